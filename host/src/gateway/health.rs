//! Which workers the gateway may send to: active health checks (`GET /health`,
//! with failure and success thresholds) and a circuit breaker per worker.
//!
//! A refused connection opens a worker's circuit at once: a gateway that waits
//! for several failures first keeps sending to a dead worker for seconds, each
//! request paying a retry. Other failures (a 5xx, a broken response) open it
//! after `gateway.circuit_failures` in a row. An open circuit lets one probe request
//! through after `gateway.circuit_open_ms`; a passing health check closes it at
//! once, so a restarted worker is back within one health interval.
//!
//! The booking path reads the state through an `arc-swap` map of atomics: no lock.

use crate::domain::WorkerKey;
use arc_swap::ArcSwap;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// One worker's state.
#[derive(Debug)]
pub struct HealthCell {
    healthy: AtomicBool,
    failures_in_a_row: AtomicU32,
    successes_in_a_row: AtomicU32,
    /// Milliseconds since the table's epoch until which the circuit is open; 0:
    /// closed.
    open_until_ms: AtomicU64,
    /// Request failures in a row, for the circuit.
    request_failures: AtomicU32,
    /// One probe request is out through a circuit that was open.
    probing: AtomicBool,
    /// Why it is out, for status.
    why: Mutex<Option<String>>,
    pub checks: AtomicU64,
    pub circuit_opened: AtomicU64,
}

impl Default for HealthCell {
    fn default() -> Self {
        Self {
            healthy: AtomicBool::new(true),
            failures_in_a_row: AtomicU32::new(0),
            successes_in_a_row: AtomicU32::new(0),
            open_until_ms: AtomicU64::new(0),
            request_failures: AtomicU32::new(0),
            probing: AtomicBool::new(false),
            why: Mutex::new(None),
            checks: AtomicU64::new(0),
            circuit_opened: AtomicU64::new(0),
        }
    }
}

/// What status shows for a worker.
#[derive(Debug, Clone, serde::Serialize)]
pub struct HealthView {
    pub healthy: bool,
    pub circuit: &'static str,
    pub why: Option<String>,
    pub checks: u64,
    pub circuit_opened: u64,
}

/// Every worker's state, by key.
pub struct Health {
    epoch: Instant,
    cells: ArcSwap<HashMap<WorkerKey, Arc<HealthCell>>>,
    /// Serialises adding cells.
    adding: Mutex<()>,
}

impl Default for Health {
    fn default() -> Self {
        Self {
            epoch: Instant::now(),
            cells: ArcSwap::from_pointee(HashMap::new()),
            adding: Mutex::new(()),
        }
    }
}

impl Health {
    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    pub fn cell(&self, key: WorkerKey) -> Arc<HealthCell> {
        if let Some(cell) = self.cells.load().get(&key) {
            return Arc::clone(cell);
        }
        let _adding = self.adding.lock();
        let cells = self.cells.load_full();
        if let Some(cell) = cells.get(&key) {
            return Arc::clone(cell);
        }
        let mut next = HashMap::clone(&cells);
        let cell = Arc::new(HealthCell::default());
        next.insert(key, Arc::clone(&cell));
        self.cells.store(Arc::new(next));
        cell
    }

    /// Forgets workers no longer registered.
    pub fn retain(&self, keep: impl Fn(&WorkerKey) -> bool) {
        let _adding = self.adding.lock();
        let cells = self.cells.load_full();
        if cells.keys().all(&keep) {
            return;
        }
        let next = cells
            .iter()
            .filter(|(k, _)| keep(k))
            .map(|(k, v)| (*k, Arc::clone(v)))
            .collect();
        self.cells.store(Arc::new(next));
    }

    /// Whether a request may go to `key` now. Claims the one probe of a circuit
    /// whose open time has passed, so call it only for a worker about to be
    /// offered to the booking. Unknown workers are admitted.
    pub fn admits(&self, key: WorkerKey) -> bool {
        let cells = self.cells.load();
        let Some(cell) = cells.get(&key) else {
            return true;
        };
        if !cell.healthy.load(Ordering::Relaxed) {
            return false;
        }
        let until = cell.open_until_ms.load(Ordering::Relaxed);
        if until == 0 {
            return true;
        }
        if self.now_ms() < until {
            return false;
        }
        // Half open: one probe at a time.
        !cell.probing.swap(true, Ordering::AcqRel)
    }

    /// A response head came back (not a 5xx or 429): the circuit closes.
    pub fn request_succeeded(&self, key: WorkerKey) {
        let cell = self.cell(key);
        cell.request_failures.store(0, Ordering::Relaxed);
        if cell.open_until_ms.swap(0, Ordering::Relaxed) != 0 {
            tracing::info!(worker = %key, "circuit closed: the worker answered");
            *cell.why.lock() = None;
        }
        cell.probing.store(false, Ordering::Relaxed);
    }

