//! The gateway: kvhint in the request path. An OpenAI request (or SGLang's native
//! `/generate`) is rendered and tokenized as its engine would, booked on a worker
//! that serves its model, and forwarded there through the engine's adapter, with
//! the hint where the engine takes one; the answer streams back as it comes, and
//! the booking is released on every way out (see [`release`]).
//!
//! ```text
//! client ─► route ─► prepare (model, render, tokenize) ─► book ─► adapter ─► worker
//!    ▲                                                                  │
//!    └──────────── bytes as they come; release when the response ends ◄─┘
//! ```
//!
//! The whole request path is here, reading only what [`RequestPath`] holds:
//! booking for a request ([`dispatch`], on the booking threads), the attempt
//! loop ([`proxy`], on the runtime), the background checks ([`checks`]), the
//! access log. The HTTP handlers (`service::gateway`) and the endpoint picker
//! (`service::endpoint_picker`) are doors over it: they decode what arrives
//! and encode what it answers.

pub mod access_log;
pub mod adapter;
pub mod approximate;
pub mod capacity;
pub mod checks;
pub mod disaggregated;
pub mod dispatch;
pub mod error;
pub mod health;
pub mod pair;
pub mod proxy;
pub mod release;
pub mod send;
pub mod signals;
pub mod stats;
pub mod tokenize;
pub mod trace;
pub mod upstream;

use crate::domain::{HttpTarget, Worker, WorkerKey};
use crate::models::{ChatRequest, EncodeError, Model, PieceStats, TooLong};
use crate::router::ingest::Ingest;
use crate::router::pool::BookingPool;
use crate::router::{BookRequest, Booking, Router};
use crate::snapshot::Snapshot;
use crate::splice::Body;
use adapter::Route;
use arc_swap::ArcSwap;
use bytes::Bytes;
pub use error::GatewayError;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The upstream client.
pub type UpstreamClient = Client<upstream::Connector, Full<Bytes>>;

/// How long a connection to a worker may sit idle in the pool. Below the 5 s
/// after which the engines' HTTP servers (cpp-httplib in llama.cpp, uvicorn in
/// vLLM and SGLang) close an idle keep-alive connection: a pooled connection is
/// dropped here before its worker closes it, rather than written to as the
/// worker's close is on its way.
pub const POOL_IDLE: Duration = Duration::from_secs(3);

/// The hop header: the marks of the routers a request passed through.
pub const VIA_HEADER: &str = "x-kvhint-via";
/// Routers a request may pass through before it is taken for a loop.
pub const MAX_HOPS: usize = 8;

/// What the request path reads, and nothing else of the service: the router,
/// where KV credits go, the booking threads, the serving snapshot, the
/// gateway's own state, and what counts a booking. Cheap to clone (shared
/// handles), so a booking job or a background task takes its own.
#[derive(Clone)]
pub struct RequestPath {
    pub router: Arc<Router>,
    /// The one path KV events (and the gateway's credits) take into the index.
    pub ingest: Ingest,
    /// Where bookings run, off the async runtime's workers.
    pub bookings: Arc<BookingPool>,
    /// The serving snapshot: read once per request, whatever a reload does meanwhile.
    pub snapshot: Arc<ArcSwap<Snapshot>>,
    pub gateway: Arc<Gateway>,
    /// Counts a booking the path made (the service's booking counters).
    pub on_booked: Arc<dyn Fn(&Booking) + Send + Sync>,
}

/// What the gateway keeps between requests.
pub struct Gateway {
    pub client: UpstreamClient,
    /// Never reuses a connection: for the one re-send of a request whose pooled
    /// connection the worker had closed.
    pub fresh: UpstreamClient,
    pub health: health::Health,
    pub stats: Arc<stats::GatewayStats>,
    /// What `kv_events: approximate` workers were credited with.
    pub approximate: approximate::Approximate,
    /// OpenTelemetry traces, when `gateway.tracing` is configured.
    pub tracing: Option<trace::Tracing>,
    next_id: AtomicU64,
    next_room: AtomicU64,
    /// Makes request ids unique across restarts (engines key requests by id).
    instance: u64,
    /// `kvhint-` and `instance` in hex: this router's mark in `x-kvhint-via`.
    via: String,
}

