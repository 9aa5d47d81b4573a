//! The gateway's sections: `models:` (what clients may name in `model`, with the
//! tokenizer the router renders and hashes with), `workers:` (engines the router
//! forwards to, for fleets with no registration step; followed on reload like
//! `kv_events.sources`) and `gateway:` (timeouts, retries, health checks).

use super::fleet;
use super::yaml::{join, location, node_location, to_json, Walker};
use super::Location;
use crate::domain::event_source::{Endpoints, KvEventSource, KvEvents};
use crate::domain::{parse_http_endpoint, ApiKey, Engine, Role};
use marked_yaml::Node;
use std::path::{Path, PathBuf};

/// `models.<name>`.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub name: String,
    /// The directory with `tokenizer.json` and `tokenizer_config.json`.
    pub tokenizer: PathBuf,
    /// The role its requests are booked under (`decode` for a disaggregated
    /// model: its answers are).
    pub role: Role,
    /// Where `role` was written, if it was.
    pub role_at: Option<Location>,
    /// `disaggregation`: prefill and decode on two pools, the KV handed over.
    pub disaggregation: Option<super::disaggregation::Disaggregation>,
    /// The LoRA adapter the engine serves this name as; it seeds the block hashes.
    pub lora: Option<String>,
    /// `encoder: hf`: encode with `tokenizers` 0.23 even where the fast encoder
    /// would pass its self-test (an operator's way back from a release
    /// candidate); `auto`, the default, lets the self-test decide.
    pub force_hf: bool,
    /// `chat_template_content_format: auto|string|openai`: how a message's
    /// content reaches the chat template, as vLLM's
    /// `--chat-template-content-format`; `auto`, the default, detects it from
    /// the template as vLLM does.
    pub content_format: ContentFormatOption,
    pub at: Location,
}

/// The content format a chat template is rendered with (`models.<name>.
/// chat_template_content_format`; `models::content_format` detects it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContentFormat {
    /// Each message's content as one string (list parts joined with "\n").
    String,
    /// Each message's content as a list of `{"type": "text", "text": …}` parts.
    OpenAi,
}

impl ContentFormat {
    pub fn as_str(self) -> &'static str {
        match self {
            ContentFormat::String => "string",
            ContentFormat::OpenAi => "openai",
        }
    }
}

/// A model's `chat_template_content_format`: detected from the template
/// (`auto`, the default) or set by the operator, as vLLM's
/// `--chat-template-content-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ContentFormatOption {
    #[default]
    Auto,
    Set(ContentFormat),
}

/// `workers[i]`: a worker the router registers itself (every rank in `0..dp_size`).
#[derive(Debug, Clone, PartialEq)]
pub struct ConfiguredWorker {
    pub worker_id: u64,
    pub dp_size: u32,
    pub role: Role,
    pub runtime_data: serde_json::Map<String, serde_json::Value>,
    pub http_endpoint: String,
    pub engine: Engine,
    pub models: Vec<String>,
    pub kv_events: Option<KvEvents>,
    /// `kv_capacity_tokens`: an approximate worker's KV capacity.
    pub kv_capacity_tokens: Option<u64>,
    /// `api_key_file`: where the worker's API key is kept.
    pub api_key_file: Option<PathBuf>,
    /// The key that file holds (read with the config, never shown).
    pub api_key: Option<ApiKey>,
    pub at: Location,
}

/// `gateway.health`: active checks of each worker's HTTP server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthConfig {
    /// Between two checks of one worker; 0 turns the checks off.
    pub interval_ms: u64,
    pub timeout_ms: u64,
    /// Failed checks in a row that mark a worker unhealthy.
    pub failures: u32,
    /// Passed checks in a row that take it back.
    pub successes: u32,
    /// The path checked on each engine's workers, where it is not `/health`
    /// (SGLang's `/health_generate` runs a one-token generation; an
    /// OpenAI-compatible server may have only `/v1/models`).
    pub paths: Vec<(Engine, String)>,
}

