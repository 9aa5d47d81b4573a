//! The deployment artefacts under `deploy/`, checked by the tools operators
//! use: the Prometheus alert rules by `promtool check rules` (Debian's
//! `prometheus` package; `.ci/run` installs it), and every metric the Grafana
//! dashboard and the alert rules name against what a live router exports on
//! `/metrics` (a gateway with a worker, a KV-event source and replication
//! over a real `nats-server`, so that every collector is registered).

use kvhint_e2e::http::{call, metrics};
use kvhint_e2e::llamacpp::qwen3_tokenizer_dir;
use kvhint_e2e::nats::NatsServer;
use kvhint_e2e::pd::{closed_port, Fake, Reply};
use kvhint_e2e::{private_dir, run_bounded, workspace_root, Server};
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

fn observability(file: &str) -> PathBuf {
    workspace_root().join("deploy/observability").join(file)
}

/// Every `kvhint_…` name in `text`.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("kvhint_") {
        let name: String = rest[at..]
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
            .collect();
        rest = &rest[at + name.len()..];
        out.insert(name);
    }
    out
}

/// The PromQL expressions of the dashboard's panels.
fn dashboard_exprs() -> Vec<String> {
    let text = std::fs::read_to_string(observability("grafana-dashboard.json")).unwrap();
    let dashboard: Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    let mut exprs = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().into_iter().flatten() {
            exprs.push(
                target["expr"]
                    .as_str()
                    .expect("a target's expr")
                    .to_string(),
            );
        }
    }
    exprs
}

#[test]
fn the_alert_rules_pass_promtool() {
    let rules = observability("prometheus-alerts.yaml");
    let output = run_bounded(
        Command::new("promtool")
            .args(["check", "rules"])
            .arg(&rules),
        Duration::from_secs(60),
    );
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        output.status.success(),
        "promtool check rules failed (install promtool with `apt-get install prometheus`):\n{text}"
    );
    assert!(text.contains("SUCCESS"), "{text}");
}

#[test]
fn every_metric_the_dashboard_and_the_alerts_name_is_one_a_live_router_exports() {
    let nats = NatsServer::start();
    let worker = Fake::start(|_, _| {
        Reply::Json(
            200,
            json!({"id": "c", "object": "text_completion", "created": 0, "model": "m",
                   "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
                   "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9}}),
        )
    });
    let dir = private_dir();
    let yaml = format!(
        "router:\n  block_size: 16\n\
         worker_selection:\n  aggregated: dynamo-default-cost-fn\n\
         models:\n  m:\n    tokenizer: {tokenizer}\n\
         gateway:\n  health:\n    interval_ms: 0\n\
         workers:\n  - {{worker_id: 1, engine: vllm, http_endpoint: \"{worker}\", models: [m], kv_events: approximate}}\n\
         kv_events:\n  sources:\n    - {{worker_id: 2, role: aggregated, endpoint: \"tcp://127.0.0.1:{silent}\"}}\n\
         replication:\n  nats_url: \"{nats}\"\n  fleet: deploy\n  name: r1\n",
        tokenizer = qwen3_tokenizer_dir().display(),
        worker = worker.url(),
        silent = closed_port(),
        nats = nats.url(),
    );
    let path = dir.path().join("kvhint.yaml");
    std::fs::write(&path, yaml).unwrap();
    let server = Server::start(&path, &[], dir.path());
    // One request through the gateway, so the per-worker families have samples.
    let (status, _, text) = call(
        &format!("{}/v1/completions", server.base),
        &json!({"model": "m", "prompt": "hello there", "max_tokens": 1}),
    );
    assert_eq!(status, 200, "{text}\n{}", server.log());

    let exposition = metrics(&server);
    // A family counts as exported when /metrics describes it (`# TYPE`), with
    // or without samples now; a named series is its family's, less the suffix
    // the exposition adds (`_total`, `_bucket`, `_sum`, `_count`).
    let families: BTreeSet<String> = exposition
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect();
    assert!(
        families
            .iter()
            .any(|f| f.starts_with("kvhint_replication_")),
        "replication is configured, so its families are there:\n{exposition}"
    );
    let exported = |name: &str| {
        families.contains(name)
            || ["_total", "_bucket", "_sum", "_count"]
                .iter()
                .any(|suffix| {
                    name.strip_suffix(suffix)
                        .is_some_and(|f| families.contains(f))
                })
    };
    // The check can fail: a name no family has is not exported.
    assert!(!exported("kvhint_no_such_metric_total"));
    assert!(
        exported("kvhint_gateway_pair_legs_total")
            && exported("kvhint_gateway_ttft_seconds_bucket")
    );
    let rules = std::fs::read_to_string(observability("prometheus-alerts.yaml")).unwrap();
    let mut named: Vec<(String, &str)> = Vec::new();
    for expr in dashboard_exprs() {
        named.extend(
            metric_names(&expr)
                .into_iter()
                .map(|n| (n, "the dashboard")),
        );
    }
    let rule_exprs: Vec<&str> = rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("expr:"))
        .collect();
    assert!(
        rule_exprs.len() >= 8,
        "the alert rules' exprs: {rule_exprs:?}"
    );
    for expr in &rule_exprs {
        named.extend(
            metric_names(expr)
                .into_iter()
                .map(|n| (n, "the alert rules")),
        );
    }
    assert!(named.len() >= 40, "names read: {named:?}");
    let missing: Vec<String> = named
        .iter()
        .filter(|(name, _)| !exported(name))
        .map(|(name, from)| format!("{name} (named by {from})"))
        .collect();
    assert!(
        missing.is_empty(),
        "metrics the router does not export:\n{}\n\nexported families: {families:?}",
        missing.join("\n")
    );
}