impl Gateway {
    /// From the first config's `gateway:` (the connect timeout and the TLS
    /// roots are fixed until restart, as the connection pool is).
    /// Call it inside the Tokio runtime (the trace exporter's gRPC client
    /// lives there).
    pub fn new(settings: &crate::config::GatewayConfig) -> Result<Self, String> {
        let tls = |e: upstream::TlsSetupError| match &settings.tls_ca {
            Some(ca) => format!("gateway.tls_ca_file ({}): {e}", ca.file.display()),
            None => format!("gateway: {e}"),
        };
        let connector = upstream::Connector::new(
            Duration::from_millis(settings.connect_timeout_ms),
            upstream::tls_roots(settings.tls_ca.as_ref()).map_err(tls)?,
        )
        .map_err(tls)?;
        let tracing = match &settings.tracing {
            Some(config) => {
                Some(trace::Tracing::start(config).map_err(|e| format!("gateway.tracing: {e}"))?)
            }
            None => None,
        };
        let client = Client::builder(hyper_util::rt::TokioExecutor::new())
            .pool_idle_timeout(POOL_IDLE)
            .pool_timer(hyper_util::rt::TokioTimer::new())
            .build(connector.clone());
        let fresh = Client::builder(hyper_util::rt::TokioExecutor::new())
            .pool_max_idle_per_host(0)
            .build(connector);
        let instance = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
            ^ u64::from(std::process::id()).rotate_left(40);
        Ok(Self {
            client,
            fresh,
            health: health::Health::default(),
            stats: Arc::default(),
            approximate: approximate::Approximate::default(),
            tracing,
            next_id: AtomicU64::new(0),
            next_room: AtomicU64::new(0),
            instance,
            via: format!("kvhint-{instance:016x}"),
        })
    }

    /// This router's mark in `x-kvhint-via`, the hop header on every request it
    /// forwards: a request that comes back carrying it has looped (a worker's
    /// `http_endpoint` leads back to a router), and is refused, not forwarded
    /// again.
    pub fn via_mark(&self) -> &str {
        &self.via
    }

    /// Whether a request with these headers is one this router forwarded, or
    /// one that passed through more routers than any fleet chains: the
    /// refusal to send instead of forwarding it.
    pub fn looped(&self, headers: &axum::http::HeaderMap) -> Option<GatewayError> {
        let mark = self.via_mark();
        let mut hops = 0usize;
        for value in headers.get_all(VIA_HEADER) {
            let text = String::from_utf8_lossy(value.as_bytes());
            for hop in text.split(',') {
                hops += 1;
                if hop.trim() == mark {
                    return Some(GatewayError::new(
                        axum::http::StatusCode::LOOP_DETECTED,
                        "upstream_error",
                        "loop_detected",
                        format!("this request already passed through this router ({VIA_HEADER} carries its mark {mark}): a worker's http_endpoint leads back to a router; point every worker at its engine"),
                    ));
                }
            }
        }
        (hops >= MAX_HOPS).then(|| {
            GatewayError::new(
                axum::http::StatusCode::LOOP_DETECTED,
                "upstream_error",
                "loop_detected",
                format!("this request passed through {hops} routers ({VIA_HEADER}); more than {MAX_HOPS} means a loop through routers that point at each other"),
            )
        })
    }

    /// A `bootstrap_room` for an SGLang pair: below 2^63 (SGLang reads it as a
    /// signed 64-bit integer), and none this router minted before within 2^63
    /// rooms: a bijection on 63 bits of a counter offset by the instance, so
    /// replicas start apart. Never the client's: two pairs in one room collide
    /// in SGLang's schedulers.
    pub fn bootstrap_room(&self) -> u64 {
        mint_room(
            self.instance,
            self.next_room.fetch_add(1, Ordering::Relaxed),
        )
    }

    /// A request id no other request of this router has had.
    pub fn request_id(&self) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("kvh-{:012x}-{n}", self.instance & 0xffff_ffff_ffff)
    }
}

/// Room `n` of the router `instance`: multiplying by an odd number and
/// xor-shifting right are each a bijection on 63-bit values, so distinct
/// counters give distinct rooms, scattered over `0..2^63`.
fn mint_room(instance: u64, n: u64) -> u64 {
    const MASK: u64 = (1 << 63) - 1;
    let mut x = n.wrapping_add(instance) & MASK;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9) & MASK;
    x ^= x >> 31;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb) & MASK;
    x ^ (x >> 29)
}

