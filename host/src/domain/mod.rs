//! The words every layer shares: roles, router modes, worker identity and what a
//! worker advertises. It imports nothing of the crate, so any module may use it
//! without creating a cycle.

pub mod event_source;

use serde::Deserialize;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

/// A worker as the router addresses it: one engine data-parallel rank.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct WorkerKey {
    pub worker_id: u64,
    pub dp_rank: u32,
}

impl fmt::Display for WorkerKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "worker {} dp_rank {}", self.worker_id, self.dp_rank)
    }
}

/// `--router-mode`: KV-aware selection (with hints), or one of the non-KV modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RouterMode {
    Kv,
    RoundRobin,
    Random,
}

impl RouterMode {
    pub const NAMES: &'static [&'static str] = &["kv", "round-robin", "random"];

    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "kv" => Some(Self::Kv),
            "round-robin" => Some(Self::RoundRobin),
            "random" => Some(Self::Random),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Kv => "kv",
            Self::RoundRobin => "round-robin",
            Self::Random => "random",
        }
    }

    pub fn is_kv(self) -> bool {
        self == Self::Kv
    }
}

impl fmt::Display for RouterMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `kv_events.thread_policy`: how the threads of the event path (engine subscriptions,
/// the ingestion thread) are scheduled beside booking threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ThreadPolicy {
    /// Linux's `SCHED_BATCH`: the same share of the CPU, but a thread that wakes does
    /// not preempt one that is running; when every core is busy it runs when the
    /// scheduler next preempts (at its tick, every few milliseconds).
    #[default]
    Batch,
    /// The default policy (`SCHED_OTHER`): a thread that wakes may preempt a booking.
    Normal,
}

impl ThreadPolicy {
    pub const NAMES: &'static [&'static str] = &["batch", "normal"];

    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "batch" => Some(Self::Batch),
            "normal" => Some(Self::Normal),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Batch => "batch",
            Self::Normal => "normal",
        }
    }
}

/// The roles a worker can serve and a request can ask for.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Aggregated,
    Prefill,
    Decode,
}

impl Role {
    pub const NAMES: &'static [&'static str] = &["aggregated", "prefill", "decode"];
    pub const ALL: [Role; 3] = [Self::Aggregated, Self::Prefill, Self::Decode];

    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "aggregated" => Some(Self::Aggregated),
            "prefill" => Some(Self::Prefill),
            "decode" => Some(Self::Decode),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Aggregated => "aggregated",
            Self::Prefill => "prefill",
            Self::Decode => "decode",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A worker registration as it arrives (HTTP body or trace record).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct WorkerRegistration {
    pub worker_id: u64,
    #[serde(default)]
    pub dp_rank: u32,
    pub role: Role,
    #[serde(default)]
    pub runtime_data: serde_json::Map<String, serde_json::Value>,
    /// Where this worker's engine publishes KV events, if the router should subscribe.
    /// Or `"approximate"`: the engine publishes none, and the router credits the
    /// worker with the blocks it routed there, for a bounded time.
    #[serde(default)]
    pub kv_events: Option<event_source::KvEvents>,
    /// Where the worker's engine serves HTTP (`http://10.0.0.7:8000`), for the
    /// gateway to forward requests to.
    #[serde(default)]
    pub http_endpoint: Option<String>,
    /// Which adapter talks to that server.
    #[serde(default)]
    pub engine: Option<Engine>,
    /// The model names it serves (the `model` of a request).
    #[serde(default)]
    pub models: Vec<String>,
    /// How many tokens of KV the worker's engine holds, for a `kv_events:
    /// approximate` worker: the router credits it with no more blocks than
    /// that. Absent: read from the engine where it says (vLLM, SGLang), else
    /// learned from its answers.
    #[serde(default)]
    pub kv_capacity_tokens: Option<u64>,
    /// The key the worker's server asks of its callers (`vllm serve --api-key`),
    /// from the file a config's `workers[i].api_key_file` names; never from a
    /// registration's body (a worker token could point the router at any file).
    #[serde(skip)]
    pub api_key: Option<ApiKey>,
}

/// A worker's API key: sent to it as `Authorization: Bearer`, never logged or
/// shown (its `Debug` says only that there is one).
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(Arc<str>);

impl ApiKey {
    pub fn new(key: &str) -> Self {
        Self(Arc::from(key))
    }

