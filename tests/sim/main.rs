//! `kvhint-sim`: simulated inference engines, for measuring routing at fleet
//! scale on a machine with no accelerator (as Dynamo's mocker and llm-d's
//! inference simulator are for theirs).
//!
//! ```text
//! kvhint-sim --workers 16 --tokenizer DIR [--model NAME] [--events --wheel VLLM_WHEEL]
//! ```
//!
//! One process serves `--workers` simulated engines, each an OpenAI-compatible
//! HTTP server on its own 127.0.0.1 port (`/v1/chat/completions`,
//! `/v1/completions`, streaming or not, `/v1/models`, `/health`, and vLLM's
//! `/metrics` names), and prints one line once they listen:
//! `{"ready": true, "workers": [{"url": …, "events": …, "replay": …}, …]}`. It
//! exits when its stdin closes.
//!
//! Each engine is a vLLM-like scheduler over a bounded block cache:
//! - a prompt is tokenized as vLLM would (the chat rendered with the model's
//!   template: the router's renderer, whose ids are tested equal to vLLM's; a
//!   completion's token ids taken as they are), cut into `--block-size` blocks
//!   chained by hash, and looked up: the longest cached prefix is reused;
//! - continuous batching: each step prefills up to `--chunk-tokens` of the
//!   waiting prompts (oldest first) and decodes one token for every running
//!   request, and takes `--step-us` + `--prefill-us-per-token` × prefilled tokens
//!   + `--decode-us-per-seq` × decoding requests; at most `--max-seqs` run;
//! - a prefilled block enters the cache as soon as its chunk is done (a later
//!   request reuses it, as vLLM's prefix cache does), pinned while a request
//!   uses it; past `--capacity-blocks`, the least recently used unpinned block
//!   goes, deepest first;
//! - every store and eviction is published, with `--events`, through vLLM
//!   0.23.0's own `ZmqEventPublisher` (`tests/engines/sim_publishers.py`, one
//!   publisher per engine, bound on `events`, replay on `replay`), so a router
//!   subscribed to it sees what it would see from vLLM;
//! - an answer's `usage` reports `prompt_tokens_details.cached_tokens`, and
//!   `/metrics` vLLM's running/waiting counts, KV usage and cache config.
//!
//! `--speedup N` runs every duration N times faster. The generated text is one
//! word per token; it carries no meaning.

use clap::Parser;
use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Frame, Incoming};
use hyper::{Request, Response, StatusCode};
use kvhint::models::{ChatRequest, ModelTokenizer};
use serde_json::{json, Value};
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::pin::Pin;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, Notify};

#[derive(Parser, Debug, Clone)]
#[command(
    name = "kvhint-sim",
    about = "Simulated inference engines for routing at fleet scale"
)]
struct Args {
    /// Simulated engines, each on its own port.
    #[arg(long, default_value_t = 4)]
    workers: usize,
    /// The directory with the model's tokenizer.json and tokenizer_config.json.
    #[arg(long)]
    tokenizer: PathBuf,
    /// The model name the engines serve.
    #[arg(long, default_value = "tiny-qwen3")]
    model: String,
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Blocks each engine's KV cache holds.
    #[arg(long, default_value_t = 2048)]
    capacity_blocks: usize,
    /// Prompt tokens prefilled in one step at most.
    #[arg(long, default_value_t = 2048)]
    chunk_tokens: usize,
    /// Requests running at once at most; the rest wait.
    #[arg(long, default_value_t = 64)]
    max_seqs: usize,
    /// A step's fixed cost, in µs.
    #[arg(long, default_value_t = 2000)]
    step_us: u64,
    /// Per prompt token prefilled in a step, in µs.
    #[arg(long, default_value_t = 100.0)]
    prefill_us_per_token: f64,
    /// Per request decoding in a step, in µs.
    #[arg(long, default_value_t = 200.0)]
    decode_us_per_seq: f64,
    /// Run every duration this many times faster.
    #[arg(long, default_value_t = 1.0)]
    speedup: f64,
    /// Publish KV events through vLLM's own publisher.
    #[arg(long)]
    events: bool,
    /// The vLLM 0.23.0 wheel the publisher is read from (with --events).
    #[arg(long)]
    wheel: Option<PathBuf>,
    /// The Python that runs tests/engines/sim_publishers.py (with --events).
    #[arg(long, default_value = "python3")]
    python: PathBuf,
}

