//! The prefix walk: for a request's block hashes, each worker's cached prefix; and, on
//! demand, the engine hashes naming a worker's part of it.
//!
//! The walk follows the request's hashes down the tree: inside a node it only compares
//! hashes (every block of a node has the same holders, but for holders of its first
//! blocks only, [`cuts`](super::cuts), who drop out at their cuts, shortest first);
//! entering a node it ANDs the set of workers still matching with the node's holder
//! words, and a worker whose bit drops there holds exactly the blocks matched so far.
//! It stops at the first block nobody still matching holds, or where the request leaves
//! the tree. Work: one compare per matched block, one word operation per 64
//! still-matching workers per node, one look per cut the match passes, one record per
//! matching worker — bounded by the prompt and the workers, whatever the index holds
//! besides (other sequences, or one worker's many copies of these). [`Matches::visited`]
//! counts it, so tests can hold that bound without timing anything.

use super::holders::{Bits, Slot, Word};
use super::{KvIndex, NodeId, WorkerKey};
use std::fmt;

/// One worker's match, by index slot ([`KvIndex::key_of`] names the worker).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Found {
    pub slot: Slot,
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
    /// The still-matching words by index, while a node's cuts are looked at.
    dense: Vec<u64>,
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

    /// Each matching worker with its cached prefix, shortest prefix first; `index` is
    /// the one the lookup ran on (it names the slots).
    pub fn workers<'a>(
        &'a self,
        index: &'a KvIndex,
    ) -> impl Iterator<Item = (WorkerKey, usize)> + 'a {
        self.found
            .iter()
            .filter_map(|f| Some((index.key_of(f.slot)?, f.cached)))
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

    /// Map probes and bitmap words the last lookup touched.
    pub fn visited(&self) -> usize {
        self.visited
    }

    /// Bytes held by the reusable buffers (they only grow).
    pub fn retained_bytes(&self) -> usize {
        self.found.capacity() * std::mem::size_of::<Found>()
            + self.by_slot.capacity() * 4
            + self.alive.capacity() * std::mem::size_of::<Word>()
            + self.dense.capacity() * 8
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
        f.debug_map()
            .entries(self.found.iter().map(|m| (m.slot, m.cached)))
            .finish()
    }
}

impl KvIndex {
    /// For a request's sequence hashes: every worker holding at least the first block,
    /// with how many leading blocks it holds. Clears and fills `out`.
    pub fn lookup(&self, hashes: &[u64], out: &mut Matches) {
        out.reset();
        let Some(&first) = hashes.first().and_then(|h| self.roots.get(h)) else {
            out.visited = usize::from(!hashes.is_empty());
            return;
        };
        if out.by_slot.len() < self.slot_count() {
            out.by_slot.resize(self.slot_count(), 0);
        }
        let Matches {
            found,
            by_slot,
            alive,
            dense,
            ..
        } = out;
        let mut node = &self.nodes[first as usize];
        alive.extend_from_slice(node.holders.words());
        let mut visited = 1 + alive.len();
        let mut depth = 0;
        while !alive.is_empty() {
            // Within a node every block has the same holders (but for the cuts, below):
            // only compare hashes.
            let matched = common_prefix(&node.seqs, &hashes[depth..]);
            visited += 1 + matched;
            // Holders cut before the match ends drop out at their cuts, shortest first.
            if let Some(cuts) = &node.cuts {
                visited += drop_cuts(cuts.by_cut(), matched, depth, alive, dense, found, by_slot);
            }
            depth += matched;
            if matched < node.len() || depth == hashes.len() {
                break;
            }
            let Some(child) = node.children.get(hashes[depth]) else {
                break;
            };
            node = &self.nodes[child as usize];
            visited += alive.len();
            intersect(alive, node.holders.words(), depth, found, by_slot);
        }
        for word in alive.iter() {
            record(word.index, word.bits, depth, found, by_slot);
        }
        alive.clear();
        out.visited = visited + out.found.len();
    }

    /// The path a request's hashes take through the tree: each node entered with the
    /// depth it starts at and how many of its blocks match.
    fn path<'a>(&'a self, hashes: &'a [u64]) -> impl Iterator<Item = (NodeId, usize, usize)> + 'a {
        let mut next = hashes.first().and_then(|h| self.roots.get(h)).copied();
        let mut depth = 0;
        std::iter::from_fn(move || {
            let id = next?;
            let node = &self.nodes[id as usize];
            let matched = common_prefix(&node.seqs, &hashes[depth..]);
            let start = depth;
            depth += matched;
            next = if matched == node.len() && depth < hashes.len() {
                node.children.get(hashes[depth])
            } else {
                None
            };
            Some((id, start, matched))
        })
    }

