//! Opening a library in a child process first.
//!
//! `dlopen` runs a library's constructors (`.init_array`) before it returns,
//! and no check on the file's bytes can tell what they do. A constructor that
//! calls `abort()`, dereferences null or never returns would take the router
//! down (or hang its reload) inside `dlopen`. So before the router opens a
//! private copy, a child process — the router re-executing itself as
//! `kvhint __probe-plugin FILE` — opens it and reads its root module, the same
//! steps the router takes, and prints one line:
//!
//! ```text
//! kvhint-probe {"result":"loaded","name":"kv-fetch",...}
//! ```
//!
//! Only when the child exits 0 with a `loaded` line does the router open the
//! file itself. A child killed by a signal, exiting otherwise, printing no such
//! line or outliving its timeout (then it is killed) becomes a refusal that
//! names the file and what happened. A refusal the child found itself (no root
//! module, wrong ABI, `panic = "abort"`) comes back as the same error the
//! router would have given, and the library is never mapped in the router.

use super::{LoadErrorKind, PluginInfo};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The hidden subcommand the router re-executes itself with.
pub const SUBCOMMAND: &str = "__probe-plugin";
/// What the child's answer line starts with.
const MARKER: &str = "kvhint-probe ";

/// How a loader makes sure a library's initialisation cannot kill the router.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ProbeMode {
    /// Re-execute the running program (`/proc/self/exe`, so a binary replaced
    /// on disk still probes with itself) as `PROGRAM __probe-plugin FILE`.
    /// The default, and what the `kvhint` binary always uses. In a program
    /// that is not `kvhint` (a test or bench binary using the library), the
    /// child gives no answer line and every plugin is refused, saying so:
    /// safe, but set [`ProbeMode::Reexec`] or [`ProbeMode::Off`] there.
    #[default]
    CurrentExe,
    /// Run this `kvhint` binary as the probe.
    Reexec(PathBuf),
    /// Open libraries in this process without a probe: a library that aborts
    /// in a constructor kills the process. For in-process benchmarks and tests
    /// only.
    Off,
}

/// The child's answer, one JSON object after [`MARKER`].
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
#[serde(tag = "result", rename_all = "snake_case")]
enum Answer {
    Loaded {
        name: String,
        version: String,
        api_version: String,
        abi_version: u32,
    },
    Dlopen {
        detail: String,
    },
    NoRootModule {
        detail: String,
    },
    IncompatibleApi {
        plugin: String,
        host: String,
        series: String,
    },
    AbiMismatch {
        detail: String,
    },
    AbiVersion {
        plugin: u32,
    },
    PanicAbort,
    /// A kind the child should never produce; kept as text.
    Other {
        detail: String,
    },
}

impl Answer {
    fn of(opened: &Result<PluginInfo, LoadErrorKind>) -> Self {
        match opened {
            Ok(info) => Answer::Loaded {
                name: info.name.clone(),
                version: info.version.clone(),
                api_version: info.api_version.clone(),
                abi_version: info.abi_version,
            },
            Err(kind) => match kind.clone() {
                LoadErrorKind::Dlopen(detail) => Answer::Dlopen { detail },
                LoadErrorKind::NoRootModule(detail) => Answer::NoRootModule { detail },
                LoadErrorKind::IncompatibleApi {
                    plugin,
                    host,
                    series,
                } => Answer::IncompatibleApi {
                    plugin,
                    host,
                    series,
                },
                LoadErrorKind::AbiMismatch(detail) => Answer::AbiMismatch { detail },
                LoadErrorKind::AbiVersion { plugin } => Answer::AbiVersion { plugin },
                LoadErrorKind::PanicAbort => Answer::PanicAbort,
                other => Answer::Other {
                    detail: other.to_string(),
                },
            },
        }
    }

    fn into_result(self) -> Result<PluginInfo, LoadErrorKind> {
        match self {
            Answer::Loaded {
                name,
                version,
                api_version,
                abi_version,
            } => Ok(PluginInfo {
                name,
                version,
                api_version,
                abi_version,
            }),
            Answer::Dlopen { detail } => Err(LoadErrorKind::Dlopen(detail)),
            Answer::NoRootModule { detail } => Err(LoadErrorKind::NoRootModule(detail)),
            Answer::IncompatibleApi {
                plugin,
                host,
                series,
            } => Err(LoadErrorKind::IncompatibleApi {
                plugin,
                host,
                series,
            }),
            Answer::AbiMismatch { detail } => Err(LoadErrorKind::AbiMismatch(detail)),
            Answer::AbiVersion { plugin } => Err(LoadErrorKind::AbiVersion { plugin }),
            Answer::PanicAbort => Err(LoadErrorKind::PanicAbort),
            Answer::Other { detail } => Err(LoadErrorKind::ProbeFailed {
                what: format!("the probe refused it: {detail}"),
            }),
        }
    }
}