impl HealthConfig {
    /// The path a health check of an `engine` worker asks for.
    pub fn path(&self, engine: Engine) -> &str {
        self.paths
            .iter()
            .find(|(e, _)| *e == engine)
            .map_or(engine.facts().health_path, |(_, path)| path.as_str())
    }
}

/// `gateway:`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatewayConfig {
    /// Connecting to a worker may take this long before it counts as refused.
    pub connect_timeout_ms: u64,
    /// No byte from the worker for this long (before the head or between two
    /// chunks of the body) ends the request.
    pub idle_timeout_ms: u64,
    /// A request ends after this long whatever it is doing; 0: no deadline.
    pub request_timeout_ms: u64,
    /// How long a non-streaming request waits for the worker's answer (an
    /// engine sends nothing until the whole generation is done, so the idle
    /// bound between bytes cannot apply to it).
    pub response_timeout_ms: u64,
    /// Tries per request, the first included; retries go to another worker and
    /// happen only before the first byte reaches the client.
    pub max_attempts: u32,
    /// Before the first retry; each later one waits 1.5× longer.
    pub retry_backoff_ms: u64,
    /// Failures in a row (other than a refused connection, which opens it at
    /// once) that open a worker's circuit.
    pub circuit_failures: u32,
    /// How long an open circuit keeps a worker out before one probe request.
    pub circuit_open_ms: u64,
    pub health: HealthConfig,
    /// How long a block routed to an `approximate` worker counts as cached there.
    pub approximate_ttl_s: u64,
    /// Blocks credited to one `approximate` worker at most (the oldest go first).
    pub approximate_max_blocks: u64,
    /// How long a request to an `approximate` worker waits for the in-flight
    /// request whose prompt holds its prefix to make it reusable, rather than
    /// compute the prefix again beside it; 0: never waits.
    pub prefix_wait_ms: u64,
    /// The shortest busy prefix, in prompt tokens, worth that wait: a request
    /// whose busy prefix is shorter is sent at once (0: any busy prefix).
    pub prefix_wait_min_tokens: u64,
    /// Whether a worker whose engine publishes KV events is credited with the
    /// blocks of the requests it is running (until each ends), so that a burst
    /// sharing a prefix finds it before the engine has computed and published it.
    pub credit_in_flight: bool,
    /// Whether a booking on a worker whose engine publishes KV events, and whose
    /// capacity is known, counts only the part of its cached prefix the engine can
    /// still hold once the requests it is running have their blocks (needs
    /// `credit_in_flight`, which says what those requests pin). Off by default: it
    /// helped at 64 simulated engines and hurt at 16 (docs/performance.md).
    pub anticipate_evictions: bool,
    /// Workers (ranks) registered at once at most, from the config and the API
    /// together: a registration past it is refused with 503.
    pub max_workers: u64,
    /// Each model's cache of tokenized prompt pieces (the text between two
    /// special tokens: a system prompt, an earlier turn), in MiB; 0 turns it off.
    pub tokenizer_cache_mib: u64,
    /// The CA certificates `https://` workers are checked against
    /// (`tls_ca_file`, PEM); the system's roots without it. Taken up at start.
    pub tls_ca: Option<TlsCa>,
    /// OpenTelemetry traces of the requests, exported over OTLP; none without
    /// it. Taken up at start.
    pub tracing: Option<TracingConfig>,
}

/// `gateway.tracing`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TracingConfig {
    /// The collector's OTLP/gRPC endpoint, like `http://127.0.0.1:4317`.
    pub otlp_endpoint: String,
    /// `service.name` on every span.
    pub service_name: String,
    /// Traces kept, in percent, for requests that bring no sampling decision of
    /// their own (a client's `traceparent` decides for its request).
    pub sample_percent: u32,
}

/// `gateway.tls_ca_file` and the certificates it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsCa {
    pub file: PathBuf,
    pub certificates: Vec<rustls_pki_types::CertificateDer<'static>>,
}

