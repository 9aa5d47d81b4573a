//! `kv_fetch`: the router's built-in hint policy (rule R9).
//!
//! With a KV copy committed by the selection policy (`kvcr`), it sends the booked
//! worker a `kv.fetch` naming that peer and those blocks. Otherwise it is best
//! effort: among eligible peers — same worker type, advertising `router_hint` and
//! a source endpoint — it picks the one whose cached prefix is strictly longer
//! than the booked worker's by at least `min_additional_blocks`, longest first,
//! ties to the lowest worker id, then dp rank.
//!
//! `block_hashes` in the payload are root-aligned, as Dynamo's router hint is:
//! entry `i` is the source engine's hash of request block `i`, from block 0 up to
//! the end of what the source holds; the target skips what it already has.
//!
//! The crate is `rlib` and `cdylib`: the router links it in as a built-in, and
//! the same code loads from `libkv_fetch.so` (which is how the static-vs-dynamic
//! benchmark compares the two).

use kvhint_plugin_api::prelude::*;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvFetchConfig {
    #[serde(default = "default_min_additional_blocks")]
    pub min_additional_blocks: usize,
}

fn default_min_additional_blocks() -> usize {
    1
}

impl Default for KvFetchConfig {
    fn default() -> Self {
        Self {
            min_additional_blocks: default_min_additional_blocks(),
        }
    }
}

/// The `kv.fetch` 1.0 payload, serialized straight into the router's writer
/// (no `Value`: a fetch can name thousands of hashes, and this runs on every
/// booking); the hashes go over in one call.
#[derive(Serialize)]
struct FetchPayload<'a> {
    source_control_endpoint: &'a str,
    #[serde(serialize_with = "kvhint_plugin_api::actions::u64_array")]
    block_hashes: &'a [u64],
}

pub struct KvFetch {
    min_additional_blocks: usize,
}

impl KvFetch {
    pub fn new(config: KvFetchConfig) -> Self {
        Self {
            min_additional_blocks: config.min_additional_blocks,
        }
    }

    fn fetch(
        actions: &mut Actions<'_>,
        endpoint: &str,
        block_hashes: &[u64],
    ) -> Result<(), HintError> {
        actions.push(
            "kv.fetch",
            "1.0",
            &FetchPayload {
                source_control_endpoint: endpoint,
                block_hashes,
            },
        )
    }
}

impl HintPolicy for KvFetch {
    fn build_hints(
        &self,
        context: &HintContext<'_>,
        actions: &mut Actions<'_>,
    ) -> Result<(), HintError> {
        if let Some(copy) = context.committed_kv_copy() {
            let source = copy.source();
            let endpoint = source.source_control_endpoint().ok_or_else(|| {
                HintError::new(format!(
                    "the committed copy's source, worker {} rank {}, has no source control endpoint",
                    source.id(),
                    source.dp_rank()
                ))
            })?;
            return Self::fetch(actions, endpoint, copy.block_hashes());
        }

        let booked = context.worker();
        let have = context.cached_blocks();
        let best = context
            .peers()
            .filter(|peer| {
                let worker = peer.worker();
                worker.router_hint()
                    && worker.worker_type() == booked.worker_type()
                    && worker.source_control_endpoint().is_some()
                    && (worker.id(), worker.dp_rank()) != (booked.id(), booked.dp_rank())
                    && peer.cached_blocks() > have
                    && peer.cached_blocks() - have >= self.min_additional_blocks
            })
            .min_by_key(|peer| {
                let worker = peer.worker();
                (
                    std::cmp::Reverse(peer.cached_blocks()),
                    worker.id(),
                    worker.dp_rank(),
                )
            });
        let Some(peer) = best else {
            return Ok(());
        };
        let Some(endpoint) = peer.worker().source_control_endpoint() else {
            return Ok(());
        };
        // Only the chosen peer's hashes are read from the index. Its cache may
        // have shrunk since the lookup; a fetch then names what it still holds,
        // if that still adds something.
        let hashes = peer.block_hashes();
        let hashes = &hashes[..hashes.len().min(peer.cached_blocks())];
        if hashes.len() <= have || hashes.len() - have < self.min_additional_blocks {
            return Ok(());
        }
        Self::fetch(actions, endpoint, hashes)
    }

    fn commitments(&self) -> Commitments {
        Commitments::KV_COPY
    }
}

/// Registers `kv_fetch`, on by default under `kvcr`.
pub fn register(registry: &mut HintRegistry) -> Result<(), RegistryError> {
    registry.register_hint_policy(
        "kv_fetch",
        Arc::new(|parameters| {
            let config: KvFetchConfig = parameters.deserialize()?;
            if config.min_additional_blocks == 0 {
                return Err(HintError::bad_parameters(
                    "min_additional_blocks must be at least 1: a fetch always adds at least one block",
                ));
            }
            Ok(HintPolicyConstructor::shared(KvFetch::new(config)))
        }),
        [HintHost::worker_selection("kvcr")],
    )?;
    Ok(())
}

