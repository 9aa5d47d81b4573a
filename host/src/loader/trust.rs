//! Who may have written a plugin file.
//!
//! Loading a plugin runs its code inside the router. If the file, or the
//! directory it sits in, can be written by another user, that user can swap the
//! router's code. So, as sshd's StrictModes does for `authorized_keys`, a file
//! or its directory that is writable by group or others, or owned by a user
//! other than the router's own (or root), is refused.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum TrustError {
    #[error("{what} {path} is writable by group or others (mode {mode:04o}): another user could replace the router's code; run `chmod go-w {path}`")]
    Writable {
        what: &'static str,
        path: String,
        mode: u32,
    },
    #[error("{what} {path} is owned by uid {owner}, not by the router's user (uid {me}) or root; run `chown {me} {path}` or copy it to a directory you own")]
    ForeignOwner {
        what: &'static str,
        path: String,
        owner: u32,
        me: u32,
    },
    #[error("cannot inspect {path}: {reason}")]
    Unreadable { path: String, reason: String },
}

/// The effective user id of this process.
pub fn effective_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

fn check_metadata(
    what: &'static str,
    path: &Path,
    meta: &std::fs::Metadata,
) -> Result<(), TrustError> {
    let me = effective_uid();
    if meta.uid() != me && meta.uid() != 0 {
        return Err(TrustError::ForeignOwner {
            what,
            path: path.display().to_string(),
            owner: meta.uid(),
            me,
        });
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o022 != 0 {
        return Err(TrustError::Writable {
            what,
            path: path.display().to_string(),
            mode,
        });
    }
    Ok(())
}

fn check_directory(path: &Path) -> Result<(), TrustError> {
    let meta = std::fs::metadata(path).map_err(|e| TrustError::Unreadable {
        path: path.display().to_string(),
        reason: e.to_string(),
    })?;
    check_metadata("plugin directory", path, &meta)
}

/// Checks an opened plugin file — `opened` is its `fstat`, so the owner and
/// mode checked are those of the very file whose bytes are read — and the
/// directories it depends on: the one it was found in (whoever can write it
/// can plant a link to any library) and, for a symlink, its target's.
pub fn check_plugin_file(path: &Path, opened: &std::fs::Metadata) -> Result<(), TrustError> {
    check_metadata("plugin file", path, opened)?;
    let found_in = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    check_directory(found_in)?;
    let real = std::fs::canonicalize(path).map_err(|e| TrustError::Unreadable {
        path: path.display().to_string(),
        reason: e.to_string(),
    })?;
    if let Some(dir) = real.parent() {
        if dir != found_in {
            check_directory(dir)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn world_writable_file_is_refused_and_fixed_by_chmod() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("libx.so");
        std::fs::write(&file, b"x").unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o666)).unwrap();
        let err = check_plugin_file(&file, &std::fs::metadata(&file).unwrap()).unwrap_err();
        assert!(err.to_string().contains("chmod go-w"), "{err}");
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert_eq!(
            check_plugin_file(&file, &std::fs::metadata(&file).unwrap()),
            Ok(())
        );
    }

    #[test]
    fn symlink_in_a_world_writable_directory_is_refused() {
        let good = tempfile::tempdir().unwrap();
        let file = good.path().join("libx.so");
        std::fs::write(&file, b"x").unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        let open = tempfile::tempdir().unwrap();
        std::fs::set_permissions(open.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        let link = open.path().join("libx.so");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        let err = check_plugin_file(&link, &std::fs::metadata(&link).unwrap()).unwrap_err();
        assert!(
            matches!(
                err,
                TrustError::Writable {
                    what: "plugin directory",
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn group_writable_directory_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("libx.so");
        std::fs::write(&file, b"x").unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o775)).unwrap();
        let err = check_plugin_file(&file, &std::fs::metadata(&file).unwrap()).unwrap_err();
        assert!(
            matches!(
                err,
                TrustError::Writable {
                    what: "plugin directory",
                    ..
                }
            ),
            "{err}"
        );
    }
}
