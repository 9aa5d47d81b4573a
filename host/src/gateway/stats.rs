//! What the gateway counts: releases by reason, retries, hints not deliverable by
//! engine, upstream statuses, and per model and worker the time to first byte,
//! the duration and the router's own overhead (tokenization apart), read by
//! `/metrics`.

use super::signals::Signals;
use crate::domain::{Engine, WorkerKey};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Why a booking made by the gateway was released.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Release {
    /// The worker's response ended.
    Completed,
    /// The client went away (before the head, during prefill, or mid-stream).
    ClientDisconnect,
    /// The worker refused the connection, failed, or broke off its response.
    UpstreamError,
    /// No byte from the worker for `gateway.idle_timeout_ms`.
    IdleTimeout,
    /// A non-streaming request's answer did not come within
    /// `gateway.response_timeout_ms`.
    ResponseTimeout,
    /// `gateway.request_timeout_ms` passed.
    Deadline,
    /// The router's `router.booking_ttl` released it first.
    Ttl,
    /// The request was booked again elsewhere (a retry).
    Retried,
    /// Booked but never sent, or sent and abandoned before its head: the
    /// other leg of its disaggregated pair could not be booked, or failed
    /// first (the pair is booked again, or the request fails).
    PairAbandoned,
}

impl Release {
    pub const ALL: [Release; 9] = [
        Release::Completed,
        Release::ClientDisconnect,
        Release::UpstreamError,
        Release::IdleTimeout,
        Release::ResponseTimeout,
        Release::Deadline,
        Release::Ttl,
        Release::Retried,
        Release::PairAbandoned,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Completed => "completed",
            Self::ClientDisconnect => "client_disconnect",
            Self::UpstreamError => "upstream_error",
            Self::IdleTimeout => "idle_timeout",
            Self::ResponseTimeout => "response_timeout",
            Self::Deadline => "deadline",
            Self::Ttl => "ttl",
            Self::Retried => "retried",
            Self::PairAbandoned => "pair_abandoned",
        }
    }
}

/// The latency histogram's bucket bounds, in seconds.
pub const BUCKETS: [f64; 14] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0,
];

/// A Prometheus histogram's counts.
#[derive(Debug, Clone, Default)]
pub struct Histogram {
    pub buckets: [u64; BUCKETS.len()],
    pub count: u64,
    pub sum: f64,
}

impl Histogram {
    fn observe(&mut self, seconds: f64) {
        for (bound, count) in BUCKETS.iter().zip(self.buckets.iter_mut()) {
            if seconds <= *bound {
                *count += 1;
            }
        }
        self.count += 1;
        self.sum += seconds;
    }
}

/// Per (model, worker) figures.
#[derive(Debug, Clone, Default)]
pub struct Timings {
    pub ttfb: Histogram,
    pub duration: Histogram,
    /// Request received → request sent to the worker, tokenization included.
    pub overhead: Histogram,
    pub tokenize: Histogram,
    /// Request received to the first content: a stream's first SSE event with a
    /// token, a non-streaming answer's first byte.
    pub ttft: Histogram,
    /// A stream's mean time between content events after the first.
    pub between_tokens: Histogram,
    /// From the engine's `usage`, when it sent one.
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// Responses by upstream status code.
    pub statuses: BTreeMap<u16, u64>,
}

#[derive(Debug, Default)]
pub struct GatewayStats {
    releases: [AtomicU64; Release::ALL.len()],
    pub retries: AtomicU64,
    /// Requests re-sent on a fresh connection to the same worker, their pooled
    /// one having been closed by the worker.
    pub resent: AtomicU64,
    undeliverable: [AtomicU64; Engine::ALL.len()],
    pub hints_delivered: AtomicU64,
    /// Requests answered by the router itself (no worker answered), by status.
    refused: Mutex<BTreeMap<u16, u64>>,
    timings: Mutex<BTreeMap<(String, WorkerKey), Timings>>,
    /// Requests whose prefix an in-flight request was still computing:
    /// [waited and it settled in time, waited `gateway.prefix_wait_ms` in vain,
    /// sent at once (the prefix was shorter than
    /// `gateway.prefix_wait_min_tokens`)], and the nanoseconds they waited in all.
    prefix_waits: [AtomicU64; 3],
    prefix_wait_ns: AtomicU64,
    /// Disaggregated pairs (`gateway::disaggregated`).
    pub pairs: PairStats,
}

/// What became of disaggregated requests and of each of their legs.
#[derive(Debug, Default)]
pub struct PairStats {
    paths: [AtomicU64; PairPath::ALL.len()],
    /// By leg (prefill, decode) and outcome ([`LegOutcome`]).
    legs: [[AtomicU64; LegOutcome::ALL.len()]; 2],
    /// Requests whose prefill answered that no KV would be handed over (vLLM:
    /// no `kv_transfer_params`): their decode worker computed the prompt.
    pub not_transferred: AtomicU64,
}

/// How a disaggregated request was served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PairPath {
    /// A prefill leg, then (or beside it) the decode leg.
    Disaggregated,
    /// The decode worker held all but `decode_alone_within_tokens` of the
    /// prompt: no prefill leg.
    DecodeAloneCached,
    /// No prefill worker could compute the prompt (`on_prefill_failure:
    /// decode_alone`): the decode worker did.
    DecodeAlonePrefillFailed,
}

impl PairPath {
    pub const ALL: [PairPath; 3] = [
        Self::Disaggregated,
        Self::DecodeAloneCached,
        Self::DecodeAlonePrefillFailed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Disaggregated => "prefill_decode",
            Self::DecodeAloneCached => "decode_alone_cached",
            Self::DecodeAlonePrefillFailed => "decode_alone_prefill_failed",
        }
    }
}

