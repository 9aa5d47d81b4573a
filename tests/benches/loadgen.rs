//! Load generator for `kvhint serve` over loopback (127.0.0.1 only).
//!
//! ```sh
//! cargo bench -p kvhint-e2e --bench loadgen            # full run, release artefacts
//! cargo test  -p kvhint-e2e --bench loadgen            # quick smoke run, debug artefacts
//! ```
//!
//! It starts the real `kvhint serve` binary (a fresh process per section, each
//! in its own private directory with a plugins directory and a config) and
//! measures, from client threads in this process:
//!
//! 1. **Bookings per second**, with p50/p99/max client-side latency of
//!    `POST /book`, at a fixed concurrency, with hints
//!    (`[{type: kv_fetch}, {type: harness_prefetch}]`) and without (`[]`).
//!    Each client thread has its own keep-alive agent and loops book + release
//!    with unique request ids. The fleet: 64 hint-capable decode workers; 8
//!    distinct 4,096-token prompts (block size 16, so 256 blocks each), each
//!    stored on two workers at different lengths (224 and 96 blocks), and one
//!    long-lived booking per prompt pinned on its longest holder, so the
//!    default cost function books elsewhere and `kv_fetch` sends a fetch.
//! 2. **Hot-add latency**: with `--watch-config`, the YAML first names
//!    `hot_added` (that reload fails: unknown type, the old snapshot keeps
//!    serving); at t0 `libfixture_hot_add.so` is renamed into the plugins
//!    directory; then book + release in a tight loop until a booking's hint
//!    carries `test.hot_added`. Latency = that booking's response time − t0.
//!    Each trial is reverted (YAML entry and `.so` removed) before the next.
//! 3. **Failed bookings across reloads under load**: booking threads run while
//!    `POST /admin/reload` is issued N times, the config alternating between
//!    `harness_prefetch` `max_blocks: 4` and `2`.
//!
//! Environment (used with `--bench` only; quick mode has fixed tiny settings):
//!
//! | variable | default | meaning |
//! | --- | --- | --- |
//! | `LOADGEN_CONCURRENCY` | 8 | client threads booking at once (sections 1 and 3) |
//! | `LOADGEN_SECONDS` | 5 | measured seconds per mode in section 1 (after a 1 s warm-up) |
//! | `LOADGEN_TRIALS` | 10 | hot-add trials (section 2) |
//! | `LOADGEN_RELOADS` | 100 | `POST /admin/reload` calls under load (section 3) |
//! | `LOADGEN_KVHINT` | (the artefacts' `kvhint`) | the `kvhint` binary to serve, e.g. an earlier build for a before/after |
//! | `LOADGEN_BOOKING_THREADS` | (the server's default) | `kvhint serve --booking-threads` (0: bookings under `block_in_place` on the HTTP runtime) |
//!
//! **Quick mode**: run without `--bench` (as `cargo test --benches` does), it
//! uses the debug artefacts and 1 thread, 0.3 s per mode, 1 hot-add trial and
//! 5 reloads, and exits non-zero with a message if anything did not work.
//!
//! Output: plain text lines, then one `{"loadgen": {...}}` JSON line with every
//! figure. Every request loop is bounded in count and in time; each server is
//! killed when its guard drops, also on panic.

use kvhint_e2e::wait::Waiting;
use kvhint_e2e::{action_types, private_dir, TempDir};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

const WORKERS: u64 = 64;
const PROMPTS: usize = 8;
const PROMPT_TOKENS: u32 = 4096;
const BLOCK_SIZE: u32 = 16;
/// Blocks of its prompt the longest holder stores (of 256).
const LONG_HOLD_BLOCKS: u32 = 224;
/// Blocks of its prompt the second holder stores.
const SHORT_HOLD_BLOCKS: u32 = 96;
/// Per-thread cap on book + release iterations in any loop.
const MAX_ITERATIONS_PER_THREAD: u64 = 5_000_000;
/// How long any single wait (a reload to show, a hot add to land) may take.
const WAIT_LIMIT: Duration = Duration::from_secs(10);
/// Safety cap on how long the booking threads of section 3 may run.
const RELOAD_LOAD_LIMIT: Duration = Duration::from_secs(300);
const HOT_ADD_ACTION: &str = "test.hot_added";

// ---------------------------------------------------------------------------
// Settings

struct Settings {
    /// A quick smoke run (`cargo test --benches`, debug build): its figures
    /// are not measurements, so no target is judged met or not.
    quick: bool,
    concurrency: usize,
    warmup: Duration,
    seconds: f64,
    trials: usize,
    reloads: usize,
}

fn env_number<T: std::str::FromStr>(
    name: &str,
    default: T,
    valid: impl Fn(&T) -> bool,
) -> Result<T, String> {
    match std::env::var(name) {
        Err(_) => Ok(default),
        Ok(text) => match text.trim().parse::<T>() {
            Ok(value) if valid(&value) => Ok(value),
            _ => Err(format!("{name}={text:?} is not a valid value")),
        },
    }
}

