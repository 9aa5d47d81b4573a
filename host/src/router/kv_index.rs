//! The router's KV index: which worker already holds which prefix of a prompt.
//!
//! A KV-aware booking credits a worker for the prompt blocks it would not have to
//! prefill again, and the hint stage tells the booked worker which of a peer's blocks to
//! fetch. Both need the same answer: for this request, how many leading blocks does each
//! worker hold, and under which names. Workers report what they cache as a stream of KV
//! events (`stored` / `removed` / `cleared`); this index folds those streams into one
//! structure that answers that question on the booking hot path.
//!
//! **Two hashes per block.** The router names a block by its *sequence hash*, a chain of
//! xxh3 hashes over the token ids of the block, seeded with the hash of everything before it
//! ([`block_hashes`]), so a request can be matched before any engine has seen it. Engines
//! name blocks by their own hashes, which differ between engines, versions and even
//! workers for the same tokens (salts, LoRA ids, hash seeds). The index keys on the
//! router's hash so one lookup per block serves every worker, and keeps each worker's
//! engine hash beside it because everything that goes back to an engine — a removal we
//! must recognise, a parent a later `stored` event chains onto, a "fetch these blocks
//! from peer X" hint — has to speak that engine's names, not ours.
//!
//! **Prefix semantics.** A KV block is only usable if every block before it is present:
//! attention over block *i* needs the keys and values of blocks `0..i`. So a worker's
//! overlap with a request is the length of the leading run of blocks it holds, and a
//! block held after a gap is worth nothing. Removing a block does not cascade to its
//! descendants (engines send their own removals, and may evict a parent before its
//! children), but the prefix walk stops at the gap anyway, so a stale descendant cannot
//! be credited.
//!
//! **Cost.** With 64 workers and a 4,096-token prompt (256 blocks) a booking has about
//! 10 µs in total. [`KvIndex::overlaps`] does one hash-map probe per request block —
//! never one per worker and block — walks only the holders of that block, stops at the
//! first block no still-matching worker holds, and writes into a caller-owned
//! [`Overlaps`] whose buffers are reused across bookings. What remains is proportional
//! to the answer itself: one engine hash written per matched (worker, block).

use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasherDefault, Hasher};

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::{xxh3_64_with_seed, Xxh3};

/// Seed of every router block hash. Fixed so that hashes agree across router restarts
/// and between the router and any tool that recomputes them.
const HASH_SEED: u64 = 1337;

/// Token bytes of one block hashed from a stack buffer up to this size; the common
/// engine block sizes (16–128 tokens) fit, larger ones fall back to streaming.
const STACK_BLOCK_BYTES: usize = 1024;

/// A worker as the router addresses it: one engine data-parallel rank.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct WorkerKey {
    pub worker_id: u64,
    pub dp_rank: u32,
}

impl fmt::Display for WorkerKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "worker {} dp_rank {}", self.worker_id, self.dp_rank)
    }
}

/// The router's chained block hashes of a prompt: one per FULL block of `block_size`
/// tokens (a trailing partial block gets none, because no engine caches a partial block
/// under a name another request could match).
///
/// Block 0's hash = `xxh3_64_with_seed(its token ids as little-endian u32 bytes, 1337)`;
/// block `i > 0`'s = `xxh3_64_with_seed(its token ids, seed = block i-1's hash)`. One
/// xxh3 call per block: seeding with the parent's hash chains the whole prefix in at no
/// extra cost.
/// Clears `out` and fills it. A `block_size` of 0 yields no hashes.
pub fn block_hashes(token_ids: &[u32], block_size: usize, out: &mut Vec<u64>) {
    out.clear();
    if block_size == 0 {
        return;
    }
    out.reserve(token_ids.len() / block_size);
    let mut buf = [0u8; STACK_BLOCK_BYTES];
    let mut parent = None;
    for block in token_ids.chunks_exact(block_size) {
        let hash = chained_hash(parent, block, &mut buf);
        out.push(hash);
        parent = Some(hash);
    }
}

/// The sequence hash of a block of `tokens` following `parent`. `buf` is the caller's
/// so that it is zeroed once per prompt, not once per block.
fn chained_hash(parent: Option<u64>, tokens: &[u32], buf: &mut [u8; STACK_BLOCK_BYTES]) -> u64 {
    let seed = parent.unwrap_or(HASH_SEED);
    if tokens.len() * 4 <= STACK_BLOCK_BYTES {
        let len = le_bytes(tokens, buf);
        xxh3_64_with_seed(&buf[..len], seed)
    } else {
        let mut hasher = Xxh3::with_seed(seed);
        for chunk in tokens.chunks(STACK_BLOCK_BYTES / 4) {
            let len = le_bytes(chunk, buf);
            hasher.update(&buf[..len]);
        }
        hasher.digest()
    }
}

/// Writes `tokens` (at most `STACK_BLOCK_BYTES / 4`) into `buf` as little-endian bytes
/// and returns their length.
fn le_bytes(tokens: &[u32], buf: &mut [u8; STACK_BLOCK_BYTES]) -> usize {
    for (dst, t) in buf.chunks_exact_mut(4).zip(tokens) {
        dst.copy_from_slice(&t.to_le_bytes());
    }
    tokens.len() * 4
}