/// The certificates of a PEM file (at least one).
pub(super) fn read_ca_file(
    path: &Path,
) -> Result<Vec<rustls_pki_types::CertificateDer<'static>>, String> {
    use rustls_pki_types::pem::PemObject;
    if std::fs::metadata(path).is_err() {
        return Err("there is no such file; point `tls_ca_file` at the PEM file of the CA certificates that signed the workers' certificates".into());
    }
    let certificates = rustls_pki_types::CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("cannot read it as PEM certificates: {e}"))?;
    if certificates.is_empty() {
        return Err("holds no certificate; give a PEM file with the CA certificates (`-----BEGIN CERTIFICATE-----` blocks) that signed the workers' certificates".into());
    }
    Ok(certificates)
}

impl Default for GatewayConfig {
    fn default() -> Self {
        Self {
            connect_timeout_ms: 1_000,
            idle_timeout_ms: 120_000,
            request_timeout_ms: 0,
            response_timeout_ms: 600_000,
            max_attempts: 3,
            retry_backoff_ms: 50,
            circuit_failures: 3,
            circuit_open_ms: 10_000,
            health: HealthConfig {
                interval_ms: 2_000,
                timeout_ms: 1_000,
                failures: 2,
                successes: 1,
                paths: Vec::new(),
            },
            approximate_ttl_s: 120,
            approximate_max_blocks: 100_000,
            prefix_wait_ms: 2_000,
            prefix_wait_min_tokens: 256,
            credit_in_flight: true,
            anticipate_evictions: false,
            max_workers: 4_096,
            tokenizer_cache_mib: 64,
            tls_ca: None,
            tracing: None,
        }
    }
}

pub(super) fn models(walker: &mut Walker, node: &Node, base: &Path) -> Vec<ModelConfig> {
    let mut out = Vec::new();
    let Some(map) = walker.mapping(node, "models") else {
        return out;
    };
    for (name, node) in map.iter() {
        let path = join("models", name.as_str());
        let at = location(&path, name.span());
        let Some(model) = walker.mapping(node, &path) else {
            continue;
        };
        walker.known_keys(
            model,
            &path,
            &[
                "tokenizer",
                "role",
                "lora",
                "encoder",
                "chat_template_content_format",
                "disaggregation",
            ],
        );
        if name.as_str().is_empty() || name.as_str().chars().any(char::is_control) {
            walker.error(
                at.clone(),
                "a model name is what clients write in `model`: not empty, no control characters",
            );
            continue;
        }
        let tokenizer = match model.get_node("tokenizer") {
            Some(n) => walker
                .string(n, &join(&path, "tokenizer"))
                .map(|t| base.join(t)),
            None => {
                walker.error(
                    at.clone(),
                    "a model needs `tokenizer`: the directory holding its tokenizer.json and \
                     tokenizer_config.json (the files its engine loads)",
                );
                None
            }
        };
        let disaggregation = model.get_node("disaggregation").map(|n| {
            super::disaggregation::parse(walker, model, n, &join(&path, "disaggregation"))
        });
        let role_at = model
            .get_node("role")
            .map(|n| location(&join(&path, "role"), n.span()));
        let role = match (model.get_node("role"), &disaggregation) {
            (Some(n), _) => {
                walker.one_of(n, &join(&path, "role"), "role", Role::NAMES, Role::parse)
            }
            // Its answers are the decode pool's; its prompts go to the prefill
            // pool on a booking of their own.
            (None, Some(_)) => Some(Role::Decode),
            (None, None) => Some(Role::Aggregated),
        };
        let lora = model
            .get_node("lora")
            .and_then(|n| walker.string(n, &join(&path, "lora")));
        let force_hf = match model.get_node("encoder") {
            Some(n) => walker.one_of(
                n,
                &join(&path, "encoder"),
                "encoder",
                &["auto", "hf"],
                |s| match s {
                    "auto" => Some(false),
                    "hf" => Some(true),
                    _ => None,
                },
            ),
            None => Some(false),
        };
        let content_format = match model.get_node("chat_template_content_format") {
            Some(n) => walker.one_of(
                n,
                &join(&path, "chat_template_content_format"),
                "content format",
                &["auto", "string", "openai"],
                |s| match s {
                    "auto" => Some(ContentFormatOption::Auto),
                    "string" => Some(ContentFormatOption::Set(ContentFormat::String)),
                    "openai" => Some(ContentFormatOption::Set(ContentFormat::OpenAi)),
                    _ => None,
                },
            ),
            None => Some(Default::default()),
        };
        if let (Some(tokenizer), Some(role), Some(force_hf), Some(content_format), Some(disagg)) = (
            tokenizer,
            role,
            force_hf,
            content_format,
            disaggregation.map_or(Some(None), |d| d.map(Some)),
        ) {
            out.push(ModelConfig {
                name: name.as_str().to_string(),
                tokenizer,
                role,
                role_at,
                disaggregation: disagg,
                lora,
                force_hf,
                content_format,
                at,
            });
        }
    }
    out
}