    /// The worker refused the connection: its circuit opens at once.
    pub fn refused(&self, key: WorkerKey, open_ms: u64, why: String) {
        let cell = self.cell(key);
        self.open(&cell, key, open_ms, why);
    }

    /// Another failure (a 5xx, a broken response): the circuit opens after
    /// `threshold` in a row.
    pub fn request_failed(&self, key: WorkerKey, threshold: u32, open_ms: u64, why: String) {
        let cell = self.cell(key);
        let failures = cell.request_failures.fetch_add(1, Ordering::Relaxed) + 1;
        let was_probe = cell.probing.load(Ordering::Relaxed);
        if failures >= threshold || was_probe {
            self.open(&cell, key, open_ms, why);
        }
    }

    /// The worker sent no response in time. If its last health check passed it
    /// is busy (a long generation), not broken, and this does not count against
    /// its circuit; without a passing check (none yet, checks off, or failing) it
    /// counts as [`Self::request_failed`] does.
    pub fn timed_out(&self, key: WorkerKey, threshold: u32, open_ms: u64, why: String) {
        let cell = self.cell(key);
        let passing = cell.checks.load(Ordering::Relaxed) > 0
            && cell.healthy.load(Ordering::Relaxed)
            && cell.failures_in_a_row.load(Ordering::Relaxed) == 0;
        if passing {
            // A probe through a half-open circuit ends here without a verdict.
            cell.probing.store(false, Ordering::Relaxed);
            tracing::info!(worker = %key, %why, "a request timed out on a worker that passes its health checks; its circuit is left as it is");
            return;
        }
        self.request_failed(key, threshold, open_ms, why);
    }

    fn open(&self, cell: &HealthCell, key: WorkerKey, open_ms: u64, why: String) {
        let until = self.now_ms() + open_ms.max(1);
        if cell.open_until_ms.swap(until, Ordering::Relaxed) == 0 {
            cell.circuit_opened.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(worker = %key, %why, open_ms, "circuit open: no requests go to this worker until it answers a health check or the open time passes");
        }
        cell.probing.store(false, Ordering::Relaxed);
        *cell.why.lock() = Some(format!("circuit open: {why}"));
    }

    /// A health check's result.
    pub fn checked(&self, key: WorkerKey, ok: bool, why: String, failures: u32, successes: u32) {
        let cell = self.cell(key);
        cell.checks.fetch_add(1, Ordering::Relaxed);
        if ok {
            cell.failures_in_a_row.store(0, Ordering::Relaxed);
            let n = cell.successes_in_a_row.fetch_add(1, Ordering::Relaxed) + 1;
            if n >= successes && !cell.healthy.swap(true, Ordering::Relaxed) {
                tracing::info!(worker = %key, "healthy again: it passed its health checks");
            }
            // A worker that answers its health check takes requests again, even
            // one whose circuit a refusal opened (it restarted).
            if cell.healthy.load(Ordering::Relaxed) {
                if cell.open_until_ms.swap(0, Ordering::Relaxed) != 0 {
                    tracing::info!(worker = %key, "circuit closed: the worker passed a health check");
                }
                cell.request_failures.store(0, Ordering::Relaxed);
                cell.probing.store(false, Ordering::Relaxed);
                *cell.why.lock() = None;
            }
        } else {
            cell.successes_in_a_row.store(0, Ordering::Relaxed);
            let n = cell.failures_in_a_row.fetch_add(1, Ordering::Relaxed) + 1;
            if n >= failures {
                if cell.healthy.swap(false, Ordering::Relaxed) {
                    tracing::warn!(worker = %key, %why, "unhealthy: no requests go to it until it passes its health checks again");
                }
                *cell.why.lock() = Some(format!("health check failed: {why}"));
            }
        }
    }

    pub fn view(&self, key: WorkerKey) -> Option<HealthView> {
        let cell = Arc::clone(self.cells.load().get(&key)?);
        let until = cell.open_until_ms.load(Ordering::Relaxed);
        Some(HealthView {
            healthy: cell.healthy.load(Ordering::Relaxed),
            circuit: match until {
                0 => "closed",
                u if self.now_ms() < u => "open",
                _ => "half_open",
            },
            why: {
                let why = cell.why.lock().clone();
                why
            },
            checks: cell.checks.load(Ordering::Relaxed),
            circuit_opened: cell.circuit_opened.load(Ordering::Relaxed),
        })
    }

    /// Whether `key` would be admitted, without claiming a probe (for listing).
    pub fn looks_up(&self, key: WorkerKey) -> bool {
        let cells = self.cells.load();
        match cells.get(&key) {
            None => true,
            Some(cell) => {
                cell.healthy.load(Ordering::Relaxed) && {
                    let until = cell.open_until_ms.load(Ordering::Relaxed);
                    until == 0 || self.now_ms() >= until
                }
            }
        }
    }
}
