//! The router's KV index: which worker already holds which prefix of a prompt.
//!
//! A KV-aware booking credits a worker for the prompt blocks it would not have to
//! prefill again, and the hint stage tells the booked worker which of a peer's blocks to
//! fetch. Both need the same answer: for this request, how many leading blocks does each
//! worker hold, and (for a fetch) under which names. Workers report what they cache as a
//! stream of KV events (`stored` / `removed` / `cleared`, [`events`]); this index folds
//! those streams into one structure that answers on the booking hot path.
//!
//! **Shape: one hash map from block to holder bitmap.** Blocks are keyed by the router's
//! chained *sequence hash* ([`hashing`]): a block's hash covers its tokens and everything
//! before it, so one probe per request block serves every worker, and the map needs no
//! tree: the chain is in the keys. Each entry is the set of workers holding that block as
//! 64-slot bitmap words ([`holders`]) with one engine hash per holder. A lookup ANDs the
//! sets block by block ([`lookup`]): one word operation per 64 still-matching workers per
//! block, plus one record when a worker drops out, so its cost is the prompt's matched
//! blocks times the fleet's words, never a per-worker, per-block loop and never how many
//! copies a worker holds. Engine hashes, which only a `kv.fetch` needs, are read on
//! demand for the workers that need them, root-aligned.
//!
//! **Two hashes per block.** Engines name blocks by their own hashes, which differ between
//! engines, versions and even workers for the same tokens (salts, LoRA ids, hash seeds).
//! The index keys on the router's hash and keeps, per worker, engine hash → block, because
//! everything that goes back to an engine — a removal we must recognise, a parent a later
//! `stored` event chains onto, a "fetch these blocks from peer X" hint — has to speak that
//! engine's names. A worker that stores the same tokens under several engine hashes holds
//! the block once; its copies are a ring through its engine-hash map, so removing any of
//! them is O(1) and the block stays held until the last copy goes.
//!
//! **Prefix semantics.** A KV block is only usable if every block before it is present:
//! attention over block *i* needs the keys and values of blocks `0..i`. So a worker's
//! overlap with a request is the length of the leading run of blocks it holds. Removing a
//! block does not cascade to its descendants (engines send their own removals, and may
//! evict a parent before its children), but the walk stops at the gap anyway.
//!
//! **Concurrency** lives one level up ([`shared`]): this structure is single-writer and
//! `Clone`, and [`shared::SharedIndex`] keeps two copies of it (`left-right`), so bookings
//! read without a lock while one ingestion path applies events in batches.

pub mod events;
pub mod hashing;
pub mod holders;
pub mod lookup;
pub mod shared;

pub use crate::domain::WorkerKey;
pub use events::{ApplyStats, KvEvent, KvEventError, StoredBlock};
pub use hashing::{block_hashes, chained_hash, HASH_SEED};
pub use holders::Slot;
pub use lookup::Matches;

use holders::Holders;
use rustc_hash::FxHashMap;
use std::collections::hash_map::Entry;

/// One of a worker's copies of a block, named by an engine hash. Copies of the same block
/// (same sequence hash) form a ring through `prev`/`next` (engine hashes; a lone copy
/// points at itself), so any one can be removed without searching for the others.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Copy {
    seq: u64,
    prev: u64,
    next: u64,
}

#[derive(Debug, Clone)]
struct WorkerBlocks {
    key: WorkerKey,
    /// Engine hash → its block: removals and parents arrive as engine hashes.
    by_engine: FxHashMap<u64, Copy>,
}

/// The router's KV index. See the [module documentation](self).
#[derive(Debug, Clone)]
pub struct KvIndex {
    block_size: usize,
    /// Sequence hash → the workers holding that block.
    blocks: FxHashMap<u64, Holders>,
    slots: FxHashMap<WorkerKey, Slot>,
    /// Indexed by slot; `None` for a freed slot awaiting reuse.
    workers: Vec<Option<WorkerBlocks>>,
    free_slots: Vec<Slot>,
    /// (worker, engine hash) copies held.
    entries: usize,
}

