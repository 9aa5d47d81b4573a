//! Booking for a request: the CPU work of a request on a booking thread.
//!
//! Parse the body once, prepare it (render and tokenize; kept for a retry),
//! book on an eligible worker, credit what the worker will hold (approximate
//! KV, or the in-flight prefix), and splice the adapter's request with the
//! hint. The front door ([`super::proxy`]) and the endpoint picker both book
//! through [`dispatch`], so both book and splice alike.

use super::adapter::{self, Handover, HintDelivery, Route};
use super::approximate;
use super::release::ReleaseGuard;
use super::{Allowed, GatewayError, Prepared, RequestPath};
use crate::domain::{HttpTarget, WorkerKey};
use crate::splice::ParsedBody;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One booking attempt for a request: its route and id, the workers tried
/// already, what an earlier attempt prepared, and the proxy's subset hint.
pub struct Attempt<'a> {
    pub route: Route,
    pub request_id: &'a str,
    pub tried: &'a [WorkerKey],
    pub prepared: Option<Arc<Prepared>>,
    pub allowed: Allowed<'a>,
}

/// A request's body as a booking job gets it: the text, checked UTF-8, on the
/// first attempt; parsed, on a retry.
pub enum Body {
    Text(Arc<str>),
    Parsed(Arc<ParsedBody>),
}

/// What one booking job hands back: the open booking (its guard releases it on
/// every way out), and the request the adapter made for the booked worker.
pub struct Booked {
    pub guard: ReleaseGuard,
    /// The in-flight request on the booked worker whose prompt holds this one's
    /// cached prefix: the request is sent once it settles (see
    /// `gateway::approximate`).
    pub wait_for: Option<Arc<approximate::Gate>>,
    /// The prompt tokens the router found cached on the booked worker.
    pub cached_tokens: usize,
    pub prepared: Arc<Prepared>,
    /// The body, parsed once: a retry books and splices it again unparsed.
    pub body: Arc<ParsedBody>,
    pub worker: WorkerKey,
    pub base: Arc<str>,
    /// The worker's `host:port`.
    pub authority: Arc<str>,
    pub engine: crate::domain::Engine,
    pub forward: adapter::Forward,
    /// The worker's API key, if its server asks for one.
    pub api_key: Option<crate::domain::ApiKey>,
    pub target: Arc<HttpTarget>,
    /// The booking's hint message, for a leg whose request is built again
    /// (vLLM's decode leg, once the prefill has answered).
    pub hint: Option<Box<serde_json::value::RawValue>>,
}

/// A request's CPU work, on a booking thread: parse the body (unless a retry
/// passes it parsed), prepare it (render and tokenize; `prepared` is reused on
/// a retry), book on an eligible worker not in `tried` and `allowed`, credit
/// what the booked worker will hold, and build the adapter's request with the
/// hint. A disaggregated model, which needs two bookings, is refused: the
/// front door books its pairs itself (`proxy`, `pair`).
pub fn dispatch(
    path: &RequestPath,
    snapshot: &crate::snapshot::Snapshot,
    body: Body,
    attempt: Attempt<'_>,
) -> Result<Booked, GatewayError> {
    let (body, prepared) = read(snapshot, body, attempt.route, attempt.prepared.clone())?;
    if prepared.model.disaggregation.is_some() {
        return Err(GatewayError::bad_request(
            "disaggregated_model",
            format!(
                "model {} is disaggregated (prefill and decode on two workers); the endpoint picker names one worker per request: serve it through kvhint's gateway",
                prepared.model.name
            ),
        )
        .at("model"));
    }
    book_one(path, snapshot, body, prepared, attempt)
}

