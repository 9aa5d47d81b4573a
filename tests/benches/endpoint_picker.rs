//! Envoy with kvhint as its endpoint picker against Envoy's own round-robin, to
//! the same two llama.cpp workers (llama.cpp's server through PyPI `xllamacpp`,
//! the tiny Qwen3-vocabulary model), and straight to the workers (the client
//! alternating between them), in one run, round by round with the systems'
//! order rotating so a slow stretch of the machine hits each alike.
//!
//! Two workloads at concurrency 1: a short completion (a new first line each
//! time, 1 token out: the routing's share of the time is what shows) and a short
//! streaming chat (8 tokens out). Per system: p50 and p99 latency, and the
//! latency *added* over straight (the system's quantile minus straight's); and
//! what kvhint adds over Envoy's round-robin (Envoy + kvhint minus Envoy alone):
//! the ext_proc round trips, the body streamed through kvhint and back,
//! tokenizing and booking.
//!
//! `cargo bench -p kvhint-e2e --bench endpoint_picker` measures (release kvhint);
//! `cargo test -p kvhint-e2e --bench endpoint_picker` (quick mode) runs each case
//! a couple of times on a debug build, to keep it working.

use kvhint_e2e::bench::{self, quantile};
use kvhint_e2e::envoy::{Envoy, Routing};
use kvhint_e2e::http::{agent, timed_post};
use kvhint_e2e::llamacpp::{qwen3_tokenizer_dir, worker_yaml, LlamaWorker, MODEL_NAME};
use kvhint_e2e::{private_dir, Server};
use serde_json::{json, Value};
use std::process::Command;

fn completion(n: u64) -> Value {
    json!({"model": MODEL_NAME,
           "prompt": format!("Request {n}. The quick brown fox jumps over the lazy dog."),
           "max_tokens": 1, "temperature": 0})
}

fn chat(n: u64) -> Value {
    json!({"model": MODEL_NAME, "stream": true, "max_tokens": 8, "temperature": 0,
           "messages": [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": format!("Question {n}: name three colours.")}]})
}

/// A workload: its name, its path, and the body of its `n`th request.
type Workload = (&'static str, &'static str, fn(u64) -> Value);

struct System {
    name: &'static str,
    urls: Vec<String>,
}

fn main() {
    let quick = !bench::is_bench();
    let (rounds, per_round): (usize, usize) = if quick { (1, 2) } else { (10, 40) };
    let workers = [LlamaWorker::start(), LlamaWorker::start()];
    let urls: Vec<String> = workers.iter().map(LlamaWorker::url).collect();

    let dir = private_dir();
    let config = dir.path().join("kvhint.yaml");
    let mut yaml = format!(
        "router:\n  block_size: 16\nworker_selection:\n  aggregated: dynamo-default-cost-fn\n\
         models:\n  {MODEL_NAME}:\n    tokenizer: {}\n\
         endpoint_picker:\n  listen: 127.0.0.1:0\nworkers:\n",
        qwen3_tokenizer_dir().display()
    );
    for (id, worker) in (1..).zip(&workers) {
        yaml.push_str(&worker_yaml(id, worker));
    }
    std::fs::write(&config, yaml).unwrap();
    let kvhint = Server::start_command(
        Command::new(bench::artifacts().join("kvhint")),
        &config,
        &[],
        dir.path(),
    );
    let picker = kvhint.picker_address();
    let with_kvhint = Envoy::start(&Routing::Picker {
        picker,
        subset: None,
    });
    let round_robin = Envoy::start(&Routing::RoundRobin {
        workers: workers
            .iter()
            .map(|w| format!("127.0.0.1:{}", w.port))
            .collect(),
    });
    let systems = [
        System {
            name: "straight",
            urls: urls.clone(),
        },
        System {
            name: "envoy round-robin",
            urls: vec![round_robin.url()],
        },
        System {
            name: "envoy + kvhint",
            urls: vec![with_kvhint.url()],
        },
    ];
    let workloads: [Workload; 2] = [
        (
            "short completion, 1 token out",
            "/v1/completions",
            completion,
        ),
        (
            "short streaming chat, 8 tokens out",
            "/v1/chat/completions",
            chat,
        ),
    ];
    println!(
        "endpoint-picker bench ({}): {rounds} rounds × {per_round} requests per system and workload, concurrency 1",
        if quick {
            "quick mode, debug build: not measurements"
        } else {
            "release"
        }
    );
    let agent = agent();
    let mut n = 0u64;
    for (name, path, body) in workloads {
        // Warm every path (connections, Envoy's clusters, the tokenizer).
        for system in &systems {
            for url in &system.urls {
                n += 1;
                timed_post(&agent, &format!("{url}{path}"), &body(n).to_string());
            }
        }
        let mut samples: Vec<Vec<f64>> = vec![Vec::new(); systems.len()];
        for round in 0..rounds {
            for k in 0..systems.len() {
                let s = (round + k) % systems.len();
                let system = &systems[s];
                for i in 0..per_round {
                    n += 1;
                    let url = &system.urls[i % system.urls.len()];
                    let latency =
                        timed_post(&agent, &format!("{url}{path}"), &body(n).to_string()).0;
                    samples[s].push(latency);
                }
            }
        }
        let figures: Vec<(f64, f64)> = samples
            .iter_mut()
            .map(|s| (quantile(s, 0.5) * 1e3, quantile(s, 0.99) * 1e3))
            .collect();
        println!("\n{name} ({} requests per system):", samples[0].len());
        println!(
            "  {:<20} {:>9} {:>9} {:>16} {:>16}",
            "system", "p50 ms", "p99 ms", "added p50 ms", "added p99 ms"
        );
        for (system, (p50, p99)) in systems.iter().zip(&figures) {
            println!(
                "  {:<20} {:>9.2} {:>9.2} {:>16.2} {:>16.2}",
                system.name,
                p50,
                p99,
                p50 - figures[0].0,
                p99 - figures[0].1
            );
        }
        let (rr, epp) = (figures[1], figures[2]);
        println!(
            "  kvhint over Envoy's round-robin: p50 +{:.2} ms ({:.2}x), p99 +{:.2} ms ({:.2}x)",
            epp.0 - rr.0,
            epp.0 / rr.0,
            epp.1 - rr.1,
            epp.1 / rr.1
        );
    }
    // Every booking the picker made was released at its response's end.
    let status: Value = kvhint.status();
    assert_eq!(status["open_bookings"], 0, "{status}");
}
