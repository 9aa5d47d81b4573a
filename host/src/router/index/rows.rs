//! A node's engine hashes: one row the holders share, and, for a holder that names some
//! of the node's blocks otherwise, those names in storage of that worker's own.
//!
//! When engines of one model share a hash seed, they name the same tokens alike, and
//! the holders of a block agree on its engine hash: a node keeps one shared row, and
//! joining it with the same names costs a compare. Engines that seed their hashes per
//! process (vLLM without a fixed `PYTHONHASHSEED`) name every block differently.
//! Their names used to be rows of their own inside the node, side by side in slot
//! order: a worker joining a node under names of its own wrote a row there, a cold line
//! per node per worker (plus the own rows' holder words), and at 1,024 workers that was
//! a third of the ingest's cache misses (issue 29). Now each worker's names that differ
//! from the shared row live in [`OwnNames`], one map per worker from block id to engine
//! hash: a join writes only that worker's map, which its store is filling anyway (the
//! way Dynamo writes only its per-worker lookup map). Keyed by block id, which outlives
//! splits and merges, so restructuring a node moves none of them; the node keeps only a
//! flag saying that some holder may have names of its own there ([`EngineRows::odd`]),
//! so nodes whose holders all agree are read as one slice, as before. The map keeps
//! names in chunks of consecutive block ids ([`OwnMap`]): a run of blocks is mostly a
//! run of ids, so a join writes its names one after the other and naming a worker's
//! blocks of an odd node for a `kv.fetch` costs a probe per chunk, not per block;
//! removing a worker's copies deletes its entries, and a clear drops its map whole.

use super::holders::Slot;
use super::BlockId;
use rustc_hash::FxHashMap;

#[derive(Debug, Clone, Default)]
pub(super) struct EngineRows {
    /// The names the holders share: the first holder's, or the node's sole holder's.
    common: Vec<u64>,
    /// Some holder may name some block of the node otherwise than `common` (an entry
    /// in its [`OwnNames`]). Kept set until the node has no holders or one whose names
    /// become the shared row, so a stale `true` costs only probes that find nothing.
    odd: bool,
}

/// Per worker slot, block id → the worker's engine hash of that block, for blocks it
/// holds under a name other than their node's shared row: exactly those (an entry is
/// never the shared row's name), so a map holds just the worker's odd names.
#[derive(Debug, Clone, Default)]
pub(super) struct OwnNames {
    by_slot: Vec<OwnMap>,
}

impl OwnNames {
    /// `slot`'s own name for `block`, if it has one.
    #[inline]
    pub(super) fn get(&self, slot: Slot, block: BlockId) -> Option<u64> {
        self.by_slot.get(slot as usize)?.get(block)
    }

    /// `slot`'s map, made on first use.
    #[inline]
    fn map(&mut self, slot: Slot) -> &mut OwnMap {
        let at = slot as usize;
        if at >= self.by_slot.len() {
            self.by_slot.resize_with(at + 1, OwnMap::default);
        }
        &mut self.by_slot[at]
    }

    fn remove(&mut self, slot: Slot, block: BlockId) -> Option<u64> {
        self.by_slot.get_mut(slot as usize)?.remove(block)
    }

    /// Forgets every own name of `slot` (a clear, or its worker leaving).
    pub(super) fn clear(&mut self, slot: Slot) {
        if let Some(map) = self.by_slot.get_mut(slot as usize) {
            map.clear();
        }
    }

    /// Checks every worker's map ([`OwnMap::check`]).
    #[cfg(test)]
    pub(super) fn check(&self) {
        for map in &self.by_slot {
            map.check();
        }
    }

    /// Own names over all workers (for tests).
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.by_slot.iter().map(|m| m.len).sum()
    }

    /// Every (slot, block, engine hash) (for invariant checks).
    #[cfg(test)]
    pub(super) fn all(&self) -> impl Iterator<Item = (Slot, BlockId, u64)> + '_ {
        self.by_slot.iter().enumerate().flat_map(|(slot, map)| {
            map.all()
                .map(move |(block, engine)| (slot as Slot, block, engine))
        })
    }
}

