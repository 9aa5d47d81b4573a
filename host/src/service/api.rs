//! The booking API's handlers: workers register and deregister and post KV
//! events, clients book and release, an operator reloads; and the open probes
//! (`/health`, `/healthz`, `/metrics`). Thin: decode, call the router, encode;
//! every failure maps to the one error shape in [`super::error`].

use super::body::JsonBody;
use super::error::ApiError;
use super::metrics;
use super::reload::Trigger;
use super::App;
use crate::engine_events::AttachError;
use crate::fleet::{MembershipError, Origin};
use crate::router::configured_role;
use crate::router::workers::WorkerRegistration;
use crate::wire::{BookBody, BookingView, KvEventBody, ReleaseBody};
use axum::extract::{Path as UrlPath, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::json;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

pub(super) async fn register_worker(
    State(app): State<Arc<App>>,
    body: Result<JsonBody<WorkerRegistration>, ApiError>,
) -> Result<Response, ApiError> {
    let JsonBody(registration) = body?;
    let (worker_id, dp_rank) = (registration.worker_id, registration.dp_rank);
    if let (Some(endpoint), Some(listen)) = (&registration.http_endpoint, app.listen.get()) {
        if points_at(endpoint, *listen) {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_runtime_data",
                format!("worker {worker_id} rank {dp_rank}: http_endpoint {endpoint} is this router's own address ({listen}): every request sent there would come back to the router; point it at the engine"),
            ));
        }
    }
    let max = app.snapshot.load().gateway.max_workers;
    let workers = app.router.workers();
    let known = workers
        .iter()
        .any(|(w, _)| w.key.worker_id == worker_id && w.key.dp_rank == dp_rank);
    if !known && workers.len() as u64 >= max {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "too_many_workers",
            format!("{} workers are registered, gateway.max_workers ({max}); deregister one, or raise it", workers.len()),
        ));
    }
    let new = app
        .fleet
        .register(registration, Origin::Registration)
        .map_err(membership_error)?;
    let status = if new {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    let body = json!({"worker_id": worker_id, "dp_rank": dp_rank, "registered": if new { "new" } else { "updated" }});
    Ok((status, Json(body)).into_response())
}

/// Whether `endpoint` (`http://host:port`) is the router's own `listen`
/// address: the same port on the same IP (`localhost` taken as 127.0.0.1), or
/// on a loopback address when the router listens on every address.
fn points_at(endpoint: &str, listen: SocketAddr) -> bool {
    let authority = endpoint
        .split_once("://")
        .map_or(endpoint, |(_, rest)| rest)
        .split('/')
        .next()
        .unwrap_or_default();
    let Some((host, port)) = authority.rsplit_once(':') else {
        return false;
    };
    if port.parse::<u16>().ok() != Some(listen.port()) {
        return false;
    }
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let ip = if host.eq_ignore_ascii_case("localhost") {
        std::net::IpAddr::from([127, 0, 0, 1])
    } else {
        match host.parse::<std::net::IpAddr>() {
            Ok(ip) => ip,
            // A host name: the hop header catches a loop through it.
            Err(_) => return false,
        }
    };
    // 0.0.0.0 as a destination reaches the local listener; a router listening
    // on every address is reached on any loopback address. Another loopback
    // address than the one the router listens on may be another process's.
    ip == listen.ip()
        || (ip.is_unspecified() && listen.ip().is_loopback())
        || (listen.ip().is_unspecified() && (ip.is_loopback() || ip.is_unspecified()))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RankQuery {
    #[serde(default)]
    dp_rank: u32,
}

/// A refused registration: the caller's source (400), the router's verdict, or a
/// thread the host could not start (500).
fn membership_error(error: MembershipError) -> ApiError {
    match error {
        MembershipError::Router(e) => e.into(),
        MembershipError::Attach(AttachError::Source(e)) => ApiError::bad_request(e.to_string()),
        MembershipError::Attach(e @ AttachError::Full { .. }) => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "too_many_sources",
            e.to_string(),
        ),
        MembershipError::Attach(e @ AttachError::Spawn(_)) => {
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string())
        }
    }
}

pub(super) async fn deregister_worker(
    State(app): State<Arc<App>>,
    worker_id: Result<UrlPath<u64>, axum::extract::rejection::PathRejection>,
    query: Result<Query<RankQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let UrlPath(worker_id) = worker_id.map_err(|e| {
        ApiError::bad_request(format!("{}; the worker id is a number", e.body_text()))
    })?;
    let Query(RankQuery { dp_rank }) = query.map_err(|e| ApiError::bad_request(e.body_text()))?;
    let key = crate::domain::WorkerKey { worker_id, dp_rank };
    app.fleet.deregister(key)?;
    Ok(Json(
        json!({"worker_id": worker_id, "dp_rank": dp_rank, "deregistered": true}),
    ))
}