impl KvIndex {
    /// An empty index for engines whose KV blocks hold `block_size` tokens.
    ///
    /// # Panics
    /// If `block_size` is 0: no block could ever be stored or matched, so that is a
    /// configuration error the caller must refuse before building the router (the config
    /// does).
    pub fn new(block_size: usize) -> Self {
        assert!(block_size > 0, "KV block size must be at least 1 token");
        Self {
            block_size,
            blocks: FxHashMap::default(),
            slots: FxHashMap::default(),
            workers: Vec::new(),
            free_slots: Vec::new(),
            entries: 0,
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The slot of `worker`, giving it one if it has none (slots are reused, so their
    /// number is the peak fleet size).
    pub fn add_worker(&mut self, worker: WorkerKey) -> Slot {
        if let Some(&slot) = self.slots.get(&worker) {
            return slot;
        }
        let blocks = WorkerBlocks {
            key: worker,
            by_engine: FxHashMap::default(),
        };
        let slot = match self.free_slots.pop() {
            Some(slot) => {
                self.workers[slot as usize] = Some(blocks);
                slot
            }
            None => {
                self.workers.push(Some(blocks));
                (self.workers.len() - 1) as Slot
            }
        };
        self.slots.insert(worker, slot);
        slot
    }

    pub fn slot_of(&self, worker: WorkerKey) -> Option<Slot> {
        self.slots.get(&worker).copied()
    }

    /// The worker a slot currently belongs to.
    pub fn key_of(&self, slot: Slot) -> Option<WorkerKey> {
        self.workers.get(slot as usize)?.as_ref().map(|w| w.key)
    }

    /// Slots ever handed out (the size a per-slot array needs).
    pub fn slot_count(&self) -> usize {
        self.workers.len()
    }

    /// Applies one event from `worker`. Atomic: on error nothing changed.
    ///
    /// Stored blocks chain from the parent (or start a sequence when the parent is
    /// `None`); each block's sequence hash is computed from the parent's and the block's
    /// tokens exactly as [`block_hashes`] does for a prompt, so a request's hashes meet
    /// what the workers stored. Storing a copy again is a no-op (engines re-announce
    /// blocks on prefix hits). Removing an engine hash the worker does not hold is
    /// counted in [`ApplyStats::missing_removals`], not refused.
    pub fn apply(
        &mut self,
        worker: WorkerKey,
        event: &KvEvent,
    ) -> Result<ApplyStats, KvEventError> {
        match event {
            KvEvent::Stored {
                parent_block_hash,
                blocks,
            } => {
                let mut resolved = Vec::new();
                self.apply_stored(worker, *parent_block_hash, blocks, &mut resolved)
            }
            KvEvent::Removed { block_hashes } => Ok(self.apply_removed(worker, block_hashes)),
            KvEvent::Cleared => Ok(ApplyStats {
                removed: self.clear_worker(worker),
                ..ApplyStats::default()
            }),
        }
    }

    /// [`apply`](Self::apply) for a `stored` event, also handing back each block's
    /// (engine hash, sequence hash) so a second copy of the index can replay the event
    /// without hashing again ([`KvIndex::store_resolved`]).
    pub(crate) fn apply_stored(
        &mut self,
        worker: WorkerKey,
        parent_block_hash: Option<u64>,
        blocks: &[StoredBlock],
        resolved: &mut Vec<(u64, u64)>,
    ) -> Result<ApplyStats, KvEventError> {
        // Every check happens before the first change, which is what makes the event
        // atomic without an undo log.
        if let Some((index, block)) = blocks
            .iter()
            .enumerate()
            .find(|(_, b)| b.token_ids.len() != self.block_size)
        {
            return Err(KvEventError::WrongBlockSize {
                worker,
                index,
                block_hash: block.block_hash,
                tokens: block.token_ids.len(),
                block_size: self.block_size,
            });
        }
        let mut parent = match parent_block_hash {
            None => None,
            Some(parent_hash) => {
                let seq = self
                    .slots
                    .get(&worker)
                    .and_then(|&slot| self.workers[slot as usize].as_ref())
                    .and_then(|w| w.by_engine.get(&parent_hash))
                    .map(|copy| copy.seq);
                match seq {
                    Some(seq) => Some(seq),
                    None => {
                        return Err(KvEventError::UnknownParent {
                            worker,
                            parent_block_hash: parent_hash,
                        })
                    }
                }
            }
        };
        resolved.clear();
        resolved.reserve(blocks.len());
        for block in blocks {
            let seq = chained_hash(parent, &block.token_ids);
            resolved.push((block.block_hash, seq));
            parent = Some(seq);
        }
        self.store_resolved(worker, resolved);
        Ok(ApplyStats {
            stored: blocks.len(),
            ..ApplyStats::default()
        })
    }

    /// Records `worker`'s copies (engine hash, sequence hash), already validated.
    pub(crate) fn store_resolved(&mut self, worker: WorkerKey, copies: &[(u64, u64)]) {
        if copies.is_empty() {
            return;
        }
        let slot = self.add_worker(worker);
        for &(engine, seq) in copies {
            self.insert(slot, engine, seq);
        }
    }

    fn insert(&mut self, slot: Slot, engine: u64, seq: u64) {
        let Self {
            blocks,
            workers,
            entries,
            ..
        } = self;
        let Some(w) = workers[slot as usize].as_mut() else {
            return;
        };
        match w.by_engine.get(&engine) {
            Some(copy) if copy.seq == seq => return,
            // The engine reused a hash for other tokens: its old block is gone.
            Some(&old) => {
                w.by_engine.remove(&engine);
                unlink(blocks, &mut w.by_engine, slot, engine, old);
                *entries -= 1;
            }
            None => {}
        }
        let holders = blocks.entry(seq).or_default();
        if holders.insert(slot, engine) {
            w.by_engine.insert(
                engine,
                Copy {
                    seq,
                    prev: engine,
                    next: engine,
                },
            );
        } else if let Some(head) = holders.engine_of(slot) {
            // Another copy of a block this worker holds: append it to the ring, so the
            // block keeps the name it was first stored under.
            let tail = w.by_engine.get(&head).map_or(head, |c| c.prev);
            w.by_engine.insert(
                engine,
                Copy {
                    seq,
                    prev: tail,
                    next: head,
                },
            );
            if let Some(c) = w.by_engine.get_mut(&tail) {
                c.next = engine;
            }
            if let Some(c) = w.by_engine.get_mut(&head) {
                c.prev = engine;
            }
        }
        *entries += 1;
    }

    pub(crate) fn apply_removed(&mut self, worker: WorkerKey, engine_hashes: &[u64]) -> ApplyStats {
        let mut stats = ApplyStats::default();
        let Some(&slot) = self.slots.get(&worker) else {
            stats.missing_removals = engine_hashes.len();
            return stats;
        };
        let Self {
            blocks,
            workers,
            entries,
            ..
        } = self;
        let Some(w) = workers[slot as usize].as_mut() else {
            stats.missing_removals = engine_hashes.len();
            return stats;
        };
        for &engine in engine_hashes {
            match w.by_engine.remove(&engine) {
                Some(copy) => {
                    unlink(blocks, &mut w.by_engine, slot, engine, copy);
                    *entries -= 1;
                    stats.removed += 1;
                }
                None => stats.missing_removals += 1,
            }
        }
        stats
    }

    /// Forgets everything `worker` stored (deregistration) and frees its slot.
    pub fn remove_worker(&mut self, worker: WorkerKey) {
        self.clear_worker(worker);
        if let Some(slot) = self.slots.remove(&worker) {
            self.workers[slot as usize] = None;
            self.free_slots.push(slot);
        }
    }

    /// Drops every block `worker` holds but keeps its slot, since a cleared engine
    /// usually starts storing again at once. Returns how many copies were dropped.
    pub(crate) fn clear_worker(&mut self, worker: WorkerKey) -> usize {
        let Some(&slot) = self.slots.get(&worker) else {
            return 0;
        };
        let Some(w) = self.workers[slot as usize].as_mut() else {
            return 0;
        };
        let dropped = w.by_engine.len();
        for (_, copy) in w.by_engine.drain() {
            if let Entry::Occupied(mut holders) = self.blocks.entry(copy.seq) {
                holders.get_mut().remove(slot);
                if holders.get().is_empty() {
                    holders.remove();
                }
            }
        }
        self.entries -= dropped;
        dropped
    }

    /// Number of (worker, engine hash) copies held.
    pub fn len(&self) -> usize {
        self.entries
    }

    pub fn is_empty(&self) -> bool {
        self.entries == 0
    }

    /// Number of distinct blocks (sequence hashes) held by any worker.
    pub fn distinct_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Number of (worker, block) pairs: a worker's copies of one block count once.
    pub fn held_blocks(&self) -> usize {
        self.blocks.values().map(Holders::len).sum()
    }

    fn holders(&self, seq: u64) -> Option<&Holders> {
        self.blocks.get(&seq)
    }
}

/// Takes one copy (already removed from `by_engine`) out of its ring, and the worker out
/// of the block's holders once it was the last copy, so `distinct_blocks` and memory
/// follow the fleet's caches down as well as up.
fn unlink(
    blocks: &mut FxHashMap<u64, Holders>,
    by_engine: &mut FxHashMap<u64, Copy>,
    slot: Slot,
    engine: u64,
    copy: Copy,
) {
    if copy.next == engine {
        if let Entry::Occupied(mut holders) = blocks.entry(copy.seq) {
            holders.get_mut().remove(slot);
            if holders.get().is_empty() {
                holders.remove();
            }
        }
        return;
    }
    if let Some(c) = by_engine.get_mut(&copy.prev) {
        c.next = copy.next;
    }
    if let Some(c) = by_engine.get_mut(&copy.next) {
        c.prev = copy.prev;
    }
    if let Some(holders) = blocks.get_mut(&copy.seq) {
        if holders.engine_of(slot) == Some(engine) {
            holders.set_engine(slot, copy.next);
        }
    }
}

#[cfg(test)]
mod tests;
