//! A real OpenTelemetry collector on 127.0.0.1: `rotel` (PyPI `rotel`, a
//! collector written in Rust whose wheel ships its binary `rotel-agent`),
//! receiving OTLP over gRPC and HTTP and printing every span it receives
//! (`--debug-log traces --debug-log-verbosity detailed`), exporting nowhere.
//! A test reads what it printed.

use crate::process::{free_port, spawn_tied};
use crate::provision::python;
use crate::wait::Waiting;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use tempfile::TempDir;

/// One span as the collector printed it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Span {
    pub trace_id: String,
    pub parent_id: String,
    pub id: String,
    pub name: String,
}

pub struct Collector {
    child: Child,
    /// Its OTLP/gRPC endpoint, `http://127.0.0.1:PORT`.
    pub grpc: String,
    dir: TempDir,
}

fn agent_bin() -> PathBuf {
    let output = Command::new(python())
        .args([
            "-c",
            "import rotel, os; print(os.path.join(os.path.dirname(rotel.__file__), 'rotel-agent'))",
        ])
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", python().display()));
    let path = PathBuf::from(String::from_utf8_lossy(&output.stdout).trim());
    assert!(
        output.status.success() && path.is_file(),
        "the venv has no rotel-agent (PyPI rotel, tests/engines/requirements.txt): {}",
        String::from_utf8_lossy(&output.stderr)
    );
    path
}

impl Collector {
    pub fn start() -> Collector {
        let dir = crate::private_dir();
        let (grpc, http) = (free_port(), free_port());
        let out = dir.path().join("collector.out");
        let mut command = Command::new(agent_bin());
        command
            .args(["start", "--exporter", "blackhole", "--debug-log", "traces"])
            .args(["--debug-log-verbosity", "detailed"])
            .args(["--otlp-grpc-endpoint", &format!("127.0.0.1:{grpc}")])
            .args(["--otlp-http-endpoint", &format!("127.0.0.1:{http}")])
            .arg("--log-file")
            .arg(dir.path().join("rotel.log"))
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&out).unwrap())
            .stderr(std::fs::File::create(dir.path().join("collector.err")).unwrap());
        let child = spawn_tied(command).unwrap_or_else(|e| panic!("cannot start rotel: {e}"));
        let collector = Collector {
            child,
            grpc: format!("http://127.0.0.1:{grpc}"),
            dir,
        };
        Waiting::new("the collector to listen", Duration::from_secs(30))
            .every(Duration::from_millis(50))
            .report(|| collector.output())
            .until(|| {
                std::net::TcpStream::connect(("127.0.0.1", grpc))
                    .ok()
                    .map(drop)
            });
        collector
    }

    /// Everything it printed so far.
    pub fn output(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("collector.out")).unwrap_or_default()
    }

    /// The spans it received so far, in order.
    pub fn spans(&self) -> Vec<Span> {
        let mut spans = Vec::new();
        let mut current: Option<Span> = None;
        for line in self.output().lines() {
            let line = line.trim();
            if line.starts_with("Span #") {
                spans.extend(current.take());
                current = Some(Span::default());
                continue;
            }
            let (Some(span), Some((key, value))) = (current.as_mut(), line.split_once(':')) else {
                continue;
            };
            let value = value.trim().to_string();
            match key.trim() {
                "Trace ID" => span.trace_id = value,
                "Parent ID" => span.parent_id = value,
                "ID" => span.id = value,
                "Name" => span.name = value,
                _ => {}
            }
        }
        spans.extend(current);
        spans
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