/// A request read, its model found and its prompt tokenized.
pub struct Prepared {
    pub route: Route,
    pub model: Arc<Model>,
    pub token_ids: Vec<u32>,
    pub cache_salt: Option<String>,
    /// The client asked for a stream (`"stream": true`): the worker's head comes
    /// at once and bytes follow as tokens do; otherwise nothing comes until the
    /// whole answer is ready.
    pub stream: bool,
    pub tokenize: Duration,
    /// What the tokenizer's piece cache held of the prompt.
    pub pieces: PieceStats,
}

/// Reads what the router needs from a request body: the model, and the prompt as
/// token ids (rendered and tokenized here, on the caller's thread: a booking
/// thread). `default_model`: the model a `/generate` body without `model` means.
pub fn prepare(
    snapshot: &Snapshot,
    route: Route,
    body: &Body<'_>,
) -> Result<Prepared, GatewayError> {
    let field =
        |key: &'static str| move |e: String| GatewayError::bad_request("invalid_field", e).at(key);
    if body.has("kv_hints") {
        return Err(GatewayError::bad_request(
            "client_hints_refused",
            "the body has `kv_hints`: only the router attaches hints; remove the field",
        )
        .at("kv_hints"));
    }
    let name: Option<String> = body.get("model").map_err(field("model"))?;
    let name = match (name, route) {
        (Some(name), _) => name,
        // SGLang's /generate names no model: the one model served, if only one.
        (None, Route::Generate) if snapshot.models.names().len() == 1 => {
            snapshot.models.names()[0].clone()
        }
        (None, _) => return Err(GatewayError::missing_model(snapshot.models.names())),
    };
    let Some(model) = snapshot.models.get(&name) else {
        return Err(GatewayError::model_not_found(
            &name,
            snapshot.models.names(),
        ));
    };
    let cache_salt: Option<String> = body.get("cache_salt").map_err(field("cache_salt"))?;
    let stream = body
        .get::<bool>("stream")
        .map_err(field("stream"))?
        .unwrap_or(false);
    let started = Instant::now();
    // The router refuses a prompt over `router.max_prompt_tokens` when it books;
    // tokenizing stops as soon as the count passes it, so that a prompt megabytes
    // over costs what one at the bound costs, not what its whole text would.
    let max = snapshot.limits.max_prompt_tokens;
    let encoded = |param: &'static str| {
        move |e: EncodeError| match e {
            EncodeError::Invalid(e) => GatewayError::bad_request("invalid_prompt", e.0).at(param),
            EncodeError::TooLong(too_long) => prompt_too_long(too_long),
        }
    };
    let (token_ids, pieces) = match route {
        Route::Chat => {
            let request = ChatRequest::from_body(body)
                .map_err(|e| GatewayError::bad_request("invalid_messages", e).at("messages"))?;
            model
                .tokenizer
                .encode_chat_within(&request, max)
                .map_err(encoded("messages"))?
        }
        // Token ids are counted, not tokenized: the router refuses too many when
        // it books.
        Route::Completions => match prompt(body, "prompt")? {
            Some(Prompt::Ids(ids)) => (ids, PieceStats::default()),
            Some(Prompt::Text(text)) => model
                .tokenizer
                .encode_prompt_within(&text, max)
                .map_err(encoded("prompt"))?,
            None => {
                return Err(
                    GatewayError::bad_request("missing_prompt", "the body has no `prompt`")
                        .at("prompt"),
                )
            }
        },
        Route::Embeddings => (embedding_input(model, body, max)?, PieceStats::default()),
        Route::Generate => {
            match (prompt(body, "input_ids")?, prompt(body, "text")?) {
                (Some(Prompt::Ids(ids)), None) => (ids, PieceStats::default()),
                (None, Some(Prompt::Text(text))) => model
                    .tokenizer
                    .encode_prompt_within(&text, max)
                    .map_err(encoded("text"))?,
                (Some(_), Some(_)) => {
                    return Err(GatewayError::bad_request(
                        "invalid_prompt",
                        "give `text` or `input_ids`, not both",
                    )
                    .at("input_ids"))
                }
                _ => return Err(GatewayError::bad_request(
                    "missing_prompt",
                    "the body has neither `text` (a string) nor `input_ids` (a list of token ids)",
                )),
            }
        }
    };
    Ok(Prepared {
        route,
        model: Arc::clone(model),
        token_ids,
        cache_salt,
        stream,
        tokenize: started.elapsed(),
        pieces,
    })
}

