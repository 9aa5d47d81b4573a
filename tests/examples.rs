//! Everything in `examples/` works as the README says.

use kvhint_e2e::{examples_copy, kvhint_bin};
use serde_json::Value;
use std::process::Command;

#[test]
fn every_example_config_passes_check() {
    let root = examples_copy();
    let mut checked = 0;
    for entry in std::fs::read_dir(root.path().join("examples")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("yaml") {
            continue;
        }
        let output = Command::new(kvhint_bin())
            .args(["check", "--config"])
            .arg(&path)
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "{} fails check:\n{}",
            path.display(),
            String::from_utf8_lossy(&output.stderr)
        );
        checked += 1;
    }
    assert!(checked >= 1, "no example configs found");
}

#[test]
fn bundled_example_replay_sends_a_committed_copy_and_a_best_effort_fetch() {
    let root = examples_copy();
    let output = Command::new(kvhint_bin())
        .current_dir(root.path())
        .args([
            "replay",
            "--config",
            "examples/kvhint.yaml",
            "--trace",
            "examples/trace.jsonl",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let lines: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let booking = |id: &str| lines.iter().find(|b| b["request_id"] == id).unwrap();
    // Under kvcr: the committed copy, sent by kv_fetch.
    assert_eq!(booking("r1")["committed_copy"]["source_worker_id"], 3);
    assert_eq!(
        booking("r1")["hint"]["actions"][0]["action_type"],
        "kv.fetch"
    );
    // Under the default cost fn: a best-effort fetch, then the plugin's prefetch.
    assert_eq!(booking("r3")["committed_copy"], Value::Null);
    let actions = booking("r3")["hint"]["actions"].as_array().unwrap();
    assert_eq!(
        actions[0]["payload"]["source_control_endpoint"],
        "tcp://10.0.0.11:23280"
    );
    assert_eq!(actions[1]["action_type"], "kv.prefetch");
    let summary = &lines.last().unwrap()["summary"];
    assert_eq!(summary["actions_by_type"]["kv.fetch"], 2);
    assert_eq!(summary["committed_copies"], 1);
    assert_eq!(summary["errors"], 0);
}
