//! Routing quality at fleet scale: 16 and 64 simulated engines (`kvhint-sim`,
//! `tests/sim/main.rs`: vLLM-like schedulers with bounded LRU block caches,
//! prefill time per uncached token, decode time per batch, KV events through
//! vLLM 0.23.0's own publisher over ZMQ), which two CPU cores could not run as
//! real engines.
//!
//! Systems, interleaved (their order rotates from block to block), each on a
//! fresh fleet (empty caches), every fleet publishing its KV events whether the
//! system subscribes or not (the publishers are Python processes, whose CPU
//! would otherwise burden only the event-fed systems on a small machine):
//! - `straight`: the client sends round robin over the workers;
//! - `smg`: `smg` 1.13 with `--policy cache_aware` at its launcher's defaults;
//! - `kvhint-approx`: kvhint's documented config with `kv_events: approximate`
//!   (it reads each engine's capacity from `vllm:cache_config_info`);
//! - `kvhint-events`: the same, subscribed to every engine's KV events;
//! - `kvhint-published` (not run by default): `kvhint-events` with
//!   `gateway.credit_in_flight: false`, the index holding only what the engines
//!   published, to measure what crediting in-flight prompts buys;
//! - `kvhint-anticipating` (not run by default): `kvhint-events` with
//!   `gateway.anticipate_evictions: true` (off by default), reading each
//!   engine's capacity, to measure what anticipating evictions buys.
//!
//! Workloads (`FLEET_WORKLOAD`, `mix` by default), as streaming chats of
//! `OUTPUT_TOKENS` (12) output tokens each, whatever the workload says:
//! - `mix`: the quality bench's mix (shared system prompts, multi-turn chats,
//!   unique prompts), scaled with the fleet (as many groups and chats as
//!   workers), on an open-loop Poisson schedule at a load where a fleet
//!   computing every prompt in full would be `FLEET_LOAD` (70 %) busy;
//! - `mooncake`: a window of Mooncake's conversation trace (FAST '25, vendored
//!   in `tests/fixtures/mooncake/`, read by `kvhint_e2e::mooncake`): 12,031
//!   requests over 59 minutes, each prompt named by one hash id per 512-token
//!   block, prefix-chained, so a shared leading run of ids is a shared prefix
//!   (block 0 opens nearly every prompt; later turns of a conversation repeat its
//!   earlier blocks). Each block becomes `FLEET_TRACE_BLOCK_WORDS` (32) words
//!   drawn from its id (~35 tokens: prompts shrunk ~15-fold, a mean one ~770
//!   words, the longest ~7,900), the last block in proportion to its tokens; a
//!   prompt is one user message. The window is `FLEET_TRACE_REQUESTS` requests
//!   (20 per worker: 320 at 16 workers, 1,280 at 64, so a block lasts ~33 s at
//!   either size) from line `FLEET_TRACE_START` (0). Its arrivals keep the
//!   trace's order, gaps and bursts, with its time stretched by one factor so
//!   that the fleet computing every prompt in full would be `FLEET_LOAD` busy
//!   over the window (up to the arrival of the request after it). The trace's
//!   reuse comes back over minutes of trace time, so a longer window holds more
//!   of it (at most ~10 % of the prompt tokens are reusable in 320 requests,
//!   ~23 % in 1,280, 37 % in the whole trace): the table says how much.
//!
//! Each engine holds `FLEET_CAPACITY_BLOCKS` (128) blocks of 16 tokens: two
//! prompts, so a router that spreads a prefix over the fleet computes it again
//! and again.
//!
//! `cargo bench -p kvhint-e2e --bench fleet` measures, each workload on fleets
//! of its own; `cargo test -p kvhint-e2e --bench fleet` (CI's quick mode) runs 4
//! engines once per system, sending a small mix and then 32 requests of the
//! trace on the same fleet (`FLEET_WORKLOAD` `mix,mooncake` there).
//! Environment: `FLEET_WORKERS` (`16,64`), `FLEET_SYSTEMS`
//! (`straight,smg,kvhint-approx,kvhint-events`), `FLEET_WORKLOAD` (`mix`,
//! `mooncake` or both, comma-separated), `FLEET_REPS` (1), `FLEET_SEED`,
//! `FLEET_LOAD` (0.7), `FLEET_CAPACITY_BLOCKS`, `FLEET_PREFILL_US` (per uncached
//! token, 1000), `FLEET_TRACE_REQUESTS`, `FLEET_TRACE_START`,
//! `FLEET_TRACE_BLOCK_WORDS` (the bench configures kvhint for 65,536 prompt tokens: ~200
//! words a block at most), `FLEET_OUT` (a file to append every request's
//! outcome to, as JSON lines).

