//! One source's counters and state: written by its thread, read by `/metrics` and
//! `/admin/status` without a lock.

use super::decode::DecodedBatch;
use crate::router::index::KvEvent;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// Where a subscription is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceState {
    /// Creating, binding or connecting its socket (or waiting to retry).
    Connecting = 0,
    /// Receiving.
    Live = 1,
    /// Fetching missed batches from the replay socket.
    Replaying = 2,
    /// Its worker was deregistered or its source removed.
    Stopped = 3,
    /// The last attempt to create, bind or connect its socket failed (`last_error`
    /// says why); the next one comes after a backoff (100 ms, doubling to 5 s).
    Failed = 4,
}

impl SourceState {
    /// Every state, in `as_str` order (the metrics' `state` label).
    pub const ALL: [SourceState; 5] = [
        Self::Connecting,
        Self::Live,
        Self::Replaying,
        Self::Stopped,
        Self::Failed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Connecting => "connecting",
            Self::Live => "live",
            Self::Replaying => "replaying",
            Self::Stopped => "stopped",
            Self::Failed => "failed",
        }
    }

    fn from_u8(value: u8) -> Self {
        match value {
            1 => Self::Live,
            2 => Self::Replaying,
            3 => Self::Stopped,
            4 => Self::Failed,
            _ => Self::Connecting,
        }
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// `u64::MAX` in [`SourceStats::last_seq`]: nothing received yet.
pub const NO_SEQ: u64 = u64::MAX;

#[derive(Debug)]
pub struct SourceStats {
    state: AtomicU8,
    pub connects: AtomicU64,
    /// The publisher's connection dropped and came back (the worker is rebuilt).
    pub reconnects: AtomicU64,
    pub socket_errors: AtomicU64,
    /// Peers that accepted a connection but failed the ZMTP handshake: not a ZMQ
    /// publisher (or not yet one).
    pub handshake_failures: AtomicU64,
    pub batches: AtomicU64,
    pub stored: AtomicU64,
    pub removed: AtomicU64,
    pub cleared: AtomicU64,
    pub blocks_stored: AtomicU64,
    pub unknown_type: AtomicU64,
    pub other_medium: AtomicU64,
    pub other_group: AtomicU64,
    pub wrong_block_size: AtomicU64,
    pub placeholder: AtomicU64,
    /// Events refused because their fields contradict each other.
    pub malformed_events: AtomicU64,
    pub decode_errors: AtomicU64,
    pub frame_errors: AtomicU64,
    /// Batches on another topic (a SUB subscription matches topics by prefix).
    pub other_topic: AtomicU64,
    pub gaps: AtomicU64,
    pub duplicates: AtomicU64,
    pub restarts: AtomicU64,
    pub replays: AtomicU64,
    pub replay_failures: AtomicU64,
    /// Replays whose buffer no longer reached the first batch missed.
    pub replay_short: AtomicU64,
    pub resyncs: AtomicU64,
    /// Batches the ingestion queue could not take.
    pub dropped: AtomicU64,
    pub unknown_parent: AtomicU64,
    pub unknown_worker: AtomicU64,
    pub refused: AtomicU64,
    pub last_seq: AtomicU64,
    /// Wall clock (ms) when the last batch arrived; 0 before the first.
    pub last_received_ms: AtomicU64,
    /// Arrival minus the batch's `ts`, in ms (negative clamped to 0), last batch.
    pub lag_ms: AtomicU64,
    /// The engine's hashes are signed (SGLang) / digests (vLLM without int hashes).
    pub signed_hashes: AtomicBool,
    pub digest_hashes: AtomicBool,
    last_error: Mutex<Option<String>>,
}

impl Default for SourceStats {
    fn default() -> Self {
        Self {
            state: AtomicU8::new(SourceState::Connecting as u8),
            connects: AtomicU64::new(0),
            reconnects: AtomicU64::new(0),
            socket_errors: AtomicU64::new(0),
            handshake_failures: AtomicU64::new(0),
            batches: AtomicU64::new(0),
            stored: AtomicU64::new(0),
            removed: AtomicU64::new(0),
            cleared: AtomicU64::new(0),
            blocks_stored: AtomicU64::new(0),
            unknown_type: AtomicU64::new(0),
            other_medium: AtomicU64::new(0),
            other_group: AtomicU64::new(0),
            wrong_block_size: AtomicU64::new(0),
            placeholder: AtomicU64::new(0),
            malformed_events: AtomicU64::new(0),
            decode_errors: AtomicU64::new(0),
            frame_errors: AtomicU64::new(0),
            other_topic: AtomicU64::new(0),
            gaps: AtomicU64::new(0),
            duplicates: AtomicU64::new(0),
            restarts: AtomicU64::new(0),
            replays: AtomicU64::new(0),
            replay_failures: AtomicU64::new(0),
            replay_short: AtomicU64::new(0),
            resyncs: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            unknown_parent: AtomicU64::new(0),
            unknown_worker: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            last_seq: AtomicU64::new(NO_SEQ),
            last_received_ms: AtomicU64::new(0),
            lag_ms: AtomicU64::new(0),
            signed_hashes: AtomicBool::new(false),
            digest_hashes: AtomicBool::new(false),
            last_error: Mutex::new(None),
        }
    }
}

impl SourceStats {
    pub fn state(&self) -> SourceState {
        SourceState::from_u8(self.state.load(Ordering::Relaxed))
    }

    pub fn set_state(&self, state: SourceState) {
        self.state.store(state as u8, Ordering::Relaxed);
        if state == SourceState::Live {
            *self.last_error.lock() = None;
        }
    }

    pub fn set_error(&self, problem: &str) {
        *self.last_error.lock() = Some(problem.to_string());
    }

    pub fn last_error(&self) -> Option<String> {
        self.last_error.lock().clone()
    }

    /// A batch arrived now.
    pub fn touch(&self) {
        self.last_received_ms.store(now_ms(), Ordering::Relaxed);
    }

    /// Milliseconds since the last batch arrived, if one has.
    pub fn age_ms(&self) -> Option<u64> {
        match self.last_received_ms.load(Ordering::Relaxed) {
            0 => None,
            at => Some(now_ms().saturating_sub(at)),
        }
    }

    /// Counts what a decoded batch held.
    pub fn record(&self, batch: &DecodedBatch) {
        let c = &batch.counts;
        let add = |counter: &AtomicU64, n: u64| {
            if n > 0 {
                counter.fetch_add(n, Ordering::Relaxed);
            }
        };
        add(&self.stored, c.stored);
        add(&self.removed, c.removed);
        add(&self.cleared, c.cleared);
        add(&self.unknown_type, c.unknown_type);
        add(&self.other_medium, c.other_medium);
        add(&self.other_group, c.other_group);
        add(&self.wrong_block_size, c.wrong_block_size);
        add(&self.placeholder, c.placeholder);
        add(&self.malformed_events, c.malformed);
        let blocks: usize = batch
            .events
            .iter()
            .map(|e| match e {
                KvEvent::Stored { blocks, .. } => blocks.len(),
                KvEvent::Hashed { blocks, .. } => blocks.len(),
                KvEvent::Removed { .. } | KvEvent::Cleared => 0,
            })
            .sum();
        add(&self.blocks_stored, blocks as u64);
        if batch.hashes.signed {
            self.signed_hashes.store(true, Ordering::Relaxed);
        }
        if batch.hashes.digest {
            self.digest_hashes.store(true, Ordering::Relaxed);
        }
        let ts_ms = batch.ts * 1000.0;
        if ts_ms.is_finite() && ts_ms > 0.0 {
            let lag = now_ms().saturating_sub(ts_ms as u64);
            self.lag_ms.store(lag, Ordering::Relaxed);
        }
    }
}
