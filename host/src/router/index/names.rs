//! The writer's book of engine names: per worker, engine hash → the block it names.
//!
//! Removals and parents arrive as engine hashes, so the writer needs, per worker, a map
//! from each engine hash it holds to its block. Bookings never read it: a lookup walks
//! the tree by sequence hash, and a `kv.fetch` reads the engine hashes off the tree (the
//! nodes' shared rows, and each worker's own names kept beside them). So the book is kept once, outside the two copies of the tree that bookings and
//! ingestion share ([`super::shared`]), and the second copy does not probe it again.
//!
//! Every question the tree's algorithms ask of the book goes through [`Names`]. Applying
//! an event to the first copy of the tree asks the real book and writes each answer on
//! a [`Tape`] ([`Recording`]); applying it to the second copy, whose tree is identical,
//! asks the same questions in the same order and reads the answers back ([`Replay`]):
//! one probe of a large hash map per block instead of two, and one map in memory.
//!
//! **One copy, two names.** A worker that stores the same tokens under several engine
//! hashes holds the block once: one copy *names* it (the one its node row holds, which
//! a `kv.fetch` sends), the others are extras kept aside, any of them removed in O(1),
//! and the block stays held until the last copy goes.
//!
//! **Shared names.** Engines of one model and hash seed name the same tokens alike, so
//! a fleet's workers mostly hold a popular block under one engine hash: its node's
//! shared row ([`super::rows`]). Such a name is entered once for the block, in the
//! book's [`Shared`] names, instead of once per worker: a worker that joins a node whose
//! shared row is entered, naming its blocks alike, writes nothing in its own map (a
//! store that joins a long chain of such nodes was mostly those writes, and the maps
//! growing under them). Its copy is *backed*: the worker holds the block, its row names
//! the block that engine hash, and the shared names give that block for it. The tree
//! checks the first two, so a question about a worker's copy is its own map, then the
//! shared names and the tree. The first holder of a block still records its name in its
//! own map (most blocks have one holder), as does any worker whose name for a block is
//! not the entered one.

use super::claims::Claims;
use super::holders::Slot;
use super::BlockId;
use rustc_hash::FxHashMap;
use std::collections::hash_map::Entry;

/// One of a worker's copies of a block, named by an engine hash: the block's *named*
/// copy, or one of its extra copies, by its entry in the worker's [`Extras`]. (The
/// worker's map keeps it packed, [`Claims`]: nearly every block has one copy.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Copy {
    pub block: BlockId,
    /// [`NAMED`], or the copy's entry in its worker's [`Extras`].
    pub extra: u32,
}

pub(super) const NAMED: u32 = u32::MAX;

#[derive(Debug, Clone, Default)]
pub(super) struct WorkerNames {
    /// Engine hash → its copy: removals and parents arrive as engine hashes.
    pub by_engine: Claims,
    /// The engine hashes of its copies besides the named one, for blocks this worker
    /// stored under more than one.
    pub extras: Extras,
    /// Its backed copies (held through the [`Shared`] names, not in `by_engine`): while
    /// there are none, no question about its copies looks there.
    pub backed: usize,
}

/// Engine hash → the block whose node's shared row names it so, entered when a second
/// worker joins the node, and for each block appended to a node entered so (its name
/// joins the row's; see the [module documentation](self)).
///
/// Kept exact: an entry's block is live and its node's shared row names it by that
/// hash. The tree takes entries out when that stops being so (a node freed, a shared
/// row renamed). A bit filter in front answers most "is this hash entered?" questions
/// without probing the map: each name a store brings asks one, to be sure its worker
/// does not hold that hash already through the entries.
#[derive(Debug, Clone)]
pub(super) struct Shared {
    pub by_engine: FxHashMap<u64, BlockId>,
    /// `FILTER_BITS_PER_NAME` bits per entered name at least (a power of two of
    /// them), set for every entered hash; bits of hashes taken out stay set until the
    /// filter is rebuilt. Never empty, so a question costs one multiply, one shift
    /// and one load.
    filter: Vec<u64>,
    /// The filter's words − 1 (a power of two of them).
    mask: usize,
    /// Hashes taken out since the filter was last built.
    stale: usize,
}

/// Filter bits per entered name: with one bit looked at per question, about one hash
/// in 16 not entered still finds its bit set (and then probes the map).
const FILTER_BITS_PER_NAME: usize = 16;