impl Settings {
    fn from_env(quick: bool) -> Result<Settings, String> {
        if quick {
            return Ok(Settings {
                quick: true,
                concurrency: 1,
                warmup: Duration::from_millis(100),
                seconds: 0.3,
                trials: 1,
                reloads: 5,
            });
        }
        Ok(Settings {
            quick: false,
            concurrency: env_number("LOADGEN_CONCURRENCY", 8usize, |n| (1..=1024).contains(n))?,
            warmup: Duration::from_secs(1),
            seconds: env_number("LOADGEN_SECONDS", 5.0f64, |s| *s > 0.0 && *s <= 3600.0)?,
            trials: env_number("LOADGEN_TRIALS", 10usize, |n| (1..=1000).contains(n))?,
            reloads: env_number("LOADGEN_RELOADS", 100usize, |n| (1..=100_000).contains(n))?,
        })
    }
}

// ---------------------------------------------------------------------------
// HTTP

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(10)))
        .build()
        .new_agent()
}

fn post(agent: &ureq::Agent, url: &str, body: &str) -> Result<(u16, String), String> {
    let mut response = agent
        .post(url)
        .header("content-type", "application/json")
        .send(body)
        .map_err(|e| format!("POST {url}: {e}"))?;
    let status = response.status().as_u16();
    let text = response
        .body_mut()
        .read_to_string()
        .map_err(|e| format!("POST {url}: reading the body: {e}"))?;
    Ok((status, text))
}

fn get_json(agent: &ureq::Agent, url: &str) -> Result<Value, String> {
    let mut response = agent
        .get(url)
        .call()
        .map_err(|e| format!("GET {url}: {e}"))?;
    let status = response.status().as_u16();
    let text = response
        .body_mut()
        .read_to_string()
        .map_err(|e| format!("GET {url}: reading the body: {e}"))?;
    if status != 200 {
        return Err(format!("GET {url}: {status} {text}"));
    }
    serde_json::from_str(&text).map_err(|e| format!("GET {url}: {e}: {text:.200}"))
}

/// POSTs and requires 200; returns the parsed body.
fn post_ok(agent: &ureq::Agent, url: &str, body: &str, expect: u16) -> Result<Value, String> {
    let (status, text) = post(agent, url, body)?;
    if status != expect {
        return Err(format!(
            "POST {url}: {status} (expected {expect}): {text:.300}"
        ));
    }
    serde_json::from_str(&text).map_err(|e| format!("POST {url}: {e}: {text:.200}"))
}

/// The cheap checks the booking loops make on a `/book` response (the body is
/// serde_json's compact output; [`check_detection`] confirms this once).
fn carries_hint(body: &str) -> bool {
    !body.contains("\"hint\":null")
}

fn carries_action(body: &str, action_type: &str) -> bool {
    body.contains(&format!("\"action_type\":\"{action_type}\""))
}

// ---------------------------------------------------------------------------
// Server and its directory

/// A running `kvhint serve`, killed when dropped (also while unwinding).
struct Server {
    child: Child,
    base: String,
    log: PathBuf,
}

