//! The index as bookings and ingestion share it: readers never wait, one writer applies
//! events in batches.
//!
//! Two copies of [`KvIndex`]'s tree behind `left-right`: bookings read the published
//! copy with no lock (a read costs two increments of the reading thread's own epoch
//! counter, not a cost per block), and the writer applies a batch of events to the
//! other copy, swaps, waits for the readers still in the old copy to finish their walk
//! (microseconds), and replays the batch there. So a booking never waits for ingestion
//! at all, and ingestion waits at most for the walks in flight when it published.
//!
//! The price is memory (two trees) and applying each event twice. The second
//! application is the cheaper one: it replays the first's resolved sequence hashes, so
//! the tokens are hashed once, and the answers the first got from the book of engine
//! names ([`super::names`], which bookings never read and which is kept once), so the
//! second copy probes no engine-hash map.
//!
//! Events become visible when their batch is published: [`SharedIndex::apply`] and
//! [`SharedIndex::apply_batch`] publish before they return, so a caller that posted an
//! event and then books sees it.

use super::names::{Recording, Replay, Tape};
use super::{ApplyStats, KvEvent, KvEventError, KvIndex, Slot, Stored, WorkerKey};
use left_right::{Absorb, ReadHandle, ReadHandleFactory, WriteHandle};
use parking_lot::Mutex;
use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

/// The outcomes of one batch's events, in the order the first copy applied them: one
/// allocation per batch, not one per event.
type Outcomes = Arc<Mutex<Vec<Result<ApplyStats, KvEventError>>>>;

/// Tapes the second copy has replayed, kept for the next ops: a steady stream of events
/// allocates no tape per event. Bounded in count and in each tape's size, so one huge
/// event (a clear of a large cache) does not keep its tape's memory forever.
#[derive(Default)]
struct Spares {
    tapes: Vec<Tape>,
}

const SPARE_TAPES: usize = 1024;
const SPARE_TAPE_ENTRIES: usize = 4096;

impl Spares {
    fn keep(&mut self, tape: Tape) {
        if self.tapes.len() < SPARE_TAPES && tape.capacity() <= SPARE_TAPE_ENTRIES {
            self.tapes.push(tape);
        }
    }
}

/// One change to the index, as the writer's log holds it until both copies have it.
pub enum Op {
    Event {
        worker: WorkerKey,
        /// Taken when the first copy applies it; a `stored` event is replaced by its
        /// resolved copies so the second copy does not hash again.
        event: Option<KvEvent>,
        parent: Option<u64>,
        /// A stored event's (engine hash, sequence hash) pairs; a hashed event's own
        /// buffer, resolved in place.
        resolved: Vec<(u64, u64)>,
        /// The book's answers to the first application, for the second.
        tape: Tape,
        outcomes: Outcomes,
    },
    AddWorker {
        worker: WorkerKey,
        slot: Arc<OnceLock<Slot>>,
    },
    RemoveWorker {
        worker: WorkerKey,
        /// The book's answers to the first copy (the worker's blocks), for the second.
        tape: Tape,
    },
}

/// One of the two copies `left-right` keeps. Both share one book of names: the copy
/// that applies an op first asks it and records the answers, the other replays them.
/// Only `left-right` clones it, once, while the index is still empty.
pub struct Twin {
    index: KvIndex,
    spares: Arc<Mutex<Spares>>,
}

impl Clone for Twin {
    fn clone(&self) -> Self {
        Self {
            index: self.index.twin(),
            spares: Arc::clone(&self.spares),
        }
    }
}

