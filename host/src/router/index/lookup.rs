//! The prefix walk: for a request's block hashes, each worker's cached prefix; and, on
//! demand, the engine hashes naming a worker's part of it.
//!
//! The walk keeps the set of workers still matching as bitmap words, starting from the
//! holders of block 0 and ANDed with each next block's holders; a worker whose bit drops
//! at block `d` holds exactly `d` leading blocks. It stops at the first block nobody
//! still matching holds. Work: one probe per matched block, one word operation per 64
//! still-matching workers, one record per matching worker — bounded by the prompt and
//! the workers, whatever the index holds besides. [`Matches::visited`] counts it, so
//! tests can hold that bound without timing anything.

use super::holders::{Bits, Slot, Word};
use super::{KvIndex, WorkerKey};
use std::fmt;

/// One worker's match.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Found {
    pub slot: Slot,
    pub worker: WorkerKey,
    /// Leading request blocks it holds (≥ 1).
    pub cached: usize,
}

/// Reusable output of [`KvIndex::lookup`]. Keep one per booking thread and pass it to
/// every call, so its buffers are allocated once.
#[derive(Default, Clone)]
pub struct Matches {
    /// Every worker holding the first block, by how soon it dropped out (shortest first).
    found: Vec<Found>,
    /// Cached blocks by slot; 0 for a slot not in `found`.
    by_slot: Vec<u32>,
    /// The still-matching set during a walk.
    alive: Vec<Word>,
    visited: usize,
}

impl Matches {
    pub fn new() -> Self {
        Self::default()
    }

    /// Workers holding at least the request's first block.
    pub fn len(&self) -> usize {
        self.found.len()
    }

    pub fn is_empty(&self) -> bool {
        self.found.is_empty()
    }

    /// Each matching worker with its cached prefix, shortest prefix first.
    pub fn iter(&self) -> impl Iterator<Item = (WorkerKey, usize)> + '_ {
        self.found.iter().map(|f| (f.worker, f.cached))
    }

    /// The matches with their slots, shortest prefix first.
    pub fn found(&self) -> &[Found] {
        &self.found
    }

    /// Leading blocks the worker in `slot` holds; 0 if it holds not even the first.
    #[inline]
    pub fn cached_in_slot(&self, slot: Slot) -> usize {
        self.by_slot.get(slot as usize).map_or(0, |&d| d as usize)
    }

    /// Leading blocks `worker` holds (a scan: for tests and tools; the router reads by
    /// slot).
    pub fn cached_blocks(&self, worker: WorkerKey) -> usize {
        self.found
            .iter()
            .find(|f| f.worker == worker)
            .map_or(0, |f| f.cached)
    }

    /// Map probes and bitmap words the last lookup touched.
    pub fn visited(&self) -> usize {
        self.visited
    }

    /// Bytes held by the reusable buffers (they only grow).
    pub fn retained_bytes(&self) -> usize {
        self.found.capacity() * std::mem::size_of::<Found>()
            + self.by_slot.capacity() * 4
            + self.alive.capacity() * std::mem::size_of::<Word>()
    }

    fn reset(&mut self) {
        for f in &self.found {
            if let Some(d) = self.by_slot.get_mut(f.slot as usize) {
                *d = 0;
            }
        }
        self.found.clear();
        self.alive.clear();
        self.visited = 0;
    }
}

impl fmt::Debug for Matches {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl KvIndex {
    /// For a request's sequence hashes: every worker holding at least the first block,
    /// with how many leading blocks it holds. Clears and fills `out`.
    pub fn lookup(&self, hashes: &[u64], out: &mut Matches) {
        out.reset();
        let Some(first) = hashes.first().and_then(|h| self.holders(*h)) else {
            out.visited = usize::from(!hashes.is_empty());
            return;
        };
        let mut visited = 1 + first.words().len();
        out.alive.extend_from_slice(first.words());
        let mut depth = 1;
        while depth < hashes.len() {
            let Some(holders) = self.holders(hashes[depth]) else {
                visited += 1;
                break;
            };
            visited += 1 + out.alive.len();
            intersect(&mut out.alive, holders.words(), depth, &mut out.found);
            if out.alive.is_empty() {
                break;
            }
            depth += 1;
        }
        for word in &out.alive {
            for bit in Bits(word.bits) {
                out.found.push(Found {
                    slot: word.index * 64 + bit,
                    worker: WorkerKey {
                        worker_id: 0,
                        dp_rank: 0,
                    },
                    cached: depth,
                });
            }
        }
        out.alive.clear();
        if out.by_slot.len() < self.slot_count() {
            out.by_slot.resize(self.slot_count(), 0);
        }
        for f in &mut out.found {
            // Every set bit is a live slot (a freed slot's bits are cleared with its
            // blocks), so the key is always there.
            if let Some(key) = self.key_of(f.slot) {
                f.worker = key;
            }
            out.by_slot[f.slot as usize] = f.cached as u32;
        }
        out.visited = visited + out.found.len();
    }

