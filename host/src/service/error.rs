//! One error shape for every API failure: `{"error": <code>, "detail": <text>}`
//! with the status code that fits, so clients can branch on `error` and show
//! `detail` to a person. Which status and code a router error or a full queue
//! gets, at this door and at the OpenAI doors, is one table:
//! `gateway::error::row`.

use crate::gateway::error::{self, GatewayError};
use crate::router::pool::Overloaded;
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

    /// A queue at its bound (the table's [`error::OVERLOADED`]); the client
    /// should retry shortly.
    pub fn overloaded(detail: impl Into<String>) -> Self {
        Self::answer(error::OVERLOADED.api, detail)
    }

    /// The booking API's answer from the table, with its detail.
    pub fn answer(answer: error::Api, detail: impl Into<String>) -> Self {
        Self::new(answer.status, answer.code, detail)
    }
}

/// A router error as the booking API answers it: the table's row
/// (`gateway::error::row`), with the error's own message.
impl From<RouterError> for ApiError {
    fn from(error: RouterError) -> Self {
        Self::answer(error::row(&error).api, error.to_string())
    }
}

/// Every booking thread is busy and the booking queue is full.
impl From<Overloaded> for ApiError {
    fn from(_: Overloaded) -> Self {
        Self::overloaded(error::BOOKING_QUEUE_FULL)
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
    let (mut parts, _) = response.into_parts();
    parts.headers.remove(axum::http::header::CONTENT_LENGTH);
    let mut out = openai_response(GatewayError::new(
        error.status,
        error::openai_type(error.status),
        error.code,
        error.detail,
    ));
    for (name, value) in &parts.headers {
        if name != axum::http::header::CONTENT_TYPE {
            out.headers_mut().insert(name.clone(), value.clone());
        }
    }
    out
}

/// An error in OpenAI's shape, carrying its code (for the error counter and the
/// access log) and its message (why, for the access log).
pub fn openai_response(error: GatewayError) -> Response {
    let mut response = (error.status, axum::Json(error.body())).into_response();
    response.extensions_mut().insert(ErrorCode(error.code));
    response
        .extensions_mut()
        .insert(crate::gateway::access_log::Refusal(error.message));
    response
}

pub use crate::gateway::error::ErrorCode;

/// Counts each error answer by its code: the one place API errors are counted,
/// so a handler cannot forget to (the ext_proc listener counts its own, outside
/// HTTP).
pub async fn count_errors(
    State(metrics): State<Arc<super::metrics::Metrics>>,
    request: Request,
    next: Next,
) -> Response {
    let response = next.run(request).await;
    if let Some(ErrorCode(code)) = response.extensions().get::<ErrorCode>() {
        metrics.error(code);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gateway::error::every_router_error;

    async fn json(response: Response) -> (u16, serde_json::Value) {
        let status = response.status().as_u16();
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
            .await
            .unwrap();
        (status, serde_json::from_slice(&bytes).unwrap())
    }

    /// The booking API's door: each router error with the table's status and
    /// code (pinned value by value in `gateway::error`'s tests), its own message
    /// as the detail, in the API's shape.
    #[tokio::test]
    async fn the_booking_api_answers_each_router_error_from_the_table() {
        for error in every_router_error() {
            let row = error::row(&error);
            let answered = ApiError::from(error.clone());
            assert_eq!(
                (answered.status, answered.code),
                (row.api.status, row.api.code),
                "{error:?}"
            );
            let (status, body) = json(answered.into_response()).await;
            assert_eq!(status, row.api.status.as_u16(), "{error:?}");
            assert_eq!(
                body,
                serde_json::json!({"error": row.api.code, "detail": error.to_string()})
            );
        }
        // The three the issue found the doors disagreeing on, per door.
        let too_many = RouterError::TooManyOpenBookings { open: 3 };
        assert_eq!(ApiError::from(too_many.clone()).status.as_u16(), 503);
        assert_eq!(GatewayError::from(too_many).status.as_u16(), 429);
        assert_eq!(
            ApiError::from(RouterError::EmptyPrompt).status.as_u16(),
            422
        );
        assert_eq!(
            GatewayError::from(RouterError::EmptyPrompt).status.as_u16(),
            400
        );
    }

    #[test]
    fn a_full_booking_queue_is_503_at_the_booking_api_and_429_at_the_openai_doors() {
        let api = ApiError::from(Overloaded);
        assert_eq!(api.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(api.code, "overloaded");
        assert_eq!(api.detail, error::BOOKING_QUEUE_FULL);
        let openai = GatewayError::from(Overloaded);
        assert_eq!(openai.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(openai.kind, "rate_limit_error");
        assert_eq!(openai.code, "overloaded");
        assert_eq!(openai.message, error::BOOKING_QUEUE_FULL);
    }

    /// On the front door, an error first answered in the API's shape (the token
    /// guard's 401) is answered in OpenAI's, with its status, code, headers and
    /// the code and reason the counter and the access log read.
    #[tokio::test]
    async fn an_api_error_on_the_front_door_takes_openai_s_shape() {
        let mut response =
            ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", "no token").into_response();
        response.headers_mut().insert(
            axum::http::header::WWW_AUTHENTICATE,
            axum::http::HeaderValue::from_static("Bearer"),
        );
        let response = openai_shape(response).await;
        assert_eq!(response.headers()["www-authenticate"], "Bearer");
        assert_eq!(
            response.extensions().get::<ErrorCode>(),
            Some(&ErrorCode("unauthorized"))
        );
        assert_eq!(
            response
                .extensions()
                .get::<crate::gateway::access_log::Refusal>()
                .map(|r| r.0.as_str()),
            Some("no token")
        );
        let (status, body) = json(response).await;
        assert_eq!(status, 401);
        assert_eq!(
            body,
            serde_json::json!({"error": {
                "message": "no token",
                "type": "authentication_error",
                "param": null,
                "code": "unauthorized",
            }})
        );
    }
}