/// A KV event from one worker's engine.
///
/// Wire format (externally tagged, snake_case, unknown fields refused so that a field an
/// engine adapter misspells is an error rather than silently dropped data):
/// ```json
/// {"stored": {"parent_block_hash": 7, "blocks": [{"block_hash": 11, "token_ids": [1, 2]}]}}
/// {"removed": {"block_hashes": [11, 22]}}
/// "cleared"
/// ```
/// `block_hash` / `parent_block_hash` are the engine's own hashes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum KvEvent {
    /// Blocks the engine now holds, each chained onto the one before it; the first onto
    /// `parent_block_hash`, or starting a sequence when it is `None`.
    Stored {
        parent_block_hash: Option<u64>,
        blocks: Vec<StoredBlock>,
    },
    /// Blocks the engine evicted, by engine hash.
    Removed { block_hashes: Vec<u64> },
    /// The engine dropped its whole cache (restart, reset).
    Cleared,
}

/// One block of a [`KvEvent::Stored`]: its engine hash and exactly `block_size` token ids.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoredBlock {
    pub block_hash: u64,
    pub token_ids: Vec<u32>,
}

/// Why a KV event was refused. A refused event changes nothing in the index.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
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

/// Hasher for the index's maps. The default SipHash costs more than the rest of a probe
/// for u64 keys; the router's keys are xxh3 outputs, but engine hashes and worker ids may
/// be structured (counters, small ids), so keys still go through one folded 64×64→128
/// multiply, which spreads every input bit over both the bucket bits and the tag bits
/// hashbrown uses. Denial-of-service resistance is not needed: keys come from our own
/// workers, not from clients.
#[derive(Default, Clone, Copy)]
struct FoldHasher {
    state: u64,
}

impl Hasher for FoldHasher {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
    }

    #[inline]
    fn write_u64(&mut self, value: u64) {
        const K: u64 = 0x9e37_79b9_7f4a_7c15;
        let product = u128::from(self.state ^ value) * u128::from(K);
        self.state = (product as u64) ^ ((product >> 64) as u64);
    }

    #[inline]
    fn write_u32(&mut self, value: u32) {
        self.write_u64(u64::from(value));
    }

    #[inline]
    fn write_usize(&mut self, value: usize) {
        self.write_u64(value as u64);
    }

    #[inline]
    fn finish(&self) -> u64 {
        self.state
    }
}

type FastMap<K, V> = HashMap<K, V, BuildHasherDefault<FoldHasher>>;

/// Dense worker number, so the prefix walk can index scratch arrays instead of hashing
/// worker keys.
type Slot = u32;

/// One worker's copy of one block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Holder {
    slot: Slot,
    engine_hash: u64,
}

#[derive(Debug)]
struct WorkerBlocks {
    /// Engine hash → router sequence hash: removals and parents arrive as engine hashes.
    by_engine: FastMap<u64, u64>,
}

/// The router's KV index. See the [module documentation](self).
#[derive(Debug)]
pub struct KvIndex {
    block_size: usize,
    /// Router sequence hash → every (worker, engine hash) holding that block. A worker
    /// may appear twice if its engine stored the same tokens under two engine hashes
    /// (e.g. different salts); each copy lives and dies with its own engine hash.
    blocks: FastMap<u64, Vec<Holder>>,
    slots: FastMap<WorkerKey, Slot>,
    /// Indexed by slot; `None` for a freed slot awaiting reuse.
    workers: Vec<Option<WorkerBlocks>>,
    /// Indexed by slot, kept beside `workers` so the walk reads a dense array.
    slot_keys: Vec<WorkerKey>,
    free_slots: Vec<Slot>,
    entries: usize,
}