/// The refusal of a prompt found over `router.max_prompt_tokens` while it was
/// tokenized: the router's own ([`error::PROMPT_TOO_LONG`]), saying where
/// counting stopped.
pub(crate) fn prompt_too_long(too_long: TooLong) -> GatewayError {
    GatewayError::answer(error::PROMPT_TOO_LONG.openai, too_long.to_string())
}

/// An embeddings request's `input` as token ids: a string, a list of ids, or a
/// batch of either, every item's ids one after the other. The ids are not sent
/// (the engine gets the client's body); they weigh the request's load and key
/// its booking, so they are held to `max` (`router.max_prompt_tokens`) as a
/// prompt is: each text is tokenized within what the items before it left.
fn embedding_input(model: &Model, body: &Body<'_>, max: usize) -> Result<Vec<u32>, GatewayError> {
    #[derive(serde::Deserialize)]
    #[serde(untagged)]
    enum Input {
        Text(String),
        Ids(Vec<u32>),
        Texts(Vec<String>),
        IdLists(Vec<Vec<u32>>),
    }
    let Some(raw) = body.raw("input") else {
        return Err(GatewayError::bad_request(
            "missing_input",
            "the body has no `input`: a string, a list of strings, or token ids",
        )
        .at("input"));
    };
    let input: Input = serde_json::from_str(raw).map_err(|_| {
        GatewayError::bad_request(
            "invalid_input",
            "`input` is a string, a list of strings, a list of token ids, or a list of such lists",
        )
        .at("input")
    })?;
    let encode = |text: &str, before: usize| {
        model
            .tokenizer
            .encode_prompt_within(text, max.saturating_sub(before))
            .map(|(ids, _)| ids)
            .map_err(|e| match e {
                EncodeError::Invalid(e) => {
                    GatewayError::bad_request("invalid_input", e.0).at("input")
                }
                EncodeError::TooLong(too_long) => prompt_too_long(TooLong {
                    counted: too_long.counted + before,
                    max,
                    ..too_long
                }),
            })
    };
    let ids = match input {
        Input::Text(text) => encode(&text, 0)?,
        Input::Ids(ids) => ids,
        Input::Texts(texts) => {
            let mut ids = Vec::new();
            for text in &texts {
                ids.extend(encode(text, ids.len())?);
            }
            ids
        }
        Input::IdLists(lists) => lists.concat(),
    };
    Ok(ids)
}

enum Prompt {
    Text(String),
    Ids(Vec<u32>),
}

/// A prompt field: a string, a list of token ids, or a list holding one of
/// either. A batch is refused: the router books one worker per request.
fn prompt(body: &Body<'_>, key: &'static str) -> Result<Option<Prompt>, GatewayError> {
    let Some(raw) = body.raw(key) else {
        return Ok(None);
    };
    #[derive(serde::Deserialize)]
    #[serde(untagged)]
    enum Shape {
        Text(String),
        Ids(Vec<u32>),
        Texts(Vec<String>),
        IdLists(Vec<Vec<u32>>),
    }
    let batch = || {
        GatewayError::bad_request(
            "batch_not_supported",
            format!("`{key}` holds several prompts; send one prompt per request (each is booked on its own worker)"),
        )
        .at(key)
    };
    match serde_json::from_str::<Shape>(raw) {
        Ok(Shape::Text(text)) => Ok(Some(Prompt::Text(text))),
        Ok(Shape::Ids(ids)) => Ok(Some(Prompt::Ids(ids))),
        Ok(Shape::Texts(mut texts)) if texts.len() == 1 => Ok(texts.pop().map(Prompt::Text)),
        Ok(Shape::IdLists(mut lists)) if lists.len() == 1 => Ok(lists.pop().map(Prompt::Ids)),
        Ok(_) => Err(batch()),
        Err(_) => Err(GatewayError::bad_request(
            "invalid_prompt",
            format!("`{key}` is a string or a list of token ids (whole numbers below 2^32)"),
        )
        .at(key)),
    }
}