fn main() {
    let args = Args::parse();
    let tokenizer = match ModelTokenizer::load(&args.tokenizer, 64 << 20) {
        Ok(t) => Arc::new(t),
        Err(e) => fail(&format!("cannot load the tokenizer: {e}")),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap_or_else(|e| fail(&format!("cannot start the runtime: {e}")));
    runtime.block_on(serve(args, tokenizer));
}

fn fail(why: &str) -> ! {
    println!("{}", json!({"ready": false, "error": why}));
    std::process::exit(1);
}

async fn serve(args: Args, tokenizer: Arc<ModelTokenizer>) {
    let mut listeners = Vec::new();
    for _ in 0..args.workers {
        match tokio::net::TcpListener::bind("127.0.0.1:0").await {
            Ok(l) => listeners.push(l),
            Err(e) => fail(&format!("cannot listen on 127.0.0.1: {e}")),
        }
    }
    let (events, publisher) = if args.events {
        let (tx, child) = start_publishers(&args);
        (Some(tx), Some(child))
    } else {
        (None, None)
    };
    let mut described = Vec::new();
    for (i, listener) in listeners.into_iter().enumerate() {
        let port = listener.local_addr().map(|a| a.port()).unwrap_or(0);
        let mut entry = json!({"url": format!("http://127.0.0.1:{port}")});
        if let Some((_, endpoints)) = &events {
            let (pub_port, replay_port) = endpoints[i];
            entry["events"] = json!(format!("tcp://127.0.0.1:{pub_port}"));
            entry["replay"] = json!(format!("tcp://127.0.0.1:{replay_port}"));
        }
        described.push(entry);
        let engine = Arc::new(Engine::new(
            i,
            args.clone(),
            events.as_ref().map(|(tx, _)| tx.clone()),
        ));
        tokio::spawn(Arc::clone(&engine).run());
        let tokenizer = Arc::clone(&tokenizer);
        tokio::spawn(accept(listener, engine, tokenizer));
    }
    println!("{}", json!({"ready": true, "workers": described}));
    let _ = std::io::stdout().flush();
    // Until the caller closes stdin.
    let _ = tokio::task::spawn_blocking(|| {
        let mut sink = String::new();
        while std::io::stdin().read_line(&mut sink).is_ok_and(|n| n > 0) {
            sink.clear();
        }
    })
    .await;
    if let Some(mut child) = publisher {
        let _ = child.kill();
        let _ = child.wait();
    }
    std::process::exit(0);
}

type EventTx = std::sync::mpsc::Sender<String>;

/// Starts `sim_publishers.py` with a publisher per worker on ports of its own;
/// returns where batches go (JSON lines) and each worker's (events, replay) port.
fn start_publishers(args: &Args) -> Publishers {
    // Ports are picked by binding and letting go, so another process may take
    // one before the publishers bind it: try again with new ones.
    let mut why = String::new();
    for _ in 0..3 {
        match try_publishers(args) {
            Ok(started) => return started,
            Err(e) => why = e,
        }
    }
    fail(&format!("the publishers did not start: {why}"))
}

/// The publishers' line, each engine's (events, replay) ports, their process.
type Publishers = ((EventTx, Vec<(u16, u16)>), Child);

fn try_publishers(args: &Args) -> Result<Publishers, String> {
    let Some(wheel) = &args.wheel else {
        fail("--events needs --wheel: the vLLM 0.23.0 wheel the publisher is read from");
    };
    let ports: Vec<(u16, u16)> = free_ports(args.workers * 2)
        .chunks(2)
        .map(|p| (p[0], p[1]))
        .collect();
    let list = |f: fn(&(u16, u16)) -> u16| {
        ports
            .iter()
            .map(|p| format!("tcp://*:{}", f(p)))
            .collect::<Vec<_>>()
            .join(",")
    };
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("engines/sim_publishers.py");
    let mut child = Command::new(&args.python)
        .arg(&script)
        .arg("--wheel")
        .arg(wheel)
        .args(["--endpoints", &list(|p| p.0)])
        .args(["--replay-endpoints", &list(|p| p.1)])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| fail(&format!("cannot run {}: {e}", script.display())));
    let stdout = child.stdout.take().map(std::io::BufReader::new);
    let mut ready = String::new();
    if let Some(mut out) = stdout {
        let _ = out.read_line(&mut ready);
    }
    if !ready.contains("\"ready\": true") {
        let _ = child.kill();
        let _ = child.wait();
        return Err(ready.trim().to_string());
    }
    let Some(stdin) = child.stdin.take() else {
        fail("the publishers' stdin is gone");
    };
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || write_lines(stdin, rx));
    Ok(((tx, ports), child))
}

