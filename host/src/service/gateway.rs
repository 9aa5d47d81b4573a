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
use crate::gateway::release::{GuardedBody, OnEnd, ReleaseGuard};
use crate::gateway::signals::Signals;
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

/// Whether a worker that can take requests now serves `model`.
fn served_now(
    app: &App,
    workers: &[(Arc<crate::domain::Worker>, crate::router::workers::Load)],
    model: &str,
) -> bool {
    workers.iter().any(|(worker, _)| {
        worker.http.as_ref().is_some_and(|h| h.serves(model))
            && app.gateway.health.looks_up(worker.key)
    })
}

fn model_object(name: &str) -> serde_json::Value {
    serde_json::json!({
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "kvhint",
    })
}

pub async fn embeddings(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Result<RawJson, ApiError>,
) -> Response {
    handle(app, Route::Embeddings, headers, body).await
}

/// The model a `/tokenize` or `/detokenize` body names: its `model`, or the
/// one model this router serves.
fn named_model(
    snapshot: &crate::snapshot::Snapshot,
    body: &Body<'_>,
) -> Result<Arc<crate::models::Model>, GatewayError> {
    let name: Option<String> = body
        .get("model")
        .map_err(|e| GatewayError::bad_request("invalid_field", e).at("model"))?;
    let names = snapshot.models.names();
    let name = match name {
        Some(name) => name,
        None if names.len() == 1 => names[0].clone(),
        None => return Err(GatewayError::missing_model(names)),
    };
    snapshot
        .models
        .get(&name)
        .cloned()
        .ok_or_else(|| GatewayError::model_not_found(&name, names))
}

/// `POST /tokenize`, in vLLM's shapes: `{model?, prompt, add_special_tokens =
/// true, return_token_strs = false}` or `{model?, messages, tools?,
/// add_generation_prompt = true, continue_final_message, chat_template_kwargs,
/// add_special_tokens = false, return_token_strs}`; answers `{count,
/// max_model_len, tokens, token_strs}`, with the ids the router books with
/// (the model's own tokenizer and chat template, in process). `max_model_len`
/// is the longest prompt this router books (`router.max_prompt_tokens`).
pub async fn tokenize(State(app): State<Arc<App>>, body: Result<RawJson, ApiError>) -> Response {
    tokenizer_job(app, body, true).await
}

/// `POST /detokenize`, in vLLM's shapes: `{model?, tokens}` → `{prompt}`
/// (special tokens kept).
pub async fn detokenize(State(app): State<Arc<App>>, body: Result<RawJson, ApiError>) -> Response {
    tokenizer_job(app, body, false).await
}

/// Tokenizing is CPU work: it runs on the booking threads, as a booking does.
async fn tokenizer_job(app: Arc<App>, body: Result<RawJson, ApiError>, encode: bool) -> Response {
    let body = match body {
        Ok(RawJson(body)) => body,
        Err(error) => return error.into_response(),
    };
    let job = {
        let app = Arc::clone(&app);
        move || {
            let snapshot = app.snapshot.load_full();
            let text = std::str::from_utf8(&body).map_err(|_| GatewayError::not_utf8())?;
            let parsed = Body::parse(text)
                .map_err(|e| GatewayError::bad_request("invalid_json", e.to_string()))?;
            let model = named_model(&snapshot, &parsed)?;
            if encode {
                tokenize_body(&snapshot, &model, &parsed)
            } else {
                let ids: Vec<u32> = parsed
                    .get("tokens")
                    .map_err(|e| GatewayError::bad_request("invalid_tokens", e).at("tokens"))?
                    .ok_or_else(|| {
                        GatewayError::bad_request(
                            "missing_tokens",
                            "the body has no `tokens`: the list of token ids to turn into text",
                        )
                        .at("tokens")
                    })?;
                let prompt = model
                    .tokenizer
                    .decode(&ids)
                    .map_err(|e| GatewayError::bad_request("invalid_tokens", e.0).at("tokens"))?;
                Ok(serde_json::json!({"prompt": prompt}))
            }
        }
    };
    let answer = app.bookings.run(job).await.map_err(GatewayError::from);
    match answer.and_then(|a| a) {
        Ok(json) => axum::Json(json).into_response(),
        Err(error) => error_response(&app, error),
    }
}

