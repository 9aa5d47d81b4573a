//! Opening a library in a child process first.
//!
//! `dlopen` runs a library's constructors (`.init_array`) before it returns,
//! and no check on the file's bytes can tell what they do. A constructor that
//! calls `abort()`, dereferences null or never returns would take the router
//! down (or hang its reload) inside `dlopen`. So before the router opens a
//! private copy, a child process — the router re-executing itself as
//! `kvhint __probe-plugin FILE --answer-fd N --nonce-fd M` — opens it and reads
//! its root module, the same steps the router takes, and answers.
//!
//! The answer cannot come from the library. The library's code runs in the
//! child, so anything the child's standard output carries it could have
//! printed; instead:
//!
//! - the child answers on a pipe of its own (`--answer-fd`), never on stdout
//!   or stderr;
//! - the answer carries a per-probe nonce, which the child reads from another
//!   pipe (`--nonce-fd`) and closes *before* it opens the library, so the
//!   library finds it in no descriptor, argument or environment variable;
//! - the answer names the child's pid (a process the library forked answers
//!   with its own) and the sha256 of the bytes the child opened, which must be
//!   the ones the router checked;
//! - the child writes it only once `dlopen` has returned, and the router takes
//!   it only if the child then exits 0: a library that exits (or makes the
//!   child exit) before the probe's own code answers is refused, since it would
//!   end the router the same way.
//!
//! And no process the probe starts outlives it: the child runs in a process
//! group of its own, which is killed (SIGKILL) when the probe returns, whatever
//! the outcome; it dies with the router (`PR_SET_PDEATHSIG`); it is a child
//! subreaper, so a process the library starts (even one that leaves the group)
//! is its child, and it kills those and refuses the library, which would start
//! them in the router too. It opens the library in a child of its own, so that
//! even a process started with `clone(CLONE_PARENT)` (a child of the opener's
//! parent) is the probe's to kill, never the router's. On shutdown, [`abandon_all`] kills every running
//! probe and refuses new ones, so a hung constructor cannot hold up an exit.
//!
//! A refusal the child found itself (no root module, wrong ABI,
//! `panic = "abort"`) comes back as the same error the router would have
//! given, and the library is never mapped in the router.

use super::{LoadErrorKind, PluginInfo};
use std::collections::HashSet;
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The hidden subcommand the router re-executes itself with.
pub const SUBCOMMAND: &str = "__probe-plugin";
/// What the child's answer line starts with.
const MARKER: &str = "kvhint-probe ";
/// The most of an answer read (a real one is a few hundred bytes).
const MAX_ANSWER_BYTES: usize = 64 << 10;

/// Set once the router shuts down: probes running are killed, new ones refused.
static ABANDONED: AtomicBool = AtomicBool::new(false);
/// The process groups of the probes running now (each probe's pid).
static RUNNING: Mutex<Option<HashSet<i32>>> = Mutex::new(None);

/// On shutdown: kills every probe running (its whole process group) and makes
/// every later probe fail at once, so a reload in flight ends now and none
/// waits out a probe timeout. Returns how many probes were killed.
pub fn abandon_all() -> usize {
    ABANDONED.store(true, Ordering::SeqCst);
    let running = RUNNING.lock().unwrap_or_else(|e| e.into_inner());
    let groups: Vec<i32> = running.iter().flatten().copied().collect();
    for group in &groups {
        // SAFETY: a signal to a process group this process created and has not
        // reaped the leader of (it is reaped only after leaving `RUNNING`).
        unsafe {
            libc::kill(-group, libc::SIGKILL);
        }
    }
    groups.len()
}

/// Whether [`abandon_all`] has been called.
pub fn abandoned() -> bool {
    ABANDONED.load(Ordering::SeqCst)
}

/// The answer as the child writes it: the probe's nonce, its pid, the sha256
/// of the bytes it opened, and what it found.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
struct Envelope {
    nonce: String,
    pid: u32,
    sha256: String,
    /// Processes the library's initialisation code started (killed by the child).
    started: usize,
    answer: Answer,
}

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