pub(super) fn workers(walker: &mut Walker, node: &Node, base: &Path) -> Vec<ConfiguredWorker> {
    let Some(items) = node.as_sequence() else {
        walker.error(
            node_location("workers", node),
            "`workers` is a list of engines to forward to, each with worker_id, role, \
             http_endpoint, engine and models",
        );
        return Vec::new();
    };
    fleet::entries(walker, items.iter(), "workers", |walker, item, path| {
        configured(walker, item, path, base)
    })
}

impl fleet::Listed for ConfiguredWorker {
    fn worker_id(&self) -> u64 {
        self.worker_id
    }
    fn at(&self) -> &Location {
        &self.at
    }
}

fn configured(
    walker: &mut Walker,
    node: &Node,
    path: &str,
    base: &Path,
) -> Option<ConfiguredWorker> {
    let kind = fleet::EntryKind {
        noun: "worker",
        role_required: false,
    };
    let entry = fleet::Entry::open(
        walker,
        node,
        path,
        kind,
        &[
            "http_endpoint",
            "engine",
            "models",
            "kv_events",
            "kv_capacity_tokens",
            "api_key_file",
        ],
    )?;
    let (map, at) = (entry.map, entry.at.clone());
    let errors_before = walker.errors.len();
    let required = |walker: &mut Walker, key: &str, what: &str| entry.required(walker, key, what);
    let fleet::Membership {
        worker_id,
        dp_size,
        role,
        runtime_data,
    } = entry.membership(walker);
    let http_endpoint = required(
        walker,
        "http_endpoint",
        "where the engine serves HTTP, like http://10.0.0.7:8000",
    )
    .and_then(|n| {
        let text = walker.string(n, &join(path, "http_endpoint"))?;
        match parse_http_endpoint(&text) {
            Ok(_) => Some(text),
            Err(problem) => {
                walker.error(
                    location(&join(path, "http_endpoint"), n.span()),
                    format!("http_endpoint {problem}"),
                );
                None
            }
        }
    });
    // "vllm, sglang, … or openai", from the engine table.
    let engines = match Engine::NAMES.split_last() {
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        None => String::new(),
    };
    let engine = required(
        walker,
        "engine",
        &format!("which adapter talks to it: {engines}"),
    )
    .and_then(|n| {
        walker.one_of(
            n,
            &join(path, "engine"),
            "engine",
            Engine::NAMES,
            Engine::parse,
        )
    });
    let models = required(
        walker,
        "models",
        "the model names it serves, as clients write them in `model`",
    )
    .and_then(|n| match n.as_sequence() {
        Some(items) if !items.is_empty() => {
            let names: Vec<Option<String>> = items
                .iter()
                .enumerate()
                .map(|(i, item)| walker.string(item, &format!("{}[{i}]", join(path, "models"))))
                .collect();
            names.into_iter().collect::<Option<Vec<_>>>()
        }
        _ => {
            walker.error(
                location(&join(path, "models"), n.span()),
                "`models` is a non-empty list of model names, like [qwen3-8b]",
            );
            None
        }
    });
    let kv_events = match map.get_node("kv_events") {
        None => Some(None),
        Some(n) => match n.as_scalar().map(|s| s.as_str()) {
            Some("approximate") => Some(Some(KvEvents::Approximate)),
            _ => match n.as_mapping() {
                Some(source) => {
                    let source_path = join(path, "kv_events");
                    walker.known_keys(
                        source,
                        &source_path,
                        &["endpoint", "replay_endpoint", "topic", "bind"],
                    );
                    let value = to_json(n);
                    match serde_json::from_value::<KvEventSource>(value) {
                        Ok(source) => Some(Some(KvEvents::Source(source))),
                        Err(e) => {
                            walker.error(
                                node_location(&source_path, n),
                                format!("{e}: `kv_events` names where the engine publishes, with `endpoint` (and `replay_endpoint`, `topic`, `bind`)"),
                            );
                            None
                        }
                    }
                }
                None => {
                    walker.error(
                        location(&join(path, "kv_events"), n.span()),
                        "`kv_events` is `approximate` (the engine publishes none) or where it \
                         publishes, {endpoint: tcp://…, replay_endpoint: …}",
                    );
                    None
                }
            },
        },
    };
    let kv_capacity_tokens = match map.get_node("kv_capacity_tokens") {
        None => None,
        Some(n) => {
            let key_path = join(path, "kv_capacity_tokens");
            let tokens = walker.unsigned(n, &key_path, 1, 1 << 40);
            if tokens.is_some()
                && matches!(&kv_events, Some(k) if !matches!(k, Some(KvEvents::Approximate)))
            {
                walker.error(
                    location(&key_path, n.span()),
                    "`kv_capacity_tokens` bounds what the router credits a `kv_events: \
                     approximate` worker with; this worker is not one (a worker whose engine \
                     publishes KV events says what it holds): remove it, or set `kv_events: \
                     approximate`"
                        .to_string(),
                );
            }
            tokens
        }
    };
    let (api_key_file, api_key) = match map.get_node("api_key_file") {
        None => (None, None),
        Some(n) => {
            let key_path = join(path, "api_key_file");
            match walker.string(n, &key_path).map(|f| base.join(f)) {
                None => (None, None),
                Some(file) => match super::auth::read_secret_file(&file) {
                    Ok(key) => (Some(file), Some(ApiKey::new(&key))),
                    Err(problem) => {
                        walker.error(
                            location(&key_path, n.span()),
                            format!("{}: {problem}", file.display()),
                        );
                        (None, None)
                    }
                },
            }
        }
    };
    if walker.errors.len() > errors_before {
        return None;
    }
    let dp_size = dp_size?;
    if let Some(KvEvents::Source(source)) = kv_events.as_ref().and_then(|k| k.as_ref()) {
        if let Err(error) = Endpoints::resolve(dp_size - 1, source) {
            walker.error(at, error.to_string());
            return None;
        }
    }
    Some(ConfiguredWorker {
        worker_id: worker_id?,
        dp_size,
        role: role?,
        runtime_data: runtime_data?,
        http_endpoint: http_endpoint?,
        engine: engine?,
        models: models?,
        kv_events: kv_events?,
        kv_capacity_tokens,
        api_key_file,
        api_key,
        at,
    })
}