/// One worker's own names: block id → engine hash, in chunks of [`CHUNK`] consecutive
/// ids, each a presence mask and the names side by side.
///
/// Not a table of one entry per name. A worker that names a shared prompt by its own
/// hashes (issue 29) joins a run of blocks whose ids follow one another (they were made
/// in the order the prompt's blocks first arrived), and each of its names went into a
/// table entry of its own: a probe per name, and a table of 16-byte entries at most
/// three quarters full to write and grow, which was 3.5 ns of the 21 a block such a
/// store cost (the ingest with own names skipped: 18.7 ns). In chunks, the names of a
/// run are written one after the other, 8 bytes each, with one probe of the chunk map
/// per 8; growing moves chunks, not names. (Chunks of 16 measured the same, of 4 lost
/// most of the gain.) The price is where a worker's own names are scattered in id
/// space, as when the blocks it joins were made one a decode step among many
/// conversations: a chunk of 72 bytes and its map entry for a lone name, about 85
/// bytes against the 21–43 of a table entry; a run costs about 11 bytes a name.
#[derive(Debug, Clone, Default)]
struct OwnMap {
    /// `block / CHUNK` → its chunk in `chunks`.
    index: FxHashMap<BlockId, u32>,
    chunks: Vec<Chunk>,
    /// Chunks no key uses, for reuse.
    free: Vec<u32>,
    /// Live names.
    len: usize,
}

/// Consecutive block ids a chunk names.
const CHUNK: usize = 8;
/// A chunk's presence bits, one a place.
type Mask = u8;

#[derive(Debug, Clone, Copy)]
struct Chunk {
    /// Bit `i`: block `key * CHUNK + i` has a name here.
    present: Mask,
    names: [u64; CHUNK],
}

const EMPTY_CHUNK: Chunk = Chunk {
    present: 0,
    names: [0; CHUNK],
};

/// Chunks an emptied map keeps (of 72 bytes) for the next names.
const OWN_KEEP: usize = 1 << 8;

/// A block's chunk key and place in its chunk.
#[inline(always)]
fn split_id(block: BlockId) -> (BlockId, usize) {
    (block / CHUNK as BlockId, block as usize % CHUNK)
}

impl OwnMap {
    #[inline]
    fn get(&self, block: BlockId) -> Option<u64> {
        if self.len == 0 {
            return None;
        }
        let (key, at) = split_id(block);
        let chunk = &self.chunks[*self.index.get(&key)? as usize];
        (chunk.present >> at & 1 != 0).then_some(chunk.names[at])
    }

    /// Writes the name of each of `ids` into `out`, or `common`'s where it has none:
    /// one probe of the chunk map per chunk the ids touch. A node's ids mostly follow
    /// one another (its blocks were made in the prompt's order), so where a chunk's
    /// part of them does, it is copied as one slice, and a block at a time only where
    /// they do not: a `kv.fetch` names a copy's whole range this way.
    fn names_into(&self, ids: &[BlockId], common: &[u64], out: &mut [u64]) {
        let len = out.len().min(ids.len()).min(common.len());
        let mut current: (BlockId, Option<&Chunk>) = (BlockId::MAX, None);
        let mut chunk_of = |key: BlockId| {
            if key != current.0 {
                current = (key, self.index.get(&key).map(|&c| &self.chunks[c as usize]));
            }
            current.1
        };
        let mut i = 0;
        while i < len {
            let first = ids[i];
            let (key, at) = split_id(first);
            let chunk = chunk_of(key);
            let run = (CHUNK - at).min(len - i);
            let consecutive = ids[i..i + run]
                .iter()
                .enumerate()
                .all(|(k, &id)| id == first.wrapping_add(k as BlockId));
            if !consecutive {
                out[i] = match chunk {
                    Some(c) if c.present >> at & 1 != 0 => c.names[at],
                    _ => common[i],
                };
                i += 1;
                continue;
            }
            let (out, common) = (&mut out[i..i + run], &common[i..i + run]);
            // `at + run <= CHUNK`, so the run's bits fit the mask.
            let bits = (((1u16 << run) - 1) as Mask) << at;
            match chunk {
                Some(c) if c.present & bits == bits => {
                    out.copy_from_slice(&c.names[at..at + run]);
                }
                Some(c) => {
                    for (k, (cell, &shared)) in out.iter_mut().zip(common).enumerate() {
                        *cell = if c.present >> (at + k) & 1 != 0 {
                            c.names[at + k]
                        } else {
                            shared
                        };
                    }
                }
                None => out.copy_from_slice(common),
            }
            i += run;
        }
    }

