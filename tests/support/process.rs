//! Child processes the tests start: tied to the test process's life, and read
//! with deadlines, so a hung child fails a test with a message instead of
//! hanging the run; commands run to their end within a bound; free ports for
//! the servers they start; and the `[kvhint-e2e]` progress lines the harness
//! prints while it builds and fetches.

use std::io::{BufRead, BufReader, Read};
use std::net::TcpListener;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

/// Spawns `command` so that the child is sent SIGKILL when the test process
/// ends, however it ends (`PR_SET_PDEATHSIG`).
///
/// Linux sends that signal when the *thread* that forked the child ends, not
/// the process, and libtest runs each test on a thread of its own; so every
/// child is forked by one spawner thread that lives as long as the process,
/// and a worker started by one test can outlive that test's thread.
pub fn spawn_tied(command: Command) -> std::io::Result<Child> {
    type Request = (Command, mpsc::Sender<std::io::Result<Child>>);
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<Request>>> = OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        let (requests, received) = mpsc::channel::<Request>();
        std::thread::Builder::new()
            .name("kvhint-e2e-spawner".into())
            .spawn(move || {
                for (mut command, reply) in received {
                    let _ = reply.send(spawn_with_parent_death(&mut command));
                }
            })
            .expect("cannot start the spawner thread");
        Mutex::new(requests)
    });
    let (reply, answer) = mpsc::channel();
    spawner
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .send((command, reply))
        .expect("the spawner thread is gone");
    answer.recv().expect("the spawner thread is gone")
}

fn spawn_with_parent_death(command: &mut Command) -> std::io::Result<Child> {
    use std::os::unix::process::CommandExt;
    // SAFETY: getpid is async-signal-safe.
    let parent = unsafe { libc::getpid() };
    // SAFETY: the closure runs in the forked child before exec and calls only
    // async-signal-safe functions (prctl, getppid, _exit); it allocates nothing.
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The parent may have died before the prctl: then no signal comes.
            if libc::getppid() != parent {
                libc::_exit(1);
            }
            Ok(())
        });
    }
    command.spawn()
}

/// Lines a child writes to a pipe, read on a thread of their own so that a
/// test can wait for the next one with a deadline.
pub struct LineReader {
    lines: Receiver<std::io::Result<String>>,
}

/// Why [`LineReader::line`] returned no line.
#[derive(Debug)]
pub enum NoLine {
    /// The deadline passed with no complete line.
    Timeout(Duration),
    /// The pipe closed (the child exited or closed it).
    Closed,
    /// Reading failed.
    Io(std::io::Error),
}

impl std::fmt::Display for NoLine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NoLine::Timeout(within) => write!(f, "no line within {within:?}"),
            NoLine::Closed => write!(f, "the pipe closed (the process exited?)"),
            NoLine::Io(e) => write!(f, "reading failed: {e}"),
        }
    }
}

impl LineReader {
    /// Starts reading `pipe` (a child's stdout or stderr) line by line.
    pub fn new(pipe: impl Read + Send + 'static) -> LineReader {
        let (sender, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines() {
                let failed = line.is_err();
                if sender.send(line).is_err() || failed {
                    break;
                }
            }
        });
        LineReader { lines }
    }

    /// The next line (without its newline), waiting at most `within`.
    pub fn line(&self, within: Duration) -> Result<String, NoLine> {
        match self.lines.recv_timeout(within) {
            Ok(Ok(line)) => Ok(line),
            Ok(Err(e)) => Err(NoLine::Io(e)),
            Err(RecvTimeoutError::Timeout) => Err(NoLine::Timeout(within)),
            Err(RecvTimeoutError::Disconnected) => Err(NoLine::Closed),
        }
    }
}

impl LineReader {
    /// Every line still to come, until the pipe closes or `within` has passed,
    /// each with its newline: what a test prints when a child failed.
    pub fn rest(&self, within: Duration) -> String {
        let deadline = std::time::Instant::now() + within;
        let mut text = String::new();
        while let Some(left) = deadline.checked_duration_since(std::time::Instant::now()) {
            match self.line(left) {
                Ok(line) => {
                    text.push_str(&line);
                    text.push('\n');
                }
                Err(_) => break,
            }
        }
        text
    }
}

/// Waits at most `within` for `child` to exit; SIGKILLs and reaps it if it has
/// not. Returns its status if it exited by itself.
pub fn wait_or_kill(child: &mut Child, within: Duration) -> Option<ExitStatus> {
    use wait_timeout::ChildExt;
    match child.wait_timeout(within) {
        Ok(Some(status)) => Some(status),
        _ => {
            let _ = child.kill();
            let _ = child.wait();
            None
        }
    }
}

/// Runs `command` to its end with no stdin, failing the test (not hanging the
/// run) if it has not ended within `bound`: a command that blocks is a failure.
/// Its output is read as it comes, so a chatty command never blocks on a full
/// pipe.
pub fn run_bounded(command: &mut Command, bound: Duration) -> std::process::Output {
    use wait_timeout::ChildExt;
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {command:?}: {e}"));
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_end(&mut bytes);
            }
            bytes
        })
    };
    let stdout = drain(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let stderr = drain(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let status = child.wait_timeout(bound).unwrap();
    let status = match status {
        Some(status) => status,
        None => {
            let _ = child.kill();
            let _ = child.wait();
            let stderr = stderr.join().unwrap_or_default();
            panic!(
                "{command:?} did not end within {bound:?}\n{}",
                String::from_utf8_lossy(&stderr)
            );
        }
    };
    std::process::Output {
        status,
        stdout: stdout.join().unwrap_or_default(),
        stderr: stderr.join().unwrap_or_default(),
    }
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

/// A port on 127.0.0.1 below Linux's ephemeral range (32768–60999), free when
/// asked: one a server can bind again after a restart without an outgoing
/// connection having taken it meanwhile. Each test process starts at its own
/// offset, so test binaries running at once rarely meet.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const FIRST: u32 = 20_000;
    const PORTS: u32 = 12_000;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let base = (std::process::id() % 1_400) * 20;
    for _ in 0..2_000 {
        let port = FIRST + (base + NEXT.fetch_add(1, Ordering::Relaxed)) % PORTS;
        let port = port as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port between 20000 and 31999");
}
