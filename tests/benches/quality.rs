//! Routing quality side by side: what a client gets from each router in front of
//! the same real llama.cpp workers, whose prompt caches are bounded as a real
//! worker's are.
//!
//! Two llama.cpp servers (llama.cpp's own server through PyPI `xllamacpp`), one
//! compute thread each, serve a random-weight model big enough that prefill
//! dominates (`llamacpp::quality_model`: a 1,600-token prompt takes a few hundred
//! milliseconds to prefill, the same prompt from the cache a few tens), with four
//! slots sharing one KV buffer and a host-memory prompt cache of
//! `QUALITY_CACHE_MIB` (16 MiB: about five prompts of 1,600 tokens), so a worker
//! can reuse only what it recently served, as a worker with a full GPU cache.
//!
//! Workloads (seeded, the same requests for every system), sent as streaming chats
//! on an open-loop Poisson schedule:
//! - `shared`: 8 groups × 10 requests sharing a ~1,500-token system prompt, each
//!   with its own ~100-token question;
//! - `multiturn`: 8 chats × 8 turns, 1,200 → 1,900 tokens, each turn sent after
//!   the chat's previous one has ended;
//! - `unique`: 40 prompts of ~1,600 tokens that share nothing (they must still
//!   spread evenly);
//! - `mix`: shared groups, chats and unique prompts interleaved.
//!
//! Loads: the arrival rate is set from the workers' measured costs (per prefilled
//! token, and per request besides) so that a fleet that computed every prompt in
//! full would be `light` (35 % busy), at `medium` (70 %) or `saturated` (130 %:
//! its queue grows without end). A router that finds the reusable prefixes
//! lightens each load as much as it finds; the same arrival times go to every
//! system.
//!
//! Systems, interleaved (their order rotates from block to block) with fresh
//! workers (empty caches) for every block: `straight` (the client alternates
//! between the workers: round robin), `smg` 1.13 and `vllm-router` 0.1.17 with
//! `--policy cache_aware` at their launchers' defaults, and `kvhint` with the
//! config `docs/gateway.md` gives for a llama.cpp fleet and nothing tuned.
//! Per system: time to first token (the first SSE event) p50/p90/p99, end-to-end
//! p50/p90, throughput, the share of prompt tokens the engines served from their
//! caches (llama.cpp's `usage.prompt_tokens_details.cached_tokens`), how the
//! prompt tokens spread over the two workers (their `/metrics`), and errors.
//!
//! `cargo bench -p kvhint-e2e --bench quality` measures (release kvhint; about an
//! hour for two repetitions of every block). `cargo test -p kvhint-e2e --bench
//! quality` (CI's quick mode) runs one small mixed workload once per system on
//! the tiny model, to keep it working. Environment:
//! - `QUALITY_WORKLOADS` (`shared,multiturn,unique,mix`), `QUALITY_LOADS`
//!   (`light,medium,saturated`), `QUALITY_SYSTEMS` (`straight,smg,vllm-router,kvhint`),
//!   `QUALITY_REPS` (2), `QUALITY_SEED`, `QUALITY_CACHE_MIB`;
//! - `QUALITY_VARIANTS`: more kvhint systems, `name=SECTIONS;…`, each config's
//!   top-level sections replaced by these (YAML lines, `|` between lines:
//!   `dyn4=worker_selection: {aggregated: {type: dynamo-default-cost-fn,
//!   parameters: {overlap_score_weight: 4}}}|gateway: {prefix_wait_ms: 0}`);
//! - `QUALITY_KVHINT_BIN`: a `kvhint` binary to run as `kvhint-bin` beside this
//!   build's (an earlier build, for before/after);
//! - `QUALITY_OUT`: a file to append every request's outcome to, as JSON lines.