/// The child's side (the hidden subcommand): opens `file` as the router would
/// and writes the answer to `answer_fd`, with the nonce read from `nonce_fd`
/// (both given by the router; without them, for a person trying the probe by
/// hand, the answer goes to stdout without a nonce). Returns the exit code.
pub fn child(file: &Path, answer_fd: Option<RawFd>, nonce_fd: Option<RawFd>) -> i32 {
    // A library that crashes here is expected to: leave no core file behind
    // (`check` and `plugins` write nothing), whatever the shell's `ulimit -c`.
    // Processes the library starts become this process's children, even if
    // their parent exits, so they can be found and killed below.
    // SAFETY: plain system calls on this process, with valid arguments.
    unsafe {
        let none = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        libc::setrlimit(libc::RLIMIT_CORE, &none);
        libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0);
        libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
    }
    // The library is opened in a child of this process, which waits for it:
    // a process the library starts with `clone(CLONE_PARENT)` is a child of its
    // opener's parent, so without this step it would be the router's, outside
    // the probe's reach; here it is this process's, killed below.
    // SAFETY: fork in the probe subcommand, which starts no thread of its own
    // (no runtime; logging writes from the calling thread), so the child may
    // run any code.
    let opener = unsafe { libc::fork() };
    if opener < 0 {
        return 7;
    }
    if opener > 0 {
        return outlive(opener);
    }
    // SAFETY: plain system calls on this process, with valid arguments.
    unsafe {
        // Dies with the probe, and is the subreaper of what the library starts.
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);
        libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
    }
    // The nonce is read, and its pipe closed, before the library's code runs.
    let nonce = match nonce_fd {
        Some(fd) => {
            // SAFETY: the router passed this descriptor for this process alone.
            let mut pipe = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) });
            let mut nonce = String::new();
            if (&mut pipe).take(256).read_to_string(&mut nonce).is_err() {
                return 3;
            }
            nonce
        }
        None => String::new(),
    };
    let sha256 = match std::fs::File::open(file) {
        Ok(mut opened) => super::cache::copy_hashing(&mut opened, std::io::sink(), u64::MAX)
            .map(|(_, sha)| sha)
            .unwrap_or_default(),
        Err(_) => String::new(),
    };
    let opened = super::dlopen(file)
        .and_then(|()| super::read_root_module(file))
        .map(|(_, info)| info);
    let started = kill_children();
    let envelope = Envelope {
        nonce,
        // The probe's own process, the one the router started (this one is its
        // child). SAFETY: getppid has no preconditions.
        pid: unsafe { libc::getppid() } as u32,
        sha256,
        started,
        answer: Answer::of(&opened),
    };
    let line = match serde_json::to_string(&envelope) {
        Ok(json) => format!("{MARKER}{json}\n"),
        Err(_) => return 4,
    };
    match answer_fd {
        Some(fd) => {
            // SAFETY: the router passed this descriptor for this process alone.
            let mut pipe = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) });
            use std::io::Write;
            if pipe.write_all(line.as_bytes()).is_err() {
                return 5;
            }
            drop(pipe);
            // Done: exit without running the library's destructors or atexit
            // handlers, which have nothing to say to the router.
            // SAFETY: _exit ends this process; nothing is left to flush.
            unsafe { libc::_exit(0) }
        }
        None => {
            print!("{line}");
            0
        }
    }
}

/// The probe's exit code when the library started a process outside the
/// process that opened it (`clone(CLONE_PARENT)`), which the probe killed.
const STARTED_OUTSIDE: i32 = 6;

/// The probe's own process: waits for the child that opens the library, kills
/// whatever else is its child then (a process the library started as the
/// opener's sibling, orphans of those), and exits as the opener did: with
/// [`STARTED_OUTSIDE`] if there was anything to kill, with the opener's signal
/// if one ended it (so the router names the crash), else with its code.
fn outlive(opener: i32) -> i32 {
    let mut status = 0;
    // SAFETY: waits for this process's own child; `status` is a live int.
    let waited = unsafe { libc::waitpid(opener, &mut status, 0) };
    let strays = kill_children();
    if waited != opener {
        return 7;
    }
    if strays > 0 {
        return STARTED_OUTSIDE;
    }
    if libc::WIFSIGNALED(status) {
        let signal = libc::WTERMSIG(status);
        // SAFETY: the default action for the opener's signal, then the signal
        // to this process, so it ends the same way (no core: RLIMIT_CORE is 0).
        unsafe {
            libc::signal(signal, libc::SIG_DFL);
            libc::raise(signal);
        }
        return 128 + signal;
    }
    libc::WEXITSTATUS(status)
}