    /// The engine hashes under which the worker in `slot` holds the leading blocks of
    /// `hashes`, root-aligned (entry `i` names block `i`), as many as it holds in a row.
    /// Appends to `out` and returns how many it appended.
    pub fn engine_hashes(&self, slot: Slot, hashes: &[u64], out: &mut Vec<u64>) -> usize {
        let start = out.len();
        for (id, _, matched) in self.path(hashes) {
            let node = &self.nodes[id as usize];
            let held = node.held_until(slot);
            let take = matched.min(held);
            if take == 0 {
                break;
            }
            let at = out.len();
            out.resize(at + take, 0);
            node.copy_row(&self.own, slot, &mut out[at..]);
            if take < node.len() {
                break;
            }
        }
        out.len() - start
    }

    /// Engine hashes for several workers at once, one walk: `rows` gives each worker's
    /// slot and how many leading blocks to name, longest first. Appends each row's
    /// hashes to `out` consecutively and writes each row's length (shorter than asked if
    /// the worker no longer holds that many: the index may have changed since the
    /// lookup) into `lengths`. `scratch` is the caller's, reused across calls.
    ///
    /// Per node on the path, the rows still wanting blocks are a bitmap ANDed with the
    /// node's holders, and each survivor's engine hashes of the node's matched blocks are
    /// copied as one slice.
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
            offsets,
            row_of_slot,
            wanting,
            path,
        } = scratch;
        let start = out.len();
        offsets.clear();
        let mut at = start;
        for &(_, len) in rows {
            offsets.push(at);
            at += len;
        }
        out.resize(at, 0);
        if row_of_slot.len() < self.slot_count() {
            row_of_slot.resize(self.slot_count(), Dest::default());
        }
        wanting.clear();
        for (i, &(slot, len)) in rows.iter().enumerate() {
            if len > 0 && (slot as usize) < row_of_slot.len() {
                row_of_slot[slot as usize] = Dest {
                    row: i as u32,
                    offset: offsets[i],
                    asked: len,
                };
                set_bit(wanting, slot);
            }
        }
        // Slices, not the Vecs, in the loop: a store through a Vec's buffer could alias
        // its header as far as the optimiser knows, so it would reload them every cell.
        let dests = row_of_slot.as_slice();
        let cells = out.as_mut_slice();
        let lengths = lengths.as_mut_slice();
        // The path is taken in groups of nodes covering a few cache lines of each row,
        // and within a group row by row: each row's cells of the group are written
        // together. Taken node by node, a fleet of a thousand peers would get two or
        // three cells written per row per node, and every write would miss the cache.
        // A row's length is written once, when it stops: at its asked length, where its
        // worker stops holding the request's blocks, or where the walk ends.
        path.clear();
        path.extend(self.path(hashes));
        let node = |id: NodeId| &self.nodes[id as usize];
        let own = &self.own;
        let mut reached = 0;
        let mut g = 0;
        while g < path.len() && !wanting.is_empty() {
            let mut h = g;
            let mut blocks = 0;
            while h < path.len() && (h == g || (blocks < GROUP_BLOCKS && h - g < GROUP_NODES)) {
                blocks += path[h].2;
                h += 1;
                if path[h - 1].2 < node(path[h - 1].0).len() {
                    break;
                }
            }
            let group = &path[g..h];
            // Per node of the group: the word its holders' scan has reached.
            let mut cursors = [0usize; GROUP_NODES];
            let mut keep = 0;
            for wi in 0..wanting.len() {
                let want = wanting[wi];
                let base = (want.index * 64) as usize;
                // Each node's word for this index.
                let mut words: [u64; GROUP_NODES] = [0; GROUP_NODES];
                for (gi, &(id, _, _)) in group.iter().enumerate() {
                    let node_words = node(id).holders.words();
                    let j = &mut cursors[gi];
                    while *j < node_words.len() && node_words[*j].index < want.index {
                        *j += 1;
                    }
                    if let Some(word) = node_words.get(*j).filter(|w| w.index == want.index) {
                        words[gi] = word.bits;
                    }
                }
                let mut still = want.bits;
                for bit in Bits(want.bits) {
                    let mask = 1u64 << bit;
                    let dest = dests[base + bit as usize];
                    for (gi, &(id, depth, matched)) in group.iter().enumerate() {
                        let node = node(id);
                        if dest.asked <= depth {
                            lengths[dest.row as usize] = dest.asked;
                            still &= !mask;
                            break;
                        }
                        if words[gi] & mask == 0 {
                            // Its worker does not hold this node: it has its prefix.
                            lengths[dest.row as usize] = depth;
                            still &= !mask;
                            break;
                        }
                        let slot = base as Slot + bit;
                        let want = matched.min(dest.asked - depth);
                        // A holder cut inside the match holds up to its cut.
                        let take = match node.cuts.as_ref().and_then(|c| c.cut_of(slot)) {
                            Some(cut) => want.min(cut),
                            None => want,
                        };
                        let to = dest.offset + depth;
                        node.copy_row(own, slot, &mut cells[to..to + take]);
                        if take < want {
                            lengths[dest.row as usize] = depth + take;
                            still &= !mask;
                            break;
                        }
                    }
                }
                if still != 0 {
                    wanting[keep] = Word {
                        index: want.index,
                        bits: still,
                    };
                    keep += 1;
                }
            }
            wanting.truncate(keep);
            let (last, depth, matched) = path[h - 1];
            reached = depth + matched;
            if matched < node(last).len() {
                break;
            }
            g = h;
        }
        for word in wanting.iter() {
            for bit in Bits(word.bits) {
                let dest = dests[(word.index * 64 + bit) as usize];
                lengths[dest.row as usize] = reached.min(dest.asked);
            }
        }
        // Close the gaps left by rows that came up short.
        let mut write = start;
        for (i, &len) in lengths.iter().enumerate() {
            if offsets[i] != write {
                out.copy_within(offsets[i]..offsets[i] + len, write);
            }
            write += len;
        }
        out.truncate(write);
    }
}

