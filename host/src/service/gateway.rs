//! The front door's handlers: `POST /v1/chat/completions`, `POST /v1/completions`,
//! SGLang's `POST /generate`, and `GET /v1/models`.
//!
//! A request's CPU work (reading the body, rendering and tokenizing, booking, the
//! adapter's splice) runs as one job on the booking threads; the runtime only
//! waits on sockets. A retry (a refused connection, a 429 or 5xx before any byte
//! reached the client) books again on another worker, reusing the tokens.

use super::body::RawJson;
use super::error::ApiError;
use super::App;
use crate::domain::WorkerKey;
use crate::gateway::adapter::{self, HintDelivery, Route};
use crate::gateway::approximate;
use crate::gateway::release::{GuardedBody, ReleaseGuard};
use crate::gateway::stats::Release;
use crate::gateway::{self, GatewayError, Prepared};
use crate::splice::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
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

pub async fn chat_completions(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Result<RawJson, ApiError>,
) -> Response {
    handle(app, Route::Chat, headers, body).await
}

pub async fn completions(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Result<RawJson, ApiError>,
) -> Response {
    handle(app, Route::Completions, headers, body).await
}

pub async fn generate(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Result<RawJson, ApiError>,
) -> Response {
    handle(app, Route::Generate, headers, body).await
}

/// The models a worker that can take requests now serves, in OpenAI's shape.
pub async fn models(State(app): State<Arc<App>>) -> Response {
    let snapshot = app.snapshot.load_full();
    let workers = app.router.workers();
    let data: Vec<serde_json::Value> = snapshot
        .models
        .names()
        .iter()
        .filter(|name| {
            workers.iter().any(|(worker, _)| {
                worker.http.as_ref().is_some_and(|h| h.serves(name))
                    && app.gateway.health.looks_up(worker.key)
            })
        })
        .map(|name| {
            serde_json::json!({
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "kvhint",
            })
        })
        .collect();
    axum::Json(serde_json::json!({"object": "list", "data": data})).into_response()
}

/// An error in OpenAI's shape, counted.
pub fn error_response(app: &App, error: GatewayError) -> Response {
    app.gateway.stats.refused(error.status.as_u16());
    let mut response = (error.status, axum::Json(error.body())).into_response();
    response
        .extensions_mut()
        .insert(super::error::ErrorCode(error.code));
    response
}

async fn handle(
    app: Arc<App>,
    route: Route,
    headers: HeaderMap,
    body: Result<RawJson, ApiError>,
) -> Response {
    let received = Instant::now();
    let body = match body {
        Ok(RawJson(body)) => body,
        Err(error) => {
            // The front door's layer turns it into OpenAI's shape.
            return error.into_response();
        }
    };
    match forward(&app, route, &headers, body, received).await {
        Ok(response) => response,
        Err(error) => error_response(&app, error),
    }
}

/// A booking's request on its way to the worker.
struct Sent {
    prepared: Arc<Prepared>,
    worker: WorkerKey,
    base: Arc<str>,
    engine: crate::domain::Engine,
    forward: adapter::Forward,
}

/// What one booking job hands back: the open booking (its guard releases it on
/// every way out), and the request the adapter made for the booked worker.
pub(crate) struct Booked {
    pub guard: ReleaseGuard,
    /// The in-flight request on the booked worker whose prompt holds this one's
    /// cached prefix: the request is sent once it settles (see
    /// `gateway::approximate`).
    pub wait_for: Option<Arc<approximate::Gate>>,
    /// The prompt tokens the router found cached on the booked worker.
    pub cached_tokens: usize,
    pub prepared: Arc<Prepared>,
    pub worker: WorkerKey,
    pub base: Arc<str>,
    /// The worker's `host:port`.
    pub authority: Arc<str>,
    pub engine: crate::domain::Engine,
    pub forward: adapter::Forward,
}

