//! Where things are: the workspace, its target directory, the harness's own
//! build directory under it, and the private temporary directories every test
//! works in.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use tempfile::TempDir;

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ lives in the workspace root")
        .to_path_buf()
}

pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target"))
}

/// Where the harness builds. Not the workspace's own target directory: a build
/// started from inside a running `cargo test` can rewrite rlibs that the same
/// `cargo test` later links doctests against (rustc's E0460), so the harness
/// keeps its artefacts apart, as trybuild does.
pub fn e2e_target_dir() -> PathBuf {
    target_dir().join("e2e")
}

/// A fresh directory only this user can write (what the loader requires).
pub fn private_dir() -> TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    dir
}