/// `dst.copy_from_slice(src)` without a call to memcpy for the few-element copies of
/// short nodes (where many workers each hold a different prefix, nodes are a block or
/// two long and a call per copy costs more than the copy).
#[inline(always)]
pub(super) fn copy_short(dst: &mut [u64], src: &[u64]) {
    match (dst, src) {
        ([d0], [s0]) => *d0 = *s0,
        ([d0, d1], [s0, s1]) => (*d0, *d1) = (*s0, *s1),
        ([d0, d1, d2], [s0, s1, s2]) => (*d0, *d1, *d2) = (*s0, *s1, *s2),
        ([d0, d1, d2, d3], [s0, s1, s2, s3]) => (*d0, *d1, *d2, *d3) = (*s0, *s1, *s2, *s3),
        (dst, src) => dst.copy_from_slice(src),
    }
}

/// How many leading entries `run` and `query` share.
#[inline]
fn common_prefix(run: &[u64], query: &[u64]) -> usize {
    let n = run.len().min(query.len());
    let (run, query) = (&run[..n], &query[..n]);
    // Four at a time while they agree (the common case inside a node), then one by one.
    // Spelled out rather than as slice equality, which calls memcmp: a call per node
    // costs more than the compare when nodes are a few blocks long.
    let mut i = 0;
    while i + 4 <= n
        && (run[i] ^ query[i])
            | (run[i + 1] ^ query[i + 1])
            | (run[i + 2] ^ query[i + 2])
            | (run[i + 3] ^ query[i + 3])
            == 0
    {
        i += 4;
    }
    while i < n && run[i] == query[i] {
        i += 1;
    }
    i
}

/// Blocks a group of path nodes covers at least, in `engine_hashes_for` (four cache
/// lines of each row), unless it reaches `GROUP_NODES` nodes first.
const GROUP_BLOCKS: usize = 32;
const GROUP_NODES: usize = 16;

/// Where one worker's engine hashes go in `engine_hashes_for`'s output.
#[derive(Debug, Default, Clone, Copy)]
struct Dest {
    row: u32,
    offset: usize,
    /// Blocks it is asked for.
    asked: usize,
}

/// Reusable buffers of [`KvIndex::engine_hashes_for`].
#[derive(Debug, Default, Clone)]
pub struct RowScratch {
    offsets: Vec<usize>,
    /// Where each slot's row goes. Entries of other slots are stale but never read:
    /// only slots of the current call's rows are looked up.
    row_of_slot: Vec<Dest>,
    wanting: Vec<Word>,
    /// The request's path through the tree: (node, depth it starts at, blocks matched).
    path: Vec<(NodeId, usize, usize)>,
}

fn set_bit(words: &mut Vec<Word>, slot: Slot) {
    let index = slot / 64;
    let bit = 1u64 << (slot % 64);
    match words.binary_search_by_key(&index, |w| w.index) {
        Ok(at) => words[at].bits |= bit,
        Err(at) => words.insert(at, Word { index, bits: bit }),
    }
}

