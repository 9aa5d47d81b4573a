//! The router's KV index: which worker already holds which prefix of a prompt.
//!
//! A KV-aware booking credits a worker for the prompt blocks it would not have to
//! prefill again, and the hint stage tells the booked worker which of a peer's blocks to
//! fetch. Both need the same answer: for this request, how many leading blocks does each
//! worker hold, and (for a fetch) under which names. Workers report what they cache as a
//! stream of KV events (`stored` / `removed` / `cleared`, [`events`]); this index folds
//! those streams into one structure that answers on the booking hot path.
//!
//! **Shape: a compressed radix tree of blocks with holder bitmaps.** Blocks are named by
//! the router's chained *sequence hash* ([`hashing`]). A node is a run of consecutive
//! blocks that the same set of workers holds: their sequence hashes side by side, the
//! holder set as 64-slot bitmap words ([`holders`]), the holders that hold only the
//! run's first blocks with where they stop ([`cuts`]: nested prefixes of one prompt are
//! one node, not one per length), and the holders' engine hashes of those blocks
//! ([`rows`]: one row they share; a holder that names some of them otherwise keeps
//! those names in a table of its own, by block). A lookup ([`lookup`]) compares the
//! request's hashes with a node's run one after the other — a sequential compare, no
//! hash-map probe — and meets a map only where the run ends and a child starts; entering
//! a node ANDs the still-matching set with the node's holders, one word per 64 workers.
//! So its cost is the matched blocks plus, per node, the fleet's words: never a probe per
//! block, never a loop over workers per block, and never how many copies a worker holds.
//! Engine hashes, which only a `kv.fetch` needs, are copied on demand, a run at a time
//! (per block from a worker's own table where its names differ from the shared row).
//!
//! **Why a tree and not a map from block to holders.** A map costs a probe (a likely
//! cache miss in a large index) per request block; Dynamo's `RadixTree` and SGLang's
//! chain index both walk runs sequentially instead, and a per-block map cannot catch
//! them. Nodes split where holder sets diverge and merge back when they agree again, so
//! a run stays as long as the fleet's caches allow.
//!
//! **Two hashes per block.** Engines name blocks by their own hashes, which differ between
//! engines, versions and even workers for the same tokens (salts, LoRA ids, hash seeds).
//! The writer keeps, per worker, engine hash → block ([`names`]), because everything
//! that comes from or goes back to an engine — a removal we must recognise, a parent a
//! later `stored` event chains onto, a "fetch these blocks from peer X" hint — speaks
//! that engine's names. A worker that stores the same tokens under several engine
//! hashes holds the block once: one copy names it, the others are extras kept aside,
//! any of them removed in O(1), and the block stays held until the last copy goes.
//! A name the holders of a node share is kept once for the block rather than once per
//! worker ([`names::Shared`]): a worker joining the node under that name holds its copy
//! through it, which the tree (it holds the block, its row names it so) confirms.
//!
//! **Prefix semantics.** A KV block is only usable if every block before it is present:
//! attention over block *i* needs the keys and values of blocks `0..i`. So a worker's
//! overlap with a request is the length of the leading run of blocks it holds. Removing a
//! block does not cascade to its descendants (engines send their own removals, and may
//! evict a parent before its children), but the walk stops at the gap anyway.
//!
//! **Concurrency** lives one level up ([`shared`]): this structure is single-writer, and
//! [`shared::SharedIndex`] keeps two copies of its tree (`left-right`) over one book of
//! names, so bookings read without a lock while one ingestion path applies events in
//! batches.
//!
//! **Where things are.** This file holds the index's state, its workers' slots and the
//! entry point for an event ([`KvIndex::apply`]); each job on that state has a file:
//! [`tree`] the nodes and their restructuring (split, merge, prune, a node with cuts
//! back into plain nodes), [`cuts`] holders of a node's first blocks, [`store`] a
//! `stored` event, [`remove`] removals, clears and a worker leaving, [`copies`] the
//! tree's half of a worker's names, [`lookup`] a booking's read.

mod claims;
mod copies;
mod cuts;
pub mod events;
pub mod hashing;
pub mod holders;
pub mod lookup;
mod names;
mod remove;
mod rows;
pub mod shared;
mod store;
mod tree;

