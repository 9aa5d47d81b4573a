//! The JSON body extractor: size-limited, time-limited, strict, and failing in
//! the API's one error shape (axum's own `Json` answers in plain text).
//!
//! A declared `Content-Length` over the limit is refused before the body is read,
//! so a client that sent `Expect: 100-continue` gets its 413 at once instead of a
//! `100 Continue` and a wasted upload. The body must arrive whole within the
//! connection's body deadline (`--body-timeout-ms`): a peer that drips it byte by
//! byte is cut off, not waited for.

use super::error::ApiError;
use super::listener::BodyDeadline;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, FromRequest, Request};
use axum::http::{header, HeaderMap, StatusCode};
use serde::de::DeserializeOwned;

pub struct JsonBody<T>(pub T);

/// Whether `value` is a JSON media type (`application/json`, `application/*+json`,
/// any case, any parameters), or the form type `curl -d` sends by default.
pub fn is_json_media_type(value: &str) -> bool {
    let Ok(media) = value.parse::<mime::Mime>() else {
        return false;
    };
    media.type_() == mime::APPLICATION
        && (media.subtype() == mime::JSON
            || media.suffix() == Some(mime::JSON)
            // curl -d sends form encoding by default; accept it as JSON rather
            // than make every shell user add a header.
            || media.subtype() == mime::WWW_FORM_URLENCODED)
}

fn too_large(detail: impl std::fmt::Display) -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "payload_too_large",
        format!("{detail}; the limit is set with --max-body-bytes"),
    )
}

/// The declared body length, if any, checked against `limit`.
fn check_declared_length(headers: &HeaderMap, limit: Option<usize>) -> Result<(), ApiError> {
    let (Some(limit), Some(declared)) = (limit, headers.get(header::CONTENT_LENGTH)) else {
        return Ok(());
    };
    match declared
        .to_str()
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
    {
        Some(length) if length > limit as u64 => Err(too_large(format!(
            "the body is declared as {length} bytes, more than the {limit} this router accepts"
        ))),
        _ => Ok(()),
    }
}

/// The body limit the routes were built with (see `routes`).
#[derive(Debug, Clone, Copy)]
pub struct BodyLimit(pub usize);

impl<S, T> FromRequest<S> for JsonBody<T>
where
    S: Send + Sync,
    T: DeserializeOwned,
{
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, ApiError> {
        let bytes = json_bytes(request, state).await?;
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

/// A JSON body's bytes, read as [`JsonBody`] reads them (type, size and time
/// checked) but not decoded: the gateway forwards what the client wrote.
pub struct RawJson(pub Bytes);

impl<S: Send + Sync> FromRequest<S> for RawJson {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, ApiError> {
        json_bytes(request, state).await.map(RawJson)
    }
}

/// The body of a JSON request, whole, within the size limit and the body deadline.
async fn json_bytes<S: Send + Sync>(request: Request, state: &S) -> Result<Bytes, ApiError> {
    {
        if let Some(kind) = request.headers().get(header::CONTENT_TYPE) {
            let kind = kind.to_str().unwrap_or("");
            if !is_json_media_type(kind) {
                return Err(ApiError::new(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "unsupported_media_type",
                    format!(
                        "the body must be JSON (Content-Type: application/json), not {:?}",
                        kind
                    ),
                ));
            }
        }
        let limit = request.extensions().get::<BodyLimit>().map(|l| l.0);
        check_declared_length(request.headers(), limit)?;
        let deadline = request.extensions().get::<BodyDeadline>().map(|d| d.0);
        let read = Bytes::from_request(request, state);
        let bytes = match deadline {
            Some(deadline) => tokio::time::timeout(deadline, read).await.map_err(|_| {
                ApiError::new(
                    StatusCode::REQUEST_TIMEOUT,
                    "body_timeout",
                    format!(
                        "the body did not arrive within {} ms (--body-timeout-ms); send it whole, at once",
                        deadline.as_millis()
                    ),
                )
            })?,
            None => read.await,
        };
        bytes.map_err(|e| {
            if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
                too_large(e.body_text())
            } else {
                ApiError::bad_request(e.body_text())
            }
        })
    }
}

/// The body limit as both axum's layer and the extension the extractor reads.
pub fn limit_layers(router: axum::Router, max_body_bytes: usize) -> axum::Router {
    router
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .layer(axum::Extension(BodyLimit(max_body_bytes)))
}

impl ApiError {
    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = code;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::is_json_media_type;

    #[test]
    fn media_types_are_parsed_not_prefix_matched() {
        for accepted in [
            "application/json",
            "APPLICATION/JSON",
            "application/json; charset=utf-8",
            "Application/Json;charset=UTF-8",
            "application/problem+json",
            "application/x-www-form-urlencoded",
        ] {
            assert!(is_json_media_type(accepted), "{accepted}");
        }
        for refused in [
            "application/jsonfoo",
            "application/json-seq2",
            "text/plain",
            "text/json",
            "multipart/form-data; boundary=x",
            "",
            "json",
        ] {
            assert!(!is_json_media_type(refused), "{refused}");
        }
    }
}
