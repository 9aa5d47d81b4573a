//! One error shape for every API failure: `{"error": <code>, "detail": <text>}`
//! with the status code that fits, so clients can branch on `error` and show
//! `detail` to a person.

use crate::router::RouterError;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

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
        (self.status, axum::Json(body)).into_response()
    }
}