pub use crate::domain::WorkerKey;
pub use events::{ApplyStats, BlockTokens, HashedBlock, KvEvent, KvEventError, StoredBlock};
pub use hashing::{
    block_content, block_hashes, chained_content, chained_hash, chained_hash_with_extra,
    hashed_blocks, identity_seed, seeded_block_hashes, HASH_SEED,
};
pub use holders::Slot;
pub use lookup::{Found, Matches, RowScratch};

#[cfg(test)]
use store::Contents;
pub(crate) use store::Stored;

use names::{Book, Names};
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use std::sync::Arc;
use tree::{BlockAt, Buffers, Node};

type NodeId = u32;
const NO_NODE: NodeId = u32::MAX;
type BlockId = u32;

/// The router's KV index. See the [module documentation](self).
///
/// Not `Clone`: its copies share one [`Book`] of engine names, which only
/// [`shared::SharedIndex`] may make ([`KvIndex::twin`]).
#[derive(Debug)]
pub struct KvIndex {
    block_size: usize,
    nodes: Vec<Node>,
    free_nodes: Vec<NodeId>,
    /// Nodes whose first block starts a sequence, by its sequence hash.
    roots: FxHashMap<u64, NodeId>,
    blocks: Vec<BlockAt>,
    free_blocks: Vec<BlockId>,
    slots: FxHashMap<WorkerKey, Slot>,
    /// Each slot's worker, dense, so resolving a lookup's matches reads one array;
    /// `None` for a freed slot awaiting reuse.
    slot_keys: Vec<Option<WorkerKey>>,
    free_slots: Vec<Slot>,
    /// (worker, engine hash) copies held.
    entries: usize,
    /// Each worker's names that differ from their nodes' shared rows ([`rows`]).
    own: rows::OwnNames,
    /// The writer's engine names ([`names`]): one book for this index and, under
    /// [`shared::SharedIndex`], for its twin. Bookings never lock it.
    book: Arc<Mutex<Book>>,
    /// Reused by [`KvIndex::apply`] for a stored event's resolved hashes.
    resolved: Vec<(u64, u64)>,
    scratch: Scratch,
    buffers: Buffers,
}

/// Lists the writer fills and empties within one event, kept so that a steady stream
/// of removals allocates none (each was a fresh allocation per event, and a costly
/// one: glibc's allocator sorting its bins on the write path).
#[derive(Debug, Default)]
struct Scratch {
    /// [`KvIndex::release_blocks`]: (node, position, block) of each block left.
    at: Vec<(NodeId, usize, BlockId)>,
    /// [`KvIndex::release_blocks`]: a block of each run left.
    touched: Vec<BlockId>,
    /// [`KvIndex::apply_removed`]: the blocks a worker leaves.
    leaving: Vec<BlockId>,
    /// [`KvIndex::append_run`]: the ids of the blocks it appends.
    ids: Vec<BlockId>,
    /// Blocks whose nodes may be left empty by an event, pruned at its end.
    prune: Vec<BlockId>,
    /// [`KvIndex::materialize`]: the nodes a node with cuts was split into.
    pieces: Vec<NodeId>,
    /// Blocks of nodes that may agree with a neighbour the cuts kept apart, for a
    /// merge at the event's end ([`KvIndex::remerge`]): the first and last block of
    /// a node [`KvIndex::materialize`] splits back (and each piece's first), the
    /// head's first and the tail's last of any [`KvIndex::split`] of a node with cuts.
    remerge: Vec<BlockId>,
    /// [`KvIndex::apply_removed`]: blocks whose last copy it took, which the tree
    /// still shows held until the worker leaves them at the end (a second removal of
    /// the same name in the event must not find it there as a backed copy).
    left: rustc_hash::FxHashSet<BlockId>,
}

/// The most entries a scratch list keeps between events.
const SCRATCH_KEEP: usize = 1 << 16;

