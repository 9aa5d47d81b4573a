//! Open bookings: what each reserved, so a release frees exactly that.
//!
//! Sharded by request id, so bookings and releases of different requests rarely touch
//! the same lock, and each lock is held for one map insert or remove. The duplicate
//! check stays exact: a request id lives in one shard, and inserting it is the check.
//! The open count ([`OpenCount`]) keeps the `router.max_open_bookings` cap exact too
//! (counted in before the insert, out again if the insert is refused).
//!
//! Each booking keeps when it was made, so one a client never releases (it crashed,
//! or forgot) is released by [`Bookings::expire`] after `router.booking_ttl`.
//!
//! A booking names the load cell it added to by the cell's id, not by a reference
//! count: cloning an `Arc` of the cell was a write to a line of its own, shared by
//! every thread booking that worker, on each booking and each release. A release finds
//! the cell in the current worker table, and frees the load only if it is the same
//! cell: a worker deregistered since took its load with it, and one registered again
//! under the same key has a new cell that this booking never added to.

use super::open_count::OpenCount;
use super::workers::{Load, LoadCell, WorkerTable};
use crate::domain::WorkerKey;
use crossbeam_utils::CachePadded;
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Reservation shards: enough that bookings on many cores rarely meet on one (each
/// booking locks its shard three times: the early duplicate check, the insert, the
/// release). At 64 cores and ~16 M bookings/s, 32 shards would each take ~1.5 M locks
/// a second, nearly every one after another core; 256 take an eighth of that. An
/// empty shard costs its 128 bytes and no allocation.
const SHARDS: usize = 256;

/// What one open booking holds.
#[derive(Debug, Clone)]
pub struct Reservation {
    pub worker: WorkerKey,
    pub load: Load,
    /// [`LoadCell::id`] of the booked worker's load cell, which `load` was added to.
    pub cell: u64,
    /// When it was booked, for [`Bookings::expire`].
    pub booked_at: Instant,
}

/// Why a booking was not recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// The request id is open already.
    Duplicate,
    /// `max_open` bookings are open.
    Full { open: usize },
}

pub struct Bookings {
    /// Each shard on cache lines of its own: packed side by side (40 bytes each), two
    /// threads booking requests of neighbouring shards wrote the same line (the lock
    /// byte, the map's length) and took turns with it.
    shards: [CachePadded<Mutex<FxHashMap<String, Reservation>>>; SHARDS],
    hasher: rustc_hash::FxBuildHasher,
    open: OpenCount,
    expired: AtomicU64,
}

impl Default for Bookings {
    fn default() -> Self {
        Self {
            // `Default` for arrays stops at 32 items.
            shards: std::array::from_fn(|_| CachePadded::default()),
            hasher: rustc_hash::FxBuildHasher,
            open: OpenCount::default(),
            expired: AtomicU64::new(0),
        }
    }
}

impl Bookings {
    fn shard(&self, request_id: &str) -> &Mutex<FxHashMap<String, Reservation>> {
        // The high bits: FxHash's low bits are its weakest.
        let high = self.hasher.hash_one(request_id) >> (64 - SHARDS.trailing_zeros());
        &self.shards[high as usize % SHARDS]
    }

    pub fn contains(&self, request_id: &str) -> bool {
        self.shard(request_id).lock().contains_key(request_id)
    }

    /// Records a booking and adds its load to `cell` (the cell `reservation.cell`
    /// names); refused (nothing changes) if the id is open, or if `max_open`
    /// bookings are.
    pub fn insert(
        &self,
        request_id: &str,
        reservation: Reservation,
        cell: &LoadCell,
        max_open: usize,
    ) -> Result<(), Refused> {
        if let Err(open) = self.open.open(max_open) {
            return Err(Refused::Full { open });
        }
        let mut shard = self.shard(request_id).lock();
        if shard.contains_key(request_id) {
            drop(shard);
            self.open.close();
            return Err(Refused::Duplicate);
        }
        debug_assert_eq!(cell.id(), reservation.cell);
        cell.add(reservation.load);
        shard.insert(request_id.to_string(), reservation);
        Ok(())
    }

    /// Grows an open booking's reservation (and its worker's load, if `table`
    /// still has its cell) by `extra`.
    pub fn grow(&self, request_id: &str, extra: Load, table: &WorkerTable) {
        if let Some(r) = self.shard(request_id).lock().get_mut(request_id) {
            r.load.active_requests += extra.active_requests;
            r.load.active_blocks += extra.active_blocks;
            r.load.prefill_blocks += extra.prefill_blocks;
            if let Some(cell) = table.load_cell(r.worker, r.cell) {
                cell.add(extra);
            }
        }
    }

