//! The front door's handlers: `POST /v1/chat/completions`, `POST /v1/completions`,
//! SGLang's `POST /generate`, `POST /v1/embeddings`, `/tokenize` and
//! `/detokenize`, `GET /v1/models` and `/readiness`.
//!
//! Doors over the request path in `gateway/`: a handler takes the body, hands
//! it to [`crate::gateway::proxy`] (booking runs on the booking threads, the
//! runtime only waits on sockets), and turns what comes back into a response.

use super::body::RawJson;
use super::error::ApiError;
use super::App;
use crate::gateway::adapter::Route;
use crate::gateway::{proxy, tokenize, GatewayError};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use std::sync::Arc;
use std::time::Instant;

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
        let path = app.path.clone();
        move || tokenize::answer(&path.snapshot.load_full(), &body, encode)
    };
    let answer = app.bookings.run(job).await.map_err(GatewayError::from);
    match answer.and_then(|a| a) {
        Ok(json) => axum::Json(json).into_response(),
        Err(error) => error_response(&app, error),
    }
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
    match proxy::proxy(&app.path, route, &headers, body, received, &request_id).await {
        Ok(response) => response,
        Err(error) => {
            let mut response = error_response(&app, error);
            if let Ok(value) = HeaderValue::from_str(&request_id) {
                response.headers_mut().insert("x-kvhint-request-id", value);
            }
            response
        }
    }
}
