//! Selection policies as plugins (ABI 2): a `.so` selection policy books its own
//! choice; one that errors, panics or answers out of range falls back to the
//! built-in default for that booking, counted per policy; one that commits KV
//! copies is held to rule R5 like `kvcr`. Real config files, the real
//! `fixture_misbehaving` `.so` and the router's own booking path (replay).

use kvhint::config::Role;
use kvhint::selection::FallbackReason;
use kvhint_e2e::trace::{request, stored, tokens, worker};
use kvhint_e2e::{action_types, config_file, replay_records, snapshot_of};
use serde_json::Value;

const BS: usize = 4;

/// Three hint-capable decode workers; 3 holds prompt A, 2 holds half of it.
fn trace() -> Vec<Value> {
    let a = tokens(1, 16);
    vec![
        worker(1, 0, "decode", true, "decode"),
        worker(2, 0, "decode", true, "decode"),
        worker(3, 0, "decode", true, "decode"),
        stored(3, 0, &a, BS, 3000),
        stored(2, 0, &a[..8], BS, 2000),
        request("r1", "decode", &a),
        request("r2", "decode", &tokens(1, 12)),
        request("r3", "decode", &tokens(500, 8)),
    ]
}

fn config(selection: &str) -> kvhint_e2e::ConfigFixture {
    config_file(&format!(
        "plugins:\n  files: ['{{so:fixture_misbehaving}}']\nrouter: {{block_size: {BS}}}\nworker_selection:\n  decode:\n{selection}"
    ))
}

fn booked(bookings: &[Value]) -> Vec<u64> {
    bookings
        .iter()
        .map(|b| b["worker_id"].as_u64().unwrap())
        .collect()
}

#[test]
fn a_plugin_selection_policy_books_its_own_choice() {
    let fixture = config("    type: wayward\n    parameters: {mode: last}\n    hints: []\n");
    let (snapshot, _loader) = snapshot_of(&fixture, None).unwrap();
    let role = snapshot.role(Role::Decode).unwrap();
    assert!(role
        .booking_selection()
        .origin
        .to_string()
        .contains("fixture-misbehaving"));
    assert!(
        role.on_kv_path,
        "a KV-aware plugin puts the role on the KV path"
    );
    let (bookings, errors) = replay_records(&snapshot, &trace());
    assert!(errors.is_empty(), "{errors}");
    // The last candidate every time: not what the default cost would pick.
    assert_eq!(booked(&bookings), [3, 3, 3]);
    assert!(bookings
        .iter()
        .all(|b| b.get("selection_fallback").is_none()));
    // Each booking names the policy that placed it: the plugin's, not the default.
    for booking in &bookings {
        assert_eq!(booking["selection_policy"], "wayward", "{booking}");
    }
    let stats = &role.booking_selection().stats;
    assert_eq!(stats.calls.get(), 3);
    for reason in FallbackReason::ALL {
        assert_eq!(stats.fallbacks(reason), 0);
    }
}

#[test]
fn every_failure_of_a_selection_policy_falls_back_to_the_default_and_is_counted() {
    // What the built-in default books for the same trace.
    let default = config("    type: dynamo-default-cost-fn\n    hints: []\n");
    let (snapshot, _loader) = snapshot_of(&default, None).unwrap();
    let (expected, errors) = replay_records(&snapshot, &trace());
    assert!(errors.is_empty(), "{errors}");
    for booking in &expected {
        assert_eq!(
            booking["selection_policy"], "dynamo-default-cost-fn",
            "{booking}"
        );
    }
    let expected = booked(&expected);
    assert_ne!(expected, [3, 3, 3], "the default must differ from `last`");

    for (mode, reason) in [
        ("error", FallbackReason::Error),
        ("panic", FallbackReason::Panic),
        ("out_of_range", FallbackReason::OutOfRange),
        // A committed copy from a policy that never declared it commits any.
        ("undeclared_copy", FallbackReason::OutOfRange),
    ] {
        let fixture = config(&format!(
            "    type: wayward\n    parameters: {{mode: {mode}}}\n    hints: []\n"
        ));
        let (snapshot, _loader) = snapshot_of(&fixture, None).unwrap();
        let (bookings, errors) = replay_records(&snapshot, &trace());
        assert!(errors.is_empty(), "{mode}: no booking fails: {errors}");
        assert_eq!(
            booked(&bookings),
            expected,
            "{mode}: booked as the default books"
        );
        for booking in &bookings {
            assert_eq!(
                booking["selection_fallback"].as_str(),
                Some(reason.as_str()),
                "{mode}: {booking}"
            );
            // Placed by the built-in default, and the booking says so.
            assert_eq!(
                booking["selection_policy"], "dynamo-default-cost-fn",
                "{mode}: {booking}"
            );
            assert!(booking["committed_copy"].is_null(), "{mode}: {booking}");
        }
        let stats = &snapshot
            .role(Role::Decode)
            .unwrap()
            .booking_selection()
            .stats;
        assert_eq!(stats.fallbacks(reason), 3, "{mode}");
        let others: u64 = FallbackReason::ALL
            .iter()
            .filter(|r| **r != reason)
            .map(|r| stats.fallbacks(*r))
            .sum();
        assert_eq!(others, 0, "{mode}");
    }
}

