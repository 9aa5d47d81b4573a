//! One request to one worker: the adapter's request sent on a pooled
//! connection (re-sent once on a fresh one when the worker had closed the
//! pooled one), its head awaited within a bound, and the client's response
//! made from the head: the body streamed under the idle and request bounds,
//! owning the booking's guard, counted, traced and logged when it ends. The
//! attempt loop (`proxy`) and a disaggregated pair's legs (`disaggregated`)
//! both send through here.

use super::adapter;
use super::release::{GuardedBody, OnEnd, ReleaseGuard};
use super::signals::Signals;
use super::stats::Release;
use super::{GatewayError, Prepared, RequestPath};
use crate::domain::WorkerKey;
use crate::logging::with_causes;
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
pub struct Sent {
    pub prepared: Arc<Prepared>,
    pub worker: WorkerKey,
    pub base: Arc<str>,
    pub engine: crate::domain::Engine,
    pub forward: adapter::Forward,
    pub api_key: Option<crate::domain::ApiKey>,
}

/// A worker's answer as the attempt loop took it: the head's status, when the
/// request was sent and received, what the router found cached, the stream's
/// bounds, and what else runs when the response ends (a disaggregated pair's
/// prefill leg).
pub struct Answered {
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
pub fn respond(
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
pub type Answer = Result<
    Result<hyper::Response<hyper::body::Incoming>, hyper_util::client::legacy::Error>,
    tokio::time::error::Elapsed,
>;

/// Sends the booked request on a pooled connection and waits for its head
/// until `until`. A pooled connection the worker had closed while it sat idle
/// (the request written on it got no byte of an answer: the worker's close
/// crossed it) is not the worker's failure: the request is re-sent once, on a
/// fresh connection to the same worker, and counted in
/// `kvhint_gateway_resent_total`.
pub async fn send(
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
pub fn local_shortage(error: &hyper_util::client::legacy::Error) -> Option<String> {
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