    /// Room for `additional` more names in chunks of consecutive ids.
    fn reserve(&mut self, additional: usize) {
        let chunks = additional.div_ceil(CHUNK) + 1;
        self.chunks.reserve(chunks.saturating_sub(self.free.len()));
        self.index.reserve(chunks);
    }

    /// The chunk for `key`, made if there is none.
    #[inline]
    fn chunk(&mut self, key: BlockId) -> usize {
        let next = self.chunks.len();
        let free = &mut self.free;
        let chunks = &mut self.chunks;
        *self.index.entry(key).or_insert_with(|| match free.pop() {
            Some(at) => at,
            None => {
                chunks.push(EMPTY_CHUNK);
                next as u32
            }
        }) as usize
    }

    /// Writes `name` at `at` of chunk `chunk`.
    #[inline(always)]
    fn put(&mut self, chunk: usize, at: usize, name: u64) {
        let c = &mut self.chunks[chunk];
        self.len += usize::from(c.present >> at & 1 == 0);
        c.present |= 1 << at;
        c.names[at] = name;
    }

    #[inline]
    fn insert(&mut self, block: BlockId, engine: u64) {
        let (key, at) = split_id(block);
        let chunk = self.chunk(key);
        self.put(chunk, at, engine);
    }

    /// Inserts `(block, engine)` pairs, whose blocks mostly follow one another: one
    /// probe of the chunk map per chunk they touch, and its mask read and written once.
    #[inline]
    fn insert_run(&mut self, pairs: impl Iterator<Item = (BlockId, u64)>) {
        let (mut key, mut chunk, mut mask) = (BlockId::MAX, usize::MAX, 0 as Mask);
        for (block, engine) in pairs {
            let (k, at) = split_id(block);
            if k != key {
                self.mark(chunk, mask);
                (key, chunk, mask) = (k, self.chunk(k), 0);
            }
            self.chunks[chunk].names[at] = engine;
            mask |= 1 << at;
        }
        self.mark(chunk, mask);
    }

    /// Marks the places `mask` of chunk `chunk` (if any) named.
    #[inline(always)]
    fn mark(&mut self, chunk: usize, mask: Mask) {
        if let Some(c) = self.chunks.get_mut(chunk) {
            self.len += (mask & !c.present).count_ones() as usize;
            c.present |= mask;
        }
    }

    fn remove(&mut self, block: BlockId) -> Option<u64> {
        if self.len == 0 {
            return None;
        }
        let (key, at) = split_id(block);
        let chunk = *self.index.get(&key)? as usize;
        let c = &mut self.chunks[chunk];
        if c.present >> at & 1 == 0 {
            return None;
        }
        c.present &= !(1 << at);
        let name = c.names[at];
        self.len -= 1;
        if c.present == 0 {
            self.index.remove(&key);
            self.free.push(chunk as u32);
        }
        Some(name)
    }

    fn clear(&mut self) {
        self.len = 0;
        self.index.clear();
        self.free.clear();
        self.chunks.clear();
        if self.chunks.capacity() > OWN_KEEP {
            *self = Self::default();
        }
    }