/// Filter words of an empty [`Shared`] (its smallest filter).
const FILTER_MIN_WORDS: usize = 64;

impl Default for Shared {
    fn default() -> Self {
        Self {
            by_engine: FxHashMap::default(),
            filter: vec![0; FILTER_MIN_WORDS],
            mask: FILTER_MIN_WORDS - 1,
            stale: 0,
        }
    }
}

impl Shared {
    /// The filter's word and bit for `engine`: a multiply by an odd constant first,
    /// since engine hashes may be anything, small integers too.
    #[inline(always)]
    fn bit(&self, engine: u64) -> (usize, u32) {
        let h = engine.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        ((h >> 32) as usize & self.mask, (h & 63) as u32)
    }

    /// Whether `engine` may be entered (the filter's answer).
    #[inline(always)]
    pub(super) fn may_have(&self, engine: u64) -> bool {
        let (word, bit) = self.bit(engine);
        // In bounds by construction (`mask` is set with the filter); `get` keeps a
        // bad index from panicking all the same.
        self.filter.get(word).is_some_and(|w| (w >> bit) & 1 != 0)
    }

    /// The block `engine` is entered for, if any.
    #[inline(always)]
    pub(super) fn get(&self, engine: u64) -> Option<BlockId> {
        if !self.may_have(engine) {
            return None;
        }
        self.by_engine.get(&engine).copied()
    }

    /// Enters `engine` for `block` unless another block has it; returns whether
    /// `engine` is entered for `block` now.
    fn enter(&mut self, engine: u64, block: BlockId) -> bool {
        match self.by_engine.entry(engine) {
            Entry::Occupied(o) => *o.get() == block,
            Entry::Vacant(v) => {
                v.insert(block);
                if self.filter.len() * 64 < self.by_engine.len() * FILTER_BITS_PER_NAME {
                    self.rebuild();
                } else {
                    let (word, bit) = self.bit(engine);
                    self.filter[word] |= 1 << bit;
                }
                true
            }
        }
    }

    /// Takes `engine` out if it is entered for `block`.
    fn take_out(&mut self, engine: u64, block: BlockId) {
        if let Entry::Occupied(o) = self.by_engine.entry(engine) {
            if *o.get() == block {
                o.remove();
                self.stale += 1;
                if self.stale > self.by_engine.len().max(1024) {
                    self.rebuild();
                }
            }
        }
    }

    /// Sizes the filter for the entries and sets their bits afresh.
    fn rebuild(&mut self) {
        let words = (self.by_engine.len() * FILTER_BITS_PER_NAME)
            .div_ceil(64)
            .next_power_of_two()
            .max(FILTER_MIN_WORDS);
        self.filter.clear();
        self.filter.resize(words, 0);
        self.mask = words - 1;
        self.stale = 0;
        let mut filter = std::mem::take(&mut self.filter);
        for &engine in self.by_engine.keys() {
            let (word, bit) = self.bit(engine);
            filter[word] |= 1 << bit;
        }
        self.filter = filter;
    }
}

/// A worker's extra copies: for each block it stored under more than one engine hash,
/// the names besides the named one, newest first, as a list linked through one array.
///
/// Adding or removing one is O(1), so tens of thousands of names for one block cost no
/// more per name than a handful. One array rather than a vector per block: a worker
/// that stores a long prompt under many salts adds an extra to each of thousands of
/// blocks in turn, and per-block vectors put each of those writes on another cache line
/// and grew each vector by reallocation several times over; here a new extra goes at
/// the end of the array (or in a freed entry), and only the block's previous newest
/// extra is touched, to link it.
///
/// Linked when first needed: an extra appended at the end of the array is only
/// recorded there (with its block), and the lists are linked, in the order the
/// extras came, the next time one is removed or a named copy with extras goes. A
/// worker storing a prompt under salt after salt, which only adds, pays a push per
/// name instead of a probe of `heads` and two writes; one whose engine also evicts
/// links at each removal what came since the last, the same work as before.
#[derive(Debug, Clone)]
pub(super) struct Extras {
    /// Block → its newest extra copy in `list` (of the linked ones).
    heads: FxHashMap<BlockId, u32>,
    list: Vec<Extra>,
    /// First free entry of `list`, the free ones chained through `older`; [`END`] if none.
    free: u32,
    /// Entries from here to the end of `list` are not linked yet: each holds its
    /// block in `newer`. (A free entry exists only once everything is linked, so the
    /// unlinked ones are always the last ones added, in order.)
    linked: usize,
}