fn write_lines(mut stdin: ChildStdin, rx: std::sync::mpsc::Receiver<String>) {
    for line in rx {
        if stdin.write_all(line.as_bytes()).is_err() || stdin.write_all(b"\n").is_err() {
            return;
        }
    }
}

/// `n` different free ports: all held at once while they are picked, so no
/// two are the same.
fn free_ports(n: usize) -> Vec<u16> {
    let held: Vec<std::net::TcpListener> = (0..n)
        .map(|_| {
            std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap_or_else(|e| fail(&format!("no free port: {e}")))
        })
        .collect();
    held.iter()
        .map(|l| {
            l.local_addr()
                .map(|a| a.port())
                .unwrap_or_else(|e| fail(&format!("no free port: {e}")))
        })
        .collect()
}

// ------------------------------------------------------------------ the engine

/// What a running request hears from its engine.
enum Step {
    /// Its first token, with the prompt tokens it found cached.
    First {
        cached_tokens: usize,
    },
    Token,
    Done,
}

struct Job {
    tokens: Vec<u32>,
    hashes: Vec<u64>,
    max_tokens: u32,
    tx: mpsc::UnboundedSender<Step>,
    /// Tokens prefilled (cached ones included).
    prefilled: usize,
    cached_tokens: usize,
    generated: u32,
    /// Blocks it pins in the cache.
    pinned: Vec<u64>,
}

struct CachedBlock {
    refs: u32,
    /// (last use, depth): the eviction order.
    order: (u64, u32),
}

#[derive(Default)]
struct State {
    waiting: VecDeque<Job>,
    running: Vec<Job>,
    blocks: HashMap<u64, CachedBlock>,
    /// Unpinned blocks by (last use, deepest first, hash): the first goes first.
    evictable: BTreeSet<((u64, u32), u64)>,
    tick: u64,
    queries: u64,
    hits: u64,
}

struct Engine {
    index: usize,
    args: Args,
    state: Mutex<State>,
    work: Notify,
    events: Option<EventTx>,
}

impl Engine {
    fn new(index: usize, args: Args, events: Option<EventTx>) -> Self {
        Self {
            index,
            args,
            state: Mutex::new(State::default()),
            work: Notify::new(),
            events,
        }
    }

