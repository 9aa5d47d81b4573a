//! KV events as `POST /kv_events` and the trace carry them, and what applying one
//! reports. Engine hashes here are the engine's own names for its blocks.

use crate::domain::WorkerKey;
use serde::{Deserialize, Serialize};

/// A KV event from one worker's engine.
///
/// Wire format (externally tagged, snake_case, unknown fields refused so that a field an
/// engine adapter misspells is an error rather than silently dropped data):
/// ```json
/// {"stored": {"parent_block_hash": 7, "blocks": [{"block_hash": 11, "token_ids": [1, 2]}]}}
/// {"stored": {"parent_block_hash": null, "blocks": [...], "lora_name": "a", "cache_salt": "s"}}
/// {"removed": {"block_hashes": [11, 22]}}
/// "cleared"
/// ```
/// `block_hash` / `parent_block_hash` are the engine's own hashes. `lora_name` and
/// `cache_salt` name the request identity the blocks were computed under; they seed
/// the router's hashes of a sequence's first blocks (a `stored` event with a parent
/// inherits its parent's identity), exactly as `POST /book`'s fields of the same names
/// seed a prompt's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum KvEvent {
    /// Blocks the engine now holds, each chained onto the one before it; the first onto
    /// `parent_block_hash`, or starting a sequence when it is `None`.
    Stored {
        parent_block_hash: Option<u64>,
        blocks: Vec<StoredBlock>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        lora_name: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cache_salt: Option<String>,
        /// Blocks whose engine hash also covers inputs other than their tokens
        /// (multimodal items, prompt embeddings): (block index, a hash of those
        /// inputs). Only engine subscriptions fill it; the JSON wire has no such field.
        #[serde(skip)]
        extra_keys: Vec<(u32, u64)>,
    },
    /// A `stored` event whose blocks were hashed where it was decoded: what an engine
    /// subscription hands the index. The decoder reads each block's token ids once and
    /// keeps only their [`block_content`](super::hashing::block_content), so the
    /// ingestion thread, which every source shares, chains hashes instead of hashing
    /// tokens, and an event carries 16 bytes a block instead of its token ids. Not on
    /// the JSON wire (`POST /kv_events` sends tokens, as [`KvEvent::Stored`]).
    #[serde(skip)]
    Hashed {
        parent_block_hash: Option<u64>,
        /// [`identity_seed`](super::hashing::identity_seed) of the event's LoRA name
        /// and cache salt.
        identity: Option<u64>,
        blocks: Vec<HashedBlock>,
    },
    /// Blocks the engine evicted, by engine hash.
    Removed { block_hashes: Vec<u64> },
    /// The engine dropped its whole cache (restart, reset).
    Cleared,
}

impl KvEvent {
    /// A `stored` event with no LoRA adapter, cache salt or extra keys: the plain
    /// token blocks most callers (the HTTP endpoint's tests, benches) store.
    pub fn stored(parent_block_hash: Option<u64>, blocks: Vec<StoredBlock>) -> Self {
        Self::Stored {
            parent_block_hash,
            blocks,
            lora_name: None,
            cache_salt: None,
            extra_keys: Vec::new(),
        }
    }
}

/// One block of a [`KvEvent::Stored`]: its engine hash and exactly `block_size` token ids.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoredBlock {
    pub block_hash: u64,
    pub token_ids: BlockTokens,
}

/// One block of a [`KvEvent::Hashed`]: its engine hash and the router's hash of its
/// content ([`block_content`](super::hashing::block_content): its tokens, and any
/// other inputs the engine hashed into it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HashedBlock {
    pub block_hash: u64,
    pub content: u64,
}

/// A block's token ids: inline up to 16 (the usual block size), so decoding an engine
/// batch allocates per event, not per block.
pub type BlockTokens = smallvec::SmallVec<[u32; 16]>;

/// Why a KV event was refused. A refused event changes nothing in the index.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum KvEventError {
    #[error(
        "KV event from {worker}: stored block {index} (engine hash {block_hash}) has {tokens} \
         token ids but the router's KV block size is {block_size}; the event was ignored and \
         the index is unchanged. The engine's block (page) size must equal the router's \
         block size, or this worker's cache can never be matched"
    )]
    WrongBlockSize {
        worker: WorkerKey,
        index: usize,
        block_hash: u64,
        tokens: usize,
        block_size: usize,
    },
    #[error(
        "KV event from {worker}: stored blocks chain onto parent engine hash \
         {parent_block_hash}, which this worker never stored (or has since removed or \
         cleared); the event was ignored and the index is unchanged. Its events were lost \
         or reordered, or the router restarted without the worker replaying its cache; \
         these blocks earn no cache credit until the engine stores them again"
    )]
    UnknownParent {
        worker: WorkerKey,
        parent_block_hash: u64,
    },
    /// The router's index takes events only for registered workers: one deregistered
    /// while its events were queued must not come back with the cache it had.
    #[error("KV event from {worker}: the worker is not registered (or was deregistered); the event was ignored — register it first")]
    UnknownWorker { worker: WorkerKey },
}

/// What one applied event did, for metrics and logs.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ApplyStats {
    /// Blocks recorded by a `stored` event (a block stored again counts again).
    pub stored: usize,
    /// Blocks dropped by a `removed` or `cleared` event.
    pub removed: usize,
    /// Engine hashes a `removed` event named that the worker did not hold. Engines may
    /// report an eviction twice, so this is counted, not refused; a steadily growing count
    /// means the router and the engine disagree about the cache.
    pub missing_removals: usize,
}