pub(super) async fn kv_event(
    State(app): State<Arc<App>>,
    body: Result<JsonBody<KvEventBody>, ApiError>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let JsonBody(body) = body?;
    let key = body.key();
    let applied = app
        .ingest
        .submit(key, body.event)
        .map_err(|e| ApiError::overloaded(e.to_string()))?;
    let stats = applied
        .await
        .map_err(|_| ApiError::overloaded("the KV-event ingestion path stopped"))??;
    app.metrics.kv_events.fetch_add(1, Ordering::Relaxed);
    Ok(Json(json!({
        "stored": stats.stored,
        "removed": stats.removed,
        "missing_removals": stats.missing_removals,
    })))
}

pub(super) async fn create_booking(
    State(app): State<Arc<App>>,
    body: Result<JsonBody<BookBody>, ApiError>,
) -> Result<Response, ApiError> {
    let JsonBody(body) = body?;
    let worker = Arc::clone(&app);
    let booked = app
        .bookings
        .run(move || {
            let session = body.session_text();
            // One snapshot for the whole booking, whatever a reload does meanwhile.
            let snapshot = worker.snapshot.load_full();
            let request = body.request(session.as_deref());
            let role = configured_role(&snapshot, request.role)?;
            let booking = worker.router.book(role, &request)?;
            worker
                .metrics
                .booked(&booking, booking.hint.message().is_some());
            serde_json::to_string(&BookingView::new(&booking, role)).map_err(|e| {
                ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string())
            })
        })
        .await?;
    let text = booked?;
    Ok(([(header::CONTENT_TYPE, "application/json")], text).into_response())
}

pub(super) async fn release_booking(
    State(app): State<Arc<App>>,
    body: Result<JsonBody<ReleaseBody>, ApiError>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let JsonBody(body) = body?;
    let worker = app.router.release(&body.request_id)?;
    Ok(Json(json!({
        "request_id": body.request_id,
        "worker_id": worker.worker_id,
        "dp_rank": worker.dp_rank,
        "released": true,
    })))
}

/// `GET /health`: the process is alive and serving (load balancers' and both
/// peer gateways' path); `/readiness` says whether it can route.
pub(super) async fn health() -> Json<serde_json::Value> {
    Json(json!({"status": "ok"}))
}

pub(super) async fn healthz(State(app): State<Arc<App>>) -> Json<serde_json::Value> {
    Json(json!({"status": "ok", "generation": app.snapshot.load().generation}))
}

/// OpenMetrics for a scraper that asks for it, else the Prometheus text format.
pub(super) async fn metrics(
    State(app): State<Arc<App>>,
    headers: axum::http::HeaderMap,
) -> Response {
    let accept = headers
        .get(header::ACCEPT)
        .and_then(|value| value.to_str().ok());
    let registry = app.metrics_registry();
    let (content_type, text) = metrics::encode(&registry, metrics::wants_openmetrics(accept));
    ([(header::CONTENT_TYPE, content_type)], text).into_response()
}

pub(super) async fn admin_reload(
    State(app): State<Arc<App>>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let worker = Arc::clone(&app);
    let result = tokio::task::spawn_blocking(move || {
        worker.reloader.reload(&worker.snapshot, Trigger::Admin)
    })
    .await
    .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()))?;
    match result {
        Ok(generation) => Ok(Json(json!({"reloaded": true, "generation": generation}))),
        Err(errors) => Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "reload_failed",
            format!(
                "the previous snapshot keeps serving; {}",
                errors
                    .0
                    .iter()
                    .map(|e| e.to_string())
                    .collect::<Vec<_>>()
                    .join("; ")
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::points_at;

    #[test]
    fn a_worker_endpoint_at_the_router_s_own_address_is_recognised_and_no_other() {
        let loopback = "127.0.0.1:8080".parse().unwrap();
        for (endpoint, own) in [
            ("http://127.0.0.1:8080", true),
            ("http://localhost:8080", true),
            ("http://0.0.0.0:8080", true),
            ("http://127.0.0.1:8081", false),
            // Another loopback address may be another process's.
            ("http://127.0.0.2:8080", false),
            ("http://10.0.0.1:8080", false),
            ("https://worker.example:8080", false),
        ] {
            assert_eq!(points_at(endpoint, loopback), own, "{endpoint}");
        }
        let every = "0.0.0.0:8080".parse().unwrap();
        for (endpoint, own) in [
            ("http://127.0.0.5:8080", true),
            ("http://[::1]:8080", true),
            ("http://localhost:8080", true),
            ("http://127.0.0.5:9090", false),
        ] {
            assert_eq!(points_at(endpoint, every), own, "{endpoint}");
        }
    }
}