impl Server {
    fn start(
        bin: &Path,
        config: &Path,
        watch_config: bool,
        log: PathBuf,
    ) -> Result<Server, String> {
        let stderr = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
        let mut command = Command::new(bin);
        command
            .args(["serve", "--listen", "127.0.0.1:0", "--config"])
            .arg(config)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr);
        if watch_config {
            command.arg("--watch-config");
        }
        // LOADGEN_BOOKING_THREADS: the server's --booking-threads (0: block_in_place).
        if let Ok(threads) = std::env::var("LOADGEN_BOOKING_THREADS") {
            command.args(["--booking-threads", &threads]);
        }
        let child = command
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", bin.display()))?;
        let mut server = Server {
            child,
            base: String::new(),
            log,
        };
        let stdout = server.child.stdout.take().expect("stdout is piped");
        let mut reader = BufReader::new(stdout);
        let mut line = String::new();
        let _ = reader.read_line(&mut line);
        let Some(address) = line.trim().strip_prefix("listening on ") else {
            return Err(format!(
                "kvhint serve did not start: {line:?}\n{}",
                server.log_tail()
            ));
        };
        if !address.starts_with("127.0.0.1:") {
            return Err(format!("kvhint serve listens on {address}, not loopback"));
        }
        server.base = format!("http://{address}");
        // Keep draining stdout so a later line can neither block the server on
        // a full pipe nor fail on a closed one; ends when the server exits.
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut reader, &mut std::io::sink());
        });
        Ok(server)
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    fn status(&self, agent: &ureq::Agent) -> Result<Value, String> {
        get_json(agent, &self.url("/admin/status"))
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let tail = &lines[lines.len().saturating_sub(30)..];
        format!("--- last lines of the serve log ---\n{}", tail.join("\n"))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Writes `path` by the drop-in protocol: a temporary dotfile in the same
/// directory, then a rename.
fn drop_in(path: &Path, bytes: &[u8]) -> Result<(), String> {
    kvhint_e2e::drop_in(path, bytes).map_err(|e| format!("{}: {e}", path.display()))
}

/// The temporary name the drop-in protocol writes under; the hot-add trial
/// writes and renames by itself so t0 can sit between the two.
fn temp_name(path: &Path) -> PathBuf {
    path.with_file_name(format!(
        ".{}.tmp",
        path.file_name().unwrap_or_default().to_string_lossy()
    ))
}

/// The YAML of the benchmark configs: block size 16, one decode role on the
/// default cost function, with the given hint list.
fn config_yaml(hints: &str) -> String {
    format!(
        "plugins:\n  directory: plugins\n  cache_dir: cache\nrouter:\n  block_size: {BLOCK_SIZE}\n\
         worker_selection:\n  decode:\n    type: dynamo-default-cost-fn\n    hints: {hints}\n"
    )
}

const WITH_HINTS: &str = "[{type: kv_fetch}, {type: harness_prefetch}]";
const WITHOUT_HINTS: &str = "[]";
const WITH_HOT_ADDED: &str = "[{type: kv_fetch}, {type: harness_prefetch}, {type: hot_added}]";

fn prefetch_variant(max_blocks: usize) -> String {
    format!("[{{type: kv_fetch}}, {{type: harness_prefetch, parameters: {{max_blocks: {max_blocks}}}}}]")
}

/// A private directory (0700) with a plugins directory holding
/// `libharness_prefetch.so`, a config, and the server's log beside it (outside
/// the watched directories' names).
struct Site {
    dir: TempDir,
    logs: TempDir,
}

impl Site {
    fn new(artefacts: &Path, hints: &str) -> Result<Site, String> {
        let site = Site {
            dir: private_dir(),
            logs: private_dir(),
        };
        let plugins = site.plugins();
        std::fs::create_dir(&plugins).map_err(|e| format!("{}: {e}", plugins.display()))?;
        std::fs::set_permissions(&plugins, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| format!("{}: {e}", plugins.display()))?;
        let so = artefacts.join("libharness_prefetch.so");
        let bytes = std::fs::read(&so).map_err(|e| format!("{}: {e}", so.display()))?;
        drop_in(&plugins.join("libharness_prefetch.so"), &bytes)?;
        site.write_config(hints)?;
        Ok(site)
    }

    fn plugins(&self) -> PathBuf {
        self.dir.path().join("plugins")
    }

    fn config(&self) -> PathBuf {
        self.dir.path().join("kvhint.yaml")
    }

    fn write_config(&self, hints: &str) -> Result<(), String> {
        drop_in(&self.config(), config_yaml(hints).as_bytes())
    }

    fn start(&self, artefacts: &Path, watch_config: bool) -> Result<Server, String> {
        // `LOADGEN_KVHINT` serves another build (an earlier commit's, say) with
        // the same artefacts, workload and client, for a before/after.
        let binary = std::env::var_os("LOADGEN_KVHINT")
            .map(PathBuf::from)
            .unwrap_or_else(|| artefacts.join("kvhint"));
        Server::start(
            &binary,
            &self.config(),
            watch_config,
            self.logs.path().join("serve.log"),
        )
    }
}

// ---------------------------------------------------------------------------
// The fleet: workers, KV events, prompts

/// Prompt `p`'s longest holder and its second holder (high ids, so idle
/// low-id workers win cost ties).
fn long_holder(p: usize) -> u64 {
    WORKERS - 2 * p as u64
}

fn short_holder(p: usize) -> u64 {
    WORKERS - 1 - 2 * p as u64
}

fn prompt_tokens(p: usize) -> Vec<u32> {
    let start = 1 + p as u32 * 1_000_000;
    (start..start + PROMPT_TOKENS).collect()
}

struct Fleet {
    /// Each prompt's `token_ids` as JSON text, rendered once.
    prompts: Vec<String>,
}

impl Fleet {
    fn book_body(&self, request_id: &str, prompt: usize) -> String {
        format!(
            "{{\"request_id\":\"{request_id}\",\"role\":\"decode\",\"token_ids\":{}}}",
            self.prompts[prompt % PROMPTS]
        )
    }
}

fn release_body(request_id: &str) -> String {
    format!("{{\"request_id\":\"{request_id}\"}}")
}

/// Registers the 64 workers, stores each prompt on its two holders, and pins
/// one open booking per prompt on its longest holder.
fn set_up_fleet(server: &Server, agent: &ureq::Agent) -> Result<Fleet, String> {
    for id in 1..=WORKERS {
        let body = json!({"worker_id": id, "role": "decode", "runtime_data": {
            "router_hint": true, "router_hint_worker_type": "decode",
            "router_hint_source_control_endpoints": {"0": format!("tcp://10.0.{}.{}:23280", id / 256, id % 256)}}});
        post_ok(agent, &server.url("/workers"), &body.to_string(), 201)?;
    }
    let prompts: Vec<Vec<u32>> = (0..PROMPTS).map(prompt_tokens).collect();
    for (p, tokens) in prompts.iter().enumerate() {
        for (worker, blocks) in [
            (long_holder(p), LONG_HOLD_BLOCKS),
            (short_holder(p), SHORT_HOLD_BLOCKS),
        ] {
            let stored: Vec<Value> = tokens
                .chunks_exact(BLOCK_SIZE as usize)
                .take(blocks as usize)
                .enumerate()
                .map(|(i, chunk)| json!({"block_hash": worker * 1_000_000 + i as u64, "token_ids": chunk}))
                .collect();
            let body = json!({"worker_id": worker, "event": {"stored": {"parent_block_hash": null, "blocks": stored}}});
            let answer = post_ok(agent, &server.url("/kv_events"), &body.to_string(), 200)?;
            if answer["stored"] != blocks {
                return Err(format!("KV event for worker {worker}: {answer}"));
            }
        }
    }
    let fleet = Fleet {
        prompts: prompts
            .iter()
            .map(|t| serde_json::to_string(t).expect("token ids serialize"))
            .collect(),
    };
    for p in 0..PROMPTS {
        let id = format!("pin-{p}");
        let booking = post_ok(agent, &server.url("/book"), &fleet.book_body(&id, p), 200)?;
        if booking["worker_id"] != long_holder(p) {
            return Err(format!(
                "the pinned booking of prompt {p} went to worker {}, not its longest holder {}",
                booking["worker_id"],
                long_holder(p)
            ));
        }
    }
    Ok(fleet)
}

/// Books prompt 0 once, checks where it went and what it carried, and that
/// the loops' string checks agree with a real parse.
fn check_detection(
    server: &Server,
    agent: &ureq::Agent,
    fleet: &Fleet,
    tag: &str,
    expect_hints: bool,
) -> Result<(), String> {
    let id = format!("{tag}-probe");
    let (status, text) = post(agent, &server.url("/book"), &fleet.book_body(&id, 0))?;
    if status != 200 {
        return Err(format!("probe booking: {status} {text:.300}"));
    }
    post_ok(agent, &server.url("/release"), &release_body(&id), 200)?;
    let booking: Value = serde_json::from_str(&text).map_err(|e| format!("probe booking: {e}"))?;
    let types = action_types(&booking);
    let parsed_hint = !booking["hint"].is_null();
    if carries_hint(&text) != parsed_hint
        || carries_action(&text, "kv.fetch") != types.iter().any(|t| t == "kv.fetch")
    {
        return Err(format!(
            "the response format changed; the loadgen's checks no longer match it: {text:.400}"
        ));
    }
    if booking["worker_id"] != short_holder(0) {
        return Err(format!(
            "probe booking went to worker {}, expected the second holder {} (the longest holder is loaded)",
            booking["worker_id"],
            short_holder(0)
        ));
    }
    if expect_hints && types != ["kv.fetch", "kv.prefetch"] {
        return Err(format!(
            "probe booking with hints carried {types:?}, expected kv.fetch and kv.prefetch"
        ));
    }
    if !expect_hints && !booking["hint"].is_null() {
        return Err(format!(
            "probe booking without hints carried a hint: {}",
            booking["hint"]
        ));
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Booking loops

/// What one booking thread is told.
struct LoopSpec<'a> {
    base: &'a str,
    fleet: &'a Fleet,
    tag: &'a str,
    /// Bookings that start before this are warm-up: not measured.
    measure_from: Instant,
    /// No booking starts at or after this.
    end: Instant,
    /// Stops the loop early when set.
    stop: &'a AtomicBool,
    /// Live counts, for section 3's "during the reloads".
    booked: &'a AtomicU64,
    failed: &'a AtomicU64,
    /// Parse each booking and count its `kv.prefetch` length (section 3).
    classify_prefetch: bool,
}

#[derive(Default)]
struct ThreadStats {
    latencies_ns: Vec<u64>,
    bookings: u64,
    hinted: u64,
    fetched: u64,
    /// Non-200 or transport failures of book or release, warm-up included.
    errors: u64,
    first_error: Option<String>,
    /// Section 3: bookings by the number of hashes in their `kv.prefetch`
    /// (0 = none).
    prefetch_lengths: BTreeMap<usize, u64>,
}

impl ThreadStats {
    fn error(&mut self, spec: &LoopSpec<'_>, what: String) {
        self.errors += 1;
        spec.failed.fetch_add(1, Ordering::Relaxed);
        if self.first_error.is_none() {
            self.first_error = Some(what);
        }
    }
}

fn booking_thread(spec: &LoopSpec<'_>, thread: usize) -> ThreadStats {
    let agent = agent();
    let book_url = format!("{}/book", spec.base);
    let release_url = format!("{}/release", spec.base);
    let mut stats = ThreadStats::default();
    let mut n: u64 = 0;
    while n < MAX_ITERATIONS_PER_THREAD && !spec.stop.load(Ordering::Relaxed) {
        let started = Instant::now();
        if started >= spec.end {
            break;
        }
        n += 1;
        let measured = started >= spec.measure_from;
        let id = format!("{}-{thread}-{n}", spec.tag);
        let body = spec.fleet.book_body(&id, thread + n as usize);
        let sent = Instant::now();
        let result = post(&agent, &book_url, &body);
        let took = sent.elapsed();
        let text = match result {
            Ok((200, text)) => text,
            Ok((status, text)) => {
                stats.error(spec, format!("book {id}: {status} {text:.300}"));
                continue;
            }
            Err(e) => {
                stats.error(spec, format!("book {id}: {e}"));
                continue;
            }
        };
        spec.booked.fetch_add(1, Ordering::Relaxed);
        if measured {
            stats.latencies_ns.push(took.as_nanos() as u64);
            stats.bookings += 1;
            stats.hinted += u64::from(carries_hint(&text));
            stats.fetched += u64::from(carries_action(&text, "kv.fetch"));
        }
        if spec.classify_prefetch {
            let booking: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
            let length = booking["hint"]["actions"]
                .as_array()
                .and_then(|actions| actions.iter().find(|a| a["action_type"] == "kv.prefetch"))
                .and_then(|a| a["payload"]["block_hashes"].as_array())
                .map_or(0, Vec::len);
            *stats.prefetch_lengths.entry(length).or_default() += 1;
        }
        match post(&agent, &release_url, &release_body(&id)) {
            Ok((200, _)) => {}
            Ok((status, text)) => stats.error(spec, format!("release {id}: {status} {text:.300}")),
            Err(e) => stats.error(spec, format!("release {id}: {e}")),
        }
    }
    stats
}

fn run_threads(spec: &LoopSpec<'_>, threads: usize) -> ThreadStats {
    let all: Vec<ThreadStats> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| scope.spawn(move || booking_thread(spec, t)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a booking thread panicked"))
            .collect()
    });
    let mut total = ThreadStats::default();
    for stats in all {
        total.latencies_ns.extend(stats.latencies_ns);
        total.bookings += stats.bookings;
        total.hinted += stats.hinted;
        total.fetched += stats.fetched;
        total.errors += stats.errors;
        if total.first_error.is_none() {
            total.first_error = stats.first_error;
        }
        for (length, count) in stats.prefetch_lengths {
            *total.prefetch_lengths.entry(length).or_default() += count;
        }
    }
    total.latencies_ns.sort_unstable();
    total
}

/// The `q` quantile (nearest rank) of sorted values.
fn quantile(sorted: &[u64], q: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

fn micros(ns: u64) -> f64 {
    (ns as f64 / 100.0).round() / 10.0
}

fn millis(d: Duration) -> f64 {
    (d.as_secs_f64() * 10_000.0).round() / 10.0
}

fn ratio(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        (part as f64 / whole as f64 * 10_000.0).round() / 10_000.0
    }
}

// ---------------------------------------------------------------------------
// Section 1: bookings per second

fn bookings_section(
    settings: &Settings,
    artefacts: &Path,
    mode: &str,
    hints: &str,
    problems: &mut Vec<String>,
) -> Result<Value, String> {
    let site = Site::new(artefacts, hints)?;
    let server = site.start(artefacts, false)?;
    let agent = agent();
    let mut run = || -> Result<Value, String> {
        let fleet = set_up_fleet(&server, &agent)?;
        let expect_hints = hints != WITHOUT_HINTS;
        check_detection(&server, &agent, &fleet, mode, expect_hints)?;
        let (stop, booked, failed) = (AtomicBool::new(false), AtomicU64::new(0), AtomicU64::new(0));
        let start = Instant::now();
        let measure_from = start + settings.warmup;
        let spec = LoopSpec {
            base: &server.base,
            fleet: &fleet,
            tag: mode,
            measure_from,
            end: measure_from + Duration::from_secs_f64(settings.seconds),
            stop: &stop,
            booked: &booked,
            failed: &failed,
            classify_prefetch: false,
        };
        let stats = run_threads(&spec, settings.concurrency);
        let measured = Instant::now()
            .saturating_duration_since(measure_from)
            .as_secs_f64();
        let per_second = stats.bookings as f64 / measured.max(1e-9);
        let (p50, p99, max) = (
            quantile(&stats.latencies_ns, 0.50),
            quantile(&stats.latencies_ns, 0.99),
            stats.latencies_ns.last().copied().unwrap_or(0),
        );
        println!(
            "booking  mode={mode:<13} concurrency={} bookings/s={per_second:.0} p50={:.1}us p99={:.1}us max={:.1}us \
             errors={} hinted={:.1}% (kv.fetch {:.1}%) bookings={} over {measured:.2}s",
            settings.concurrency,
            micros(p50),
            micros(p99),
            micros(max),
            stats.errors,
            100.0 * ratio(stats.hinted, stats.bookings),
            100.0 * ratio(stats.fetched, stats.bookings),
            stats.bookings,
        );
        if stats.errors > 0 {
            problems.push(format!(
                "{mode}: {} failed requests; first: {}",
                stats.errors,
                stats.first_error.as_deref().unwrap_or("?")
            ));
        }
        if stats.bookings == 0 {
            problems.push(format!(
                "{mode}: no booking completed in the measured window"
            ));
        }
        if expect_hints && stats.fetched == 0 {
            problems.push(format!("{mode}: no booking carried kv.fetch"));
        }
        if !expect_hints && stats.hinted > 0 {
            problems.push(format!(
                "{mode}: {} bookings carried a hint under `hints: []`",
                stats.hinted
            ));
        }
        Ok(json!({
            "concurrency": settings.concurrency,
            "seconds": (measured * 1000.0).round() / 1000.0,
            "bookings": stats.bookings,
            "bookings_per_s": per_second.round(),
            "p50_us": micros(p50),
            "p99_us": micros(p99),
            "max_us": micros(max),
            "errors": stats.errors,
            "hinted_fraction": ratio(stats.hinted, stats.bookings),
            "kv_fetch_fraction": ratio(stats.fetched, stats.bookings),
        }))
    };
    run().map_err(|e| format!("{mode}: {e}\n{}", server.log_tail()))
}

// ---------------------------------------------------------------------------
// Section 2: hot-add latency

/// Polls `check` every 10 ms until it holds or [`WAIT_LIMIT`] passes.
fn wait_until(what: &str, mut check: impl FnMut() -> Result<bool, String>) -> Result<(), String> {
    Waiting::new(what, WAIT_LIMIT)
        .every(Duration::from_millis(10))
        .try_until(|| Ok(check()?.then_some(())))
}

/// Books and releases one request; returns the booking's body and when its
/// response arrived.
fn book_once(
    server: &Server,
    agent: &ureq::Agent,
    fleet: &Fleet,
    id: &str,
) -> Result<(String, Instant), String> {
    let (status, text) = post(agent, &server.url("/book"), &fleet.book_body(id, 0))?;
    let arrived = Instant::now();
    if status != 200 {
        return Err(format!("book {id}: {status} {text:.300}"));
    }
    post_ok(agent, &server.url("/release"), &release_body(id), 200)?;
    Ok((text, arrived))
}

fn has_hot_add_plugin(status: &Value) -> bool {
    status["plugins"]
        .as_array()
        .is_some_and(|plugins| plugins.iter().any(|p| p["name"] == "fixture-hot-add"))
}

struct Trial {
    latency: Duration,
    polls: u64,
}

fn hot_add_trial(
    site: &Site,
    server: &Server,
    agent: &ureq::Agent,
    fleet: &Fleet,
    so: &[u8],
    trial: usize,
) -> Result<Trial, String> {
    let target = site.plugins().join("libfixture_hot_add.so");
    // 1. The YAML names `hot_added` before its plugin is there: that reload fails.
    let failed_before = server.status(agent)?["reloads"]["failed"]
        .as_u64()
        .unwrap_or(0);
    site.write_config(WITH_HOT_ADDED)?;
    wait_until("the reload of the YAML naming hot_added to fail", || {
        Ok(server.status(agent)?["reloads"]["failed"]
            .as_u64()
            .unwrap_or(0)
            > failed_before)
    })?;
    let status = server.status(agent)?;
    let why = status["reloads"]["last_error"]["errors"].to_string();
    if !why.contains("hot_added") {
        return Err(format!("the failed reload does not name hot_added: {why}"));
    }
    let (text, _) = book_once(server, agent, fleet, &format!("hot{trial}-before"))?;
    if carries_action(&text, HOT_ADD_ACTION) {
        return Err("a booking carried test.hot_added before the plugin was added".into());
    }

    // 2. Rename the .so in (written under a temporary name first), then book
    // until a booking carries the new policy's action.
    let tmp = temp_name(&target);
    std::fs::write(&tmp, so).map_err(|e| format!("{}: {e}", tmp.display()))?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o644))
        .map_err(|e| format!("{}: {e}", tmp.display()))?;
    let t0 = Instant::now();
    std::fs::rename(&tmp, &target).map_err(|e| format!("{}: {e}", target.display()))?;
    let mut polls = 0u64;
    let latency = loop {
        if t0.elapsed() > WAIT_LIMIT || polls >= MAX_ITERATIONS_PER_THREAD {
            return Err(format!(
                "no booking carried {HOT_ADD_ACTION} within {WAIT_LIMIT:?} of the rename ({polls} bookings)"
            ));
        }
        polls += 1;
        let (text, arrived) = book_once(server, agent, fleet, &format!("hot{trial}-{polls}"))?;
        if carries_action(&text, HOT_ADD_ACTION) {
            break arrived.duration_since(t0);
        }
    };

    // 3. Revert: the YAML entry and the .so go; wait until bookings no longer
    // carry the action and the plugin is gone from the serving snapshot.
    site.write_config(WITH_HINTS)?;
    std::fs::remove_file(&target).map_err(|e| format!("{}: {e}", target.display()))?;
    wait_until(
        "the revert (hot_added and its plugin gone, no reload error)",
        || {
            let status = server.status(agent)?;
            Ok(!has_hot_add_plugin(&status) && status["reloads"]["last_error"].is_null())
        },
    )?;
    let mut n = 0;
    wait_until("bookings without test.hot_added", || {
        n += 1;
        let (text, _) = book_once(server, agent, fleet, &format!("hot{trial}-after-{n}"))?;
        Ok(!carries_action(&text, HOT_ADD_ACTION))
    })?;
    // Let the watcher go quiet before the next trial.
    std::thread::sleep(Duration::from_millis(300));
    Ok(Trial { latency, polls })
}