    fn submit(&self, job: Job) {
        self.lock().waiting.push_back(job);
        self.work.notify_one();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    async fn run(self: Arc<Self>) {
        let mut clock: Option<Instant> = None;
        loop {
            let (took, idle) = {
                let mut state = self.lock();
                self.admit(&mut state);
                if state.running.is_empty() {
                    (Duration::ZERO, true)
                } else {
                    (self.step(&mut state), false)
                }
            };
            if idle {
                clock = None;
                self.work.notified().await;
                continue;
            }
            // A virtual clock, so that sleeping in whole timer ticks does not
            // add up to drift.
            let start = *clock.get_or_insert_with(Instant::now);
            let next = start + took.div_f64(self.args.speedup.max(1e-6));
            clock = Some(next);
            tokio::time::sleep_until(next.into()).await;
            let events = {
                let mut state = self.lock();
                self.finish_step(&mut state)
            };
            self.publish(events);
        }
    }

    /// Moves waiting requests in while there is room: each looks up its
    /// longest cached prefix and pins it.
    fn admit(&self, state: &mut State) {
        while state.running.len() < self.args.max_seqs {
            let Some(mut job) = state.waiting.pop_front() else {
                break;
            };
            if job.tx.is_closed() {
                continue;
            }
            state.tick += 1;
            let tick = state.tick;
            let mut cached = 0;
            for (depth, hash) in job.hashes.iter().enumerate() {
                if !state.blocks.contains_key(hash) {
                    break;
                }
                pin(state, *hash, (tick, u32::MAX - depth as u32));
                job.pinned.push(*hash);
                cached += 1;
            }
            state.queries += job.tokens.len() as u64;
            // Even a fully cached prompt computes its last token.
            job.cached_tokens = (cached * self.args.block_size).min(job.tokens.len() - 1);
            state.hits += job.cached_tokens as u64;
            job.prefilled = job.cached_tokens;
            state.running.push(job);
        }
    }

    /// Plans one step: prefill chunks oldest first, a token for every decoding
    /// request; returns how long it takes.
    fn step(&self, state: &mut State) -> Duration {
        let mut budget = self.args.chunk_tokens;
        let mut prefill = 0usize;
        let mut decoding = 0usize;
        for job in &mut state.running {
            if job.prefilled < job.tokens.len() {
                let take = budget.min(job.tokens.len() - job.prefilled);
                job.prefilled += take;
                budget -= take;
                prefill += take;
            } else {
                decoding += 1;
            }
        }
        let us = self.args.step_us as f64
            + self.args.prefill_us_per_token * prefill as f64
            + self.args.decode_us_per_seq * decoding as f64;
        Duration::from_secs_f64(us / 1e6)
    }

    /// After a step: new full blocks into the cache, first tokens and tokens
    /// out, finished requests unpinned, the cache back under its capacity.
    /// Returns the step's KV events.
    fn finish_step(&self, state: &mut State) -> Vec<Value> {
        let block_size = self.args.block_size;
        let mut stored: Vec<Value> = Vec::new();
        let mut running = std::mem::take(&mut state.running);
        state.tick += 1;
        let tick = state.tick;
        let mut keep = Vec::with_capacity(running.len());
        for mut job in running.drain(..) {
            // Blocks its prefill has completed and the cache lacks: one event
            // for the run of them, as vLLM publishes a request's new blocks.
            let full = job.prefilled / block_size;
            let mut new_blocks: Vec<usize> = Vec::new();
            while job.pinned.len() < full.min(job.hashes.len()) {
                let depth = job.pinned.len();
                let hash = job.hashes[depth];
                if let std::collections::hash_map::Entry::Vacant(entry) = state.blocks.entry(hash) {
                    new_blocks.push(depth);
                    entry.insert(CachedBlock {
                        refs: 0,
                        order: (tick, u32::MAX - depth as u32),
                    });
                }
                pin(state, hash, (tick, u32::MAX - depth as u32));
                job.pinned.push(hash);
            }
            // Runs of consecutive depths (a block another request stored
            // meanwhile splits a run).
            for run in new_blocks.chunk_by(|a, b| b == &(a + 1)) {
                let (first, last) = (run[0], run[run.len() - 1]);
                stored.push(json!({
                    "type": "BlockStored",
                    "block_hashes": &job.hashes[first..=last],
                    "parent_block_hash": first.checked_sub(1).map(|d| job.hashes[d]),
                    "token_ids": &job.tokens[first * block_size..(last + 1) * block_size],
                    "block_size": block_size,
                }));
            }
            let done_prefill = job.prefilled >= job.tokens.len();
            let sent = if !done_prefill {
                true
            } else if job.generated == 0 {
                job.generated = 1;
                job.tx
                    .send(Step::First {
                        cached_tokens: job.cached_tokens,
                    })
                    .is_ok()
            } else {
                job.generated += 1;
                job.tx.send(Step::Token).is_ok()
            };
            if !sent || job.generated >= job.max_tokens {
                let _ = job.tx.send(Step::Done);
                for hash in job.pinned.drain(..) {
                    unpin(state, hash);
                }
            } else {
                keep.push(job);
            }
        }
        state.running = keep;
        let mut removed = Vec::new();
        while state.blocks.len() > self.args.capacity_blocks {
            let Some(first) = state.evictable.pop_first() else {
                break; // everything left is pinned
            };
            state.blocks.remove(&first.1);
            removed.push(first.1);
        }
        let mut events = stored;
        if !removed.is_empty() {
            events.push(json!({"type": "BlockRemoved", "block_hashes": removed}));
        }
        events
    }

    fn publish(&self, events: Vec<Value>) {
        if events.is_empty() {
            return;
        }
        if let Some(tx) = &self.events {
            let _ = tx.send(json!({"worker": self.index, "events": events}).to_string());
        }
    }

    fn metrics(&self) -> String {
        let state = self.lock();
        let used = state.blocks.len() - state.evictable.len();
        format!(
            "vllm:num_requests_running{{model_name=\"{m}\"}} {}\n\
             vllm:num_requests_waiting{{model_name=\"{m}\"}} {}\n\
             vllm:kv_cache_usage_perc{{model_name=\"{m}\"}} {}\n\
             vllm:prefix_cache_queries_total{{model_name=\"{m}\"}} {}\n\
             vllm:prefix_cache_hits_total{{model_name=\"{m}\"}} {}\n\
             vllm:cache_config_info{{block_size=\"{}\",num_gpu_blocks=\"{}\"}} 1\n",
            state.running.len(),
            state.waiting.len(),
            used as f64 / self.args.capacity_blocks.max(1) as f64,
            state.queries,
            state.hits,
            self.args.block_size,
            self.args.capacity_blocks,
            m = self.args.model,
        )
    }
}

fn pin(state: &mut State, hash: u64, order: (u64, u32)) {
    if let Some(block) = state.blocks.get_mut(&hash) {
        if block.refs == 0 {
            state.evictable.remove(&(block.order, hash));
        }
        block.refs += 1;
        block.order = block.order.max(order);
    }
}

fn unpin(state: &mut State, hash: u64) {
    if let Some(block) = state.blocks.get_mut(&hash) {
        block.refs = block.refs.saturating_sub(1);
        if block.refs == 0 {
            state.evictable.insert((block.order, hash));
        }
    }
}

/// A prompt's full blocks, chained: each hash stands for its whole prefix.
fn block_hashes(tokens: &[u32], block_size: usize) -> Vec<u64> {
    let mut parent = 0x5151_u64;
    tokens
        .chunks_exact(block_size.max(1))
        .map(|chunk| {
            let bytes: Vec<u8> = chunk.iter().flat_map(|t| t.to_le_bytes()).collect();
            parent = xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, parent);
            // vLLM's hashes are any 64-bit values; keep them positive in i64
            // terms too, as some subscribers print them signed.
            parent & (u64::MAX >> 1)
        })
        .collect()
}

