//! The plugins the tests load: the fixture `.so` files (and the `kvhint`
//! binary) built once per test process, plugin directories and the drop-in
//! protocol, the example tree, and the registry, loader and snapshot builders
//! that load them in-process.
//!
//! Fixtures in the workspace (`plugins/*`, `tests/fixtures/plugins/*`) are built
//! with one `cargo build` into `target/e2e/` (apart from the outer build, see
//! [`e2e_target_dir`]). The two fixtures that need a build of their own —
//! `panic = "abort"`, and a plugin built against the released plugin-api 0.1.0
//! (vendored in `tests/fixtures/plugin-api-0.1/`) — are generated as standalone
//! workspaces under `target/fixture-standalone/`.

use crate::paths::{e2e_target_dir, private_dir, target_dir, workspace_root};
use crate::process::progress;
use crate::provision;
use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};
use tempfile::TempDir;

/// The crates whose `.so` (and binary) the tests load.
const WORKSPACE_ARTIFACTS: &[&str] = &[
    "kvhint",
    "kv-fetch",
    "kvhint-selection",
    "harness-prefetch",
    "session-affinity",
    "fixture-misbehaving",
    "fixture-duplicate-type",
    "fixture-no-root-module",
    "fixture-hot-add",
    "fixture-versioned-v1",
    "fixture-versioned-v2",
    "fixture-raw-abi",
    "fixture-ctor-abort",
    "fixture-ctor-impersonate",
    "fixture-ctor-fork",
];

fn cargo() -> Command {
    Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

/// The longest a cargo build of fixtures may take (a first build on two busy
/// cores takes minutes, not an hour).
const BUILD_BOUND: Duration = Duration::from_secs(60 * 60);

/// Runs a cargo build, passing cargo's own progress lines (`Compiling …`) through
/// to stderr as they come, with a heartbeat (elapsed time) while cargo is quiet,
/// and a line when it ends.
fn run(mut command: Command, what: &str) {
    let started = Instant::now();
    progress(&format!(
        "building {what} with cargo (a first build takes minutes; later runs reuse it)"
    ));
    let shown = |line: &str| {
        [
            "Compiling",
            "Finished",
            "Downloaded",
            "error",
            "warning: unused",
        ]
        .iter()
        .any(|p| line.starts_with(p))
    };
    if let Err(failure) = provision::run_with_progress(
        &mut command,
        &format!("building {what}"),
        shown,
        BUILD_BOUND,
    ) {
        panic!("building {what} failed: {failure}");
    }
    progress(&format!(
        "built {what} in {} s",
        started.elapsed().as_secs()
    ));
}

fn build_artifacts(release: bool) -> PathBuf {
    let mut command = cargo();
    command
        .arg("build")
        .current_dir(workspace_root())
        .env("CARGO_TARGET_DIR", e2e_target_dir());
    if release {
        command.arg("--release");
    }
    for package in WORKSPACE_ARTIFACTS {
        command.args(["-p", package]);
    }
    run(command, "the test plugins");
    e2e_target_dir().join(if release { "release" } else { "debug" })
}

/// The tokens [`examples_copy`] writes into `examples/tokens/`, by caller class.
pub const EXAMPLE_TOKENS: [(&str, &str); 3] = [
    ("admin", "0b7f4e2a9c1d8e3f5a6b7c8d9e0f1a2b"),
    ("worker", "5d3c2b1a0f9e8d7c6b5a4f3e2d1c0b9a"),
    ("client", "9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c4d"),
];

/// A copy of `examples/` laid out as in the repository, with the example
/// plugin where the example config expects a `cargo build` to leave it
/// (`../target/debug/libharness_prefetch.so`), so the example files are used
/// verbatim, and the token files `examples/serve.yaml` reads.
pub fn examples_copy() -> TempDir {
    let root = private_dir();
    copy_tree(
        &workspace_root().join("examples"),
        &root.path().join("examples"),
    );
    // The README's step before serving `examples/serve.yaml`: a private token
    // file per caller class.
    let tokens = root.path().join("examples/tokens");
    std::fs::create_dir_all(&tokens).unwrap();
    for (who, token) in EXAMPLE_TOKENS {
        let file = tokens.join(format!("{who}.token"));
        std::fs::write(&file, format!("{token}\n")).unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let debug = root.path().join("target/debug");
    std::fs::create_dir_all(&debug).unwrap();
    std::fs::copy(
        plugin_so("harness_prefetch"),
        debug.join("libharness_prefetch.so"),
    )
    .unwrap();
    root
}

/// `target/e2e/debug` (see [`e2e_target_dir`]), after building every workspace
/// artefact the tests use.
pub fn build_dir() -> &'static Path {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| build_artifacts(false))
}

/// `target/e2e/release`, after building the same artefacts optimised — what
/// benchmarks load, so a plugin and the host are built with the same profile.
pub fn release_dir() -> &'static Path {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| build_artifacts(true))
}