/// The body parsed (once: a retry passes it parsed) and prepared (rendered and
/// tokenized once: a retry passes it prepared).
pub fn read(
    snapshot: &crate::snapshot::Snapshot,
    body: Body,
    route: Route,
    prepared: Option<Arc<Prepared>>,
) -> Result<(Arc<ParsedBody>, Arc<Prepared>), GatewayError> {
    let body = match body {
        Body::Parsed(body) => body,
        Body::Text(text) => Arc::new(
            ParsedBody::parse(text)
                .map_err(|e| GatewayError::bad_request("invalid_json", e.to_string()))?,
        ),
    };
    let prepared = match prepared {
        Some(prepared) => prepared,
        None => Arc::new(super::prepare(snapshot, route, &body.body())?),
    };
    Ok((body, prepared))
}

pub fn book_one(
    path: &RequestPath,
    snapshot: &crate::snapshot::Snapshot,
    body: Arc<ParsedBody>,
    prepared: Arc<Prepared>,
    attempt: Attempt<'_>,
) -> Result<Booked, GatewayError> {
    let leg = Leg {
        route: attempt.route,
        book_as: super::BookAs {
            request_id: attempt.request_id,
            role: prepared.model.role,
            receive_from: None,
        },
        tried: attempt.tried,
        allowed: attempt.allowed,
        handover: HandoverPlan::Whole,
    };
    book_leg(path, snapshot, body, prepared, leg)
}

/// How a leg's request takes part in its pair's hand-over (the fields it
/// needs come from the worker booked for it, or for the other leg).
#[derive(Debug, Clone, Copy)]
pub enum HandoverPlan<'a> {
    /// Not a leg of a pair.
    Whole,
    /// SGLang's prefill leg: its own bootstrap server, this room.
    SglangPrefill { room: u64 },
    /// SGLang's decode leg: the prefill worker's bootstrap server and rank.
    SglangDecode {
        prefill: &'a HttpTarget,
        prefill_dp_rank: u32,
        room: u64,
    },
    /// vLLM's prefill leg.
    VllmPrefill,
}

impl<'a> HandoverPlan<'a> {
    /// The adapter's hand-over for the worker booked (`target`, `key`).
    fn handover(self, target: &'a HttpTarget, key: WorkerKey) -> Option<Handover<'a>> {
        match self {
            Self::Whole => None,
            Self::SglangPrefill { room } => Some(Handover::Sglang {
                prefill: true,
                host: target.host(),
                port: target.bootstrap_port,
                room,
                prefill_dp_rank: key.dp_rank,
            }),
            Self::SglangDecode {
                prefill,
                prefill_dp_rank,
                room,
            } => Some(Handover::Sglang {
                prefill: false,
                host: prefill.host(),
                port: prefill.bootstrap_port,
                room,
                prefill_dp_rank,
            }),
            Self::VllmPrefill => Some(Handover::VllmPrefill),
        }
    }
}

/// One booking of a request: on which role, as which request id, among which
/// workers, and what its engine's hand-over needs in the body.
pub struct Leg<'a> {
    pub route: Route,
    pub book_as: super::BookAs<'a>,
    pub tried: &'a [WorkerKey],
    pub allowed: Allowed<'a>,
    pub handover: HandoverPlan<'a>,
}