fn tokenize_body(
    snapshot: &crate::snapshot::Snapshot,
    model: &crate::models::Model,
    body: &Body<'_>,
) -> Result<serde_json::Value, GatewayError> {
    let flag = |key: &'static str| -> Result<Option<bool>, GatewayError> {
        body.get(key)
            .map_err(|e| GatewayError::bad_request("invalid_field", e).at(key))
    };
    let strs = flag("return_token_strs")?.unwrap_or(false);
    let invalid = |param: &'static str| {
        move |e: crate::models::RenderError| {
            GatewayError::bad_request("invalid_prompt", e.0).at(param)
        }
    };
    // Held to the bound a prompt is held to: past it the count is of no use
    // (no prompt that long is booked), and tokenizing it all would let one
    // request spend seconds of CPU.
    let max = snapshot.limits.max_prompt_tokens;
    let bounded = |param: &'static str| {
        move |e: crate::models::EncodeError| match e {
            crate::models::EncodeError::Invalid(e) => {
                GatewayError::bad_request("invalid_prompt", e.0).at(param)
            }
            crate::models::EncodeError::TooLong(too_long) => {
                crate::gateway::prompt_too_long(too_long).at(param)
            }
        }
    };
    let tokens = if body.has("messages") {
        let request: crate::models::ChatRequest =
            serde_json::from_str(body.text()).map_err(|e| {
                GatewayError::bad_request("invalid_messages", e.to_string()).at("messages")
            })?;
        if flag("add_special_tokens")?.unwrap_or(false) {
            let text = model
                .tokenizer
                .render_chat(&request)
                .map_err(invalid("messages"))?;
            model
                .tokenizer
                .encode_text_within(&text, true, max)
                .map_err(bounded("messages"))?
        } else {
            model
                .tokenizer
                .encode_chat_within(&request, max)
                .map_err(bounded("messages"))?
                .0
        }
    } else {
        let prompt: String = body
            .get("prompt")
            .map_err(|e| GatewayError::bad_request("invalid_prompt", e).at("prompt"))?
            .ok_or_else(|| {
                GatewayError::bad_request(
                    "missing_prompt",
                    "the body has neither `prompt` (a string) nor `messages` (a chat)",
                )
                .at("prompt")
            })?;
        let special = flag("add_special_tokens")?.unwrap_or(true);
        model
            .tokenizer
            .encode_text_within(&prompt, special, max)
            .map_err(bounded("prompt"))?
    };
    let token_strs = if strs {
        Some(
            model
                .tokenizer
                .token_strs(&tokens)
                .map_err(invalid("prompt"))?,
        )
    } else {
        None
    };
    Ok(serde_json::json!({
        "count": tokens.len(),
        "max_model_len": snapshot.limits.max_prompt_tokens,
        "tokens": tokens,
        "token_strs": token_strs,
    }))
}

/// The models a worker that can take requests now serves, in OpenAI's shape.
pub async fn models(State(app): State<Arc<App>>) -> Response {
    let snapshot = app.snapshot.load_full();
    let workers = app.router.workers();
    let data: Vec<serde_json::Value> = snapshot
        .models
        .names()
        .iter()
        .filter(|name| served_now(&app, &workers, name))
        .map(|name| model_object(name))
        .collect();
    axum::Json(serde_json::json!({"object": "list", "data": data})).into_response()
}