/// The `.so` of a workspace crate, by library name (`kv_fetch`, `fixture_misbehaving`).
pub fn plugin_so(lib_name: &str) -> PathBuf {
    let path = build_dir().join(format!("lib{lib_name}.so"));
    assert!(path.is_file(), "{} was not built", path.display());
    path
}

/// The `kvhint` binary.
pub fn kvhint_bin() -> PathBuf {
    build_dir().join("kvhint")
}

/// A standalone fixture's `.so`: `"panic-abort"` (the current plugin-api, built
/// with `panic = "abort"`) or `"old-api"` (built against kvhint-plugin-api
/// 0.1.0, the copy in `tests/fixtures/plugin-api-0.1/`).
pub fn standalone_so(name: &str) -> PathBuf {
    static BUILT: OnceLock<Mutex<HashMap<String, PathBuf>>> = OnceLock::new();
    let built = BUILT.get_or_init(Default::default);
    let mut built = built.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(path) = built.get(name) {
        return path.clone();
    }
    let path = build_standalone(name);
    built.insert(name.to_string(), path.clone());
    path
}

fn build_standalone(name: &str) -> PathBuf {
    let root = workspace_root();
    let base = target_dir().join("fixture-standalone");
    let crate_dir = base.join(name);
    let src = crate_dir.join("src");
    std::fs::create_dir_all(&src).unwrap();
    let (source, api_path, profile) = match name {
        "panic-abort" => (
            "panic_abort.rs",
            root.join("plugin-api"),
            "[profile.dev]\npanic = \"abort\"\n",
        ),
        "old-api" => ("old_api.rs", root.join("tests/fixtures/plugin-api-0.1"), ""),
        other => panic!("unknown standalone fixture {other}"),
    };
    std::fs::copy(
        root.join("tests/fixtures/standalone").join(source),
        src.join("lib.rs"),
    )
    .unwrap();
    let lib = format!("fixture_{}", name.replace('-', "_"));
    std::fs::write(
        crate_dir.join("Cargo.toml"),
        format!(
            "[package]\nname = \"{lib}\"\nversion = \"0.1.0\"\nedition = \"2021\"\n\n\
             [lib]\ncrate-type = [\"cdylib\"]\n\n\
             [dependencies]\nkvhint-plugin-api = {{ path = {api:?} }}\n\n\
             {profile}\n[workspace]\n",
            api = api_path.display().to_string(),
        ),
    )
    .unwrap();
    // The workspace's lock file pins the same dependency versions, so this build
    // needs nothing the workspace build did not already fetch.
    if !crate_dir.join("Cargo.lock").exists() {
        std::fs::copy(root.join("Cargo.lock"), crate_dir.join("Cargo.lock")).unwrap();
    }
    let mut command = cargo();
    command
        .arg("build")
        .current_dir(&crate_dir)
        .env("CARGO_TARGET_DIR", base.join("target"));
    run(command, &format!("the standalone fixture {name}"));
    base.join("target/debug").join(format!("lib{lib}.so"))
}

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// A private plugins directory holding copies of the given files.
pub fn plugins_dir_with(files: &[PathBuf]) -> TempDir {
    let dir = private_dir();
    for file in files {
        let name = file.file_name().unwrap();
        let target = dir.path().join(name);
        std::fs::copy(file, &target).unwrap();
        std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    dir
}

/// Writes `bytes` to `path` by the drop-in protocol: a temporary dotfile in
/// the same directory, then a rename, so a watcher never sees a partial file.
pub fn drop_in(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let tmp = path.with_file_name(format!(".{name}.tmp"));
    std::fs::write(&tmp, bytes)?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o644))?;
    std::fs::rename(&tmp, path)
}

