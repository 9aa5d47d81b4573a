//! One error vocabulary for every door. The router's refusals ([`RouterError`])
//! and a full queue are answered at two doors:
//!
//! - **the booking API** (`/book`, `/release`, `/workers`, `/kv_events`), in its
//!   own shape, `{"error": <code>, "detail": <text>}` (`service::error::ApiError`),
//!   with the statuses docs/api.md gives its clients;
//! - **the OpenAI doors**: the front door (`/v1/…`, `/generate`, `/tokenize`) and
//!   the endpoint picker's immediate responses to Envoy, in OpenAI's shape,
//!   `{"error": {"message", "type", "param", "code"}}` ([`GatewayError`], written
//!   by [`GatewayError::body`] alone).
//!
//! [`row`] is the one table from a router error to each door's status and code;
//! [`OVERLOADED`] is the row of a full queue, [`BOOKING_QUEUE_FULL`] its message.
//! A router error's message is its own (`Display`), the same at both doors.
//!
//! Where the doors answer the same error differently, it is on purpose:
//!
//! - **Shedding** (`TooManyOpenBookings`, a full booking queue): 503 at the
//!   booking API, as docs/api.md has always answered it; 429 `rate_limit_error`
//!   at the OpenAI doors, which is how OpenAI itself says "too much load, retry
//!   later" and what its clients back off on. There a 503 keeps one meaning: no
//!   worker can take the request (`no_workers`). The code says what the caller
//!   holds: bookings at the booking API, requests at the OpenAI doors.
//! - **A prompt refused** (`EmptyPrompt`, `PromptTooLong`): 422 at the booking
//!   API (the body parsed, its content is refused, as every such refusal there
//!   is); 400 `invalid_request_error` naming `prompt` at the OpenAI doors, as
//!   OpenAI answers any invalid request.
//! - **A role without a policy** (`RoleNotConfigured`): 422 at the booking API,
//!   whose client names the role; 500 at the OpenAI doors, where the role comes
//!   from the model's config, so the operator's config is at fault, not the
//!   client.
//! - **The booking API's own errors** (an unknown worker or request, a duplicate
//!   or over-long request id, runtime data, a KV event): no OpenAI request can
//!   cause them (the router picks the request id, the request path registers
//!   nothing), so one reaching an OpenAI door is the router's fault: 500
//!   `internal`.

use crate::router::RouterError;
use axum::http::StatusCode;

/// An error on an OpenAI door, in OpenAI's shape:
/// `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatewayError {
    pub status: StatusCode,
    /// OpenAI's `type`: `invalid_request_error`, `authentication_error`, …
    pub kind: &'static str,
    pub code: &'static str,
    pub message: String,
    /// The request body's field at fault, if one is (OpenAI's `param`).
    pub param: Option<&'static str>,
}

impl GatewayError {
    pub fn new(
        status: StatusCode,
        kind: &'static str,
        code: &'static str,
        message: impl Into<String>,
    ) -> Self {
        Self {
            status,
            kind,
            code,
            message: message.into(),
            param: None,
        }
    }

    /// The OpenAI doors' answer from the table, with its message.
    pub fn answer(answer: OpenAi, message: impl Into<String>) -> Self {
        Self {
            status: answer.status,
            kind: answer.kind,
            code: answer.code,
            message: message.into(),
            param: answer.param,
        }
    }

    /// The same error, naming the body's field at fault.
    pub fn at(mut self, param: &'static str) -> Self {
        self.param = Some(param);
        self
    }

    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            code,
            message,
        )
    }

    /// A body without `model` where this router serves several (`served`).
    pub fn missing_model(served: &[String]) -> Self {
        Self::bad_request(
            "missing_model",
            format!(
                "the body has no `model`; this router serves: {}",
                served.join(", ")
            ),
        )
        .at("model")
    }

    /// A body's `model` that this router does not serve (it serves `served`).
    pub fn model_not_found(name: &str, served: &[String]) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "model_not_found",
            format!(
                "the model `{name}` does not exist here; this router serves: {} (GET /v1/models)",
                if served.is_empty() {
                    "none (the config has no `models`)".to_string()
                } else {
                    served.join(", ")
                }
            ),
        )
        .at("model")
    }

    /// Every booking thread is busy and the booking queue is full.
    pub fn overloaded() -> Self {
        Self::answer(OVERLOADED.openai, BOOKING_QUEUE_FULL)
    }

    /// A body that is not UTF-8 text.
    pub fn not_utf8() -> Self {
        Self::bad_request("invalid_json", NOT_UTF8)
    }

    /// OpenAI's error body: the one place it is written, for the front door and
    /// the endpoint picker alike.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