// ------------------------------------------------------------------ HTTP

async fn accept(
    listener: tokio::net::TcpListener,
    engine: Arc<Engine>,
    tokenizer: Arc<ModelTokenizer>,
) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let engine = Arc::clone(&engine);
        let tokenizer = Arc::clone(&tokenizer);
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request| {
                handle(request, Arc::clone(&engine), Arc::clone(&tokenizer))
            });
            let io = hyper_util::rt::TokioIo::new(stream);
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(io, service)
                .await;
        });
    }
}

type Body = http_body_util::combinators::BoxBody<Bytes, std::convert::Infallible>;

fn full(status: StatusCode, content_type: &str, body: impl Into<Bytes>) -> Response<Body> {
    let mut response = Response::new(Full::new(body.into()).boxed());
    *response.status_mut() = status;
    if let Ok(value) = hyper::header::HeaderValue::from_str(content_type) {
        response
            .headers_mut()
            .insert(hyper::header::CONTENT_TYPE, value);
    }
    response
}

fn error(status: StatusCode, message: &str) -> Response<Body> {
    full(
        status,
        "application/json",
        json!({"error": {"message": message, "type": "invalid_request_error"}}).to_string(),
    )
}

async fn handle(
    request: Request<Incoming>,
    engine: Arc<Engine>,
    tokenizer: Arc<ModelTokenizer>,
) -> Result<Response<Body>, std::convert::Infallible> {
    let path = request.uri().path().to_string();
    let method = request.method().clone();
    Ok(match (method.as_str(), path.as_str()) {
        ("GET", "/health") => full(StatusCode::OK, "text/plain", ""),
        ("GET", "/v1/models") => full(
            StatusCode::OK,
            "application/json",
            json!({"object": "list", "data": [{"id": engine.args.model, "object": "model"}]})
                .to_string(),
        ),
        ("GET", "/metrics") => full(StatusCode::OK, "text/plain", engine.metrics()),
        ("POST", "/v1/chat/completions") | ("POST", "/v1/completions") => {
            let chat = path.ends_with("chat/completions");
            let body = match request.into_body().collect().await {
                Ok(body) => body.to_bytes(),
                Err(e) => return Ok(error(StatusCode::BAD_REQUEST, &e.to_string())),
            };
            match generate(&body, chat, &engine, &tokenizer) {
                Ok(response) => response,
                Err(why) => error(StatusCode::BAD_REQUEST, &why),
            }
        }
        _ => error(StatusCode::NOT_FOUND, "no such route"),
    })
}