/// A request body's CPU work, on a booking thread: parse, prepare (render and
/// tokenize; `prepared` is reused on a retry), book on an eligible worker not in
/// `tried` and `allowed`, credit an approximate-KV worker, and build the adapter's
/// request with the hint. Shared by the front door's handlers and the endpoint
/// picker (`service::endpoint_picker`), so both book and splice alike.
#[allow(clippy::too_many_arguments)]
pub(crate) fn book_body(
    app: &App,
    snapshot: &crate::snapshot::Snapshot,
    route: Route,
    body: &[u8],
    request_id: &str,
    tried: &[WorkerKey],
    prepared: Option<Arc<Prepared>>,
    allowed: gateway::Allowed<'_>,
) -> Result<Booked, GatewayError> {
    let text = std::str::from_utf8(body).map_err(|_| {
        GatewayError::bad_request("invalid_json", "the body is not UTF-8 text; send JSON")
    })?;
    let parsed =
        Body::parse(text).map_err(|e| GatewayError::bad_request("invalid_json", e.to_string()))?;
    let prepared = match prepared {
        Some(prepared) => prepared,
        None => Arc::new(gateway::prepare(snapshot, route, &parsed)?),
    };
    let (booking, worker, target) = gateway::book(
        &app.router,
        snapshot,
        &app.gateway,
        &prepared,
        request_id,
        tried,
        allowed,
    )?;
    // The guard exists from the moment the booking does: if the caller left
    // while this job ran, the reply is dropped unread and the guard with it,
    // which releases the booking.
    let mut guard = ReleaseGuard::new(
        Arc::clone(&app.router),
        Arc::clone(&app.gateway.stats),
        request_id.to_string(),
    );
    app.metrics
        .booked(&booking, booking.hint.message().is_some());
    let mut wait_for = None;
    if worker.approximate_kv {
        let credit = app.gateway.approximate.credit(
            &app.ingest,
            booking.worker,
            &approximate::Prompt {
                token_ids: &prepared.token_ids,
                block_size: snapshot.block_size,
                lora: prepared.model.lora.as_deref(),
                salt: prepared.cache_salt.as_deref(),
                cached_blocks: booking.cached_blocks,
            },
            snapshot.gateway.approximate_max_blocks,
            approximate::settles(target.engine),
        );
        wait_for = credit.wait_for.clone();
        guard.hold(credit);
    }
    let forward = adapter::forward(
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
    Ok(Booked {
        guard,
        wait_for,
        cached_tokens: booking.cached_blocks * snapshot.block_size,
        prepared,
        worker: booking.worker,
        base: Arc::clone(&target.base),
        authority: Arc::clone(&target.authority),
        engine: target.engine,
        forward,
    })
}

/// Counts what became of a booking's hint on its way to the engine.
pub(crate) fn count_hint(app: &App, forward: &adapter::Forward, engine: crate::domain::Engine) {
    match forward.hint {
        HintDelivery::Delivered => {
            app.gateway
                .stats
                .hints_delivered
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        HintDelivery::Undeliverable => app.gateway.stats.undeliverable(engine),
        HintDelivery::None => {}
    }
}

async fn forward(
    app: &Arc<App>,
    route: Route,
    headers: &HeaderMap,
    body: Bytes,
    received: Instant,
) -> Result<Response, GatewayError> {
    if std::str::from_utf8(&body).is_err() {
        return Err(GatewayError::bad_request(
            "invalid_json",
            "the body is not UTF-8 text; send JSON",
        ));
    }
    let snapshot = app.snapshot.load_full();
    let settings = snapshot.gateway.clone();
    let idle = Duration::from_millis(settings.idle_timeout_ms);
    let deadline = (settings.request_timeout_ms > 0)
        .then(|| received + Duration::from_millis(settings.request_timeout_ms));
    let request_id = app.gateway.request_id();
    let mut tried: Vec<WorkerKey> = Vec::new();
    let mut prepared: Option<Arc<Prepared>> = None;
    let mut backoff = Duration::from_millis(settings.retry_backoff_ms);
    let mut attempt = 0;
    loop {
        attempt += 1;
        let last_attempt = attempt >= settings.max_attempts;
        let job = {
            let app = Arc::clone(app);
            let snapshot = Arc::clone(&snapshot);
            let body = body.clone();
            let request_id = request_id.clone();
            let tried = tried.clone();
            let prepared = prepared.clone();
            move || {
                book_body(
                    &app,
                    &snapshot,
                    route,
                    &body,
                    &request_id,
                    &tried,
                    prepared,
                    None,
                )
            }
        };
        let booked = app.bookings.run(job).await.map_err(|_| {
            GatewayError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                "overloaded",
                "every booking thread is busy and the booking queue is full; retry shortly",
            )
        })??;
        // The booking is open: the guard releases it on every way out, this
        // future being dropped (the client left) included.
        let Booked {
            mut guard,
            wait_for,
            cached_tokens,
            prepared: this_prepared,
            worker,
            base,
            engine,
            forward,
            ..
        } = booked;
        if let Some(gate) = wait_for {
            if !wait_for_prefix(app, &gate, &settings).await {
                guard.sent_while_busy();
            }
        }
        let booked = Sent {
            prepared: this_prepared,
            worker,
            base,
            engine,
            forward,
        };
        prepared = Some(Arc::clone(&booked.prepared));
        count_hint(app, &booked.forward, booked.engine);
        let request = upstream_request(&booked, headers)?;
        let sent = Instant::now();
        let waited = match deadline {
            Some(at) => idle.min(at.saturating_duration_since(sent)),
            None => idle,
        };
        let answer = tokio::time::timeout(waited, app.gateway.client.request(request)).await;
        let key = booked.worker;
        let retry = |guard: &mut ReleaseGuard, tried: &mut Vec<WorkerKey>| {
            guard.finish(Release::Retried);
            tried.push(key);
            app.gateway
                .stats
                .retries
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        };
        let response = match answer {
            Err(_) => {
                let past_deadline = deadline.is_some_and(|at| Instant::now() >= at);
                guard.finish(if past_deadline {
                    Release::Deadline
                } else {
                    Release::IdleTimeout
                });
                app.gateway.health.request_failed(
                    key,
                    settings.circuit_failures,
                    settings.circuit_open_ms,
                    "it sent no response head in time".into(),
                );
                return Err(GatewayError::new(
                    StatusCode::GATEWAY_TIMEOUT,
                    "timeout_error",
                    if past_deadline {
                        "deadline"
                    } else {
                        "idle_timeout"
                    },
                    format!(
                        "{key} sent no response within {} ms ({})",
                        waited.as_millis(),
                        if past_deadline {
                            "gateway.request_timeout_ms"
                        } else {
                            "gateway.idle_timeout_ms"
                        }
                    ),
                ));
            }
            Ok(Err(error)) => {
                let why = describe(&error);
                if error.is_connect() {
                    app.gateway
                        .health
                        .refused(key, settings.circuit_open_ms, why.clone());
                } else {
                    app.gateway.health.request_failed(
                        key,
                        settings.circuit_failures,
                        settings.circuit_open_ms,
                        why.clone(),
                    );
                }
                if !last_attempt {
                    retry(&mut guard, &mut tried);
                    tokio::time::sleep(backoff).await;
                    backoff = backoff.mul_f32(1.5);
                    continue;
                }
                guard.finish(Release::UpstreamError);
                return Err(GatewayError::new(
                    StatusCode::BAD_GATEWAY,
                    "upstream_error",
                    "upstream_unreachable",
                    format!("{key} could not be reached: {why}"),
                ));
            }
            Ok(Ok(response)) => response,
        };
        let status = response.status();
        if status == StatusCode::TOO_MANY_REQUESTS || status.is_server_error() {
            app.gateway.health.request_failed(
                key,
                settings.circuit_failures,
                settings.circuit_open_ms,
                format!("it answered {status}"),
            );
            if !last_attempt {
                retry(&mut guard, &mut tried);
                drop(response);
                tokio::time::sleep(backoff).await;
                backoff = backoff.mul_f32(1.5);
                continue;
            }
        } else {
            app.gateway.health.request_succeeded(key);
        }
        let now = Instant::now();
        let prepared = &booked.prepared;
        app.gateway.stats.answered(
            &prepared.model.name,
            key,
            status.as_u16(),
            sent.saturating_duration_since(received),
            prepared.tokenize,
            now.saturating_duration_since(received),
        );
        let (parts, incoming) = response.into_parts();
        let stats = Arc::clone(&app.gateway.stats);
        let model = prepared.model.name.clone();
        let log_id = request_id.clone();
        let on_end = Box::new(move |reason: Release, duration: Duration| {
            stats.ended(&model, key, duration);
            tracing::info!(
                target: "kvhint::access",
                request_id = %log_id,
                model = %model,
                worker = key.worker_id,
                dp_rank = key.dp_rank,
                status = status.as_u16(),
                ttfb_ms = now.saturating_duration_since(received).as_secs_f64() * 1e3,
                duration_ms = duration.as_secs_f64() * 1e3,
                end = reason.as_str(),
                "request"
            );
        });
        let body = GuardedBody::new(incoming, guard, idle, deadline, received, on_end);
        let mut out = Response::new(axum::body::Body::new(body));
        *out.status_mut() = status;
        for (name, value) in &parts.headers {
            if !HOP_BY_HOP.contains(&name.as_str()) {
                out.headers_mut().append(name.clone(), value.clone());
            }
        }
        let worker = format!("{} {}", key.worker_id, key.dp_rank);
        if let Ok(value) = HeaderValue::from_str(&worker) {
            out.headers_mut().insert("x-kvhint-worker", value);
        }
        if let Ok(value) = HeaderValue::from_str(&request_id) {
            out.headers_mut().insert("x-kvhint-request-id", value);
        }
        out.headers_mut()
            .insert("x-kvhint-cached-tokens", HeaderValue::from(cached_tokens));
        return Ok(out);
    }
}

/// Waits, at most `gateway.prefix_wait_ms`, for the in-flight request whose
/// prompt holds this one's prefix to settle, so this one finds it reusable
/// rather than computing it again beside it; counted either way. Whether it
/// settled.
pub(crate) async fn wait_for_prefix(
    app: &App,
    gate: &approximate::Gate,
    settings: &crate::config::GatewayConfig,
) -> bool {
    if settings.prefix_wait_ms == 0 {
        return gate.is_open();
    }
    let started = Instant::now();
    let bound = Duration::from_millis(settings.prefix_wait_ms);
    let settled = tokio::time::timeout(bound, gate.opened()).await.is_ok();
    app.gateway.stats.prefix_waited(settled, started.elapsed());
    settled
}

/// The request to the booked worker: the adapter's body and headers, and the
/// client's headers that may pass.
fn upstream_request(
    booked: &Sent,
    client_headers: &HeaderMap,
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

/// A client error with its causes (hyper's top level says only "client error").
fn describe(error: &hyper_util::client::legacy::Error) -> String {
    let mut text = error.to_string();
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// Checks every HTTP worker's `GET /health` each `gateway.health.interval_ms`,
/// for as long as the router runs; the health table follows the results, and
/// forgets workers that left.
pub async fn health_checks(app: Arc<App>) {
    loop {
        let gateway_settings = app.snapshot.load().gateway.clone();
        let settings = gateway_settings.health.clone();
        app.gateway.approximate.expire(
            &app.ingest,
            Duration::from_secs(gateway_settings.approximate_ttl_s),
        );
        if settings.interval_ms == 0 {
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        }
        let started = tokio::time::Instant::now();
        let workers = app.router.workers();
        app.gateway
            .health
            .retain(|key| workers.iter().any(|(w, _)| w.key == *key));
        app.gateway
            .approximate
            .forget(|key| workers.iter().any(|(w, _)| w.key == *key));
        let mut checks = tokio::task::JoinSet::new();
        for (worker, _) in &workers {
            let Some(http) = worker.http.clone() else {
                continue;
            };
            let key = worker.key;
            let client = app.gateway.client.clone();
            let timeout = Duration::from_millis(settings.timeout_ms);
            checks.spawn(async move {
                let uri = format!("{}/health", http.base);
                let request = match hyper::Request::get(uri).body(Full::new(Bytes::new())) {
                    Ok(request) => request,
                    Err(e) => return (key, Err(e.to_string())),
                };
                let result = match tokio::time::timeout(timeout, client.request(request)).await {
                    Err(_) => Err(format!("no answer within {} ms", timeout.as_millis())),
                    Ok(Err(e)) => Err(describe(&e)),
                    Ok(Ok(response)) if response.status().is_success() => Ok(()),
                    Ok(Ok(response)) => Err(format!("GET /health answered {}", response.status())),
                };
                (key, result)
            });
        }
        while let Some(done) = checks.join_next().await {
            if let Ok((key, result)) = done {
                let ok = result.is_ok();
                app.gateway.health.checked(
                    key,
                    ok,
                    result.err().unwrap_or_default(),
                    settings.failures,
                    settings.successes,
                );
            }
        }
        tokio::time::sleep_until(started + Duration::from_millis(settings.interval_ms)).await;
    }
}