#[test]
fn a_selection_plugin_that_commits_copies_is_held_to_r5_and_its_copy_is_fetched() {
    // Declares commitments: without exactly one sender the role is refused.
    let none =
        config("    type: wayward\n    parameters: {mode: copy, commits: true}\n    hints: []\n");
    let errors = snapshot_of(&none, None).err().expect("refused").0;
    let text: Vec<String> = errors.iter().map(|e| e.to_string()).collect();
    assert!(
        text.iter()
            .any(|e| e.contains("commits KV copies") && e.contains("wayward")),
        "{text:?}"
    );
    // With kv_fetch as the sender, the committed copy goes out as a kv.fetch
    // naming the source's own engine hashes.
    let sent = config(
        "    type: wayward\n    parameters: {mode: copy, commits: true}\n    hints: [{type: kv_fetch}]\n",
    );
    let (snapshot, _loader) = snapshot_of(&sent, None).unwrap();
    assert!(snapshot.role(Role::Decode).unwrap().commits_kv_copies);
    let (bookings, errors) = replay_records(&snapshot, &trace());
    assert!(errors.is_empty(), "{errors}");
    let first = &bookings[0];
    assert!(first.get("selection_fallback").is_none(), "{first}");
    let copy = &first["committed_copy"];
    assert_eq!(copy["source_worker_id"], 3, "{first}");
    assert_eq!(action_types(first), ["kv.fetch"]);
    let hashes = &first["hint"]["actions"][0]["payload"]["block_hashes"];
    assert_eq!(
        hashes,
        &serde_json::json!([3000, 3001, 3002, 3003]),
        "{first}"
    );
}

#[test]
fn a_selection_plugin_that_is_not_kv_aware_takes_no_hints() {
    let fixture = config(
        "    type: wayward\n    parameters: {mode: last, kv_aware: false}\n    hints: [{type: kv_fetch}]\n",
    );
    let errors = snapshot_of(&fixture, None).err().expect("refused").0;
    let text: Vec<String> = errors.iter().map(|e| e.to_string()).collect();
    assert!(
        text.iter()
            .any(|e| e.contains("hints run only on the KV path")
                && e.contains("`wayward` is not KV-aware")),
        "{text:?}"
    );
}

#[test]
fn a_selection_plugin_that_keeps_panicking_is_quarantined_until_reload() {
    let fixture = config("    type: wayward\n    parameters: {mode: panic}\n    hints: []\n");
    let (snapshot, _loader) = snapshot_of(&fixture, None).unwrap();
    let mut records = trace();
    for n in 4..=6 {
        records.push(request(&format!("r{n}"), "decode", &tokens(1, 16)));
    }
    let (bookings, errors) = replay_records(&snapshot, &records);
    assert!(errors.is_empty(), "every booking still goes out: {errors}");
    assert_eq!(bookings.len(), 6);
    let reasons: Vec<&str> = bookings
        .iter()
        .map(|b| b["selection_fallback"].as_str().unwrap())
        .collect();
    // Three panics (router.quarantine_after_panics), then it is not called.
    assert_eq!(
        reasons,
        [
            "panic",
            "panic",
            "panic",
            "quarantined",
            "quarantined",
            "quarantined"
        ]
    );
    let stage = snapshot.role(Role::Decode).unwrap().booking_selection();
    assert!(stage.is_quarantined());
    assert_eq!(
        stage.quarantine().map(|q| q.as_str()),
        Some("panics"),
        "the reason status reports"
    );
    assert_eq!(stage.stats.calls.get(), 3);
    assert_eq!(
        stage
            .stats
            .quarantines
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    // A reload builds a fresh instance: it is called again.
    let (reloaded, _loader) = snapshot_of(&fixture, None).unwrap();
    assert!(!reloaded
        .role(Role::Decode)
        .unwrap()
        .booking_selection()
        .is_quarantined());
    let (again, _) = replay_records(&reloaded, &trace()[..6]);
    assert_eq!(again[0]["selection_fallback"], "panic");
}
