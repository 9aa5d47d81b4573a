//! The hint stage across the ABI with real plugins: rules R7 (numbering and the
//! cap), R8 (a failing policy loses only its own actions) and R10 (the engine
//! envelope).

use kvhint::hints::{FailureKind, HintLimits, HintPolicyInstance, HintStage, Quarantine};
use kvhint::registry::Registry;
use kvhint_e2e::{build_dir, registry_of, TempDir};
use kvhint_plugin_api::testing::{TestBooking, TestKvCopy, TestPeer, TestWorker};
use serde_json::{json, Value};
use std::sync::atomic::Ordering;

/// A registry with kv_fetch, harness_prefetch and the misbehaving fixture, all
/// loaded from their `.so` files.
fn registry() -> (Registry, kvhint::loader::Loader, TempDir) {
    registry_of(
        &["kv_fetch", "harness_prefetch", "fixture_misbehaving"],
        build_dir(),
    )
}

fn stage(registry: &Registry, items: &[(&str, &str, Value)]) -> HintStage {
    stage_with(registry, items, HintLimits::default())
}

fn stage_with(registry: &Registry, items: &[(&str, &str, Value)], limits: HintLimits) -> HintStage {
    let policies = items
        .iter()
        .map(|(name, type_name, parameters)| {
            HintPolicyInstance::new(*name, registry.construct(type_name, parameters).unwrap())
        })
        .collect();
    HintStage::new(policies, limits)
}

fn booking() -> TestBooking {
    TestBooking {
        request_id: "req-1".into(),
        worker: TestWorker::capable(1),
        cached_blocks: 1,
        prompt_tokens: 64,
        block_size: 16,
        selection_policy: "dynamo-default-cost-fn".into(),
        block_hashes: vec![101, 102, 103, 104],
        peers: vec![TestPeer {
            worker: TestWorker::capable(7),
            block_hashes: vec![11, 22, 33],
        }],
        ..Default::default()
    }
}

fn message(outcome: &kvhint::hints::HintOutcome) -> Value {
    serde_json::from_str(outcome.message.as_deref().expect("a hint message")).unwrap()
}

