//! A plugin crate linked into a router, beside the two the router already
//! links (`kv-fetch` and `kvhint-selection`): this test binary is such a
//! router, and this file is such a crate (`export_plugin!` below). That the
//! binary links at all is the first check: each crate's root symbol is named
//! after the crate, so three of them do not collide. The tests check that the
//! linked crate registers like a built-in, and that it leaves the router's own
//! panic hook in place: a panic inside its policy is still contained (the
//! booking loses only that policy's actions) and reaches the router's hook.

use kvhint::hints::{HintLimits, HintPolicyInstance, HintStage};
use kvhint::registry::{Origin, Registry};
use kvhint_plugin_api::prelude::*;
use kvhint_plugin_api::testing::{TestBooking, TestWorker};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

struct Explodes;

impl HintPolicy for Explodes {
    fn build_hints(&self, context: &HintContext<'_>, _: &mut Actions<'_>) -> Result<(), HintError> {
        panic!("linked policy panic for {}", context.request_id());
    }
}

fn register(registry: &mut HintRegistry) -> Result<(), RegistryError> {
    registry.register_hint_policy(
        "linked_explodes",
        Arc::new(|_| Ok(HintPolicyConstructor::shared(Explodes))),
        [],
    )
}

export_plugin!(register);

/// Panics the router's own hook saw, by message.
static SEEN: Mutex<Vec<String>> = Mutex::new(Vec::new());
static HOOK_CALLS: AtomicUsize = AtomicUsize::new(0);

#[test]
fn a_third_linked_crate_registers_and_leaves_the_routers_panic_hook_alone() {
    std::panic::set_hook(Box::new(|info| {
        HOOK_CALLS.fetch_add(1, Ordering::SeqCst);
        let text = info
            .payload()
            .downcast_ref::<String>()
            .cloned()
            .unwrap_or_default();
        SEEN.lock().unwrap_or_else(|e| e.into_inner()).push(text);
    }));

    let mut registry = Registry::with_builtins().expect("the built-ins register");
    registry
        .add_module(
            Origin::BuiltIn {
                crate_name: "linked-test".into(),
            },
            kvhint_plugin_module(),
        )
        .expect("a third linked crate registers");
    assert!(registry.get("kv_fetch").is_some());
    assert!(registry.get("kvcr").is_some());
    let constructed = registry
        .construct("linked_explodes", &serde_json::json!({}))
        .unwrap();
    let kv_fetch = registry
        .construct("kv_fetch", &serde_json::json!({}))
        .unwrap();
    let stage = HintStage::new(
        vec![
            HintPolicyInstance::new("linked_explodes", constructed),
            HintPolicyInstance::new("kv_fetch", kv_fetch),
        ],
        HintLimits::default(),
    );
    let booking = TestBooking {
        request_id: "linked-1".into(),
        worker: TestWorker::capable(1),
        block_size: 16,
        prompt_tokens: 64,
        block_hashes: vec![1, 2, 3, 4],
        peers: vec![kvhint_plugin_api::testing::TestPeer {
            worker: TestWorker::capable(2),
            block_hashes: vec![21, 22, 23, 24],
        }],
        ..Default::default()
    };
    let outcome = booking.with_raw_context(|context| stage.run(context));
    // Contained: the panicking policy lost its actions, kv_fetch's went out.
    assert_eq!(outcome.action_types, ["kv.fetch"]);
    assert_eq!(outcome.failures.len(), 1);
    assert!(
        outcome.failures[0]
            .message
            .contains("linked policy panic for linked-1"),
        "{:?}",
        outcome.failures
    );
    // And the router's hook, not one the plugin-api installed, saw it.
    let seen = SEEN.lock().unwrap_or_else(|e| e.into_inner()).clone();
    assert!(
        seen.iter()
            .any(|s| s.contains("linked policy panic for linked-1")),
        "{seen:?}"
    );
    // The hook is still the router's for panics outside any plugin.
    let before = HOOK_CALLS.load(Ordering::SeqCst);
    let _ = std::panic::catch_unwind(|| panic!("{}", String::from("router's own panic")));
    assert_eq!(HOOK_CALLS.load(Ordering::SeqCst), before + 1);
    let _ = std::panic::take_hook();
}