    /// The `Authorization` value, marked sensitive (HTTP/2 never indexes it, and
    /// `Debug` of the header map hides it).
    pub fn authorization(&self) -> Option<axum::http::HeaderValue> {
        let mut value = axum::http::HeaderValue::from_str(&format!("Bearer {}", self.0)).ok()?;
        value.set_sensitive(true);
        Some(value)
    }
}

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ApiKey(<redacted>)")
    }
}

/// Which adapter talks to a worker's HTTP server: what it takes a pre-tokenized
/// prompt in, where its request id and dp rank go, and whether a hint can reach it.
/// What the router knows of each engine is one row of [`Engine::TABLE`]; how a
/// request is shaped for it is its arm in `gateway::adapter`. A new engine is a
/// variant here, a row there and an adapter arm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Engine {
    Vllm,
    Sglang,
    Trtllm,
    Llamacpp,
    /// Any other OpenAI-compatible server: requests go as the client sent them.
    Openai,
}

/// When a request's prompt becomes reusable by another request on its worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settle {
    /// Once it has been prefilled: its first byte (engines that share a
    /// computed prefix between running requests: vLLM, SGLang, TRT-LLM).
    FirstByte,
    /// Once it has ended (llama.cpp: the prompt lives in the request's slot
    /// until the slot is idle).
    End,
}

/// One engine's row of [`Engine::TABLE`]: every fact the router keeps about it
/// outside the adapter's request shaping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineFacts {
    pub engine: Engine,
    /// Its name in configs, registrations, logs and metrics labels.
    pub name: &'static str,
    /// When a request's prompt becomes reusable on it (`kv_events: approximate`).
    pub settle: Settle,
    /// Where it says its KV capacity over HTTP, if it does (`gateway::capacity`).
    pub capacity_path: Option<&'static str>,
    /// The path its workers' health checks ask for unless
    /// `gateway.health.paths` names another.
    pub health_path: &'static str,
}

impl Engine {
    /// Every engine's facts, in the order of the enum's variants (a constant
    /// check below holds it to that, so a row is found by index).
    ///
    /// Settling: llama.cpp's prompt lives in its slot until the request ends;
    /// vLLM, SGLang and TRT-LLM share computed blocks between running requests;
    /// an unknown OpenAI-compatible server is taken to be like llama.cpp, the
    /// longer wait. Capacity: vLLM says it at `/metrics`, SGLang at
    /// `/server_info`; the others say it nowhere over HTTP (learned instead).
    pub const TABLE: [EngineFacts; 5] = [
        EngineFacts {
            engine: Self::Vllm,
            name: "vllm",
            settle: Settle::FirstByte,
            capacity_path: Some("/metrics"),
            health_path: "/health",
        },
        EngineFacts {
            engine: Self::Sglang,
            name: "sglang",
            settle: Settle::FirstByte,
            capacity_path: Some("/server_info"),
            health_path: "/health",
        },
        EngineFacts {
            engine: Self::Trtllm,
            name: "trtllm",
            settle: Settle::FirstByte,
            capacity_path: None,
            health_path: "/health",
        },
        EngineFacts {
            engine: Self::Llamacpp,
            name: "llamacpp",
            settle: Settle::End,
            capacity_path: None,
            health_path: "/health",
        },
        EngineFacts {
            engine: Self::Openai,
            name: "openai",
            settle: Settle::End,
            capacity_path: None,
            health_path: "/health",
        },
    ];

    /// Every engine, in the table's order.
    pub const ALL: [Engine; Self::TABLE.len()] = {
        let mut all = [Self::Vllm; Self::TABLE.len()];
        let mut i = 0;
        while i < all.len() {
            all[i] = Self::TABLE[i].engine;
            i += 1;
        }
        all
    };

    /// Every engine's name, in the table's order.
    pub const NAMES: &'static [&'static str] = &{
        let mut names = [""; Self::TABLE.len()];
        let mut i = 0;
        while i < names.len() {
            names[i] = Self::TABLE[i].name;
            i += 1;
        }
        names
    };

    /// This engine's row.
    pub fn facts(self) -> &'static EngineFacts {
        &Self::TABLE[self.index()]
    }

    /// Its position in [`Engine::TABLE`] (and [`Engine::ALL`]), for per-engine arrays.
    pub fn index(self) -> usize {
        self as usize
    }

    pub fn parse(text: &str) -> Option<Self> {
        Self::TABLE
            .iter()
            .find(|row| row.name == text)
            .map(|row| row.engine)
    }

    pub fn as_str(self) -> &'static str {
        self.facts().name
    }
}

