//! The front door's figures (`gateway::stats`): what ended each request, retries,
//! hints delivered, upstream statuses and latency histograms per (model, worker),
//! each model's tokenizer cache, and which workers the gateway sends to now.

use super::{counter, counters, gauges, histograms, ConstHistogram, WorkerLabels};
use crate::gateway::stats::{Histogram, Timings, BUCKETS};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// The front door's counters, and what it reads of the fleet at scrape time.
pub struct GatewayCollector {
    pub stats: Arc<crate::gateway::stats::GatewayStats>,
    pub predictions: Arc<crate::gateway::approximate::PredictionStats>,
    pub in_flight_blocks: usize,
    /// The serving snapshot, for its models' tokenizer caches.
    pub snapshot: Arc<crate::snapshot::Snapshot>,
    /// Each worker with an HTTP endpoint, and whether the gateway sends to it now.
    pub workers_up: Vec<(crate::domain::WorkerKey, bool)>,
}

super::debug_as_name!(GatewayCollector);

type Pick = fn(&Timings) -> &Histogram;

/// The latency histograms per (model, worker): name, help, which.
const HISTOGRAMS: [(&str, &str, Pick); 6] = [
    (
        "kvhint_gateway_ttfb_seconds",
        "Request received to the worker's response head.",
        |t| &t.ttfb,
    ),
    (
        "kvhint_gateway_duration_seconds",
        "Request received to the response's end.",
        |t| &t.duration,
    ),
    (
        "kvhint_gateway_overhead_seconds",
        "Request received to the request sent to the worker (tokenization included).",
        |t| &t.overhead,
    ),
    (
        "kvhint_gateway_tokenize_seconds",
        "Rendering and tokenizing the prompt.",
        |t| &t.tokenize,
    ),
    (
        "kvhint_gateway_ttft_seconds",
        "Request received to the first token: a stream's first SSE event with content, a non-streaming answer's first byte.",
        |t| &t.ttft,
    ),
    (
        "kvhint_gateway_time_between_tokens_seconds",
        "A stream's mean time between content events after the first (one per request).",
        |t| &t.between_tokens,
    ),
];

fn histogram(h: &Histogram) -> ConstHistogram {
    ConstHistogram::from_cumulative(&BUCKETS, &h.buckets, h.count, h.sum)
}