/// A registry holding only the hint types of the given plugins (library names,
/// e.g. `kv_fetch`, found in `dir`), loaded from private copies through a
/// loader with a private cache. Keep the returned loader and directory alive
/// as long as the registry.
pub fn registry_of(
    libs: &[&str],
    dir: &Path,
) -> (kvhint::registry::Registry, kvhint::loader::Loader, TempDir) {
    let private = private_dir();
    let files: Vec<kvhint::catalog::PluginFile> = libs
        .iter()
        .map(|name| {
            let copy = private.path().join(format!("lib{name}.so"));
            std::fs::copy(dir.join(format!("lib{name}.so")), &copy).unwrap();
            std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o644)).unwrap();
            kvhint::catalog::PluginFile {
                path: copy,
                sha256: None,
            }
        })
        .collect();
    let loader = kvhint::loader::Loader::new(&kvhint::loader::LoaderOptions {
        cache_dir: private.path().join("cache"),
        max_libraries: 64,
        probe: probe_beside(dir),
        ..Default::default()
    })
    .unwrap();
    let mut registry = kvhint::registry::Registry::new();
    for report in kvhint::catalog::load_into(&loader, &mut registry, &files) {
        report.result.unwrap_or_else(|e| panic!("{e:?}"));
    }
    (registry, loader, private)
}

/// The probe the harness's loaders run: the `kvhint` binary built beside the
/// plugins they load (it is one of the artefacts), named without building
/// anything, so a loader that never loads a plugin never builds.
fn probe_beside(dir: &Path) -> kvhint::loader::ProbeMode {
    kvhint::loader::ProbeMode::Reexec(dir.join("kvhint"))
}

/// A loader with its own private cache.
pub fn loader() -> (kvhint::loader::Loader, TempDir) {
    let cache = private_dir();
    let loader = kvhint::loader::Loader::new(&kvhint::loader::LoaderOptions {
        cache_dir: cache.path().join("cache"),
        max_libraries: 64,
        probe: probe_beside(&e2e_target_dir().join("debug")),
        ..Default::default()
    })
    .unwrap();
    (loader, cache)
}

/// A config file written to a private directory, with `{so:NAME}` in the text
/// replaced by the path of a private copy of `libNAME.so`.
pub struct ConfigFixture {
    pub dir: TempDir,
    pub path: PathBuf,
}

pub fn config_file(yaml: &str) -> ConfigFixture {
    let dir = private_dir();
    let mut text = yaml.to_string();
    while let Some(start) = text.find("{so:") {
        let end = start + text[start..].find('}').expect("closing brace");
        let name = text[start + 4..end].to_string();
        let copy = dir.path().join(format!("lib{name}.so"));
        if !copy.exists() {
            std::fs::copy(plugin_so(&name), &copy).unwrap();
            std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o644)).unwrap();
        }
        text.replace_range(start..=end, &copy.display().to_string());
    }
    let path = dir.path().join("kvhint.yaml");
    std::fs::write(&path, text).unwrap();
    ConfigFixture { dir, path }
}

/// Parses a config and builds its snapshot, as `kvhint check` does.
pub fn snapshot_of(
    fixture: &ConfigFixture,
    mode: Option<kvhint::config::RouterMode>,
) -> Result<(kvhint::snapshot::Snapshot, kvhint::loader::Loader), kvhint::config::ConfigErrors> {
    let config = kvhint::config::load(&fixture.path)?;
    let loader = kvhint::loader::Loader::new(&kvhint::loader::LoaderOptions {
        cache_dir: fixture.dir.path().join("cache"),
        max_libraries: 64,
        probe: probe_beside(&e2e_target_dir().join("debug")),
        ..Default::default()
    })
    .unwrap();
    let snapshot = kvhint::snapshot::build(
        &config,
        &kvhint::snapshot::BuildOptions {
            loader: &loader,
            mode,
            generation: 1,
            fixed: None,
            policy_stats: None,
            tokenizers: None,
        },
    )?;
    Ok((snapshot, loader))
}

/// The benchmarks' fleet: a decode role under `kvcr` (multiplier 1.0, so bookings
/// commit peers' copies and the built-in `kv_fetch` sends them), block size 16.
pub fn kvcr_snapshot() -> (
    kvhint::snapshot::Snapshot,
    kvhint::loader::Loader,
    ConfigFixture,
) {
    let fixture = config_file(
        "router: {block_size: 16}\nworker_selection:\n  decode:\n    type: kvcr\n    parameters: {shared_cache_multiplier: 1.0}\n",
    );
    let (snapshot, loader) = snapshot_of(&fixture, None).expect("config builds");
    (snapshot, loader, fixture)
}