// Row `i` of the table is the engine whose discriminant is `i`: `facts` and
// `index` rely on it. A row out of place fails the build here.
const _: () = {
    let mut i = 0;
    while i < Engine::TABLE.len() {
        assert!(
            Engine::TABLE[i].engine as usize == i,
            "Engine::TABLE is out of the enum's order"
        );
        i += 1;
    }
};

impl fmt::Display for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where and how a worker takes requests over HTTP.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpTarget {
    /// `http://host:port` (or `https://`), without a trailing slash.
    pub base: Arc<str>,
    /// `host:port`.
    pub authority: Arc<str>,
    pub engine: Engine,
    pub models: Vec<Arc<str>>,
    /// `runtime_data.kvhint_endpoint_plugin: true`: a vLLM worker running kvhint's
    /// endpoint plugin (`python/kvhint-vllm`), whose `/v1/completions` and
    /// `/v1/chat/completions` pass a body's `kv_hints` to the engine.
    pub hint_plugin: bool,
    /// Sent to the worker on every request and health check.
    pub api_key: Option<ApiKey>,
    /// Where an SGLang prefill server serves its KV bootstrap
    /// (`runtime_data.disaggregation_bootstrap_port`, its
    /// `--disaggregation-bootstrap-port`; SGLang's default 8998): what the
    /// router names to both legs of a disaggregated pair.
    pub bootstrap_port: u16,
}

/// SGLang's `--disaggregation-bootstrap-port` default
/// (`sglang/srt/arg_groups/fields/disagg.py`).
pub const SGLANG_BOOTSTRAP_PORT: u16 = 8998;

impl HttpTarget {
    /// The host of [`Self::authority`], without its port (brackets kept off an
    /// IPv6 address): the prefill worker's `bootstrap_host`.
    pub fn host(&self) -> &str {
        let host = match self.authority.rsplit_once(':') {
            Some((host, port)) if port.chars().all(|c| c.is_ascii_digit()) => host,
            _ => &self.authority,
        };
        host.trim_start_matches('[').trim_end_matches(']')
    }

    pub fn serves(&self, model: &str) -> bool {
        self.models.iter().any(|m| &**m == model)
    }
}

/// Checks an `http_endpoint`: `http://host:port` with nothing after the authority
/// (a path, a query or user info would be dropped or misread by every adapter).
pub fn parse_http_endpoint(text: &str) -> Result<(Arc<str>, Arc<str>), String> {
    let example = "like http://10.0.0.7:8000 or https://worker-1.example:443";
    let (scheme, rest) = if let Some(rest) = text.strip_prefix("http://") {
        ("http", rest)
    } else if let Some(rest) = text.strip_prefix("https://") {
        ("https", rest)
    } else {
        return Err(format!(
            "is {text:?}: write the engine's HTTP address {example}"
        ));
    };
    let authority = rest.strip_suffix('/').unwrap_or(rest);
    let bad = authority.is_empty()
        || authority
            .bytes()
            .any(|b| matches!(b, b'/' | b'?' | b'#' | b'@' | b' ') || b.is_ascii_control());
    if bad {
        return Err(format!(
            "is {text:?}: only a scheme, host and port, {example} (no path, query or user info)"
        ));
    }
    let port = authority
        .rsplit_once(':')
        .filter(|(host, _)| !host.is_empty() && (!host.contains(':') || host.ends_with(']')))
        .and_then(|(_, port)| port.parse::<u16>().ok())
        .filter(|port| *port > 0);
    if port.is_none() {
        return Err(format!("is {text:?}: name the port, {example}"));
    }
    Ok((
        Arc::from(format!("{scheme}://{authority}")),
        Arc::from(authority),
    ))
}

/// A registered worker (one dp rank of one engine).
#[derive(Debug, Clone, PartialEq)]
pub struct Worker {
    pub key: WorkerKey,
    pub role: Role,
    /// Advertises `router_hint: true`: can receive hint messages (rule R6).
    pub router_hint: bool,
    /// `router_hint_worker_type` ("" if absent).
    pub worker_type: Arc<str>,
    /// This rank's entry of `router_hint_source_control_endpoints` ("" if none).
    pub source_control_endpoint: Arc<str>,
    pub runtime_data: serde_json::Map<String, serde_json::Value>,
    /// Where the gateway forwards requests booked on it, if it serves HTTP.
    pub http: Option<Arc<HttpTarget>>,
    /// Publishes no KV events; the router credits it with what it routed there.
    pub approximate_kv: bool,
    /// `kv_capacity_tokens`: bounds an approximate worker's credits.
    pub kv_capacity_tokens: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("worker {worker_id} rank {dp_rank}: {key} {problem}")]
