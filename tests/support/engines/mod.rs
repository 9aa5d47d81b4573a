//! What the engines send and serve, for the tests that stand in for them or run
//! their own code: KV-event batches in msgpack as the engines write them
//! ([`msgpack`], [`batch`]); the engines' own KV-event publishers
//! (`tests/engines/*_publisher.py`, SGLang's and vLLM's code from the harness's
//! Python environment) driven over stdin/stdout ([`Publisher`]); capture
//! servers that record what reached a worker ([`capture`]); and vLLM's own
//! renderer ([`vllm_render`]).

pub mod capture;
pub mod paced;
pub mod vllm_render;

use crate::paths::workspace_root;
use crate::process::{run_bounded, spawn_tied, wait_or_kill, LineReader};
use crate::provision::{python, vllm_wheel};
use crate::server::Server;
use crate::wait::Waiting;
use serde_json::{json, Value};
use std::io::Write;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::Duration;

/// Appends `value` as msgpack, for the JSON shapes an engine event has: integers
/// as the smallest msgpack integer that holds them, other numbers as f64, and
/// an object `{"bytes": [..]}` (and nothing else) as a byte string.
pub fn write_msgpack(out: &mut Vec<u8>, value: &Value) {
    use rmp::encode;
    match value {
        Value::Null => encode::write_nil(out).unwrap(),
        Value::Bool(b) => encode::write_bool(out, *b).unwrap(),
        Value::Number(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => {
                encode::write_uint(out, u).unwrap();
            }
            (None, Some(i)) => {
                encode::write_sint(out, i).unwrap();
            }
            _ => encode::write_f64(out, n.as_f64().unwrap()).unwrap(),
        },
        Value::String(s) => encode::write_str(out, s).unwrap(),
        Value::Array(items) => {
            encode::write_array_len(out, items.len() as u32).unwrap();
            for item in items {
                write_msgpack(out, item);
            }
        }
        Value::Object(map) if map.len() == 1 && map.contains_key("bytes") => {
            let bytes: Vec<u8> = map["bytes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b.as_u64().unwrap() as u8)
                .collect();
            encode::write_bin(out, &bytes).unwrap();
        }
        Value::Object(map) => {
            encode::write_map_len(out, map.len() as u32).unwrap();
            for (k, v) in map {
                encode::write_str(out, k).unwrap();
                write_msgpack(out, v);
            }
        }
    }
}

/// `value` as msgpack ([`write_msgpack`]).
pub fn msgpack(value: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    write_msgpack(&mut out, value);
    out
}

/// One engine batch `[ts, events, dp_rank 0]`, as vLLM and SGLang publish it
/// (`events` a JSON array of event maps).
pub fn batch(events: Value) -> Vec<u8> {
    msgpack(&json!([1.7e9, events, 0]))
}

/// How long a publisher may take to answer a command (or to start).
pub const REPLY_WITHIN: Duration = Duration::from_secs(60);

/// An engine's own KV-event publisher (`tests/engines/<script>`), driven over
/// stdin/stdout with one JSON command and one JSON answer a line; every answer
/// read with a deadline ([`REPLY_WITHIN`]). Told to quit (then killed) on drop.
pub struct Publisher {
    child: Child,
    stdin: ChildStdin,
    stdout: LineReader,
    script: String,
}

impl Publisher {
    /// `script` in `tests/engines/` (`sglang_publisher.py`,
    /// `vllm_publisher.py`) with `args`, under the harness's Python; waits for
    /// its `{"ready": true}`.
    pub fn start(script: &str, args: &[String]) -> Publisher {
        let python = python();
        let path = workspace_root().join("tests/engines").join(script);
        let mut command = Command::new(python);
        command
            .arg(&path)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child =
            spawn_tied(command).unwrap_or_else(|e| panic!("cannot run {}: {e}", python.display()));
        let stdin = child.stdin.take().unwrap();
        let stdout = LineReader::new(child.stdout.take().unwrap());
        let mut publisher = Publisher {
            child,
            stdin,
            stdout,
            script: script.into(),
        };
        let ready = publisher.line();
        assert_eq!(
            ready["ready"],
            true,
            "{} did not start: {ready} (its stderr is above; the interpreter is {})",
            path.display(),
            python.display()
        );
        publisher
    }

    /// SGLang 0.5.23's publisher (`sglang_publisher.py`).
    pub fn sglang(args: &[String]) -> Publisher {
        Self::start("sglang_publisher.py", args)
    }

    /// vLLM 0.23.0's publisher, read out of the wheel the harness provides.
    pub fn vllm(args: &[String]) -> Publisher {
        let mut args = args.to_vec();
        args.extend(["--wheel".into(), vllm_wheel().display().to_string()]);
        Self::start("vllm_publisher.py", &args)
    }

    /// The publisher's next line, as JSON; fails the test if none comes within
    /// [`REPLY_WITHIN`].
    pub fn line(&mut self) -> Value {
        let line = match self.stdout.line(REPLY_WITHIN) {
            Ok(line) => line,
            Err(why) => {
                let status = wait_or_kill(&mut self.child, Duration::ZERO);
                panic!(
                    "{} gave no answer: {why} (exit status: {})",
                    self.script,
                    status.map_or("still running, killed".into(), |s| s.to_string())
                )
            }
        };
        serde_json::from_str(&line).unwrap_or_else(|_| panic!("{} said {line:?}", self.script))
    }

    /// Sends `command`; its answer, which must not be an error.
    pub fn command(&mut self, command: Value) -> Value {
        writeln!(self.stdin, "{command}").unwrap();
        self.stdin.flush().unwrap();
        let reply = self.line();
        assert!(reply.get("error").is_none(), "{command} → {reply}");
        reply
    }

    /// Publishes one batch of `events` (`drop`: the publisher numbers it but
    /// does not send it, a gap); its sequence number.
    pub fn publish(&mut self, events: Value, drop: bool) -> u64 {
        let reply = self.command(json!({"op": "publish", "events": events, "drop": drop}));
        reply["published"].as_u64().unwrap()
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "{}", json!({"op": "quit"}));
        let _ = self.stdin.flush();
        wait_or_kill(&mut self.child, Duration::from_secs(3));
    }
}

