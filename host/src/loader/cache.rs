//! The private copy every plugin is loaded from.
//!
//! The router never dlopens a file in the watched directory: an operator (or a
//! half-finished `cp`) could rewrite it while it is mapped, and the dynamic
//! linker caches by path, so a new build under the old name would never be seen.
//! Each file is copied to `<stem>-<sha256 prefix>.so` in a directory only the
//! router's user can write; equal content gets an equal name, so loading the same
//! build twice is a no-op, and a new build gets a new name and a fresh mapping.
//!
//! The cache directory is checked as the plugins are (every ancestor, every
//! symlink: see [`super::trust`]) and refused if unsafe; kvhint never changes
//! the mode of a directory it did not create. Missing directories on the way
//! are created 0700, and only those.
//!
//! **Bounded.** A [persistent](CacheMode::Persistent) cache holds the copies of
//! the libraries this process has mapped, and nothing else: at start the
//! copies of earlier runs and `.incoming-*` partials a crash left are removed.
//! Libraries are never unloaded, so while it runs a process needs at most
//! `plugins.max_libraries` copies (removing the file of a mapped library would
//! not free its disk space anyway). Several routers may share one cache: each
//! holds a shared `flock` on `.lock`, and the clean-up runs only under an
//! exclusive one, i.e. when no other kvhint process uses the directory.
//!
//! A [temporary](CacheMode::Temporary) cache (what `kvhint check`, `plugins`
//! and `replay` use) is a fresh private directory under the system's temporary
//! directory, removed when the loader is dropped: those commands write nothing
//! else.

use super::LoadErrorKind;
use crate::trust::{self, effective_uid};
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Where a loader keeps its private copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CacheMode {
    /// In `cache_dir`, created if missing (what `kvhint serve` uses).
    #[default]
    Persistent,
    /// In a fresh temporary directory removed with the loader; `cache_dir` is
    /// only checked (it would be refused by `serve`), never created or written.
    Temporary,
}

#[derive(Debug)]
pub struct PluginCache {
    dir: PathBuf,
    /// Keeps a temporary cache alive; removes it on drop.
    _temporary: Option<tempfile::TempDir>,
    /// The shared lock of a persistent cache (released when closed).
    lock: Option<std::fs::File>,
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

const WHAT: &str = "plugin cache";

fn refused(dir: &Path, e: impl std::fmt::Display) -> String {
    format!(
        "the plugin cache {}: {e}; point `plugins.cache_dir` at a directory only the router's user can write (it is created 0700 if missing)",
        dir.display()
    )
}

/// Checks a cache directory that exists: it must be the router's user's own
/// and writable by no one else (root's own counts only for root).
fn check_own(dir: &Path) -> Result<(), String> {
    let meta = std::fs::metadata(dir).map_err(|e| refused(dir, e))?;
    if !meta.is_dir() {
        return Err(refused(dir, "it is not a directory"));
    }
    if meta.uid() != effective_uid() {
        return Err(refused(
            dir,
            format!(
                "it is owned by uid {}, not by the router's user (uid {})",
                meta.uid(),
                effective_uid()
            ),
        ));
    }
    Ok(())
}

/// Creates the missing directories on the way to `dir`, each 0700, and only
/// those: an existing directory's mode is never changed.
fn create_missing(dir: &Path) -> Result<(), String> {
    let mut missing = Vec::new();
    let mut at = dir;
    while std::fs::symlink_metadata(at).is_err() {
        missing.push(at.to_path_buf());
        match at.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => at = parent,
            _ => break,
        }
    }
    for path in missing.iter().rev() {
        match std::fs::DirBuilder::new().mode(0o700).create(path) {
            Ok(()) => {
                // The umask may have taken bits away; this one is ours to set.
                std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700))
                    .map_err(|e| refused(path, e))?;
            }
            // Created meanwhile by someone else: checked below like any other.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(refused(path, format!("cannot create it: {e}"))),
        }
    }
    Ok(())
}