pub struct RuntimeDataError {
    pub worker_id: u64,
    pub dp_rank: u32,
    pub key: &'static str,
    pub problem: String,
}

/// A worker as the policy stages show it to policies, borrowed: the fields a
/// selection or hint policy reads, without the ABI's record (the stages build that).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerView<'a> {
    pub key: WorkerKey,
    pub router_hint: bool,
    pub worker_type: &'a str,
    pub source_control_endpoint: &'a str,
}

impl Worker {
    pub fn view(&self) -> WorkerView<'_> {
        WorkerView {
            key: self.key,
            router_hint: self.router_hint,
            worker_type: &self.worker_type,
            source_control_endpoint: &self.source_control_endpoint,
        }
    }

    pub fn from_registration(registration: WorkerRegistration) -> Result<Self, RuntimeDataError> {
        let key = WorkerKey {
            worker_id: registration.worker_id,
            dp_rank: registration.dp_rank,
        };
        let fail = |field: &'static str, problem: String| RuntimeDataError {
            worker_id: key.worker_id,
            dp_rank: key.dp_rank,
            key: field,
            problem,
        };
        let data = &registration.runtime_data;
        let router_hint = match data.get("router_hint") {
            None | Some(serde_json::Value::Null) => false,
            Some(serde_json::Value::Bool(b)) => *b,
            Some(other) => {
                return Err(fail(
                    "runtime_data.router_hint",
                    format!("must be true or false, found {other}"),
                ))
            }
        };
        let worker_type = match data.get("router_hint_worker_type") {
            None | Some(serde_json::Value::Null) => "",
            Some(serde_json::Value::String(s)) => s.as_str(),
            Some(other) => {
                return Err(fail(
                    "runtime_data.router_hint_worker_type",
                    format!("must be a string, found {other}"),
                ))
            }
        };
        // Dynamo advertises one endpoint per global dp rank: {"0": "tcp://…", …}.
        let endpoints: BTreeMap<String, String> =
            match data.get("router_hint_source_control_endpoints") {
                None | Some(serde_json::Value::Null) => BTreeMap::new(),
                Some(value) => serde_json::from_value(value.clone()).map_err(|_| {
                    fail(
                        "runtime_data.router_hint_source_control_endpoints",
                        format!("must map dp ranks to endpoints, like {{\"0\": \"tcp://10.0.0.7:23280\"}}; found {value}"),
                    )
                })?,
            };
        let hint_plugin = match data.get("kvhint_endpoint_plugin") {
            None | Some(serde_json::Value::Null) => false,
            Some(serde_json::Value::Bool(b)) => *b,
            Some(other) => {
                return Err(fail(
                    "runtime_data.kvhint_endpoint_plugin",
                    format!("must be true or false, found {other}"),
                ))
            }
        };
        let bootstrap_port = match data.get("disaggregation_bootstrap_port") {
            None | Some(serde_json::Value::Null) => SGLANG_BOOTSTRAP_PORT,
            Some(value) => match value.as_u64().and_then(|p| u16::try_from(p).ok()) {
                Some(port) if port > 0 => port,
                _ => {
                    return Err(fail(
                        "runtime_data.disaggregation_bootstrap_port",
                        format!("must be a port number (1 to 65535, the prefill server's --disaggregation-bootstrap-port), found {value}"),
                    ))
                }
            },
        };
        let mut endpoint = "";
        for (rank, value) in &endpoints {
            match rank.parse::<u32>() {
                Ok(rank) if rank == key.dp_rank => endpoint = value.as_str(),
                Ok(_) => {}
                Err(_) => {
                    return Err(fail(
                        "runtime_data.router_hint_source_control_endpoints",
                        format!("has key {rank:?}, which is not a dp rank number"),
                    ))
                }
            }
        }
        let http = match (&registration.http_endpoint, registration.engine) {
            (None, None) if registration.models.is_empty() => None,
            (None, _) => {
                return Err(fail(
                    "http_endpoint",
                    "is missing: `engine` and `models` say how the gateway forwards to a \
                     worker, which needs its http_endpoint, like http://10.0.0.7:8000"
                        .into(),
                ))
            }
            (Some(endpoint), engine) => {
                let (base, authority) = parse_http_endpoint(endpoint)
                    .map_err(|problem| fail("http_endpoint", problem))?;
                let Some(engine) = engine else {
                    return Err(fail(
                        "engine",
                        format!(
                            "is missing: say which engine serves {endpoint} ({})",
                            Engine::NAMES.join(", ")
                        ),
                    ));
                };
                if registration.models.is_empty() {
                    return Err(fail(
                        "models",
                        format!("is empty: list the model names {endpoint} serves, as clients name them in `model`"),
                    ));
                }
                if let Some(bad) = registration
                    .models
                    .iter()
                    .find(|m| m.is_empty() || m.len() > 256 || m.chars().any(char::is_control))
                {
                    return Err(fail(
                        "models",
                        format!("has {bad:?}: a model name is 1 to 256 characters, none a control character"),
                    ));
                }
                Some(Arc::new(HttpTarget {
                    base,
                    authority,
                    engine,
                    models: registration
                        .models
                        .iter()
                        .map(|m| Arc::from(m.as_str()))
                        .collect(),
                    hint_plugin,
                    api_key: registration.api_key.clone(),
                    bootstrap_port,
                }))
            }
        };
        let approximate_kv = matches!(
            registration.kv_events,
            Some(event_source::KvEvents::Approximate)
        );
        match registration.kv_capacity_tokens {
            Some(0) => {
                return Err(fail(
                    "kv_capacity_tokens",
                    "is 0: give the tokens of KV the engine holds (its KV cache and any \
                     prompt cache), or leave it out to have the router learn it"
                        .into(),
                ))
            }
            Some(_) if !approximate_kv => {
                return Err(fail(
                    "kv_capacity_tokens",
                    "is only for `kv_events: approximate` workers: a worker whose engine \
                     publishes KV events tells the router what it holds; remove it"
                        .into(),
                ))
            }
            _ => {}
        }
        Ok(Self {
            key,
            role: registration.role,
            router_hint,
            worker_type: Arc::from(worker_type),
            source_control_endpoint: Arc::from(endpoint),
            runtime_data: registration.runtime_data,
            http,
            approximate_kv,
            kv_capacity_tokens: registration.kv_capacity_tokens,
        })
    }
}

