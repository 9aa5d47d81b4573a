//! Booking for a request: the CPU work of a request on a booking thread.
//!
//! Parse the body once, prepare it (render and tokenize; kept for a retry),
//! book on an eligible worker, credit what the worker will hold (approximate
//! KV, or the in-flight prefix), and splice the adapter's request with the
//! hint. The front door ([`super::proxy`]) and the endpoint picker both book
//! through [`dispatch`], so both book and splice alike.

use super::adapter::{self, HintDelivery, Route};
use super::approximate;
use super::release::ReleaseGuard;
use super::{Allowed, GatewayError, Prepared, RequestPath};
use crate::domain::WorkerKey;
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
}

/// A request's CPU work, on a booking thread: parse the body (unless a retry
/// passes it parsed), prepare it (render and tokenize; `prepared` is reused on
/// a retry), book on an eligible worker not in `tried` and `allowed`, credit
/// what the booked worker will hold, and build the adapter's request with the
/// hint.
pub fn dispatch(
    path: &RequestPath,
    snapshot: &crate::snapshot::Snapshot,
    body: Body,
    attempt: Attempt<'_>,
) -> Result<Booked, GatewayError> {
    let Attempt {
        route,
        request_id,
        tried,
        prepared,
        allowed,
    } = attempt;
    let body = match body {
        Body::Parsed(body) => body,
        Body::Text(text) => Arc::new(
            ParsedBody::parse(text)
                .map_err(|e| GatewayError::bad_request("invalid_json", e.to_string()))?,
        ),
    };
    let parsed = body.body();
    let prepared = match prepared {
        Some(prepared) => prepared,
        None => Arc::new(super::prepare(snapshot, route, &parsed)?),
    };
    let (booking, worker, target) = super::book_eligible(
        &path.router,
        snapshot,
        &path.gateway,
        &prepared,
        request_id,
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
        },
        booking.worker,
        request_id,
        booking.hint.message().map(|m| m.get()),
    );
    drop(parsed);
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