/// `GET /v1/models/{id}`: the model, if a worker that can take requests now
/// serves it (as `/v1/models` lists it); 404 otherwise.
pub async fn model(
    State(app): State<Arc<App>>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    let snapshot = app.snapshot.load_full();
    if snapshot.models.get(&id).is_some() && served_now(&app, &app.router.workers(), &id) {
        return axum::Json(model_object(&id)).into_response();
    }
    let why = if snapshot.models.get(&id).is_some() {
        "is configured, but no worker that can take requests serves it now (see /readiness)"
    } else {
        "does not exist here (GET /v1/models lists the models served)"
    };
    error_response(
        &app,
        GatewayError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "model_not_found",
            format!("the model `{id}` {why}"),
        ),
    )
}

/// `GET /readiness`: 200 while every model in `models:` has a worker that can
/// take requests (healthy, circuit not open), 503 naming each model that has
/// none otherwise. Load balancers send traffic only to a ready router.
pub async fn readiness(State(app): State<Arc<App>>) -> Response {
    let snapshot = app.snapshot.load_full();
    let workers = app.router.workers();
    let missing: Vec<String> = snapshot
        .models
        .names()
        .iter()
        .filter(|name| !served_now(&app, &workers, name))
        .map(|name| {
            let serving: Vec<String> = workers
                .iter()
                .filter(|(w, _)| w.http.as_ref().is_some_and(|h| h.serves(name)))
                .map(|(w, _)| {
                    let why = app
                        .gateway
                        .health
                        .view(w.key)
                        .and_then(|v| v.why)
                        .unwrap_or_else(|| "out of rotation".into());
                    format!("{}: {why}", w.key)
                })
                .collect();
            if serving.is_empty() {
                format!("model `{name}`: no worker serves it (list one under `workers:` or register one)")
            } else {
                format!(
                    "model `{name}`: no worker can take requests ({})",
                    serving.join("; ")
                )
            }
        })
        .collect();
    if missing.is_empty() {
        axum::Json(serde_json::json!({"status": "ready"})).into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(serde_json::json!({"status": "not_ready", "reasons": missing})),
        )
            .into_response()
    }
}

/// An unknown route under `/v1/`: 404 in OpenAI's shape, as OpenAI answers it.
pub async fn unknown_route(
    State(app): State<Arc<App>>,
    method: axum::http::Method,
    uri: axum::http::Uri,
) -> Response {
    error_response(
        &app,
        GatewayError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "unknown_url",
            format!(
                "Invalid URL ({method} {}): this router serves /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/models and /v1/models/{{id}}",
                uri.path()
            ),
        ),
    )
}

/// An error in OpenAI's shape, counted.
pub fn error_response(app: &App, error: GatewayError) -> Response {
    app.gateway.stats.refused(error.status.as_u16());
    super::error::openai_response(error)
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
    let request_id = app.gateway.request_id();
    let mut trace = app
        .gateway
        .tracing
        .as_ref()
        .and_then(|t| t.request(&headers, route.as_str(), received));
    match forward(
        &app,
        route,
        &headers,
        body,
        received,
        &request_id,
        &mut trace,
    )
    .await
    {
        Ok(response) => response,
        Err(error) => {
            if let Some(trace) = trace {
                trace.finish(
                    Instant::now(),
                    "answered_by_router",
                    error.status.as_u16(),
                    None,
                    None,
                );
            }
            let mut response = error_response(&app, error);
            if let Ok(value) = HeaderValue::from_str(&request_id) {
                response.headers_mut().insert("x-kvhint-request-id", value);
            }
            response
        }
    }
}

/// The access-log line of a request the router answered itself (a refusal, a
/// bad body, no worker, a timeout: every response that carries an error code
/// of its own), so no answer goes unlogged; a worker's answer is logged when
/// its body ends (in `forward`).
pub async fn access_log(request: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let received = Instant::now();
    let method = request.method().clone();
    let path = request.uri().path().to_string();
    let response = next.run(request).await;
    if let Some(super::error::ErrorCode(code)) = response.extensions().get() {
        let request_id = response
            .headers()
            .get("x-kvhint-request-id")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        let reason = response
            .extensions()
            .get::<Refusal>()
            .map_or("", |r| r.0.as_str());
        tracing::info!(
            target: "kvhint::access",
            request_id,
            method = %method,
            path = %path,
            status = response.status().as_u16(),
            duration_ms = received.elapsed().as_secs_f64() * 1e3,
            end = "answered_by_router",
            code,
            reason,
            "request"
        );
    }
    response
}