impl Absorb<Op> for Twin {
    fn absorb_first(&mut self, op: &mut Op, _: &Self) {
        let index = &mut self.index;
        let book = index.book();
        let mut book = book.lock();
        match op {
            Op::Event {
                worker,
                event,
                parent,
                resolved,
                tape,
                outcomes,
            } => {
                // About one answer per block, and two more per event.
                let blocks = match event {
                    Some(KvEvent::Stored { blocks, .. }) => blocks.len(),
                    Some(KvEvent::Hashed { blocks, .. }) => blocks.len(),
                    Some(KvEvent::Removed { block_hashes }) => block_hashes.len(),
                    _ => 0,
                };
                tape.rewind(blocks + 2);
                let mut names = Recording {
                    book: &mut book,
                    tape,
                };
                // Only registration gives a worker a slot here: events queued for a
                // worker that was deregistered meanwhile are refused, not replayed
                // into a fresh slot.
                let result = match event.take() {
                    Some(_) if index.slot_of(*worker).is_none() => {
                        Err(KvEventError::UnknownWorker { worker: *worker })
                    }
                    Some(KvEvent::Hashed {
                        parent_block_hash,
                        identity,
                        blocks,
                    }) => {
                        *parent = parent_block_hash;
                        match index.resolve_hashed(
                            names.book,
                            *worker,
                            parent_block_hash,
                            identity,
                            blocks,
                        ) {
                            Ok((stats, pairs)) => {
                                *resolved = pairs;
                                index.store_resolved(&mut names, *worker, *parent, resolved);
                                Ok(stats)
                            }
                            Err(refused) => Err(refused),
                        }
                    }
                    Some(stored @ KvEvent::Stored { .. }) => match Stored::of(&stored) {
                        Some((parent_block_hash, contents)) => {
                            *parent = parent_block_hash;
                            let result = index.resolve(
                                names.book,
                                *worker,
                                parent_block_hash,
                                contents,
                                resolved,
                            );
                            if result.is_ok() {
                                index.store_resolved(&mut names, *worker, *parent, resolved);
                            }
                            result
                        }
                        None => Ok(ApplyStats::default()),
                    },
                    Some(KvEvent::Removed { block_hashes }) => {
                        let stats = index.apply_removed(&mut names, *worker, &block_hashes);
                        *event = Some(KvEvent::Removed { block_hashes });
                        Ok(stats)
                    }
                    Some(KvEvent::Cleared) => {
                        let removed = index.clear_worker(&mut names, *worker);
                        *event = Some(KvEvent::Cleared);
                        Ok(ApplyStats {
                            removed,
                            ..ApplyStats::default()
                        })
                    }
                    None => Ok(ApplyStats::default()),
                };
                if result.is_err() {
                    resolved.clear();
                    *event = None;
                }
                outcomes.lock().push(result);
            }
            Op::AddWorker { worker, slot } => {
                let _ = slot.set(index.add_worker_with(&mut *book, *worker));
            }
            Op::RemoveWorker { worker, tape } => {
                tape.rewind(1);
                let mut names = Recording {
                    book: &mut book,
                    tape,
                };
                index.remove_worker_with(&mut names, *worker);
            }
        }
    }

    fn absorb_second(&mut self, op: Op, _: &Self) {
        let index = &mut self.index;
        match op {
            Op::Event {
                worker,
                event,
                parent,
                resolved,
                tape,
                ..
            } => {
                let mut names = Replay::new(&tape);
                match event {
                    Some(KvEvent::Removed { block_hashes }) => {
                        index.apply_removed(&mut names, worker, &block_hashes);
                    }
                    Some(KvEvent::Cleared) => {
                        index.clear_worker(&mut names, worker);
                    }
                    // A stored event was resolved by the first application, and a
                    // refused one left nothing to replay.
                    Some(KvEvent::Stored { .. } | KvEvent::Hashed { .. }) | None => {
                        index.store_resolved(&mut names, worker, parent, &resolved)
                    }
                }
                self.spares.lock().keep(tape);
            }
            Op::AddWorker { worker, .. } => {
                index.add_worker_with(&mut Replay::new(&Tape::default()), worker);
            }
            Op::RemoveWorker { worker, tape } => {
                index.remove_worker_with(&mut Replay::new(&tape), worker)
            }
        }
    }

    fn sync_with(&mut self, first: &Self) {
        *self = first.clone();
    }
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// This thread's read handle of each live index (a handle is per thread: entering it
    /// is two uncontended atomic increments; making one takes a lock).
    static READERS: RefCell<Vec<(u64, ReadHandle<Twin>)>> = const { RefCell::new(Vec::new()) };
}

/// The KV index shared by bookings (readers) and ingestion (one writer at a time).
pub struct SharedIndex {
    id: u64,
    writer: Mutex<WriteHandle<Twin, Op>>,
    readers: ReadHandleFactory<Twin>,
    block_size: usize,
    publishes: AtomicU64,
    /// Shared with both copies ([`Spares`]).
    spares: Arc<Mutex<Spares>>,
}

