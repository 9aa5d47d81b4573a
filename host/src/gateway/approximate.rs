//! Workers whose engines publish no KV events (llama.cpp; TRT-LLM without its
//! publisher), registered with `kv_events: approximate`: the router credits such a
//! worker with the blocks of each prompt it sent there, as if the engine had
//! published them, so repeated prompts land where their prefix is (Dynamo's
//! approximate mode is the anchor).
//!
//! A credit is a guess, so it is bounded: a block counts for
//! `gateway.approximate_ttl_s` after the last prompt that used it, and a worker is
//! credited with at most `gateway.approximate_max_blocks` (the least recently used
//! go first). The blocks go into the index through the same ingestion path as
//! engine events, under engine hashes of the router's own making, and status
//! shows the worker as `approximate`, apart from event-fed workers.

use crate::domain::WorkerKey;
use crate::router::index::events::{KvEvent, StoredBlock};
use crate::router::ingest::Ingest;
use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// What one worker was credited with.
#[derive(Default)]
struct Ledger {
    /// Engine hash → when a prompt last used the block.
    last_used: HashMap<u64, Instant>,
    /// (when, engine hash), oldest first; stale entries are skipped.
    order: VecDeque<(Instant, u64)>,
}

/// Every approximate worker's ledger.
#[derive(Default)]
pub struct Approximate {
    ledgers: Mutex<HashMap<WorkerKey, Ledger>>,
}

/// The engine hashes the router names a prompt's full blocks by: chained, so a
/// block's hash stands for its whole prefix, and seeded by the LoRA adapter and
/// cache salt, as an engine's own are.
pub fn block_hashes(
    token_ids: &[u32],
    block_size: usize,
    lora: Option<&str>,
    salt: Option<&str>,
) -> Vec<u64> {
    let mut seed = xxhash_rust::xxh3::xxh3_64(lora.unwrap_or("").as_bytes());
    seed ^= xxhash_rust::xxh3::xxh3_64(salt.unwrap_or("").as_bytes()).rotate_left(17);
    let mut parent = seed;
    token_ids
        .chunks_exact(block_size.max(1))
        .map(|chunk| {
            let bytes: Vec<u8> = chunk.iter().flat_map(|t| t.to_le_bytes()).collect();
            parent = xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, parent);
            parent
        })
        .collect()
}

impl Approximate {
    /// Credits `worker` with the full blocks of `token_ids`: stores them in the
    /// index (through `ingest`, without waiting) and notes when.
    #[allow(clippy::too_many_arguments)]
    pub fn credit(
        &self,
        ingest: &Ingest,
        worker: WorkerKey,
        token_ids: &[u32],
        block_size: usize,
        lora: Option<&str>,
        salt: Option<&str>,
        max_blocks: u64,
    ) {
        let hashes = block_hashes(token_ids, block_size, lora, salt);
        if hashes.is_empty() {
            return;
        }
        let now = Instant::now();
        let evicted = {
            let mut ledgers = self.ledgers.lock();
            let ledger = ledgers.entry(worker).or_default();
            for hash in &hashes {
                ledger.last_used.insert(*hash, now);
                ledger.order.push_back((now, *hash));
            }
            ledger.evict(|ledger| ledger.last_used.len() as u64 > max_blocks)
        };
        let event = KvEvent::Stored {
            parent_block_hash: None,
            blocks: token_ids
                .chunks_exact(block_size)
                .zip(&hashes)
                .map(|(chunk, hash)| StoredBlock {
                    block_hash: *hash,
                    token_ids: chunk.into(),
                })
                .collect(),
            lora_name: lora.map(str::to_string),
            cache_salt: salt.map(str::to_string),
            extra_keys: Vec::new(),
        };
        if ingest.submit_detached(worker, event).is_err() {
            tracing::debug!(%worker, "approximate credit dropped: the ingestion queue is full");
        }
        if !evicted.is_empty() {
            let _ = ingest.submit_detached(
                worker,
                KvEvent::Removed {
                    block_hashes: evicted,
                },
            );
        }
    }

    /// Takes back credits older than `ttl`; returns how many blocks.
    pub fn expire(&self, ingest: &Ingest, ttl: Duration) -> usize {
        let Some(cutoff) = Instant::now().checked_sub(ttl) else {
            return 0;
        };
        let mut removals = Vec::new();
        {
            let mut ledgers = self.ledgers.lock();
            for (worker, ledger) in ledgers.iter_mut() {
                let evicted =
                    ledger.evict(|ledger| ledger.order.front().is_some_and(|(at, _)| *at < cutoff));
                if !evicted.is_empty() {
                    removals.push((*worker, evicted));
                }
            }
            ledgers.retain(|_, l| !l.last_used.is_empty());
        }
        let mut removed = 0;
        for (worker, block_hashes) in removals {
            removed += block_hashes.len();
            let _ = ingest.submit_detached(worker, KvEvent::Removed { block_hashes });
        }
        removed
    }

    /// Forgets a worker that left (its index entries went with it).
    pub fn forget(&self, keep: impl Fn(&WorkerKey) -> bool) {
        self.ledgers.lock().retain(|k, _| keep(k));
    }

    /// Blocks credited to `worker` now.
    pub fn blocks(&self, worker: WorkerKey) -> usize {
        self.ledgers
            .lock()
            .get(&worker)
            .map_or(0, |l| l.last_used.len())
    }
}

impl Ledger {
    /// Pops the oldest credits while `more` says so; a block used again since is
    /// kept (its newer entry stays queued). Returns the blocks taken back.
    fn evict(&mut self, more: impl Fn(&Ledger) -> bool) -> Vec<u64> {
        let mut evicted = Vec::new();
        while more(self) {
            let Some((at, hash)) = self.order.pop_front() else {
                break;
            };
            if self.last_used.get(&hash) == Some(&at) {
                self.last_used.remove(&hash);
                evicted.push(hash);
            }
        }
        evicted
    }
}