/// The code of the error a response answers, as `kvhint_errors_total` counts it
/// and the access log writes it: every error answer carries it (a response
/// extension), whichever shape its body takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ErrorCode(pub &'static str);

/// Every booking thread is busy and the booking queue is full.
impl From<crate::router::pool::Overloaded> for GatewayError {
    fn from(_: crate::router::pool::Overloaded) -> Self {
        GatewayError::overloaded()
    }
}

impl From<RouterError> for GatewayError {
    fn from(error: RouterError) -> Self {
        Self::answer(row(&error).openai, error.to_string())
    }
}

/// How the booking API answers an error: its status and `error` code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Api {
    pub status: StatusCode,
    pub code: &'static str,
}

/// How the OpenAI doors answer an error: status, OpenAI's `type`, `code`, and
/// the body's field at fault (`param`), if the error names one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenAi {
    pub status: StatusCode,
    pub kind: &'static str,
    pub code: &'static str,
    pub param: Option<&'static str>,
}

/// One row of the table: how each door answers one error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Row {
    pub api: Api,
    pub openai: OpenAi,
}

const fn api(status: StatusCode, code: &'static str) -> Api {
    Api { status, code }
}

const fn openai(status: StatusCode, kind: &'static str, code: &'static str) -> OpenAi {
    OpenAi {
        status,
        kind,
        code,
        param: None,
    }
}

const fn at_prompt(answer: OpenAi) -> OpenAi {
    OpenAi {
        param: Some("prompt"),
        ..answer
    }
}

/// A router error no OpenAI request can cause (see the module's notes).
const INTERNAL: OpenAi = openai(
    StatusCode::INTERNAL_SERVER_ERROR,
    "server_error",
    "internal",
);

/// No worker (or no eligible one) to book on: 503 at both doors.
pub const NO_WORKERS: Row = Row {
    api: api(StatusCode::SERVICE_UNAVAILABLE, "no_workers"),
    openai: openai(
        StatusCode::SERVICE_UNAVAILABLE,
        "service_unavailable",
        "no_workers",
    ),
};

/// A prompt over `router.max_prompt_tokens`, found when booking or while
/// tokenizing.
pub const PROMPT_TOO_LONG: Row = Row {
    api: api(StatusCode::UNPROCESSABLE_ENTITY, "prompt_too_long"),
    openai: at_prompt(openai(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        "prompt_too_long",
    )),
};

/// A queue at its bound: the booking pool's (both doors), or the KV-event
/// ingestion's (the booking API only). The caller should retry shortly.
pub const OVERLOADED: Row = Row {
    api: api(StatusCode::SERVICE_UNAVAILABLE, "overloaded"),
    openai: openai(
        StatusCode::TOO_MANY_REQUESTS,
        "rate_limit_error",
        "overloaded",
    ),
};

/// The message of a full booking queue, at every door.
pub const BOOKING_QUEUE_FULL: &str =
    "every booking thread is busy and the booking queue is full; retry shortly";

/// The message of a request body that is not UTF-8 text.
pub const NOT_UTF8: &str = "the body is not UTF-8 text; send JSON";

