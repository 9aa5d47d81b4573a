//! Who may have written a plugin file, or the cache it is copied to.
//!
//! Loading a plugin runs its code inside the router. If the file, the
//! directory it sits in, **any ancestor of that directory**, or any directory a
//! symlink on the way passes through can be written by another user, that user
//! can swap the router's code (replace the file, or rename a whole directory
//! and put one of their own in its place). So, as sshd's StrictModes does for
//! `authorized_keys`, the path is resolved one component at a time, following
//! symlinks the way the kernel does, and every directory traversed must be
//! owned by root or the router's user and not writable by group or others.
//!
//! One exception, also sshd's: a root-owned directory with the sticky bit (the
//! system's temporary directory, mode 1777) may be an ancestor, because there
//! others may add entries but not rename or remove ours. It is never accepted
//! as the directory that holds the plugins (or the cache) itself: there anyone
//! could add a `lib*.so`.
//!
//! A leaf with the domain at the bottom of the layers, not part of the loader: the
//! loader checks plugin files and its cache with it, the config its token files.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};

#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum TrustError {
    #[error("{what} {path} is writable by group or others (mode {mode:04o}, owner uid {owner}): another user could {stake}; run `chmod go-w {path}`, or move {moved} somewhere only you and root can write")]
    Writable {
        what: &'static str,
        path: String,
        mode: u32,
        owner: u32,
        /// What another user could do with it.
        stake: &'static str,
        /// What to move elsewhere.
        moved: &'static str,
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
    #[error("{path} passes through more than {MAX_LINKS} symlinks (a loop?); point the config at the real path")]
    TooManyLinks { path: String },
    #[error("{path} changed while it was being checked (it no longer resolves to the file that was opened); write plugins by the drop-in protocol (a temporary name, then rename) and retry")]
    Changed { path: String },
}

/// As Linux's `MAXSYMLINKS`.
const MAX_LINKS: usize = 40;

/// The effective user id of this process.
pub fn effective_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// What a directory on a path is to the thing being checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// Passed through on the way (an ancestor, or a directory a symlink
    /// passes through): a root-owned sticky directory is accepted.
    Ancestor,
    /// The directory that holds the plugin file or the cache's copies: no
    /// exception.
    Holder,
}

fn check_metadata(
    what: &'static str,
    path: &Path,
    meta: &std::fs::Metadata,
    role: Role,
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
    let root_sticky = meta.uid() == 0 && mode & libc::S_ISVTX != 0;
    if mode & 0o022 != 0 && !(role == Role::Ancestor && meta.is_dir() && root_sticky) {
        let (stake, moved) = stake(what);
        return Err(TrustError::Writable {
            what,
            path: path.display().to_string(),
            mode,
            owner: meta.uid(),
            stake,
            moved,
        });
    }
    Ok(())
}

/// What the thing checked is for, for the message: the plugins' and the cache's
/// files are the router's code; a token file decides who may call it.
fn stake(what: &'static str) -> (&'static str, &'static str) {
    if what.starts_with("token") {
        ("choose the router's API tokens", "the token file")
    } else {
        ("replace the router's code", "the plugins")
    }
}

fn unreadable(path: &Path, e: std::io::Error) -> TrustError {
    TrustError::Unreadable {
        path: path.display().to_string(),
        reason: e.to_string(),
    }
}