fn hot_add_section(settings: &Settings, artefacts: &Path) -> Result<Value, String> {
    let site = Site::new(artefacts, WITH_HINTS)?;
    let server = site.start(artefacts, true)?;
    let agent = agent();
    let so_path = artefacts.join("libfixture_hot_add.so");
    let so = std::fs::read(&so_path).map_err(|e| format!("{}: {e}", so_path.display()))?;
    let run = || -> Result<Value, String> {
        let fleet = set_up_fleet(&server, &agent)?;
        let mut trials = Vec::new();
        for trial in 0..settings.trials {
            let result = hot_add_trial(&site, &server, &agent, &fleet, &so, trial + 1)?;
            println!(
                "hot-add  trial {:>2}: {:.1} ms from rename to the first booking carrying {HOT_ADD_ACTION} ({} bookings polled){}",
                trial + 1,
                millis(result.latency),
                result.polls,
                if trial == 0 { "" } else { " [same .so content: reuses the mapped library]" }
            );
            trials.push(result);
        }
        let mut sorted: Vec<Duration> = trials.iter().map(|t| t.latency).collect();
        sorted.sort_unstable();
        let median = if sorted.len() % 2 == 1 {
            sorted[sorted.len() / 2]
        } else {
            (sorted[sorted.len() / 2 - 1] + sorted[sorted.len() / 2]) / 2
        };
        let max = *sorted.last().expect("at least one trial");
        let min = sorted[0];
        let status = server.status(&agent)?;
        println!(
            "hot-add  {} trials: median {:.1} ms, min {:.1} ms, max {:.1} ms (target <= 500 ms: {}); \
             the loader cache is content-addressed, so trials after the first re-add the same build \
             and reuse the library mapped in trial 1 (libraries mapped now: {})",
            sorted.len(),
            millis(median),
            millis(min),
            millis(max),
            kvhint_e2e::bench::verdict(settings.quick, max <= Duration::from_millis(500)),
            status["libraries_mapped"],
        );
        Ok(json!({
            "trials": sorted.len(),
            "median_ms": millis(median),
            "min_ms": millis(min),
            "max_ms": millis(max),
            "each_ms": trials.iter().map(|t| millis(t.latency)).collect::<Vec<_>>(),
            "target_ms": 500,
            "target_met": (!settings.quick).then_some(max <= Duration::from_millis(500)),
            "libraries_mapped": status["libraries_mapped"],
            "note": "trials after the first re-add the same .so content, which the content-addressed loader cache maps once",
        }))
    };
    run().map_err(|e| format!("hot add: {e}\n{}", server.log_tail()))
}