/// The table: how each door answers a router error (the module's notes say why
/// the doors differ where they do).
pub fn row(error: &RouterError) -> Row {
    use StatusCode as S;
    let (api, openai) = match error {
        RouterError::UnknownWorker { .. } => (api(S::NOT_FOUND, "unknown_worker"), INTERNAL),
        RouterError::UnknownRequest(_) => (api(S::NOT_FOUND, "unknown_request"), INTERNAL),
        RouterError::DuplicateRequest(_) => (api(S::CONFLICT, "duplicate_request"), INTERNAL),
        RouterError::RuntimeData(_) => (
            api(S::UNPROCESSABLE_ENTITY, "invalid_runtime_data"),
            INTERNAL,
        ),
        RouterError::KvEvent { .. } => {
            (api(S::UNPROCESSABLE_ENTITY, "kv_event_rejected"), INTERNAL)
        }
        RouterError::RequestIdTooLong { .. } => (
            api(S::UNPROCESSABLE_ENTITY, "request_id_too_long"),
            INTERNAL,
        ),
        RouterError::RoleNotConfigured(_) => (
            api(S::UNPROCESSABLE_ENTITY, "role_not_configured"),
            openai(
                S::INTERNAL_SERVER_ERROR,
                "server_error",
                "role_not_configured",
            ),
        ),
        RouterError::EmptyPrompt => (
            api(S::UNPROCESSABLE_ENTITY, "empty_prompt"),
            at_prompt(openai(
                S::BAD_REQUEST,
                "invalid_request_error",
                "empty_prompt",
            )),
        ),
        RouterError::PromptTooLong { .. } => return PROMPT_TOO_LONG,
        RouterError::NoWorkers(_) | RouterError::NoEligibleWorkers(_) => return NO_WORKERS,
        RouterError::TooManyOpenBookings { .. } => (
            api(S::SERVICE_UNAVAILABLE, "too_many_open_bookings"),
            openai(
                S::TOO_MANY_REQUESTS,
                "rate_limit_error",
                "too_many_open_requests",
            ),
        ),
    };
    Row { api, openai }
}

/// OpenAI's `type` for an error the booking API's shape answered first on an
/// OpenAI door (the token guard's 401, a body over the limit's 413, a method a
/// route does not take), by its status.
pub fn openai_type(status: StatusCode) -> &'static str {
    match status {
        StatusCode::UNAUTHORIZED => "authentication_error",
        StatusCode::FORBIDDEN => "permission_error",
        StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
        s if s.is_server_error() => "server_error",
        _ => "invalid_request_error",
    }
}

