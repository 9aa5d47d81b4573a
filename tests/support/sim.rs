//! Simulated engines (`kvhint-sim`, `tests/sim/main.rs`) on 127.0.0.1: one
//! process serving many vLLM-like workers with bounded block caches, for tests
//! and benches of routing at fleet scale.
//!
//! The binary is this package's own, so only its integration tests and benches
//! know its path (`env!("CARGO_BIN_EXE_kvhint-sim")`): they pass it in.

use crate::process::{spawn_tied, LineReader};
use serde_json::Value;
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::Duration;

/// One simulated worker: where it serves HTTP, and where it publishes KV events
/// (with `--events`).
#[derive(Debug, Clone)]
pub struct SimWorker {
    pub url: String,
    pub events: Option<String>,
    pub replay: Option<String>,
}

/// A `kvhint-sim` process; killed when dropped (it also exits when its stdin
/// closes, and dies with the test process).
pub struct SimFleet {
    pub workers: Vec<SimWorker>,
    child: Child,
    _stdin: ChildStdin,
}

impl SimFleet {
    /// Starts `bin` with `args` (`--workers N --tokenizer DIR …`) and waits for
    /// its ready line.
    pub fn start(bin: &Path, args: &[String]) -> SimFleet {
        let mut command = Command::new(bin);
        command
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child =
            spawn_tied(command).unwrap_or_else(|e| panic!("cannot run {}: {e}", bin.display()));
        let stdin = child.stdin.take().expect("piped stdin");
        let stdout = child.stdout.take().expect("piped stdout");
        let lines = LineReader::new(stdout);
        let line = lines
            .line(Duration::from_secs(120))
            .unwrap_or_else(|e| panic!("kvhint-sim {args:?} said nothing ready: {e}"));
        let ready: Value = serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("kvhint-sim's ready line {line:?}: {e}"));
        assert_eq!(ready["ready"], true, "kvhint-sim did not start: {line}");
        let text = |v: &Value| v.as_str().map(str::to_string);
        let workers = ready["workers"]
            .as_array()
            .unwrap_or_else(|| panic!("no workers in {line}"))
            .iter()
            .map(|w| SimWorker {
                url: text(&w["url"]).unwrap_or_else(|| panic!("a worker without url: {line}")),
                events: text(&w["events"]),
                replay: text(&w["replay"]),
            })
            .collect();
        SimFleet {
            workers,
            child,
            _stdin: stdin,
        }
    }

    /// `--workers N` engines of `--capacity-blocks C` blocks of 16 tokens,
    /// serving the tiny model's name with Qwen3's tokenizer; more flags go after.
    pub fn args(workers: usize, capacity_blocks: usize) -> Vec<String> {
        vec![
            "--workers".into(),
            workers.to_string(),
            "--tokenizer".into(),
            crate::llamacpp::qwen3_tokenizer_dir().display().to_string(),
            "--model".into(),
            crate::llamacpp::MODEL_NAME.into(),
            "--block-size".into(),
            "16".into(),
            "--capacity-blocks".into(),
            capacity_blocks.to_string(),
        ]
    }

    pub fn urls(&self) -> Vec<String> {
        self.workers.iter().map(|w| w.url.clone()).collect()
    }
}

impl Drop for SimFleet {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