    /// Frees an open booking's prefill load (its worker has prefilled the prompt);
    /// the rest stays reserved until release.
    pub fn finish_prefill(&self, request_id: &str, table: &WorkerTable) {
        if let Some(r) = self.shard(request_id).lock().get_mut(request_id) {
            let done = Load {
                prefill_blocks: std::mem::take(&mut r.load.prefill_blocks),
                ..Load::default()
            };
            if let Some(cell) = table.load_cell(r.worker, r.cell) {
                cell.sub(done);
            }
        }
    }

    /// Removes a booking and frees its load (if `table` still has its cell).
    pub fn remove(&self, request_id: &str, table: &WorkerTable) -> Option<Reservation> {
        let reservation = self.shard(request_id).lock().remove(request_id)?;
        self.open.close();
        if let Some(cell) = table.load_cell(reservation.worker, reservation.cell) {
            cell.sub(reservation.load);
        }
        Some(reservation)
    }

    /// Releases every booking older than `ttl`, as a release would; returns how
    /// many. Each shard's lock is held for one pass over that shard.
    pub fn expire(&self, ttl: Duration, table: &WorkerTable) -> usize {
        let Some(cutoff) = Instant::now().checked_sub(ttl) else {
            return 0;
        };
        let mut expired = 0;
        for shard in &self.shards {
            shard.lock().retain(|_, r| {
                let keep = r.booked_at > cutoff;
                if !keep {
                    if let Some(cell) = table.load_cell(r.worker, r.cell) {
                        cell.sub(r.load);
                    }
                    expired += 1;
                }
                keep
            });
        }
        self.open.close_many(expired);
        self.expired.fetch_add(expired as u64, Ordering::Relaxed);
        expired
    }

    /// Bookings released by [`Self::expire`] since start.
    pub fn expired(&self) -> u64 {
        self.expired.load(Ordering::Relaxed)
    }

    /// Drops every booking on `worker` (it was deregistered; its load cell went
    /// with it, so there is no load to free).
    pub fn forget_worker(&self, worker: WorkerKey) {
        let mut dropped = 0;
        for shard in &self.shards {
            shard.lock().retain(|_, r| {
                let keep = r.worker != worker;
                dropped += usize::from(!keep);
                keep
            });
        }
        self.open.close_many(dropped);
    }

    /// Bookings open; exact when none is being booked or released.
    pub fn len(&self) -> usize {
        self.open.get()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::Worker;
    use crate::router::workers::{WorkerEntry, WorkerRegistration};
    use std::sync::Arc;

    fn table(key: WorkerKey, cell: &Arc<LoadCell>) -> WorkerTable {
        let registration: WorkerRegistration = serde_json::from_value(serde_json::json!({
            "worker_id": key.worker_id, "dp_rank": key.dp_rank, "role": "decode",
        }))
        .expect("registration");
        let worker = Worker::from_registration(registration).expect("worker");
        WorkerTable::from_entries(vec![Arc::new(WorkerEntry {
            worker: Arc::new(worker),
            slot: 0,
            load: Arc::clone(cell),
            signed_hashes: Arc::default(),
        })])
    }

    /// A booking frees its load from the cell it added to, and only from that one: a
    /// worker registered again under the same key after a deregistration has a new
    /// cell, which a booking made before must leave alone (it never added to it).
    #[test]
    fn a_release_frees_the_load_from_the_cell_it_was_added_to_and_no_other() {
        let key = WorkerKey {
            worker_id: 7,
            dp_rank: 0,
        };
        let load = Load {
            active_requests: 1,
            active_blocks: 16,
            prefill_blocks: 4,
        };
        let bookings = Bookings::default();
        let (first, second) = (Arc::new(LoadCell::default()), Arc::new(LoadCell::default()));
        let (before, after) = (table(key, &first), table(key, &second));
        for id in ["a", "b"] {
            let reservation = Reservation {
                worker: key,
                load,
                cell: first.id(),
                booked_at: Instant::now(),
            };
            assert_eq!(bookings.insert(id, reservation, &first, 10), Ok(()));
        }
        assert_eq!(first.get().active_blocks, 32);

        // The worker came back with a new cell: releasing leaves it at zero.
        second.add(Load {
            active_requests: 1,
            ..Load::default()
        });
        assert!(bookings.remove("a", &after).is_some());
        assert_eq!(second.get().active_requests, 1, "the new cell is untouched");
        assert_eq!(
            first.get().active_blocks,
            32,
            "the old cell is not in that table"
        );

        // Released against the table that holds its cell, the load is freed.
        assert!(bookings.remove("b", &before).is_some());
        assert_eq!(first.get().active_blocks, 16);
        assert_eq!(bookings.len(), 0);
        assert!(bookings.remove("b", &before).is_none());
    }
}