/// One router error of each variant, for the tests that pin the table (here
/// and at the doors).
#[cfg(test)]
pub(crate) fn every_router_error() -> Vec<RouterError> {
    use crate::domain::{Role, RuntimeDataError};
    let errors = vec![
        RouterError::UnknownWorker {
            worker_id: 7,
            dp_rank: 1,
        },
        RouterError::RuntimeData(RuntimeDataError {
            worker_id: 7,
            dp_rank: 0,
            key: "http_endpoint",
            problem: "not a URL".into(),
        }),
        RouterError::KvEvent {
            worker_id: 7,
            dp_rank: 0,
            message: "a block of the wrong size".into(),
            unknown_parent: false,
        },
        RouterError::UnknownRequest("r1".into()),
        RouterError::DuplicateRequest("r1".into()),
        RouterError::RoleNotConfigured(Role::Prefill),
        RouterError::NoWorkers(Role::Decode),
        RouterError::NoEligibleWorkers(Role::Aggregated),
        RouterError::EmptyPrompt,
        RouterError::PromptTooLong {
            tokens: 300,
            max: 256,
        },
        RouterError::RequestIdTooLong { bytes: 65, max: 64 },
        RouterError::TooManyOpenBookings { open: 3 },
    ];
    // A variant added to `RouterError` fails to compile here until it is listed
    // above (and pinned in the tests below).
    for error in &errors {
        match error {
            RouterError::UnknownWorker { .. }
            | RouterError::RuntimeData(_)
            | RouterError::KvEvent { .. }
            | RouterError::UnknownRequest(_)
            | RouterError::DuplicateRequest(_)
            | RouterError::RoleNotConfigured(_)
            | RouterError::NoWorkers(_)
            | RouterError::NoEligibleWorkers(_)
            | RouterError::EmptyPrompt
            | RouterError::PromptTooLong { .. }
            | RouterError::RequestIdTooLong { .. }
            | RouterError::TooManyOpenBookings { .. } => {}
        }
    }
    errors
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The variant's name, for the table below.
    fn name(error: &RouterError) -> String {
        let debug = format!("{error:?}");
        debug
            .split(|c: char| !c.is_alphanumeric())
            .next()
            .unwrap_or_default()
            .to_string()
    }

    /// Each router error → (booking API status, code), (OpenAI doors' status,
    /// type, code, param). The booking API's column is pinned end to end by
    /// tests/serve.rs (`/book`'s 409 and 422s, `/kv_events`' 404 and 422,
    /// `/release`'s 404, `/workers`' 422) and tests/trust.rs (422
    /// `request_id_too_long`, 503 `too_many_open_bookings`); the OpenAI doors'
    /// by tests/gateway.rs (503 `no_workers`), tests/trust.rs (400
    /// `prompt_too_long` at `prompt`) and tests/endpoint_picker.rs (429
    /// `too_many_open_requests`, 503 `no_workers`).
    #[allow(clippy::type_complexity)]
    #[rustfmt::skip]
    const TABLE: &[(&str, (u16, &str), (u16, &str, &str, Option<&str>))] = &[
        ("UnknownWorker", (404, "unknown_worker"), (500, "server_error", "internal", None)),
        ("RuntimeData", (422, "invalid_runtime_data"), (500, "server_error", "internal", None)),
        ("KvEvent", (422, "kv_event_rejected"), (500, "server_error", "internal", None)),
        ("UnknownRequest", (404, "unknown_request"), (500, "server_error", "internal", None)),
        ("DuplicateRequest", (409, "duplicate_request"), (500, "server_error", "internal", None)),
        ("RoleNotConfigured", (422, "role_not_configured"), (500, "server_error", "role_not_configured", None)),
        ("NoWorkers", (503, "no_workers"), (503, "service_unavailable", "no_workers", None)),
        ("NoEligibleWorkers", (503, "no_workers"), (503, "service_unavailable", "no_workers", None)),
        ("EmptyPrompt", (422, "empty_prompt"), (400, "invalid_request_error", "empty_prompt", Some("prompt"))),
        ("PromptTooLong", (422, "prompt_too_long"), (400, "invalid_request_error", "prompt_too_long", Some("prompt"))),
        ("RequestIdTooLong", (422, "request_id_too_long"), (500, "server_error", "internal", None)),
        ("TooManyOpenBookings", (503, "too_many_open_bookings"), (429, "rate_limit_error", "too_many_open_requests", None)),
    ];

    #[test]
    fn each_router_error_has_its_status_and_code_at_each_door() {
        let errors = every_router_error();
        assert_eq!(errors.len(), TABLE.len());
        for error in errors {
            let name = name(&error);
            let (_, (api_status, api_code), (status, kind, code, param)) = TABLE
                .iter()
                .find(|(n, ..)| *n == name)
                .unwrap_or_else(|| panic!("{name} is not in the table"));
            let row = row(&error);
            assert_eq!(row.api.status.as_u16(), *api_status, "{name}");
            assert_eq!(row.api.code, *api_code, "{name}");
            assert_eq!(
                (
                    row.openai.status.as_u16(),
                    row.openai.kind,
                    row.openai.code,
                    row.openai.param
                ),
                (*status, *kind, *code, *param),
                "{name}"
            );
            // The OpenAI doors answer it from the row, with the error's message.
            let answered = GatewayError::from(error.clone());
            assert_eq!(answered.status.as_u16(), *status, "{name}");
            assert_eq!(answered.kind, *kind, "{name}");
            assert_eq!(answered.code, *code, "{name}");
            assert_eq!(answered.param, *param, "{name}");
            assert_eq!(answered.message, error.to_string(), "{name}");
        }
    }

    #[test]
    fn a_full_queue_is_503_at_the_booking_api_and_429_at_the_openai_doors() {
        assert_eq!(OVERLOADED.api.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(OVERLOADED.api.code, "overloaded");
        let error = GatewayError::overloaded();
        assert_eq!(error.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(error.kind, "rate_limit_error");
        assert_eq!(error.code, "overloaded");
        assert_eq!(error.param, None);
        assert_eq!(error.message, BOOKING_QUEUE_FULL);
    }

    #[test]
    fn the_openai_body_has_message_type_param_and_code() {
        let error = GatewayError::from(RouterError::EmptyPrompt);
        assert_eq!(
            error.body(),
            serde_json::json!({"error": {
                "message": "the request has no token ids",
                "type": "invalid_request_error",
                "param": "prompt",
                "code": "empty_prompt",
            }})
        );
        let error = GatewayError::overloaded();
        assert_eq!(error.body()["error"]["param"], serde_json::Value::Null);
    }

    #[test]
    fn an_api_shaped_error_takes_the_openai_type_its_status_means() {
        for (status, kind) in [
            (401, "authentication_error"),
            (403, "permission_error"),
            (429, "rate_limit_error"),
            (500, "server_error"),
            (503, "server_error"),
            (400, "invalid_request_error"),
            (404, "invalid_request_error"),
            (405, "invalid_request_error"),
            (413, "invalid_request_error"),
            (415, "invalid_request_error"),
        ] {
            let status = StatusCode::from_u16(status).unwrap();
            assert_eq!(openai_type(status), kind, "{status}");
        }
    }
}
