//! Open bookings: what each reserved, so a release frees exactly that.
//!
//! Sharded by request id, so bookings and releases of different requests rarely touch
//! the same lock, and each lock is held for one map insert or remove. The duplicate
//! check stays exact: a request id lives in one shard, and inserting it is the check.

use super::workers::{Load, LoadCell};
use crate::domain::WorkerKey;
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use std::hash::BuildHasher;
use std::sync::Arc;

const SHARDS: usize = 32;

/// What one open booking holds.
#[derive(Debug, Clone)]
pub struct Reservation {
    pub worker: WorkerKey,
    pub load: Load,
    /// The booked worker's load cell, so a release frees the load it added even if
    /// the worker re-registered meanwhile.
    pub cell: Arc<LoadCell>,
}

#[derive(Default)]
pub struct Bookings {
    shards: [Mutex<FxHashMap<String, Reservation>>; SHARDS],
    hasher: rustc_hash::FxBuildHasher,
}

impl Bookings {
    fn shard(&self, request_id: &str) -> &Mutex<FxHashMap<String, Reservation>> {
        // The high bits: FxHash's low bits are its weakest.
        &self.shards[(self.hasher.hash_one(request_id) >> 59) as usize % SHARDS]
    }

    pub fn contains(&self, request_id: &str) -> bool {
        self.shard(request_id).lock().contains_key(request_id)
    }

    /// Records a booking and adds its load; refused (nothing changes) if the id is open.
    pub fn insert(&self, request_id: &str, reservation: Reservation) -> bool {
        let mut shard = self.shard(request_id).lock();
        if shard.contains_key(request_id) {
            return false;
        }
        reservation.cell.add(reservation.load);
        shard.insert(request_id.to_string(), reservation);
        true
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
        reservation.cell.sub(reservation.load);
        Some(reservation)
    }

    /// Drops every booking on `worker` (it was deregistered; its load goes with it).
    pub fn forget_worker(&self, worker: WorkerKey) {
        for shard in &self.shards {
            shard.lock().retain(|_, r| {
                let keep = r.worker != worker;
                if !keep {
                    r.cell.sub(r.load);
                }
                keep
            });
        }
    }

    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