impl SharedIndex {
    pub fn new(block_size: usize) -> Self {
        let spares = Arc::new(Mutex::new(Spares::default()));
        let (writer, reader) = left_right::new_from_empty::<Twin, Op>(Twin {
            index: KvIndex::new(block_size),
            spares: Arc::clone(&spares),
        });
        let readers = reader.factory();
        let mut writer = writer;
        // The first publish makes the copies distinct; do it before anyone reads.
        writer.publish();
        Self {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            writer: Mutex::new(writer),
            readers,
            block_size,
            publishes: AtomicU64::new(0),
            spares,
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Runs `f` on the published copy. Never waits for the writer.
    pub fn read<R>(&self, f: impl FnOnce(&KvIndex) -> R) -> R {
        READERS.with(|cell| {
            if let Ok(mut readers) = cell.try_borrow_mut() {
                // Handles of indexes dropped since are pruned as new ones are added.
                if !readers.iter().any(|(id, _)| *id == self.id) {
                    readers.retain(|(_, handle)| !handle.was_dropped());
                    readers.push((self.id, self.readers.handle()));
                }
            }
            match cell.try_borrow() {
                Ok(readers) => match readers.iter().find(|(id, _)| *id == self.id) {
                    Some((_, handle)) => read_with(handle, self.block_size, f),
                    None => read_with(&self.readers.handle(), self.block_size, f),
                },
                // Only a read nested inside another read's adding of a handle lands
                // here; it pays for a handle of its own.
                Err(_) => read_with(&self.readers.handle(), self.block_size, f),
            }
        })
    }

    /// Applies one event and publishes it.
    pub fn apply(&self, worker: WorkerKey, event: KvEvent) -> Result<ApplyStats, KvEventError> {
        let mut results = self.apply_batch(std::iter::once((worker, event)));
        results.pop().unwrap_or(Ok(ApplyStats::default()))
    }

    /// Applies events in order, each atomically, and publishes them together: one wait
    /// for the readers per batch, not per event.
    pub fn apply_batch(
        &self,
        events: impl IntoIterator<Item = (WorkerKey, KvEvent)>,
    ) -> Vec<Result<ApplyStats, KvEventError>> {
        let outcomes = Outcomes::default();
        {
            let mut writer = self.writer.lock();
            {
                // Not held across the publish: the second copy hands tapes back there.
                let mut spares = self.spares.lock();
                for (worker, event) in events {
                    writer.append(Op::Event {
                        worker,
                        event: Some(event),
                        parent: None,
                        resolved: Vec::new(),
                        tape: spares.tapes.pop().unwrap_or_default(),
                        outcomes: Arc::clone(&outcomes),
                    });
                }
            }
            writer.publish();
        }
        self.publishes.fetch_add(1, Ordering::Relaxed);
        // The first copy applied every event of the batch in this publish, in order.
        let results = std::mem::take(&mut *outcomes.lock());
        results
    }

    /// Gives `worker` a slot (or returns the one it has) and publishes.
    pub fn add_worker(&self, worker: WorkerKey) -> Slot {
        let slot = Arc::new(OnceLock::new());
        {
            let mut writer = self.writer.lock();
            writer.append(Op::AddWorker {
                worker,
                slot: Arc::clone(&slot),
            });
            writer.publish();
        }
        self.publishes.fetch_add(1, Ordering::Relaxed);
        slot.get().copied().unwrap_or_default()
    }

    pub fn remove_worker(&self, worker: WorkerKey) {
        {
            let mut writer = self.writer.lock();
            writer.append(Op::RemoveWorker {
                worker,
                tape: Tape::default(),
            });
            writer.publish();
        }
        self.publishes.fetch_add(1, Ordering::Relaxed);
    }

    /// Times the writer has published.
    pub fn publishes(&self) -> u64 {
        self.publishes.load(Ordering::Relaxed)
    }
}

fn read_with<R>(handle: &ReadHandle<Twin>, block_size: usize, f: impl FnOnce(&KvIndex) -> R) -> R {
    match handle.enter() {
        Some(twin) => f(&twin.index),
        // Only while the index is being dropped: nothing is held then.
        None => f(&KvIndex::new(block_size.max(1))),
    }
}
