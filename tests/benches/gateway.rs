//! The gateway side by side: the same two llama.cpp workers (llama.cpp's own
//! server through PyPI `xllamacpp`, the tiny Qwen3-vocabulary model) behind
//! kvhint, behind SGLang's model gateway (`smg` 1.13.0, `--policy cache_aware`)
//! and vLLM's router (`vllm-router` 0.1.17, `--policy cache_aware`), and straight
//! (the client alternating between the two workers itself), in one run, round by
//! round with the systems' order rotating, so a slow stretch of the machine hits
//! every system alike.
//!
//! Three workloads, each at concurrency 1 and 8: a 4,000-token non-streaming
//! completion (1 token out: the gateway's share of the time is what shows), a
//! short streaming chat, and a 4,000-token chat whose system prompt every request
//! shares (1 token out). Per system: requests/s, p50/p99 latency, *added* latency
//! (through the system minus straight, per round, then the median over rounds),
//! time to first byte, the gateway process's CPU time per request (its threads'
//! `schedstat`, in ns), its RSS, and kvhint's tokenization time apart, per
//! workload, with what its tokenizer cache found. The completion's prompt is new
//! on every request (a unique first line), so no gateway reuses a tokenization of
//! it: its figures are the cold ones. The long chat's system prompt is the same
//! every time and only the question is new: kvhint's tokenizer cache keeps the
//! system prompt's ids (the text between two special tokens), so its figures are
//! the warm ones.
//!
//! Then the soak: 10,000 short streaming chats at concurrency 16 through kvhint
//! in front of the same two workers, every answer checked (a 200 whose stream
//! ends in `[DONE]`): client-visible errors must be zero, and the retries the
//! router made behind them are reported (`kvhint_gateway_retries_total`) with
//! the re-sends on a fresh connection (`kvhint_gateway_resent_total`).
//!
//! `cargo bench -p kvhint-e2e --bench gateway` measures (release kvhint);
//! `KVHINT_BENCH_BEFORE=/path/to/kvhint` adds another build of kvhint (the one
//! before a change) as a system of its own, in the same run and the soak;
//! `kvhint+otel` is this build with `gateway.tracing` on, every request traced
//! and exported to a real collector (PyPI `rotel`): its CPU per request beside
//! `kvhint`'s is what tracing costs;
//! `-- soak` runs the soak alone; `-- long-stream` streams one answer for ten
//! minutes (a chunk every 5 s from a paced engine, `engines::paced`) through
//! `kvhint serve` at its default flags and checks it arrives whole.
//! `cargo test -p kvhint-e2e --bench gateway` (CI's quick mode) runs each case
//! once, a small soak (320 chats) and a 1-second stream, on a debug build, to
//! keep them working; the soak's zero errors hold there too.

use kvhint_e2e::bench::{self, quantile};
use kvhint_e2e::engines::paced::{chunk_text, Pace, Paced};
use kvhint_e2e::http::{agent, timed_post};
use kvhint_e2e::llamacpp::{qwen3_tokenizer_dir, LlamaWorker, MODEL_NAME};
use kvhint_e2e::peers::Peer;
use kvhint_e2e::{private_dir, Server};
use serde_json::{json, Value};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A system under test: where clients send requests, and the process whose CPU
/// time counts (none for straight).
struct System {
    name: &'static str,
    urls: Vec<String>,
    pid: Option<u32>,
}

