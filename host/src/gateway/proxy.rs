//! The attempt loop: a request booked, sent to its worker, and booked again on
//! another worker when the first failed before any byte reached the client (a
//! refused connection, a 429 or 5xx, a redirect); the answer streamed back
//! under the idle and request deadlines, its booking released on every way
//! out. What the handler gets is the worker's response, or the error to answer
//! with.

use super::adapter::Route;
use super::dispatch::{count_hint, wait_for_prefix, Attempt, Body, Booked};
use super::release::ReleaseGuard;
use super::send::{local_shortage, respond, send, Answered, Sent};
use super::stats::Release;
use super::{GatewayError, Prepared, RequestPath};
use crate::domain::WorkerKey;
use crate::logging::with_causes;
use crate::splice::ParsedBody;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use bytes::Bytes;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Sends a request to a worker booked for it, and books again on another
/// worker while the one tried failed before any byte reached the client; the
/// worker's response (its body released on every way out), or the error the
/// router answers with itself. The trace, if traced, ends either way.
pub async fn proxy(
    path: &RequestPath,
    route: Route,
    headers: &HeaderMap,
    body: Bytes,
    received: Instant,
    request_id: &str,
) -> Result<Response, GatewayError> {
    let mut trace = path
        .gateway
        .tracing
        .as_ref()
        .and_then(|t| t.request(headers, route.as_str(), received));
    let result = attempts(path, route, headers, body, received, request_id, &mut trace).await;
    if let (Err(error), Some(trace)) = (&result, trace) {
        trace.finish(
            Instant::now(),
            "answered_by_router",
            error.status.as_u16(),
            None,
            None,
        );
    }
    result
}

