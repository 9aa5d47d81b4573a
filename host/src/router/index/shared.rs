//! The index as bookings and ingestion share it: readers never wait, one writer applies
//! events in batches.
//!
//! Two copies of [`KvIndex`] behind `left-right`: bookings read the published copy with
//! no lock (a read costs two increments of the reading thread's own epoch counter, not a
//! cost per block), and
//! the writer applies a batch of events to the other copy, swaps, waits for the readers
//! still in the old copy to finish their walk (microseconds), and replays the batch
//! there. So a booking never waits for ingestion at all, and ingestion waits at most for
//! the walks in flight when it published. The price is memory (two copies) and applying
//! each event twice; the second application replays the first's resolved sequence
//! hashes, so the tokens are hashed once.
//!
//! Events become visible when their batch is published: [`SharedIndex::apply`] and
//! [`SharedIndex::apply_batch`] publish before they return, so a caller that posted an
//! event and then books sees it.

use super::{identity_seed, ApplyStats, KvEvent, KvEventError, KvIndex, Slot, Stored, WorkerKey};
use left_right::{Absorb, ReadHandle, ReadHandleFactory, WriteHandle};
use parking_lot::Mutex;
use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

type Outcome = Arc<OnceLock<Result<ApplyStats, KvEventError>>>;

/// One change to the index, as the writer's log holds it until both copies have it.
pub enum Op {
    Event {
        worker: WorkerKey,
        /// Taken when the first copy applies it; a `stored` event is replaced by its
        /// resolved copies so the second copy does not hash again.
        event: Option<KvEvent>,
        parent: Option<u64>,
        resolved: Vec<(u64, u64)>,
        outcome: Outcome,
    },
    AddWorker {
        worker: WorkerKey,
        slot: Arc<OnceLock<Slot>>,
    },
    RemoveWorker(WorkerKey),
}

impl Absorb<Op> for KvIndex {
    fn absorb_first(&mut self, op: &mut Op, _: &Self) {
        match op {
            Op::Event {
                worker,
                event,
                parent,
                resolved,
                outcome,
            } => {
                // Only registration gives a worker a slot here: events queued for a
                // worker that was deregistered meanwhile are refused, not replayed
                // into a fresh slot.
                let result = match event.take() {
                    Some(_) if self.slot_of(*worker).is_none() => {
                        Err(KvEventError::UnknownWorker { worker: *worker })
                    }
                    Some(KvEvent::Stored {
                        parent_block_hash,
                        blocks,
                        lora_name,
                        cache_salt,
                        extra_keys,
                    }) => {
                        *parent = parent_block_hash;
                        let identity = identity_seed(lora_name.as_deref(), cache_salt.as_deref());
                        self.apply_stored(
                            *worker,
                            parent_block_hash,
                            Stored {
                                identity,
                                blocks: &blocks,
                                extra_keys: &extra_keys,
                            },
                            resolved,
                        )
                    }
                    Some(other) => {
                        let result = self.apply(*worker, &other);
                        // Removals and clears replay as they are: no hashing to save.
                        *event = Some(other);
                        result
                    }
                    None => Ok(ApplyStats::default()),
                };
                if result.is_err() {
                    resolved.clear();
                    *event = None;
                }
                let _ = outcome.set(result);
            }
            Op::AddWorker { worker, slot } => {
                let _ = slot.set(self.add_worker(*worker));
            }
            Op::RemoveWorker(worker) => self.remove_worker(*worker),
        }
    }

    fn absorb_second(&mut self, op: Op, _: &Self) {
        match op {
            Op::Event {
                worker,
                event,
                parent,
                resolved,
                ..
            } => match event {
                Some(event) => {
                    let _ = self.apply(worker, &event);
                }
                None => self.store_resolved(worker, parent, &resolved),
            },
            Op::AddWorker { worker, .. } => {
                self.add_worker(worker);
            }
            Op::RemoveWorker(worker) => self.remove_worker(worker),
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
    static READERS: RefCell<Vec<(u64, ReadHandle<KvIndex>)>> = const { RefCell::new(Vec::new()) };
}

/// The KV index shared by bookings (readers) and ingestion (one writer at a time).
pub struct SharedIndex {
    id: u64,
    writer: Mutex<WriteHandle<KvIndex, Op>>,
    readers: ReadHandleFactory<KvIndex>,
    block_size: usize,
    publishes: AtomicU64,
}

impl SharedIndex {
    pub fn new(block_size: usize) -> Self {
        let (writer, reader) = left_right::new_from_empty::<KvIndex, Op>(KvIndex::new(block_size));
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
        let outcomes: Vec<Outcome> = {
            let mut writer = self.writer.lock();
            let outcomes: Vec<Outcome> = events
                .into_iter()
                .map(|(worker, event)| {
                    let outcome = Outcome::default();
                    writer.append(Op::Event {
                        worker,
                        event: Some(event),
                        parent: None,
                        resolved: Vec::new(),
                        outcome: Arc::clone(&outcome),
                    });
                    outcome
                })
                .collect();
            writer.publish();
            outcomes
        };
        self.publishes.fetch_add(1, Ordering::Relaxed);
        outcomes
            .into_iter()
            .map(|o| o.get().cloned().unwrap_or(Ok(ApplyStats::default())))
            .collect()
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
            writer.append(Op::RemoveWorker(worker));
            writer.publish();
        }
        self.publishes.fetch_add(1, Ordering::Relaxed);
    }

    /// Times the writer has published.
    pub fn publishes(&self) -> u64 {
        self.publishes.load(Ordering::Relaxed)
    }
}

fn read_with<R>(
    handle: &ReadHandle<KvIndex>,
    block_size: usize,
    f: impl FnOnce(&KvIndex) -> R,
) -> R {
    match handle.enter() {
        Some(index) => f(&index),
        // Only while the index is being dropped: nothing is held then.
        None => f(&KvIndex::new(block_size.max(1))),
    }
}