impl PluginCache {
    /// Opens the cache: see the module docs for what each mode writes.
    pub fn open(dir: &Path, mode: CacheMode) -> Result<Self, String> {
        match mode {
            CacheMode::Temporary => {
                // What `serve` would refuse is refused here too, without
                // creating or touching anything.
                let real = trust::check_directory_to_be(dir, WHAT).map_err(|e| refused(dir, e))?;
                if real.exists() {
                    check_own(&real)?;
                }
                let temporary = tempfile::Builder::new()
                    .prefix("kvhint-cache-")
                    .tempdir()
                    .map_err(|e| {
                        format!(
                            "cannot create a temporary plugin cache in {}: {e}; set TMPDIR to a directory you can write",
                            std::env::temp_dir().display()
                        )
                    })?;
                std::fs::set_permissions(temporary.path(), std::fs::Permissions::from_mode(0o700))
                    .map_err(|e| refused(temporary.path(), e))?;
                trust::check_holder_directory(temporary.path(), WHAT)
                    .map_err(|e| refused(temporary.path(), e))?;
                Ok(Self {
                    dir: temporary.path().to_path_buf(),
                    _temporary: Some(temporary),
                    lock: None,
                })
            }
            CacheMode::Persistent => {
                // Check the way there before creating anything in it.
                trust::check_directory_to_be(dir, WHAT).map_err(|e| refused(dir, e))?;
                create_missing(dir)?;
                trust::check_holder_directory(dir, WHAT).map_err(|e| refused(dir, e))?;
                check_own(dir)?;
                let lock = std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .open(dir.join(".lock"))
                    .map_err(|e| refused(dir, format!("cannot open its .lock: {e}")))?;
                let cache = Self {
                    dir: dir.to_path_buf(),
                    _temporary: None,
                    lock: Some(lock),
                };
                cache.lock(libc::LOCK_SH)?;
                cache.prune(&[]);
                Ok(cache)
            }
        }
    }

    fn lock(&self, how: libc::c_int) -> Result<(), String> {
        let Some(file) = &self.lock else {
            return Ok(());
        };
        // SAFETY: flock on a file descriptor this struct owns.
        if unsafe { libc::flock(file.as_raw_fd(), how) } == 0 {
            Ok(())
        } else {
            Err(refused(
                &self.dir,
                format!("cannot lock it: {}", std::io::Error::last_os_error()),
            ))
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The private path of a build.
    pub fn path_for(&self, stem: &str, sha256_hex: &str) -> PathBuf {
        let prefix = sha256_hex.get(..16).unwrap_or(sha256_hex);
        self.dir.join(format!("{stem}-{prefix}.so"))
    }

    /// Removes every copy but `keep`, and every `.incoming-*` partial — only
    /// when no other process holds the cache (else it does nothing). Returns
    /// how many files were removed.
    pub fn prune(&self, keep: &[PathBuf]) -> usize {
        if self.lock.is_none() {
            return 0;
        }
        if self.lock(libc::LOCK_EX | libc::LOCK_NB).is_err() {
            // Another kvhint process uses this cache. Converting a flock is not
            // atomic, so a refused conversion may have dropped the shared
            // lock: take it again.
            let _ = self.lock(libc::LOCK_SH);
            return 0;
        }
        let mut removed = 0;
        if let Ok(entries) = std::fs::read_dir(&self.dir) {
            for entry in entries.flatten() {
                let path = entry.path();
                let name = entry.file_name();
                let name = name.to_string_lossy();
                let is_copy = is_copy_name(&name);
                let is_partial = name.starts_with(".incoming-");
                let is_file = entry.file_type().is_ok_and(|t| t.is_file());
                if is_file && (is_partial || (is_copy && !keep.contains(&path))) {
                    match std::fs::remove_file(&path) {
                        Ok(()) => removed += 1,
                        Err(e) => tracing::warn!(
                            file = %path.display(),
                            "cannot remove a stale plugin copy: {e}"
                        ),
                    }
                }
            }
        }
        if removed > 0 {
            tracing::info!(
                cache = %self.dir.display(),
                removed,
                "removed plugin copies no longer used"
            );
        }
        // Back to shared; a failure here only makes the next prune skip.
        let _ = self.lock(libc::LOCK_SH);
        removed
    }

    /// Streams `source` (at most `limit` bytes) into the cache as
    /// `<stem>-<prefix>.so`, checking that its sha256 is `sha256_hex`, and runs
    /// `check` on the private copy before it takes its final name. Returns the
    /// private path.
    pub fn store(
        &self,
        stem: &str,
        sha256_hex: &str,
        source: &mut std::fs::File,
        limit: u64,
        check: impl FnOnce(&std::fs::File, u64) -> Result<(), LoadErrorKind>,
    ) -> Result<PathBuf, LoadErrorKind> {
        let path = self.path_for(stem, sha256_hex);
        let cannot = |e: std::io::Error| {
            LoadErrorKind::Cache(format!(
                "cannot write to the plugin cache {}: {e}",
                self.dir.display()
            ))
        };
        // Write beside it and rename: a mapped older copy keeps its inode.
        let mut tmp = tempfile::Builder::new()
            .prefix(".incoming-")
            .tempfile_in(&self.dir)
            .map_err(cannot)?;
        let (len, sha256) = copy_hashing(source, tmp.as_file_mut(), limit).map_err(cannot)?;
        if sha256 != sha256_hex {
            return Err(LoadErrorKind::Cache(format!(
                "it changed while it was being read (sha256 {sha256_hex}, then {sha256}); write plugins by the drop-in protocol (a temporary name, then rename)"
            )));
        }
        tmp.as_file().sync_all().map_err(cannot)?;
        check(tmp.as_file(), len)?;
        std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o500)).map_err(
            |e| LoadErrorKind::Cache(format!("cannot set permissions in the plugin cache: {e}")),
        )?;
        tmp.persist(&path).map_err(|e| {
            LoadErrorKind::Cache(format!(
                "cannot store {} in the plugin cache: {e}",
                path.display()
            ))
        })?;
        Ok(path)
    }
}