/// Tokenizes the request as vLLM would and queues it on the engine; the
/// response streams the engine's steps.
fn generate(
    body: &[u8],
    chat: bool,
    engine: &Arc<Engine>,
    tokenizer: &ModelTokenizer,
) -> Result<Response<Body>, String> {
    let value: Value = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    let tokens = if chat {
        let request: ChatRequest = serde_json::from_slice(body).map_err(|e| e.to_string())?;
        tokenizer.encode_chat(&request).map_err(|e| e.0)?.0
    } else {
        match &value["prompt"] {
            Value::String(text) => tokenizer.encode_prompt(text).map_err(|e| e.0)?.0,
            Value::Array(ids) => ids
                .iter()
                .map(|id| id.as_u64().map(|v| v as u32))
                .collect::<Option<Vec<u32>>>()
                .ok_or("`prompt` is text or a list of token ids")?,
            _ => return Err("`prompt` is text or a list of token ids".into()),
        }
    };
    if tokens.is_empty() {
        return Err("the prompt is empty".into());
    }
    let max_tokens = value["max_tokens"]
        .as_u64()
        .or(value["max_completion_tokens"].as_u64())
        .unwrap_or(16)
        .clamp(1, 4096) as u32;
    let stream = value["stream"].as_bool().unwrap_or(false);
    let usage = value["stream_options"]["include_usage"]
        .as_bool()
        .unwrap_or(false);
    let (tx, rx) = mpsc::unbounded_channel();
    let prompt_tokens = tokens.len();
    engine.submit(Job {
        hashes: block_hashes(&tokens, engine.args.block_size),
        tokens,
        max_tokens,
        tx,
        prefilled: 0,
        cached_tokens: 0,
        generated: 0,
        pinned: Vec::new(),
    });
    let answer = Answer {
        rx,
        chat,
        stream,
        usage: usage || !stream,
        model: engine.args.model.clone(),
        prompt_tokens,
        cached_tokens: 0,
        generated: 0,
        done: false,
    };
    let content_type = if stream {
        "text/event-stream"
    } else {
        "application/json"
    };
    let mut response = Response::new(BodyExt::boxed(answer));
    if let Ok(value) = hyper::header::HeaderValue::from_str(content_type) {
        response
            .headers_mut()
            .insert(hyper::header::CONTENT_TYPE, value);
    }
    Ok(response)
}

/// A response as the engine produces it: SSE chunks as tokens come (OpenAI's
/// shapes), or one JSON body at the end.
struct Answer {
    rx: mpsc::UnboundedReceiver<Step>,
    chat: bool,
    stream: bool,
    usage: bool,
    model: String,
    prompt_tokens: usize,
    cached_tokens: usize,
    generated: u32,
    done: bool,
}

impl Answer {
    fn usage(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.generated,
            "total_tokens": self.prompt_tokens + self.generated as usize,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        })
    }

    fn chunk(&self, finish: Option<&str>) -> String {
        let choice = if self.chat {
            json!({"index": 0, "delta": {"content": " w"}, "finish_reason": finish})
        } else {
            json!({"index": 0, "text": " w", "finish_reason": finish})
        };
        let object = if self.chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        format!(
            "data: {}\n\n",
            json!({"id": "sim", "object": object, "created": 0, "model": self.model, "choices": [choice]})
        )
    }

    fn whole(&self) -> String {
        let text = " w".repeat(self.generated as usize);
        let choice = if self.chat {
            json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"})
        } else {
            json!({"index": 0, "text": text, "finish_reason": "length"})
        };
        json!({"id": "sim", "object": if self.chat { "chat.completion" } else { "text_completion" },
               "created": 0, "model": self.model, "choices": [choice], "usage": self.usage()})
        .to_string()
    }
}

impl hyper::body::Body for Answer {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        loop {
            if this.done {
                return Poll::Ready(None);
            }
            match this.rx.poll_recv(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(step) => {
                    let text = match step {
                        Some(Step::First { cached_tokens }) => {
                            this.cached_tokens = cached_tokens;
                            this.generated = 1;
                            this.stream.then(|| this.chunk(None))
                        }
                        Some(Step::Token) => {
                            this.generated += 1;
                            this.stream.then(|| this.chunk(None))
                        }
                        Some(Step::Done) | None => {
                            this.done = true;
                            Some(if this.stream {
                                let mut tail = this.chunk(Some("length"));
                                if this.usage {
                                    tail.push_str(&format!(
                                        "data: {}\n\n",
                                        json!({"id": "sim", "object": "chat.completion.chunk", "created": 0,
                                               "model": this.model, "choices": [], "usage": this.usage()})
                                    ));
                                }
                                tail.push_str("data: [DONE]\n\n");
                                tail
                            } else {
                                this.whole()
                            })
                        }
                    };
                    if let Some(text) = text {
                        return Poll::Ready(Some(Ok(Frame::data(Bytes::from(text)))));
                    }
                }
            }
        }
    }
}