#[derive(Debug, Clone, Copy)]
struct Extra {
    engine: u64,
    /// The block's next newer extra, or [`END`] for the newest.
    newer: u32,
    /// The block's next older extra, or [`END`] for the oldest; for a free entry, the
    /// next free one.
    older: u32,
}

/// No entry (a list's end, or no free entry).
const END: u32 = u32::MAX;

impl Default for Extras {
    fn default() -> Self {
        Self {
            heads: FxHashMap::default(),
            list: Vec::new(),
            free: END,
            linked: 0,
        }
    }
}

/// Entries an emptied list of extras keeps (of 16 bytes) for the next ones.
const EXTRAS_KEEP: usize = 1 << 12;

impl Extras {
    pub(super) fn is_empty(&self) -> bool {
        self.heads.is_empty() && self.linked == self.list.len()
    }

    /// Records `engine` as `block`'s newest extra; returns its entry.
    fn add(&mut self, block: BlockId, engine: u64) -> u32 {
        if self.free == END {
            // At the end, unlinked: the block in `newer` until the lists are linked.
            self.list.push(Extra {
                engine,
                newer: block,
                older: END,
            });
            return (self.list.len() - 1) as u32;
        }
        let at = self.free;
        self.link(block, at, engine);
        at
    }

    /// Links every entry added since the lists were last linked, oldest first.
    fn link_all(&mut self) {
        while self.linked < self.list.len() {
            let at = self.linked as u32;
            let Extra { engine, newer, .. } = self.list[self.linked];
            self.link(newer, at, engine);
            self.linked += 1;
        }
    }

    /// Writes entry `at` (the first free one, or the first unlinked one) as
    /// `block`'s newest extra, `engine`, linked to the one that was.
    fn link(&mut self, block: BlockId, at: u32, engine: u64) {
        let reused = at == self.free;
        let older = match self.heads.entry(block) {
            Entry::Occupied(mut head) => {
                let older = std::mem::replace(head.get_mut(), at);
                self.list[older as usize].newer = at;
                older
            }
            Entry::Vacant(head) => {
                head.insert(at);
                END
            }
        };
        if reused {
            self.free = self.list[at as usize].older;
        }
        self.list[at as usize] = Extra {
            engine,
            newer: END,
            older,
        };
    }

    /// Unlinks entry `at`, one of `block`'s extras.
    fn remove(&mut self, block: BlockId, at: u32) {
        self.link_all();
        let Some(&Extra { newer, older, .. }) = self.list.get(at as usize) else {
            return;
        };
        match newer {
            END if older == END => {
                self.heads.remove(&block);
            }
            END => {
                self.heads.insert(block, older);
            }
            newer => self.list[newer as usize].older = older,
        }
        if older != END {
            self.list[older as usize].newer = newer;
        }
        self.release(at);
    }

    /// Takes `block`'s newest extra out of the list; returns its engine hash.
    fn pop_newest(&mut self, block: BlockId) -> Option<u64> {
        self.link_all();
        let at = *self.heads.get(&block)?;
        let Extra { engine, older, .. } = self.list[at as usize];
        if older == END {
            self.heads.remove(&block);
        } else {
            self.heads.insert(block, older);
            self.list[older as usize].newer = END;
        }
        self.release(at);
        Some(engine)
    }

    /// Frees entry `at`; once no block has extras, the array starts again from empty.
    fn release(&mut self, at: u32) {
        if self.heads.is_empty() {
            self.clear();
            return;
        }
        self.list[at as usize].older = self.free;
        self.free = at;
    }

    fn clear(&mut self) {
        self.heads.clear();
        self.list.clear();
        if self.list.capacity() > EXTRAS_KEEP {
            self.list.shrink_to(EXTRAS_KEEP);
        }
        self.free = END;
        self.linked = 0;
    }

    /// Each block with extras and its extras, newest first, as (entry, engine hash),
    /// checking the links both ways, as linking them now would leave them (for
    /// invariant checks).
    #[cfg(test)]
    pub(super) fn lists(&self) -> Vec<(BlockId, Vec<(u32, u64)>)> {
        let mut linked = self.clone();
        linked.link_all();
        linked
            .heads
            .iter()
            .map(|(&block, &head)| {
                let mut out = Vec::new();
                let (mut at, mut newer) = (head, END);
                while at != END {
                    let e = linked.list[at as usize];
                    assert_eq!(e.newer, newer, "extra {at} of block {block} links back");
                    out.push((at, e.engine));
                    (newer, at) = (at, e.older);
                }
                (block, out)
            })
            .collect()
    }