    /// Checks the chunks' bookkeeping: every chunk is indexed or free, once; no
    /// indexed chunk is empty; the names counted are the names present.
    #[cfg(test)]
    fn check(&self) {
        assert_eq!(
            self.index.len() + self.free.len(),
            self.chunks.len(),
            "every chunk indexed or free"
        );
        let mut seen = vec![false; self.chunks.len()];
        for &c in self.index.values().chain(&self.free) {
            assert!(
                !std::mem::replace(&mut seen[c as usize], true),
                "chunk {c} once"
            );
        }
        let mut names = 0;
        for &c in self.index.values() {
            let present = self.chunks[c as usize].present;
            assert_ne!(present, 0, "an indexed chunk names something");
            names += present.count_ones() as usize;
        }
        assert_eq!(names, self.len, "names counted");
    }

    /// Every (block, engine hash) (for invariant checks).
    #[cfg(test)]
    fn all(&self) -> impl Iterator<Item = (BlockId, u64)> + '_ {
        self.index.iter().flat_map(move |(&key, &chunk)| {
            let c = &self.chunks[chunk as usize];
            (0..CHUNK)
                .filter(move |&at| c.present >> at & 1 != 0)
                .map(move |at| (key * CHUNK as BlockId + at as BlockId, c.names[at]))
        })
    }
}

impl EngineRows {
    /// The engine hash under which `slot` (a holder of the node) holds the block at
    /// `pos`, whose id is `block`.
    #[inline]
    pub(super) fn name(&self, own: &OwnNames, slot: Slot, pos: usize, block: BlockId) -> u64 {
        if self.odd {
            if let Some(engine) = own.get(slot, block) {
                return engine;
            }
        }
        self.common[pos]
    }

    /// Writes `slot`'s engine hashes of the node's first `out.len()` blocks (`ids`,
    /// the node's block ids) into `out`: one slice copy where every holder agrees.
    #[inline]
    pub(super) fn copy_row(&self, own: &OwnNames, slot: Slot, ids: &[BlockId], out: &mut [u64]) {
        let take = out.len();
        if !self.odd {
            super::lookup::copy_short(out, &self.common[..take]);
            return;
        }
        let Some(map) = own.by_slot.get(slot as usize) else {
            super::lookup::copy_short(out, &self.common[..take]);
            return;
        };
        map.names_into(ids, &self.common[..take], out);
    }

    /// Whether some holder may name some block otherwise than the shared row.
    pub(super) fn has_odd(&self) -> bool {
        self.odd
    }

    /// The shared row.
    #[inline(always)]
    pub(super) fn common(&self) -> &[u64] {
        &self.common
    }

    /// Room for `additional` more blocks (amortized: a node appended to event after
    /// event grows its row by doubling, like its other arrays).
    pub(super) fn reserve(&mut self, additional: usize) {
        self.common.reserve(additional);
    }

    /// `slot` joins the node naming its blocks (`ids`) by the engine hashes of `items`,
    /// (engine hash, sequence hash) pairs as a store carries them; `first`: it is the
    /// only holder now, so its names become the shared row. Names that agree with the
    /// shared row cost a compare and no write; others go into `slot`'s own names.
    /// A store joining a chain of short nodes calls this once per node: compared as two
    /// slices side by side.
    /// `rest`: the blocks left in the store from the first of `items` on, which a
    /// worker's map makes room for at its first own name of the store (the rest of a
    /// store under names of its own is most likely all its own names: one growth of the
    /// map instead of a rehash at each doubling).
    #[inline]
    pub(super) fn add_pairs(
        &mut self,
        own: &mut OwnNames,
        slot: Slot,
        items: &[(u64, u64)],
        ids: &[BlockId],
        first: bool,
        rest: usize,
    ) {
        if first {
            self.common.clear();
            self.common.extend(items.iter().map(|(engine, _)| *engine));
            self.odd = false;
            return;
        }
        if let Some(at) = items
            .iter()
            .zip(&self.common)
            .position(|(item, c)| item.0 != *c)
        {
            self.add_own(own, slot, &items[at..], &ids[at..], at, rest - at);
        }
    }

