//! Everything in `examples/` works as the README says, under every router mode
//! it claims: each example config says which in a `# modes: …` comment line.

use kvhint_e2e::{examples_copy, kvhint_bin};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Every example config with the router modes its `# modes:` line claims.
fn example_configs(root: &Path) -> Vec<(PathBuf, Vec<String>)> {
    let mut configs = Vec::new();
    for entry in std::fs::read_dir(root.join("examples")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("yaml") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let modes: Vec<String> = text
            .lines()
            .find_map(|l| l.strip_prefix("# modes:"))
            .map(|m| m.split(',').map(|s| s.trim().to_string()).collect())
            .unwrap_or_default();
        assert!(
            !modes.is_empty(),
            "{} has no `# modes: …` line saying which router modes it is for",
            path.display()
        );
        configs.push((path, modes));
    }
    configs.sort();
    configs
}

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
fn every_example_passes_check_and_replays_the_trace_under_every_mode_it_claims() {
    let root = examples_copy();
    for (config, modes) in example_configs(root.path()) {
        for mode in modes {
            for command in ["check", "replay"] {
                let mut run = Command::new(kvhint_bin());
                run.current_dir(root.path())
                    .args([command, "--router-mode", &mode, "--config"])
                    .arg(&config);
                if command == "replay" {
                    run.args(["--trace", "examples/trace.jsonl"]);
                }
                let output = run.output().unwrap();
                let stdout = String::from_utf8_lossy(&output.stdout);
                assert!(
                    output.status.success(),
                    "`kvhint {command} --router-mode {mode}` with {} fails:\n{stdout}{}",
                    config.display(),
                    String::from_utf8_lossy(&output.stderr)
                );
                if command == "check" {
                    assert!(
                        stdout.contains(&format!("(router mode {mode},")),
                        "{stdout}"
                    );
                } else {
                    let summary: Value =
                        serde_json::from_str(stdout.lines().last().unwrap_or_default()).unwrap();
                    assert_eq!(summary["summary"]["errors"], 0, "{stdout}");
                    assert_eq!(summary["summary"]["bookings"], 6, "{stdout}");
                }
            }
        }
    }
}

#[test]
fn every_router_mode_has_an_example() {
    let root = examples_copy();
    let claimed: Vec<String> = example_configs(root.path())
        .into_iter()
        .flat_map(|(_, modes)| modes)
        .collect();
    for mode in kvhint::config::RouterMode::NAMES {
        assert!(
            claimed.iter().any(|m| m == mode),
            "no example config claims `--router-mode {mode}` (claimed: {claimed:?})"
        );
    }
}

/// Replays the bundled trace on `config` (a path under the examples copy),
/// as the README runs it; the output lines, parsed.
fn replay_example(config: &str) -> Vec<Value> {
    let root = examples_copy();
    let output = Command::new(kvhint_bin())
        .current_dir(root.path())
        .args([
            "replay",
            "--config",
            config,
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
    stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn the_round_robin_example_books_without_hints() {
    let lines = replay_example("examples/kvhint-round-robin.yaml");
    let summary = &lines.last().unwrap()["summary"];
    assert_eq!(summary["hints"], 0, "{summary}");
    assert_eq!(summary["committed_copies"], 0, "{summary}");
}

#[test]
fn bundled_example_replay_sends_a_committed_copy_and_a_best_effort_fetch() {
    let lines = replay_example("examples/kvhint.yaml");
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