impl KvIndex {
    /// An empty index for engines whose KV blocks hold `block_size` tokens.
    ///
    /// # Panics
    /// If `block_size` is 0: no block could ever be stored or matched, so that is a
    /// configuration error the caller must refuse before building the router.
    pub fn new(block_size: usize) -> Self {
        assert!(block_size > 0, "KV block size must be at least 1 token");
        Self {
            block_size,
            blocks: FastMap::default(),
            slots: FastMap::default(),
            workers: Vec::new(),
            slot_keys: Vec::new(),
            free_slots: Vec::new(),
            entries: 0,
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Applies one event from `worker`. Atomic: on error nothing changed.
    ///
    /// Stored blocks chain from the parent (or start a sequence when the parent is
    /// `None`); each block's router sequence hash is computed from the parent's sequence
    /// hash and the block's tokens exactly as [`block_hashes`] does for a prompt, so a
    /// request's hashes meet what the workers stored. Removing an engine hash the worker
    /// does not hold is counted in [`ApplyStats::missing_removals`], not refused.
    pub fn apply(
        &mut self,
        worker: WorkerKey,
        event: &KvEvent,
    ) -> Result<ApplyStats, KvEventError> {
        match event {
            KvEvent::Stored {
                parent_block_hash,
                blocks,
            } => self.apply_stored(worker, *parent_block_hash, blocks),
            KvEvent::Removed { block_hashes } => Ok(self.apply_removed(worker, block_hashes)),
            KvEvent::Cleared => Ok(ApplyStats {
                removed: self.clear_worker(worker),
                ..ApplyStats::default()
            }),
        }
    }

    fn apply_stored(
        &mut self,
        worker: WorkerKey,
        parent_block_hash: Option<u64>,
        blocks: &[StoredBlock],
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
                    .and_then(|w| w.by_engine.get(&parent_hash).copied());
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

        let slot = self.slot_for(worker);
        let mut buf = [0u8; STACK_BLOCK_BYTES];
        for block in blocks {
            let seq = chained_hash(parent, &block.token_ids, &mut buf);
            self.insert(slot, block.block_hash, seq);
            parent = Some(seq);
        }
        Ok(ApplyStats {
            stored: blocks.len(),
            ..ApplyStats::default()
        })
    }

    fn apply_removed(&mut self, worker: WorkerKey, engine_hashes: &[u64]) -> ApplyStats {
        let mut stats = ApplyStats::default();
        let Some(&slot) = self.slots.get(&worker) else {
            stats.missing_removals = engine_hashes.len();
            return stats;
        };
        for &engine_hash in engine_hashes {
            let seq = self.workers[slot as usize]
                .as_mut()
                .and_then(|w| w.by_engine.remove(&engine_hash));
            match seq {
                Some(seq) => {
                    detach(&mut self.blocks, seq, Holder { slot, engine_hash });
                    self.entries -= 1;
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
    /// usually starts storing again at once. Returns how many blocks were dropped.
    fn clear_worker(&mut self, worker: WorkerKey) -> usize {
        let Some(&slot) = self.slots.get(&worker) else {
            return 0;
        };
        let Some(w) = self.workers[slot as usize].as_mut() else {
            return 0;
        };
        let dropped = w.by_engine.len();
        for (engine_hash, seq) in w.by_engine.drain() {
            detach(&mut self.blocks, seq, Holder { slot, engine_hash });
        }
        self.entries -= dropped;
        dropped
    }

    fn slot_for(&mut self, worker: WorkerKey) -> Slot {
        if let Some(&slot) = self.slots.get(&worker) {
            return slot;
        }
        let blocks = WorkerBlocks {
            by_engine: FastMap::default(),
        };
        let slot = match self.free_slots.pop() {
            Some(slot) => {
                self.workers[slot as usize] = Some(blocks);
                self.slot_keys[slot as usize] = worker;
                slot
            }
            None => {
                // Slots are reused, so their number is the peak fleet size: far below 2^32.
                let slot = self.workers.len() as Slot;
                self.workers.push(Some(blocks));
                self.slot_keys.push(worker);
                slot
            }
        };
        self.slots.insert(worker, slot);
        slot
    }

    fn insert(&mut self, slot: Slot, engine_hash: u64, seq: u64) {
        let Some(w) = self.workers[slot as usize].as_mut() else {
            return;
        };
        match w.by_engine.insert(engine_hash, seq) {
            Some(old) if old == seq => return,
            // The engine reused a hash for other tokens: its old block is gone.
            Some(old) => detach(&mut self.blocks, old, Holder { slot, engine_hash }),
            None => self.entries += 1,
        }
        self.blocks
            .entry(seq)
            .or_default()
            .push(Holder { slot, engine_hash });
    }

    /// For a request's sequence hashes: every worker holding at least the first block,
    /// with how many leading blocks it holds (a prefix match, stopping at the first block
    /// it lacks) and its engine hashes of those blocks in order. Clears and fills `out`.
    pub fn overlaps(&self, hashes: &[u64], out: &mut Overlaps) {
        out.entries.clear();
        out.by_worker.clear();
        let Some(first) = hashes.first().and_then(|h| self.blocks.get(h)) else {
            return;
        };

        // Scratch is indexed by slot, so a holder costs one array read, not a lookup.
        let slots = self.slot_keys.len();
        if out.walk.len() < slots {
            out.walk.resize(slots, Walk::default());
        }
        // One row of engine hashes per worker holding block 0. The walk writes one column
        // per block; a row length that is a power-of-two number of bytes would put every
        // row's current cache line in the same few L1 sets and miss on nearly every
        // write, so rows span an odd number of cache lines.
        let stride = (hashes.len().div_ceil(8) | 1) * 8;
        // Grow only: zeroing the matrix on every booking would cost more than the walk.
        // Cells past a worker's depth are stale and never read.
        if out.engine.len() < stride * first.len() {
            out.engine.resize(stride * first.len(), 0);
        }
        // Slices, not the Vecs: a store through a Vec's buffer could alias its header as
        // far as the optimiser knows, so it would reload pointer and length every holder.
        let walk = out.walk.as_mut_slice();
        let engine = out.engine.as_mut_slice();

        let mut rows = 0;
        for holder in first {
            let state = &mut walk[holder.slot as usize];
            // A second copy of the block under another engine hash adds nothing.
            if state.depth == 0 {
                *state = Walk {
                    depth: 1,
                    row: rows * stride,
                };
                engine[state.row] = holder.engine_hash;
                rows += 1;
            }
        }
        for (d, hash) in hashes.iter().enumerate().skip(1) {
            let Some(holders) = self.blocks.get(hash) else {
                break;
            };
            let mut advanced = false;
            for holder in holders {
                let state = &mut walk[holder.slot as usize];
                // Still matching iff it held every block so far; workers that never
                // held block 0 sit at depth 0 and are skipped here too.
                if state.depth as usize == d {
                    engine[state.row + d] = holder.engine_hash;
                    state.depth += 1;
                    advanced = true;
                }
            }
            if !advanced {
                break;
            }
        }

        for holder in first {
            let state = &mut walk[holder.slot as usize];
            if state.depth != 0 {
                out.entries.push(Entry {
                    worker: self.slot_keys[holder.slot as usize],
                    cached: state.depth as usize,
                    row: state.row,
                });
                // Leave the scratch zeroed for the next call.
                state.depth = 0;
            }
        }
        out.entries
            .sort_unstable_by_key(|e| (std::cmp::Reverse(e.cached), e.worker));
        out.by_worker.extend_from_slice(&out.entries);
        out.by_worker.sort_unstable_by_key(|e| e.worker);
    }

    /// Number of (worker, block) entries held.
    pub fn len(&self) -> usize {
        self.entries
    }

    pub fn is_empty(&self) -> bool {
        self.entries == 0
    }

    /// Number of distinct router sequence hashes held by any worker.
    pub fn distinct_blocks(&self) -> usize {
        self.blocks.len()
    }
}

/// Removes one holder of `seq`, and the sequence hash itself once nobody holds it, so
/// `distinct_blocks` and memory follow the fleet's caches down as well as up.
fn detach(blocks: &mut FastMap<u64, Vec<Holder>>, seq: u64, holder: Holder) {
    if let Some(holders) = blocks.get_mut(&seq) {
        if let Some(pos) = holders.iter().position(|h| *h == holder) {
            holders.swap_remove(pos);
        }
        if holders.is_empty() {
            blocks.remove(&seq);
        }
    }
}

/// A worker's progress during one prefix walk.
#[derive(Debug, Default, Clone, Copy)]
struct Walk {
    /// Leading request blocks matched so far; 0 for a worker not holding block 0.
    depth: u32,
    /// Start of its row in `Overlaps::engine`.
    row: usize,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    worker: WorkerKey,
    cached: usize,
    /// Start of this worker's engine hashes in `Overlaps::engine`.
    row: usize,
}

/// Reusable output of [`KvIndex::overlaps`]: entries sorted by cached blocks descending,
/// then worker id, then dp rank ascending. Keep one per booking thread and pass it to
/// every call so its buffers are allocated once.
#[derive(Default)]
pub struct Overlaps {
    entries: Vec<Entry>,
    /// The same entries sorted by worker, so a by-worker lookup is one binary search.
    by_worker: Vec<Entry>,
    /// Engine hashes, one row per index slot.
    engine: Vec<u64>,
    /// Scratch indexed by slot, all depths 0 between walks.
    walk: Vec<Walk>,
}

impl Overlaps {
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of workers holding at least the request's first block.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Each worker with its engine hashes of the matched prefix (length = cached blocks),
    /// longest prefix first.
    pub fn iter(&self) -> impl Iterator<Item = (WorkerKey, &[u64])> {
        self.entries
            .iter()
            .map(|e| (e.worker, &self.engine[e.row..e.row + e.cached]))
    }

    /// Leading blocks `worker` holds; 0 if it holds not even the first.
    /// Bytes held by the reusable buffers (they only grow, so a caller can
    /// drop an `Overlaps` that a very long request made large).
    pub fn retained_bytes(&self) -> usize {
        self.engine.capacity() * std::mem::size_of::<u64>()
            + (self.entries.capacity() + self.by_worker.capacity()) * std::mem::size_of::<Entry>()
            + self.walk.capacity() * std::mem::size_of::<Walk>()
    }

    pub fn cached_blocks(&self, worker: WorkerKey) -> usize {
        self.find(worker).map_or(0, |e| e.cached)
    }

    /// `worker`'s engine hashes of its matched prefix; empty if it holds no prefix.
    pub fn engine_hashes(&self, worker: WorkerKey) -> &[u64] {
        self.find(worker)
            .map_or(&[], |e| &self.engine[e.row..e.row + e.cached])
    }

    fn find(&self, worker: WorkerKey) -> Option<&Entry> {
        self.by_worker
            .binary_search_by_key(&worker, |e| e.worker)
            .ok()
            .map(|pos| &self.by_worker[pos])
    }
}

impl fmt::Debug for Overlaps {
    // The buffers hold stale cells past each prefix; show only what the answer is.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BS: usize = 4;

    fn w(worker_id: u64, dp_rank: u32) -> WorkerKey {
        WorkerKey { worker_id, dp_rank }
    }

    fn hashes(tokens: &[u32]) -> Vec<u64> {
        let mut out = Vec::new();
        block_hashes(tokens, BS, &mut out);
        out
    }

    /// A `stored` event for `tokens` (whole blocks) with engine hashes `engine`.
    fn stored(parent: Option<u64>, tokens: &[u32], engine: &[u64]) -> KvEvent {
        assert_eq!(tokens.len(), engine.len() * BS);
        KvEvent::Stored {
            parent_block_hash: parent,
            blocks: tokens
                .chunks(BS)
                .zip(engine)
                .map(|(t, &block_hash)| StoredBlock {
                    block_hash,
                    token_ids: t.to_vec(),
                })
                .collect(),
        }
    }

    fn prompt(blocks: usize) -> Vec<u32> {
        (0..(blocks * BS) as u32).map(|t| t * 7 + 3).collect()
    }

    fn overlaps(index: &KvIndex, tokens: &[u32]) -> Overlaps {
        let mut out = Overlaps::new();
        index.overlaps(&hashes(tokens), &mut out);
        out
    }

    fn as_vec(out: &Overlaps) -> Vec<(WorkerKey, Vec<u64>)> {
        out.iter().map(|(k, h)| (k, h.to_vec())).collect()
    }

    #[test]
    fn block_hashes_follow_the_documented_formula() {
        let tokens = [1u32, 2, 3, 4, 5, 6, 7, 8];
        let bytes = |t: &[u32]| t.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let s0 = xxh3_64_with_seed(&bytes(&tokens[..4]), 1337);
        let s1 = xxh3_64_with_seed(&bytes(&tokens[4..]), s0);
        assert_eq!(hashes(&tokens), vec![s0, s1]);

        // Any block size, odd ones included: a block's hash covers exactly its tokens.
        let mut out = Vec::new();
        block_hashes(&tokens[..7], 3, &mut out);
        assert_eq!(out.len(), 2);
        assert_eq!(out[0], xxh3_64_with_seed(&bytes(&tokens[..3]), 1337));
        assert_eq!(out[1], xxh3_64_with_seed(&bytes(&tokens[3..6]), out[0]));
    }

    #[test]
    fn block_hashes_chain_on_the_prefix() {
        let a = hashes(&[1, 2, 3, 4, 9, 9, 9, 9]);
        let b = hashes(&[5, 6, 7, 8, 9, 9, 9, 9]);
        // Same tokens in block 1, different prefix: different sequence hash.
        assert_ne!(a[1], b[1]);
        assert_ne!(a[0], b[0]);
        // Block 1 alone is not block 1 after a prefix.
        assert_ne!(hashes(&[9, 9, 9, 9])[0], a[1]);
    }

    #[test]
    fn block_hashes_skip_a_partial_trailing_block_and_clear_out() {
        let mut out = vec![42, 43, 44, 45, 46];
        block_hashes(&[1, 2, 3, 4, 5, 6, 7], BS, &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!(out, hashes(&[1, 2, 3, 4]));
        block_hashes(&[1, 2, 3], BS, &mut out);
        assert!(out.is_empty());
        block_hashes(&[1, 2, 3], 0, &mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn large_blocks_hash_like_small_ones() {
        // Over the stack buffer, the streaming path must give the one-shot hash.
        let tokens: Vec<u32> = (0..600).collect();
        let mut out = Vec::new();
        block_hashes(&tokens, 300, &mut out);
        let bytes: Vec<u8> = tokens[..300].iter().flat_map(|x| x.to_le_bytes()).collect();
        assert_eq!(out[0], xxh3_64_with_seed(&bytes, 1337));
        assert_eq!(out.len(), 2);
    }

    #[test]
    fn stored_blocks_give_the_prefix_with_engine_hashes() {
        let mut index = KvIndex::new(BS);
        let tokens = prompt(3);
        let stats = index
            .apply(w(1, 0), &stored(None, &tokens, &[101, 102, 103]))
            .unwrap();
        assert_eq!(stats.stored, 3);
        assert_eq!(index.len(), 3);
        assert_eq!(index.distinct_blocks(), 3);

        // A longer request whose first three blocks are cached.
        let out = overlaps(&index, &prompt(5));
        assert_eq!(out.len(), 1);
        assert_eq!(out.cached_blocks(w(1, 0)), 3);
        assert_eq!(out.engine_hashes(w(1, 0)), &[101, 102, 103]);
        assert_eq!(out.cached_blocks(w(2, 0)), 0);
        assert!(out.engine_hashes(w(2, 0)).is_empty());

        // A shorter request matches only its own blocks.
        let out = overlaps(&index, &prompt(2));
        assert_eq!(out.engine_hashes(w(1, 0)), &[101, 102]);

        // A request with a different first block matches nothing.
        let mut other = prompt(3);
        other[0] += 1;
        assert!(overlaps(&index, &other).is_empty());
    }

    #[test]
    fn workers_keep_their_own_engine_hashes_for_the_same_tokens() {
        let mut index = KvIndex::new(BS);
        let tokens = prompt(2);
        index
            .apply(w(1, 0), &stored(None, &tokens, &[11, 12]))
            .unwrap();
        index
            .apply(w(2, 0), &stored(None, &tokens, &[21, 22]))
            .unwrap();
        assert_eq!(index.len(), 4);
        assert_eq!(index.distinct_blocks(), 2);
        let out = overlaps(&index, &tokens);
        assert_eq!(out.engine_hashes(w(1, 0)), &[11, 12]);
        assert_eq!(out.engine_hashes(w(2, 0)), &[21, 22]);
    }

    #[test]
    fn prefix_stops_at_a_gap() {
        let mut index = KvIndex::new(BS);
        let tokens = prompt(4);
        index
            .apply(w(1, 0), &stored(None, &tokens, &[1, 2, 3, 4]))
            .unwrap();
        let stats = index
            .apply(
                w(1, 0),
                &KvEvent::Removed {
                    block_hashes: vec![2],
                },
            )
            .unwrap();
        assert_eq!(
            stats,
            ApplyStats {
                removed: 1,
                ..ApplyStats::default()
            }
        );
        // Blocks 3 and 4 are still held but worth nothing after the gap.
        assert_eq!(index.len(), 3);
        let out = overlaps(&index, &tokens);
        assert_eq!(out.engine_hashes(w(1, 0)), &[1]);
    }

    #[test]
    fn removed_counts_missing_hashes_and_cleared_drops_everything() {
        let mut index = KvIndex::new(BS);
        let tokens = prompt(3);
        index
            .apply(w(1, 0), &stored(None, &tokens, &[1, 2, 3]))
            .unwrap();
        index
            .apply(w(2, 0), &stored(None, &tokens, &[1, 2, 3]))
            .unwrap();

        let stats = index
            .apply(
                w(1, 0),
                &KvEvent::Removed {
                    block_hashes: vec![3, 3, 99],
                },
            )
            .unwrap();
        assert_eq!(
            stats,
            ApplyStats {
                stored: 0,
                removed: 1,
                missing_removals: 2
            }
        );
        // Worker 2's block of the same engine hash is untouched.
        let out = overlaps(&index, &tokens);
        assert_eq!(out.cached_blocks(w(1, 0)), 2);
        assert_eq!(out.cached_blocks(w(2, 0)), 3);

        let stats = index.apply(w(2, 0), &KvEvent::Cleared).unwrap();
        assert_eq!(stats.removed, 3);
        assert_eq!(index.len(), 2);
        let out = overlaps(&index, &tokens);
        assert_eq!(out.len(), 1);
        assert_eq!(out.cached_blocks(w(2, 0)), 0);

        // Removals from a worker the index never saw are all missing, not errors.
        let stats = index
            .apply(
                w(9, 0),
                &KvEvent::Removed {
                    block_hashes: vec![1],
                },
            )
            .unwrap();
        assert_eq!(stats.missing_removals, 1);

        index.apply(w(1, 0), &KvEvent::Cleared).unwrap();
        assert!(index.is_empty());
        assert_eq!(index.distinct_blocks(), 0);

        // A cleared worker stores again from scratch.
        index
            .apply(w(2, 0), &stored(None, &tokens, &[7, 8, 9]))
            .unwrap();
        assert_eq!(overlaps(&index, &tokens).engine_hashes(w(2, 0)), &[7, 8, 9]);
    }

    #[test]
    fn remove_worker_forgets_it_and_reuses_its_slot() {
        let mut index = KvIndex::new(BS);
        let tokens = prompt(2);
        index
            .apply(w(1, 0), &stored(None, &tokens, &[11, 12]))
            .unwrap();
        index
            .apply(w(2, 0), &stored(None, &tokens, &[21, 22]))
            .unwrap();
        index.remove_worker(w(1, 0));
        assert_eq!(index.len(), 2);
        let out = overlaps(&index, &tokens);
        assert_eq!(as_vec(&out), vec![(w(2, 0), vec![21, 22])]);

        // Its parents are gone too.
        let more = prompt(3);
        let err = index
            .apply(w(1, 0), &stored(Some(12), &more[8..], &[13]))
            .unwrap_err();
        assert!(matches!(err, KvEventError::UnknownParent { .. }));

        // A new worker takes the freed slot without inheriting anything.
        index
            .apply(w(3, 0), &stored(None, &tokens[..4], &[31]))
            .unwrap();
        let out = overlaps(&index, &tokens);
        assert_eq!(
            as_vec(&out),
            vec![(w(2, 0), vec![21, 22]), (w(3, 0), vec![31])]
        );
        index.remove_worker(w(2, 0));
        index.remove_worker(w(3, 0));
        index.remove_worker(w(3, 0));
        assert!(index.is_empty());
        assert_eq!(index.distinct_blocks(), 0);
    }

    #[test]
    fn unknown_parent_is_refused_and_changes_nothing() {
        let mut index = KvIndex::new(BS);
        let tokens = prompt(3);
        index
            .apply(w(1, 0), &stored(None, &tokens[..4], &[1]))
            .unwrap();
        let before = overlaps(&index, &tokens);

        let err = index
            .apply(w(1, 0), &stored(Some(77), &tokens[4..], &[2, 3]))
            .unwrap_err();
        assert_eq!(
            err,
            KvEventError::UnknownParent {
                worker: w(1, 0),
                parent_block_hash: 77
            }
        );
        let msg = err.to_string();
        assert!(
            msg.contains("77") && msg.contains("worker 1 dp_rank 0"),
            "{msg}"
        );
        assert!(
            msg.contains("ignored") && msg.contains("unchanged"),
            "{msg}"
        );

        // A parent another worker stored is still unknown to this one.
        index
            .apply(w(2, 0), &stored(None, &tokens[..4], &[5]))
            .unwrap();
        assert!(index
            .apply(w(1, 0), &stored(Some(5), &tokens[4..], &[2, 3]))
            .is_err());
        // Nor does an unknown worker get a slot from a refused event.
        assert!(index
            .apply(w(3, 0), &stored(Some(1), &tokens[4..], &[2, 3]))
            .is_err());

        assert_eq!(index.len(), 2);
        assert_eq!(index.distinct_blocks(), 1);
        let after = overlaps(&index, &tokens);
        assert_eq!(after.engine_hashes(w(1, 0)), before.engine_hashes(w(1, 0)));
        assert_eq!(after.len(), 2);
    }

    #[test]
    fn wrong_token_count_is_refused_and_changes_nothing() {
        let mut index = KvIndex::new(BS);
        let event = KvEvent::Stored {
            parent_block_hash: None,
            blocks: vec![
                StoredBlock {
                    block_hash: 1,
                    token_ids: vec![1, 2, 3, 4],
                },
                StoredBlock {
                    block_hash: 2,
                    token_ids: vec![5, 6, 7],
                },
            ],
        };
        let err = index.apply(w(1, 0), &event).unwrap_err();
        assert_eq!(
            err,
            KvEventError::WrongBlockSize {
                worker: w(1, 0),
                index: 1,
                block_hash: 2,
                tokens: 3,
                block_size: BS
            }
        );
        let msg = err.to_string();
        assert!(
            msg.contains("3 token ids") && msg.contains("block size is 4"),
            "{msg}"
        );
        assert!(msg.contains("unchanged"), "{msg}");
        // Even the valid first block was not stored.
        assert!(index.is_empty());
        assert!(overlaps(&index, &[1, 2, 3, 4]).is_empty());
    }

    #[test]
    fn chained_stored_events_continue_the_request_hashes() {
        let mut index = KvIndex::new(BS);
        let tokens = prompt(5);
        index
            .apply(w(1, 0), &stored(None, &tokens[..8], &[1, 2]))
            .unwrap();
        index
            .apply(w(1, 0), &stored(Some(2), &tokens[8..], &[3, 4, 5]))
            .unwrap();
        assert_eq!(index.distinct_blocks(), 5);
        let out = overlaps(&index, &tokens);
        assert_eq!(out.engine_hashes(w(1, 0)), &[1, 2, 3, 4, 5]);

        // Branching from a middle block shares the prefix and nothing after it.
        let mut branch = tokens.clone();
        branch[12] += 1;
        index
            .apply(w(2, 0), &stored(None, &branch[..12], &[1, 2, 3]))
            .unwrap();
        index
            .apply(w(2, 0), &stored(Some(3), &branch[12..], &[40, 50]))
            .unwrap();
        assert_eq!(index.distinct_blocks(), 7);
        let out = overlaps(&index, &tokens);
        assert_eq!(out.engine_hashes(w(2, 0)), &[1, 2, 3]);
        let out = overlaps(&index, &branch);
        assert_eq!(out.engine_hashes(w(2, 0)), &[1, 2, 3, 40, 50]);
        assert_eq!(out.engine_hashes(w(1, 0)), &[1, 2, 3]);
    }

    #[test]
    fn overlaps_are_ordered_longest_then_worker_then_rank() {
        let mut index = KvIndex::new(BS);
        let tokens = prompt(3);
        let store = |index: &mut KvIndex, key: WorkerKey, blocks: usize| {
            let engine: Vec<u64> = (0..blocks as u64).map(|b| key.worker_id * 10 + b).collect();
            index
                .apply(key, &stored(None, &tokens[..blocks * BS], &engine))
                .unwrap();
        };
        store(&mut index, w(5, 1), 1);
        store(&mut index, w(3, 0), 2);
        store(&mut index, w(9, 0), 3);
        store(&mut index, w(5, 0), 1);
        store(&mut index, w(2, 0), 1);
        store(&mut index, w(4, 0), 3);
        let mut out = Overlaps::new();
        index.overlaps(&hashes(&tokens), &mut out);
        let order: Vec<(WorkerKey, usize)> = out.iter().map(|(k, h)| (k, h.len())).collect();
        assert_eq!(
            order,
            vec![
                (w(4, 0), 3),
                (w(9, 0), 3),
                (w(3, 0), 2),
                (w(2, 0), 1),
                (w(5, 0), 1),
                (w(5, 1), 1),
            ]
        );
        assert_eq!(out.engine_hashes(w(9, 0)), &[90, 91, 92]);
        assert_eq!(out.cached_blocks(w(5, 1)), 1);

        // Reusing the output for a shorter request leaves nothing stale behind.
        index.overlaps(&hashes(&tokens[..4]), &mut out);
        assert_eq!(out.len(), 6);
        assert!(out.iter().all(|(_, h)| h.len() == 1));
        assert_eq!(out.engine_hashes(w(4, 0)), &[40]);
        index.overlaps(&[], &mut out);
        assert!(out.is_empty());
        assert_eq!(out.cached_blocks(w(4, 0)), 0);
    }

    #[test]
    fn same_tokens_under_two_engine_hashes_survive_one_removal() {
        let mut index = KvIndex::new(BS);
        let tokens = prompt(1);
        index.apply(w(1, 0), &stored(None, &tokens, &[1])).unwrap();
        index.apply(w(1, 0), &stored(None, &tokens, &[2])).unwrap();
        assert_eq!(index.len(), 2);
        let out = overlaps(&index, &tokens);
        assert_eq!(out.len(), 1);
        assert_eq!(out.cached_blocks(w(1, 0)), 1);
        index
            .apply(
                w(1, 0),
                &KvEvent::Removed {
                    block_hashes: vec![1],
                },
            )
            .unwrap();
        assert_eq!(overlaps(&index, &tokens).engine_hashes(w(1, 0)), &[2]);

        // Storing the same engine hash again is idempotent.
        index.apply(w(1, 0), &stored(None, &tokens, &[2])).unwrap();
        assert_eq!(index.len(), 1);
        // Reusing an engine hash for other tokens moves it.
        let other = prompt(2);
        index
            .apply(w(1, 0), &stored(None, &other[4..], &[2]))
            .unwrap();
        assert_eq!(index.len(), 1);
        assert!(overlaps(&index, &tokens).is_empty());
        assert_eq!(overlaps(&index, &other[4..]).engine_hashes(w(1, 0)), &[2]);
    }

    /// Random event streams against a naive model: per worker, the set of router hashes
    /// it holds; a worker's overlap is the leading run of a request's hashes in its set.
    #[test]
    fn random_event_streams_match_a_naive_model() {
        use std::collections::{BTreeMap, HashSet};

        let mut rng = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = move |bound: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % bound
        };
        let base = prompt(8);
        let mut docs = [base.clone(), base.clone(), base, prompt(8)];
        docs[1][3 * BS] += 1; // shares 3 blocks with doc 0
        docs[2][6 * BS + 1] += 1; // shares 6 blocks
        docs[3].reverse(); // shares nothing
        let doc_hashes: Vec<Vec<u64>> = docs.iter().map(|d| hashes(d)).collect();
        let workers = [w(1, 0), w(1, 1), w(2, 0), w(3, 0), w(4, 2)];
        // Engines name blocks by content, but each worker differently.
        let engine = |k: WorkerKey, seq: u64| seq ^ (k.worker_id << 40) ^ u64::from(k.dp_rank);

        let mut index = KvIndex::new(BS);
        let mut model: BTreeMap<WorkerKey, HashSet<u64>> = BTreeMap::new();
        let mut out = Overlaps::new();
        let (mut chained, mut refused, mut longest) = (0, 0, 0);
        for _ in 0..3000 {
            let k = workers[next(workers.len() as u64) as usize];
            let held = model.entry(k).or_default();
            match next(10) {
                0..=5 => {
                    let d = next(docs.len() as u64) as usize;
                    let start = next(8) as usize;
                    let count = 1 + next((8 - start) as u64) as usize;
                    let parent = (start > 0).then(|| engine(k, doc_hashes[d][start - 1]));
                    let blocks = &doc_hashes[d][start..start + count];
                    let ev = stored(
                        parent,
                        &docs[d][start * BS..(start + count) * BS],
                        &blocks.iter().map(|&h| engine(k, h)).collect::<Vec<_>>(),
                    );
                    let known = start == 0 || held.contains(&doc_hashes[d][start - 1]);
                    match index.apply(k, &ev) {
                        Ok(stats) => {
                            assert!(known);
                            chained += usize::from(start > 0);
                            assert_eq!(stats.stored, count);
                            held.extend(blocks);
                        }
                        Err(err) => {
                            assert!(!known);
                            refused += 1;
                            assert!(matches!(err, KvEventError::UnknownParent { .. }));
                        }
                    }
                }
                6..=7 => {
                    let d = next(docs.len() as u64) as usize;
                    let victims: Vec<u64> = (0..1 + next(3))
                        .map(|_| doc_hashes[d][next(8) as usize])
                        .collect();
                    let mut removed = 0;
                    for v in &victims {
                        removed += usize::from(held.remove(v));
                    }
                    let ev = KvEvent::Removed {
                        block_hashes: victims.iter().map(|&h| engine(k, h)).collect(),
                    };
                    let stats = index.apply(k, &ev).unwrap();
                    assert_eq!(stats.removed, removed);
                    assert_eq!(stats.missing_removals, victims.len() - removed);
                }
                8 => {
                    let stats = index.apply(k, &KvEvent::Cleared).unwrap();
                    assert_eq!(stats.removed, held.len());
                    held.clear();
                }
                _ => {
                    index.remove_worker(k);
                    held.clear();
                }
            }

            assert_eq!(index.len(), model.values().map(HashSet::len).sum::<usize>());
            let distinct: HashSet<u64> = model.values().flatten().copied().collect();
            assert_eq!(index.distinct_blocks(), distinct.len());
            for request in &doc_hashes {
                let n = 1 + next(8) as usize;
                let request = &request[..n];
                let mut expected: Vec<(WorkerKey, Vec<u64>)> = model
                    .iter()
                    .map(|(&k, held)| {
                        let prefix = request.iter().take_while(|h| held.contains(h));
                        (k, prefix.map(|&h| engine(k, h)).collect::<Vec<_>>())
                    })
                    .filter(|(_, e)| !e.is_empty())
                    .collect();
                expected.sort_by(|a, b| b.1.len().cmp(&a.1.len()).then(a.0.cmp(&b.0)));
                index.overlaps(request, &mut out);
                longest = longest.max(expected.first().map_or(0, |e| e.1.len()));
                assert_eq!(as_vec(&out), expected);
                for (k, e) in &expected {
                    assert_eq!(out.engine_hashes(*k), e.as_slice());
                }
            }
        }
        // The stream must have exercised chaining, refusal and deep prefixes.
        assert!(
            chained > 100 && refused > 100 && longest == 8,
            "{chained} {refused} {longest}"
        );
    }

    #[test]
    fn wire_forms_round_trip() {
        let forms = [
            (
                r#"{"stored":{"parent_block_hash":7,"blocks":[{"block_hash":11,"token_ids":[1,2,3,4]}]}}"#,
                KvEvent::Stored {
                    parent_block_hash: Some(7),
                    blocks: vec![StoredBlock {
                        block_hash: 11,
                        token_ids: vec![1, 2, 3, 4],
                    }],
                },
            ),
            (
                r#"{"stored":{"parent_block_hash":null,"blocks":[]}}"#,
                KvEvent::Stored {
                    parent_block_hash: None,
                    blocks: vec![],
                },
            ),
            (
                r#"{"removed":{"block_hashes":[11,22,18446744073709551615]}}"#,
                KvEvent::Removed {
                    block_hashes: vec![11, 22, u64::MAX],
                },
            ),
            (r#""cleared""#, KvEvent::Cleared),
        ];
        for (json, event) in forms {
            let parsed: KvEvent = serde_json::from_str(json).unwrap();
            assert_eq!(parsed, event, "{json}");
            assert_eq!(serde_json::to_string(&event).unwrap(), json);
        }
        let key = w(3, 1);
        let json = serde_json::to_string(&key).unwrap();
        assert_eq!(json, r#"{"worker_id":3,"dp_rank":1}"#);
        assert_eq!(serde_json::from_str::<WorkerKey>(&json).unwrap(), key);
    }

    #[test]
    fn wire_forms_refuse_unknown_fields_and_variants() {
        for json in [
            r#"{"stored":{"parent_block_hash":null,"blocks":[],"lora_id":3}}"#,
            r#"{"stored":{"parent_block_hash":null,"blocks":[{"block_hash":1,"token_ids":[],"extra":1}]}}"#,
            r#"{"removed":{"block_hashes":[1],"medium":"gpu"}}"#,
        ] {
            let err = serde_json::from_str::<KvEvent>(json).unwrap_err();
            assert!(err.to_string().contains("unknown field"), "{json}: {err}");
        }
        for json in [
            r#""evicted""#,
            r#"{"Stored":{"parent_block_hash":null,"blocks":[]}}"#,
            r#"{"removed":{"block_hashes":[-1]}}"#,
        ] {
            assert!(serde_json::from_str::<KvEvent>(json).is_err(), "{json}");
        }
    }
}