    /// The engine hashes under which the worker in `slot` holds the leading blocks of
    /// `hashes`, root-aligned (entry `i` names block `i`), as many as it holds in a row.
    /// Appends to `out` and returns how many it appended.
    pub fn engine_hashes(&self, slot: Slot, hashes: &[u64], out: &mut Vec<u64>) -> usize {
        let start = out.len();
        for hash in hashes {
            match self.holders(*hash).and_then(|h| h.engine_of(slot)) {
                Some(engine) => out.push(engine),
                None => break,
            }
        }
        out.len() - start
    }

    /// Engine hashes for several workers at once, one probe per block: `rows` gives each
    /// worker's slot and how many leading blocks to name, longest first. Appends each
    /// row's hashes to `out` consecutively and writes each row's length (shorter than
    /// asked if the worker no longer holds that many: the index may have changed since
    /// the lookup) into `lengths`. `scratch` is the caller's, reused across calls.
    ///
    /// Per block, the rows still wanting it are a bitmap ANDed with the block's holders,
    /// and the engine hashes of the survivors are read in slot order with a running rank:
    /// one word operation per 64 rows, one write per hash, no per-row search.
    pub fn engine_hashes_for(
        &self,
        hashes: &[u64],
        rows: &[(Slot, usize)],
        out: &mut Vec<u64>,
        lengths: &mut Vec<usize>,
        scratch: &mut RowScratch,
    ) {
        lengths.clear();
        lengths.resize(rows.len(), 0);
        let RowScratch {
            row_of_slot,
            wanting,
        } = scratch;
        let start = out.len();
        // Rows are written column by column into a matrix first, each row `stride`
        // cells apart, then packed. A stride of a power-of-two number of bytes would
        // put every row's current cache line in the same few L1 sets and miss on
        // nearly every write, so rows span an odd number of cache lines.
        let deepest = rows.first().map_or(0, |r| r.1).min(hashes.len());
        let stride = (deepest.div_ceil(8) | 1) * 8;
        out.resize(start + stride * rows.len(), 0);
        if row_of_slot.len() < self.slot_count() {
            row_of_slot.resize(self.slot_count(), u32::MAX);
        }
        wanting.clear();
        for (i, &(slot, len)) in rows.iter().enumerate() {
            if len == 0 || slot as usize >= row_of_slot.len() {
                continue;
            }
            row_of_slot[slot as usize] = i as u32;
            set_bit(wanting, slot);
        }
        // Slices, not the Vecs: a store through a Vec's buffer could alias its header as
        // far as the optimiser knows, so it would reload pointer and length every cell.
        let out_cells = &mut out[start..];
        let row_at = row_of_slot.as_slice();
        let lengths = lengths.as_mut_slice();
        // Rows are longest first: the rows that stop wanting blocks at `d` are the last
        // ones still wanting, so `ending` walks back from the end.
        let mut ending = rows.len();
        let mut d = 0;
        while d < deepest {
            while ending > 0 && rows[ending - 1].1 <= d {
                ending -= 1;
                if clear_bit(wanting, rows[ending].0) {
                    lengths[ending] = rows[ending].1;
                }
            }
            if wanting.is_empty() {
                break;
            }
            let Some(holders) = self.holders(hashes[d]) else {
                break;
            };
            let engines = holders.engines();
            let words = holders.words();
            let mut rank = 0;
            let mut j = 0;
            let mut keep = 0;
            for i in 0..wanting.len() {
                let want = wanting[i];
                while j < words.len() && words[j].index < want.index {
                    rank += words[j].bits.count_ones() as usize;
                    j += 1;
                }
                let held = match words.get(j) {
                    Some(word) if word.index == want.index => word.bits,
                    _ => 0,
                };
                let bits = want.bits & held;
                let base = (want.index * 64) as usize;
                if bits == held {
                    // Every holder in this word is wanted (the common case): ranks
                    // follow the bits one by one, no search.
                    for (k, bit) in Bits(bits).enumerate() {
                        let row = row_at[base + bit as usize] as usize;
                        out_cells[row * stride + d] = engines[rank + k];
                    }
                } else {
                    // Walk all holders of the word with a running rank rather than a
                    // popcount per hit: baseline x86-64 has no popcnt instruction.
                    for (k, bit) in (rank..).zip(Bits(held)) {
                        if bits & (1u64 << bit) != 0 {
                            let row = row_at[base + bit as usize] as usize;
                            out_cells[row * stride + d] = engines[k];
                        }
                    }
                }
                // A row that misses a block has its prefix; it wants nothing more.
                for bit in Bits(want.bits & !held) {
                    lengths[row_at[base + bit as usize] as usize] = d;
                }
                if bits != 0 {
                    wanting[keep] = Word {
                        index: want.index,
                        bits,
                    };
                    keep += 1;
                }
            }
            wanting.truncate(keep);
            d += 1;
        }
        // Rows still wanting when the walk stopped hold every block it reached.
        for word in wanting.iter() {
            for bit in Bits(word.bits) {
                let row = row_at[(word.index * 64 + bit) as usize] as usize;
                lengths[row] = d.min(rows[row].1);
            }
        }
        // Close the gaps left by rows that came up short.
        let mut write = start;
        for (i, &len) in lengths.iter().enumerate() {
            let from = start + i * stride;
            if from != write {
                out.copy_within(from..from + len, write);
            }
            write += len;
        }
        out.truncate(write);
    }
}

/// Reusable buffers of [`KvIndex::engine_hashes_for`].
#[derive(Debug, Default, Clone)]
pub struct RowScratch {
    /// Row of each slot being read. Entries of other slots are stale but never read:
    /// only slots of the current call's rows are looked up.
    row_of_slot: Vec<u32>,
    wanting: Vec<Word>,
}

fn set_bit(words: &mut Vec<Word>, slot: Slot) {
    let index = slot / 64;
    let bit = 1u64 << (slot % 64);
    match words.binary_search_by_key(&index, |w| w.index) {
        Ok(at) => words[at].bits |= bit,
        Err(at) => words.insert(at, Word { index, bits: bit }),
    }
}

/// Clears `slot`'s bit; returns whether it was set.
fn clear_bit(words: &mut Vec<Word>, slot: Slot) -> bool {
    let index = slot / 64;
    let bit = 1u64 << (slot % 64);
    let Ok(at) = words.binary_search_by_key(&index, |w| w.index) else {
        return false;
    };
    let was = words[at].bits & bit != 0;
    words[at].bits &= !bit;
    if words[at].bits == 0 {
        words.remove(at);
    }
    was
}

/// `alive &= other`, recording every slot that drops out with depth `depth`.
#[inline]
fn intersect(alive: &mut Vec<Word>, other: &[Word], depth: usize, found: &mut Vec<Found>) {
    // The common case, a fleet of at most 64 workers: one word on each side.
    if let ([a], [b]) = (alive.as_mut_slice(), other) {
        let bits = if a.index == b.index {
            a.bits & b.bits
        } else {
            0
        };
        record(a.index, a.bits & !bits, depth, found);
        a.bits = bits;
        if bits == 0 {
            alive.clear();
        }
        return;
    }
    let mut j = 0;
    let mut keep = 0;
    for i in 0..alive.len() {
        let word = alive[i];
        while j < other.len() && other[j].index < word.index {
            j += 1;
        }
        let bits = match other.get(j) {
            Some(o) if o.index == word.index => word.bits & o.bits,
            _ => 0,
        };
        record(word.index, word.bits & !bits, depth, found);
        if bits != 0 {
            alive[keep] = Word {
                index: word.index,
                bits,
            };
            keep += 1;
        }
    }
    alive.truncate(keep);
}

#[inline]
fn record(index: u32, dropped: u64, depth: usize, found: &mut Vec<Found>) {
    for bit in Bits(dropped) {
        found.push(Found {
            slot: index * 64 + bit,
            worker: WorkerKey {
                worker_id: 0,
                dp_rank: 0,
            },
            cached: depth,
        });
    }
}
