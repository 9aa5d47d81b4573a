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
//! holder set as 64-slot bitmap words ([`holders`]), and the holders' engine hashes of
//! those blocks ([`rows`]: one row they share, and own rows for holders that name them
//! otherwise). A lookup ([`lookup`]) compares the request's hashes with a node's run
//! one after the other — a sequential compare, no hash-map probe — and meets a map only
//! where the run ends and a child starts; entering a node ANDs the still-matching set
//! with the node's holders, one word per 64 workers. So its cost is the matched blocks
//! plus, per node, the fleet's words: never a probe per block, never a loop over workers
//! per block, and never how many copies a worker holds. Engine hashes, which only a
//! `kv.fetch` needs, are copied on demand, a run at a time.
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

pub mod events;
pub mod hashing;
pub mod holders;
pub mod lookup;
mod names;
mod rows;
pub mod shared;

pub use crate::domain::WorkerKey;
pub use events::{ApplyStats, BlockTokens, HashedBlock, KvEvent, KvEventError, StoredBlock};
pub use hashing::{
    block_content, block_hashes, chained_content, chained_hash, chained_hash_with_extra,
    hashed_blocks, identity_seed, seeded_block_hashes, HASH_SEED,
};
pub use holders::Slot;
pub use lookup::{Found, Matches, RowScratch};

use holders::Holders;
use names::{Book, Names, Taken};
use parking_lot::Mutex;
use rows::EngineRows;
use rustc_hash::FxHashMap;
use smallvec::SmallVec;
use std::sync::Arc;

type NodeId = u32;
const NO_NODE: NodeId = u32::MAX;
type BlockId = u32;

/// Children of a node by the sequence hash of their first block: a short list scanned
/// in order, or a map once a node has many (a shared system prompt followed by many
/// different user prompts).
#[derive(Debug, Clone)]
enum Children {
    Few(SmallVec<[(u64, NodeId); 2]>),
    Many(FxHashMap<u64, NodeId>),
}

const FEW_CHILDREN: usize = 8;

impl Default for Children {
    fn default() -> Self {
        Self::Few(SmallVec::new())
    }
}

impl Children {
    #[inline]
    fn get(&self, seq: u64) -> Option<NodeId> {
        match self {
            Self::Few(list) => list.iter().find(|(s, _)| *s == seq).map(|(_, n)| *n),
            Self::Many(map) => map.get(&seq).copied(),
        }
    }

    fn insert(&mut self, seq: u64, node: NodeId) {
        match self {
            Self::Few(list) => {
                if let Some(entry) = list.iter_mut().find(|(s, _)| *s == seq) {
                    entry.1 = node;
                } else if list.len() < FEW_CHILDREN {
                    list.push((seq, node));
                } else {
                    let mut map: FxHashMap<u64, NodeId> = list.iter().copied().collect();
                    map.insert(seq, node);
                    *self = Self::Many(map);
                }
            }
            Self::Many(map) => {
                map.insert(seq, node);
            }
        }
    }

    fn remove(&mut self, seq: u64) {
        match self {
            Self::Few(list) => list.retain(|(s, _)| *s != seq),
            Self::Many(map) => {
                map.remove(&seq);
            }
        }
    }

    fn len(&self) -> usize {
        match self {
            Self::Few(list) => list.len(),
            Self::Many(map) => map.len(),
        }
    }

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    #[inline]
    fn only(&self) -> Option<NodeId> {
        match self {
            // One look at where the list's items are, not one for its length and
            // one more for its item.
            Self::Few(list) => match list.as_slice() {
                [(_, node)] => Some(*node),
                _ => None,
            },
            Self::Many(map) if map.len() == 1 => map.values().next().copied(),
            _ => None,
        }
    }

    fn nodes(&self) -> impl Iterator<Item = NodeId> + '_ {
        let (few, many) = match self {
            Self::Few(list) => (Some(list.iter().map(|(_, n)| *n)), None),
            Self::Many(map) => (None, Some(map.values().copied())),
        };
        few.into_iter().flatten().chain(many.into_iter().flatten())
    }
}

/// A run of consecutive blocks that the same workers hold.
#[derive(Debug, Clone, Default)]
struct Node {
    /// Sequence hashes of the blocks, in chain order.
    seqs: Vec<u64>,
    /// Ids of the blocks, parallel to `seqs`.
    ids: Vec<BlockId>,
    /// The holders of every block of the node.
    holders: Holders,
    /// Each holder's engine hashes of the node's blocks ([`rows`]): one row the
    /// holders share, and rows of their own only for holders that name them otherwise.
    engines: EngineRows,
    /// `NO_NODE` for a node whose first block starts a sequence.
    parent: NodeId,
    children: Children,
    /// The `offset` its blocks' [`BlockAt`] entries count from, so that splitting a node
    /// rewrites only the moved blocks' entries. It only grows along a sequence that
    /// keeps growing at its end while losing its head, so after 2^32 blocks through one
    /// sequence it wraps: offsets and positions are computed modulo 2^32 (wrapping
    /// arithmetic), which is exact while a node holds fewer than 2^32 blocks.
    first: u32,
    live: bool,
    /// Every name of the shared row is entered in the book's shared names for its
    /// block ([`names::Shared`]): a holder joining with the same names holds the
    /// blocks through them and writes nothing in its own names.
    entered: bool,
    /// Some names of the shared row may be entered: the node's names are taken out
    /// when it is freed or its shared row renamed.
    listed: bool,
}

impl Node {
    fn len(&self) -> usize {
        self.seqs.len()
    }

    /// The engine hashes of the holder `slot`.
    fn row(&self, slot: Slot) -> &[u64] {
        self.engines.row(slot)
    }

    fn set_engine(&mut self, slot: Slot, pos: usize, engine: u64) {
        if self.holders.contains(slot) {
            let sole = self.holders.len() == 1;
            self.engines.set(slot, pos, engine, sole);
        }
    }

    /// Adds `slot` with its engine hashes of every block: the first of each of
    /// `items` (`len()` of them).
    #[inline(always)]
    fn add_holder(&mut self, slot: Slot, items: &[(u64, u64)]) {
        let first = self.holders.is_empty();
        if self.holders.insert(slot) {
            self.engines.add_pairs(slot, items, first);
        }
    }