    /// The engine hash of entry `at` (for invariant checks).
    #[cfg(test)]
    pub(super) fn engine(&self, at: u32) -> Option<u64> {
        self.list.get(at as usize).map(|e| e.engine)
    }
}

/// What taking one copy out of a worker's names left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Taken {
    /// The worker held no copy under that engine hash.
    Missing,
    /// An extra copy went; the block keeps its name.
    Extra,
    /// The worker's last copy of `block` went: it leaves the block.
    Last(BlockId),
    /// The named copy went and an extra, `named`, names `block` now.
    Renamed { block: BlockId, named: u64 },
}

/// The questions the tree asks of the names, in the order it asks them. See the
/// [module documentation](self).
pub(super) trait Names {
    /// `slot`'s names start empty (a worker given a slot).
    fn open(&mut self, slot: Slot);
    /// `slot`'s names are forgotten (its worker deregistered).
    fn close(&mut self, slot: Slot);
    fn reserve(&mut self, slot: Slot, additional: usize);
    fn get(&mut self, slot: Slot, engine: u64) -> Option<Copy>;
    /// Names `block` `engine` if `slot` holds no copy under that hash yet (`None`);
    /// otherwise changes nothing and returns the copy it holds.
    fn claim(&mut self, slot: Slot, engine: u64, block: BlockId) -> Option<Copy>;
    /// Another engine hash for a block `slot` holds: an extra copy, if `slot` holds
    /// no copy under that hash yet (`None`); otherwise changes nothing and returns the
    /// copy it holds. One probe of the engine-hash map either way.
    fn add_extra(&mut self, slot: Slot, block: BlockId, engine: u64) -> Option<Copy>;
    fn take(&mut self, slot: Slot, engine: u64) -> Taken;
    /// Forgets every copy `slot` holds in its own names; appends the block of each of
    /// its own named copies to `blocks`. Returns how many own copies there were and
    /// how many backed ones (whose blocks the tree knows).
    fn drain(&mut self, slot: Slot, blocks: &mut Vec<BlockId>) -> (usize, usize);
    /// The block the shared names give `engine`, if `slot` holds any backed copy at
    /// all (else `None`, usually without a probe). The tree checks whether `slot`'s
    /// row names that block so.
    fn backed(&mut self, slot: Slot, engine: u64) -> Option<BlockId>;
    /// The block the shared names give `engine`, whoever asks.
    fn shared(&mut self, engine: u64) -> Option<BlockId>;
    /// Enters `engine` for `block` in the shared names unless another block has it;
    /// whether it is entered for `block` now.
    fn enter(&mut self, engine: u64, block: BlockId) -> bool;
    /// Takes `engine` out of the shared names if it is entered for `block`.
    fn take_out(&mut self, engine: u64, block: BlockId);
    /// `slot` holds `copies` more backed copies.
    fn back(&mut self, slot: Slot, copies: usize);
    /// `slot`'s backed copy of `block` goes: [`Taken::Last`], or, if `slot` holds
    /// extras of the block, [`Taken::Renamed`] with the newest (now its named copy).
    fn take_backed(&mut self, slot: Slot, block: BlockId) -> Taken;
}

/// The names themselves, indexed by slot.
#[derive(Debug, Clone, Default)]
pub(super) struct Book {
    workers: Vec<Option<WorkerNames>>,
    pub shared: Shared,
}

impl Book {
    pub(super) fn worker(&self, slot: Slot) -> Option<&WorkerNames> {
        self.workers.get(slot as usize)?.as_ref()
    }

    fn worker_mut(&mut self, slot: Slot) -> Option<&mut WorkerNames> {
        self.workers.get_mut(slot as usize)?.as_mut()
    }

    /// The copy `slot` holds under `engine` in its own names, without recording the
    /// question.
    pub(super) fn copy(&self, slot: Slot, engine: u64) -> Option<Copy> {
        self.worker(slot)?.by_engine.get(engine)
    }

    /// [`Names::backed`], without recording the question. The filter first: a new
    /// name is nearly never entered, and that answer needs no look at the worker.
    #[inline(always)]
    pub(super) fn backed_block(&self, slot: Slot, engine: u64) -> Option<BlockId> {
        if !self.shared.may_have(engine) || self.worker(slot)?.backed == 0 {
            return None;
        }
        self.shared.by_engine.get(&engine).copied()
    }