impl Collector for GatewayCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        let e = &mut encoder;
        let stats = &self.stats;
        counters(
            e,
            "kvhint_gateway_releases",
            "Bookings the gateway released, by what ended the request.",
            stats
                .releases()
                .into_iter()
                .map(|(reason, n)| ([("reason", reason.as_str())], n)),
        )?;
        counter(
            e,
            "kvhint_gateway_retries",
            "Requests booked again on another worker before any byte reached the client.",
            stats.retries.load(Ordering::Relaxed),
        )?;
        let predictions = &self.predictions;
        counters(
            e,
            "kvhint_approximate_predictions",
            "Answers from approximate workers, by how the engine's count of reused prompt tokens compared with the prefix the router credited: held, phantom (the engine had dropped blocks still credited), unseen (it kept blocks no longer credited), speculative (sent while its prefix was busy).",
            crate::gateway::approximate::Prediction::ALL
                .iter()
                .map(|p| ([("outcome", p.as_str())], predictions.count(*p))),
        )?;
        let (settled, timed_out, short, waited) = stats.prefix_waits();
        counters(
            e,
            "kvhint_gateway_prefix_waits",
            "Requests whose prefix an in-flight request on the same worker was still computing: waited until it became reusable (settled), waited gateway.prefix_wait_ms in vain (timed_out), or sent at once, the prefix being shorter than gateway.prefix_wait_min_tokens (short).",
            [
                ([("outcome", "settled")], settled),
                ([("outcome", "timed_out")], timed_out),
                ([("outcome", "short")], short),
            ],
        )?;
        super::gauge(
            e,
            "kvhint_gateway_in_flight_blocks",
            "Blocks of workers with KV events credited to the requests they are running (gateway.credit_in_flight), over every worker: in the index until the last request holding each ends.",
            self.in_flight_blocks as f64,
        )?;
        super::float_counter(
            e,
            "kvhint_gateway_prefix_wait_seconds",
            "Time requests spent waiting for the in-flight request holding their prefix.",
            waited,
        )?;
        counters(
            e,
            "kvhint_gateway_disaggregated",
            "Attempts at serving requests for disaggregated models (a pair booked again after a failed leg counts again), by how: a prefill leg and a decode leg (prefill_decode), the decode worker alone because it held all but decode_alone_within_tokens of the prompt (decode_alone_cached), or alone because no prefill worker could compute it (decode_alone_prefill_failed).",
            stats
                .pairs
                .paths()
                .into_iter()
                .map(|(p, n)| ([("path", p.as_str())], n)),
        )?;
        counters(
            e,
            "kvhint_gateway_pair_legs",
            "Legs of disaggregated pairs sent to a worker, by leg (prefill, decode) and what came of the head: answered, failed (refused, 5xx, 429, a redirect: the pair is booked again or the request falls back), timed_out.",
            stats
                .pairs
                .legs()
                .into_iter()
                .map(|(leg, outcome, n)| ([("leg", leg), ("outcome", outcome.as_str())], n)),
        )?;
        counter(
            e,
            "kvhint_gateway_kv_not_transferred",
            "Disaggregated requests whose prefill engine answered that no KV would be handed over (vLLM: no kv_transfer_params in its answer): the decode worker computed the prompt itself.",
            stats.pairs.not_transferred.load(Ordering::Relaxed),
        )?;
        counter(
            e,
            "kvhint_gateway_resent",
            "Requests re-sent on a fresh connection to the same worker: the pooled connection they were written on had been closed by the worker (no byte of an answer came). Not the worker's failure, not a retry.",
            stats.resent.load(Ordering::Relaxed),
        )?;
        counter(
            e,
            "kvhint_hints_delivered",
            "Hint messages forwarded in the engine's own field.",
            stats.hints_delivered.load(Ordering::Relaxed),
        )?;
        counters(
            e,
            "kvhint_hints_undeliverable",
            "Hint messages not sent because the booked engine takes none on that route.",
            stats
                .undeliverable_counts()
                .into_iter()
                .map(|(engine, n)| ([("engine", engine.to_string())], n)),
        )?;
        counters(
            e,
            "kvhint_gateway_refused",
            "Requests the router answered itself, by status (no worker answered them).",
            stats
                .refused_counts()
                .into_iter()
                .map(|(status, n)| ([("status", status)], n)),
        )?;
        let timings = stats.timings();
        let by_worker =
            |model: &str, worker| ([("model", model.to_string())], WorkerLabels(worker));
        counters(
            e,
            "kvhint_gateway_upstream_responses",
            "Response heads from workers, by model, worker and status.",
            timings.iter().flat_map(|((model, worker), t)| {
                t.statuses.iter().map(move |(status, n)| {
                    ((by_worker(model, *worker), [("status", *status)]), *n)
                })
            }),
        )?;
        counters(
            e,
            "kvhint_gateway_prompt_tokens",
            "Prompt tokens, from the engine's usage (non-streaming answers, and streams that asked for stream_options.include_usage).",
            timings
                .iter()
                .map(|((model, worker), t)| (by_worker(model, *worker), t.prompt_tokens)),
        )?;
        counters(
            e,
            "kvhint_gateway_completion_tokens",
            "Completion tokens, from the engine's usage (as prompt tokens).",
            timings
                .iter()
                .map(|((model, worker), t)| (by_worker(model, *worker), t.completion_tokens)),
        )?;
        for (name, help, pick) in HISTOGRAMS {
            histograms(
                e,
                name,
                help,
                timings
                    .iter()
                    .map(|((model, worker), t)| (by_worker(model, *worker), histogram(pick(t)))),
            )?;
        }
        tokenizer_cache(e, &self.snapshot.models)?;
        gauges(
            e,
            "kvhint_gateway_worker_up",
            "1 if the gateway sends requests to the worker now (healthy, circuit not open).",
            self.workers_up
                .iter()
                .map(|(key, up)| (WorkerLabels(*key), if *up { 1.0 } else { 0.0 })),
        )
    }
}

/// Each model's cache of tokenized prompt pieces: what it found and what it had to
/// encode (pieces and bytes of text), and what it holds. A model whose tokenizer
/// cannot be cut into pieces exactly has none, and no samples here.
fn tokenizer_cache(e: &mut DescriptorEncoder, models: &crate::models::Models) -> fmt::Result {
    let caches: Vec<_> = models
        .names()
        .iter()
        .filter_map(|name| {
            let model = models.get(name)?;
            let (stats, entries, held) = model.tokenizer.piece_cache().ok()?;
            Some((name.to_string(), stats, entries, held))
        })
        .collect();
    let by_result = |pick: fn(&crate::models::PieceStats, bool) -> u64| {
        caches.iter().flat_map(move |(model, stats, _, _)| {
            [("hit", true), ("miss", false)].map(|(result, hit)| {
                (
                    [("model", model.as_str()), ("result", result)],
                    pick(stats, hit),
                )
            })
        })
    };
    counters(
        e,
        "kvhint_tokenizer_cache_pieces",
        "Prompt pieces (text between special tokens) found in the tokenizer cache (hit) or encoded (miss).",
        by_result(|s, hit| if hit { s.hits } else { s.misses }),
    )?;
    counters(
        e,
        "kvhint_tokenizer_cache_text_bytes",
        "Bytes of prompt text whose ids came from the tokenizer cache (hit) or were encoded (miss).",
        by_result(|s, hit| if hit { s.hit_bytes } else { s.miss_bytes }),
    )?;
    gauges(
        e,
        "kvhint_tokenizer_cache_entries",
        "Pieces the tokenizer cache holds.",
        caches
            .iter()
            .map(|(model, _, entries, _)| ([("model", model.as_str())], *entries as f64)),
    )?;
    gauges(
        e,
        "kvhint_tokenizer_cache_bytes",
        "What the tokenizer cache holds, in bytes (gateway.tokenizer_cache_mib bounds it).",
        caches
            .iter()
            .map(|(model, _, _, held)| ([("model", model.as_str())], *held as f64)),
    )
}