/// CPU time of every thread of `pid`, in ns (`/proc/PID/task/*/schedstat`'s first
/// field: time on a CPU).
fn cpu_ns(pid: u32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|task| std::fs::read_to_string(task.path().join("schedstat")).ok())
        .filter_map(|text| text.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

fn rss_mb(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

struct Workload {
    name: &'static str,
    path: &'static str,
    body: fn(u64) -> Value,
}

fn long_completion(n: u64) -> Value {
    // About 4,000 tokens (3,855 with Qwen3's tokenizer): a unique first line,
    // then numbered words.
    let mut prompt = format!("Request {n}.\n");
    for i in 0..1_330 {
        prompt.push_str(&format!("w{} ", i % 97));
    }
    json!({"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0})
}

fn long_chat(n: u64) -> Value {
    // The same ~4,000-token system prompt on every request, a new question.
    let mut system = String::from("You answer from this reference.\n");
    for i in 0..1_330 {
        system.push_str(&format!("w{} ", i % 97));
    }
    json!({"model": MODEL_NAME, "max_tokens": 1, "temperature": 0,
           "messages": [{"role": "system", "content": system},
                        {"role": "user", "content": format!("Question {n}: which word comes first?")}]})
}

fn short_chat(n: u64) -> Value {
    json!({"model": MODEL_NAME, "stream": true, "max_tokens": 16, "temperature": 0,
           "messages": [{"role": "system", "content": "You answer briefly."},
                        {"role": "user", "content": format!("Question {n}: what is a router?")}]})
}

/// Per system, per round: latencies, first-byte times, CPU ns per request.
#[derive(Default, Clone)]
struct Figures {
    total: Vec<f64>,
    ttfb: Vec<f64>,
    round_p50: Vec<f64>,
    round_p99: Vec<f64>,
    cpu_ns: Vec<f64>,
    seconds: f64,
    requests: usize,
}

/// `kvhint serve` (the bench's build) in front of `urls`, each served as
/// `engine`, at its default flags but the body limit.
fn start_kvhint(dir: &kvhint_e2e::TempDir, urls: &[String], engine: &str) -> Server {
    start_kvhint_from(&bench::artifacts().join("kvhint"), dir, urls, engine, "")
}

/// [`start_kvhint`] with the `kvhint` binary at `binary`.
fn start_kvhint_from(
    binary: &std::path::Path,
    dir: &kvhint_e2e::TempDir,
    urls: &[String],
    engine: &str,
    gateway: &str,
) -> Server {
    let config = dir.path().join("kvhint.yaml");
    let approximate = if engine == "llamacpp" {
        "    kv_events: approximate\n"
    } else {
        ""
    };
    let mut yaml = format!(
        "router:\n  block_size: 16\n  max_prompt_tokens: 65536\nworker_selection:\n  aggregated: dynamo-default-cost-fn\n\
         models:\n  {MODEL_NAME}:\n    tokenizer: {}\n{gateway}workers:\n",
        qwen3_tokenizer_dir().display()
    );
    for (i, url) in urls.iter().enumerate() {
        yaml.push_str(&format!(
            "  - worker_id: {}\n    http_endpoint: {url}\n    engine: {engine}\n    models: [{MODEL_NAME}]\n{approximate}",
            i + 1
        ));
    }
    std::fs::write(&config, yaml).unwrap();
    Server::start_command(
        Command::new(binary),
        &config,
        &["--max-body-bytes", "8388608"],
        dir.path(),
    )
}

fn main() {
    let quick = !bench::is_bench();
    let only = |mode: &str| std::env::args().skip(1).any(|a| a == mode);
    if only("long-stream") {
        long_stream(false);
        return;
    }
    // 8 slots, each room for a 4,000-token prompt.
    let workers = [
        LlamaWorker::start_sized(8, 8 * 4_200),
        LlamaWorker::start_sized(8, 8 * 4_200),
    ];
    let urls: Vec<String> = workers.iter().map(LlamaWorker::url).collect();
    let dir = private_dir();
    let kvhint = start_kvhint(&dir, &urls, "llamacpp");
    // `KVHINT_BENCH_BEFORE=/path/to/kvhint`: another build of kvhint (the one
    // before a change), measured beside this one in the same run.
    let before_dir = private_dir();
    let before = std::env::var_os("KVHINT_BENCH_BEFORE").map(|binary| {
        start_kvhint_from(
            std::path::Path::new(&binary),
            &before_dir,
            &urls,
            "llamacpp",
            "",
        )
    });
    // The same build with OpenTelemetry tracing on, every request traced and
    // exported to a real collector: what tracing costs per request.
    let collector = kvhint_e2e::otel::Collector::start();
    let traced_dir = private_dir();
    let traced = start_kvhint_from(
        &bench::artifacts().join("kvhint"),
        &traced_dir,
        &urls,
        "llamacpp",
        &format!(
            "gateway:\n  tracing:\n    otlp_endpoint: {}\n",
            collector.grpc
        ),
    );
    let mut kvhints = vec![("kvhint", &kvhint), ("kvhint+otel", &traced)];
    if let Some(before) = &before {
        kvhints.push(("kvhint-before", before));
    }
    if !only("soak") {
        side_by_side(quick, &kvhints, &urls);
    }
    for (name, server) in kvhints.iter().filter(|(name, _)| *name != "kvhint+otel") {
        soak(name, server, if quick { 320 } else { 10_000 });
    }
    drop(collector);
    if quick {
        long_stream(true);
    }
}

/// kvhint, the peers and straight, interleaved round by round.
fn side_by_side(quick: bool, kvhints: &[(&'static str, &Server)], urls: &[String]) {
    let kvhint = kvhints[0].1;
    let (rounds, per_round): (usize, usize) = if quick { (1, 2) } else { (5, 40) };
    let smg = Peer::smg(urls);
    let router = Peer::vllm_router(urls);

    let mut systems = vec![System {
        name: "straight",
        urls: urls.to_vec(),
        pid: None,
    }];
    systems.extend(kvhints.iter().map(|(name, server)| System {
        name,
        urls: vec![server.base.clone()],
        pid: Some(server.child.id()),
    }));
    systems.extend([
        System {
            name: "smg",
            urls: vec![smg.url.clone()],
            pid: Some(smg.child.id()),
        },
        System {
            name: "vllm-router",
            urls: vec![router.url.clone()],
            pid: Some(router.child.id()),
        },
    ]);
    let workloads = [
        Workload {
            name: "4k-token completion",
            path: "/v1/completions",
            body: long_completion,
        },
        Workload {
            name: "short streaming chat",
            path: "/v1/chat/completions",
            body: short_chat,
        },
        Workload {
            name: "4k-token chat, shared system prompt",
            path: "/v1/chat/completions",
            body: long_chat,
        },
    ];
    let counter = Arc::new(AtomicU64::new(0));
    println!(
        "gateway bench ({}): {rounds} rounds × {per_round} requests per system, workload and concurrency",
        if quick { "quick mode, debug build: not measurements" } else { "release" }
    );
    for workload in &workloads {
        for concurrency in [1usize, 8] {
            let mut figures = vec![Figures::default(); systems.len()];
            let tokenizing_before = tokenizing(kvhint);
            // Warm every path (connections, pools) before measuring.
            for system in &systems {
                for url in &system.urls {
                    let body = (workload.body)(counter.fetch_add(1, Ordering::Relaxed)).to_string();
                    timed_post(&agent(), &format!("{url}{}", workload.path), &body);
                }
            }
            for round in 0..rounds {
                for k in 0..systems.len() {
                    let at = (k + round) % systems.len();
                    let system = &systems[at];
                    let cpu_before = system.pid.map(cpu_ns);
                    let started = Instant::now();
                    let threads: Vec<_> = (0..concurrency)
                        .map(|t| {
                            let urls = system.urls.clone();
                            let counter = Arc::clone(&counter);
                            let path = workload.path;
                            let make = workload.body;
                            let count = per_round.div_ceil(concurrency);
                            std::thread::spawn(move || {
                                let agent = agent();
                                (0..count)
                                    .map(|i| {
                                        let n = counter.fetch_add(1, Ordering::Relaxed);
                                        let url = &urls[(t + i) % urls.len()];
                                        timed_post(
                                            &agent,
                                            &format!("{url}{path}"),
                                            &make(n).to_string(),
                                        )
                                    })
                                    .collect::<Vec<_>>()
                            })
                        })
                        .collect();
                    let mut samples: Vec<(f64, f64)> = Vec::new();
                    for thread in threads {
                        samples.extend(thread.join().unwrap());
                    }
                    let elapsed = started.elapsed().as_secs_f64();
                    let f = &mut figures[at];
                    if let (Some(before), Some(pid)) = (cpu_before, system.pid) {
                        f.cpu_ns
                            .push((cpu_ns(pid) - before) as f64 / samples.len() as f64);
                    }
                    let mut totals: Vec<f64> = samples.iter().map(|s| s.0).collect();
                    f.round_p50.push(quantile(&mut totals, 0.5));
                    f.round_p99.push(quantile(&mut totals, 0.99));
                    f.total.extend(samples.iter().map(|s| s.0));
                    f.ttfb.extend(samples.iter().map(|s| s.1));
                    f.seconds += elapsed;
                    f.requests += samples.len();
                }
            }
            println!("\n{} at concurrency {concurrency}:", workload.name);
            println!(
                "  {:<12} {:>8} {:>9} {:>9} {:>10} {:>10} {:>9} {:>10} {:>8}",
                "system",
                "req/s",
                "p50 ms",
                "p99 ms",
                "+p50 ms",
                "+p99 ms",
                "ttfb ms",
                "cpu ms/req",
                "rss MB"
            );
            let straight = figures[0].clone();
            for (system, f) in systems.iter().zip(&figures) {
                let added = |mine: &[f64], base: &[f64]| {
                    let mut diffs: Vec<f64> =
                        mine.iter().zip(base).map(|(a, b)| (a - b) * 1e3).collect();
                    bench::median(&mut diffs)
                };
                let mut total = f.total.clone();
                let mut ttfb = f.ttfb.clone();
                let mut cpu = f.cpu_ns.clone();
                println!(
                    "  {:<12} {:>8.1} {:>9.2} {:>9.2} {:>10.3} {:>10.3} {:>9.2} {:>10.3} {:>8.1}",
                    system.name,
                    f.requests as f64 / f.seconds,
                    quantile(&mut total, 0.5) * 1e3,
                    quantile(&mut total, 0.99) * 1e3,
                    added(&f.round_p50, &straight.round_p50),
                    added(&f.round_p99, &straight.round_p99),
                    quantile(&mut ttfb, 0.5) * 1e3,
                    if cpu.is_empty() {
                        0.0
                    } else {
                        bench::median(&mut cpu) / 1e6
                    },
                    system.pid.map_or(0.0, rss_mb),
                );
            }
            let t = tokenizing(kvhint).since(&tokenizing_before);
            println!(
                "  kvhint tokenization {:.3} ms mean over {} requests, router overhead {:.3} ms mean; \
                 tokenizer cache: {:.0}% of the prompt text found ({} pieces found, {} encoded)",
                t.seconds / t.count.max(1.0) * 1e3,
                t.count,
                t.overhead / t.count.max(1.0) * 1e3,
                100.0 * t.hit_bytes / (t.hit_bytes + t.miss_bytes).max(1.0),
                t.hits,
                t.misses,
            );
        }
    }
    drop(smg);
    drop(router);
}

/// The soak: `requests` short streaming chats at concurrency 16 through
/// kvhint, each read to its end and checked (a 200 whose stream ends in
/// `[DONE]`). Prints the client-visible errors (the first few in full), and the
/// retries and fresh-connection re-sends the router made behind them.
fn soak(name: &str, kvhint: &Server, requests: usize) {
    const CONCURRENCY: usize = 16;
    let url = format!("{}/v1/chat/completions", kvhint.base);
    let counters = |kvhint: &Server| {
        let metrics = kvhint_e2e::http::metrics(kvhint);
        (
            kvhint_e2e::http::sum_of(&metrics, "kvhint_gateway_retries_total"),
            kvhint_e2e::http::sum_of(&metrics, "kvhint_gateway_resent_total"),
        )
    };
    let (retries_before, resent_before) = counters(kvhint);
    let counter = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let threads: Vec<_> = (0..CONCURRENCY)
        .map(|_| {
            let url = url.clone();
            let counter = Arc::clone(&counter);
            std::thread::spawn(move || {
                let agent = agent();
                let mut latencies = Vec::new();
                let mut errors: Vec<String> = Vec::new();
                loop {
                    let n = counter.fetch_add(1, Ordering::Relaxed);
                    if n >= requests as u64 {
                        break;
                    }
                    let body = short_chat(1_000_000 + n).to_string();
                    let sent = Instant::now();
                    let outcome = agent
                        .post(&url)
                        .header("content-type", "application/json")
                        .send(&body)
                        .map_err(|e| e.to_string())
                        .and_then(|mut response| {
                            let status = response.status().as_u16();
                            let text = response
                                .body_mut()
                                .read_to_string()
                                .map_err(|e| format!("reading the stream: {e}"))?;
                            if status != 200 {
                                Err(format!("{status}: {text}"))
                            } else if !text.trim_end().ends_with("data: [DONE]") {
                                Err(format!("a stream without [DONE]: {text}"))
                            } else {
                                Ok(())
                            }
                        });
                    match outcome {
                        Ok(()) => latencies.push(sent.elapsed().as_secs_f64()),
                        Err(e) => errors.push(e),
                    }
                }
                (latencies, errors)
            })
        })
        .collect();
    let (mut latencies, mut errors) = (Vec::new(), Vec::new());
    for thread in threads {
        let (l, e) = thread.join().unwrap();
        latencies.extend(l);
        errors.extend(e);
    }
    let seconds = started.elapsed().as_secs_f64();
    let (retries, resent) = counters(kvhint);
    let (retries, resent) = (retries - retries_before, resent - resent_before);
    println!(
        "\nsoak: {requests} short streaming chats at concurrency {CONCURRENCY} through {name}, two llama.cpp workers"
    );
    println!(
        "  {:.1} req/s, p50 {:.2} ms, p99 {:.2} ms; client-visible errors {}; retries {} ({:.3}%), re-sent on a fresh connection {} ({:.3}%)",
        requests as f64 / seconds,
        if latencies.is_empty() { 0.0 } else { quantile(&mut latencies, 0.5) * 1e3 },
        if latencies.is_empty() { 0.0 } else { quantile(&mut latencies, 0.99) * 1e3 },
        errors.len(),
        retries,
        100.0 * retries / requests as f64,
        resent,
        100.0 * resent / requests as f64,
    );
    for error in errors.iter().take(5) {
        println!("  error: {error}");
    }
    // The build before a change is measured, not judged.
    assert!(
        errors.is_empty() || name != "kvhint",
        "{} of {requests} chats failed against healthy workers; the first: {}",
        errors.len(),
        errors[0]
    );
}

/// One answer streamed for ten minutes (`quick`: one second) by a paced engine,
/// a chunk every 5 s (200 ms), through `kvhint serve` at its default flags:
/// every chunk and `[DONE]` must arrive.
fn long_stream(quick: bool) {
    let (chunks, every) = if quick {
        (5, Duration::from_millis(200))
    } else {
        (120, Duration::from_secs(5))
    };
    let paced = Paced::start(Pace {
        chunks,
        every,
        answer_after: Duration::ZERO,
        close_after_stream: None,
    });
    let dir = private_dir();
    let kvhint = start_kvhint(&dir, &[paced.url()], "openai");
    let agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(every * (chunks as u32 + 10)))
        .build()
        .new_agent();
    let started = Instant::now();
    let mut response = agent
        .post(&format!("{}/v1/chat/completions", kvhint.base))
        .header("content-type", "application/json")
        .send(
            json!({"model": MODEL_NAME, "stream": true,
                   "messages": [{"role": "user", "content": "Reason at length."}]})
            .to_string(),
        )
        .unwrap_or_else(|e| panic!("the long stream: {e}"));
    let status = response.status().as_u16();
    let text = response
        .body_mut()
        .with_config()
        .limit(64 << 20)
        .read_to_string()
        .unwrap_or_else(|e| panic!("reading the long stream: {e}"));
    let seconds = started.elapsed().as_secs_f64();
    let arrived = (0..chunks)
        .filter(|i| text.contains(&format!("\"{}\"", chunk_text(*i))))
        .count();
    let done = text.trim_end().ends_with("data: [DONE]");
    println!(
        "\nlong stream: status {status}, {arrived} of {chunks} chunks and {} over {seconds:.1} s (a chunk every {every:?}, kvhint at its default flags)",
        if done { "[DONE]" } else { "NO [DONE]" }
    );
    assert!(
        status == 200 && arrived == chunks && done,
        "the stream was cut: {text}"
    );
}

/// kvhint's tokenization counters, read from its `/metrics`.
#[derive(Default)]
struct Tokenizing {
    seconds: f64,
    count: f64,
    overhead: f64,
    hits: f64,
    misses: f64,
    hit_bytes: f64,
    miss_bytes: f64,
}

impl Tokenizing {
    fn since(&self, before: &Tokenizing) -> Tokenizing {
        Tokenizing {
            seconds: self.seconds - before.seconds,
            count: self.count - before.count,
            overhead: self.overhead - before.overhead,
            hits: self.hits - before.hits,
            misses: self.misses - before.misses,
            hit_bytes: self.hit_bytes - before.hit_bytes,
            miss_bytes: self.miss_bytes - before.miss_bytes,
        }
    }
}

fn tokenizing(kvhint: &Server) -> Tokenizing {
    let (_, metrics) = kvhint.get("/metrics");
    // Sums every sample of a family whose line starts with `prefix`.
    let sum = |prefix: &str| -> f64 {
        metrics
            .lines()
            .filter(|l| l.starts_with(prefix))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    let cache = |family: &str, result: &str| {
        format!(
            "kvhint_tokenizer_cache_{family}_total{{model=\"{MODEL_NAME}\",result=\"{result}\"}}"
        )
    };
    Tokenizing {
        seconds: sum("kvhint_gateway_tokenize_seconds_sum"),
        count: sum("kvhint_gateway_tokenize_seconds_count"),
        overhead: sum("kvhint_gateway_overhead_seconds_sum"),
        hits: sum(&cache("pieces", "hit")),
        misses: sum(&cache("pieces", "miss")),
        hit_bytes: sum(&cache("text_bytes", "hit")),
        miss_bytes: sum(&cache("text_bytes", "miss")),
    }
}