/// The child's side: opens `file` as the router would and returns the answer
/// line to print. Only reached through the hidden subcommand.
pub fn child(file: &Path) -> String {
    // A library that crashes here is expected to: leave no core file behind
    // (`check` and `plugins` write nothing), whatever the shell's `ulimit -c`.
    // SAFETY: plain system calls on this process, with valid arguments.
    unsafe {
        let none = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        libc::setrlimit(libc::RLIMIT_CORE, &none);
        libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0);
    }
    let opened = super::dlopen(file)
        .and_then(|()| super::read_root_module(file))
        .map(|(_, info)| info);
    let answer = serde_json::to_string(&Answer::of(&opened))
        .unwrap_or_else(|e| format!("{{\"result\":\"other\",\"detail\":\"{e}\"}}"));
    format!("{MARKER}{answer}")
}

/// Whether a refusal by the probe follows from the file's content alone, so
/// the same build need not be probed again. A failure to start the probe, a
/// timeout, a kill from outside (SIGKILL: the OOM killer) or a dynamic-linker
/// error (a dependency may be installed meanwhile) is tried again next time.
pub(crate) fn is_lasting(kind: &LoadErrorKind) -> bool {
    match kind {
        LoadErrorKind::ProbeCrashed { signal, .. } => !signal.starts_with("SIGKILL"),
        LoadErrorKind::NoRootModule(_)
        | LoadErrorKind::IncompatibleApi { .. }
        | LoadErrorKind::AbiMismatch(_)
        | LoadErrorKind::AbiVersion { .. }
        | LoadErrorKind::PanicAbort => true,
        _ => false,
    }
}

/// The name of a signal, as `kill -l` gives it.
fn signal_name(signal: i32) -> String {
    let name = match signal {
        libc::SIGABRT => "SIGABRT",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGBUS => "SIGBUS",
        libc::SIGILL => "SIGILL",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGTERM => "SIGTERM",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGSYS => "SIGSYS",
        _ => return format!("signal {signal}"),
    };
    format!("{name} (signal {signal})")
}