async fn attempts(
    path: &RequestPath,
    route: Route,
    headers: &HeaderMap,
    body: Bytes,
    received: Instant,
    request_id: &str,
    trace: &mut Option<super::trace::RequestTrace>,
) -> Result<Response, GatewayError> {
    if let Some(looped) = path.gateway.looped(headers) {
        return Err(looped);
    }
    // Checked once here; parsed once, by the first booking job (a retry books
    // with what it parsed).
    let text: Arc<str> = std::str::from_utf8(&body)
        .map_err(|_| GatewayError::not_utf8())?
        .into();
    let mut parsed: Option<Arc<ParsedBody>> = None;
    let snapshot = path.snapshot.load_full();
    let settings = snapshot.gateway.clone();
    let idle = Duration::from_millis(settings.idle_timeout_ms);
    let deadline = (settings.request_timeout_ms > 0)
        .then(|| received + Duration::from_millis(settings.request_timeout_ms));
    let request_id = request_id.to_string();
    let mut tried: Vec<WorkerKey> = Vec::new();
    let mut prepared: Option<Arc<Prepared>> = None;
    let mut backoff = Duration::from_millis(settings.retry_backoff_ms);
    let mut attempt = 0;
    // What the last worker tried did wrong: the answer when no other worker is
    // left to try (a 502 that says what failed, not a 503 that says none was
    // there).
    let mut last_failure: Option<GatewayError> = None;
    loop {
        attempt += 1;
        let last_attempt = attempt >= settings.max_attempts;
        let body = match &parsed {
            Some(parsed) => Body::Parsed(Arc::clone(parsed)),
            None => Body::Text(Arc::clone(&text)),
        };
        let job = {
            let path = path.clone();
            let snapshot = Arc::clone(&snapshot);
            let request_id = request_id.clone();
            let tried = tried.clone();
            let prepared = prepared.clone();
            move || {
                let started = Instant::now();
                let attempt = Attempt {
                    route,
                    request_id: &request_id,
                    tried: &tried,
                    prepared,
                    allowed: None,
                };
                let booked = dispatch_request(&path, &snapshot, body, attempt);
                (started, booked)
            }
        };
        let (job_started, booked) = path.bookings.run(job).await?;
        let booked = match booked {
            Ok(Dispatched::One(booked)) => booked,
            Ok(Dispatched::Pair(pair)) => {
                let request = super::disaggregated::Request {
                    route,
                    headers,
                    received,
                    request_id: &request_id,
                    job_started,
                };
                return super::disaggregated::serve(path, &snapshot, request, *pair, trace).await;
            }
            Err(error) if error.code == super::error::NO_WORKERS.openai.code => {
                return Err(last_failure.take().unwrap_or(error));
            }
            Err(error) => return Err(error),
        };
        if let Some(trace) = trace.as_mut() {
            trace.booked(
                job_started,
                booked.prepared.tokenize,
                Instant::now(),
                booked.worker,
            );
        }
        // The booking is open: the guard releases it on every way out, this
        // future being dropped (the client left) included.
        let Booked {
            mut guard,
            wait_for,
            cached_tokens,
            prepared: this_prepared,
            body: this_body,
            worker,
            base,
            engine,
            forward,
            api_key,
            ..
        } = booked;
        parsed = Some(this_body);
        if let Some(gate) = wait_for {
            if !wait_for_prefix(&path.gateway, &gate, cached_tokens, &settings).await {
                guard.sent_while_busy();
            }
        }
        let booked = Sent {
            prepared: this_prepared,
            worker,
            base,
            engine,
            forward,
            api_key,
        };
        prepared = Some(Arc::clone(&booked.prepared));
        count_hint(&path.gateway, &booked.forward, booked.engine);
        let sent = Instant::now();
        // A stream's head comes at once (bytes follow as tokens do), so silence
        // before it is the idle bound's; a non-streaming engine sends nothing
        // until the whole answer is ready, which may take minutes.
        let (for_head, head_bound) = if booked.prepared.stream {
            (idle, "gateway.idle_timeout_ms")
        } else {
            (
                Duration::from_millis(settings.response_timeout_ms),
                "gateway.response_timeout_ms",
            )
        };
        let waited = match deadline {
            Some(at) => for_head.min(at.saturating_duration_since(sent)),
            None => for_head,
        };
        let traceparent = trace.as_mut().and_then(|t| t.sending(sent));
        let answer = send(
            &path.gateway,
            &booked,
            headers,
            sent + waited,
            &request_id,
            traceparent.as_ref(),
        )
        .await?;
        let key = booked.worker;
        let retry = |guard: &mut ReleaseGuard, tried: &mut Vec<WorkerKey>| {
            guard.finish(Release::Retried);
            tried.push(key);
            path.gateway
                .stats
                .retries
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        };
        let response = match answer {
            Err(_) => {
                let past_deadline = deadline.is_some_and(|at| Instant::now() >= at);
                let (release, code, bound) = if past_deadline {
                    (Release::Deadline, "deadline", "gateway.request_timeout_ms")
                } else if booked.prepared.stream {
                    (Release::IdleTimeout, "idle_timeout", head_bound)
                } else {
                    (Release::ResponseTimeout, "response_timeout", head_bound)
                };
                guard.finish(release);
                // A worker that passes its health checks is busy, not broken: a
                // long generation must not take it out of rotation.
                path.gateway.health.timed_out(
                    key,
                    settings.circuit_failures,
                    settings.circuit_open_ms,
                    format!("it sent no response head within {} ms", waited.as_millis()),
                );
                return Err(GatewayError::new(
                    StatusCode::GATEWAY_TIMEOUT,
                    "timeout_error",
                    code,
                    format!(
                        "{key} sent no response within {} ms ({bound}); raise it for longer generations",
                        waited.as_millis(),
                    ),
                ));
            }
            Ok(Err(error)) => {
                let why = with_causes(&error);
                if let Some(shortage) = local_shortage(&error) {
                    // The router's own shortage, not the worker's failure: no
                    // circuit opens, no other worker is tried (it would meet
                    // the same shortage).
                    tracing::warn!(request_id = %request_id, worker = %key, error = %why, "the router could not open a connection to the worker: it is short of descriptors or memory");
                    guard.finish(Release::UpstreamError);
                    return Err(GatewayError::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "server_error",
                        "router_out_of_resources",
                        format!("the router could not open a connection to {key}: {shortage}; the router is short of file descriptors or memory, {key} is not at fault (raise `ulimit -n`, or lower --max-connections)"),
                    ));
                }
                if error.is_connect() {
                    path.gateway
                        .health
                        .refused(key, settings.circuit_open_ms, why.clone());
                } else {
                    path.gateway.health.request_failed(
                        key,
                        settings.circuit_failures,
                        settings.circuit_open_ms,
                        why.clone(),
                    );
                }
                let failure = GatewayError::new(
                    StatusCode::BAD_GATEWAY,
                    "upstream_error",
                    "upstream_unreachable",
                    format!("{key} could not be reached: {why}"),
                );
                if !last_attempt {
                    tracing::warn!(request_id = %request_id, worker = %key, error = %why, attempt, "the request failed before any byte reached the client; booking it again on another worker");
                    if let Some(trace) = trace.as_mut() {
                        trace.retried(key, &why);
                    }
                    retry(&mut guard, &mut tried);
                    last_failure = Some(failure);
                    tokio::time::sleep(backoff).await;
                    backoff = backoff.mul_f32(1.5);
                    continue;
                }
                guard.finish(Release::UpstreamError);
                return Err(failure);
            }
            Ok(Ok(response)) => response,
        };
        let status = response.status();
        // A redirect is a failure too, never passed on: OpenAI's clients follow
        // them, with the client's request, to whatever host the worker names.
        let redirect = status.is_redirection();
        if redirect || status == StatusCode::TOO_MANY_REQUESTS || status.is_server_error() {
            let why = if redirect {
                format!("it answered {status}, a redirect")
            } else {
                format!("it answered {status}")
            };
            path.gateway.health.request_failed(
                key,
                settings.circuit_failures,
                settings.circuit_open_ms,
                why.clone(),
            );
            let failure = if redirect {
                GatewayError::new(
                    StatusCode::BAD_GATEWAY,
                    "upstream_error",
                    "upstream_redirect",
                    format!("{key} answered {status}, a redirect, which the router never passes on; point its http_endpoint at the server that answers"),
                )
            } else {
                GatewayError::new(
                    StatusCode::BAD_GATEWAY,
                    "upstream_error",
                    "upstream_status",
                    format!("{key} answered {status}"),
                )
            };
            if !last_attempt {
                if let Some(trace) = trace.as_mut() {
                    trace.retried(key, &why);
                }
                retry(&mut guard, &mut tried);
                drop(response);
                last_failure = Some(failure);
                tokio::time::sleep(backoff).await;
                backoff = backoff.mul_f32(1.5);
                continue;
            }
            if redirect {
                guard.finish(Release::UpstreamError);
                return Err(failure);
            }
        } else {
            path.gateway.health.request_succeeded(key);
        }
        let answered = Answered {
            status,
            sent,
            received,
            cached_tokens,
            idle,
            deadline,
            also_on_end: None,
        };
        return Ok(respond(
            path,
            &booked,
            guard,
            response,
            answered,
            &request_id,
            trace.take(),
        ));
    }
}