    fn remove_holder(&mut self, slot: Slot) {
        if self.holders.remove(slot) {
            self.engines.remove(slot);
        }
    }

    /// Appends a block held by `slot`, the node's only holder. Inlined: it runs for
    /// every block appended, and as a call it spilled registers around three pushes.
    #[inline(always)]
    fn push_block(&mut self, slot: Slot, seq: u64, block: BlockId, engine: u64) {
        // The new block's name is not entered.
        self.entered = false;
        self.seqs.push(seq);
        self.ids.push(block);
        self.engines.push_sole(slot, engine);
    }
}

/// Splits `v` before `k` like [`Vec::split_off`], but into `spare` (a pooled buffer,
/// see [`Buffers`]), and copies the shorter side out: the longer side keeps the buffer
/// and its spare room. A worker that evicts the head of a sequence it is still
/// extending splits off a short head, so the tail, where its next blocks are appended,
/// keeps the capacity it grew instead of starting again from an exact-size copy.
fn split_buffer<T: Copy>(v: &mut Vec<T>, k: usize, mut spare: Vec<T>) -> Vec<T> {
    spare.clear();
    if k <= v.len() - k {
        spare.extend_from_slice(&v[..k]);
        v.drain(..k);
        std::mem::replace(v, spare)
    } else {
        spare.extend_from_slice(&v[k..]);
        v.truncate(k);
        spare
    }
}

/// Buffers of the nodes this copy of the tree freed, for the nodes it makes next.
///
/// In a steady stream an engine stores new sequences as fast as it evicts old ones,
/// so nodes are freed (pruned, or merged into their parent) and made (new sequences,
/// splits) at the same rate. Each made node used to allocate its arrays and grow them
/// block by block as its sequence grew (a `realloc` and a copy at each doubling), and
/// each freed one gave them back: a tenth of the instructions of applying the stream
/// went to the allocator. Reused, a buffer keeps the room its last node grew.
/// Bounded: at most [`BUFFERS_KEEP`] of each kind, none larger than [`BUFFER_MAX`]
/// entries, so an index that shrinks gives nearly all of its memory back.
#[derive(Debug, Default)]
struct Buffers {
    /// Sequence hashes' and engine hashes' arrays.
    wide: Vec<Vec<u64>>,
    /// Block ids' arrays.
    ids: Vec<Vec<BlockId>>,
}

const BUFFERS_KEEP: usize = 256;
const BUFFER_MAX: usize = 4096;

impl Buffers {
    fn keep<T>(pool: &mut Vec<Vec<T>>, mut buffer: Vec<T>) {
        if buffer.capacity() > 0 && buffer.capacity() <= BUFFER_MAX && pool.len() < BUFFERS_KEEP {
            buffer.clear();
            pool.push(buffer);
        }
    }

    /// Keeps the arrays of a node being freed.
    fn keep_node(&mut self, node: Node) {
        Self::keep(&mut self.wide, node.seqs);
        Self::keep(&mut self.ids, node.ids);
        Self::keep(&mut self.wide, node.engines.into_common());
    }

    fn wide(&mut self) -> Vec<u64> {
        self.wide.pop().unwrap_or_default()
    }

    fn ids(&mut self) -> Vec<BlockId> {
        self.ids.pop().unwrap_or_default()
    }
}

/// A block with its node and position in it, as a store's walk carries it: a store
/// that joins a long chain of short nodes meets a node per block or two, and looking
/// each block up again in `blocks` put one more dependent load in every step.
#[derive(Debug, Clone, Copy)]
struct Place {
    block: BlockId,
    node: NodeId,
    pos: usize,
}

/// Where a block is: its node and `first + position` in it.
#[derive(Debug, Clone, Copy)]
struct BlockAt {
    node: NodeId,
    offset: u32,
}

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

/// The parts of a stored event [`KvIndex::resolve`] hashes, besides its parent.
#[derive(Clone, Copy)]
pub(crate) struct Stored<'a> {
    /// [`identity_seed`] of the event's LoRA name and cache salt.
    pub identity: Option<u64>,
    pub contents: Contents<'a>,
}

/// A stored event's blocks: their tokens ([`KvEvent::Stored`]), or their content
/// hashes, computed where the event was decoded ([`KvEvent::Hashed`]).
#[derive(Clone, Copy)]
pub(crate) enum Contents<'a> {
    Tokens {
        blocks: &'a [StoredBlock],
        /// (block index, hash of its other inputs), ascending by index.
        extra_keys: &'a [(u32, u64)],
    },
    Hashed(&'a [HashedBlock]),
}

impl<'a> Stored<'a> {
    /// The parts of `event` to resolve and its parent, if it stores blocks.
    pub(crate) fn of(event: &'a KvEvent) -> Option<(Option<u64>, Self)> {
        match event {
            KvEvent::Stored {
                parent_block_hash,
                blocks,
                lora_name,
                cache_salt,
                extra_keys,
            } => Some((
                *parent_block_hash,
                Stored {
                    identity: identity_seed(lora_name.as_deref(), cache_salt.as_deref()),
                    contents: Contents::Tokens { blocks, extra_keys },
                },
            )),
            KvEvent::Hashed {
                parent_block_hash,
                identity,
                blocks,
            } => Some((
                *parent_block_hash,
                Stored {
                    identity: *identity,
                    contents: Contents::Hashed(blocks),
                },
            )),
            KvEvent::Removed { .. } | KvEvent::Cleared => None,
        }
    }