/// Reads at most `keep` bytes of a pipe to its end (the rest is discarded, so a
/// chatty child never blocks on a full pipe).
fn drain(mut pipe: impl Read + Send + 'static, keep: usize) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut kept = Vec::new();
        let mut buffer = [0u8; 8192];
        loop {
            match pipe.read(&mut buffer) {
                Ok(0) => break,
                Ok(n) => {
                    let room = keep.saturating_sub(kept.len());
                    kept.extend_from_slice(&buffer[..n.min(room)]);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        kept
    })
}

/// The last lines of what the child wrote to stderr, for the error message.
fn tail(stderr: &[u8]) -> String {
    let text = String::from_utf8_lossy(stderr);
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let start = lines.len().saturating_sub(3);
    let joined = lines[start..].join(" / ");
    if joined.is_empty() {
        String::new()
    } else {
        format!(" (it wrote: {joined})")
    }
}

/// The router's side: runs the probe on `file` (a private copy) and returns
/// what the child found, or why the file must not be opened.
pub fn run(
    mode: &ProbeMode,
    file: &Path,
    timeout: Duration,
) -> Option<Result<PluginInfo, LoadErrorKind>> {
    let program = match mode {
        ProbeMode::Off => return None,
        ProbeMode::Reexec(program) => program.clone(),
        ProbeMode::CurrentExe => {
            let proc_exe = Path::new("/proc/self/exe");
            if proc_exe.exists() {
                proc_exe.to_path_buf()
            } else {
                match std::env::current_exe() {
                    Ok(exe) => exe,
                    Err(e) => {
                        return Some(Err(LoadErrorKind::ProbeFailed {
                            what: format!(
                                "the probe cannot start: the router cannot find its own executable ({e})"
                            ),
                        }))
                    }
                }
            }
        }
    };
    Some(run_child(&program, file, timeout))
}

fn run_child(program: &Path, file: &Path, timeout: Duration) -> Result<PluginInfo, LoadErrorKind> {
    let failed = |what: String| LoadErrorKind::ProbeFailed { what };
    let mut child = Command::new(program)
        .arg(SUBCOMMAND)
        .arg(file)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // The child logs only problems, whatever the router's own level.
        .env("KVHINT_LOG", "warn")
        .spawn()
        .map_err(|e| {
            failed(format!(
                "the probe ({} {SUBCOMMAND}) cannot start: {e}",
                program.display()
            ))
        })?;
    let stdout = child.stdout.take().map(|p| drain(p, 64 << 10));
    let stderr = child.stderr.take().map(|p| drain(p, 16 << 10));
    let deadline = Instant::now() + timeout;
    // Polled, so the child is reaped by this thread alone (a kill can never
    // hit a recycled pid); at most 1 ms late, and a probe takes a few ms.
    let mut pause = Duration::from_micros(100);
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Some(status),
            Ok(None) if Instant::now() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            Ok(None) => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(1));
            }
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(failed(format!("the probe could not be waited for: {e}")));
            }
        }
    };
    // A process the library forked may hold the pipes open: wait for the
    // readers only until the deadline, never for good.
    let collect = |h: Option<std::thread::JoinHandle<Vec<u8>>>| {
        let h = h?;
        while !h.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        if h.is_finished() {
            h.join().ok()
        } else {
            None
        }
    };
    let Some(status) = status else {
        return Err(LoadErrorKind::ProbeTimeout {
            ms: timeout.as_millis() as u64,
        });
    };
    let out = collect(stdout).unwrap_or_default();
    let err = collect(stderr).unwrap_or_default();
    use std::os::unix::process::ExitStatusExt;
    if let Some(signal) = status.signal() {
        return Err(LoadErrorKind::ProbeCrashed {
            signal: signal_name(signal),
            output: tail(&err),
        });
    }
    if !status.success() {
        return Err(failed(format!(
            "the probe exited with {status}{}",
            tail(&err)
        )));
    }
    let text = String::from_utf8_lossy(&out);
    let Some(line) = text.lines().rev().find_map(|l| l.strip_prefix(MARKER)) else {
        return Err(failed(format!(
            "the probe ({}) gave no answer: it is not a kvhint binary, or the library closed its output{}",
            program.display(),
            tail(&err)
        )));
    };
    let answer: Answer = serde_json::from_str(line)
        .map_err(|e| failed(format!("the probe's answer is unreadable ({e}): {line}")))?;
    answer.into_result()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_round_trip() {
        for kind in [
            LoadErrorKind::PanicAbort,
            LoadErrorKind::NoRootModule("x".into()),
            LoadErrorKind::AbiVersion { plugin: 7 },
        ] {
            let text = serde_json::to_string(&Answer::of(&Err(kind.clone()))).unwrap();
            let back: Answer = serde_json::from_str(&text).unwrap();
            assert_eq!(
                back.into_result().unwrap_err().to_string(),
                kind.to_string()
            );
        }
    }

    #[test]
    fn a_program_that_is_not_kvhint_is_no_answer() {
        let err = run_child(
            Path::new("/bin/true"),
            Path::new("/nonexistent.so"),
            Duration::from_secs(10),
        )
        .unwrap_err();
        assert!(err.to_string().contains("gave no answer"), "{err}");
    }

    #[test]
    fn a_hung_probe_is_killed_at_its_timeout() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let program = dir.path().join("hangs");
        std::fs::write(&program, "#!/bin/sh\nexec sleep 600\n").unwrap();
        std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o755)).unwrap();
        // Another test's thread may fork while this file is still open for writing,
        // and its child holds the descriptor until it execs: exec then fails with
        // ETXTBSY for a moment. Try again a bounded number of times.
        let mut attempts = 0;
        let err = loop {
            let err = run_child(
                &program,
                Path::new("/nonexistent.so"),
                Duration::from_millis(300),
            )
            .unwrap_err();
            attempts += 1;
            if attempts < 50 && err.to_string().contains("Text file busy") {
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            break err;
        };
        assert!(
            matches!(err, LoadErrorKind::ProbeTimeout { ms: 300 }),
            "{err}"
        );
    }
}