/// Whether a file name is one [`PluginCache::store`] gives (`<stem>-<16 hex
/// digits>.so`): the clean-up removes nothing else, whatever directory it is
/// pointed at.
fn is_copy_name(name: &str) -> bool {
    let Some((stem, prefix)) = name
        .strip_suffix(".so")
        .and_then(|base| base.rsplit_once('-'))
    else {
        return false;
    };
    !stem.is_empty()
        && !stem.starts_with('.')
        && prefix.len() == 16
        && prefix
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Reads `source` to its end (at most `limit` bytes, else an error), hashing;
/// writes what it reads to `sink` when given. Returns the length and the hex
/// sha256.
pub fn copy_hashing(
    source: &mut std::fs::File,
    mut sink: impl Write,
    limit: u64,
) -> std::io::Result<(u64, String)> {
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; 256 << 10];
    let mut len = 0u64;
    loop {
        let n = match source.read(&mut buffer) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        len += n as u64;
        if len > limit {
            return Err(std::io::Error::other(format!(
                "it grew past {limit} bytes while being read"
            )));
        }
        hasher.update(&buffer[..n]);
        sink.write_all(&buffer[..n])?;
    }
    sink.flush()?;
    Ok((len, super::hex(&hasher.finalize())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_caches_own_names_are_cleaned_up() {
        assert!(is_copy_name("libkv_fetch-0123456789abcdef.so"));
        assert!(is_copy_name("my-plugin-0123456789abcdef.so"));
        assert!(!is_copy_name("libkv_fetch.so"));
        assert!(!is_copy_name("libssl-3.so"));
        assert!(!is_copy_name("libkv_fetch-0123456789ABCDEF.so"));
        assert!(!is_copy_name(".x-0123456789abcdef.so"));
    }

    #[test]
    fn an_existing_directory_keeps_its_mode() {
        let top = tempfile::tempdir().unwrap();
        let open = top.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o1777)).unwrap();
        for mode in [CacheMode::Persistent, CacheMode::Temporary] {
            assert!(PluginCache::open(&open, mode).is_err());
            let meta = std::fs::metadata(&open).unwrap();
            assert_eq!(meta.mode() & 0o7777, 0o1777);
        }
        // Created: only the missing directories, each 0700.
        let deep = top.path().join("a/b");
        std::fs::set_permissions(top.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        PluginCache::open(&deep, CacheMode::Persistent).unwrap();
        for dir in [top.path().join("a"), deep.clone()] {
            assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o7777, 0o700);
        }
        assert_eq!(
            std::fs::metadata(top.path()).unwrap().mode() & 0o7777,
            0o755
        );
    }
}
