//! Open bookings: what each reserved, so a release frees exactly that.
//!
//! Sharded by request id, so bookings and releases of different requests rarely touch
//! the same lock, and each lock is held for one map insert or remove. The duplicate
//! check stays exact: a request id lives in one shard, and inserting it is the check.
//! The open count is one atomic beside the shards, so the `router.max_open_bookings`
//! cap is exact too (taken before the insert, given back if the insert is refused).
//!
//! Each booking keeps when it was made, so one a client never releases (it crashed,
//! or forgot) is released by [`Bookings::expire`] after `router.booking_ttl`.

use super::workers::{Load, LoadCell};
use crate::domain::WorkerKey;
use crossbeam_utils::CachePadded;
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const SHARDS: usize = 32;

/// What one open booking holds.
#[derive(Debug, Clone)]
pub struct Reservation {
    pub worker: WorkerKey,
    pub load: Load,
    /// The booked worker's load cell, so a release frees the load it added even if
    /// the worker re-registered meanwhile.
    pub cell: Arc<LoadCell>,
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

#[derive(Default)]
pub struct Bookings {
    /// Each shard on cache lines of its own: packed side by side (40 bytes each), two
    /// threads booking requests of neighbouring shards wrote the same line (the lock
    /// byte, the map's length) and took turns with it.
    shards: [CachePadded<Mutex<FxHashMap<String, Reservation>>>; SHARDS],
    hasher: rustc_hash::FxBuildHasher,
    /// Its own lines too, for the same reason.
    open: CachePadded<AtomicUsize>,
    expired: AtomicU64,
}

impl Bookings {
    fn shard(&self, request_id: &str) -> &Mutex<FxHashMap<String, Reservation>> {
        // The high bits: FxHash's low bits are its weakest.
        &self.shards[(self.hasher.hash_one(request_id) >> 59) as usize % SHARDS]
    }

    pub fn contains(&self, request_id: &str) -> bool {
        self.shard(request_id).lock().contains_key(request_id)
    }

    /// Records a booking and adds its load; refused (nothing changes) if the id is
    /// open, or if `max_open` bookings are.
    pub fn insert(
        &self,
        request_id: &str,
        reservation: Reservation,
        max_open: usize,
    ) -> Result<(), Refused> {
        let open = self.open.fetch_add(1, Ordering::AcqRel);
        if open >= max_open {
            self.open.fetch_sub(1, Ordering::AcqRel);
            return Err(Refused::Full { open });
        }
        let mut shard = self.shard(request_id).lock();
        if shard.contains_key(request_id) {
            drop(shard);
            self.open.fetch_sub(1, Ordering::AcqRel);
            return Err(Refused::Duplicate);
        }
        reservation.cell.add(reservation.load);
        shard.insert(request_id.to_string(), reservation);
        Ok(())
    }

    /// Grows an open booking's reservation (and its worker's load) by `extra`.
    pub fn grow(&self, request_id: &str, extra: Load) {
        if let Some(r) = self.shard(request_id).lock().get_mut(request_id) {
            r.load.active_requests += extra.active_requests;
            r.load.active_blocks += extra.active_blocks;
            r.load.prefill_blocks += extra.prefill_blocks;
            r.cell.add(extra);
        }
    }

    /// Removes a booking and frees its load.
    pub fn remove(&self, request_id: &str) -> Option<Reservation> {
        let reservation = self.shard(request_id).lock().remove(request_id)?;
        self.open.fetch_sub(1, Ordering::AcqRel);
        reservation.cell.sub(reservation.load);
        Some(reservation)
    }

    /// Releases every booking older than `ttl`, as a release would; returns how
    /// many. Each shard's lock is held for one pass over that shard.
    pub fn expire(&self, ttl: Duration) -> usize {
        let Some(cutoff) = Instant::now().checked_sub(ttl) else {
            return 0;
        };
        let mut expired = 0;
        for shard in &self.shards {
            shard.lock().retain(|_, r| {
                let keep = r.booked_at > cutoff;
                if !keep {
                    r.cell.sub(r.load);
                    expired += 1;
                }
                keep
            });
        }
        self.open.fetch_sub(expired, Ordering::AcqRel);
        self.expired.fetch_add(expired as u64, Ordering::Relaxed);
        expired
    }

    /// Bookings released by [`Self::expire`] since start.
    pub fn expired(&self) -> u64 {
        self.expired.load(Ordering::Relaxed)
    }

    /// Drops every booking on `worker` (it was deregistered; its load goes with it).
    pub fn forget_worker(&self, worker: WorkerKey) {
        let mut dropped = 0;
        for shard in &self.shards {
            shard.lock().retain(|_, r| {
                let keep = r.worker != worker;
                if !keep {
                    r.cell.sub(r.load);
                    dropped += 1;
                }
                keep
            });
        }
        self.open.fetch_sub(dropped, Ordering::AcqRel);
    }

    pub fn len(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
