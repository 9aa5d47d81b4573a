//! The private copy every plugin is loaded from.
//!
//! The router never dlopens a file in the watched directory: an operator (or a
//! half-finished `cp`) could rewrite it while it is mapped, and the dynamic
//! linker caches by path, so a new build under the old name would never be seen.
//! Each file is copied to `<stem>-<sha256 prefix>.so` in a directory only the
//! router's user can write; equal content gets an equal name, so loading the same
//! build twice is a no-op, and a new build gets a new name and a fresh mapping.

use super::trust::effective_uid;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

#[derive(Debug)]
pub struct PluginCache {
    dir: PathBuf,
}

/// Where the cache lives unless the config says otherwise.
pub fn default_cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir).join("kvhint").join("plugins");
    }
    if let Some(home) = std::env::var_os("HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(home)
            .join(".cache")
            .join("kvhint")
            .join("plugins");
    }
    std::env::temp_dir()
        .join(format!("kvhint-{}", effective_uid()))
        .join("plugins")
}

impl PluginCache {
    /// Opens (creating, mode 0700) the cache directory, and refuses one that
    /// another user owns or others can write: it holds code the router runs.
    pub fn open(dir: &Path) -> Result<Self, String> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| format!("cannot create the plugin cache {}: {e}", dir.display()))?;
        let meta = std::fs::metadata(dir)
            .map_err(|e| format!("cannot inspect the plugin cache {}: {e}", dir.display()))?;
        if meta.uid() != effective_uid() {
            return Err(format!(
                "the plugin cache {} is owned by uid {}, not by the router's user; point `plugins.cache_dir` at a directory you own",
                dir.display(),
                meta.uid()
            ));
        }
        if meta.mode() & 0o022 != 0 {
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(|e| {
                format!(
                    "the plugin cache {} is writable by others and cannot be fixed: {e}",
                    dir.display()
                )
            })?;
        }
        Ok(Self {
            dir: dir.to_path_buf(),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Stores `bytes` (whose sha256 is `sha256_hex`) and returns the private path.
    pub fn store(&self, stem: &str, sha256_hex: &str, bytes: &[u8]) -> Result<PathBuf, String> {
        let prefix = sha256_hex.get(..16).unwrap_or(sha256_hex);
        let path = self.dir.join(format!("{stem}-{prefix}.so"));
        if let Ok(existing) = std::fs::read(&path) {
            if existing == bytes {
                return Ok(path);
            }
        }
        // Write beside it and rename: a mapped older copy keeps its inode.
        let mut tmp = tempfile::Builder::new()
            .prefix(".incoming-")
            .tempfile_in(&self.dir)
            .map_err(|e| {
                format!(
                    "cannot write to the plugin cache {}: {e}",
                    self.dir.display()
                )
            })?;
        tmp.write_all(bytes)
            .and_then(|()| tmp.as_file().sync_all())
            .map_err(|e| {
                format!(
                    "cannot write to the plugin cache {}: {e}",
                    self.dir.display()
                )
            })?;
        std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o500))
            .map_err(|e| format!("cannot set permissions in the plugin cache: {e}"))?;
        tmp.persist(&path)
            .map_err(|e| format!("cannot store {} in the plugin cache: {e}", path.display()))?;
        Ok(path)
    }
}