use kvhint_e2e::bench::{self, quantile};
use kvhint_e2e::http::get;
use kvhint_e2e::llamacpp::{
    quality_model, qwen3_tokenizer_dir, LlamaWorker, WorkerOptions, MODEL_NAME,
};
use kvhint_e2e::peers::Peer;
use kvhint_e2e::workloads::{
    self, chat, client, text, workload, Front, Item, Kind, Outcome, Sizes,
};
use kvhint_e2e::{private_dir, Server};
use serde_json::json;
use std::io::Write;
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// What the workers cost, measured on a fresh one: seconds per prompt token
/// prefilled, and the fixed part of a request (a cache hit's restore, the
/// generated tokens), from a cold and a warm request; and how much longer each
/// takes when several run at once (a worker's slots share one compute thread,
/// and the machine's two cores are shared with the router and the client).
#[derive(Clone, Copy, Debug)]
struct Costs {
    per_token: f64,
    fixed: f64,
    tokens_per_word: f64,
    /// A request's share of a batch of cold ones sent together, against one
    /// cold request alone.
    contention: f64,
}

impl Costs {
    /// Seconds a worker is busy with `item` if it computes the whole prompt.
    fn full_service(&self, item: &Item) -> f64 {
        self.contention * (self.fixed + item.words as f64 * self.tokens_per_word * self.per_token)
    }
}

/// A system's name and how to put it in front of workers.
#[derive(Clone)]
struct System {
    name: String,
    how: How,
}

#[derive(Clone)]
enum How {
    Straight,
    Smg,
    VllmRouter,
    /// kvhint with these config sections (None: the documented config as it
    /// is), from this binary.
    Kvhint {
        selection: Option<String>,
        binary: PathBuf,
    },
}

/// The config `docs/gateway.md` gives for a llama.cpp fleet, for `workers`,
/// with a variant's sections (YAML lines, `|` between them) added.
fn kvhint_config(variant: Option<&str>, workers: &[String]) -> String {
    let mut yaml = String::from("router:\n  block_size: 16\n  max_prompt_tokens: 65536\n");
    // No `worker_selection`: the documented config leaves it to the default.
    let lines: Vec<&str> = variant.map_or_else(Vec::new, |v| v.split('|').collect());
    for line in lines {
        yaml.push_str(line);
        yaml.push('\n');
    }
    yaml.push_str(&format!(
        "models:\n  {MODEL_NAME}:\n    tokenizer: {}\nworkers:\n",
        qwen3_tokenizer_dir().display()
    ));
    for (i, url) in workers.iter().enumerate() {
        yaml.push_str(&format!(
            "  - worker_id: {}\n    http_endpoint: {url}\n    engine: llamacpp\n    models: [{MODEL_NAME}]\n    kv_events: approximate\n",
            i + 1
        ));
    }
    yaml
}

fn front(system: &System, workers: &[String], dir: &std::path::Path) -> Front {
    match &system.how {
        How::Straight => Front::Straight(workers.to_vec()),
        How::Smg => Front::Peer(Peer::smg(workers)),
        How::VllmRouter => Front::Peer(Peer::vllm_router(workers)),
        How::Kvhint { selection, binary } => {
            let config = dir.join(format!("{}.yaml", system.name));
            std::fs::write(&config, kvhint_config(selection.as_deref(), workers))
                .unwrap_or_else(|e| panic!("cannot write {}: {e}", config.display()));
            Front::Kvhint(Server::start_command(
                Command::new(binary),
                &config,
                &["--max-body-bytes", "8388608"],
                dir,
            ))
        }
    }
}

