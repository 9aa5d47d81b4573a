//! The attempt loop: a request booked, sent to its worker, and booked again on
//! another worker when the first failed before any byte reached the client (a
//! refused connection, a 429 or 5xx, a redirect); the answer streamed back
//! under the idle and request deadlines, its booking released on every way
//! out. What the handler gets is the worker's response, or the error to answer
//! with.

use super::adapter::{self, Route};
use super::dispatch::{
    count_hint, dispatch_request, wait_for_prefix, Attempt, Body, Booked, Dispatched,
};
use super::release::{GuardedBody, OnEnd, ReleaseGuard};
use super::signals::Signals;
use super::stats::Release;
use super::{GatewayError, Prepared, RequestPath};
use crate::domain::WorkerKey;
use crate::logging::with_causes;
use crate::splice::ParsedBody;
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::Response;
use bytes::Bytes;
use http_body_util::Full;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Request headers passed to the worker; every other one (the client's
/// `Authorization` first) stays here.
const FORWARDED: &[&str] = &[
    "accept",
    "traceparent",
    "tracestate",
    "baggage",
    "user-agent",
];

/// Response headers that describe one hop, not the response.
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// A booking's request on its way to the worker.
pub(super) struct Sent {
    pub prepared: Arc<Prepared>,
    pub worker: WorkerKey,
    pub base: Arc<str>,
    pub engine: crate::domain::Engine,
    pub forward: adapter::Forward,
    pub api_key: Option<crate::domain::ApiKey>,
}

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

/// A worker's answer as the attempt loop took it: the head's status, when the
/// request was sent and received, what the router found cached, the stream's
/// bounds, and what else runs when the response ends (a disaggregated pair's
/// prefill leg).
pub(super) struct Answered {
    pub status: StatusCode,
    pub sent: Instant,
    pub received: Instant,
    pub cached_tokens: usize,
    pub idle: Duration,
    pub deadline: Option<Instant>,
    pub also_on_end: Option<Box<dyn FnOnce(Release) + Send + Sync>>,
}

/// The client's response from a worker's head: its body streamed under the
/// idle and request bounds, owning the booking's guard; counted, traced and
/// logged when it ends; the worker's headers passed on but this hop's.
pub(super) fn respond(
    path: &RequestPath,
    booked: &Sent,
    guard: ReleaseGuard,
    response: hyper::Response<hyper::body::Incoming>,
    answered: Answered,
    request_id: &str,
    trace: Option<super::trace::RequestTrace>,
) -> Response {
    let Answered {
        status,
        sent,
        received,
        cached_tokens,
        idle,
        deadline,
        also_on_end,
    } = answered;
    let key = booked.worker;
    let now = Instant::now();
    let prepared = &booked.prepared;
    path.gateway.stats.answered(
        &prepared.model.name,
        key,
        status.as_u16(),
        sent.saturating_duration_since(received),
        prepared.tokenize,
        now.saturating_duration_since(received),
    );
    let mut trace = trace;
    if let Some(trace) = trace.as_mut() {
        trace.head(now, status.as_u16());
    }
    let (parts, incoming) = response.into_parts();
    let stats = Arc::clone(&path.gateway.stats);
    let model = prepared.model.name.clone();
    let log_id = request_id.to_string();
    let on_end: OnEnd = Box::new(
        move |reason: Release, duration: Duration, signals: &Signals| {
            if let Some(also) = also_on_end {
                also(reason);
            }
            stats.ended(&model, key, duration, Some((signals, received)));
            if let Some(trace) = trace {
                trace.finish(
                    received + duration,
                    reason.as_str(),
                    status.as_u16(),
                    signals.first_content,
                    signals
                        .usage
                        .map(|u| (u.prompt_tokens, u.completion_tokens)),
                );
            }
            let since = |at: Option<Instant>| {
                at.map(|at| at.saturating_duration_since(received).as_secs_f64() * 1e3)
            };
            tracing::info!(
                target: "kvhint::access",
                request_id = %log_id,
                model = %model,
                worker = key.worker_id,
                dp_rank = key.dp_rank,
                status = status.as_u16(),
                ttfb_ms = now.saturating_duration_since(received).as_secs_f64() * 1e3,
                ttft_ms = since(signals.first_content),
                duration_ms = duration.as_secs_f64() * 1e3,
                prompt_tokens = signals.usage.map(|u| u.prompt_tokens),
                completion_tokens = signals.usage.map(|u| u.completion_tokens),
                end = reason.as_str(),
                "request"
            );
        },
    );
    let body = GuardedBody::new(
        incoming,
        guard,
        idle,
        deadline,
        received,
        prepared.stream,
        on_end,
    );
    let mut out = Response::new(axum::body::Body::new(body));
    *out.status_mut() = status;
    // Headers the worker names in `Connection` are this hop's too (RFC
    // 9110 §7.6.1). A message sent chunked has no length to pass on: a
    // Content-Length beside Transfer-Encoding is dropped (RFC 9112 §6.3),
    // or the client would read that many bytes as the whole answer.
    let named: Vec<HeaderName> = parts
        .headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|token| HeaderName::from_bytes(token.trim().as_bytes()).ok())
        .collect();
    let chunked = parts.headers.contains_key(header::TRANSFER_ENCODING);
    for (name, value) in &parts.headers {
        let framing = chunked && name == header::CONTENT_LENGTH;
        if !HOP_BY_HOP.contains(&name.as_str()) && !named.contains(name) && !framing {
            out.headers_mut().append(name.clone(), value.clone());
        }
    }
    let worker = format!("{} {}", key.worker_id, key.dp_rank);
    if let Ok(value) = HeaderValue::from_str(&worker) {
        out.headers_mut().insert("x-kvhint-worker", value);
    }
    if let Ok(value) = HeaderValue::from_str(request_id) {
        out.headers_mut().insert("x-kvhint-request-id", value);
    }
    out.headers_mut()
        .insert("x-kvhint-cached-tokens", HeaderValue::from(cached_tokens));
    out
}