/// Which workers a request may go to beyond the gateway's own rules (the
/// endpoint picker's subset hint from the proxy); `None`: any.
pub type Allowed<'a> = Option<&'a (dyn Fn(&HttpTarget) -> bool + Sync)>;

/// Whether `worker` may take `prepared`: it serves the model and the route,
/// is `allowed`, was not `tried` already, and is healthy with its circuit
/// closed.
pub fn eligible(
    gateway: &Gateway,
    prepared: &Prepared,
    tried: &[WorkerKey],
    allowed: Allowed<'_>,
    worker: &Worker,
) -> bool {
    worker.http.as_ref().is_some_and(|http| {
        http.serves(&prepared.model.name)
            && prepared.route.served_by(http.engine)
            && allowed.is_none_or(|allowed| allowed(http))
    }) && !tried.contains(&worker.key)
        && gateway.health.admits(worker.key)
}

/// What a booking is for: the request id it is opened under, the role it is
/// booked on, and the worker its KV comes from (the decode leg of a
/// disaggregated pair).
#[derive(Debug, Clone, Copy)]
pub struct BookAs<'a> {
    pub request_id: &'a str,
    pub role: crate::domain::Role,
    pub receive_from: Option<WorkerKey>,
}

/// Books a prepared request on a worker that serves its model and route, is
/// healthy with its circuit closed, is not in `tried`, and is `allowed`. Runs on
/// a booking thread.
pub fn book_eligible(
    router: &Router,
    snapshot: &Snapshot,
    gateway: &Gateway,
    prepared: &Prepared,
    book_as: BookAs<'_>,
    tried: &[WorkerKey],
    allowed: Allowed<'_>,
) -> Result<(Booking, Arc<Worker>, Arc<HttpTarget>), GatewayError> {
    let BookAs {
        request_id,
        role: role_name,
        receive_from,
    } = book_as;
    let model = &prepared.model;
    let role = crate::router::configured_role(snapshot, role_name)?;
    let eligible = |worker: &Worker| eligible(gateway, prepared, tried, allowed, worker);
    // What running requests pin of this prompt on event-fed workers: their
    // engines cannot drop it, whatever the booking anticipates (read only when
    // bookings anticipate evictions).
    let pinned_prefix =
        if snapshot.gateway.credit_in_flight && snapshot.gateway.anticipate_evictions {
            gateway.approximate.pinned_prefix(&approximate::Prompt {
                token_ids: &prepared.token_ids,
                block_size: snapshot.block_size,
                lora: model.lora.as_deref(),
                salt: prepared.cache_salt.as_deref(),
                cached_blocks: 0,
            })
        } else {
            Vec::new()
        };
    let request = BookRequest {
        request_id,
        role: role_name,
        token_ids: &prepared.token_ids,
        session_context: None,
        lora_name: model.lora.as_deref(),
        cache_salt: prepared.cache_salt.as_deref(),
        pinned_prefix: &pinned_prefix,
        receive_from,
    };
    let booking = router.book_among(role, &request, Some(&eligible))?;
    let worker = router.worker(booking.worker);
    let Some((worker, target)) = worker.and_then(|w| Some((Arc::clone(&w), w.http.clone()?)))
    else {
        // Deregistered between the booking and now.
        let _ = router.release(request_id);
        return Err(GatewayError::answer(
            error::NO_WORKERS.openai,
            "the booked worker left before the request could be sent; retry",
        ));
    };
    Ok((booking, worker, target))
}

#[cfg(test)]
mod tests {
    use super::mint_room;
    use std::collections::HashSet;

    #[test]
    fn bootstrap_rooms_are_below_2_63_and_never_repeat() {
        for instance in [0, 7, u64::MAX] {
            let mut seen = HashSet::new();
            for n in (0..100_000).chain([(1 << 62) + 5, (1 << 63) - 1]) {
                let room = mint_room(instance, n);
                assert!(room < 1 << 63, "{room}");
                assert!(seen.insert(room), "room {room} minted twice (n {n})");
            }
        }
    }
}