// ---------------------------------------------------------------------------
// Section 3: reloads under load

fn reloads_section(
    settings: &Settings,
    artefacts: &Path,
    problems: &mut Vec<String>,
) -> Result<Value, String> {
    let site = Site::new(artefacts, &prefetch_variant(2))?;
    let server = site.start(artefacts, false)?;
    let agent = agent();
    let mut run = || -> Result<Value, String> {
        let fleet = set_up_fleet(&server, &agent)?;
        let generation_before = server.status(&agent)?["generation"].as_u64().unwrap_or(0);
        let (stop, booked, failed) = (AtomicBool::new(false), AtomicU64::new(0), AtomicU64::new(0));
        let start = Instant::now();
        let spec = LoopSpec {
            base: &server.base,
            fleet: &fleet,
            tag: "reload",
            measure_from: start,
            end: start + RELOAD_LOAD_LIMIT,
            stop: &stop,
            booked: &booked,
            failed: &failed,
            classify_prefetch: true,
        };
        let mut reload_ok = 0u64;
        let mut reload_failed = 0u64;
        let mut first_reload_error = None;
        let mut reload_ns = Vec::new();
        let mut window = (0, 0, 0, 0, Duration::ZERO);
        let stats = std::thread::scope(|scope| {
            let load = scope.spawn(|| run_threads(&spec, settings.concurrency));
            // Let the bookers get going, then reload N times.
            std::thread::sleep(Duration::from_millis(200));
            let (booked_before, failed_before) = (
                booked.load(Ordering::Relaxed),
                failed.load(Ordering::Relaxed),
            );
            let reloads_started = Instant::now();
            for i in 0..settings.reloads {
                // Alternate 4, 2, 4, …: each reload swaps in a different snapshot.
                let max_blocks = if i % 2 == 0 { 4 } else { 2 };
                if let Err(e) = site.write_config(&prefetch_variant(max_blocks)) {
                    reload_failed += 1;
                    first_reload_error.get_or_insert(e);
                    continue;
                }
                let sent = Instant::now();
                match post(&agent, &server.url("/admin/reload"), "") {
                    Ok((200, _)) => {
                        reload_ok += 1;
                        reload_ns.push(sent.elapsed().as_nanos() as u64);
                    }
                    Ok((status, text)) => {
                        reload_failed += 1;
                        first_reload_error.get_or_insert(format!("{status} {text:.300}"));
                    }
                    Err(e) => {
                        reload_failed += 1;
                        first_reload_error.get_or_insert(e);
                    }
                }
            }
            window = (
                booked_before,
                booked.load(Ordering::Relaxed),
                failed_before,
                failed.load(Ordering::Relaxed),
                reloads_started.elapsed(),
            );
            stop.store(true, Ordering::Relaxed);
            load.join().expect("the booking threads panicked")
        });
        let (booked_before, booked_after, failed_before, failed_after, took) = window;
        reload_ns.sort_unstable();
        let status = server.status(&agent)?;
        let generation_after = status["generation"].as_u64().unwrap_or(0);
        let open = status["open_bookings"].as_u64().unwrap_or(u64::MAX);
        let without_prefetch = stats.prefetch_lengths.get(&0).copied().unwrap_or(0);
        let by_length: BTreeMap<String, u64> = stats
            .prefetch_lengths
            .iter()
            .map(|(length, count)| (length.to_string(), *count))
            .collect();
        println!(
            "reloads  {} POST /admin/reload in {:.2}s under {} booking threads: ok={reload_ok} failed={reload_failed} \
             (reload latency p50 {:.1} ms, max {:.1} ms); generation {generation_before} -> {generation_after}",
            settings.reloads,
            took.as_secs_f64(),
            settings.concurrency,
            millis(Duration::from_nanos(quantile(&reload_ns, 0.5))),
            millis(Duration::from_nanos(reload_ns.last().copied().unwrap_or(0))),
        );
        println!(
            "reloads  bookings during the reloads={} failed bookings during the reloads={} (whole run: {} bookings, {} failed; target 0); \
             bookings by kv.prefetch length {by_length:?}; open bookings after: {open} (the 8 pinned)",
            booked_after - booked_before,
            failed_after - failed_before,
            stats.bookings,
            stats.errors,
        );
        if reload_failed > 0 {
            problems.push(format!(
                "reloads: {reload_failed} of {} failed; first: {}",
                settings.reloads,
                first_reload_error.as_deref().unwrap_or("?")
            ));
        }
        if stats.errors > 0 {
            problems.push(format!(
                "reloads: {} failed bookings; first: {}",
                stats.errors,
                stats.first_error.as_deref().unwrap_or("?")
            ));
        }
        if booked_after == booked_before {
            problems.push("reloads: no booking completed while the reloads ran".into());
        }
        if without_prefetch > 0 {
            problems.push(format!(
                "reloads: {without_prefetch} bookings carried no kv.prefetch"
            ));
        }
        if generation_after != generation_before + reload_ok {
            problems.push(format!(
                "reloads: generation went {generation_before} -> {generation_after} after {reload_ok} successful reloads"
            ));
        }
        if open != PROMPTS as u64 {
            problems.push(format!(
                "reloads: {open} open bookings after the run, expected the {PROMPTS} pinned"
            ));
        }
        Ok(json!({
            "concurrency": settings.concurrency,
            "reloads": settings.reloads,
            "reloads_ok": reload_ok,
            "reloads_failed": reload_failed,
            "reload_p50_ms": millis(Duration::from_nanos(quantile(&reload_ns, 0.5))),
            "reload_max_ms": millis(Duration::from_nanos(reload_ns.last().copied().unwrap_or(0))),
            "seconds": (took.as_secs_f64() * 1000.0).round() / 1000.0,
            "bookings_during_reloads": booked_after - booked_before,
            "failed_bookings_during_reloads": failed_after - failed_before,
            "bookings_total": stats.bookings,
            "failed_bookings_total": stats.errors,
            "bookings_by_prefetch_length": by_length,
            "generation_before": generation_before,
            "generation_after": generation_after,
        }))
    };
    run().map_err(|e| format!("reloads: {e}\n{}", server.log_tail()))
}

