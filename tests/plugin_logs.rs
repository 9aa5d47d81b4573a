//! A plugin's `tracing` events reach the router's log, tagged with the plugin's
//! name, at the level the operator asked for.
//!
//! A plugin `.so` has its own copy of `tracing`; without the log bridge its
//! events went to its own, empty, dispatcher. This runs the real binary, as an
//! operator would, because only a real process has the router's subscriber
//! (from `KVHINT_LOG`) on one side and a dlopened plugin on the other.

use kvhint_e2e::{config_file, kvhint_bin, trace, ConfigFixture};
use serde_json::Value;
use std::process::{Command, Output};

const REQUEST: &str = "req-logs-1";

/// A decode role whose only hint policy is the fixture's `logs`, and a trace
/// with one hint-capable decode worker and one request, written next to it.
fn logging_setup() -> (ConfigFixture, std::path::PathBuf) {
    // `dynamo-default-cost-fn` commits no KV copies, so `logs` may be the
    // role's only hint policy (R5).
    let fixture = config_file(
        "plugins:\n  files: ['{so:fixture_misbehaving}']\n  cache_dir: ./cache\nrouter: {block_size: 4}\nworker_selection:\n  decode:\n    type: dynamo-default-cost-fn\n    hints: [{type: logs}]\n",
    );
    let records = [
        trace::worker(1, 0, "decode", true, "decode"),
        trace::request(REQUEST, "decode", &trace::tokens(1, 8)),
    ];
    let trace_path = fixture.dir.path().join("trace.jsonl");
    let text: String = records.iter().map(|r| format!("{r}\n")).collect();
    std::fs::write(&trace_path, text).unwrap();
    (fixture, trace_path)
}

fn replay_with_log(log: &str) -> Output {
    let (fixture, trace_path) = logging_setup();
    let output = Command::new(kvhint_bin())
        .args(["replay", "--config"])
        .arg(&fixture.path)
        .arg("--trace")
        .arg(&trace_path)
        .env("KVHINT_LOG", log)
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "replay failed:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    // The policy ran: the request was booked on the hint-capable worker, and
    // `logs` returned no actions.
    let stdout = String::from_utf8_lossy(&output.stdout);
    let booking: Value = stdout
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .find(|b| b["request_id"] == REQUEST)
        .unwrap_or_else(|| panic!("no booking for {REQUEST}:\n{stdout}"));
    assert_eq!(booking["worker_id"], 1, "{booking}");
    assert_eq!(booking["hint_skipped"], "no_actions", "{booking}");
    assert_eq!(
        booking["policy_failures"],
        serde_json::json!([]),
        "{booking}"
    );
    output
}

/// Stderr without ANSI colour sequences (the fmt subscriber may colour field
/// names), so assertions read the text an operator reads.
fn plain_stderr(output: &Output) -> String {
    let text = String::from_utf8_lossy(&output.stderr);
    let mut plain = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // CSI: ESC '[' parameters, ended by a letter.
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            plain.push(c);
        }
    }
    plain
}

#[test]
fn a_plugins_tracing_events_reach_the_host_log_with_its_name() {
    let stderr = plain_stderr(&replay_with_log("warn"));
    let line = stderr
        .lines()
        .find(|l| l.contains("fixture log line"))
        .unwrap_or_else(|| panic!("the plugin's warning is not in the router's log:\n{stderr}"));
    assert!(line.contains("WARN"), "{line}");
    assert!(line.contains("kvhint::plugin"), "{line}");
    assert!(line.contains("plugin=fixture-misbehaving"), "{line}");
    assert!(line.contains("plugin_target=fixture_misbehaving"), "{line}");
    assert!(line.contains(&format!("request={REQUEST}")), "{line}");
    assert_eq!(
        stderr.matches("fixture log line").count(),
        1,
        "one booking, one line:\n{stderr}"
    );
}

#[test]
fn a_plugins_events_below_the_hosts_level_are_not_logged() {
    let stderr = plain_stderr(&replay_with_log("error"));
    assert!(
        !stderr.contains("fixture log line"),
        "a warning passed KVHINT_LOG=error:\n{stderr}"
    );
}