/// The server's first KV-event source in `/admin/status` (null if none).
pub fn source_status(server: &Server) -> Value {
    server.status()["kv_event_sources"]
        .as_array()
        .and_then(|s| s.first().cloned())
        .unwrap_or(Value::Null)
}

/// Publishes probes (a removal of a block nobody holds) until the server's
/// first source has heard a batch: ZMQ's slow joiner, a SUB socket misses
/// what is sent before its subscription reaches the publisher. A probe is
/// heard at the latest at the next check, 50 ms later.
pub fn until_joined(server: &Server, publisher: &mut Publisher) {
    Waiting::new(
        "the subscription to hear the publisher",
        Duration::from_secs(30),
    )
    .every(Duration::from_millis(50))
    .report(|| format!("{}\n{}", source_status(server), server.log()))
    .until(|| {
        publisher.publish(
            json!([{"type": "BlockRemoved", "block_hashes": [999_999]}]),
            false,
        );
        (source_status(server)["batches"].as_u64().unwrap_or(0) > 0).then_some(())
    });
}

/// Runs `script` in `tests/engines/` with the harness's Python; returns its
/// one JSON line, failing the test (with what it printed) unless it says ok.
pub fn run_checker(script: &str, args: &[&std::ffi::OsStr]) -> Value {
    let path = workspace_root().join("tests/engines").join(script);
    let output = run_bounded(
        Command::new(python()).arg(&path).args(args),
        Duration::from_secs(180),
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    let report: Value = stdout
        .lines()
        .last()
        .and_then(|l| serde_json::from_str(l).ok())
        .unwrap_or(Value::Null);
    assert!(
        output.status.success() && report["ok"] == true,
        "{script} refused it ({}): {stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    report
}