/// Kills the processes this process has as children (what the library's code
/// started; orphans of them too, this process being a subreaper), and returns
/// how many there were.
fn kill_children() -> usize {
    let mut killed = HashSet::new();
    // A process can start another between the listing and the kill: a few rounds.
    for _ in 0..8 {
        let mut found = Vec::new();
        if let Ok(tasks) = std::fs::read_dir("/proc/self/task") {
            for task in tasks.flatten() {
                if let Ok(text) = std::fs::read_to_string(task.path().join("children")) {
                    found.extend(
                        text.split_whitespace()
                            .filter_map(|p| p.parse::<i32>().ok()),
                    );
                }
            }
        }
        if found.is_empty() {
            break;
        }
        for pid in found {
            // SAFETY: a signal to a child of this process, then its reaping.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, std::ptr::null_mut(), 0);
            }
            killed.insert(pid);
        }
    }
    killed.len()
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

/// A pipe whose both ends close on exec: (read, write).
fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: pipe2 fills the two descriptors it is given room for.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: both were just created and are owned by nothing else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// A fresh nonce: 16 random bytes, in hex.
fn nonce() -> std::io::Result<String> {
    let mut bytes = [0u8; 16];
    let mut got = 0;
    while got < bytes.len() {
        // SAFETY: getrandom writes at most the length given into the buffer.
        let n = unsafe { libc::getrandom(bytes[got..].as_mut_ptr().cast(), bytes.len() - got, 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(e);
            }
        } else {
            got += n as usize;
        }
    }
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Whether the child `pid` has exited, without reaping it (its pid, and so its
/// process group's id, stays reserved until it is reaped).
fn exited(pid: i32) -> std::io::Result<bool> {
    // SAFETY: `siginfo_t` is a plain C struct of integers and pointers, for
    // which all zero bytes are a valid value.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: `info` is a live, writable `siginfo_t` for the whole call, which
    // is all `waitid` writes to; with `WNOWAIT` it reaps nothing.
    let rc = unsafe {
        libc::waitid(
            libc::P_PID,
            pid as libc::id_t,
            &mut info,
            libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: si_pid is set by waitid when a child changed state, 0 otherwise.
    Ok(unsafe { info.si_pid() } != 0)
}

/// The probe's process group, registered for [`abandon_all`] while it runs and
/// killed whole when it is dropped (before the leader is reaped).
struct Group(i32);

impl Group {
    fn new(pid: i32) -> Self {
        RUNNING
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert_with(HashSet::new)
            .insert(pid);
        Group(pid)
    }

    fn kill(&self) {
        // SAFETY: the group's leader is a child of this process not yet reaped.
        unsafe {
            libc::kill(-self.0, libc::SIGKILL);
        }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        self.kill();
        if let Some(running) = RUNNING.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
            running.remove(&self.0);
        }
    }
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

/// The router's side: runs the probe on `file` (a private copy whose sha256
/// the router computed) and returns what the child found, or why the file
/// must not be opened.
pub fn run(
    mode: &ProbeMode,
    file: &Path,
    sha256: &str,
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
    Some(run_child(&program, file, sha256, timeout))
}

fn abandoned_error() -> LoadErrorKind {
    LoadErrorKind::ProbeFailed {
        what: "the router is shutting down, so its probe was stopped (or not started)".to_string(),
    }
}

fn run_child(
    program: &Path,
    file: &Path,
    sha256: &str,
    timeout: Duration,
) -> Result<PluginInfo, LoadErrorKind> {
    let failed = |what: String| LoadErrorKind::ProbeFailed { what };
    if abandoned() {
        return Err(abandoned_error());
    }
    let cannot_start = |e: std::io::Error| {
        failed(format!(
            "the probe ({} {SUBCOMMAND}) cannot start: {e}",
            program.display()
        ))
    };
    let nonce = nonce().map_err(cannot_start)?;
    let (answer_read, answer_write) = pipe().map_err(cannot_start)?;
    let (nonce_read, nonce_write) = pipe().map_err(cannot_start)?;
    {
        use std::io::Write;
        let mut writer = std::fs::File::from(nonce_write);
        writer.write_all(nonce.as_bytes()).map_err(cannot_start)?;
        // Closed here: the child reads the nonce to its end.
    }
    let (answer_fd, nonce_fd) = (answer_write.as_raw_fd(), nonce_read.as_raw_fd());
    // SAFETY: getpid has no preconditions.
    let router = unsafe { libc::getpid() };
    let mut command = Command::new(program);
    command
        .arg(SUBCOMMAND)
        .arg(file)
        .arg("--answer-fd")
        .arg(answer_fd.to_string())
        .arg("--nonce-fd")
        .arg(nonce_fd.to_string())
        .stdin(Stdio::null())
        // What the library prints is no answer: it goes nowhere.
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        // The child logs only problems, whatever the router's own level.
        .env("KVHINT_LOG", "warn")
        // A group of its own, killed whole when the probe returns.
        .process_group(0);
    {
        // SAFETY: between fork and exec only async-signal-safe calls (prctl,
        // getppid, fcntl, _exit) on this process's own state.
        unsafe {
            command.pre_exec(move || {
                // Dies with the router (with the thread that started it, which
                // waits for it), and not even that window: a router gone
                // before the prctl is seen here.
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0
                    || libc::getppid() != router
                {
                    libc::_exit(1);
                }
                // The two pipe ends the child keeps across exec.
                for fd in [answer_fd, nonce_fd] {
                    if libc::fcntl(fd, libc::F_SETFD, 0) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
    }
    let mut child = command.spawn().map_err(cannot_start)?;
    let pid = child.id() as i32;
    let group = Group::new(pid);
    // The child has its own copies; the router's must close, or the answer
    // pipe would never end.
    drop(answer_write);
    drop(nonce_read);
    if abandoned() {
        group.kill();
    }
    let answer = drain(std::fs::File::from(answer_read), MAX_ANSWER_BYTES);
    let stderr = child.stderr.take().map(|p| drain(p, 16 << 10));
    let deadline = Instant::now() + timeout;
    // Polled, so the child is reaped by this thread alone, and only after its
    // group was killed (a kill can never hit a recycled pid); at most 1 ms late,
    // and a probe takes a few ms.
    let mut pause = Duration::from_micros(100);
    let timed_out = loop {
        match exited(pid) {
            Ok(true) => break false,
            Ok(false) if Instant::now() >= deadline || abandoned() => break true,
            Ok(false) => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(1));
            }
            Err(e) => {
                drop(group);
                let _ = child.wait();
                return Err(failed(format!("the probe could not be waited for: {e}")));
            }
        }
    };
    // Whatever happened, nothing the probe started outlives it.
    drop(group);
    let status = child.wait();
    if abandoned() {
        return Err(abandoned_error());
    }
    if timed_out {
        return Err(LoadErrorKind::ProbeTimeout {
            ms: timeout.as_millis() as u64,
        });
    }
    let status = status.map_err(|e| failed(format!("the probe could not be waited for: {e}")))?;
    // Every process of the group is dead, so the pipes end; a process that left
    // the group (and that the child could not kill) is waited for only until the
    // deadline, never for good.
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
    let answer = collect(Some(answer)).unwrap_or_default();
    let err = collect(stderr).unwrap_or_default();
    use std::os::unix::process::ExitStatusExt;
    if let Some(signal) = status.signal() {
        return Err(LoadErrorKind::ProbeCrashed {
            signal: signal_name(signal),
            output: tail(&err),
        });
    }
    let text = String::from_utf8_lossy(&answer);
    let line = text.lines().find_map(|l| l.strip_prefix(MARKER));
    if status.code() == Some(STARTED_OUTSIDE) {
        return Err(LoadErrorKind::ProbeFailed {
            what: "opening it started a process outside the process that opened it (its initialisation code clones with CLONE_PARENT), which the probe killed: loaded in the router it would start it there too, as the router's own child; fix the plugin (start no process from a constructor)".to_string(),
        });
    }
    if !status.success() {
        return Err(failed(format!(
            "the probe exited with {status}{}",
            tail(&err)
        )));
    }
    let Some(line) = line else {
        return Err(failed(format!(
            "the probe ({}) gave no answer: the library ended the probe process (exit status 0) before the probe's own code could answer, so its initialisation code exits the process it is loaded in and would end the router too; fix the plugin (a constructor must return). If the probe is not a kvhint binary, point the loader at one{}",
            program.display(),
            tail(&err)
        )));
    };
    let envelope: Envelope = serde_json::from_str(line).map_err(|e| {
        failed(format!(
            "the probe's answer is unreadable ({e}), so it did not come from the probe: the library's initialisation code wrote it; fix the plugin"
        ))
    })?;
    if envelope.nonce.is_empty() || envelope.nonce != nonce || envelope.pid != pid as u32 {
        return Err(failed(
            "the probe's answer did not come from the probe's own process (its nonce or process id is wrong): a process the library started, or the library itself, wrote it; fix the plugin".to_string(),
        ));
    }
    if !envelope.sha256.eq_ignore_ascii_case(sha256) {
        return Err(failed(format!(
            "the probe opened other bytes (sha256 {}) than the router checked ({sha256}): the private copy changed; check who else writes to `plugins.cache_dir`",
            envelope.sha256
        )));
    }
    if envelope.started > 0 {
        return Err(LoadErrorKind::ProbeFailed {
            what: format!(
                "opening it started {} process{} (its initialisation code forks), which the probe killed: loaded in the router it would start them there too; fix the plugin (start no process from a constructor)",
                envelope.started,
                if envelope.started == 1 { "" } else { "es" }
            ),
        });
    }
    envelope.answer.into_result()
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
            assert!(!text.contains('\n'));
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
            "",
            Duration::from_secs(10),
        )
        .unwrap_err();
        assert!(err.to_string().contains("gave no answer"), "{err}");
    }

    /// A program standing in for the probe: a shell script.
    fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let program = dir.join(name);
        std::fs::write(&program, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o755)).unwrap();
        program
    }

    /// Runs `program` as the probe, again while exec meets ETXTBSY (another
    /// test's fork may hold the script open for writing for a moment).
    fn probe_with(program: &Path, timeout: Duration) -> LoadErrorKind {
        let mut attempts = 0;
        loop {
            let err = run_child(program, Path::new("/nonexistent.so"), "", timeout).unwrap_err();
            attempts += 1;
            if attempts < 50 && err.to_string().contains("Text file busy") {
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            return err;
        }
    }

    #[test]
    fn a_success_line_on_stdout_or_without_the_nonce_is_no_answer() {
        let dir = tempfile::tempdir().unwrap();
        let loaded =
            r#"{"result":"loaded","name":"x","version":"1","api_version":"0.2.0","abi_version":2}"#;
        // What a constructor that impersonates the probe prints, then exits 0.
        let stdout = script(dir.path(), "stdout", &format!("echo '{MARKER}{loaded}'"));
        let err = probe_with(&stdout, Duration::from_secs(10));
        assert!(err.to_string().contains("gave no answer"), "{err}");
        // On the answer pipe, but without the nonce (it never saw it).
        let forged = format!(
            r#"{MARKER}{{"nonce":"00","pid":$$,"sha256":"","started":0,"answer":{loaded}}}"#
        );
        let pipe = script(
            dir.path(),
            "pipe",
            &format!("eval \"echo '{forged}' >&$4\""),
        );
        let err = probe_with(&pipe, Duration::from_secs(10));
        assert!(
            err.to_string().contains("did not come from the probe"),
            "{err}"
        );
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
                "",
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