/// Books one leg: an eligible worker, the guard that releases it, the credit
/// of what the worker will hold, and the adapter's request with the hint.
pub fn book_leg(
    path: &RequestPath,
    snapshot: &crate::snapshot::Snapshot,
    body: Arc<ParsedBody>,
    prepared: Arc<Prepared>,
    leg: Leg<'_>,
) -> Result<Booked, GatewayError> {
    let Leg {
        route,
        book_as,
        tried,
        allowed,
        handover,
    } = leg;
    let request_id = book_as.request_id;
    let parsed = body.body();
    let (booking, worker, target) = super::book_eligible(
        &path.router,
        snapshot,
        &path.gateway,
        &prepared,
        book_as,
        tried,
        allowed,
    )?;
    // The guard exists from the moment the booking does: if the caller left
    // while this job ran, the reply is dropped unread and the guard with it,
    // which releases the booking.
    let mut guard = ReleaseGuard::new(
        Arc::clone(&path.router),
        Arc::clone(&path.gateway.stats),
        request_id.to_string(),
    );
    (path.on_booked)(&booking);
    let mut wait_for = None;
    let prompt = approximate::Prompt {
        token_ids: &prepared.token_ids,
        block_size: snapshot.block_size,
        lora: prepared.model.lora.as_deref(),
        salt: prepared.cache_salt.as_deref(),
        cached_blocks: booking.cached_blocks,
    };
    let credit = if worker.approximate_kv {
        Some(path.gateway.approximate.credit(
            &path.ingest,
            booking.worker,
            &prompt,
            snapshot.gateway.approximate_max_blocks,
            approximate::settles(target.engine),
        ))
    } else if snapshot.gateway.credit_in_flight {
        Some(path.gateway.approximate.in_flight(
            &path.ingest,
            booking.worker,
            path.router.load_cell(booking.worker),
            &prompt,
            approximate::settles(target.engine),
        ))
    } else {
        None
    };
    if let Some(credit) = credit {
        wait_for = credit.wait_for.clone();
        guard.hold(credit);
    }
    let forward = adapter::build_forward(
        &target,
        route,
        &parsed,
        &adapter::Prompt {
            token_ids: &prepared.token_ids,
            handover: handover.handover(&target, booking.worker),
        },
        booking.worker,
        request_id,
        booking.hint.message().map(|m| m.get()),
    );
    drop(parsed);
    // Moved out of the booking, not copied: no allocation per request.
    let hint = match booking.hint {
        crate::hints::Hint::Sent { message, .. } => Some(message),
        crate::hints::Hint::Skipped(_) => None,
    };
    Ok(Booked {
        guard,
        wait_for,
        cached_tokens: booking.cached_blocks * snapshot.block_size,
        prepared,
        body,
        worker: booking.worker,
        base: Arc::clone(&target.base),
        authority: Arc::clone(&target.authority),
        engine: target.engine,
        forward,
        api_key: target.api_key.clone(),
        target,
        hint,
    })
}

/// Counts what became of a booking's hint on its way to the engine.
pub fn count_hint(
    gateway: &super::Gateway,
    forward: &adapter::Forward,
    engine: crate::domain::Engine,
) {
    match forward.hint {
        HintDelivery::Delivered => {
            gateway
                .stats
                .hints_delivered
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        HintDelivery::Undeliverable => gateway.stats.undeliverable(engine),
        HintDelivery::None => {}
    }
}

/// Waits, at most `gateway.prefix_wait_ms`, for the in-flight request whose
/// prompt holds this one's prefix (`cached_tokens` long) to settle, so this one
/// finds it reusable rather than computing it again beside it; counted either
/// way. Whether it settled.
///
/// A prefix shorter than `gateway.prefix_wait_min_tokens` is not waited for:
/// the wait lasts until the holder settles (on llama.cpp, until it has ended,
/// its whole answer generated), while computing a short prefix again costs a
/// few milliseconds; a common short system prompt would otherwise let one
/// request at a time through to each worker.
pub async fn wait_for_prefix(
    gateway: &super::Gateway,
    gate: &approximate::Gate,
    cached_tokens: usize,
    settings: &crate::config::GatewayConfig,
) -> bool {
    if settings.prefix_wait_ms == 0 {
        return gate.is_open();
    }
    if (cached_tokens as u64) < settings.prefix_wait_min_tokens {
        let settled = gate.is_open();
        if !settled {
            gateway.stats.prefix_too_short();
        }
        return settled;
    }
    let started = Instant::now();
    let bound = Duration::from_millis(settings.prefix_wait_ms);
    let settled = tokio::time::timeout(bound, gate.opened()).await.is_ok();
    gateway.stats.prefix_waited(settled, started.elapsed());
    settled
}