    /// Every worker's names, by slot (for invariant checks).
    #[cfg(test)]
    pub(super) fn all(&self) -> impl Iterator<Item = (Slot, &WorkerNames)> {
        self.workers
            .iter()
            .enumerate()
            .filter_map(|(slot, w)| Some((slot as Slot, w.as_ref()?)))
    }
}

impl Names for Book {
    fn open(&mut self, slot: Slot) {
        let at = slot as usize;
        if self.workers.len() <= at {
            self.workers.resize_with(at + 1, || None);
        }
        self.workers[at].get_or_insert_with(WorkerNames::default);
    }

    fn close(&mut self, slot: Slot) {
        if let Some(w) = self.workers.get_mut(slot as usize) {
            *w = None;
        }
    }

    fn reserve(&mut self, slot: Slot, additional: usize) {
        if let Some(w) = self.worker_mut(slot) {
            w.by_engine.reserve(additional);
        }
    }

    fn get(&mut self, slot: Slot, engine: u64) -> Option<Copy> {
        self.copy(slot, engine)
    }

    #[inline(always)]
    fn claim(&mut self, slot: Slot, engine: u64, block: BlockId) -> Option<Copy> {
        self.worker_mut(slot)?.by_engine.claim(engine, block)
    }

    fn add_extra(&mut self, slot: Slot, block: BlockId, engine: u64) -> Option<Copy> {
        let w = self.worker_mut(slot)?;
        let extras = &mut w.extras;
        w.by_engine
            .add_extra(engine, block, || extras.add(block, engine))
    }

    fn take(&mut self, slot: Slot, engine: u64) -> Taken {
        let Some(w) = self.worker_mut(slot) else {
            return Taken::Missing;
        };
        let Some(copy) = w.by_engine.remove(engine) else {
            return Taken::Missing;
        };
        if copy.extra != NAMED {
            w.extras.remove(copy.block, copy.extra);
            return Taken::Extra;
        }
        // Most workers never store a block twice: no probe of the extras for them.
        if w.extras.is_empty() {
            return Taken::Last(copy.block);
        }
        // The newest extra still held names the block now.
        let Some(named) = w.extras.pop_newest(copy.block) else {
            return Taken::Last(copy.block);
        };
        w.by_engine.make_named(named);
        Taken::Renamed {
            block: copy.block,
            named,
        }
    }

    fn drain(&mut self, slot: Slot, blocks: &mut Vec<BlockId>) -> (usize, usize) {
        let Some(w) = self.worker_mut(slot) else {
            return (0, 0);
        };
        let own = w.by_engine.len();
        let backed = std::mem::take(&mut w.backed);
        w.extras.clear();
        // An extra's block is its named copy's too (own or backed): the own named
        // copies and the backed ones list every block.
        w.by_engine.drain_named(blocks);
        (own, backed)
    }

    #[inline(always)]
    fn backed(&mut self, slot: Slot, engine: u64) -> Option<BlockId> {
        self.backed_block(slot, engine)
    }

    fn shared(&mut self, engine: u64) -> Option<BlockId> {
        self.shared.get(engine)
    }

    fn enter(&mut self, engine: u64, block: BlockId) -> bool {
        self.shared.enter(engine, block)
    }

    fn take_out(&mut self, engine: u64, block: BlockId) {
        self.shared.take_out(engine, block);
    }

    fn back(&mut self, slot: Slot, copies: usize) {
        if let Some(w) = self.worker_mut(slot) {
            w.backed += copies;
        }
    }

    fn take_backed(&mut self, slot: Slot, block: BlockId) -> Taken {
        let Some(w) = self.worker_mut(slot) else {
            return Taken::Missing;
        };
        w.backed = w.backed.saturating_sub(1);
        if w.extras.is_empty() {
            return Taken::Last(block);
        }
        let Some(named) = w.extras.pop_newest(block) else {
            return Taken::Last(block);
        };
        w.by_engine.make_named(named);
        Taken::Renamed { block, named }
    }
}