export_plugin!(register);

#[cfg(test)]
mod tests {
    use super::*;
    use kvhint_plugin_api::testing::{Action, TestBooking, TestKvCopy, TestPeer, TestWorker};
    use serde_json::json;

    fn booking(cached: usize) -> TestBooking {
        TestBooking {
            request_id: "r1".into(),
            worker: TestWorker::capable(1),
            cached_blocks: cached,
            block_size: 16,
            prompt_tokens: 160,
            block_hashes: (100..110).collect(),
            ..Default::default()
        }
    }

    fn peer(id: u64, blocks: usize) -> TestPeer {
        TestPeer {
            worker: TestWorker::capable(id),
            block_hashes: (0..blocks as u64).map(|b| id * 1000 + b).collect(),
        }
    }

    fn policy(min_additional_blocks: usize) -> KvFetch {
        KvFetch::new(KvFetchConfig {
            min_additional_blocks,
        })
    }

    fn payload(actions: &[Action]) -> Vec<serde_json::Value> {
        actions.iter().map(|a| a.payload.clone()).collect()
    }

    #[test]
    fn committed_copy_wins_over_longer_peers() {
        let mut b = booking(0);
        b.peers = vec![peer(5, 8)];
        b.committed_kv_copy = Some(TestKvCopy {
            source: TestWorker::capable(7),
            first_block: 0,
            block_hashes: vec![11, 22],
        });
        let actions = b.run(&policy(1)).unwrap();
        assert_eq!(
            payload(&actions),
            vec![
                json!({"source_control_endpoint": "tcp://10.0.0.7:23280", "block_hashes": [11, 22]})
            ]
        );
        assert_eq!(actions[0].action_type, "kv.fetch");
        assert_eq!(actions[0].action_version, "1.0");
    }

    #[test]
    fn best_effort_names_the_longest_peer_with_root_aligned_hashes() {
        let mut b = booking(2);
        b.peers = vec![peer(3, 4), peer(4, 6)];
        let actions = b.run(&policy(1)).unwrap();
        // Root-aligned: entry i is request block i; the target skips the two
        // blocks it already holds.
        assert_eq!(
            payload(&actions),
            vec![json!({
                "source_control_endpoint": "tcp://10.0.0.4:23280",
                "block_hashes": [4000, 4001, 4002, 4003, 4004, 4005]
            })]
        );
    }

    #[test]
    fn min_additional_blocks_is_respected() {
        let mut b = booking(2);
        b.peers = vec![peer(3, 4)];
        assert!(b.run(&policy(3)).unwrap().is_empty());
        assert_eq!(b.run(&policy(2)).unwrap().len(), 1);
    }

    #[test]
    fn ties_go_to_lowest_worker_id_then_dp_rank() {
        let mut b = booking(0);
        let mut p9 = peer(9, 4);
        p9.worker.dp_rank = 0;
        let mut p4r1 = peer(4, 4);
        p4r1.worker.dp_rank = 1;
        let p4r0 = TestPeer {
            worker: TestWorker {
                source_control_endpoint: "tcp://10.0.0.4:9999".into(),
                ..TestWorker::capable(4)
            },
            block_hashes: p4r1.block_hashes.clone(),
        };
        b.peers = vec![p9, p4r1, p4r0];
        let actions = b.run(&policy(1)).unwrap();
        assert_eq!(
            actions[0].payload["source_control_endpoint"],
            "tcp://10.0.0.4:9999"
        );
    }

    #[test]
    fn ineligible_peers_are_skipped() {
        let mut b = booking(0);
        let mut other_type = peer(2, 8);
        other_type.worker.worker_type = "prefill".into();
        let mut no_hint = peer(3, 8);
        no_hint.worker.router_hint = false;
        let mut no_endpoint = peer(4, 8);
        no_endpoint.worker.source_control_endpoint.clear();
        b.peers = vec![other_type, no_hint, no_endpoint];
        assert!(b.run(&policy(1)).unwrap().is_empty());
    }

    #[test]
    fn constructed_through_its_provider() {
        let policy =
            kvhint_plugin_api::testing::construct(register, "kv_fetch", json!({})).unwrap();
        assert_eq!(policy.commitments(), Commitments::KV_COPY);
        let err = kvhint_plugin_api::testing::construct(
            register,
            "kv_fetch",
            json!({"min_additional_blocks": "two"}),
        )
        .err()
        .unwrap();
        assert_eq!(err.kind(), HintErrorKind::BadParameters);
        assert!(err.message().contains("`min_additional_blocks`"), "{err}");
    }

    #[test]
    fn equal_prefix_is_not_a_fetch() {
        let mut b = booking(4);
        b.peers = vec![peer(3, 4)];
        assert!(b.run(&policy(1)).unwrap().is_empty());
    }
}