/// Resolves `path` one component at a time, as the kernel does, checking
/// every directory it passes through (`/` included) as an ancestor. Returns the
/// resolved path, which is not a symlink (it may not exist, if `missing_ok`:
/// then the rest of the path is appended unresolved, as it would be created).
fn resolve_checked(
    path: &Path,
    what: &'static str,
    missing_ok: bool,
) -> Result<PathBuf, TrustError> {
    let absolute = if path.is_absolute() {
        path.to_path_buf()
    } else {
        // getcwd is the real path of the working directory.
        std::env::current_dir()
            .map_err(|e| unreadable(Path::new("."), e))?
            .join(path)
    };
    let mut pending: VecDeque<OsString> = VecDeque::new();
    push_front(&mut pending, &absolute);
    let mut resolved = PathBuf::from("/");
    check_directory(what, &resolved, Role::Ancestor)?;
    let mut links = 0;
    while let Some(part) = pending.pop_front() {
        match part.to_str() {
            Some("/") => {
                resolved = PathBuf::from("/");
                continue;
            }
            Some(".") => continue,
            Some("..") => {
                // `resolved` has no symlinks in it, so its parent is the real `..`.
                resolved.pop();
                continue;
            }
            _ => {}
        }
        let candidate = resolved.join(&part);
        let meta = match std::fs::symlink_metadata(&candidate) {
            Ok(meta) => meta,
            Err(e) if missing_ok && e.kind() == std::io::ErrorKind::NotFound => {
                let mut rest = candidate;
                for part in pending {
                    rest.push(part);
                }
                return Ok(rest);
            }
            Err(e) => return Err(unreadable(&candidate, e)),
        };
        if meta.file_type().is_symlink() {
            links += 1;
            if links > MAX_LINKS {
                return Err(TrustError::TooManyLinks {
                    path: path.display().to_string(),
                });
            }
            let target = std::fs::read_link(&candidate).map_err(|e| unreadable(&candidate, e))?;
            // Relative targets resolve against the link's directory, which is
            // `resolved` (already checked); absolute ones restart at `/`.
            push_front(&mut pending, &target);
            continue;
        }
        resolved = candidate;
        if meta.is_dir() && !pending.is_empty() {
            check_metadata(what, &resolved, &meta, Role::Ancestor)?;
        }
    }
    Ok(resolved)
}

fn push_front(pending: &mut VecDeque<OsString>, path: &Path) {
    for component in path.components().rev() {
        let part = match component {
            Component::RootDir => OsString::from("/"),
            Component::CurDir => OsString::from("."),
            Component::ParentDir => OsString::from(".."),
            Component::Normal(name) => name.to_os_string(),
            Component::Prefix(_) => continue,
        };
        pending.push_front(part);
    }
}

fn check_directory(what: &'static str, path: &Path, role: Role) -> Result<(), TrustError> {
    let meta = std::fs::metadata(path).map_err(|e| unreadable(path, e))?;
    check_metadata(what, path, &meta, role)
}

/// Checks a directory that holds plugins or the cache's copies: every
/// directory on its path (through any symlinks) as an ancestor, and the
/// directory it resolves to with no exception. Returns the resolved path.
pub fn check_holder_directory(dir: &Path, what: &'static str) -> Result<PathBuf, TrustError> {
    let real = resolve_checked(dir, what, false)?;
    check_directory(what, &real, Role::Holder)?;
    Ok(real)
}

/// Checks the directories on the way to `dir`, which may not exist yet:
/// every existing one on its path as an ancestor, and `dir` itself, if it
/// exists, as the holder. Writes nothing. Returns the resolved path (its
/// missing tail unresolved).
pub fn check_directory_to_be(dir: &Path, what: &'static str) -> Result<PathBuf, TrustError> {
    let real = resolve_checked(dir, what, true)?;
    match std::fs::symlink_metadata(&real) {
        Ok(meta) => check_metadata(what, &real, &meta, Role::Holder)?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(unreadable(&real, e)),
    }
    Ok(real)
}

/// Checks an opened plugin file — `opened` is its `fstat`, so the owner and
/// mode checked are those of the very file whose bytes are read — and every
/// directory it depends on: the ones on the way to where it was found, every
/// directory a symlink chain passes through, and the directory the file really
/// lives in. The path must still resolve to the opened file.
pub fn check_plugin_file(path: &Path, opened: &std::fs::Metadata) -> Result<(), TrustError> {
    check_file(path, opened, "plugin file", "plugin directory")
}

/// Checks an opened token file (`auth.*_token_file`) as a plugin file is
/// checked: whoever can write it, replace it, or rename a directory on its way
/// chooses the tokens the router takes at its next reload.
pub fn check_token_file(path: &Path, opened: &std::fs::Metadata) -> Result<(), TrustError> {
    check_file(path, opened, "token file", "token file's directory")
}