pub(super) fn gateway(walker: &mut Walker, node: &Node, base: &Path) -> GatewayConfig {
    let mut out = GatewayConfig::default();
    let Some(map) = walker.mapping(node, "gateway") else {
        return out;
    };
    walker.known_keys(
        map,
        "gateway",
        &[
            "connect_timeout_ms",
            "idle_timeout_ms",
            "request_timeout_ms",
            "response_timeout_ms",
            "max_attempts",
            "retry_backoff_ms",
            "circuit_failures",
            "circuit_open_ms",
            "health",
            "approximate_ttl_s",
            "approximate_max_blocks",
            "prefix_wait_ms",
            "prefix_wait_min_tokens",
            "credit_in_flight",
            "anticipate_evictions",
            "max_workers",
            "tokenizer_cache_mib",
            "tls_ca_file",
            "tracing",
        ],
    );
    let number = |walker: &mut Walker, key: &str, min: u64, max: u64, into: &mut u64| {
        if let Some(n) = map.get_node(key) {
            if let Some(v) = walker.unsigned(n, &join("gateway", key), min, max) {
                *into = v;
            }
        }
    };
    number(
        walker,
        "connect_timeout_ms",
        1,
        600_000,
        &mut out.connect_timeout_ms,
    );
    number(
        walker,
        "idle_timeout_ms",
        1,
        86_400_000,
        &mut out.idle_timeout_ms,
    );
    number(
        walker,
        "request_timeout_ms",
        0,
        86_400_000,
        &mut out.request_timeout_ms,
    );
    number(
        walker,
        "response_timeout_ms",
        1,
        86_400_000,
        &mut out.response_timeout_ms,
    );
    number(
        walker,
        "retry_backoff_ms",
        0,
        60_000,
        &mut out.retry_backoff_ms,
    );
    number(
        walker,
        "circuit_open_ms",
        1,
        3_600_000,
        &mut out.circuit_open_ms,
    );
    number(
        walker,
        "approximate_ttl_s",
        1,
        86_400,
        &mut out.approximate_ttl_s,
    );
    number(
        walker,
        "approximate_max_blocks",
        1,
        100_000_000,
        &mut out.approximate_max_blocks,
    );
    number(
        walker,
        "prefix_wait_ms",
        0,
        600_000,
        &mut out.prefix_wait_ms,
    );
    number(walker, "max_workers", 1, 1 << 20, &mut out.max_workers);
    number(
        walker,
        "prefix_wait_min_tokens",
        0,
        1 << 24,
        &mut out.prefix_wait_min_tokens,
    );
    if let Some(n) = map.get_node("credit_in_flight") {
        if let Some(on) = walker.one_of(
            n,
            "gateway.credit_in_flight",
            "value",
            &["true", "false"],
            |s| s.parse::<bool>().ok(),
        ) {
            out.credit_in_flight = on;
        }
    }
    if let Some(n) = map.get_node("anticipate_evictions") {
        if let Some(on) = walker.one_of(
            n,
            "gateway.anticipate_evictions",
            "value",
            &["true", "false"],
            |s| s.parse::<bool>().ok(),
        ) {
            out.anticipate_evictions = on;
        }
    }
    number(
        walker,
        "tokenizer_cache_mib",
        0,
        1 << 20,
        &mut out.tokenizer_cache_mib,
    );
    if let Some(n) = map.get_node("tls_ca_file") {
        if let Some(file) = walker
            .string(n, "gateway.tls_ca_file")
            .map(|f| base.join(f))
        {
            match read_ca_file(&file) {
                Ok(certificates) => out.tls_ca = Some(TlsCa { file, certificates }),
                Err(problem) => walker.error(
                    location("gateway.tls_ca_file", n.span()),
                    format!("{}: {problem}", file.display()),
                ),
            }
        }
    }
    if let Some(n) = map.get_node("tracing") {
        out.tracing = tracing(walker, n);
    }
    let mut small = u64::from(out.max_attempts);
    number(walker, "max_attempts", 1, 10, &mut small);
    out.max_attempts = small as u32;
    let mut small = u64::from(out.circuit_failures);
    number(walker, "circuit_failures", 1, 1_000, &mut small);
    out.circuit_failures = small as u32;
    if let Some(node) = map.get_node("health") {
        if let Some(health) = walker.mapping(node, "gateway.health") {
            walker.known_keys(
                health,
                "gateway.health",
                &[
                    "interval_ms",
                    "timeout_ms",
                    "failures",
                    "successes",
                    "paths",
                ],
            );
            let field = |walker: &mut Walker, key: &str, min: u64, max: u64| {
                health
                    .get_node(key)
                    .and_then(|n| walker.unsigned(n, &join("gateway.health", key), min, max))
            };
            if let Some(v) = field(walker, "interval_ms", 0, 3_600_000) {
                out.health.interval_ms = v;
            }
            if let Some(v) = field(walker, "timeout_ms", 1, 600_000) {
                out.health.timeout_ms = v;
            }
            if let Some(v) = field(walker, "failures", 1, 100) {
                out.health.failures = v as u32;
            }
            if let Some(v) = field(walker, "successes", 1, 100) {
                out.health.successes = v as u32;
            }
            if let Some(node) = health.get_node("paths") {
                out.health.paths = health_paths(walker, node);
            }
        }
    }
    out
}