    /// [`add_pairs`](Self::add_pairs)'s names from position `from` on, where the first
    /// differs from the shared row: each that differs goes into `slot`'s own names.
    fn add_own(
        &mut self,
        own: &mut OwnNames,
        slot: Slot,
        items: &[(u64, u64)],
        ids: &[BlockId],
        from: usize,
        rest: usize,
    ) {
        self.odd = true;
        let map = own.map(slot);
        map.reserve(rest);
        map.insert_run(
            items
                .iter()
                .zip(ids)
                .zip(&self.common[from..])
                .filter(|((item, _), &c)| item.0 != c)
                .map(|((&(engine, _), &block), _)| (block, engine)),
        );
    }

    /// `slot` leaves the node (`ids`, its block ids): its own names there go. `own`:
    /// `None` when they are dropped whole elsewhere (a clear).
    pub(super) fn remove(
        &mut self,
        own: Option<&mut OwnNames>,
        slot: Slot,
        ids: &[BlockId],
        holders_left: usize,
    ) {
        if !self.odd {
            return;
        }
        if let Some(own) = own {
            if let Some(map) = own.by_slot.get_mut(slot as usize) {
                for &block in ids {
                    if map.len == 0 {
                        break;
                    }
                    map.remove(block);
                }
            }
        }
        if holders_left == 0 {
            self.odd = false;
        }
    }

    /// `slot` now names block `pos` (id `block`) `engine`; `sole`: it is the node's
    /// only holder.
    pub(super) fn set(
        &mut self,
        own: &mut OwnNames,
        slot: Slot,
        pos: usize,
        block: BlockId,
        engine: u64,
        sole: bool,
    ) {
        if self.odd && own.get(slot, block).is_some() {
            if sole || self.common[pos] == engine {
                own.remove(slot, block);
                self.common[pos] = engine;
            } else {
                own.map(slot).insert(block, engine);
            }
            return;
        }
        if self.common[pos] == engine {
            return;
        }
        if sole {
            self.common[pos] = engine;
            return;
        }
        self.odd = true;
        own.map(slot).insert(block, engine);
    }

    /// Appends a block that `slot` alone holds (`ids` the node's blocks so far) and
    /// names `engine`; `sole`: it is the node's only holder (not one holding all of it
    /// beside holders of its first blocks), so its names may become the shared row.
    /// Inlined, with the rare case out of line: it runs for every block appended.
    #[inline(always)]
    pub(super) fn push_sole(
        &mut self,
        own: &mut OwnNames,
        slot: Slot,
        ids: &[BlockId],
        engine: u64,
        sole: bool,
    ) {
        if self.odd && sole {
            self.make_sole(own, slot, ids);
        }
        self.common.push(engine);
    }

    /// Appends blocks that `slot` alone holds (`ids` the node's blocks so far) and
    /// names `engines`; `sole` as for [`push_sole`](Self::push_sole).
    pub(super) fn extend_sole(
        &mut self,
        own: &mut OwnNames,
        slot: Slot,
        ids: &[BlockId],
        engines: impl Iterator<Item = u64>,
        sole: bool,
    ) {
        if self.odd && sole {
            self.make_sole(own, slot, ids);
        }
        self.common.extend(engines);
    }

    /// The sole holder's own names become the shared row's.
    #[cold]
    #[inline(never)]
    fn make_sole(&mut self, own: &mut OwnNames, slot: Slot, ids: &[BlockId]) {
        for (pos, block) in ids.iter().enumerate() {
            if let Some(engine) = own.remove(slot, *block) {
                self.common[pos] = engine;
            }
        }
        self.odd = false;
    }

