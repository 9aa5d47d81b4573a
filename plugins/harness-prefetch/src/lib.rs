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

/// The `kv.prefetch` 1.0 payload (see the README).
#[derive(serde::Serialize)]
struct PrefetchPayload<'a> {
    first_block: usize,
    block_size: usize,
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
    fn build_hints(&self, context: &HintContext<'_>) -> Result<Vec<Action>, HintError> {
        let hashes = context.block_hashes();
        let first = context.cached_blocks().min(hashes.len());
        let last = first.saturating_add(self.max_blocks).min(hashes.len());
        if first == last {
            return Ok(Vec::new());
        }
        Ok(vec![Action::serialize(
            "kv.prefetch",
            "1.0",
            &PrefetchPayload {
                first_block: first,
                block_size: context.block_size(),
                block_hashes: &hashes[first..last],
            },
        )?])
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
    use kvhint_plugin_api::testing::{TestBooking, TestWorker};
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
            actions[0].payload.to_value(),
            json!({"first_block": 2, "block_size": 16, "block_hashes": [502, 503, 504]})
        );
    }

    #[test]
    fn stops_at_the_end_of_the_prompt() {
        let actions = booking(8, 10).run(&policy(64)).unwrap();
        assert_eq!(
            actions[0].payload.to_value()["block_hashes"],
            json!([508, 509])
        );
    }

    #[test]
    fn nothing_to_prefetch_sends_nothing() {
        assert!(booking(10, 10).run(&policy(64)).unwrap().is_empty());
    }

    #[test]
    fn max_blocks_defaults_to_64_and_zero_is_refused() {
        let config: PrefetchConfig = Parameters::default().deserialize().unwrap();
        assert_eq!(config.max_blocks, 64);
        // Through the exported module, as the router constructs it.
        let module = kvhint_plugin_module();
        let registrations = match (module.register())() {
            abi_stable::std_types::RResult::ROk(list) => list,
            abi_stable::std_types::RResult::RErr(e) => panic!("{e:?}"),
        };
        assert_eq!(registrations.len(), 1);
        let construct = |json: &str| {
            registrations[0]
                .provider
                .construct(abi_stable::std_types::RStr::from_str(json))
        };
        assert!(construct("{}").is_ok());
        match construct(r#"{"max_blocks": 0}"#) {
            abi_stable::std_types::RResult::RErr(e) => {
                assert_eq!(e.kind, kvhint_plugin_api::abi::FfiErrorKind::BadParameters);
                assert!(e.message.as_str().contains("max_blocks must be at least 1"));
            }
            abi_stable::std_types::RResult::ROk(_) => panic!("max_blocks 0 was accepted"),
        }
    }
}