fn check_file(
    path: &Path,
    opened: &std::fs::Metadata,
    file_what: &'static str,
    dir_what: &'static str,
) -> Result<(), TrustError> {
    check_metadata(file_what, path, opened, Role::Holder)?;
    let found_in = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    // Whoever can write the directory it was found in can plant a link to any
    // file, so that one is a holder too, even when the file is a symlink.
    check_holder_directory(found_in, dir_what)?;
    let real = resolve_checked(path, dir_what, false)?;
    let lives_in = real.parent().unwrap_or(Path::new("/"));
    check_directory(dir_what, lives_in, Role::Holder)?;
    let now = std::fs::metadata(&real).map_err(|e| unreadable(&real, e))?;
    if now.dev() != opened.dev() || now.ino() != opened.ino() {
        return Err(TrustError::Changed {
            path: path.display().to_string(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn chmod(path: &Path, mode: u32) {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    fn private() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        chmod(dir.path(), 0o700);
        dir
    }

    #[test]
    fn world_writable_file_is_refused_and_fixed_by_chmod() {
        let dir = private();
        let file = dir.path().join("libx.so");
        std::fs::write(&file, b"x").unwrap();
        chmod(&file, 0o666);
        let err = check_plugin_file(&file, &std::fs::metadata(&file).unwrap()).unwrap_err();
        assert!(err.to_string().contains("chmod go-w"), "{err}");
        chmod(&file, 0o644);
        assert_eq!(
            check_plugin_file(&file, &std::fs::metadata(&file).unwrap()),
            Ok(())
        );
    }

    #[test]
    fn symlink_in_a_world_writable_directory_is_refused() {
        let good = private();
        let file = good.path().join("libx.so");
        std::fs::write(&file, b"x").unwrap();
        chmod(&file, 0o644);
        let open = private();
        chmod(open.path(), 0o777);
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
        let dir = private();
        let file = dir.path().join("libx.so");
        std::fs::write(&file, b"x").unwrap();
        chmod(dir.path(), 0o775);
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

    #[test]
    fn every_ancestor_is_checked() {
        let top = private();
        let deep = top.path().join("a/b/c");
        std::fs::create_dir_all(&deep).unwrap();
        for dir in ["a", "a/b", "a/b/c"] {
            chmod(&top.path().join(dir), 0o755);
        }
        let file = deep.join("libx.so");
        std::fs::write(&file, b"x").unwrap();
        chmod(&file, 0o644);
        let meta = std::fs::metadata(&file).unwrap();
        assert_eq!(check_plugin_file(&file, &meta), Ok(()));
        chmod(&top.path().join("a"), 0o777);
        let err = check_plugin_file(&file, &meta).unwrap_err();
        match &err {
            TrustError::Writable { path, mode, .. } => {
                assert_eq!(Path::new(path), top.path().join("a"));
                assert_eq!(*mode, 0o777);
            }
            other => panic!("{other}"),
        }
        // Root-owned and sticky, as /tmp: acceptable as an ancestor only.
        chmod(&top.path().join("a"), 0o1777);
        if effective_uid() == 0 {
            assert_eq!(check_plugin_file(&file, &meta), Ok(()));
        }
        chmod(&deep, 0o1777);
        assert!(check_plugin_file(&file, &meta).is_err());
    }

    #[test]
    fn a_symlinked_ancestor_is_followed_and_its_target_checked() {
        let top = private();
        let real = top.path().join("open/real");
        std::fs::create_dir_all(&real).unwrap();
        chmod(&real, 0o755);
        chmod(&top.path().join("open"), 0o777);
        let file = real.join("libx.so");
        std::fs::write(&file, b"x").unwrap();
        chmod(&file, 0o644);
        let safe = top.path().join("safe");
        std::fs::create_dir(&safe).unwrap();
        chmod(&safe, 0o755);
        // safe/link -> ../open/real: the file's path looks safe, the chain is not.
        std::os::unix::fs::symlink("../open/real", safe.join("link")).unwrap();
        let via = safe.join("link/libx.so");
        let err = check_plugin_file(&via, &std::fs::metadata(&via).unwrap()).unwrap_err();
        match &err {
            TrustError::Writable { path, .. } => assert!(path.ends_with("/open"), "{err}"),
            other => panic!("{other}"),
        }
    }

    #[test]
    fn a_symlink_loop_is_an_error_not_a_hang() {
        let top = private();
        std::os::unix::fs::symlink("b", top.path().join("a")).unwrap();
        std::os::unix::fs::symlink("a", top.path().join("b")).unwrap();
        let err = check_holder_directory(&top.path().join("a"), "plugin directory").unwrap_err();
        assert!(matches!(err, TrustError::TooManyLinks { .. }), "{err}");
    }

    #[test]
    fn a_directory_to_be_is_checked_without_being_created() {
        let top = private();
        let wanted = top.path().join("x/y");
        assert_eq!(
            check_directory_to_be(&wanted, "plugin cache"),
            Ok(top.path().canonicalize().unwrap().join("x/y"))
        );
        assert!(!top.path().join("x").exists());
        chmod(top.path(), 0o777);
        assert!(check_directory_to_be(&wanted, "plugin cache").is_err());
    }
}