impl Scratch {
    /// Puts a list back for the next event, unless one huge event (a removal of much
    /// of a large cache) grew it past what a usual one needs: that memory is given back.
    fn keep<T>(slot: &mut Vec<T>, list: Vec<T>) {
        if list.capacity() <= SCRATCH_KEEP {
            *slot = list;
        }
    }
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
            nodes: Vec::new(),
            free_nodes: Vec::new(),
            roots: FxHashMap::default(),
            blocks: Vec::new(),
            free_blocks: Vec::new(),
            slots: FxHashMap::default(),
            slot_keys: Vec::new(),
            free_slots: Vec::new(),
            entries: 0,
            own: rows::OwnNames::default(),
            book: Arc::default(),
            resolved: Vec::new(),
            scratch: Scratch::default(),
            buffers: Buffers::default(),
        }
    }

    /// A copy of this index that shares its book of names: the second copy
    /// `left-right` keeps, which only ever replays what this one recorded.
    fn twin(&self) -> Self {
        Self {
            block_size: self.block_size,
            nodes: self.nodes.clone(),
            free_nodes: self.free_nodes.clone(),
            roots: self.roots.clone(),
            blocks: self.blocks.clone(),
            free_blocks: self.free_blocks.clone(),
            slots: self.slots.clone(),
            slot_keys: self.slot_keys.clone(),
            free_slots: self.free_slots.clone(),
            entries: self.entries,
            own: self.own.clone(),
            book: Arc::clone(&self.book),
            resolved: Vec::new(),
            scratch: Scratch::default(),
            buffers: Buffers::default(),
        }
    }

    fn book(&self) -> Arc<Mutex<Book>> {
        Arc::clone(&self.book)
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The slot of `worker`, giving it one if it has none (slots are reused, so their
    /// number is the peak fleet size).
    pub fn add_worker(&mut self, worker: WorkerKey) -> Slot {
        let book = self.book();
        let mut book = book.lock();
        self.add_worker_with(&mut *book, worker)
    }

    fn add_worker_with(&mut self, names: &mut impl Names, worker: WorkerKey) -> Slot {
        if let Some(&slot) = self.slots.get(&worker) {
            return slot;
        }
        let slot = match self.free_slots.pop() {
            Some(slot) => {
                self.slot_keys[slot as usize] = Some(worker);
                slot
            }
            None => {
                self.slot_keys.push(Some(worker));
                (self.slot_keys.len() - 1) as Slot
            }
        };
        names.open(slot);
        self.slots.insert(worker, slot);
        slot
    }

    pub fn slot_of(&self, worker: WorkerKey) -> Option<Slot> {
        self.slots.get(&worker).copied()
    }

    /// The worker a slot currently belongs to.
    pub fn key_of(&self, slot: Slot) -> Option<WorkerKey> {
        self.slot_keys.get(slot as usize).copied().flatten()
    }

    /// Slots ever handed out (the size a per-slot array needs).
    pub fn slot_count(&self) -> usize {
        self.slot_keys.len()
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
        let book = self.book();
        let mut book = book.lock();
        if let Some((parent, stored)) = Stored::of(event) {
            let mut resolved = std::mem::take(&mut self.resolved);
            let result = self.resolve(&book, worker, parent, stored, &mut resolved);
            if result.is_ok() {
                self.store_resolved(&mut *book, worker, parent, &resolved);
            }
            self.resolved = resolved;
            return result;
        }
        match event {
            KvEvent::Stored { .. } | KvEvent::Hashed { .. } => Ok(ApplyStats::default()),
            KvEvent::Removed { block_hashes } => {
                Ok(self.apply_removed(&mut *book, worker, block_hashes))
            }
            KvEvent::Cleared => Ok(ApplyStats {
                removed: self.clear_worker(&mut *book, worker),
                ..ApplyStats::default()
            }),
        }
    }

    /// Number of (worker, engine hash) copies held.
    pub fn len(&self) -> usize {
        self.entries
    }

    pub fn is_empty(&self) -> bool {
        self.entries == 0
    }

    /// Number of distinct blocks (sequence hashes) held by any worker. A scan of the
    /// nodes: for tests and tools, not the booking path.
    pub fn distinct_blocks(&self) -> usize {
        self.live_nodes()
            .filter(|n| !n.holders.is_empty())
            .map(Node::len)
            .sum()
    }

    /// Number of (worker, block) pairs: a worker's copies of one block count once.
    pub fn held_blocks(&self) -> usize {
        self.live_nodes()
            .map(|n| {
                let short: usize = n.cuts.as_ref().map_or(0, |c| {
                    c.by_cut()
                        .iter()
                        .map(|&(cut, _)| n.len() - cut as usize)
                        .sum()
                });
                n.len() * n.holders.len() - short
            })
            .sum()
    }

    /// Nodes in the tree (runs of blocks with one holder set).
    pub fn node_count(&self) -> usize {
        self.live_nodes().count()
    }

    fn live_nodes(&self) -> impl Iterator<Item = &Node> {
        self.nodes.iter().filter(|n| n.live)
    }
}

#[cfg(test)]
mod tests;