/// One answer of the book, as the tape keeps it.
#[derive(Debug, Clone, Copy)]
enum Answer {
    Copy(Option<Copy>),
    Taken(Taken),
    /// `own` and `backed` copies; the own named copies' blocks are
    /// `Tape::blocks[start..start + len]`.
    Drained {
        own: u32,
        backed: u32,
        start: u32,
        len: u32,
    },
    Block(Option<BlockId>),
    Entered(bool),
}

/// The answers one application of an event got from the book, for the second copy.
#[derive(Debug, Default)]
pub struct Tape {
    answers: Vec<Answer>,
    blocks: Vec<BlockId>,
}

impl Tape {
    /// Empties the tape, keeping room for `answers` answers (about one per block).
    pub fn rewind(&mut self, answers: usize) {
        self.answers.clear();
        self.blocks.clear();
        self.answers.reserve(answers);
    }

    /// Entries the tape has room for (for keeping spare tapes): its answers and the
    /// blocks of a drained worker.
    pub fn capacity(&self) -> usize {
        self.answers.capacity() + self.blocks.capacity()
    }
}

// The tape holds an answer per block an event touches: keep it small.
const _: () = assert!(std::mem::size_of::<Answer>() <= 24);

/// The book, with every answer written on a tape.
pub(super) struct Recording<'a> {
    pub book: &'a mut Book,
    pub tape: &'a mut Tape,
}

impl Names for Recording<'_> {
    fn open(&mut self, slot: Slot) {
        self.book.open(slot);
    }

    fn close(&mut self, slot: Slot) {
        self.book.close(slot);
    }

    fn reserve(&mut self, slot: Slot, additional: usize) {
        self.book.reserve(slot, additional);
    }

    fn get(&mut self, slot: Slot, engine: u64) -> Option<Copy> {
        let answer = self.book.get(slot, engine);
        self.tape.answers.push(Answer::Copy(answer));
        answer
    }

    fn claim(&mut self, slot: Slot, engine: u64, block: BlockId) -> Option<Copy> {
        let answer = self.book.claim(slot, engine, block);
        self.tape.answers.push(Answer::Copy(answer));
        answer
    }

    fn add_extra(&mut self, slot: Slot, block: BlockId, engine: u64) -> Option<Copy> {
        let answer = self.book.add_extra(slot, block, engine);
        self.tape.answers.push(Answer::Copy(answer));
        answer
    }

    fn take(&mut self, slot: Slot, engine: u64) -> Taken {
        let answer = self.book.take(slot, engine);
        self.tape.answers.push(Answer::Taken(answer));
        answer
    }

    fn drain(&mut self, slot: Slot, blocks: &mut Vec<BlockId>) -> (usize, usize) {
        let start = self.tape.blocks.len();
        let (own, backed) = self.book.drain(slot, &mut self.tape.blocks);
        blocks.extend_from_slice(&self.tape.blocks[start..]);
        // A worker's copies are counted in u32 like its blocks' ids.
        self.tape.answers.push(Answer::Drained {
            own: own as u32,
            backed: backed as u32,
            start: start as u32,
            len: (self.tape.blocks.len() - start) as u32,
        });
        (own, backed)
    }

    fn backed(&mut self, slot: Slot, engine: u64) -> Option<BlockId> {
        let answer = self.book.backed(slot, engine);
        self.tape.answers.push(Answer::Block(answer));
        answer
    }

    fn shared(&mut self, engine: u64) -> Option<BlockId> {
        let answer = self.book.shared(engine);
        self.tape.answers.push(Answer::Block(answer));
        answer
    }

    fn enter(&mut self, engine: u64, block: BlockId) -> bool {
        let answer = self.book.enter(engine, block);
        self.tape.answers.push(Answer::Entered(answer));
        answer
    }

    fn take_out(&mut self, engine: u64, block: BlockId) {
        self.book.take_out(engine, block);
    }

    fn back(&mut self, slot: Slot, copies: usize) {
        self.book.back(slot, copies);
    }

    fn take_backed(&mut self, slot: Slot, block: BlockId) -> Taken {
        let answer = self.book.take_backed(slot, block);
        self.tape.answers.push(Answer::Taken(answer));
        answer
    }
}

/// The answers of a recording, read back in order. The second copy's tree is the
/// first's, so it asks exactly the recorded questions; an answer of the wrong kind
/// would be a bug in the index, and is answered as "nothing held" rather than a panic.
pub(super) struct Replay<'a> {
    tape: &'a Tape,
    at: usize,
}

impl<'a> Replay<'a> {
    pub(super) fn new(tape: &'a Tape) -> Self {
        Self { tape, at: 0 }
    }