use kvhint_e2e::bench::{self, quantile};
use kvhint_e2e::http::get;
use kvhint_e2e::llamacpp::{qwen3_tokenizer_dir, MODEL_NAME};
use kvhint_e2e::mooncake;
use kvhint_e2e::peers::Peer;
use kvhint_e2e::sim::{SimFleet, SimWorker};
use kvhint_e2e::workloads::{self, workload, Front, Item, Kind, Outcome, Sizes, OUTPUT_TOKENS};
use kvhint_e2e::{private_dir, Server};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;

/// The simulated engines' costs, in µs.
const STEP_US: f64 = 2_000.0;
const DECODE_US_PER_SEQ: f64 = 200.0;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum System {
    Straight,
    Smg,
    KvhintApprox,
    KvhintEvents,
    KvhintPublished,
    KvhintAnticipating,
}

impl System {
    fn parse(name: &str) -> System {
        match name {
            "straight" => System::Straight,
            "smg" => System::Smg,
            "kvhint-approx" => System::KvhintApprox,
            "kvhint-events" => System::KvhintEvents,
            "kvhint-published" => System::KvhintPublished,
            "kvhint-anticipating" => System::KvhintAnticipating,
            other => {
                panic!("unknown system {other:?}: straight, smg, kvhint-approx, kvhint-events, kvhint-published or kvhint-anticipating")
            }
        }
    }

    fn name(self) -> &'static str {
        match self {
            System::Straight => "straight",
            System::Smg => "smg",
            System::KvhintApprox => "kvhint-approx",
            System::KvhintEvents => "kvhint-events",
            System::KvhintPublished => "kvhint-published",
            System::KvhintAnticipating => "kvhint-anticipating",
        }
    }

    fn events(self) -> bool {
        matches!(
            self,
            System::KvhintEvents | System::KvhintPublished | System::KvhintAnticipating
        )
    }

    /// Whether its bookings anticipate evictions (`gateway.anticipate_evictions`).
    fn anticipates(self) -> bool {
        self == System::KvhintAnticipating
    }
}

/// kvhint's documented config for a vLLM fleet (no `worker_selection`: the
/// default), approximate or fed by each engine's events (and then crediting
/// in-flight prompts, or not; anticipating evictions, or not).
fn kvhint_config(
    workers: &[SimWorker],
    events: bool,
    credit_in_flight: bool,
    anticipate_evictions: bool,
) -> String {
    let mut yaml = format!(
        "router:\n  block_size: 16\n  max_prompt_tokens: 65536\n\
         models:\n  {MODEL_NAME}:\n    tokenizer: {}\n\
         gateway:\n  credit_in_flight: {credit_in_flight}\n  \
         anticipate_evictions: {anticipate_evictions}\nworkers:\n",
        qwen3_tokenizer_dir().display()
    );
    for (i, w) in workers.iter().enumerate() {
        let source = match (&w.events, &w.replay, events) {
            (Some(e), Some(r), true) => format!("{{endpoint: \"{e}\", replay_endpoint: \"{r}\"}}"),
            (_, _, true) => panic!("kvhint-events needs the fleet's event endpoints"),
            _ => "approximate".to_string(),
        };
        yaml.push_str(&format!(
            "  - worker_id: {}\n    http_endpoint: {}\n    engine: vllm\n    models: [{MODEL_NAME}]\n    kv_events: {source}\n",
            i + 1,
            w.url
        ));
    }
    yaml
}

