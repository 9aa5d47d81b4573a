//! The access log (`kvhint::access`) of the requests the router answered
//! itself; a worker's answer is logged by [`super::proxy`] when its body ends.

use axum::response::Response;
use std::time::Instant;

/// The access-log line of a request the router answered itself (a refusal, a
/// bad body, no worker, a timeout: every response that carries an error code
/// of its own), so no answer goes unlogged; a worker's answer is logged when
/// its body ends (in [`super::proxy`]).
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
