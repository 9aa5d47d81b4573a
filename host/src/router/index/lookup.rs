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
    /// the lookup) into `lengths`.
    pub fn engine_hashes_for(
        &self,
        hashes: &[u64],
        rows: &[(Slot, usize)],
        out: &mut Vec<u64>,
        lengths: &mut Vec<usize>,
    ) {
        lengths.clear();
        lengths.resize(rows.len(), 0);
        let start = out.len();
        let total: usize = rows.iter().map(|r| r.1).sum();
        out.resize(start + total, 0);
        let mut offsets = Vec::with_capacity(rows.len());
        let mut at = start;
        for &(_, len) in rows {
            offsets.push(at);
            at += len;
        }
        let deepest = rows.first().map_or(0, |r| r.1).min(hashes.len());
        // Rows are longest first, so the rows still wanting block `d` are a prefix.
        let mut wanting = rows.len();
        for (d, hash) in hashes.iter().enumerate().take(deepest) {
            while wanting > 0 && rows[wanting - 1].1 <= d {
                wanting -= 1;
            }
            let Some(holders) = self.holders(*hash) else {
                break;
            };
            for (i, &(slot, _)) in rows[..wanting].iter().enumerate() {
                // A row stays only while it has every block so far.
                if lengths[i] == d {
                    if let Some(engine) = holders.engine_of(slot) {
                        out[offsets[i] + d] = engine;
                        lengths[i] = d + 1;
                    }
                }
            }
        }
        // Close the gaps left by rows that came up short.
        let mut write = start;
        for (i, &len) in lengths.iter().enumerate() {
            out.copy_within(offsets[i]..offsets[i] + len, write);
            write += len;
        }
        out.truncate(write);
    }
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