struct Setup {
    workers: usize,
    capacity_blocks: usize,
    prefill_us: f64,
}

fn fleet(setup: &Setup) -> SimFleet {
    let mut args = SimFleet::args(setup.workers, setup.capacity_blocks);
    args.extend([
        "--prefill-us-per-token".into(),
        setup.prefill_us.to_string(),
        "--step-us".into(),
        STEP_US.to_string(),
        "--decode-us-per-seq".into(),
        DECODE_US_PER_SEQ.to_string(),
    ]);
    args.extend([
        "--events".into(),
        "--wheel".into(),
        kvhint_e2e::provision::vllm_wheel().display().to_string(),
        "--python".into(),
        kvhint_e2e::provision::python().display().to_string(),
    ]);
    SimFleet::start(Path::new(env!("CARGO_BIN_EXE_kvhint-sim")), &args)
}

/// Prompt tokens each engine was asked for (`vllm:prefix_cache_queries`).
fn queried(url: &str) -> f64 {
    let (_, text) = get(&kvhint_e2e::http::agent(), &format!("{url}/metrics"));
    text.lines()
        .filter(|l| l.starts_with("vllm:prefix_cache_queries_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// One workload a block sends: its requests and when.
struct Phase<'a> {
    items: &'a [Item],
    times: Vec<f64>,
}

/// One block: a fresh fleet behind `system`, sent each phase in turn (the next
/// once the last answer of the one before came). Per phase: its outcomes and
/// the prompt tokens each engine was asked for.
fn run_block(
    system: System,
    setup: &Setup,
    phases: &[Phase],
    dir: &Path,
) -> Vec<(Vec<Outcome>, Vec<f64>)> {
    let sims = fleet(setup);
    let urls = sims.urls();
    let front = match system {
        System::Straight => Front::Straight(urls.clone()),
        System::Smg => Front::Peer(Peer::smg(&urls)),
        System::KvhintApprox
        | System::KvhintEvents
        | System::KvhintPublished
        | System::KvhintAnticipating => {
            let config = dir.join(format!("{}.yaml", system.name()));
            let yaml = kvhint_config(
                &sims.workers,
                system.events(),
                system != System::KvhintPublished,
                system.anticipates(),
            );
            std::fs::write(&config, yaml)
                .unwrap_or_else(|e| panic!("cannot write {}: {e}", config.display()));
            Front::Kvhint(Server::start_command(
                Command::new(bench::artifacts().join("kvhint")),
                &config,
                &["--max-body-bytes", "8388608"],
                dir,
            ))
        }
    };
    if let Front::Kvhint(server) = &front {
        // Every engine's capacity read (an approximate worker's cap; the
        // capacity an event-fed one's bookings anticipate evictions with).
        server.wait_for("every worker ready", |s| {
            let status = s.status();
            status["workers"].as_array().is_some_and(|ws| {
                ws.len() == urls.len()
                    && ws.iter().all(|w| {
                        if w["kv_events"] == "approximate" {
                            w["approximate_capacity_blocks"] == setup.capacity_blocks
                        } else {
                            !system.anticipates()
                                || w["kv_capacity_blocks"] == setup.capacity_blocks
                        }
                    })
            })
        });
    }
    let front = Arc::new(front);
    let url_of: Arc<dyn Fn(usize) -> String + Send + Sync> = {
        let front = Arc::clone(&front);
        Arc::new(move |n: usize| front.url(n))
    };
    let mut before = vec![0.0; urls.len()];
    let results = phases
        .iter()
        .map(|phase| {
            let outcomes = workloads::run_at(phase.items, &phase.times, Arc::clone(&url_of));
            let now: Vec<f64> = urls.iter().map(|u| queried(u)).collect();
            let spread = now.iter().zip(&before).map(|(a, b)| a - b).collect();
            before = now;
            (outcomes, spread)
        })
        .collect();
    drop(front);
    results
}

/// Appends each request's outcome to `path`, one JSON line each.
fn write_outcomes(
    path: &str,
    workload: &str,
    workers: usize,
    rep: usize,
    system: System,
    outcomes: &[Outcome],
) {
    use std::io::Write;
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .unwrap_or_else(|e| panic!("FLEET_OUT {path}: {e}"));
    for o in outcomes {
        let line = serde_json::json!({"workload": workload, "workers": workers, "rep": rep,
            "system": system.name(),
            "key": o.key, "sent": o.sent, "ended": o.ended, "ttft": o.ttft, "e2e": o.e2e,
            "prompt_tokens": o.prompt_tokens, "cached_tokens": o.cached_tokens,
            "predicted_tokens": o.predicted_tokens, "error": o.error});
        let _ = writeln!(file, "{line}");
    }
}

/// A workload the bench can run.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Workload {
    Mix,
    Mooncake,
}

impl Workload {
    fn parse(name: &str) -> Workload {
        match name {
            "mix" => Workload::Mix,
            "mooncake" => Workload::Mooncake,
            other => panic!("unknown workload {other:?}: mix or mooncake"),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Workload::Mix => "mix",
            Workload::Mooncake => "mooncake",
        }
    }
}

/// A workload made for one fleet size: its requests, their schedule, and what
/// its table's title says of it.
struct Plan {
    workload: Workload,
    items: Vec<Item>,
    /// The mix's Poisson schedule (drawn anew each repetition) or the trace's
    /// stretched times.
    schedule: Schedule,
    rate: f64,
    title: String,
}

enum Schedule {
    Poisson { rate: f64, seed: u64 },
    At(Vec<f64>),
}

impl Plan {
    fn times(&self, rep: usize) -> Vec<f64> {
        match &self.schedule {
            Schedule::Poisson { rate, seed } => {
                workloads::poisson(self.items.len(), *rate, seed ^ ((rep as u64) << 32))
            }
            Schedule::At(times) => times.clone(),
        }
    }
}

/// The quality bench's mix, scaled with the fleet.
fn mix_plan(
    quick: bool,
    n: usize,
    seed: u64,
    rho: f64,
    full_service: &dyn Fn(&Item) -> f64,
) -> Plan {
    let sizes = if quick {
        Sizes {
            groups: 2,
            per_group: 3,
            system_words: 200,
            question_words: 20,
            chats: 2,
            turns: 3,
            chat_system_words: 150,
            turn_words: 20,
            unique: 4,
            unique_words: 200,
        }
    } else {
        // The mix takes half the groups, a third of the chats and of the
        // unique prompts: n groups of 6, ~2n/3 chats of 4 turns, 2n unique.
        Sizes {
            groups: 2 * n,
            per_group: 8,
            system_words: 800,
            question_words: 60,
            chats: 2 * n,
            turns: 6,
            chat_system_words: 600,
            turn_words: 60,
            unique: 6 * n,
            unique_words: 800,
        }
    };
    let items = workload(Kind::Mix, &sizes, seed);
    let full = items.iter().map(full_service).sum::<f64>() / items.len() as f64;
    let rate = rho * n as f64 / full;
    Plan {
        workload: Workload::Mix,
        title: format!("mix, {} requests", items.len()),
        items,
        schedule: Schedule::Poisson { rate, seed },
        rate,
    }
}

/// `FLEET_TRACE_REQUESTS` requests of the Mooncake trace from line
/// `FLEET_TRACE_START`, its time stretched to the load `rho`.
fn mooncake_plan(
    quick: bool,
    n: usize,
    trace: &[mooncake::Request],
    rho: f64,
    full_service: &dyn Fn(&Item) -> f64,
) -> Plan {
    let start: usize = bench::env_number("FLEET_TRACE_START", 0);
    let count: usize = bench::env_number("FLEET_TRACE_REQUESTS", if quick { 32 } else { 20 * n });
    let words_per_block: usize =
        bench::env_number("FLEET_TRACE_BLOCK_WORDS", mooncake::BLOCK_WORDS);
    let window = mooncake::window(trace, start, count, words_per_block);
    // The trace's time stretched (or shrunk) so that the fleet computing every
    // prompt in full would be `rho` busy over the window.
    let work: f64 = window.items.iter().map(full_service).sum();
    let scale = work / (rho * n as f64 * window.duration);
    let items = window.items.len();
    Plan {
        workload: Workload::Mooncake,
        title: format!(
            "mooncake trace lines {start}..{}, {words_per_block} words a 512-token block, its time x{scale:.3}",
            start + items
        ),
        rate: items as f64 / (window.duration * scale),
        schedule: Schedule::At(window.times(scale)),
        items: window.items,
    }
}

fn main() {
    let quick = !bench::is_bench();
    let seed: u64 = bench::env_number("FLEET_SEED", 11);
    let reps: usize = if quick {
        1
    } else {
        bench::env_number("FLEET_REPS", 1)
    };
    let rho: f64 = bench::env_number("FLEET_LOAD", 0.7);
    let sizes_of: Vec<usize> = if quick {
        vec![4]
    } else {
        bench::env_list("FLEET_WORKERS", "16,64")
            .iter()
            .map(|n| n.parse().unwrap_or_else(|_| panic!("FLEET_WORKERS: {n:?}")))
            .collect()
    };
    let systems: Vec<System> =
        bench::env_list("FLEET_SYSTEMS", "straight,smg,kvhint-approx,kvhint-events")
            .iter()
            .map(|s| System::parse(s))
            .collect();
    let workloads: Vec<Workload> =
        bench::env_list("FLEET_WORKLOAD", if quick { "mix,mooncake" } else { "mix" })
            .iter()
            .map(|w| Workload::parse(w))
            .collect();
    let trace = workloads
        .contains(&Workload::Mooncake)
        .then(mooncake::load)
        .unwrap_or_default();
    let prefill_us: f64 = bench::env_number("FLEET_PREFILL_US", if quick { 100.0 } else { 1000.0 });
    let capacity_blocks: usize = bench::env_number("FLEET_CAPACITY_BLOCKS", 128);
    let dir = private_dir();
    let out = std::env::var("FLEET_OUT").ok();
    println!(
        "fleet bench ({}): {} workload; simulated vLLM engines, 16-token blocks, {} µs a step + {} µs per prefilled token + {} µs per running request; {rho:.2} load; {} output tokens a request; {reps} repetition(s)",
        if quick { "quick mode, debug build: not measurements" } else { "release" },
        workloads.iter().map(|w| w.name()).collect::<Vec<_>>().join(" + "),
        STEP_US,
        prefill_us,
        DECODE_US_PER_SEQ,
        OUTPUT_TOKENS,
    );
    for &n in &sizes_of {
        let setup = Setup {
            workers: n,
            capacity_blocks,
            prefill_us,
        };
        // A fleet that computes every prompt in full: ~1.3 tokens a word.
        let full_service = |item: &Item| {
            (item.words as f64 * 1.3 * setup.prefill_us
                + OUTPUT_TOKENS as f64 * (STEP_US + DECODE_US_PER_SEQ))
                / 1e6
        };
        let plans: Vec<Plan> = workloads
            .iter()
            .map(|w| match w {
                Workload::Mix => mix_plan(quick, n, seed, rho, &full_service),
                Workload::Mooncake => mooncake_plan(quick, n, &trace, rho, &full_service),
            })
            .collect();
        // Each workload on fleets of its own; in quick mode one after the other
        // on the same fleet (starting fleets is most of a quick run's time).
        let groups: Vec<Vec<Plan>> = if quick {
            vec![plans]
        } else {
            plans.into_iter().map(|p| vec![p]).collect()
        };
        for group in &groups {
            run_plans(n, &setup, group, &systems, reps, dir.path(), out.as_deref());
        }
    }
}

/// A system's results over the repetitions: outcomes, prompt tokens each engine
/// was asked for, seconds.
type Pooled = (Vec<Outcome>, Vec<f64>, f64);

/// Runs `plans` (one after the other in each block) `reps` times on every
/// system, interleaved, and prints a table per plan.
fn run_plans(
    n: usize,
    setup: &Setup,
    plans: &[Plan],
    systems: &[System],
    reps: usize,
    dir: &Path,
    out: Option<&str>,
) {
    let mut pooled: Vec<Vec<Pooled>> =
        vec![vec![(Vec::new(), vec![0.0; n], 0.0); systems.len()]; plans.len()];
    for rep in 0..reps {
        for k in 0..systems.len() {
            let at = (k + rep) % systems.len();
            let what: Vec<String> = plans
                .iter()
                .map(|p| {
                    format!(
                        "{} {} requests at {:.1}/s",
                        p.workload.name(),
                        p.items.len(),
                        p.rate
                    )
                })
                .collect();
            eprintln!(
                "[fleet] {n} workers rep {}: {} ({})",
                rep + 1,
                systems[at].name(),
                what.join(", then ")
            );
            let phases: Vec<Phase> = plans
                .iter()
                .map(|p| Phase {
                    items: &p.items,
                    times: p.times(rep),
                })
                .collect();
            let results = run_block(systems[at], setup, &phases, dir);
            for ((plan, pooled), (outcomes, spread)) in plans.iter().zip(&mut pooled).zip(results) {
                if let Some(path) = out {
                    write_outcomes(path, plan.workload.name(), n, rep, systems[at], &outcomes);
                }
                let p = &mut pooled[at];
                p.2 += outcomes.iter().map(|o| o.ended).fold(0.0, f64::max);
                for (a, b) in p.1.iter_mut().zip(spread) {
                    *a += b;
                }
                p.0.extend(outcomes);
            }
        }
    }
    for (plan, pooled) in plans.iter().zip(&pooled) {
        let reusable = plan.items.iter().map(|i| i.reusable_words).sum::<usize>() as f64
            / plan.items.iter().map(|i| i.words).sum::<usize>().max(1) as f64;
        println!(
            "\n{n} workers, {} at {:.1}/s (at most {:.0} % of prompt tokens reusable), {} blocks per engine:",
            plan.title,
            plan.rate,
            reusable * 100.0,
            setup.capacity_blocks
        );
        print_table(n, systems, pooled);
    }
}

fn print_table(n: usize, systems: &[System], pooled: &[Pooled]) {
    println!(
        "  {:<14} {:>8} {:>8} {:>8} {:>8} {:>7} {:>8} {:>12} {:>6}",
        "system",
        "ttft p50",
        "ttft p90",
        "ttft p99",
        "e2e p90",
        "req/s",
        "cached",
        "busiest",
        "errors"
    );
    for (system, (outcomes, spread, seconds)) in systems.iter().zip(pooled) {
        let ok: Vec<&Outcome> = outcomes.iter().filter(|o| o.error.is_none()).collect();
        let errors = outcomes.len() - ok.len();
        if ok.is_empty() {
            println!("  {:<14} every request failed", system.name());
            continue;
        }
        let mut ttft: Vec<f64> = ok.iter().map(|o| o.ttft * 1e3).collect();
        let mut e2e: Vec<f64> = ok.iter().map(|o| o.e2e * 1e3).collect();
        let prompt: u64 = ok.iter().map(|o| o.prompt_tokens).sum();
        let cached: u64 = ok.iter().map(|o| o.cached_tokens).sum();
        let total: f64 = spread.iter().sum::<f64>().max(1.0);
        let busiest = spread.iter().cloned().fold(0.0, f64::max) / total;
        println!(
            "  {:<14} {:>8.0} {:>8.0} {:>8.0} {:>8.0} {:>7.2} {:>7.1}% {:>7.1}%/{:<3.1} {:>6}",
            system.name(),
            quantile(&mut ttft, 0.5),
            quantile(&mut ttft, 0.9),
            quantile(&mut ttft, 0.99),
            quantile(&mut e2e, 0.9),
            outcomes.len() as f64 / seconds.max(1e-9),
            cached as f64 / prompt.max(1) as f64 * 100.0,
            busiest * 100.0,
            100.0 / n as f64,
            errors,
        );
        if let Some(error) = outcomes.iter().find_map(|o| o.error.as_ref()) {
            println!("    first error: {error}");
        }
    }
}