    fn next(&mut self) -> Option<Answer> {
        let answer = self.tape.answers.get(self.at).copied();
        self.at += 1;
        debug_assert!(answer.is_some(), "the replay asked more than was recorded");
        answer
    }
}

impl Names for Replay<'_> {
    fn open(&mut self, _: Slot) {}

    fn close(&mut self, _: Slot) {}

    fn reserve(&mut self, _: Slot, _: usize) {}

    fn get(&mut self, _: Slot, _: u64) -> Option<Copy> {
        match self.next() {
            Some(Answer::Copy(answer)) => answer,
            other => mismatch(other, None),
        }
    }

    fn claim(&mut self, slot: Slot, engine: u64, _: BlockId) -> Option<Copy> {
        self.get(slot, engine)
    }

    fn add_extra(&mut self, slot: Slot, _: BlockId, engine: u64) -> Option<Copy> {
        self.get(slot, engine)
    }

    fn take(&mut self, _: Slot, _: u64) -> Taken {
        match self.next() {
            Some(Answer::Taken(answer)) => answer,
            other => mismatch(other, Taken::Missing),
        }
    }

    fn drain(&mut self, _: Slot, blocks: &mut Vec<BlockId>) -> (usize, usize) {
        match self.next() {
            Some(Answer::Drained {
                own,
                backed,
                start,
                len,
            }) => {
                let (start, len) = (start as usize, len as usize);
                blocks.extend_from_slice(&self.tape.blocks[start..start + len]);
                (own as usize, backed as usize)
            }
            other => mismatch(other, (0, 0)),
        }
    }

    fn backed(&mut self, _: Slot, _: u64) -> Option<BlockId> {
        match self.next() {
            Some(Answer::Block(answer)) => answer,
            other => mismatch(other, None),
        }
    }

    fn shared(&mut self, _: u64) -> Option<BlockId> {
        match self.next() {
            Some(Answer::Block(answer)) => answer,
            other => mismatch(other, None),
        }
    }

    fn enter(&mut self, _: u64, _: BlockId) -> bool {
        match self.next() {
            Some(Answer::Entered(answer)) => answer,
            other => mismatch(other, false),
        }
    }

    fn take_out(&mut self, _: u64, _: BlockId) {}

    fn back(&mut self, _: Slot, _: usize) {}

    fn take_backed(&mut self, _: Slot, _: BlockId) -> Taken {
        match self.next() {
            Some(Answer::Taken(answer)) => answer,
            other => mismatch(other, Taken::Missing),
        }
    }
}

fn mismatch<T>(answer: Option<Answer>, fallback: T) -> T {
    debug_assert!(false, "the replay asked another question: {answer:?}");
    fallback
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Extras are linked when first needed, in the order they came: a block's newest
    /// extra is the last one added, whether it was added before the lists were linked
    /// (appended), or after (into a freed entry, or appended again).
    #[test]
    fn extras_linked_late_keep_the_order_they_came_in() {
        let mut x = Extras::default();
        let (a, b) = (7, 9);
        let a1 = x.add(a, 101);
        x.add(b, 201);
        x.add(a, 102);
        x.add(b, 202);
        let a3 = x.add(a, 103);
        assert!(!x.is_empty());
        // Nothing linked yet: the lists as they would be.
        let mut lists = x.lists();
        lists.sort();
        assert_eq!(
            lists,
            vec![
                (a, vec![(a3, 103), (2, 102), (a1, 101)]),
                (b, vec![(3, 202), (1, 201)]),
            ]
        );
        // Removing one links everything first; the entry goes to the free list.
        x.remove(a, a1);
        assert_eq!(x.linked, x.list.len());
        // A new extra takes the freed entry and is the newest of its block.
        assert_eq!(x.add(b, 203), a1);
        x.add(a, 104); // appended, not linked yet
        assert_eq!(x.pop_newest(a), Some(104));
        assert_eq!(x.pop_newest(a), Some(103));
        assert_eq!(x.pop_newest(b), Some(203));
        assert_eq!(x.pop_newest(b), Some(202));
        assert_eq!(x.pop_newest(a), Some(102));
        assert_eq!(x.pop_newest(a), None);
        assert_eq!(x.pop_newest(b), Some(201));
        // The last extra gone, the array starts again from empty.
        assert!(x.is_empty());
        assert!(x.list.is_empty());
    }
}