fn action_types(message: &Value) -> Vec<String> {
    message["actions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["action_type"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn both_plugins_answer_in_one_engine_envelope() {
    let (registry, ..) = registry();
    let stage = stage(
        &registry,
        &[
            ("kv_fetch", "kv_fetch", json!({})),
            (
                "harness_prefetch",
                "harness_prefetch",
                json!({"max_blocks": 2}),
            ),
        ],
    );
    let outcome = booking().with_raw_context(|context| stage.run(context));
    assert_eq!(
        message(&outcome),
        json!({
            "protocol_version": "0.1",
            "message_id": "req-1",
            "actions": [
                {"action_id": "a1", "action_type": "kv.fetch", "action_version": "1.0",
                 "payload": {"source_control_endpoint": "tcp://10.0.0.7:23280", "block_hashes": [11, 22, 33]}},
                {"action_id": "a2", "action_type": "kv.prefetch", "action_version": "1.0",
                 "payload": {"first_block": 1, "block_size": 16, "block_hashes": [102, 103]}},
            ]
        })
    );
    assert!(outcome.failures.is_empty());
}

#[test]
fn committed_copy_crosses_the_abi_into_kv_fetch() {
    let (registry, ..) = registry();
    let stage = stage(&registry, &[("kv_fetch", "kv_fetch", json!({}))]);
    let mut booking = booking();
    booking.committed_kv_copy = Some(TestKvCopy {
        source: TestWorker::capable(9),
        first_block: 1,
        block_hashes: vec![901, 902, 903],
    });
    let outcome = booking.with_raw_context(|context| stage.run(context));
    assert_eq!(
        message(&outcome)["actions"][0]["payload"],
        json!({"source_control_endpoint": "tcp://10.0.0.9:23280", "block_hashes": [901, 902, 903]})
    );
}

#[test]
fn the_whole_context_reaches_the_plugin_intact() {
    let (registry, ..) = registry();
    let stage = stage(&registry, &[("echo", "echo", json!({}))]);
    let mut booking = booking();
    booking.session_context = r#"{"session_id":"s-9"}"#.into();
    booking.worker.dp_rank = 3;
    let outcome = booking.with_raw_context(|context| stage.run(context));
    let seen = &message(&outcome)["actions"][0]["payload"];
    assert_eq!(
        *seen,
        json!({
            "request_id": "req-1", "worker_id": 1, "dp_rank": 3, "worker_type": "decode",
            "router_hint": true, "cached_blocks": 1, "prompt_len": 64, "block_size": 16,
            "session_context": "{\"session_id\":\"s-9\"}",
            "selection_policy": "dynamo-default-cost-fn",
            "block_hashes": [101, 102, 103, 104],
            "peers": [{"worker_id": 7, "dp_rank": 0, "cached_blocks": 3, "block_hashes": [11, 22, 33]}],
            "committed_kv_copy": null,
        })
    );
}

#[test]
fn panicking_policy_is_contained_and_quarantined_after_repeated_panics() {
    let (registry, ..) = registry();
    let stage = stage(
        &registry,
        &[
            (
                "before",
                "burst",
                json!({"count": 1, "action_type": "test.before"}),
            ),
            ("panics", "panics", json!({})),
            (
                "after",
                "burst",
                json!({"count": 1, "action_type": "test.after"}),
            ),
        ],
    );
    let quarantine_after = HintLimits::default().quarantine_after_panics;
    for round in 1..=quarantine_after + 2 {
        let outcome = booking().with_raw_context(|context| stage.run(context));
        // The others' actions still go out, numbered without a gap.
        let message = message(&outcome);
        assert_eq!(action_types(&message), ["test.before", "test.after"]);
        assert_eq!(message["actions"][1]["action_id"], "a2");
        if round <= quarantine_after {
            assert_eq!(outcome.failures.len(), 1, "round {round}");
            assert_eq!(outcome.failures[0].kind, FailureKind::Panic);
            assert!(outcome.failures[0]
                .message
                .contains("fixture panic for request req-1"));
        } else {
            assert!(
                outcome.failures.is_empty(),
                "quarantined policies are not called"
            );
        }
    }
    let panicking = &stage.policies()[1];
    let stats = &panicking.stats;
    assert_eq!(stats.panics.load(Ordering::Relaxed), quarantine_after);
    assert!(panicking.is_quarantined());
    assert_eq!(stats.quarantines.load(Ordering::Relaxed), 1);
    assert_eq!(stats.skipped_quarantined.load(Ordering::Relaxed), 2);
}

#[test]
fn erroring_policy_loses_only_its_own_actions() {
    let (registry, ..) = registry();
    let stage = stage(
        &registry,
        &[
            ("errors", "errors", json!({})),
            ("harness_prefetch", "harness_prefetch", json!({})),
        ],
    );
    let outcome = booking().with_raw_context(|context| stage.run(context));
    assert_eq!(action_types(&message(&outcome)), ["kv.prefetch"]);
    assert_eq!(outcome.failures[0].kind, FailureKind::Error);
    assert!(outcome.failures[0]
        .message
        .contains("cache tier unavailable"));
    let erroring = &stage.policies()[0];
    assert_eq!(erroring.stats.errors.load(Ordering::Relaxed), 1);
    assert!(!erroring.is_quarantined(), "errors do not quarantine");
}

#[test]
fn malformed_action_drops_that_policys_actions_only() {
    let (registry, ..) = registry();
    for (kind, expect) in [
        ("empty_type", "empty action_type"),
        ("empty_version", "empty action_version"),
        ("not_object", "not a JSON object"),
        ("not_json", "not a JSON object"),
    ] {
        let stage = stage(
            &registry,
            &[
                ("malformed", "malformed", json!({ "kind": kind })),
                ("after", "burst", json!({"count": 1})),
            ],
        );
        let outcome = booking().with_raw_context(|context| stage.run(context));
        // The fixture's good action is dropped with its bad one.
        assert_eq!(action_types(&message(&outcome)), ["test.burst"], "{kind}");
        assert_eq!(outcome.failures[0].kind, FailureKind::Malformed, "{kind}");
        assert!(
            outcome.failures[0].message.contains(expect),
            "{kind}: {}",
            outcome.failures[0].message
        );
    }
}

#[test]
fn forty_actions_from_two_policies_give_exactly_a1_to_a32() {
    let (registry, ..) = registry();
    let stage = stage(
        &registry,
        &[
            (
                "first",
                "burst",
                json!({"count": 20, "action_type": "test.first"}),
            ),
            (
                "second",
                "burst",
                json!({"count": 20, "action_type": "test.second"}),
            ),
        ],
    );
    let outcome = booking().with_raw_context(|context| stage.run(context));
    let message = message(&outcome);
    let actions = message["actions"].as_array().unwrap();
    let ids: Vec<&str> = actions
        .iter()
        .map(|a| a["action_id"].as_str().unwrap())
        .collect();
    let expected: Vec<String> = (1..=32).map(|i| format!("a{i}")).collect();
    assert_eq!(ids, expected);
    // Policy order is kept; the surplus comes off the later policy.
    let types = action_types(&message);
    assert_eq!(types.iter().filter(|t| *t == "test.first").count(), 20);
    assert_eq!(types.iter().filter(|t| *t == "test.second").count(), 12);
    assert_eq!(actions[20]["payload"], json!({"i": 0}));
    assert_eq!(outcome.dropped_over_cap, 8);
}

#[test]
fn no_actions_means_no_message() {
    let (registry, ..) = registry();
    let stage = stage(&registry, &[("noop", "noop", json!({}))]);
    let outcome = booking().with_raw_context(|context| stage.run(context));
    assert_eq!(outcome.message, None);
}

#[test]
fn unknown_action_types_pass_through_untouched() {
    let (registry, ..) = registry();
    let stage = stage(
        &registry,
        &[(
            "x",
            "burst",
            json!({"count": 1, "action_type": "vendor.custom-op"}),
        )],
    );
    let outcome = booking().with_raw_context(|context| stage.run(context));
    let message = message(&outcome);
    assert_eq!(message["actions"][0]["action_type"], "vendor.custom-op");
    assert_eq!(message["actions"][0]["payload"], json!({"i": 0}));
}

#[test]
fn constructor_errors_and_panics_are_reported_with_plugin_and_type() {
    let (registry, ..) = registry();
    for (type_name, expect) in [
        ("ctor_fails", "cache tier's address is not configured"),
        ("ctor_panics", "the provider panicked at"),
    ] {
        let error = registry.construct(type_name, &json!({})).err().unwrap();
        let text = error.to_string();
        assert!(text.contains(expect), "{text}");
        assert!(text.contains(&format!("\"{type_name}\"")), "{text}");
        assert!(text.contains("plugin fixture-misbehaving 0.1.0"), "{text}");
    }
    let error = registry
        .construct("harness_prefetch", &json!({"max_block": 3}))
        .err()
        .unwrap();
    assert!(
        error.to_string().contains("unknown field `max_block`"),
        "{error}"
    );
}

thread_local! {
    /// The scripted clock's reading, and how long each coming policy call takes.
    static SCRIPT: std::cell::RefCell<(u64, u32, std::collections::VecDeque<u64>)> =
        const { std::cell::RefCell::new((0, 0, std::collections::VecDeque::new())) };
}

/// A clock a stage reads twice per policy call (before and after): the second
/// reading is the first plus the next scripted duration, whatever the machine
/// did meanwhile. Bookings run on the test's own thread, so the script is too.
fn scripted_clock() -> u64 {
    SCRIPT.with(|script| {
        let (now, reads, durations) = &mut *script.borrow_mut();
        *reads += 1;
        if *reads % 2 == 0 {
            *now += durations
                .pop_front()
                .expect("a policy call the test did not script");
        }
        *now
    })
}

/// Scripts the coming policy calls' durations, in call order.
fn script(durations: &[u64]) {
    SCRIPT.with(|script| script.borrow_mut().2.extend(durations));
}

fn scripted_calls_left() -> usize {
    SCRIPT.with(|script| script.borrow().2.len())
}

const SLOW_NS: u64 = 2_000_000;

#[test]
fn a_policy_whose_calls_keep_running_over_its_budget_is_quarantined_until_reload() {
    let (registry, ..) = registry();
    let limits = HintLimits {
        budget_ns: 100_000,
        quarantine_after_overruns: 3,
        ..HintLimits::default()
    };
    // Every call of `slow` takes 2 ms by the stage's clock (20 times the 100 µs
    // budget), every call of `harness_prefetch` none: the clock is scripted, so
    // a slow moment of the machine cannot add an overrun.
    let stage = stage_with(
        &registry,
        &[
            ("slow", "slow", json!({"sleep_us": 0})),
            ("harness_prefetch", "harness_prefetch", json!({})),
        ],
        limits,
    )
    .with_clock(scripted_clock);
    for round in 1..=5 {
        if round <= 3 {
            script(&[SLOW_NS, 0]);
        } else {
            // Quarantined: only `harness_prefetch` is called.
            script(&[0]);
        }
        let outcome = booking().with_raw_context(|context| stage.run(context));
        let types = action_types(&message(&outcome));
        if round <= 3 {
            // An overrunning call finished: its actions still go out.
            assert_eq!(types, ["test.slow", "kv.prefetch"], "round {round}");
        } else {
            assert_eq!(types, ["kv.prefetch"], "round {round}: quarantined");
        }
        assert!(outcome.failures.is_empty(), "an overrun is not a failure");
    }
    assert_eq!(scripted_calls_left(), 0, "every scripted call was made");
    let slow = &stage.policies()[0];
    assert_eq!(slow.stats.over_budget.load(Ordering::Relaxed), 3);
    assert_eq!(slow.stats.skipped_quarantined.load(Ordering::Relaxed), 2);
    assert_eq!(slow.stats.quarantines.load(Ordering::Relaxed), 1);
    assert_eq!(slow.quarantine(), Some(Quarantine::OverBudget));
    assert!(!stage.policies()[1].is_quarantined());
}

#[test]
fn overruns_must_come_in_a_row_to_quarantine() {
    let (registry, ..) = registry();
    let limits = HintLimits {
        budget_ns: 100_000,
        quarantine_after_overruns: 2,
        ..HintLimits::default()
    };
    // Slow on every other call only: never two overruns in a row.
    let stage = stage_with(
        &registry,
        &[("slow", "slow", json!({"sleep_us": 0}))],
        limits,
    )
    .with_clock(scripted_clock);
    for call in 0..10 {
        script(&[if call % 2 == 0 { SLOW_NS } else { 0 }]);
        let outcome = booking().with_raw_context(|context| stage.run(context));
        assert_eq!(action_types(&message(&outcome)), ["test.slow"]);
    }
    let slow = &stage.policies()[0];
    assert_eq!(slow.stats.over_budget.load(Ordering::Relaxed), 5);
    assert!(!slow.is_quarantined());
    // Two in a row do.
    script(&[SLOW_NS, SLOW_NS]);
    for _ in 0..2 {
        booking().with_raw_context(|context| stage.run(context));
    }
    assert_eq!(slow.stats.over_budget.load(Ordering::Relaxed), 7);
    assert_eq!(slow.quarantine(), Some(Quarantine::OverBudget));
    // And no budget at all (0) counts nothing.
    let unbudgeted = stage_with(
        &registry,
        &[("slow", "slow", json!({"sleep_us": 0}))],
        HintLimits {
            budget_ns: 0,
            ..HintLimits::default()
        },
    )
    .with_clock(scripted_clock);
    script(&[SLOW_NS; 3]);
    for _ in 0..3 {
        booking().with_raw_context(|context| unbudgeted.run(context));
    }
    assert_eq!(
        unbudgeted.policies()[0]
            .stats
            .over_budget
            .load(Ordering::Relaxed),
        0
    );
}

#[test]
fn the_budget_comes_from_the_config_and_a_reload_lifts_the_quarantine() {
    let fixture = kvhint_e2e::config_file(
        "plugins:\n  files: ['{so:fixture_misbehaving}']\n  cache_dir: ./cache\nrouter: {block_size: 4, policy_budget_us: 100, quarantine_after_overruns: 3}\nworker_selection:\n  decode:\n    type: dynamo-default-cost-fn\n    hints: [{type: slow, parameters: {sleep_us: 2000}}]\n",
    );
    let mut records = vec![kvhint_e2e::trace::worker(1, 0, "decode", true, "decode")];
    for i in 0..5 {
        records.push(kvhint_e2e::trace::request(
            &format!("r{i}"),
            "decode",
            &kvhint_e2e::trace::tokens(1, 8),
        ));
        records.push(kvhint_e2e::trace::release(&format!("r{i}")));
    }
    let hinted = |snapshot: &kvhint::snapshot::Snapshot| -> Vec<bool> {
        let (bookings, _) = kvhint_e2e::replay_records(snapshot, &records);
        bookings
            .iter()
            .filter(|b| b["request_id"].is_string())
            .map(|b| kvhint_e2e::action_types(b) == ["test.slow"])
            .collect()
    };
    let (snapshot, _loader) = kvhint_e2e::snapshot_of(&fixture, None).unwrap();
    assert_eq!(hinted(&snapshot), [true, true, true, false, false]);
    let slow = &snapshot.roles[0].hints.policies()[0];
    assert_eq!(slow.quarantine(), Some(Quarantine::OverBudget));
    // A new snapshot (what a reload builds) starts the policy afresh.
    let (rebuilt, _loader) = kvhint_e2e::snapshot_of(&fixture, None).unwrap();
    assert!(!rebuilt.roles[0].hints.policies()[0].is_quarantined());
}
