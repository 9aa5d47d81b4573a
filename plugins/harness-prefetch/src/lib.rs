//! `harness_prefetch`: the spec's example hint policy, shipped as a `.so` only.
//!
//! It asks the booked worker to prefetch, from its own slower cache tier, up to
//! `max_blocks` of the request's blocks beyond the prefix it already holds, so
//! they are warm by the time prefill reaches them. The action is `kv.prefetch`
//! version `1.0`; the payload is documented in this crate's README.

use kvhint_plugin_api::prelude::*;
use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrefetchConfig {
    #[serde(default = "default_max_blocks")]
    pub max_blocks: usize,
}

fn default_max_blocks() -> usize {
    64
}

/// The `kv.prefetch` 1.0 payload (see the README). The hashes go to the
/// router's writer in one call.
#[derive(serde::Serialize)]
struct PrefetchPayload<'a> {
    first_block: usize,
    block_size: usize,
    #[serde(serialize_with = "kvhint_plugin_api::actions::u64_array")]
    block_hashes: &'a [u64],
}

pub struct HarnessPrefetch {
    max_blocks: usize,
}

impl HarnessPrefetch {
    pub fn new(config: PrefetchConfig) -> Self {
        Self {
            max_blocks: config.max_blocks,
        }
    }
}

impl HintPolicy for HarnessPrefetch {
    fn build_hints(
        &self,
        context: &HintContext<'_>,
        actions: &mut Actions<'_>,
    ) -> Result<(), HintError> {
        let hashes = context.block_hashes();
        let first = context.cached_blocks().min(hashes.len());
        let last = first.saturating_add(self.max_blocks).min(hashes.len());
        if first == last {
            return Ok(());
        }
        actions.push(
            "kv.prefetch",
            "1.0",
            &PrefetchPayload {
                first_block: first,
                block_size: context.block_size(),
                block_hashes: &hashes[first..last],
            },
        )
    }
}

fn register(registry: &mut HintRegistry) -> Result<(), RegistryError> {
    registry.register_hint_policy(
        "harness_prefetch",
        Arc::new(|parameters| {
            let config: PrefetchConfig = parameters.deserialize()?;
            if config.max_blocks == 0 {
                return Err(HintError::bad_parameters(
                    "max_blocks must be at least 1 (to send no prefetch, leave the policy out of `hints`)",
                ));
            }
            Ok(HintPolicyConstructor::shared(HarnessPrefetch::new(config)))
        }),
        [],
    )?;
    Ok(())
}

export_plugin!(register);

#[cfg(test)]
mod tests {
    use super::*;
    use kvhint_plugin_api::testing::{self, TestBooking, TestWorker};
    use serde_json::json;

    fn booking(cached: usize, blocks: u64) -> TestBooking {
        TestBooking {
            request_id: "r".into(),
            worker: TestWorker::capable(1),
            cached_blocks: cached,
            block_size: 16,
            block_hashes: (0..blocks).map(|b| 500 + b).collect(),
            ..Default::default()
        }
    }

    fn policy(max_blocks: usize) -> HarnessPrefetch {
        HarnessPrefetch::new(PrefetchConfig { max_blocks })
    }

    #[test]
    fn prefetches_up_to_max_blocks_beyond_the_cached_prefix() {
        let actions = booking(2, 10).run(&policy(3)).unwrap();
        assert_eq!(actions.len(), 1);
        assert_eq!(actions[0].action_type, "kv.prefetch");
        assert_eq!(
            actions[0].payload,
            json!({"first_block": 2, "block_size": 16, "block_hashes": [502, 503, 504]})
        );
    }

    #[test]
    fn stops_at_the_end_of_the_prompt() {
        let actions = booking(8, 10).run(&policy(64)).unwrap();
        assert_eq!(actions[0].payload["block_hashes"], json!([508, 509]));
    }

    #[test]
    fn nothing_to_prefetch_sends_nothing() {
        assert!(booking(10, 10).run(&policy(64)).unwrap().is_empty());
    }

    #[test]
    fn max_blocks_defaults_to_64_and_zero_is_refused() {
        let config: PrefetchConfig = Parameters::default().deserialize().unwrap();
        assert_eq!(config.max_blocks, 64);
        let policy = testing::construct(register, "harness_prefetch", json!({})).unwrap();
        assert_eq!(
            booking(0, 100).run(&*policy).unwrap()[0].payload["block_hashes"]
                .as_array()
                .map(Vec::len),
            Some(64)
        );
        let error = testing::construct(register, "harness_prefetch", json!({"max_blocks": 0}))
            .err()
            .expect("max_blocks 0 was accepted");
        assert_eq!(error.kind(), HintErrorKind::BadParameters);
        assert!(error.message().contains("max_blocks must be at least 1"));
    }

    #[test]
    fn the_exported_module_constructs_it_as_the_router_does() {
        use abi_stable::std_types::{RResult, RStr};
        use kvhint_plugin_api::abi::{error_code, policy_kind, FfiRouterSettings};
        let module = kvhint_plugin_module();
        let registrations = match (module.register())() {
            RResult::ROk(list) => list,
            RResult::RErr(e) => panic!("{e:?}"),
        };
        assert_eq!(registrations.len(), 1);
        assert_eq!(registrations[0].kind, policy_kind::HINT);
        assert_eq!(registrations[0].name.as_str(), "harness_prefetch");
        assert!(registrations[0].default_hosts.is_empty());
        let provider = registrations[0]
            .hint_provider
            .as_ref()
            .into_option()
            .expect("a hint provider");
        let settings = FfiRouterSettings {
            block_size: 16,
            seed: 0,
        };
        let construct = |json: &str| provider.construct(RStr::from_str(json), &settings);
        match construct("{}") {
            RResult::ROk(constructed) => assert_eq!(constructed.commitments, 0),
            RResult::RErr(e) => panic!("{e:?}"),
        }
        match construct(r#"{"max_blocks": 0}"#) {
            RResult::RErr(e) => {
                assert_eq!(e.code, error_code::BAD_PARAMETERS);
                assert!(e.message.as_str().contains("max_blocks must be at least 1"));
            }
            RResult::ROk(_) => panic!("max_blocks 0 was accepted"),
        }
        match construct(r#"{"max_block": 8}"#) {
            RResult::RErr(e) => {
                assert_eq!(e.code, error_code::BAD_PARAMETERS);
                assert!(e.message.as_str().contains("max_block"), "{}", e.message);
            }
            RResult::ROk(_) => panic!("an unknown key was accepted"),
        }
    }
}