/// What a booking job made of a request: one booking, or the two legs of a
/// disaggregated pair (`super::disaggregated`).
// One booking is every request's answer and stays unboxed (no allocation on
// the hot path); a pair, rarer and twice the size, is boxed.
#[allow(clippy::large_enum_variant)]
enum Dispatched {
    One(Booked),
    Pair(Box<super::pair::Pair>),
}

/// A request's CPU work, on a booking thread: parse the body (unless a retry
/// passes it parsed), prepare it (render and tokenize; `prepared` is reused on
/// a retry), book on an eligible worker not in `tried` and `allowed`, credit
/// what the booked worker will hold, and build the adapter's request with the
/// hint. A disaggregated model books its two legs ([`Dispatched::Pair`]).
fn dispatch_request(
    path: &RequestPath,
    snapshot: &crate::snapshot::Snapshot,
    body: Body,
    attempt: Attempt<'_>,
) -> Result<Dispatched, GatewayError> {
    let (body, prepared) =
        super::dispatch::read(snapshot, body, attempt.route, attempt.prepared.clone())?;
    if let Some(disaggregation) = prepared.model.disaggregation.as_ref() {
        let pair = super::pair::book_pair(
            path,
            snapshot,
            disaggregation,
            &body,
            &prepared,
            super::pair::Tried {
                request_id: attempt.request_id,
                prefill: &[],
                decode: attempt.tried,
                prefill_exhausted: false,
            },
        )?;
        return Ok(Dispatched::Pair(Box::new(pair)));
    }
    super::dispatch::book_one(path, snapshot, body, prepared, attempt).map(Dispatched::One)
}