/// What became of one leg of a pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LegOutcome {
    /// Its worker answered (a 2xx-4xx head).
    Answered,
    /// It failed before any byte reached the client (refused, 5xx, 429, a
    /// redirect, a broken answer): the pair was booked again, or the request
    /// failed or fell back.
    Failed,
    /// No head within its bound.
    TimedOut,
}

impl LegOutcome {
    pub const ALL: [LegOutcome; 3] = [Self::Answered, Self::Failed, Self::TimedOut];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Answered => "answered",
            Self::Failed => "failed",
            Self::TimedOut => "timed_out",
        }
    }
}

impl PairStats {
    pub fn path(&self, path: PairPath) {
        let at = PairPath::ALL.iter().position(|p| *p == path).unwrap_or(0);
        self.paths[at].fetch_add(1, Ordering::Relaxed);
    }

    /// `prefill`: the prefill leg (else the decode leg).
    pub fn leg(&self, prefill: bool, outcome: LegOutcome) {
        let at = LegOutcome::ALL
            .iter()
            .position(|o| *o == outcome)
            .unwrap_or(0);
        self.legs[usize::from(!prefill)][at].fetch_add(1, Ordering::Relaxed);
    }

    pub fn paths(&self) -> Vec<(PairPath, u64)> {
        PairPath::ALL
            .iter()
            .zip(&self.paths)
            .map(|(p, n)| (*p, n.load(Ordering::Relaxed)))
            .collect()
    }

    /// (leg name, outcome, count) for every leg and outcome.
    pub fn legs(&self) -> Vec<(&'static str, LegOutcome, u64)> {
        let mut out = Vec::new();
        for (leg, counts) in ["prefill", "decode"].into_iter().zip(&self.legs) {
            for (outcome, n) in LegOutcome::ALL.iter().zip(counts) {
                out.push((leg, *outcome, n.load(Ordering::Relaxed)));
            }
        }
        out
    }
}

impl GatewayStats {
    pub fn released(&self, reason: Release) {
        let at = Release::ALL.iter().position(|r| *r == reason).unwrap_or(0);
        self.releases[at].fetch_add(1, Ordering::Relaxed);
    }

    pub fn releases(&self) -> Vec<(Release, u64)> {
        Release::ALL
            .iter()
            .zip(&self.releases)
            .map(|(r, n)| (*r, n.load(Ordering::Relaxed)))
            .collect()
    }

    pub fn undeliverable(&self, engine: Engine) {
        self.undeliverable[engine.index()].fetch_add(1, Ordering::Relaxed);
    }

    pub fn undeliverable_counts(&self) -> Vec<(Engine, u64)> {
        Engine::ALL
            .iter()
            .map(|e| (*e, self.undeliverable[e.index()].load(Ordering::Relaxed)))
            .collect()
    }

    /// A request waited `waited` for its prefix; `settled`: it became
    /// reusable in time.
    pub fn prefix_waited(&self, settled: bool, waited: Duration) {
        self.prefix_waits[usize::from(!settled)].fetch_add(1, Ordering::Relaxed);
        self.prefix_wait_ns
            .fetch_add(waited.as_nanos() as u64, Ordering::Relaxed);
    }

    /// A request sent at once although its prefix was busy: too short to wait for.
    pub fn prefix_too_short(&self) {
        self.prefix_waits[2].fetch_add(1, Ordering::Relaxed);
    }

    /// (settled, timed out, too short to wait for, seconds waited in all).
    pub fn prefix_waits(&self) -> (u64, u64, u64, f64) {
        (
            self.prefix_waits[0].load(Ordering::Relaxed),
            self.prefix_waits[1].load(Ordering::Relaxed),
            self.prefix_waits[2].load(Ordering::Relaxed),
            self.prefix_wait_ns.load(Ordering::Relaxed) as f64 / 1e9,
        )
    }

    pub fn refused(&self, status: u16) {
        *self.refused.lock().entry(status).or_default() += 1;
    }

    pub fn refused_counts(&self) -> BTreeMap<u16, u64> {
        self.refused.lock().clone()
    }

    /// A response head from `worker`: its status, and the times up to it.
    pub fn answered(
        &self,
        model: &str,
        worker: WorkerKey,
        status: u16,
        overhead: Duration,
        tokenize: Duration,
        ttfb: Duration,
    ) {
        let mut timings = self.timings.lock();
        let entry = timings.entry((model.to_string(), worker)).or_default();
        *entry.statuses.entry(status).or_default() += 1;
        entry.overhead.observe(overhead.as_secs_f64());
        entry.tokenize.observe(tokenize.as_secs_f64());
        entry.ttfb.observe(ttfb.as_secs_f64());
    }

    /// A response's end (whatever ended it), `duration` after the request came
    /// (at `received`), with what its bytes said of the generation.
    pub fn ended(
        &self,
        model: &str,
        worker: WorkerKey,
        duration: Duration,
        signals: Option<(&Signals, std::time::Instant)>,
    ) {
        let mut timings = self.timings.lock();
        let entry = timings.entry((model.to_string(), worker)).or_default();
        entry.duration.observe(duration.as_secs_f64());
        if let Some((signals, received)) = signals {
            if let Some(first) = signals.first_content {
                entry
                    .ttft
                    .observe(first.saturating_duration_since(received).as_secs_f64());
            }
            if let Some(gap) = signals.between_tokens() {
                entry.between_tokens.observe(gap);
            }
            if let Some(usage) = signals.usage {
                entry.prompt_tokens += usage.prompt_tokens;
                entry.completion_tokens += usage.completion_tokens;
            }
        }
    }

    pub fn timings(&self) -> Vec<((String, WorkerKey), Timings)> {
        self.timings
            .lock()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }
}
