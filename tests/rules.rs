//! Rules R1–R6 and R9 of the rules table in docs/architecture.md, each on real
//! bookings: a real config file, real plugin `.so` files, the router's own
//! booking path.

use kvhint::config::RouterMode;
use kvhint_e2e::trace::{release, request, stored, tokens, worker};
use kvhint_e2e::{action_types, config_file, kvhint_bin, replay_records, snapshot_of};
use serde_json::{json, Value};
use std::process::Command;

const BS: usize = 4;

fn workers_booked(bookings: &[Value]) -> Vec<(u64, u64)> {
    bookings
        .iter()
        .map(|b| {
            (
                b["worker_id"].as_u64().unwrap(),
                b["dp_rank"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// A decode pool: 1 and 2 cold and hint-capable, 3 holding prompt A (16
/// tokens) and prompt C (8 tokens); then requests that exercise selection.
fn decode_trace() -> Vec<Value> {
    let a = tokens(1, 16);
    let c = tokens(201, 8);
    vec![
        worker(1, 0, "decode", true, "decode"),
        worker(2, 0, "decode", true, "decode"),
        worker(3, 0, "decode", true, "decode"),
        stored(3, 0, &a, BS, 3000),
        stored(3, 0, &c, BS, 3100),
        request("warm", "decode", &c),
        request("r1", "decode", &a),
        request("r2", "decode", &tokens(1, 12)),
        release("warm"),
        request("r3", "decode", &a),
    ]
}

#[test]
fn r1_hint_policies_never_change_the_booked_worker() {
    let plain = config_file(
        "router: {block_size: 4}\nworker_selection:\n  decode:\n    type: kvcr\n    parameters: {shared_cache_multiplier: 0.75}\n    hints: [{type: kv_fetch}]\n",
    );
    // The same selection with every kind of hint policy around the sender:
    // ones that add actions, panic, error and return malformed actions.
    let busy = config_file(
        "plugins:\n  files: ['{so:harness_prefetch}', '{so:fixture_misbehaving}']\nrouter: {block_size: 4}\nworker_selection:\n  decode:\n    type: kvcr\n    parameters: {shared_cache_multiplier: 0.75}\n    hints:\n      - type: echo\n      - type: panics\n      - type: kv_fetch\n      - type: errors\n      - type: malformed\n        parameters: {kind: not_object}\n      - type: harness_prefetch\n      - type: burst\n        parameters: {count: 40}\n",
    );
    let (plain, _l1) = snapshot_of(&plain, None).unwrap();
    let (busy, _l2) = snapshot_of(&busy, None).unwrap();
    let (a, err_a) = replay_records(&plain, &decode_trace());
    let (b, err_b) = replay_records(&busy, &decode_trace());
    assert!(err_a.is_empty() && err_b.is_empty(), "{err_a}{err_b}");
    assert_eq!(workers_booked(&a), workers_booked(&b));
    assert_eq!(a.len(), 4);
    // The busy role really did run its policies (and some failed).
    assert!(b
        .iter()
        .any(|x| !x["policy_failures"].as_array().unwrap().is_empty()));
    assert!(b
        .iter()
        .any(|x| action_types(x).contains(&"test.echo".to_string())));
}

#[test]
fn r2_role_entry_forms_and_hint_names() {
    // A bare string, a mapping without hints, and one type listed twice with
    // distinct names: all valid.
    let fixture = config_file(
        "plugins:\n  files: ['{so:harness_prefetch}']\nworker_selection:\n  prefill: dynamo-default-cost-fn\n  aggregated:\n    type: dynamo-default-cost-fn\n  decode:\n    type: dynamo-default-cost-fn\n    hints:\n      - type: harness_prefetch\n        name: near\n        parameters: {max_blocks: 2}\n      - type: harness_prefetch\n        name: far\n        parameters: {max_blocks: 64}\n      - type: kv_fetch\n",
    );
    let (snapshot, _loader) = snapshot_of(&fixture, None).unwrap();
    let names: Vec<_> = snapshot
        .role(kvhint::config::Role::Decode)
        .unwrap()
        .hints
        .policies()
        .iter()
        .map(|p| (p.name.clone(), p.type_name.clone()))
        .collect();
    assert_eq!(
        names,
        [
            ("near".to_string(), "harness_prefetch".to_string()),
            ("far".to_string(), "harness_prefetch".to_string()),
            ("kv_fetch".to_string(), "kv_fetch".to_string()),
        ],
        "name defaults to type"
    );

    // The same type twice without names, and a duplicate name: refused.
    let fixture = config_file(
        "worker_selection:\n  decode:\n    type: dynamo-default-cost-fn\n    hints:\n      - type: kv_fetch\n      - type: kv_fetch\n      - type: kv_fetch\n        name: x\n      - type: kv_fetch\n        name: x\n",
    );
    let errors = snapshot_of(&fixture, None).err().unwrap().to_string();
    assert!(
        errors.contains(
            ":6:9: worker_selection.decode.hints[1]: this role lists hint type `kv_fetch` twice"
        ),
        "{errors}"
    );
    assert!(
        errors.contains(":9:9: worker_selection.decode.hints[3]: duplicate hint name `x`"),
        "{errors}"
    );
}

#[test]
fn r3_empty_hints_run_none_and_absent_hints_run_the_defaults_in_order() {
    let fixture = config_file(
        "plugins:\n  files: ['{so:fixture_misbehaving}']\nrouter: {block_size: 4}\nworker_selection:\n  decode: kvcr\n  aggregated:\n    type: dynamo-default-cost-fn\n    hints: []\n  prefill: dynamo-default-cost-fn\n",
    );
    let (snapshot, _loader) = snapshot_of(&fixture, None).unwrap();
    let resolved = |role| -> Vec<String> {
        snapshot
            .role(role)
            .unwrap()
            .hints
            .policies()
            .iter()
            .map(|p| p.name.clone())
            .collect()
    };
    use kvhint::config::Role;
    // Registered for kvcr first (kv_fetch), then for any selection (echo).
    assert_eq!(resolved(Role::Decode), ["kv_fetch", "echo"]);
    assert_eq!(resolved(Role::Prefill), ["echo"]);
    assert!(resolved(Role::Aggregated).is_empty());

    // On a booking, the actions come in that order too.
    let mut records = decode_trace();
    records.push(worker(9, 0, "aggregated", true, "agg"));
    records.push(request("agg", "aggregated", &tokens(1, 8)));
    let (bookings, errors) = replay_records(&snapshot, &records);
    assert!(errors.is_empty(), "{errors}");
    let r1 = bookings.iter().find(|b| b["request_id"] == "r1").unwrap();
    assert_eq!(action_types(r1), ["kv.fetch", "test.echo"]);
    let agg = bookings.iter().find(|b| b["request_id"] == "agg").unwrap();
    assert_eq!(agg["hint"], Value::Null);
    assert_eq!(agg["hint_skipped"], "no_policies");
}

#[test]
fn r4_hints_only_on_the_kv_path() {
    let listed = config_file(
        "worker_selection:\n  decode:\n    type: dynamo-default-cost-fn\n    hints:\n      - type: kv_fetch\n",
    );
    // Fine under kv; a start-up error under round-robin and random.
    assert!(snapshot_of(&listed, None).is_ok());
    for mode in [RouterMode::RoundRobin, RouterMode::Random] {
        let errors = snapshot_of(&listed, Some(mode)).err().unwrap().to_string();
        assert!(
            errors.contains(&format!(
                "hints run only on the KV path, but the router mode is `{mode}`"
            )),
            "{errors}"
        );
        assert!(
            errors.contains(":4:5: worker_selection.decode.hints"),
            "{errors}"
        );
    }
    // `kvhint check --router-mode round-robin` says so and exits 1.
    let output = Command::new(kvhint_bin())
        .args(["check", "--router-mode", "round-robin", "--config"])
        .arg(&listed.path)
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&output.stderr).contains("hints run only on the KV path"));

    // Default hints simply do not run there.
    let defaults = config_file("router: {block_size: 4}\nworker_selection:\n  decode: kvcr\n");
    let (snapshot, _loader) = snapshot_of(&defaults, Some(RouterMode::RoundRobin)).unwrap();
    assert!(snapshot
        .role(kvhint::config::Role::Decode)
        .unwrap()
        .hints
        .is_empty());
    let (bookings, _) = replay_records(&snapshot, &decode_trace());
    assert!(bookings
        .iter()
        .all(|b| b["hint"].is_null() && b["hint_skipped"] == "not_kv_path"));
    // Round-robin really books in turn.
    assert_eq!(workers_booked(&bookings), [(1, 0), (2, 0), (3, 0), (1, 0)]);

    // Under --router-mode kv, a role whose selection policy is not KV-aware is
    // off the KV path too: listing hints there is an error, and no default runs.
    let listed_rr = config_file(
        "worker_selection:\n  decode:\n    type: round-robin\n    hints: [{type: kv_fetch}]\n",
    );
    let errors = snapshot_of(&listed_rr, None).err().unwrap().to_string();
    assert!(
        errors.contains("its selection policy `round-robin` is not KV-aware"),
        "{errors}"
    );
    let bare_rr =
        config_file("router: {block_size: 4}\nworker_selection:\n  decode: round-robin\n");
    let (snapshot, _loader) = snapshot_of(&bare_rr, None).unwrap();
    let (bookings, _) = replay_records(&snapshot, &decode_trace());
    assert!(bookings.iter().all(|b| b["hint_skipped"] == "not_kv_path"));
}

#[test]
fn r5_a_copy_committing_selection_needs_exactly_one_kv_copy_sender() {
    let none = config_file(
        "plugins:\n  files: ['{so:harness_prefetch}']\nworker_selection:\n  decode:\n    type: kvcr\n    parameters: {shared_cache_multiplier: 0.5}\n    hints: [{type: harness_prefetch}]\n",
    );
    let errors = snapshot_of(&none, None).err().unwrap().to_string();
    assert!(
        errors.contains(
            ":5:5: worker_selection.decode: role decode: selection policy `kvcr` commits KV copies"
        ),
        "{errors}"
    );
    assert!(
        errors.contains("none of its hint policies declares it (resolved: [harness_prefetch])"),
        "{errors}"
    );

    let two = config_file(
        "worker_selection:\n  decode:\n    type: kvcr\n    hints:\n      - type: kv_fetch\n      - type: kv_fetch\n        name: second_fetch\n",
    );
    let errors = snapshot_of(&two, None).err().unwrap().to_string();
    assert!(
        errors.contains("2 declare it: kv_fetch, second_fetch"),
        "{errors}"
    );

    // A multiplier of 0 commits nothing, so no sender is needed.
    let zero = config_file(
        "plugins:\n  files: ['{so:harness_prefetch}']\nworker_selection:\n  decode:\n    type: kvcr\n    parameters: {shared_cache_multiplier: 0}\n    hints: [{type: harness_prefetch}]\n",
    );
    assert!(snapshot_of(&zero, None).is_ok());
}

#[test]
fn r6_no_hint_and_no_committed_copy_for_a_worker_without_router_hint() {
    let fixture = config_file(
        "plugins:\n  files: ['{so:fixture_misbehaving}']\nrouter: {block_size: 4}\nworker_selection:\n  decode:\n    type: kvcr\n    parameters: {shared_cache_multiplier: 1.0}\n    hints: [{type: kv_fetch}, {type: echo}]\n",
    );
    let (snapshot, _loader) = snapshot_of(&fixture, None).unwrap();
    let a = tokens(1, 16);
    let busy = tokens(900, 8);
    let records = vec![
        // Worker 1 cannot receive hints; worker 3 holds prompt A and is warm
        // with another prompt.
        worker(1, 0, "decode", false, ""),
        worker(3, 0, "decode", true, "decode"),
        stored(3, 0, &a, BS, 3000),
        stored(3, 0, &busy, BS, 3100),
        request("busy", "decode", &busy),
        // Were worker 3's copy credited to worker 1, idle 1 would win r1 with a
        // committed copy it could never be told about. It is not: 3 wins.
        request("r1", "decode", &a),
        // With 3 busier, worker 1 wins on load: no hint, no copy.
        request("r2", "decode", &a),
        release("r1"),
        // A hint-capable idle worker wins through the credit: copy committed.
        worker(2, 0, "decode", true, "decode"),
        request("r3", "decode", &a),
    ];
    let (bookings, errors) = replay_records(&snapshot, &records);
    assert!(errors.is_empty(), "{errors}");
    let by_id = |id: &str| bookings.iter().find(|b| b["request_id"] == id).unwrap();
    assert_eq!(by_id("r1")["worker_id"], 3);
    assert_eq!(by_id("r1")["committed_copy"], Value::Null);
    let r2 = by_id("r2");
    assert_eq!(r2["worker_id"], 1);
    assert_eq!(r2["committed_copy"], Value::Null);
    assert_eq!(r2["hint"], Value::Null);
    assert_eq!(r2["hint_skipped"], "worker_not_hint_capable");
    assert!(
        r2["policy_failures"].as_array().unwrap().is_empty(),
        "no policy ran"
    );
    let r3 = by_id("r3");
    assert_eq!(r3["worker_id"], 2, "{r3}");
    assert_eq!(r3["committed_copy"]["source_worker_id"], 3);
    // One message, carrying the copy first.
    assert_eq!(action_types(r3), ["kv.fetch", "test.echo"]);
    assert_eq!(r3["hint"]["message_id"], "r3");
}

fn fetch_payload(booking: &Value) -> Value {
    let actions = booking["hint"]["actions"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert!(actions.len() <= 1, "one kv.fetch at most: {booking}");
    actions
        .first()
        .map(|a| a["payload"].clone())
        .unwrap_or(Value::Null)
}

#[test]
fn r9_kv_fetch_sends_the_committed_copy() {
    let fixture = config_file(
        "router: {block_size: 4}\nworker_selection:\n  decode:\n    type: kvcr\n    parameters: {shared_cache_multiplier: 0.75}\n",
    );
    let (snapshot, _loader) = snapshot_of(&fixture, None).unwrap();
    let (bookings, errors) = replay_records(&snapshot, &decode_trace());
    assert!(errors.is_empty(), "{errors}");
    let r1 = bookings.iter().find(|b| b["request_id"] == "r1").unwrap();
    assert_eq!(r1["worker_id"], 1);
    assert_eq!(
        r1["committed_copy"],
        json!({"source_worker_id": 3, "source_dp_rank": 0, "first_block": 0, "last_block": 4})
    );
    assert_eq!(
        fetch_payload(r1),
        json!({"source_control_endpoint": "tcp://10.0.0.3:23280", "block_hashes": [3000, 3001, 3002, 3003]})
    );
}

/// R10 with SGLang's signed hashes: a `kv.fetch` names a source's hashes as its
/// engine published them. In a fleet whose engines publish signed 64-bit hashes the
/// same bits go out negative; in one publishing them unsigned, as they are. The
/// router's writer does it as the policy passes the hashes on (no rewrite after).
#[test]
fn r10_a_kv_fetch_names_hashes_as_the_source_engine_published_them() {
    use kvhint::domain::{Role, WorkerKey};
    use kvhint::router::index::{KvEvent, StoredBlock};
    use kvhint::router::Router;
    let (snapshot, _loader, _fixture) = kvhint_e2e::kvcr_snapshot();
    let role = snapshot.role(Role::Decode).unwrap();
    let prompt: Vec<u32> = (0..64).collect();
    let fetched = |signed: bool| {
        let router = Router::new(16);
        for id in 0..2 {
            router
                .register_worker(kvhint_e2e::decode_worker(id))
                .unwrap();
        }
        let holder = WorkerKey {
            worker_id: 1,
            dp_rank: 0,
        };
        let event = KvEvent::stored(
            None,
            prompt
                .chunks_exact(16)
                .enumerate()
                .map(|(i, chunk)| StoredBlock {
                    block_hash: [u64::MAX - 4, 7, 1 << 63, 8][i],
                    token_ids: chunk.into(),
                })
                .collect(),
        );
        router.apply_kv_event(holder, event).unwrap();
        if signed {
            assert!(router.mark_signed_hashes(holder));
        }
        let book = |request_id: &str| {
            router
                .book(
                    role,
                    &kvhint_e2e::replay::decode_request(request_id, &prompt),
                )
                .unwrap()
        };
        // Load the holder so kvcr books the cold worker on the holder's copy.
        for i in 0..3 {
            let id = format!("load-{i}");
            if book(&id).worker != holder {
                router.release(&id).unwrap();
            }
        }
        let booking = book("r");
        assert_eq!(booking.worker.worker_id, 0, "{booking:?}");
        let message: Value =
            serde_json::from_str(booking.hint.message().expect("a hint").get()).unwrap();
        message["actions"][0]["payload"]["block_hashes"].clone()
    };
    assert_eq!(fetched(true), json!([-5, 7, i64::MIN, 8]));
    assert_eq!(fetched(false), json!([u64::MAX - 4, 7, 1u64 << 63, 8]));
}

/// A committed copy comes only from a peer that could send it: one of the booked
/// worker's own worker type, taking hints, with a control endpoint for its rank.
/// Longer prefixes on peers missing any one of those are passed over.
#[test]
fn r6_a_committed_copy_comes_only_from_an_eligible_peer() {
    let fixture = config_file(
        "router: {block_size: 4}\nworker_selection:\n  decode:\n    type: kvcr\n    parameters: {shared_cache_multiplier: 0.75}\n",
    );
    let (snapshot, _loader) = snapshot_of(&fixture, None).unwrap();
    let prompt = tokens(500, 32);
    let records = vec![
        worker(1, 0, "decode", true, "decode"),
        // Wins on its own cache unless a peer's copy is credited to worker 1.
        worker(2, 0, "decode", false, ""),
        stored(2, 0, &prompt[..4], BS, 2000),
        // The whole prompt, but another worker type.
        worker(3, 0, "prefill", true, "other"),
        stored(3, 0, &prompt, BS, 3000),
        // The whole prompt and the right type, but no router_hint.
        json!({"type": "worker", "worker_id": 4, "dp_rank": 0, "role": "prefill",
               "runtime_data": {"router_hint": false, "router_hint_worker_type": "decode",
                                "router_hint_source_control_endpoints": {"0": "tcp://10.0.0.4:23280"}}}),
        stored(4, 0, &prompt, BS, 4000),
        // The whole prompt, the right type and router_hint, but no endpoint for its rank.
        json!({"type": "worker", "worker_id": 6, "dp_rank": 0, "role": "prefill",
               "runtime_data": {"router_hint": true, "router_hint_worker_type": "decode",
                                "router_hint_source_control_endpoints": {"1": "tcp://10.0.0.6:23281"}}}),
        stored(6, 0, &prompt, BS, 6000),
        // Half of it, from an eligible peer.
        worker(5, 0, "prefill", true, "decode"),
        stored(5, 0, &prompt[..16], BS, 5000),
        request("r", "decode", &prompt),
    ];
    let (bookings, errors) = replay_records(&snapshot, &records);
    assert!(errors.is_empty(), "{errors}");
    let booking = bookings.last().unwrap();
    assert_eq!(booking["worker_id"], 1, "{booking}");
    assert_eq!(
        booking["committed_copy"],
        json!({"source_worker_id": 5, "source_dp_rank": 0, "first_block": 0, "last_block": 4}),
        "{booking}"
    );
    assert_eq!(
        fetch_payload(booking)["source_control_endpoint"],
        "tcp://10.0.0.5:23280"
    );
}

/// Worker 10 (aggregated, default cost fn: no commitments) holds one block of
/// the prompt and is booked; peers hold more, and kv_fetch picks one best
/// effort.
fn best_effort(min_additional_blocks: u32, peers: &[(u64, u32, usize, bool, &str)]) -> Value {
    let fixture = config_file(&format!(
        "router: {{block_size: 4}}\nworker_selection:\n  aggregated:\n    type: dynamo-default-cost-fn\n    hints:\n      - type: kv_fetch\n        parameters: {{min_additional_blocks: {min_additional_blocks}}}\n"
    ));
    let (snapshot, _loader) = snapshot_of(&fixture, None).unwrap();
    let prompt = tokens(100, 32);
    let mut records = vec![
        worker(10, 0, "aggregated", true, "agg"),
        stored(10, 0, &prompt[..4], BS, 10_000),
    ];
    // Peers serve another role, so worker 10 is the only candidate; a peer's
    // eligibility is its worker type, not its role.
    for &(id, rank, blocks, hint, kind) in peers {
        records.push(worker(id, rank, "prefill", hint, kind));
        records.push(stored(
            id,
            rank,
            &prompt[..blocks * BS],
            BS,
            id * 1000 + rank as u64 * 100,
        ));
    }
    records.push(request("r", "aggregated", &prompt));
    let (bookings, errors) = replay_records(&snapshot, &records);
    assert!(errors.is_empty(), "{errors}");
    let booking = bookings.last().unwrap().clone();
    assert_eq!(booking["worker_id"], 10, "{booking}");
    assert_eq!(booking["committed_copy"], Value::Null);
    booking
}

#[test]
fn r9_kv_fetch_best_effort_names_the_longest_eligible_peer() {
    let booking = best_effort(
        1,
        &[
            (20, 0, 3, true, "agg"),
            (21, 0, 6, true, "agg"),
            // Longer, but ineligible: another worker type; no router_hint.
            (22, 0, 8, true, "other"),
            (23, 0, 8, false, ""),
        ],
    );
    assert_eq!(
        fetch_payload(&booking),
        json!({"source_control_endpoint": "tcp://10.0.0.21:23280", "block_hashes": [21000, 21001, 21002, 21003, 21004, 21005]})
    );
}

#[test]
fn r9_kv_fetch_min_additional_blocks() {
    // The booked worker holds 1 block, the peer 3: 2 more.
    let peers = [(20, 0, 3, true, "agg")];
    assert_eq!(fetch_payload(&best_effort(3, &peers)), Value::Null);
    assert_eq!(
        fetch_payload(&best_effort(2, &peers))["source_control_endpoint"],
        "tcp://10.0.0.20:23280"
    );
}

#[test]
fn r9_kv_fetch_ties_go_to_the_lowest_worker_id_then_dp_rank() {
    let booking = best_effort(
        1,
        &[
            (31, 0, 5, true, "agg"),
            (30, 1, 5, true, "agg"),
            (30, 2, 5, true, "agg"),
        ],
    );
    assert_eq!(
        fetch_payload(&booking)["source_control_endpoint"],
        "tcp://10.0.0.30:23281"
    );
}

#[test]
fn r7_actions_are_numbered_a1_to_a32_and_the_surplus_is_dropped_and_counted() {
    let fixture = config_file(
        "plugins:\n  files: ['{so:fixture_misbehaving}']\nrouter: {block_size: 4}\nworker_selection:\n  decode:\n    type: dynamo-default-cost-fn\n    hints:\n      - {type: burst, name: first, parameters: {count: 20, action_type: test.first}}\n      - {type: burst, name: second, parameters: {count: 20, action_type: test.second}}\n",
    );
    let (snapshot, _loader) = snapshot_of(&fixture, None).unwrap();
    let (bookings, errors) = replay_records(
        &snapshot,
        &[
            worker(1, 0, "decode", true, "decode"),
            request("r", "decode", &tokens(1, 8)),
        ],
    );
    assert!(errors.is_empty(), "{errors}");
    let actions = bookings[0]["hint"]["actions"].as_array().unwrap();
    let ids: Vec<&str> = actions
        .iter()
        .map(|a| a["action_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, (1..=32).map(|i| format!("a{i}")).collect::<Vec<_>>());
    assert_eq!(
        action_types(&bookings[0])
            .iter()
            .filter(|t| *t == "test.second")
            .count(),
        12
    );
    assert_eq!(bookings[0]["dropped_actions"], 8);
}

#[test]
fn r8_a_failing_policy_loses_only_its_own_actions_and_never_the_booking() {
    let fixture = config_file(
        "plugins:\n  files: ['{so:fixture_misbehaving}']\nrouter: {block_size: 4, quarantine_after_panics: 2}\nworker_selection:\n  decode:\n    type: dynamo-default-cost-fn\n    hints: [{type: panics}, {type: errors}, {type: malformed, parameters: {kind: not_object}}, {type: echo}]\n",
    );
    let (snapshot, _loader) = snapshot_of(&fixture, None).unwrap();
    let mut records = vec![worker(1, 0, "decode", true, "decode")];
    for i in 0..4 {
        records.push(request(&format!("r{i}"), "decode", &tokens(1, 8)));
        records.push(release(&format!("r{i}")));
    }
    let (bookings, errors) = replay_records(&snapshot, &records);
    assert!(errors.is_empty(), "{errors}");
    assert_eq!(bookings.len(), 4, "every booking went through");
    for (i, booking) in bookings.iter().enumerate() {
        // The well-behaved policy's action always goes out, as a1.
        assert_eq!(action_types(booking), ["test.echo"], "{booking}");
        let kinds: Vec<&str> = booking["policy_failures"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f["kind"].as_str().unwrap())
            .collect();
        // The panicking policy is quarantined after its second panic.
        let expected: &[&str] = if i < 2 {
            &["panic", "error", "malformed"]
        } else {
            &["error", "malformed"]
        };
        assert_eq!(kinds, expected, "booking {i}");
    }
}

#[test]
fn r10_the_hint_is_the_engine_envelope_with_exact_u64_hashes() {
    let fixture = config_file(
        "router: {block_size: 4}\nworker_selection:\n  decode:\n    type: dynamo-default-cost-fn\n    hints: [{type: kv_fetch}]\n",
    );
    let (snapshot, _loader) = snapshot_of(&fixture, None).unwrap();
    let prompt = tokens(1, 8);
    // Engine hashes at the top of the u64 range: they must arrive as exact JSON
    // numbers, not as floats or strings.
    let big = u64::MAX - 1;
    let stored_big = json!({"type": "kv_event", "worker_id": 3, "dp_rank": 0, "event": {"stored": {
        "parent_block_hash": null,
        "blocks": [{"block_hash": big, "token_ids": &prompt[..4]}, {"block_hash": big - 1, "token_ids": &prompt[4..]}]}}});
    let records = [
        worker(1, 0, "decode", true, "decode"),
        worker(3, 0, "prefill", true, "decode"),
        stored_big,
        request("req-42", "decode", &prompt),
    ];
    let router = kvhint::router::Router::new(4);
    let mut out = Vec::new();
    let mut err = Vec::new();
    let trace: String = records.iter().map(|r| format!("{r}\n")).collect();
    kvhint::replay::replay(
        &router,
        &snapshot,
        std::path::Path::new("t"),
        trace.as_bytes(),
        &mut out,
        &mut err,
    )
    .unwrap();
    let line = String::from_utf8(out).unwrap();
    assert!(
        line.contains(&format!("\"block_hashes\":[{big},{}]", big - 1)),
        "exact digits: {line}"
    );
    let booking: Value = serde_json::from_str(line.trim()).unwrap();
    assert_eq!(
        booking["hint"],
        json!({
            "protocol_version": "0.1",
            "message_id": "req-42",
            "actions": [{
                "action_id": "a1",
                "action_type": "kv.fetch",
                "action_version": "1.0",
                "payload": {"source_control_endpoint": "tcp://10.0.0.3:23280", "block_hashes": [big, big - 1]}
            }]
        })
    );
}

#[test]
fn r11_the_specs_registration_snippet_compiles_and_loads_in_a_plugin() {
    // harness-prefetch registers itself with the spec's snippet, verbatim.
    let source = std::fs::read_to_string(
        kvhint_e2e::workspace_root().join("plugins/harness-prefetch/src/lib.rs"),
    )
    .unwrap();
    // The spec's snippet, line for line (indentation aside); the plugin adds one
    // parameter check between its two statements, which the spec leaves to
    // the author.
    let lines: Vec<&str> = source.lines().map(str::trim).collect();
    let at = |line: &str| lines.iter().position(|l| *l == line);
    let spec = [
        "registry.register_hint_policy(",
        "\"harness_prefetch\",",
        "Arc::new(|parameters| {",
        "let config: PrefetchConfig = parameters.deserialize()?;",
        "Ok(HintPolicyConstructor::shared(HarnessPrefetch::new(config)))",
        "}),",
        "[],",
        ")?;",
    ];
    let positions: Vec<Option<usize>> = spec.iter().map(|l| at(l)).collect();
    assert!(
        positions.iter().all(Option::is_some),
        "every line of the snippet: {positions:?}"
    );
    assert!(
        positions.windows(2).all(|w| w[0] < w[1]),
        "in order: {positions:?}"
    );
    // And that plugin, built, loads and registers what the snippet says.
    let fixture = config_file(
        "plugins:\n  files: ['{so:harness_prefetch}']\nworker_selection:\n  decode:\n    type: dynamo-default-cost-fn\n    hints: [{type: harness_prefetch, parameters: {max_blocks: 64}}]\n",
    );
    let (snapshot, _loader) = snapshot_of(&fixture, None).unwrap();
    let registered = snapshot.registry.get("harness_prefetch").unwrap();
    assert!(
        registered.default_hosts().is_empty(),
        "`[]`: runs only where listed"
    );
}

#[test]
fn r12_builtins_and_plugins_register_through_the_same_code_and_act_alike() {
    // The built-in kv_fetch (linked) and libkv_fetch.so (loaded).
    let builtin = kvhint::registry::Registry::with_builtins().unwrap();
    let (loaded, _loader, _dir) = kvhint_e2e::registry_of(&["kv_fetch"], kvhint_e2e::build_dir());
    let (a, b) = (
        builtin.get("kv_fetch").unwrap(),
        loaded.get("kv_fetch").unwrap(),
    );
    assert_eq!(a.default_hosts(), b.default_hosts());
    assert!(a.origin.to_string().starts_with("built-in"));
    assert!(b.origin.to_string().starts_with("plugin kv-fetch"));
    let construct = |r: &kvhint::registry::Registry| r.construct("kv_fetch", &json!({})).unwrap();
    let (pa, pb) = (construct(&builtin), construct(&loaded));
    assert_eq!(pa.commitments, pb.commitments);
    // Same hint for the same booking.
    let booking = kvhint_plugin_api::testing::TestBooking {
        request_id: "r".into(),
        worker: kvhint_plugin_api::testing::TestWorker::capable(1),
        block_size: 16,
        block_hashes: vec![1, 2, 3],
        peers: vec![kvhint_plugin_api::testing::TestPeer {
            worker: kvhint_plugin_api::testing::TestWorker::capable(2),
            block_hashes: vec![21, 22, 23],
        }],
        ..Default::default()
    };
    let run = |p| {
        let stage = kvhint::hints::HintStage::new(
            vec![kvhint::hints::HintPolicyInstance::new("kv_fetch", p)],
            kvhint::hints::HintLimits::default(),
        );
        booking.with_raw_context(|c| stage.run(c).message)
    };
    let (ma, mb) = (run(pa), run(pb));
    assert!(ma.is_some());
    assert_eq!(ma, mb);
}

/// Books the decode trace's first requests with the copy's sender `hints` (a plugin
/// from `plugin`): returns r1 as booked and worker 1's load afterwards.
fn r1_with_copy_sender(plugin: &str, hints: &str) -> (Value, kvhint::router::workers::Load) {
    let fixture = config_file(&format!(
        "plugins:\n  files: ['{{so:{plugin}}}']\nrouter: {{block_size: 4}}\nworker_selection:\n  decode:\n    type: kvcr\n    parameters: {{shared_cache_multiplier: 0.75}}\n    hints: [{{type: {hints}}}]\n"
    ));
    let (snapshot, _loader) = snapshot_of(&fixture, None).unwrap();
    let router = kvhint::router::Router::new(4);
    let (bookings, errors) = kvhint_e2e::replay_on(&router, &snapshot, &decode_trace()[..7]);
    assert!(errors.is_empty(), "{errors}");
    let r1 = bookings
        .iter()
        .find(|b| b["request_id"] == "r1")
        .unwrap()
        .clone();
    let (_, load) = router
        .workers()
        .into_iter()
        .find(|(w, _)| w.key.worker_id == 1)
        .unwrap();
    (r1, load)
}

#[test]
fn r5_a_committed_copy_whose_sender_fails_is_withdrawn_and_the_load_corrected() {
    let (r1, load) = r1_with_copy_sender("fixture_misbehaving", "copy_sender_fails");
    // kvcr booked worker 1 on worker 3's copy, but the copy's sender failed:
    // the booking no longer claims it, and worker 1 prefills all 4 blocks.
    assert_eq!(r1["worker_id"], 1);
    assert_eq!(r1["committed_copy"], Value::Null, "{r1}");
    assert_eq!(r1["policy_failures"][0]["kind"], "error");
    assert_eq!(load.prefill_blocks, 4);
}

#[test]
fn r8_a_payload_the_writer_refuses_withdraws_the_committed_copy_across_the_abi() {
    // A plugin on the raw ABI drives the router's writer by hand and breaks its
    // grammar (a second key where the first key's value belongs): the writer
    // refuses that policy's action where it is written, so nothing is sent, and the
    // copy the booking was committed to will not happen: the booked worker prefills it.
    let (r1, load) = r1_with_copy_sender("fixture_raw_abi", "raw_bad_json");
    assert_eq!(r1["worker_id"], 1);
    assert_eq!(r1["hint"], Value::Null, "{r1}");
    assert_eq!(r1["hint_skipped"], "no_actions", "{r1}");
    assert_eq!(r1["policy_failures"][0]["kind"], "malformed", "{r1}");
    assert!(
        r1["policy_failures"][0]["message"]
            .as_str()
            .unwrap()
            .contains("where the previous key's value belongs"),
        "{r1}"
    );
    assert_eq!(r1["committed_copy"], Value::Null, "{r1}");
    assert_eq!(load.prefill_blocks, 4);
}