/// What one booking may ask of the router (from `router:`, per snapshot): each
/// bound keeps a single caller from growing the router's memory without limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BookingLimits {
    /// `router.max_prompt_tokens`: longer prompts are refused before any work.
    pub max_prompt_tokens: usize,
    /// `router.max_request_id_bytes`: an open booking keeps its id.
    pub max_request_id_bytes: usize,
    /// `router.max_open_bookings`: bookings held open at once, over all workers.
    pub max_open_bookings: usize,
}

impl Default for BookingLimits {
    fn default() -> Self {
        Self {
            max_prompt_tokens: 262_144,
            max_request_id_bytes: 256,
            max_open_bookings: 100_000,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn registration(runtime_data: serde_json::Value) -> WorkerRegistration {
        serde_json::from_value(serde_json::json!({
            "worker_id": 4, "role": "decode", "runtime_data": runtime_data,
            "http_endpoint": "http://127.0.0.1:8000", "engine": "vllm", "models": ["m"],
        }))
        .unwrap()
    }

    /// Each engine's row is at its index, its name parses back to it, and serde
    /// (registrations' `engine`) spells it as the table does.
    #[test]
    fn every_engine_is_one_row_whose_name_parses_back_and_serde_agrees() {
        assert_eq!(
            Engine::NAMES,
            ["vllm", "sglang", "trtllm", "llamacpp", "openai"]
        );
        for (i, engine) in Engine::ALL.into_iter().enumerate() {
            assert_eq!(engine.index(), i);
            assert_eq!(engine.facts().engine, engine);
            assert_eq!(Engine::parse(engine.as_str()), Some(engine));
            assert_eq!(
                serde_json::to_value(engine).unwrap(),
                serde_json::json!(engine.as_str())
            );
        }
        assert_eq!(Engine::parse("tgi"), None);
    }

    #[test]
    fn kvhint_endpoint_plugin_is_a_flag_on_the_http_target() {
        let plugin = |data| {
            Worker::from_registration(registration(data))
                .map(|w| w.http.unwrap().hint_plugin)
                .map_err(|e| (e.key, e.problem))
        };
        assert_eq!(plugin(serde_json::json!({})), Ok(false));
        assert_eq!(
            plugin(serde_json::json!({"kvhint_endpoint_plugin": true})),
            Ok(true)
        );
        assert_eq!(
            plugin(serde_json::json!({"kvhint_endpoint_plugin": null})),
            Ok(false)
        );
        assert_eq!(
            plugin(serde_json::json!({"kvhint_endpoint_plugin": "yes"})),
            Err((
                "runtime_data.kvhint_endpoint_plugin",
                "must be true or false, found \"yes\"".to_string()
            ))
        );
    }
}