/// What became of a request sent to its worker: its head, a failure, or no
/// head in time.
pub(super) type Answer = Result<
    Result<hyper::Response<hyper::body::Incoming>, hyper_util::client::legacy::Error>,
    tokio::time::error::Elapsed,
>;

/// Sends the booked request on a pooled connection and waits for its head
/// until `until`. A pooled connection the worker had closed while it sat idle
/// (the request written on it got no byte of an answer: the worker's close
/// crossed it) is not the worker's failure: the request is re-sent once, on a
/// fresh connection to the same worker, and counted in
/// `kvhint_gateway_resent_total`.
pub(super) async fn send(
    gateway: &super::Gateway,
    booked: &Sent,
    headers: &HeaderMap,
    until: Instant,
    request_id: &str,
    traceparent: Option<&HeaderValue>,
) -> Result<Answer, GatewayError> {
    let request = upstream_request(booked, headers, traceparent, gateway.via_mark())?;
    let wait = |at: Instant| at.saturating_duration_since(Instant::now());
    let answer = tokio::time::timeout(wait(until), gateway.client.request(request)).await;
    let stale = match &answer {
        Ok(Err(error)) if !error.is_connect() => {
            super::upstream::wire_of(error).is_some_and(|w| w.reused_and_unanswered())
        }
        _ => false,
    };
    if !stale {
        return Ok(answer);
    }
    if let Ok(Err(error)) = &answer {
        tracing::debug!(request_id, worker = %booked.worker, error = %with_causes(error), "the pooled connection was closed by the worker; re-sending on a fresh connection");
    }
    gateway
        .stats
        .resent
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let request = upstream_request(booked, headers, traceparent, gateway.via_mark())?;
    Ok(tokio::time::timeout(wait(until), gateway.fresh.request(request)).await)
}

/// The request to the booked worker: the adapter's body and headers, and the
/// client's headers that may pass.
fn upstream_request(
    booked: &Sent,
    client_headers: &HeaderMap,
    traceparent: Option<&HeaderValue>,
    via_mark: &str,
) -> Result<hyper::Request<Full<Bytes>>, GatewayError> {
    let uri = format!("{}{}", booked.base, booked.forward.path);
    let mut request = hyper::Request::post(uri);
    if let Some(headers) = request.headers_mut() {
        for name in FORWARDED {
            for value in client_headers.get_all(*name) {
                headers.append(HeaderName::from_static(name), value.clone());
            }
        }
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        for (name, value) in &booked.forward.headers {
            if let Ok(value) = HeaderValue::from_str(value) {
                headers.insert(HeaderName::from_static(name), value);
            }
        }
        if let Some(key) = booked.api_key.as_ref().and_then(|k| k.authorization()) {
            headers.insert(header::AUTHORIZATION, key);
        }
        // The hop header: the marks of the routers before this one, and its own.
        let mut via: Vec<String> = client_headers
            .get_all(super::VIA_HEADER)
            .iter()
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
            .collect();
        via.push(via_mark.to_string());
        if let Ok(value) = HeaderValue::from_str(&via.join(", ")) {
            headers.insert(HeaderName::from_static(super::VIA_HEADER), value);
        }
        // Traced: the worker's parent is this request's `connect` span.
        if let Some(traceparent) = traceparent {
            headers.insert(HeaderName::from_static("traceparent"), traceparent.clone());
        }
    }
    request
        .body(Full::new(Bytes::from(booked.forward.body.clone())))
        .map_err(|e| {
            GatewayError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                "internal",
                format!("the forwarded request could not be built: {e}"),
            )
        })
}

/// The router's own shortage behind an upstream error, if that is what it was:
/// out of file descriptors (per process or system-wide), socket buffers or
/// memory. Such an error says nothing of the worker.
pub(super) fn local_shortage(error: &hyper_util::client::legacy::Error) -> Option<String> {
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        if let Some(io) = cause.downcast_ref::<std::io::Error>() {
            if matches!(
                io.raw_os_error(),
                Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
            ) {
                return Some(io.to_string());
            }
        }
        source = cause.source();
    }
    None
}
