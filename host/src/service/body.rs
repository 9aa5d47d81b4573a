//! The JSON body extractor: size-limited, strict, and failing in the API's one
//! error shape (axum's own `Json` answers in plain text).

use super::error::ApiError;
use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::{header, StatusCode};
use serde::de::DeserializeOwned;

pub struct JsonBody<T>(pub T);

impl<S, T> FromRequest<S> for JsonBody<T>
where
    S: Send + Sync,
    T: DeserializeOwned,
{
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, ApiError> {
        if let Some(kind) = request.headers().get(header::CONTENT_TYPE) {
            let kind = kind.to_str().unwrap_or("");
            // curl -d sends form encoding by default; accept it as JSON rather
            // than make every shell user add a header.
            if !(kind.starts_with("application/json")
                || kind.starts_with("application/x-www-form-urlencoded"))
            {
                return Err(ApiError::new(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "unsupported_media_type",
                    format!("the body must be JSON (Content-Type: application/json), not {kind}"),
                ));
            }
        }
        let bytes = Bytes::from_request(request, state).await.map_err(|e| {
            if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "payload_too_large",
                    format!("{}; the limit is set with --max-body-bytes", e.body_text()),
                )
            } else {
                ApiError::bad_request(e.body_text())
            }
        })?;
        serde_json::from_slice(&bytes).map(JsonBody).map_err(|e| {
            let text = e.to_string();
            // Only the router attaches hints: say so plainly.
            if ["`hint`", "`hints`", "`actions`"]
                .iter()
                .any(|field| text.starts_with(&format!("unknown field {field}")))
            {
                ApiError::bad_request(format!(
                    "a request may not carry hints ({text}); only the router attaches hints, after it books the worker"
                ))
                .with_code("client_hint_refused")
            } else {
                ApiError::bad_request(format!("invalid request body: {text}"))
            }
        })
    }
}

impl ApiError {
    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = code;
        self
    }
}
