//! One error shape for every API failure: `{"error": <code>, "detail": <text>}`
//! with the status code that fits, so clients can branch on `error` and show
//! `detail` to a person.

use super::App;
use crate::router::RouterError;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub detail: String,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, detail: impl Into<String>) -> Self {
        Self {
            status,
            code,
            detail: detail.into(),
        }
    }

    pub fn bad_request(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "bad_request", detail)
    }

    /// The router is at a queue's bound; the client should retry shortly.
    pub fn overloaded(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "overloaded", detail)
    }
}

impl From<RouterError> for ApiError {
    fn from(error: RouterError) -> Self {
        let (status, code) = match &error {
            RouterError::UnknownWorker { .. } => (StatusCode::NOT_FOUND, "unknown_worker"),
            RouterError::UnknownRequest(_) => (StatusCode::NOT_FOUND, "unknown_request"),
            RouterError::DuplicateRequest(_) => (StatusCode::CONFLICT, "duplicate_request"),
            RouterError::RuntimeData(_) => {
                (StatusCode::UNPROCESSABLE_ENTITY, "invalid_runtime_data")
            }
            RouterError::KvEvent { .. } => (StatusCode::UNPROCESSABLE_ENTITY, "kv_event_rejected"),
            RouterError::RoleNotConfigured(_) => {
                (StatusCode::UNPROCESSABLE_ENTITY, "role_not_configured")
            }
            RouterError::EmptyPrompt => (StatusCode::UNPROCESSABLE_ENTITY, "empty_prompt"),
            RouterError::PromptTooLong { .. } => {
                (StatusCode::UNPROCESSABLE_ENTITY, "prompt_too_long")
            }
            RouterError::NoWorkers(_) | RouterError::NoEligibleWorkers(_) => {
                (StatusCode::SERVICE_UNAVAILABLE, "no_workers")
            }
            RouterError::RequestIdTooLong { .. } => {
                (StatusCode::UNPROCESSABLE_ENTITY, "request_id_too_long")
            }
            RouterError::TooManyOpenBookings { .. } => {
                (StatusCode::SERVICE_UNAVAILABLE, "too_many_open_bookings")
            }
        };
        Self::new(status, code, error.to_string())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({ "error": self.code, "detail": self.detail });
        let mut response = (self.status, axum::Json(body)).into_response();
        response.extensions_mut().insert(ErrorCode(self.code));
        // For the front door's routes, which answer in OpenAI's shape instead.
        response.extensions_mut().insert(self);
        response
    }
}

/// For the front door (OpenAI clients): an error the API's own shape would
/// answer — the token guard's 401, a body over the size limit's 413, a route
/// that does not take the method — in OpenAI's shape, `{"error": {"message",
/// "type", "code"}}`, with the same status and headers.
pub async fn openai_shape(response: Response) -> Response {
    let Some(error) = response.extensions().get::<ApiError>().cloned() else {
        return response;
    };
    let kind = match error.status {
        StatusCode::UNAUTHORIZED => "authentication_error",
        StatusCode::FORBIDDEN => "permission_error",
        StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
        s if s.is_server_error() => "server_error",
        _ => "invalid_request_error",
    };
    let body = serde_json::json!({"error": {
        "message": error.detail,
        "type": kind,
        "param": null,
        "code": error.code,
    }});
    let (mut parts, _) = response.into_parts();
    parts.headers.remove(axum::http::header::CONTENT_LENGTH);
    let mut out = (error.status, axum::Json(body)).into_response();
    out.extensions_mut().insert(ErrorCode(error.code));
    out.extensions_mut()
        .insert(super::gateway::Refusal(error.detail.clone()));
    for (name, value) in &parts.headers {
        if name != axum::http::header::CONTENT_TYPE {
            out.headers_mut().insert(name.clone(), value.clone());
        }
    }
    out
}

/// The code of the error a response answers, as `kvhint_errors_total` counts it:
/// every error answer carries it, whichever shape its body takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ErrorCode(pub &'static str);

/// Counts each error answer by its code: the one place API errors are counted,
/// so a handler cannot forget to (the ext_proc listener counts its own, outside
/// HTTP).
pub async fn count_errors(State(app): State<Arc<App>>, request: Request, next: Next) -> Response {
    let response = next.run(request).await;
    if let Some(ErrorCode(code)) = response.extensions().get::<ErrorCode>() {
        app.metrics.error(code);
    }
    response
}