/// Why the router answered a request itself, for the access log.
#[derive(Debug, Clone)]
pub struct Refusal(pub String);

/// A booking's request on its way to the worker.
struct Sent {
    prepared: Arc<Prepared>,
    worker: WorkerKey,
    base: Arc<str>,
    engine: crate::domain::Engine,
    forward: adapter::Forward,
    api_key: Option<crate::domain::ApiKey>,
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
    /// The worker's API key, if its server asks for one.
    pub api_key: Option<crate::domain::ApiKey>,
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
    let text = std::str::from_utf8(body).map_err(|_| GatewayError::not_utf8())?;
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
    let prompt = approximate::Prompt {
        token_ids: &prepared.token_ids,
        block_size: snapshot.block_size,
        lora: prepared.model.lora.as_deref(),
        salt: prepared.cache_salt.as_deref(),
        cached_blocks: booking.cached_blocks,
    };
    let credit = if worker.approximate_kv {
        Some(app.gateway.approximate.credit(
            &app.ingest,
            booking.worker,
            &prompt,
            snapshot.gateway.approximate_max_blocks,
            approximate::settles(target.engine),
        ))
    } else if snapshot.gateway.credit_in_flight {
        Some(app.gateway.approximate.in_flight(
            &app.ingest,
            booking.worker,
            app.router.load_cell(booking.worker),
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
        api_key: target.api_key.clone(),
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
    request_id: &str,
    trace: &mut Option<crate::gateway::trace::RequestTrace>,
) -> Result<Response, GatewayError> {
    if let Some(looped) = app.gateway.looped(headers) {
        return Err(looped);
    }
    if std::str::from_utf8(&body).is_err() {
        return Err(GatewayError::not_utf8());
    }
    let snapshot = app.snapshot.load_full();
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
        let job = {
            let app = Arc::clone(app);
            let snapshot = Arc::clone(&snapshot);
            let body = body.clone();
            let request_id = request_id.clone();
            let tried = tried.clone();
            let prepared = prepared.clone();
            move || {
                let started = Instant::now();
                let booked = book_body(
                    &app,
                    &snapshot,
                    route,
                    &body,
                    &request_id,
                    &tried,
                    prepared,
                    None,
                );
                (started, booked)
            }
        };
        let (job_started, booked) = app.bookings.run(job).await?;
        let booked = match booked {
            Ok(booked) => booked,
            Err(error) if error.code == gateway::error::NO_WORKERS.openai.code => {
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
            worker,
            base,
            engine,
            forward,
            api_key,
            ..
        } = booked;
        if let Some(gate) = wait_for {
            if !wait_for_prefix(app, &gate, cached_tokens, &settings).await {
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
        count_hint(app, &booked.forward, booked.engine);
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
            app,
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
            app.gateway
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
                app.gateway.health.timed_out(
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
                let why = describe(&error);
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
            app.gateway.health.request_failed(
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
        let mut trace = trace.take();
        if let Some(trace) = trace.as_mut() {
            trace.head(now, status.as_u16());
        }
        let (parts, incoming) = response.into_parts();
        let stats = Arc::clone(&app.gateway.stats);
        let model = prepared.model.name.clone();
        let log_id = request_id.clone();
        let on_end: OnEnd = Box::new(
            move |reason: Release, duration: Duration, signals: &Signals| {
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
        if let Ok(value) = HeaderValue::from_str(&request_id) {
            out.headers_mut().insert("x-kvhint-request-id", value);
        }
        out.headers_mut()
            .insert("x-kvhint-cached-tokens", HeaderValue::from(cached_tokens));
        return Ok(out);
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
pub(crate) async fn wait_for_prefix(
    app: &App,
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
            app.gateway.stats.prefix_too_short();
        }
        return settled;
    }
    let started = Instant::now();
    let bound = Duration::from_millis(settings.prefix_wait_ms);
    let settled = tokio::time::timeout(bound, gate.opened()).await.is_ok();
    app.gateway.stats.prefix_waited(settled, started.elapsed());
    settled
}

/// What became of a request sent to its worker: its head, a failure, or no
/// head in time.
type Answer = Result<
    Result<hyper::Response<hyper::body::Incoming>, hyper_util::client::legacy::Error>,
    tokio::time::error::Elapsed,
>;

/// Sends the booked request on a pooled connection and waits for its head
/// until `until`. A pooled connection the worker had closed while it sat idle
/// (the request written on it got no byte of an answer: the worker's close
/// crossed it) is not the worker's failure: the request is re-sent once, on a
/// fresh connection to the same worker, and counted in
/// `kvhint_gateway_resent_total`.
async fn send(
    app: &App,
    booked: &Sent,
    headers: &HeaderMap,
    until: Instant,
    request_id: &str,
    traceparent: Option<&HeaderValue>,
) -> Result<Answer, GatewayError> {
    let request = upstream_request(booked, headers, traceparent, app.gateway.via_mark())?;
    let wait = |at: Instant| at.saturating_duration_since(Instant::now());
    let answer = tokio::time::timeout(wait(until), app.gateway.client.request(request)).await;
    let stale = match &answer {
        Ok(Err(error)) if !error.is_connect() => {
            crate::gateway::upstream::wire_of(error).is_some_and(|w| w.reused_and_unanswered())
        }
        _ => false,
    };
    if !stale {
        return Ok(answer);
    }
    if let Ok(Err(error)) = &answer {
        tracing::debug!(request_id, worker = %booked.worker, error = %describe(error), "the pooled connection was closed by the worker; re-sending on a fresh connection");
    }
    app.gateway
        .stats
        .resent
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let request = upstream_request(booked, headers, traceparent, app.gateway.via_mark())?;
    Ok(tokio::time::timeout(wait(until), app.gateway.fresh.request(request)).await)
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
            .get_all(gateway::VIA_HEADER)
            .iter()
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
            .collect();
        via.push(via_mark.to_string());
        if let Ok(value) = HeaderValue::from_str(&via.join(", ")) {
            headers.insert(HeaderName::from_static(gateway::VIA_HEADER), value);
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

/// A client error with its causes (hyper's top level says only "client error").
/// The router's own shortage behind an upstream error, if that is what it was:
/// out of file descriptors (per process or system-wide), socket buffers or
/// memory. Such an error says nothing of the worker.
fn local_shortage(error: &hyper_util::client::legacy::Error) -> Option<String> {
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

/// Bounds what the router believes of each worker's KV cache by its capacity:
/// its `kv_capacity_tokens`, else what its engine says (asked in the background,
/// once it answers; see `gateway::capacity`). An approximate worker's credits
/// are capped by it (else learned from its answers); an event-fed worker's goes
/// to the bookings, which anticipate the evictions it makes certain
/// (`gateway.anticipate_evictions`, with `credit_in_flight`).
fn bound_kv_pictures(
    app: &Arc<App>,
    workers: &[(Arc<crate::domain::Worker>, crate::router::workers::Load)],
    block_size: usize,
    settings: &crate::config::HealthConfig,
    anticipate: bool,
) {
    let now = Instant::now();
    let approximate = &app.gateway.approximate;
    for (worker, _) in workers {
        let tokens = worker
            .kv_capacity_tokens
            .or_else(|| approximate.engine_capacity(worker.key));
        let blocks = tokens.map(|t| (t / block_size.max(1) as u64).max(1));
        let anticipated = anticipate && !worker.approximate_kv;
        if worker.approximate_kv {
            approximate.configure(worker.key, blocks);
        }
        if let Some(cell) = app.router.load_cell(worker.key) {
            cell.set_capacity_blocks(blocks.filter(|_| anticipated));
        }
        if !worker.approximate_kv && !anticipated {
            continue;
        }
        let Some(http) = worker.http.clone() else {
            continue;
        };
        let Some(path) = gateway::capacity::path(http.engine) else {
            continue;
        };
        if worker.kv_capacity_tokens.is_some() || !approximate.should_read(worker.key, now) {
            continue;
        }
        let app = Arc::clone(app);
        let key = worker.key;
        let timeout = Duration::from_millis(settings.timeout_ms.max(1000));
        let what = if worker.approximate_kv {
            "its approximate credits are bounded by that"
        } else {
            "bookings anticipate the evictions that makes certain"
        };
        tokio::spawn(async move {
            let tokens = read_capacity(&app, &http, path, timeout).await;
            match tokens {
                Some(tokens) => tracing::info!(
                    worker = %key,
                    tokens,
                    "the engine says its KV cache holds {tokens} tokens (GET {path}); {what}"
                ),
                None => {
                    tracing::debug!(worker = %key, "GET {path} said no KV capacity; asking again later")
                }
            }
            app.gateway
                .approximate
                .reported(key, tokens, Instant::now());
        });
    }
}

/// `GET {path}` of a worker, read as [`gateway::capacity::parse`] reads it.
async fn read_capacity(
    app: &App,
    http: &crate::domain::HttpTarget,
    path: &str,
    timeout: Duration,
) -> Option<u64> {
    use http_body_util::BodyExt;
    let mut request = hyper::Request::get(format!("{}{path}", http.base));
    if let Some((headers, key)) = request
        .headers_mut()
        .zip(http.api_key.as_ref().and_then(|k| k.authorization()))
    {
        headers.insert(header::AUTHORIZATION, key);
    }
    let request = request.body(Full::new(Bytes::new())).ok()?;
    let read = async {
        let response = app.gateway.client.request(request).await.ok()?;
        if !response.status().is_success() {
            return None;
        }
        // A vLLM server's metrics are tens of KiB; anything past 8 MiB is not one.
        let body = http_body_util::Limited::new(response.into_body(), 8 << 20)
            .collect()
            .await
            .ok()?
            .to_bytes();
        gateway::capacity::parse(http.engine, &body)
    };
    tokio::time::timeout(timeout, read).await.ok().flatten()
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
        let block_size = app.snapshot.load().block_size;
        let anticipate = gateway_settings.credit_in_flight && gateway_settings.anticipate_evictions;
        bound_kv_pictures(
            &app,
            &app.router.workers(),
            block_size,
            &settings,
            anticipate,
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
            let path = settings.path(http.engine).to_string();
            checks.spawn(async move {
                let uri = format!("{}{path}", http.base);
                let mut request = hyper::Request::get(uri);
                if let Some((headers, key)) = request
                    .headers_mut()
                    .zip(http.api_key.as_ref().and_then(|k| k.authorization()))
                {
                    headers.insert(header::AUTHORIZATION, key);
                }
                let request = match request.body(Full::new(Bytes::new())) {
                    Ok(request) => request,
                    Err(e) => return (key, Some(Err(e.to_string()))),
                };
                let result = match tokio::time::timeout(timeout, client.request(request)).await {
                    Err(_) => Err(format!("no answer within {} ms", timeout.as_millis())),
                    // The router's own shortage: no verdict on the worker.
                    Ok(Err(e)) if local_shortage(&e).is_some() => return (key, None),
                    Ok(Err(e)) => Err(describe(&e)),
                    Ok(Ok(response)) if response.status().is_success() => Ok(()),
                    Ok(Ok(response)) => Err(format!("GET {path} answered {}", response.status())),
                };
                (key, Some(result))
            });
        }
        while let Some(done) = checks.join_next().await {
            if let Ok((key, Some(result))) = done {
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