    /// `slot`'s row (`ids`, the node's block ids) when it is the node's sole holder
    /// (for [`make_sole`](Self::make_sole)'s caller to see what changes).
    pub(super) fn row_of(&self, own: &OwnNames, slot: Slot, ids: &[BlockId]) -> Vec<u64> {
        let mut row = vec![0; ids.len()];
        self.copy_row(own, slot, ids, &mut row);
        row
    }

    /// Empty rows whose shared row fills `common` (a pooled buffer).
    pub(super) fn with_common(common: Vec<u64>) -> Self {
        Self { common, odd: false }
    }

    /// The shared row's buffer, leaving it empty (for [`split_off`](Self::split_off)'s
    /// spare).
    pub(super) fn take_common(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.common)
    }

    /// The shared row's buffer, for reuse once its node is freed.
    pub(super) fn into_common(self) -> Vec<u64> {
        self.common
    }

    /// Splits before position `k`: `self` keeps the first `k` names, the result has the
    /// rest (its shared row in `spare`'s buffer, or this one's). Own names are keyed by
    /// block and stay where they are.
    pub(super) fn split_off(&mut self, k: usize, spare: Vec<u64>) -> Self {
        let common = super::tree::split_buffer(&mut self.common, k, spare);
        Self {
            common,
            odd: self.odd,
        }
    }

    /// Appends the rows of `next`, a node with the same holders that follows this one
    /// (whose buffers stay with it, for reuse).
    pub(super) fn append(&mut self, next: &Self) {
        self.odd |= next.odd;
        self.common.extend_from_slice(&next.common);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(rows: &EngineRows, own: &OwnNames, slot: Slot, ids: &[BlockId]) -> Vec<u64> {
        rows.row_of(own, slot, ids)
    }

    fn pairs(names: &[u64]) -> Vec<(u64, u64)> {
        names.iter().map(|&n| (n, 0)).collect()
    }

    #[test]
    fn holders_naming_alike_share_one_row_and_others_keep_their_own() {
        let ids = [10, 11, 12];
        let mut own = OwnNames::default();
        let mut rows = EngineRows::default();
        rows.add_pairs(&mut own, 3, &pairs(&[1, 2, 3]), &ids, true, 3);
        rows.add_pairs(&mut own, 5, &pairs(&[1, 2, 3]), &ids, false, 3);
        assert!(!rows.has_odd(), "names alike: no own names");
        rows.add_pairs(&mut own, 9, &pairs(&[1, 7, 3]), &ids, false, 3);
        rows.add_pairs(&mut own, 70, &pairs(&[4, 2, 3]), &ids, false, 3);
        assert_eq!(row(&rows, &own, 3, &ids), [1, 2, 3]);
        assert_eq!(row(&rows, &own, 5, &ids), [1, 2, 3]);
        assert_eq!(row(&rows, &own, 9, &ids), [1, 7, 3]);
        assert_eq!(row(&rows, &own, 70, &ids), [4, 2, 3]);
        assert_eq!(own.len(), 2, "only the names that differ are kept");

        // Split: the own names stay with their blocks.
        let mut head = rows.clone();
        let tail = head.split_off(2, Vec::new());
        assert_eq!(row(&head, &own, 9, &ids[..2]), [1, 7]);
        assert_eq!(row(&head, &own, 70, &ids[..2]), [4, 2]);
        assert_eq!(row(&tail, &own, 9, &ids[2..]), [3]);

        // Renaming the odd block back makes the holder ordinary again.
        rows.set(&mut own, 9, 1, 11, 2, false);
        assert_eq!(own.len(), 1);
        rows.set(&mut own, 5, 0, 10, 8, false);
        assert_eq!(row(&rows, &own, 5, &ids), [8, 2, 3]);
        assert_eq!(row(&rows, &own, 3, &ids), [1, 2, 3]);
        assert_eq!(row(&rows, &own, 70, &ids), [4, 2, 3]);
        rows.remove(Some(&mut own), 5, &ids, 3);
        rows.remove(Some(&mut own), 70, &ids, 2);
        assert_eq!(own.len(), 0);
    }

    /// The chunked map against a `HashMap`: ids that share chunks and ids each in a
    /// chunk of its own (so emptied chunks are freed and reused), runs of ids, names
    /// read a run at a time, through clears.
    #[test]
    fn own_maps_answer_like_a_hash_map() {
        let mut map = OwnMap::default();
        let mut model = std::collections::HashMap::new();
        let mut rng = 0x2545_f491_4f6c_dd1d_u64;
        for step in 0..20_000u64 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let block = (rng % 97) as BlockId * if step < 10_000 { 1 } else { 64 };
            if step % 5_000 == 4_999 {
                map.clear();
                model.clear();
            }
            match rng >> 60 {
                0..=7 => {
                    map.insert(block, step);
                    model.insert(block, step);
                }
                8..=13 => assert_eq!(map.remove(block), model.remove(&block), "step {step}"),
                // A run of consecutive ids, some named already (written over).
                14 => {
                    let run = (block..block + (rng % 40) as BlockId).map(|b| (b, step + b as u64));
                    map.insert_run(run.clone());
                    model.extend(run);
                    let ids: Vec<BlockId> = (block.saturating_sub(8)..block + 48).collect();
                    // And ids that follow one another only in places (a node whose
                    // blocks were made apart), read a block at a time there.
                    let scattered: Vec<BlockId> = ids
                        .iter()
                        .enumerate()
                        .map(|(i, &b)| if i % 5 == 3 { b + 17 } else { b })
                        .collect();
                    for ids in [ids, scattered] {
                        let common: Vec<u64> = ids.iter().map(|&b| u64::MAX - b as u64).collect();
                        let mut out = vec![0; ids.len()];
                        map.names_into(&ids, &common, &mut out);
                        let want: Vec<u64> = ids
                            .iter()
                            .zip(&common)
                            .map(|(b, &c)| model.get(b).copied().unwrap_or(c))
                            .collect();
                        assert_eq!(out, want, "step {step}: {ids:?}");
                    }
                }
                _ => {}
            }
            map.check();
            assert_eq!(map.len, model.len(), "step {step}");
            assert_eq!(map.get(block), model.get(&block).copied(), "step {step}");
        }
        for (&block, &engine) in &model {
            assert_eq!(map.get(block), Some(engine));
        }
    }

    #[test]
    fn merging_rows_keeps_each_holders_names() {
        let mut own = OwnNames::default();
        let mut head = EngineRows::default();
        head.add_pairs(&mut own, 1, &pairs(&[10, 11]), &[0, 1], true, 2);
        head.add_pairs(&mut own, 2, &pairs(&[10, 12]), &[0, 1], false, 2);
        let mut tail = EngineRows::default();
        tail.add_pairs(&mut own, 2, &pairs(&[13]), &[2], true, 1);
        tail.add_pairs(&mut own, 1, &pairs(&[14]), &[2], false, 1);
        head.append(&tail);
        let ids = [0, 1, 2];
        assert_eq!(row(&head, &own, 1, &ids), [10, 11, 14]);
        assert_eq!(row(&head, &own, 2, &ids), [10, 12, 13]);
        assert_eq!(head.common(), &[10, 11, 13]);

        // A sole holder with names of its own appending: they become the shared row.
        let mut own = OwnNames::default();
        let mut sole = EngineRows::default();
        sole.add_pairs(&mut own, 1, &pairs(&[1]), &[0], true, 1);
        sole.add_pairs(&mut own, 2, &pairs(&[2]), &[0], false, 1);
        sole.remove(Some(&mut own), 1, &[0], 1);
        sole.push_sole(&mut own, 2, &[0], 3, true);
        assert_eq!(row(&sole, &own, 2, &[0, 1]), [2, 3]);
        assert!(!sole.has_odd());
        assert_eq!(own.len(), 0);
    }
}