/// Prompt tokens each worker took (evaluated and from its cache), from its
/// `/metrics`.
fn prompt_tokens(worker: &LlamaWorker) -> f64 {
    let (_, text) = get(
        &kvhint_e2e::http::agent(),
        &format!("{}/metrics", worker.url()),
    );
    text.lines()
        .filter(|l| {
            l.starts_with("llamacpp:prompt_tokens_total ")
                || l.starts_with("llamacpp:prompt_tokens_cached_total ")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn worker_options(quick: bool, cache_mib: i64) -> WorkerOptions {
    WorkerOptions {
        model: (!quick).then(|| quality_model().to_path_buf()),
        parallel: 4,
        ctx: 8192,
        threads: 1,
        cache_ram_mib: Some(cache_mib),
        kv_unified: true,
        extra: Vec::new(),
    }
}

/// Two fresh workers, each warmed with one short request (a fresh llama.cpp
/// server's first request pays for setting up its buffers).
fn fresh_workers(options: &WorkerOptions) -> Vec<LlamaWorker> {
    let workers: Vec<LlamaWorker> = (0..2)
        .map(|_| LlamaWorker::start_options(options.clone()))
        .collect();
    let agent = client();
    for worker in &workers {
        let warm = chat(
            &agent,
            &worker.url(),
            &json!([{"role": "user", "content": "Warm up."}]),
        );
        assert!(warm.error.is_none(), "warming a worker: {warm:?}");
    }
    workers
}

/// Measures [`Costs`] on fresh workers: cold and warm requests of a ~1,600-word
/// prompt, three of each, on one; then a batch of cold ones sent to both at
/// once, as the workloads send them.
fn calibrate(options: &WorkerOptions, quick: bool) -> Costs {
    let workers = fresh_workers(options);
    let agent = client();
    let url = workers[0].url();
    let (system_words, question_words) = if quick { (150, 20) } else { (1_500, 100) };
    let mut cold = Vec::new();
    let mut warm = Vec::new();
    let mut per_word = Vec::new();
    for round in 0..3u64 {
        let system = text(90_000 + round, system_words);
        let ask = |q: u64| {
            json!([{"role": "system", "content": system},
                   {"role": "user", "content": text(91_000 + round * 10 + q, question_words)}])
        };
        let first = chat(&agent, &url, &ask(0));
        let second = chat(&agent, &url, &ask(1));
        assert!(
            first.error.is_none() && second.error.is_none(),
            "calibrating: {first:?} {second:?}"
        );
        cold.push((first.e2e, first.prompt_tokens - first.cached_tokens));
        warm.push((second.e2e, second.prompt_tokens - second.cached_tokens));
        per_word.push(first.prompt_tokens as f64 / (system_words + question_words) as f64);
    }
    let median = |v: &mut Vec<f64>| bench::median(v);
    let cold_s = median(&mut cold.iter().map(|c| c.0).collect());
    let warm_s = median(&mut warm.iter().map(|c| c.0).collect());
    let cold_n = median(&mut cold.iter().map(|c| c.1 as f64).collect());
    let warm_n = median(&mut warm.iter().map(|c| c.1 as f64).collect());
    let per_token = ((cold_s - warm_s) / (cold_n - warm_n).max(1.0)).max(1e-6);
    // Four new prompts on each worker at once.
    let started = Instant::now();
    let batch: Vec<_> = (0..8u64)
        .map(|i| {
            let url = workers[i as usize % 2].url();
            let messages = json!([{"role": "user", "content": text(92_000 + i, system_words + question_words)}]);
            std::thread::spawn(move || chat(&client(), &url, &messages))
        })
        .collect();
    for request in batch {
        let outcome = request.join().expect("a calibration request panicked");
        assert!(outcome.error.is_none(), "calibrating: {outcome:?}");
    }
    let share = started.elapsed().as_secs_f64() / 4.0;
    Costs {
        per_token,
        fixed: (warm_s - warm_n * per_token).max(0.0),
        tokens_per_word: median(&mut per_word),
        contention: (share / cold_s).max(1.0),
    }
}

/// Runs `items` against `system` on fresh workers, at `rate` requests/s.
#[allow(clippy::too_many_arguments)]
fn run_block(
    system: &System,
    items: &[Item],
    rate: f64,
    seed: u64,
    options: &WorkerOptions,
    dir: &std::path::Path,
) -> (Vec<Outcome>, Vec<f64>) {
    let workers = fresh_workers(options);
    let urls: Vec<String> = workers.iter().map(LlamaWorker::url).collect();
    let before: Vec<f64> = workers.iter().map(prompt_tokens).collect();
    let front = Arc::new(front(system, &urls, dir));
    let url_of = {
        let front = Arc::clone(&front);
        Arc::new(move |n: usize| front.url(n))
    };
    let outcomes = workloads::run(items, rate, seed, url_of);
    let spread: Vec<f64> = workers
        .iter()
        .zip(&before)
        .map(|(w, b)| prompt_tokens(w) - b)
        .collect();
    drop(front);
    (outcomes, spread)
}

/// Every block's results for one system, pooled over repetitions.
#[derive(Default, Clone)]
struct Pooled {
    outcomes: Vec<Outcome>,
    /// Per repetition: TTFT p90, and the block's duration.
    rep_p90: Vec<f64>,
    seconds: f64,
    spread: Vec<f64>,
}

fn systems(quick: bool) -> Vec<System> {
    let kvhint = bench::artifacts().join("kvhint");
    let mut out: Vec<System> =
        bench::env_list("QUALITY_SYSTEMS", "straight,smg,vllm-router,kvhint")
            .into_iter()
            .map(|name| {
                let how = match name.as_str() {
                    "straight" => How::Straight,
                    "smg" => How::Smg,
                    "vllm-router" => How::VllmRouter,
                    "kvhint" => How::Kvhint {
                        selection: None,
                        binary: kvhint.clone(),
                    },
                    other => {
                        panic!("unknown system {other:?}: straight, smg, vllm-router or kvhint")
                    }
                };
                System { name, how }
            })
            .collect();
    if let Ok(variants) = std::env::var("QUALITY_VARIANTS") {
        for variant in variants.split(';').filter(|v| !v.trim().is_empty()) {
            let Some((name, yaml)) = variant.split_once('=') else {
                panic!("QUALITY_VARIANTS: {variant:?} is not name=YAML");
            };
            out.push(System {
                name: name.trim().to_string(),
                how: How::Kvhint {
                    selection: Some(yaml.trim().to_string()),
                    binary: kvhint.clone(),
                },
            });
        }
    }
    if let Ok(binary) = std::env::var("QUALITY_KVHINT_BIN") {
        // An earlier build, with the config its docs gave (before
        // `worker_selection` was optional).
        out.push(System {
            name: "kvhint-bin".into(),
            how: How::Kvhint {
                selection: Some(
                    "worker_selection: {aggregated: dynamo-default-cost-fn}".to_string(),
                ),
                binary: PathBuf::from(binary),
            },
        });
    }
    if quick {
        out.retain(|s| !matches!(s.how, How::Kvhint { .. }) || s.name == "kvhint");
    }
    out
}

fn main() {
    let quick = !bench::is_bench();
    let seed: u64 = std::env::var("QUALITY_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(7);
    let reps: usize = if quick {
        1
    } else {
        std::env::var("QUALITY_REPS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(2)
    };
    let cache_mib: i64 = std::env::var("QUALITY_CACHE_MIB")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(16);
    let sizes = if quick {
        Sizes {
            groups: 4,
            per_group: 3,
            system_words: 150,
            question_words: 20,
            chats: 3,
            turns: 3,
            chat_system_words: 120,
            turn_words: 20,
            unique: 6,
            unique_words: 160,
        }
    } else {
        Sizes {
            groups: 8,
            per_group: 10,
            system_words: 1_500,
            question_words: 100,
            chats: 8,
            turns: 8,
            chat_system_words: 1_100,
            turn_words: 100,
            unique: 40,
            unique_words: 1_600,
        }
    };
    let workloads: Vec<Kind> = if quick {
        vec![Kind::Mix]
    } else {
        bench::env_list("QUALITY_WORKLOADS", "shared,multiturn,unique,mix")
            .iter()
            .map(|w| Kind::parse(w))
            .collect()
    };
    let loads: Vec<(String, f64)> = if quick {
        vec![("medium".into(), 0.7)]
    } else {
        bench::env_list("QUALITY_LOADS", "light,medium,saturated")
            .into_iter()
            .map(|l| {
                let rho = match l.as_str() {
                    "light" => 0.35,
                    "medium" => 0.7,
                    "saturated" => 1.3,
                    other => panic!("unknown load {other:?}: light, medium or saturated"),
                };
                (l, rho)
            })
            .collect()
    };
    let systems = systems(quick);
    let options = worker_options(quick, cache_mib);
    let out = std::env::var("QUALITY_OUT").ok().map(|path| {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .unwrap_or_else(|e| panic!("QUALITY_OUT {path}: {e}"))
    });
    let out = Mutex::new(out);
    let dir = private_dir();

    let costs = calibrate(&options, quick);
    println!(
        "quality bench ({}): {reps} repetition(s); workers: llama.cpp, 1 thread, 4 slots, {cache_mib} MiB prompt cache; \
         measured cost: {:.3} ms per prefilled token, {:.0} ms per request besides, {:.2}× that when four run at once, \
         {:.2} tokens per word",
        if quick { "quick mode, debug build, tiny model: not measurements" } else { "release" },
        costs.per_token * 1e3,
        costs.fixed * 1e3,
        costs.contention,
        costs.tokens_per_word,
    );
    let mut verdicts: Vec<String> = Vec::new();
    for &kind in &workloads {
        let items = workload(kind, &sizes, seed);
        let full: f64 =
            items.iter().map(|i| costs.full_service(i)).sum::<f64>() / items.len() as f64;
        // The most a cache could serve: every prefix an earlier request brought.
        let reusable = items.iter().map(|i| i.reusable_words).sum::<usize>() as f64
            / items.iter().map(|i| i.words).sum::<usize>().max(1) as f64;
        for (load, rho) in &loads {
            let rate = rho * 2.0 / full;
            let mut pooled = vec![Pooled::default(); systems.len()];
            for rep in 0..reps {
                for k in 0..systems.len() {
                    let at = (k + rep) % systems.len();
                    let system = &systems[at];
                    eprintln!(
                        "[quality] {} {load} rep {}: {} ({} requests at {rate:.2}/s)",
                        kind.name(),
                        rep + 1,
                        system.name,
                        items.len()
                    );
                    let block_seed = seed ^ ((rep as u64) << 32);
                    let (outcomes, spread) =
                        run_block(system, &items, rate, block_seed, &options, dir.path());
                    if let Some(file) = out.lock().unwrap().as_mut() {
                        for o in &outcomes {
                            let line = json!({"workload": kind.name(), "load": load, "rep": rep,
                                "system": system.name, "key": o.key, "sent": o.sent, "ended": o.ended,
                                "ttft": o.ttft, "e2e": o.e2e, "prompt_tokens": o.prompt_tokens,
                                "cached_tokens": o.cached_tokens, "predicted_tokens": o.predicted_tokens,
                                "error": o.error});
                            let _ = writeln!(file, "{line}");
                        }
                    }
                    let p = &mut pooled[at];
                    let mut ttfts: Vec<f64> = outcomes.iter().map(|o| o.ttft).collect();
                    p.rep_p90.push(quantile(&mut ttfts, 0.9));
                    p.seconds += outcomes.iter().map(|o| o.ended).fold(0.0, f64::max);
                    if p.spread.is_empty() {
                        p.spread = spread;
                    } else {
                        for (a, b) in p.spread.iter_mut().zip(spread) {
                            *a += b;
                        }
                    }
                    p.outcomes.extend(outcomes);
                }
            }
            let table = Table {
                kind,
                load,
                rho: *rho,
                rate,
                reusable,
            };
            report(&table, &systems, &pooled, quick, &mut verdicts);
        }
    }
    if !verdicts.is_empty() {
        println!("\nverdicts (kvhint against the best peer; targets: docs/performance.md):");
        for v in verdicts {
            println!("  {v}");
        }
    }
}

/// What one table is of: a workload at a load.
struct Table<'a> {
    kind: Kind,
    load: &'a str,
    rho: f64,
    rate: f64,
    /// The share of prompt words earlier requests brought: the most a cache
    /// could serve.
    reusable: f64,
}

/// One table: every system on one workload at one load.
fn report(
    table: &Table<'_>,
    systems: &[System],
    pooled: &[Pooled],
    quick: bool,
    verdicts: &mut Vec<String>,
) {
    let Table {
        kind,
        load,
        rho,
        rate,
        reusable,
    } = *table;
    println!(
        "\n{} at {load} load ({:.0} % busy if every prompt were computed in full; {rate:.2} requests/s; \
         at most {:.0} % of prompt tokens reusable):",
        kind.name(),
        rho * 100.0,
        reusable * 100.0,
    );
    println!(
        "  {:<14} {:>8} {:>8} {:>8} {:>14} {:>8} {:>8} {:>7} {:>8} {:>9} {:>6}",
        "system",
        "ttft p50",
        "ttft p90",
        "ttft p99",
        "p90 by rep",
        "e2e p50",
        "e2e p90",
        "req/s",
        "cached",
        "spread",
        "errors"
    );
    struct Row {
        p90: f64,
        cached: f64,
        spread: f64,
    }
    let mut rows: Vec<Row> = Vec::new();
    for (system, p) in systems.iter().zip(pooled) {
        let ok: Vec<&Outcome> = p.outcomes.iter().filter(|o| o.error.is_none()).collect();
        let errors = p.outcomes.len() - ok.len();
        if ok.is_empty() {
            println!("  {:<14} every request failed", system.name);
            rows.push(Row {
                p90: f64::INFINITY,
                cached: 0.0,
                spread: 1.0,
            });
            continue;
        }
        let mut ttft: Vec<f64> = ok.iter().map(|o| o.ttft * 1e3).collect();
        let mut e2e: Vec<f64> = ok.iter().map(|o| o.e2e * 1e3).collect();
        let prompt: u64 = ok.iter().map(|o| o.prompt_tokens).sum();
        let cached: u64 = ok.iter().map(|o| o.cached_tokens).sum();
        let total: f64 = p.spread.iter().sum::<f64>().max(1.0);
        let top = p.spread.iter().cloned().fold(0.0, f64::max) / total;
        let by_rep = p
            .rep_p90
            .iter()
            .map(|v| format!("{:.0}", v * 1e3))
            .collect::<Vec<_>>()
            .join("/");
        let row = Row {
            p90: quantile(&mut ttft, 0.9),
            cached: cached as f64 / prompt.max(1) as f64,
            spread: top,
        };
        println!(
            "  {:<14} {:>8.0} {:>8.0} {:>8.0} {:>14} {:>8.0} {:>8.0} {:>7.2} {:>7.1}% {:>5.0}/{:<3.0} {:>6}",
            system.name,
            quantile(&mut ttft, 0.5),
            row.p90,
            quantile(&mut ttft, 0.99),
            by_rep,
            quantile(&mut e2e, 0.5),
            quantile(&mut e2e, 0.9),
            p.outcomes.len() as f64 / p.seconds.max(1e-9),
            row.cached * 100.0,
            top * 100.0,
            (1.0 - top) * 100.0,
            errors,
        );
        rows.push(row);
    }
    for (system, p) in systems.iter().zip(pooled) {
        let predicted: Vec<(u64, u64)> = p
            .outcomes
            .iter()
            .filter(|o| o.error.is_none())
            .filter_map(|o| Some((o.predicted_tokens?, o.cached_tokens)))
            .collect();
        if predicted.is_empty() {
            continue;
        }
        let phantom = predicted.iter().filter(|(p, c)| c + 16 < *p).count();
        let unseen = predicted.iter().filter(|(p, c)| *c > p + 16).count();
        println!(
            "  {}: the engines reused what it found cached in {:.0} % of answers; less (a phantom) in {:.0} %, more in {:.0} %",
            system.name,
            100.0 * (predicted.len() - phantom - unseen) as f64 / predicted.len() as f64,
            100.0 * phantom as f64 / predicted.len() as f64,
            100.0 * unseen as f64 / predicted.len() as f64,
        );
    }
    let find = |name: &str| systems.iter().position(|s| s.name == name);
    let peers: Vec<usize> = ["smg", "vllm-router"]
        .iter()
        .filter_map(|n| find(n))
        .collect();
    let (Some(kvhint), false) = (find("kvhint"), peers.is_empty()) else {
        return;
    };
    let best_p90 = peers
        .iter()
        .map(|&i| rows[i].p90)
        .fold(f64::INFINITY, f64::min);
    let best_cached = peers.iter().map(|&i| rows[i].cached).fold(0.0, f64::max);
    let k = &rows[kvhint];
    let mut verdict = format!(
        "{} {load}: TTFT p90 {:.2}× the best peer's (target ≤ 0.8: {}); cached {:.1} % against {:.1} % (target ≥: {})",
        kind.name(),
        k.p90 / best_p90,
        bench::verdict(quick, k.p90 <= 0.8 * best_p90),
        k.cached * 100.0,
        best_cached * 100.0,
        bench::verdict(quick, k.cached >= best_cached),
    );
    if kind == Kind::Unique {
        let straight = find("straight").map_or(f64::INFINITY, |i| rows[i].p90);
        verdict.push_str(&format!(
            "; spread {:.0}/{:.0} (target within 55/45: {}); p90 against round robin's {:.2}× (target ≤ 1: {})",
            k.spread * 100.0,
            (1.0 - k.spread) * 100.0,
            bench::verdict(quick, k.spread <= 0.55),
            k.p90 / straight,
            bench::verdict(quick, k.p90 <= straight),
        ));
    }
    verdicts.push(verdict);
}