/// `gateway.health.paths`: engine → the path its workers are checked on.
fn health_paths(walker: &mut Walker, node: &Node) -> Vec<(Engine, String)> {
    let mut out = Vec::new();
    let path = "gateway.health.paths";
    let Some(map) = walker.mapping(node, path) else {
        return out;
    };
    for (engine, value) in map.iter() {
        let at = join(path, engine.as_str());
        let Some(engine) = Engine::parse(engine.as_str()) else {
            walker.error(
                location(&at, engine.span()),
                format!(
                    "unknown engine `{}`; expected one of: {}",
                    engine.as_str(),
                    Engine::NAMES.join(", ")
                ),
            );
            continue;
        };
        let Some(text) = walker.string(value, &at) else {
            continue;
        };
        let bad = !text.starts_with('/')
            || text.len() > 256
            || text
                .bytes()
                .any(|b| b.is_ascii_control() || b == b' ' || b == b'#');
        if bad {
            walker.error(
                location(&at, value.span()),
                format!("health path {text:?}: an absolute path on the worker, like /health or /health_generate (at most 256 characters, no spaces)"),
            );
            continue;
        }
        out.push((engine, text));
    }
    out
}

/// `gateway.tracing`: `{otlp_endpoint, service_name?, sample_percent?}`.
fn tracing(walker: &mut Walker, node: &Node) -> Option<TracingConfig> {
    let path = "gateway.tracing";
    let map = walker.mapping(node, path)?;
    walker.known_keys(
        map,
        path,
        &["otlp_endpoint", "service_name", "sample_percent"],
    );
    let endpoint = match map.get_node("otlp_endpoint") {
        None => {
            walker.error(
                node_location(path, node),
                "tracing needs `otlp_endpoint`: the collector's OTLP/gRPC address, like http://127.0.0.1:4317",
            );
            None
        }
        Some(n) => {
            let at = join(path, "otlp_endpoint");
            walker.string(n, &at).and_then(|endpoint| {
                let fits = (endpoint.starts_with("http://") || endpoint.starts_with("https://"))
                    && !endpoint.chars().any(|c| c.is_whitespace() || c.is_control());
                if !fits {
                    walker.error(
                        location(&at, n.span()),
                        format!("{endpoint:?} is not an OTLP/gRPC address; write it like http://127.0.0.1:4317"),
                    );
                }
                fits.then_some(endpoint)
            })
        }
    };
    let service_name = match map.get_node("service_name") {
        Some(n) => walker.string(n, &join(path, "service_name")),
        None => Some("kvhint".to_string()),
    };
    let sample_percent = match map.get_node("sample_percent") {
        Some(n) => walker
            .unsigned(n, &join(path, "sample_percent"), 0, 100)
            .map(|v| v as u32),
        None => Some(100),
    };
    Some(TracingConfig {
        otlp_endpoint: endpoint?,
        service_name: service_name?,
        sample_percent: sample_percent?,
    })
}