// ---------------------------------------------------------------------------

/// A section's figures, or `null` and a problem (its first line; the whole
/// error, with the serve log's tail, goes to stderr).
fn record(result: Result<Value, String>, problems: &mut Vec<String>) -> Value {
    match result {
        Ok(value) => value,
        Err(e) => {
            eprintln!("loadgen: {e}");
            problems.push(e.lines().next().unwrap_or("").to_string());
            Value::Null
        }
    }
}

fn main() -> ExitCode {
    let quick = !std::env::args().skip(1).any(|a| a == "--bench");
    let settings = match Settings::from_env(quick) {
        Ok(settings) => settings,
        Err(e) => {
            eprintln!("loadgen: {e}");
            return ExitCode::from(2);
        }
    };
    let artefacts = if quick {
        kvhint_e2e::build_dir()
    } else {
        kvhint_e2e::release_dir()
    };
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "loadgen: kvhint serve over loopback, {} run, {} artefacts ({})",
        if quick {
            "quick smoke (not --bench)"
        } else {
            "full"
        },
        if quick { "debug" } else { "release" },
        artefacts.display()
    );
    println!(
        "loadgen: this machine has {cpus} CPUs; the server and the {} client threads share them, \
         so throughput and latency include the client's own cost and CPU contention",
        settings.concurrency
    );
    println!(
        "loadgen: settings: concurrency {}, {} s per booking mode after {:.1} s warm-up, {} hot-add trials, {} reloads; \
         fleet: {WORKERS} hint-capable decode workers, {PROMPTS} prompts x {PROMPT_TOKENS} tokens (block size {BLOCK_SIZE}), \
         each stored on 2 workers ({LONG_HOLD_BLOCKS} and {SHORT_HOLD_BLOCKS} blocks), one open booking pinned per prompt on its longest holder",
        settings.concurrency,
        settings.seconds,
        settings.warmup.as_secs_f64(),
        settings.trials,
        settings.reloads,
    );

    let mut problems = Vec::new();
    let with_hints = bookings_section(
        &settings,
        artefacts,
        "with_hints",
        WITH_HINTS,
        &mut problems,
    );
    let with_hints = record(with_hints, &mut problems);
    let without_hints = bookings_section(
        &settings,
        artefacts,
        "without_hints",
        WITHOUT_HINTS,
        &mut problems,
    );
    let without_hints = record(without_hints, &mut problems);
    let hot_add = hot_add_section(&settings, artefacts);
    let hot_add = record(hot_add, &mut problems);
    let reloads = reloads_section(&settings, artefacts, &mut problems);
    let reloads = record(reloads, &mut problems);

    let summary = json!({"loadgen": {
        "run": if quick { "quick" } else { "bench" },
        "artefacts": if quick { "debug" } else { "release" },
        "cpus": cpus,
        "concurrency": settings.concurrency,
        "seconds_per_mode": settings.seconds,
        "fleet": {"workers": WORKERS, "prompts": PROMPTS, "prompt_tokens": PROMPT_TOKENS, "block_size": BLOCK_SIZE},
        "bookings": {"with_hints": with_hints, "without_hints": without_hints},
        "hot_add": hot_add,
        "reloads_under_load": reloads,
        "problems": problems,
    }});
    println!("{summary}");
    if problems.is_empty() {
        println!("loadgen: ok");
        ExitCode::SUCCESS
    } else {
        eprintln!("loadgen: FAILED:");
        for problem in &problems {
            eprintln!("  - {problem}");
        }
        ExitCode::FAILURE
    }
}