    fn len(&self) -> usize {
        match self.contents {
            Contents::Tokens { blocks, .. } => blocks.len(),
            Contents::Hashed(blocks) => blocks.len(),
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

    /// Checks a `stored` event and hashes its blocks, changing nothing: each block's
    /// (engine hash, sequence hash) goes into `resolved`, for
    /// [`store_resolved`](Self::store_resolved) to record (on both copies of a shared
    /// index, without hashing twice).
    fn resolve(
        &self,
        book: &Book,
        worker: WorkerKey,
        parent_block_hash: Option<u64>,
        stored: Stored<'_>,
        resolved: &mut Vec<(u64, u64)>,
    ) -> Result<ApplyStats, KvEventError> {
        resolved.clear();
        // Nothing changes here (`resolved` is scratch), so the event stays atomic
        // without an undo log: every check is done before `store_resolved` changes
        // anything. (A hashed event's block size was checked where it was decoded,
        // against the same setting.) A wrong block size is reported before an unknown
        // parent, as the event's own fault.
        let mut parent = match self.first_parent(book, worker, parent_block_hash, stored.identity) {
            Ok(parent) => parent,
            Err(unknown) => return Err(self.first_wrong_size(worker, &stored).unwrap_or(unknown)),
        };
        resolved.reserve(stored.len());
        match stored.contents {
            Contents::Tokens { blocks, extra_keys } => {
                let mut extras = extra_keys.iter().peekable();
                for (index, block) in blocks.iter().enumerate() {
                    // The size is checked in the same pass as the hashing.
                    if block.token_ids.len() != self.block_size {
                        return Err(self.wrong_size(worker, index, block));
                    }
                    let seq = match extras.next_if(|(at, _)| *at as usize == index) {
                        Some(&(_, extra)) => {
                            chained_hash_with_extra(parent, &block.token_ids, extra)
                        }
                        None => chained_hash(parent, &block.token_ids),
                    };
                    resolved.push((block.block_hash, seq));
                    parent = Some(seq);
                }
            }
            Contents::Hashed(blocks) => {
                for block in blocks {
                    let seq = chained_content(parent, block.content);
                    resolved.push((block.block_hash, seq));
                    parent = Some(seq);
                }
            }
        }
        Ok(ApplyStats {
            stored: stored.len(),
            ..ApplyStats::default()
        })
    }

    /// The first block of a stored event whose token count is not the block size, as
    /// the error that refuses the event.
    #[cold]
    fn first_wrong_size(&self, worker: WorkerKey, stored: &Stored<'_>) -> Option<KvEventError> {
        let Contents::Tokens { blocks, .. } = stored.contents else {
            return None;
        };
        blocks
            .iter()
            .enumerate()
            .find(|(_, b)| b.token_ids.len() != self.block_size)
            .map(|(index, block)| self.wrong_size(worker, index, block))
    }

    /// The refusal of a stored event whose block `index` has the wrong token count.
    #[cold]
    fn wrong_size(&self, worker: WorkerKey, index: usize, block: &StoredBlock) -> KvEventError {
        KvEventError::WrongBlockSize {
            worker,
            index,
            block_hash: block.block_hash,
            tokens: block.token_ids.len(),
            block_size: self.block_size,
        }
    }

    /// What a stored event's first block chains onto: the sequence hash of the block
    /// its engine calls `parent_block_hash`, or for a sequence's first block the
    /// request identity (a continuation inherits it through its parent's hash).
    fn first_parent(
        &self,
        book: &Book,
        worker: WorkerKey,
        parent_block_hash: Option<u64>,
        identity: Option<u64>,
    ) -> Result<Option<u64>, KvEventError> {
        match parent_block_hash {
            None => Ok(identity),
            Some(parent_hash) => match self
                .slot_of(worker)
                .and_then(|slot| self.copy_in(book, slot, parent_hash))
            {
                Some(copy) => Ok(Some(self.seq_of(copy.block))),
                None => Err(KvEventError::UnknownParent {
                    worker,
                    parent_block_hash: parent_hash,
                }),
            },
        }
    }

    /// [`resolve`](Self::resolve) of a [`KvEvent::Hashed`] that hands over its blocks:
    /// they become its (engine hash, sequence hash) pairs in their own buffer, with no
    /// copy and no allocation.
    fn resolve_hashed(
        &self,
        book: &Book,
        worker: WorkerKey,
        parent_block_hash: Option<u64>,
        identity: Option<u64>,
        blocks: Vec<HashedBlock>,
    ) -> Result<(ApplyStats, Vec<(u64, u64)>), KvEventError> {
        let mut parent = self.first_parent(book, worker, parent_block_hash, identity)?;
        let stats = ApplyStats {
            stored: blocks.len(),
            ..ApplyStats::default()
        };
        let resolved = blocks
            .into_iter()
            .map(|block| {
                let seq = chained_content(parent, block.content);
                parent = Some(seq);
                (block.block_hash, seq)
            })
            .collect();
        Ok((stats, resolved))
    }

    fn at(&self, block: BlockId) -> (NodeId, usize) {
        let at = self.blocks[block as usize];
        let node = &self.nodes[at.node as usize];
        (at.node, at.offset.wrapping_sub(node.first) as usize)
    }

    fn seq_of(&self, block: BlockId) -> u64 {
        let (node, pos) = self.at(block);
        self.nodes[node as usize].seqs[pos]
    }

    /// Records `worker`'s copies (engine hash, sequence hash) chained onto the block its
    /// engine calls `parent_engine`; already [`resolve`](Self::resolve)d (the parent
    /// exists).
    fn store_resolved(
        &mut self,
        names: &mut impl Names,
        worker: WorkerKey,
        parent_engine: Option<u64>,
        items: &[(u64, u64)],
    ) {
        if items.is_empty() {
            return;
        }
        let slot = self.add_worker_with(names, worker);
        names.reserve(slot, items.len());
        let mut cursor: Option<Place> = match parent_engine {
            Some(p) => match self.copy_of(names, slot, p) {
                Some(copy) => Some(self.place(copy.block)),
                // Resolved before: only a replay of a refused event lands here.
                None => return,
            },
            None => None,
        };
        // Nodes that may have lost their last holder; pruned once the store is done, so
        // no block the cursor names is freed under it.
        let mut prune = std::mem::take(&mut self.scratch.prune);
        prune.clear();
        // The node the last step joined `slot` to, if the last step was a join: a
        // join that goes on into its child need not try to merge the two.
        let mut joined = NO_NODE;
        let mut i = 0;
        while i < items.len() {
            let (engine, seq) = items[i];
            let Some(here) = self.child_of(cursor, seq) else {
                joined = NO_NODE;
                // A new block: one probe of the engine-hash map claims the name for it
                // (the common case, a sequence no one holds yet).
                let block = self.reserve_block();
                if self.backed_copy(names, slot, engine).is_none()
                    && names.claim(slot, engine, block).is_none()
                {
                    self.entries += 1;
                    let after = cursor.map(|c| c.block);
                    self.attach_new(names, slot, after, block, (engine, seq), items.len() - i);
                    cursor = Some(self.place(block));
                    i += 1;
                    // The rest of the event follows a block no one else holds, which
                    // has no children yet: each is new too, and goes at the end of
                    // the same node (this worker's alone). No lookups but the name.
                    let (added, last) = self.append_run(names, slot, block, &items[i..]);
                    if added > 0 {
                        cursor = Some(self.place(last));
                        i += added;
                    }
                } else {
                    // The engine reused a hash for other tokens: its old block is
                    // gone; then this item again.
                    self.free_blocks.push(block);
                    self.remove_copy(names, slot, engine, &mut prune);
                    cursor = cursor.map(|c| self.place(c.block));
                }
                continue;
            };
            let Place { block, node, pos } = here;
            let after = joined;
            joined = NO_NODE;
            let held = self.nodes[node as usize].holders.contains(slot);
            // One probe of the worker's names: a new name is recorded at once (as
            // an extra copy of a block it holds, or the first of a stretch it joins).
            let mut backed = false;
            let existing = if held {
                self.held_name(names, slot, engine, block)
            } else {
                let (existing, through_shared) =
                    self.join_name(names, slot, node, pos, engine, block);
                backed = through_shared;
                existing
            };
            match existing {
                None if held => {
                    self.entries += 1;
                    i += 1;
                    let (more, last) = self.extra_run(names, slot, here, &items[i..]);
                    cursor = Some(last);
                    i += more;
                }
                None => {
                    let (taken, last) =
                        self.hold_stretch(names, slot, here, &items[i..], after, backed);
                    cursor = Some(last);
                    joined = last.node;
                    i += taken;
                }
                // Stored again: nothing changes (engines re-announce on prefix hits).
                Some(copy) if copy.block == block => {
                    cursor = Some(here);
                    i += 1;
                }
                // Reused for other tokens: the old block loses it, then this item again
                // (removing a copy restructures nodes, never the blocks' chain, so the
                // cursor's block stays but its place may move).
                Some(_) => {
                    self.remove_copy(names, slot, engine, &mut prune);
                    cursor = cursor.map(|c| self.place(c.block));
                }
            }
        }
        self.prune_all(names, prune);
    }

    /// After an extra copy of the block at `at` (which `slot` holds): records `items`
    /// as extra copies of the node's next blocks, as far as they follow them and are
    /// new names. The same tokens stored again under another salt name a whole run of
    /// a node this way, and one pass over the node spares each the walk's child lookup
    /// and holder check. Returns how many it recorded and the place of the last block
    /// with a copy.
    fn extra_run(
        &mut self,
        names: &mut impl Names,
        slot: Slot,
        at: Place,
        items: &[(u64, u64)],
    ) -> (usize, Place) {
        let Place { node, pos, .. } = at;
        let n = &self.nodes[node as usize];
        let mut k = 0;
        while k < items.len()
            && pos + 1 + k < n.len()
            && n.seqs[pos + 1 + k] == items[k].1
            // A name held already (stored again, or reused) ends the run: the walk
            // deals with that item.
            && self
                .held_name(names, slot, items[k].0, n.ids[pos + 1 + k])
                .is_none()
        {
            k += 1;
        }
        let last = Place {
            block: n.ids[pos + k],
            node,
            pos: pos + k,
        };
        self.entries += k;
        (k, last)
    }

    /// Appends `items` to the node that ends with `last` (held by `slot` alone, no
    /// children) as new blocks, up to the first whose engine hash is already in use;
    /// returns how many it appended and the last block.
    fn append_run(
        &mut self,
        names: &mut impl Names,
        slot: Slot,
        mut last: BlockId,
        items: &[(u64, u64)],
    ) -> (usize, BlockId) {
        let node = self.blocks[last as usize].node;
        self.before_push(names, node);
        // The run's names are claimed first, an id reserved for each, up to the first
        // name in use; then the node's arrays grow once by the whole run, as copies of
        // slices rather than a push per array per block.
        let mut ids = std::mem::take(&mut self.scratch.ids);
        ids.clear();
        self.blocks.reserve(items.len());
        for &(engine, _) in items {
            let block = self.reserve_block();
            if self.backed_copy(names, slot, engine).is_some()
                || names.claim(slot, engine, block).is_some()
            {
                self.free_blocks.push(block);
                break;
            }
            ids.push(block);
        }
        let added = ids.len();
        if let Some(&end) = ids.last() {
            self.entries += added;
            let n = &mut self.nodes[node as usize];
            let base = n.first.wrapping_add(n.len() as u32);
            // The new blocks' names are not entered.
            n.entered = false;
            n.seqs.extend(items[..added].iter().map(|&(_, seq)| seq));
            n.ids.extend_from_slice(&ids);
            n.engines
                .extend_sole(slot, items[..added].iter().map(|&(engine, _)| engine));
            for (j, &block) in ids.iter().enumerate() {
                self.blocks[block as usize] = BlockAt {
                    node,
                    offset: base.wrapping_add(j as u32),
                };
            }
            last = end;
        }
        Scratch::keep(&mut self.scratch.ids, ids);
        (added, last)
    }

    /// `block` with its node and position.
    fn place(&self, block: BlockId) -> Place {
        let (node, pos) = self.at(block);
        Place { block, node, pos }
    }

    /// The block after `cursor` (or a first block, for `None`) named `seq`, if any.
    #[inline(always)]
    fn child_of(&self, cursor: Option<Place>, seq: u64) -> Option<Place> {
        let node = match cursor {
            None => *self.roots.get(&seq)?,
            Some(Place { block, node, pos }) => {
                debug_assert_eq!(self.at(block), (node, pos), "a stale cursor");
                let n = &self.nodes[node as usize];
                if pos + 1 < n.len() {
                    return (n.seqs[pos + 1] == seq).then(|| Place {
                        block: n.ids[pos + 1],
                        node,
                        pos: pos + 1,
                    });
                }
                n.children.get(seq)?
            }
        };
        Some(Place {
            block: self.nodes[node as usize].ids[0],
            node,
            pos: 0,
        })
    }

    /// Adds `slot` as a holder of the blocks of `at`'s node from `at` on that `items`
    /// continue (as far as the node goes and no item's engine hash is already in use);
    /// the first item's name is already claimed for the block at `at`
    /// (`first_backed`: held through the shared names). Returns how many items it
    /// took (at least one) and where the last of them is now.
    ///
    /// `joined`: the node this event's previous step joined `slot` to, or `NO_NODE`.
    /// When that is the parent of the stretch (the store goes on from the parent's
    /// last block into this node), the two cannot merge: they had different holders
    /// before (or they would be one node) and both gained `slot`. Nearly every join
    /// of a store that follows a chain of nodes is such a one.
    fn hold_stretch(
        &mut self,
        names: &mut impl Names,
        slot: Slot,
        at: Place,
        items: &[(u64, u64)],
        joined: NodeId,
        first_backed: bool,
    ) -> (usize, Place) {
        let Place { node, pos, .. } = at;
        // The first item's name is claimed; claim each next one's as the stretch grows:
        // one probe per block. A name already in use (reused for other tokens, or
        // repeated within this event) ends the stretch; the caller deals with that item
        // next.
        let mut taken = 1;
        let mut backed = usize::from(first_backed);
        let last = {
            let n = &self.nodes[node as usize];
            // Names the shared row has, entered, are held through the shared names:
            // only the worker's own names need asking whether it has them already.
            let entered = n.entered && !n.holders.is_empty();
            let common = n.engines.common();
            while taken < items.len()
                && pos + taken < n.len()
                && n.seqs[pos + taken] == items[taken].1
            {
                let (engine, block) = (items[taken].0, n.ids[pos + taken]);
                let through_shared = entered && common[pos + taken] == engine;
                let existing = if through_shared {
                    names.get(slot, engine)
                } else {
                    // A name this stretch already took through the shared names (an
                    // event naming two blocks alike) is not in the tree or the count
                    // yet: look for it in the stretch.
                    let entered_for = match backed {
                        0 => names.backed(slot, engine),
                        _ => names.shared(engine),
                    };
                    match entered_for {
                        Some(b)
                            if self.names_block(slot, b, engine)
                                || self.in_stretch(b, node, pos, &items[..taken], engine) =>
                        {
                            Some(names::Copy {
                                block: b,
                                extra: names::NAMED,
                            })
                        }
                        _ => names.claim(slot, engine, block),
                    }
                };
                if existing.is_some() {
                    break;
                }
                backed += usize::from(through_shared);
                taken += 1;
            }
            n.ids[pos + taken - 1]
        };
        self.entries += taken;
        if backed > 0 {
            names.back(slot, backed);
        }
        if self.nodes[node as usize].holders.is_empty() {
            // `slot`'s names become the shared row: the old one's go.
            self.take_out_row(names, node, |_| true);
        }
        let m = self.isolate(node, pos, pos + taken);
        self.nodes[m as usize].add_holder(slot, &items[..taken]);
        // `m` holds just the stretch; merged into its parent, it follows the parent's
        // blocks (merging its child in appends after it and moves nothing).
        let parent = self.nodes[m as usize].parent;
        let now = if pos == 0 && parent == joined && parent != NO_NODE {
            self.merge_child(m)
        } else {
            let before = match parent {
                NO_NODE => 0,
                parent => self.nodes[parent as usize].len(),
            };
            let now = self.merge_around(m);
            if now != m {
                return (
                    taken,
                    Place {
                        block: last,
                        node: now,
                        pos: before + taken - 1,
                    },
                );
            }
            now
        };
        let pos = taken - 1;
        (
            taken,
            Place {
                block: last,
                node: now,
                pos,
            },
        )
    }

    /// Places the new block `block` (reserved, its name claimed; `(engine, seq)` its
    /// hashes) after `cursor`, held by `slot` alone: appended to the cursor's node when
    /// that node is `slot`'s alone and ends there (a worker extending its own
    /// sequence), else the start of a new node.
    /// `rest`: blocks of the event from this one on, for which a new node reserves room
    /// (the rest of an event's new blocks all land in it).
    fn attach_new(
        &mut self,
        names: &mut impl Names,
        slot: Slot,
        cursor: Option<BlockId>,
        block: BlockId,
        (engine, seq): (u64, u64),
        rest: usize,
    ) {
        let parent = match cursor {
            None => NO_NODE,
            Some(at) => {
                let (node, pos) = self.at(at);
                if pos + 1 < self.nodes[node as usize].len() {
                    self.split(node, pos + 1);
                }
                self.at(at).0
            }
        };
        if parent != NO_NODE {
            let p = &mut self.nodes[parent as usize];
            if p.children.is_empty() && p.holders.len() == 1 && p.holders.contains(slot) {
                self.before_push(names, parent);
                let p = &mut self.nodes[parent as usize];
                let offset = p.first.wrapping_add(p.len() as u32);
                p.push_block(slot, seq, block, engine);
                self.blocks[block as usize] = BlockAt {
                    node: parent,
                    offset,
                };
                return;
            }
        }
        let node = self.new_node(parent);
        {
            let n = &mut self.nodes[node as usize];
            n.seqs.reserve_exact(rest);
            n.ids.reserve_exact(rest);
            n.engines.reserve(rest);
            n.holders.insert(slot);
            n.push_block(slot, seq, block, engine);
        }
        self.blocks[block as usize] = BlockAt { node, offset: 0 };
        if parent == NO_NODE {
            self.roots.insert(seq, node);
        } else {
            self.nodes[parent as usize].children.insert(seq, node);
        }
    }

    /// Whether `slot` holds `block` and its row names it `engine`: the tree's half of
    /// a backed copy (the shared names give the other).
    fn names_block(&self, slot: Slot, block: BlockId, engine: u64) -> bool {
        let Some(at) = self.blocks.get(block as usize) else {
            return false;
        };
        let Some(n) = self.nodes.get(at.node as usize) else {
            return false;
        };
        let pos = at.offset.wrapping_sub(n.first) as usize;
        n.live && n.holders.contains(slot) && n.row(slot).get(pos) == Some(&engine)
    }

    /// Whether `block` is one of the blocks of `node` from `pos` on that a stretch
    /// being joined has taken so far (`taken`, their items), under `engine`.
    fn in_stretch(
        &self,
        block: BlockId,
        node: NodeId,
        pos: usize,
        taken: &[(u64, u64)],
        engine: u64,
    ) -> bool {
        let Some(at) = self.blocks.get(block as usize) else {
            return false;
        };
        let Some(n) = self.nodes.get(node as usize) else {
            return false;
        };
        let q = at.offset.wrapping_sub(n.first) as usize;
        at.node == node && q >= pos && taken.get(q - pos).is_some_and(|&(name, _)| name == engine)
    }

    /// The backed copy `slot` holds under `engine`, if any.
    #[inline(always)]
    fn backed_copy(&self, names: &mut impl Names, slot: Slot, engine: u64) -> Option<names::Copy> {
        let block = names.backed(slot, engine)?;
        self.names_block(slot, block, engine)
            .then_some(names::Copy {
                block,
                extra: names::NAMED,
            })
    }

    /// The copy `slot` holds under `engine`: in its own names, or backed.
    fn copy_of(&self, names: &mut impl Names, slot: Slot, engine: u64) -> Option<names::Copy> {
        names
            .get(slot, engine)
            .or_else(|| self.backed_copy(names, slot, engine))
    }

    /// [`copy_of`](Self::copy_of), asking the book directly (nothing recorded).
    fn copy_in(&self, book: &Book, slot: Slot, engine: u64) -> Option<names::Copy> {
        book.copy(slot, engine).or_else(|| {
            let block = book.backed_block(slot, engine)?;
            self.names_block(slot, block, engine)
                .then_some(names::Copy {
                    block,
                    extra: names::NAMED,
                })
        })
    }

    /// A name for `block`, which `slot` holds: a copy it holds already under that
    /// name (backed, or in its own names), or else a new extra copy.
    #[inline(always)]
    fn held_name(
        &self,
        names: &mut impl Names,
        slot: Slot,
        engine: u64,
        block: BlockId,
    ) -> Option<names::Copy> {
        self.backed_copy(names, slot, engine)
            .or_else(|| names.add_extra(slot, block, engine))
    }

    /// The name of the first block of a stretch `slot` joins, at `pos` of `node`:
    /// held through the shared names when the node's shared row has it and is
    /// entered (entering it first if the node has holders and is not), else claimed in
    /// `slot`'s own names. Returns the copy `slot` already holds under `engine`, if
    /// any, and whether the new copy is backed.
    #[inline(always)]
    fn join_name(
        &mut self,
        names: &mut impl Names,
        slot: Slot,
        node: NodeId,
        pos: usize,
        engine: u64,
        block: BlockId,
    ) -> (Option<names::Copy>, bool) {
        let n = &self.nodes[node as usize];
        if !n.holders.is_empty() && n.engines.common()[pos] == engine {
            if !n.entered {
                self.enter_row(names, node);
            }
            if self.nodes[node as usize].entered {
                return (names.get(slot, engine), true);
            }
        }
        let existing = self
            .backed_copy(names, slot, engine)
            .or_else(|| names.claim(slot, engine, block));
        (existing, false)
    }

    /// Enters `node`'s shared row in the shared names, block by block; the node is
    /// entered if every name is (a name another block has stays with it).
    #[cold]
    #[inline(never)]
    fn enter_row(&mut self, names: &mut impl Names, node: NodeId) {
        let n = &self.nodes[node as usize];
        let mut all = true;
        for (&engine, &block) in n.engines.common().iter().zip(&n.ids) {
            all &= names.enter(engine, block);
        }
        let n = &mut self.nodes[node as usize];
        n.listed = true;
        n.entered = all;
    }

    /// Takes the names of `node`'s shared row out of the shared names, at the
    /// positions `which` picks (all of them when the node is freed or its row
    /// replaced).
    fn take_out_row(
        &mut self,
        names: &mut impl Names,
        node: NodeId,
        which: impl Fn(usize) -> bool,
    ) {
        let n = &mut self.nodes[node as usize];
        if !n.listed {
            return;
        }
        for (pos, (&engine, &block)) in n.engines.common().iter().zip(&n.ids).enumerate() {
            if which(pos) {
                names.take_out(engine, block);
            }
        }
        n.entered = false;
        n.listed = false;
    }

    /// Before a block is appended to `node`, its sole holder's: if that holder has a
    /// row of its own, it becomes the shared row, so the shared names that row does
    /// not have go.
    fn before_push(&mut self, names: &mut impl Names, node: NodeId) {
        let n = &self.nodes[node as usize];
        if !n.listed || !n.engines.has_odd() {
            return;
        }
        let Some(slot) = n.holders.slots().next() else {
            return;
        };
        let own: Vec<u64> = n.row(slot).to_vec();
        let common: Vec<u64> = n.engines.common().to_vec();
        self.take_out_row(names, node, |pos| own[pos] != common[pos]);
        // Names both rows have stay entered; the node is listed still.
        self.nodes[node as usize].listed = true;
    }

    /// A block id for a block about to be placed.
    fn reserve_block(&mut self) -> BlockId {
        match self.free_blocks.pop() {
            Some(id) => id,
            None => {
                self.blocks.push(BlockAt {
                    node: NO_NODE,
                    offset: 0,
                });
                (self.blocks.len() - 1) as BlockId
            }
        }
    }

    fn new_node(&mut self, parent: NodeId) -> NodeId {
        let node = Node {
            parent,
            live: true,
            seqs: self.buffers.wide(),
            ids: self.buffers.ids(),
            engines: EngineRows::with_common(self.buffers.wide()),
            ..Node::default()
        };
        match self.free_nodes.pop() {
            Some(id) => {
                self.nodes[id as usize] = node;
                id
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as NodeId
            }
        }
    }

    /// Splits `node` before position `k` (0 < k < len). The node keeps its id and its
    /// first `k` blocks; a new child takes the rest, the holders and the children. Only
    /// the moved blocks' entries are rewritten. Returns the new node.
    fn split(&mut self, node: NodeId, k: usize) -> NodeId {
        let tail_id = self.new_node(node);
        let t = &mut self.nodes[tail_id as usize];
        let (spare_seqs, spare_ids, spare_engines) = (
            std::mem::take(&mut t.seqs),
            std::mem::take(&mut t.ids),
            t.engines.take_common(),
        );
        let n = &mut self.nodes[node as usize];
        let seqs = split_buffer(&mut n.seqs, k, spare_seqs);
        let ids = split_buffer(&mut n.ids, k, spare_ids);
        let holders = n.holders.clone();
        let engines = n.engines.split_off(k, spare_engines);
        let children = std::mem::take(&mut n.children);
        let first = n.first.wrapping_add(k as u32);
        let head_seq = seqs[0];
        n.children.insert(head_seq, tail_id);
        for child in children.nodes() {
            self.nodes[child as usize].parent = tail_id;
        }
        for &block in &ids {
            self.blocks[block as usize].node = tail_id;
        }
        let (entered, listed) = (
            self.nodes[node as usize].entered,
            self.nodes[node as usize].listed,
        );
        let t = &mut self.nodes[tail_id as usize];
        t.seqs = seqs;
        t.ids = ids;
        t.holders = holders;
        t.engines = engines;
        t.children = children;
        t.first = first;
        t.entered = entered;
        t.listed = listed;
        tail_id
    }

    /// Splits as needed so that one node holds exactly positions `a..b` of `node`;
    /// returns it.
    fn isolate(&mut self, node: NodeId, a: usize, b: usize) -> NodeId {
        if b < self.nodes[node as usize].len() {
            self.split(node, b);
        }
        if a > 0 {
            self.split(node, a)
        } else {
            node
        }
    }

    /// Merges `child` into `parent` if it is the parent's only child and both have the
    /// same holders: a run that holder sets no longer divide becomes one node again.
    ///
    /// The check is inlined and the merge is not: a store that joins a stretch tries
    /// two merges per node it passes, and nearly all of them fail at the check.
    #[inline(always)]
    fn try_merge(&mut self, parent: NodeId, child: NodeId) -> bool {
        if parent == NO_NODE {
            return false;
        }
        let p = &self.nodes[parent as usize];
        let c = &self.nodes[child as usize];
        // The holder counts first: known without touching the children or the words,
        // and a store joining a chain of nodes leaves each with one holder more than
        // its child, so nearly every check ends here.
        if p.holders.len() != c.holders.len()
            || p.children.only() != Some(child)
            || !p.holders.same_members(&c.holders)
        {
            return false;
        }
        self.merge(parent, child);
        true
    }

    /// Merges `child`, the only child of `parent`, with the same holders, into it.
    #[inline(never)]
    fn merge(&mut self, parent: NodeId, child: NodeId) {
        let mut c = std::mem::take(&mut self.nodes[child as usize]);
        let p = &mut self.nodes[parent as usize];
        let base = p.first.wrapping_add(p.len() as u32);
        p.entered &= c.entered;
        p.listed |= c.listed;
        p.engines.append(&c.engines);
        for (j, &block) in c.ids.iter().enumerate() {
            self.blocks[block as usize] = BlockAt {
                node: parent,
                offset: base.wrapping_add(j as u32),
            };
        }
        p.seqs.extend_from_slice(&c.seqs);
        p.ids.extend_from_slice(&c.ids);
        for grandchild in c.children.nodes() {
            self.nodes[grandchild as usize].parent = parent;
        }
        self.nodes[parent as usize].children = std::mem::take(&mut c.children);
        self.buffers.keep_node(c);
        self.free_nodes.push(child);
    }

    /// After `node`'s holders changed: merges it with its parent and its only child
    /// where they now agree. Returns the node its blocks are in now.
    #[inline(always)]
    fn merge_around(&mut self, node: NodeId) -> NodeId {
        let parent = self.nodes[node as usize].parent;
        let node = if self.try_merge(parent, node) {
            parent
        } else {
            node
        };
        self.merge_child(node)
    }

    /// Merges `node`'s only child into it if they now agree; returns `node`.
    #[inline(always)]
    fn merge_child(&mut self, node: NodeId) -> NodeId {
        if let Some(child) = self.nodes[node as usize].children.only() {
            self.try_merge(node, child);
        }
        node
    }

    /// Removes one copy; the block loses `slot` when it was the last. A block whose node
    /// may have become empty is added to `prune` (a block, not a node: nodes split and
    /// merge meanwhile, a block stays where its node is).
    fn remove_copy(
        &mut self,
        names: &mut impl Names,
        slot: Slot,
        engine: u64,
        prune: &mut Vec<BlockId>,
    ) -> bool {
        match self.take_copy(names, slot, engine) {
            None => false,
            Some(None) => true,
            Some(Some(block)) => {
                self.release_blocks(slot, &[block], prune);
                self.scratch.left.clear();
                true
            }
        }
    }

    /// Takes one copy out of `slot`'s names: `None` if there was no such copy,
    /// `Some(Some(block))` if it was the worker's last copy of `block` (the worker must
    /// then leave the block), `Some(None)` if another copy still names it. When the
    /// named copy goes and extras remain, an extra becomes the named one, and the
    /// node's row says so.
    fn take_copy(
        &mut self,
        names: &mut impl Names,
        slot: Slot,
        engine: u64,
    ) -> Option<Option<BlockId>> {
        let mut taken = names.take(slot, engine);
        if taken == Taken::Missing {
            if let Some(copy) = self.backed_copy(names, slot, engine) {
                if !self.scratch.left.contains(&copy.block) {
                    taken = names.take_backed(slot, copy.block);
                }
            }
        }
        if let Taken::Last(block) = taken {
            self.scratch.left.insert(block);
        }
        if taken != Taken::Missing {
            self.entries -= 1;
        }
        match taken {
            Taken::Missing => None,
            Taken::Extra => Some(None),
            Taken::Last(block) => Some(Some(block)),
            Taken::Renamed { block, named } => {
                let (node, pos) = self.at(block);
                let n = &mut self.nodes[node as usize];
                let old = n.engines.common()[pos];
                n.set_engine(slot, pos, named);
                if n.engines.common()[pos] != old {
                    // The sole holder renamed it: the old name is no one's now.
                    n.entered = false;
                    names.take_out(old, block);
                }
                Some(None)
            }
        }
    }

    /// `slot` leaves `blocks` (each a block it held, once). Blocks are taken node by
    /// node, as runs of consecutive positions from the highest down, so a run costs one
    /// or two splits whatever its length (splitting keeps the lower positions where
    /// they are), and a node the worker leaves whole is not split at all. The nodes
    /// touched are then merged where they agree, and their blocks added to `prune`.
    fn release_blocks(&mut self, slot: Slot, blocks: &[BlockId], prune: &mut Vec<BlockId>) {
        let mut at = std::mem::take(&mut self.scratch.at);
        at.clear();
        at.extend(blocks.iter().map(|&block| {
            let (node, pos) = self.at(block);
            (node, pos, block)
        }));
        at.sort_unstable_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
        let mut touched = std::mem::take(&mut self.scratch.touched);
        touched.clear();
        let mut k = 0;
        while k < at.len() {
            let (node, high, block) = at[k];
            let mut low = high;
            k += 1;
            while k < at.len() && at[k].0 == node && at[k].1 + 1 == low {
                low = at[k].1;
                k += 1;
            }
            let m = self.isolate(node, low, high + 1);
            self.nodes[m as usize].remove_holder(slot);
            touched.push(block);
        }
        for &block in &touched {
            let node = self.blocks[block as usize].node;
            if self.nodes[node as usize].live {
                self.merge_around(node);
            }
        }
        prune.extend_from_slice(&touched);
        Scratch::keep(&mut self.scratch.at, at);
        Scratch::keep(&mut self.scratch.touched, touched);
    }

    /// Frees nodes no worker holds and no longer lead anywhere, then their parents in
    /// turn, merging what is left where it agrees.
    /// `candidates` is the event's prune list, kept for the next event afterwards.
    fn prune_all(&mut self, names: &mut impl Names, candidates: Vec<BlockId>) {
        for &block in &candidates {
            // A candidate's node may be gone already (pruned with an earlier one); a
            // stale entry then names a free or reused node, and pruning only ever
            // removes a node that is empty and leads nowhere, which is right for any.
            if let Some(at) = self.blocks.get(block as usize) {
                if (at.node as usize) < self.nodes.len() {
                    self.prune(names, at.node);
                }
            }
        }
        Scratch::keep(&mut self.scratch.prune, candidates);
    }

    fn prune(&mut self, names: &mut impl Names, mut node: NodeId) {
        loop {
            let n = &self.nodes[node as usize];
            if !n.live || !n.holders.is_empty() || !n.children.is_empty() {
                return;
            }
            self.take_out_row(names, node, |_| true);
            let n = &self.nodes[node as usize];
            let parent = n.parent;
            let first_seq = n.seqs[0];
            let n = std::mem::take(&mut self.nodes[node as usize]);
            self.free_blocks.extend_from_slice(&n.ids);
            self.buffers.keep_node(n);
            self.free_nodes.push(node);
            if parent == NO_NODE {
                self.roots.remove(&first_seq);
                return;
            }
            self.nodes[parent as usize].children.remove(first_seq);
            if let Some(child) = self.nodes[parent as usize].children.only() {
                // The parent and its last child may agree now; merged, the node may
                // itself be prunable (both were empty), so look at it again.
                if !self.try_merge(parent, child) {
                    return;
                }
            }
            node = parent;
        }
    }

    fn apply_removed(
        &mut self,
        names: &mut impl Names,
        worker: WorkerKey,
        engine_hashes: &[u64],
    ) -> ApplyStats {
        let mut stats = ApplyStats::default();
        let Some(&slot) = self.slots.get(&worker) else {
            stats.missing_removals = engine_hashes.len();
            return stats;
        };
        let mut leaving = std::mem::take(&mut self.scratch.leaving);
        leaving.clear();
        for &engine in engine_hashes {
            match self.take_copy(names, slot, engine) {
                None => stats.missing_removals += 1,
                Some(last) => {
                    stats.removed += 1;
                    leaving.extend(last);
                }
            }
        }
        let mut prune = std::mem::take(&mut self.scratch.prune);
        prune.clear();
        self.release_blocks(slot, &leaving, &mut prune);
        self.scratch.left.clear();
        Scratch::keep(&mut self.scratch.leaving, leaving);
        self.prune_all(names, prune);
        stats
    }

    /// Forgets everything `worker` stored (deregistration) and frees its slot.
    pub fn remove_worker(&mut self, worker: WorkerKey) {
        let book = self.book();
        let mut book = book.lock();
        self.remove_worker_with(&mut *book, worker);
    }

    fn remove_worker_with(&mut self, names: &mut impl Names, worker: WorkerKey) {
        self.clear_worker(names, worker);
        if let Some(slot) = self.slots.remove(&worker) {
            names.close(slot);
            self.slot_keys[slot as usize] = None;
            self.free_slots.push(slot);
        }
    }

    /// Drops every block `worker` holds but keeps its slot, since a cleared engine
    /// usually starts storing again at once. Returns how many copies were dropped.
    /// A node's holders are the same for all its blocks, so the worker leaves whole
    /// nodes: no splitting.
    fn clear_worker(&mut self, names: &mut impl Names, worker: WorkerKey) -> usize {
        let Some(&slot) = self.slots.get(&worker) else {
            return 0;
        };
        let mut blocks = Vec::new();
        let (own, backed) = names.drain(slot, &mut blocks);
        let dropped = own + backed;
        let mut nodes: Vec<NodeId> = blocks
            .into_iter()
            .map(|block| self.blocks[block as usize].node)
            .collect();
        if backed > 0 {
            // Backed copies are in no list of the worker's: their nodes are found by
            // their holders (a clear is rare; the walk is one look per node).
            nodes.extend(
                self.nodes
                    .iter()
                    .enumerate()
                    .filter(|(_, n)| n.live && n.holders.contains(slot))
                    .map(|(id, _)| id as NodeId),
            );
        }
        nodes.sort_unstable();
        nodes.dedup();
        for &node in &nodes {
            self.nodes[node as usize].remove_holder(slot);
        }
        self.entries -= dropped;
        // Merging frees nodes, so first prune, then merge what is still there.
        for &node in &nodes {
            self.prune(names, node);
        }
        for node in nodes {
            if self.nodes[node as usize].live {
                self.merge_around(node);
            }
        }
        dropped
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
        self.live_nodes().map(|n| n.len() * n.holders.len()).sum()
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