/// `alive &= other`, recording every slot that drops out with depth `depth`.
#[inline]
fn intersect(
    alive: &mut Vec<Word>,
    other: &[Word],
    depth: usize,
    found: &mut Vec<Found>,
    by_slot: &mut [u32],
) {
    // The common case, a fleet of at most 64 workers: one word on each side.
    if let ([a], [b]) = (alive.as_mut_slice(), other) {
        let bits = if a.index == b.index {
            a.bits & b.bits
        } else {
            0
        };
        record(a.index, a.bits & !bits, depth, found, by_slot);
        a.bits = bits;
        if bits == 0 {
            alive.clear();
        }
        return;
    }
    // A dense fleet: the same words on both sides (each word still matching is one
    // the node has, as along a prefix many workers share), so one AND a word, and a
    // record only where workers drop out, without the merge by index below.
    if alive.len() == other.len() && alive.iter().zip(other).all(|(a, b)| a.index == b.index) {
        let mut emptied = false;
        for (a, b) in alive.iter_mut().zip(other) {
            let bits = a.bits & b.bits;
            let dropped = a.bits ^ bits;
            if dropped != 0 {
                record(a.index, dropped, depth, found, by_slot);
            }
            a.bits = bits;
            emptied |= bits == 0;
        }
        if emptied {
            alive.retain(|w| w.bits != 0);
        }
        return;
    }
    let mut keep = 0;
    let mut j = 0;
    for i in 0..alive.len() {
        let word = alive[i];
        while j < other.len() && other[j].index < word.index {
            j += 1;
        }
        let bits = match other.get(j) {
            Some(o) if o.index == word.index => word.bits & o.bits,
            _ => 0,
        };
        record(word.index, word.bits & !bits, depth, found, by_slot);
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

/// Within a node whose match with the request is `matched` blocks from `depth`: each
/// still-matching holder cut before `matched` (`cuts`, ascending) drops out with its
/// cut. Returns the cuts looked at.
///
/// The still-matching words are spread over a dense array by word index first
/// (`dense`, the caller's), so each cut is one bit test, not a search of the words:
/// a node that a thousand workers hold to a thousand different depths has as many
/// cuts.
#[inline(never)]
fn drop_cuts(
    cuts: &[(u32, Slot)],
    matched: usize,
    depth: usize,
    alive: &mut Vec<Word>,
    dense: &mut Vec<u64>,
    found: &mut Vec<Found>,
    by_slot: &mut [u32],
) -> usize {
    let passed = cuts.partition_point(|&(cut, _)| (cut as usize) < matched);
    if passed == 0 || alive.is_empty() {
        return passed;
    }
    let top = alive[alive.len() - 1].index as usize;
    dense.clear();
    dense.resize(top + 1, 0);
    for word in alive.iter() {
        dense[word.index as usize] = word.bits;
    }
    found.reserve(passed);
    // The word being changed stays in a register while the cuts' slots fall in it (as
    // they mostly do: cuts made in turn by workers registered in turn), written back
    // when they leave it. Read and written back through memory each time, it was a
    // chain of stores and loads, slowed further where the pushes below landed 4 KiB
    // apart from it (2.3× the time in some processes and not others).
    const NONE: usize = usize::MAX;
    let (mut at, mut bits) = (NONE, 0u64);
    for &(cut, slot) in &cuts[..passed] {
        let index = (slot / 64) as usize;
        if index != at {
            if at != NONE {
                dense[at] = bits;
            }
            match dense.get(index) {
                Some(&word) => (at, bits) = (index, word),
                None => {
                    at = NONE;
                    continue;
                }
            }
        }
        let bit = 1u64 << (slot % 64);
        if bits & bit == 0 {
            continue;
        }
        bits &= !bit;
        let cached = depth + cut as usize;
        found.push(Found { slot, cached });
        if let Some(d) = by_slot.get_mut(slot as usize) {
            *d = cached as u32;
        }
    }
    if at != NONE {
        dense[at] = bits;
    }
    alive.retain_mut(|word| {
        word.bits = dense[word.index as usize];
        word.bits != 0
    });
    passed
}

#[inline]
fn record(index: u32, dropped: u64, depth: usize, found: &mut Vec<Found>, by_slot: &mut [u32]) {
    for bit in Bits(dropped) {
        let slot = index * 64 + bit;
        found.push(Found {
            slot,
            cached: depth,
        });
        if let Some(d) = by_slot.get_mut(slot as usize) {
            *d = depth as u32;
        }
    }
}
