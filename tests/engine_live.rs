//! SGLang 0.5.23's own KV-event publisher (`tests/engines/sglang_publisher.py`, which
//! runs the wheel's `ZmqEventPublisher`) publishing to a running `kvhint serve` on
//! 127.0.0.1: with the engine binding and kvhint connecting, and the other way round;
//! a gap recovered through the engine's real replay socket (SGLang's, whose replies
//! carry the topic frame, and vLLM 0.23.0's, whose do not); the resync without one;
//! and a publisher restart. The harness provides the engines' code
//! (`kvhint_e2e::provision`): a Python environment under `target/e2e/venv` with
//! `sglang==0.5.23` (`--no-deps`) and `tests/engines/requirements.txt`, and the vLLM
//! 0.23.0 wheel in `target/e2e/engine-wheels`, fetched from PyPI on first use; without
//! PyPI those tests fail saying what to install. Set `KVHINT_PYTHON` to run the
//! publishers with an interpreter of your own (it must have those packages), and
//! `KVHINT_VLLM_WHEEL` to use a wheel you have. Every read from a publisher has a
//! deadline: a hung publisher fails its test.

use kvhint_e2e::engines::{batch, source_status, until_joined, Publisher};
use kvhint_e2e::http::{book_and_release, decode_worker_body, register_worker};
use kvhint_e2e::process::free_port;
use kvhint_e2e::wait::{self, Waiting};
use kvhint_e2e::{private_dir, Server};
use serde_json::{json, Value};
use std::net::TcpListener;
use std::time::Duration;

const BLOCK: u32 = 16;

fn tokens(start: u32, blocks: u32) -> Vec<u32> {
    (start..start + blocks * BLOCK).collect()
}

/// SGLang's BlockStored: hashes are its signed 64-bit values.
fn stored(hashes: &[i64], parent: Option<i64>, tokens: &[u32]) -> Value {
    json!({"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
           "token_ids": tokens, "block_size": BLOCK, "medium": "GPU"})
}

struct Fleet {
    server: Server,
    _dir: kvhint_e2e::TempDir,
}

/// `kvhint serve` with a kvcr decode role; workers 1 and 2 have no engine, worker 3's
/// engine publishes to `source`.
fn fleet(source: Value) -> Fleet {
    let dir = private_dir();
    let config = dir.path().join("kvhint.yaml");
    std::fs::write(
        &config,
        format!(
            "router:\n  mode: kv\n  block_size: {BLOCK}\nworker_selection:\n  decode:\n    type: kvcr\n"
        ),
    )
    .unwrap();
    let server = Server::start(&config, &[], dir.path());
    for id in [1u64, 2, 3] {
        let mut body = decode_worker_body(id);
        if id == 3 {
            body["kv_events"] = source.clone();
        }
        register_worker(&server, &body);
    }
    Fleet { server, _dir: dir }
}

/// Worker 3's cached blocks for `tokens`, as the index sees them (the most any worker
/// holds, read off a booking's committed copy or its own cached prefix).
fn held_by_3(server: &Server, id: &str, tokens: &[u32]) -> usize {
    let booking = book_and_release(server, id, tokens);
    if booking["worker_id"] == 3 {
        return booking["cached_blocks"].as_u64().unwrap() as usize;
    }
    match booking["committed_copy"].as_object() {
        Some(copy) if copy["source_worker_id"] == 3 => {
            copy["last_block"].as_u64().unwrap() as usize
        }
        _ => 0,
    }
}

fn wait_held(server: &Server, tokens: &[u32], want: usize, what: &str) {
    let mut n = 0;
    Waiting::new(
        &format!("{what}: worker 3 to hold {want} blocks"),
        Duration::from_secs(20),
    )
    .report(|| format!("{}\n{}", source_status(server), server.log()))
    .until(|| {
        n += 1;
        (held_by_3(server, &format!("probe-{what}-{n}"), tokens) == want).then_some(())
    });
}

/// The first booking after a publish sees its blocks, and the `kv.fetch` names the
/// engine's own hashes.
fn blocks_reach_the_next_booking(server: &Server, publisher: &mut Publisher) {
    until_joined(server, publisher);
    let prompt = tokens(0, 3);
    let hashes = [-5_i64, -9_223_372_036_854_775_807, 77];
    publisher.publish(
        json!([
            stored(&hashes[..2], None, &prompt[..32]),
            stored(&hashes[2..], Some(hashes[1]), &prompt[32..])
        ]),
        false,
    );
    wait_held(server, &prompt, 3, "published blocks");
    // kvcr commits a copy from worker 3 to the less-loaded worker while worker 3 is busy.
    let mut fetch = None;
    for i in 0..6 {
        let (status, booking) = server.post(
            "/book",
            &json!({"request_id": format!("load-{i}"), "role": "decode", "token_ids": prompt}),
        );
        assert_eq!(status, 200, "{booking}");
        if let Some(actions) = booking["hint"]["actions"].as_array() {
            if let Some(action) = actions.iter().find(|a| a["action_type"] == "kv.fetch") {
                fetch = Some(action["payload"].clone());
            }
        }
    }
    let fetch = fetch.unwrap_or_else(|| panic!("no booking carried a kv.fetch\n{}", server.log()));
    assert_eq!(fetch["source_control_endpoint"], "tcp://10.0.0.3:23280");
    let named: Vec<i64> = fetch["block_hashes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| {
            h.as_i64().unwrap_or_else(|| {
                h.as_u64()
                    .map(|u| u as i64)
                    .unwrap_or_else(|| panic!("{h}"))
            })
        })
        .collect();
    assert_eq!(
        named, hashes,
        "the kv.fetch names the engine's hashes bit for bit"
    );
    let status = source_status(server);
    assert_eq!(status["state"], "live", "{status}");
    assert_eq!(status["hashes"], "signed", "{status}");
}

/// SGLang's publisher binding 127.0.0.1 without a replay socket, and a fleet
/// whose worker 3 subscribes to it.
fn bound() -> (Publisher, Fleet) {
    let port = free_port();
    let publisher = Publisher::sglang(&[
        "--endpoint".into(),
        format!("tcp://127.0.0.1:{port}"),
        "--bind".into(),
    ]);
    let fleet = fleet(json!({"endpoint": format!("tcp://127.0.0.1:{port}")}));
    (publisher, fleet)
}

/// SGLang's publisher binding 127.0.0.1 with its replay socket, and a fleet whose
/// worker 3 subscribes to both.
fn bound_with_replay() -> (Publisher, Fleet) {
    let (port, replay) = (free_port(), free_port());
    let publisher = Publisher::sglang(&[
        "--endpoint".into(),
        format!("tcp://127.0.0.1:{port}"),
        "--replay-endpoint".into(),
        format!("tcp://127.0.0.1:{replay}"),
        "--bind".into(),
    ]);
    let fleet = fleet(json!({"endpoint": format!("tcp://127.0.0.1:{port}"),
                             "replay_endpoint": format!("tcp://127.0.0.1:{replay}")}));
    (publisher, fleet)
}

#[test]
fn sglang_binds_kvhint_connects_and_the_next_booking_sees_the_blocks() {
    let (mut publisher, fleet) = bound_with_replay();
    blocks_reach_the_next_booking(&fleet.server, &mut publisher);
    let (_, metrics) = fleet.server.get("/metrics");
    assert!(
        metrics.contains("kvhint_kv_source_batches_total{worker_id=\"3\",dp_rank=\"0\"}"),
        "{metrics}"
    );
    assert!(metrics.contains("kvhint_kv_source_up{worker_id=\"3\",dp_rank=\"0\"} 1"));
}

#[test]
fn kvhint_binds_sglang_connects_and_the_next_booking_sees_the_blocks() {
    let port = free_port();
    let fleet = fleet(json!({"endpoint": format!("tcp://127.0.0.1:{port}"), "bind": true}));
    let mut publisher = Publisher::sglang(&[
        "--endpoint".into(),
        format!("tcp://127.0.0.1:{port}"),
        "--connect".into(),
    ]);
    blocks_reach_the_next_booking(&fleet.server, &mut publisher);
    assert_eq!(source_status(&fleet.server)["mode"], "bind");
}

#[test]
fn a_dropped_batch_is_recovered_through_the_engines_replay_socket() {
    let (mut publisher, fleet) = bound_with_replay();
    let server = &fleet.server;
    until_joined(server, &mut publisher);
    let prompt = tokens(1_000, 2);
    // Block 0 is lost on the wire but buffered for replay; block 1 reveals the gap.
    publisher.publish(json!([stored(&[101], None, &prompt[..16])]), true);
    publisher.publish(json!([stored(&[102], Some(101), &prompt[16..])]), false);
    wait_held(server, &prompt, 2, "replayed blocks");
    let status = source_status(server);
    assert!(status["gaps"].as_u64().unwrap() >= 1, "{status}");
    assert!(
        status["replays"].as_u64().unwrap() >= 2,
        "history and the gap: {status}"
    );
}

#[test]
fn without_a_replay_socket_a_gap_resyncs_the_worker_from_new_events() {
    let (mut publisher, fleet) = bound();
    let server = &fleet.server;
    until_joined(server, &mut publisher);
    let old = tokens(2_000, 1);
    publisher.publish(json!([stored(&[201], None, &old)]), false);
    wait_held(server, &old, 1, "the first block");
    // A lost batch: the router can no longer know worker 3's cache, so it forgets it
    // (under-crediting, never over-crediting) and keeps what arrives after.
    publisher.publish(
        json!([{"type": "BlockRemoved", "block_hashes": [201]}]),
        true,
    );
    let new = tokens(3_000, 1);
    publisher.publish(json!([stored(&[301], None, &new)]), false);
    wait_held(server, &new, 1, "the block after the gap");
    assert_eq!(
        held_by_3(server, "old", &old),
        0,
        "the cleared entries are gone"
    );
    let status = source_status(server);
    assert!(status["gaps"].as_u64().unwrap() >= 1, "{status}");
    assert!(status["resyncs"].as_u64().unwrap() >= 1, "{status}");
}

#[test]
fn a_publisher_restart_clears_the_worker_and_follows_the_new_sequence() {
    let (mut publisher, fleet) = bound_with_replay();
    let server = &fleet.server;
    until_joined(server, &mut publisher);
    for _ in 0..3 {
        publisher.publish(
            json!([{"type": "BlockRemoved", "block_hashes": [1]}]),
            false,
        );
    }
    let before = tokens(4_000, 1);
    publisher.publish(json!([stored(&[401], None, &before)]), false);
    wait_held(server, &before, 1, "a block before the restart");
    publisher.command(json!({"op": "restart"}));
    until_joined_again(server, &mut publisher);
    let status = source_status(server);
    assert!(
        status["restarts"].as_u64().unwrap() + status["reconnects"].as_u64().unwrap() >= 1,
        "{status}"
    );
    assert_eq!(
        held_by_3(server, "after-restart", &before),
        0,
        "a restarted engine's cache is empty"
    );
}

fn until_joined_again(server: &Server, publisher: &mut Publisher) {
    let before = source_status(server)["batches"].as_u64().unwrap_or(0);
    Waiting::new(
        "the restarted publisher to be heard",
        Duration::from_secs(20),
    )
    .every(Duration::from_millis(50))
    .report(|| source_status(server).to_string())
    .until(|| {
        publisher.publish(
            json!([{"type": "BlockRemoved", "block_hashes": [2]}]),
            false,
        );
        (source_status(server)["batches"].as_u64().unwrap_or(0) > before).then_some(())
    });
}

#[test]
fn a_bad_source_refuses_the_registration_and_says_which_field() {
    let fleet = fleet(json!({"endpoint": "tcp://127.0.0.1:1"}));
    let (status, body) = fleet.server.post(
        "/workers",
        &json!({"worker_id": 9, "role": "decode", "kv_events": {"endpoint": "tcp://*:5557"}}),
    );
    assert_eq!(status, 400, "{body}");
    assert!(
        body["detail"]
            .as_str()
            .unwrap()
            .contains("kv_events.endpoint"),
        "{body}"
    );
    let workers = fleet.server.status()["workers"].as_array().unwrap().len();
    assert_eq!(workers, 3, "the refused worker was not registered");
}

/// A fleet without a registration step: the config lists the engine, kvhint registers
/// the worker and subscribes; a reload without it deregisters the worker and stops the
/// subscription, and a reload that lists it again brings both back, without a restart.
#[test]
fn config_sources_register_subscribe_and_follow_reloads() {
    let port = free_port();
    let mut publisher = Publisher::sglang(&[
        "--endpoint".into(),
        format!("tcp://127.0.0.1:{port}"),
        "--bind".into(),
    ]);
    let dir = private_dir();
    let config = dir.path().join("kvhint.yaml");
    let roles = "worker_selection:\n  decode: kvcr\n";
    let with_source = format!(
        "router:\n  block_size: {BLOCK}\nkv_events:\n  sources:\n    - worker_id: 3\n      role: decode\n      runtime_data: {{router_hint: true}}\n      endpoint: tcp://127.0.0.1:{port}\n{roles}"
    );
    let without = format!("router:\n  block_size: {BLOCK}\n{roles}");
    std::fs::write(&config, &with_source).unwrap();
    let server = Server::start(&config, &[], dir.path());
    assert_eq!(source_status(&server)["origin"], "config");
    until_joined(&server, &mut publisher);
    let prompt = tokens(5_000, 2);
    publisher.publish(json!([stored(&[501, 502], None, &prompt)]), false);
    wait_held(&server, &prompt, 2, "a configured source's blocks");

    std::fs::write(&config, &without).unwrap();
    let (status, body) = server.post("/admin/reload", &json!({}));
    assert_eq!(status, 200, "{body}");
    assert!(server.status()["kv_event_sources"]
        .as_array()
        .unwrap()
        .is_empty());
    assert!(server.status()["workers"].as_array().unwrap().is_empty());

    std::fs::write(&config, &with_source).unwrap();
    let (status, body) = server.post("/admin/reload", &json!({}));
    assert_eq!(status, 200, "{body}");
    assert_eq!(server.status()["workers"].as_array().unwrap().len(), 1);
    until_joined_again(&server, &mut publisher);
    publisher.publish(json!([stored(&[501, 502], None, &prompt)]), false);
    wait_held(&server, &prompt, 2, "blocks after the source came back");
}

/// Data-parallel ranks as SGLang runs them: rank 1's publisher sits at the base port
/// plus 1 and stamps rank 1 into its batches; the registration for rank 1 names the
/// engine's base endpoint, and its blocks land on worker 3 rank 1, not rank 0.
#[test]
fn a_dp_rank_subscribes_at_port_plus_rank_and_its_events_land_on_that_rank() {
    let base = free_port();
    // Keep base + 1 free for the rank-1 publisher.
    let _ = free_port();
    let mut publisher = Publisher::sglang(&[
        "--endpoint".into(),
        format!("tcp://127.0.0.1:{base}"),
        "--bind".into(),
        "--dp-rank".into(),
        "1".into(),
    ]);
    let dir = private_dir();
    let config = dir.path().join("kvhint.yaml");
    std::fs::write(
        &config,
        format!("router:\n  block_size: {BLOCK}\nworker_selection:\n  decode: kvcr\n"),
    )
    .unwrap();
    let server = Server::start(&config, &[], dir.path());
    for rank in [0, 1] {
        let (status, body) = server.post(
            "/workers",
            &json!({"worker_id": 3, "dp_rank": rank, "role": "decode",
                    "kv_events": {"endpoint": format!("tcp://127.0.0.1:{base}")}}),
        );
        assert_eq!(status, 201, "{body}");
    }
    let sources = server.status()["kv_event_sources"].clone();
    assert_eq!(
        sources[1]["endpoint"],
        format!("tcp://127.0.0.1:{}", base + 1),
        "{sources}"
    );
    let rank1 = |server: &Server| {
        server.status()["kv_event_sources"][1]["batches"]
            .as_u64()
            .unwrap_or(0)
    };
    Waiting::new("rank 1 to hear its publisher", Duration::from_secs(20))
        .every(Duration::from_millis(50))
        .until(|| {
            if rank1(&server) > 0 {
                return Some(());
            }
            publisher.publish(
                json!([{"type": "BlockRemoved", "block_hashes": [9]}]),
                false,
            );
            None
        });
    let prompt = tokens(6_000, 1);
    publisher.publish(json!([stored(&[601], None, &prompt)]), false);
    let booking = wait::until_ok("rank 1 to hold the block", Duration::from_secs(20), || {
        let booking = book_and_release(&server, &format!("dp-{}", rank1(&server)), &prompt);
        if booking["cached_blocks"] == 1 {
            Ok(booking)
        } else {
            Err(format!("the last booking: {booking}"))
        }
    });
    assert_eq!(booking["dp_rank"], 1, "{booking}");
    assert_eq!(server.status()["kv_event_sources"][0]["batches"], 0);
}

/// A subscription run in this process (the code `serve` runs) against a Rust ZMQ PUB
/// socket speaking the engines' framing: for what no engine will send on purpose.
struct InProcess {
    router: std::sync::Arc<kvhint::router::Router>,
    events: kvhint::engine_events::EngineEvents,
    publisher: zmq::Socket,
    seq: u64,
    _context: zmq::Context,
}

impl InProcess {
    /// Worker 1 (decode) subscribed to a PUB bound on a free loopback port.
    fn new(receive_hwm: i32) -> InProcess {
        use kvhint::engine_events::EngineEvents;
        use kvhint::router::Router;
        use kvhint::testing::DecodeSettings;
        use kvhint::testing::Ingest;
        use kvhint::testing::SubscriberOptions;
        use std::sync::Arc;

        let router = Arc::new(Router::new(BLOCK as usize));
        router
            .register_worker(
                serde_json::from_value(json!({"worker_id": 1, "role": "decode"})).unwrap(),
            )
            .unwrap();
        let (ingest, _thread) = Ingest::start(Arc::clone(&router), 16).unwrap();
        let events = EngineEvents::new(
            Arc::clone(&router),
            ingest,
            DecodeSettings {
                block_size: BLOCK as usize,
                media: vec!["GPU".into()],
            },
            SubscriberOptions {
                receive_hwm,
                ..SubscriberOptions::default()
            },
        );
        let context = zmq::Context::new();
        let publisher = context.socket(zmq::PUB).unwrap();
        publisher.set_sndhwm(receive_hwm).unwrap();
        let port = free_port();
        publisher.bind(&format!("tcp://127.0.0.1:{port}")).unwrap();
        let this = InProcess {
            router,
            events,
            publisher,
            seq: 0,
            _context: context,
        };
        this.attach(&format!("tcp://127.0.0.1:{port}"), false);
        this
    }

    fn attach(&self, endpoint: &str, bind: bool) {
        self.events
            .attach(
                worker_1(),
                &kvhint::domain::event_source::KvEventSource {
                    endpoint: endpoint.into(),
                    replay_endpoint: None,
                    topic: String::new(),
                    bind,
                },
                kvhint::engine_events::Origin::Registration,
            )
            .unwrap();
    }

    fn stat(&self, counter: fn(&kvhint::testing::SourceStats) -> u64) -> u64 {
        counter(self.events.sources()[0].stats())
    }

    /// Sends `[topic "", seq, payload]` with the next sequence number.
    fn send(&mut self, payload: &[u8], wait: bool) {
        let flags = if wait { 0 } else { zmq::DONTWAIT };
        let _ = self
            .publisher
            .send_multipart([&b""[..], &self.seq.to_be_bytes()[..], payload], flags);
        self.seq += 1;
    }

    /// Publishes probes until the subscription has applied one.
    fn join(&mut self) {
        wait::until("the subscription to join", Duration::from_secs(20), || {
            if self.stat(|s| s.batches.load(std::sync::atomic::Ordering::Relaxed)) > 0 {
                return Some(());
            }
            self.send(&stored_batch(1, 1), true);
            None
        });
    }

    /// Publishes a one-block batch until the index holds it.
    fn until_held(&mut self, first_hash: u64) {
        let tokens: Vec<u32> = (0..BLOCK).map(|t| t + first_hash as u32).collect();
        let mut hashes = Vec::new();
        kvhint::router::index::block_hashes(&tokens, BLOCK as usize, &mut hashes);
        let mut matches = kvhint::router::index::Matches::new();
        let payload = stored_batch(first_hash, 1);
        wait::until(
            &format!("block {first_hash} to arrive"),
            Duration::from_secs(30),
            || {
                self.send(&payload, true);
                std::thread::sleep(Duration::from_millis(20));
                let held = self.router.read_index(|index| {
                    index.lookup(&hashes, &mut matches);
                    !matches.found().is_empty()
                });
                held.then_some(())
            },
        );
    }
}

fn worker_1() -> kvhint::domain::WorkerKey {
    kvhint::domain::WorkerKey {
        worker_id: 1,
        dp_rank: 0,
    }
}

/// One engine batch: `[ts, [BlockStored of `blocks` blocks], 0]`, msgpack as the
/// engines write it.
fn stored_batch(first_hash: u64, blocks: u64) -> Vec<u8> {
    let tokens: Vec<u32> = (0..blocks as u32 * BLOCK)
        .map(|t| t + first_hash as u32)
        .collect();
    let hashes: Vec<u64> = (first_hash..first_hash + blocks).collect();
    batch(json!([{"type": "BlockStored", "block_hashes": hashes,
                  "parent_block_hash": null, "token_ids": tokens,
                  "block_size": BLOCK, "medium": "GPU"}]))
}

/// A publisher far faster than the router: the socket's high-water mark drops what the
/// router cannot take, the subscription sees the gaps and resynchronises instead of
/// queueing without bound, and the first batch after the burst is applied as usual.
#[test]
fn a_flood_is_dropped_at_the_socket_and_resynchronised_not_queued() {
    use std::sync::atomic::Ordering;
    let mut source = InProcess::new(4);
    source.join();
    // The flood: 20,000 batches of 64 blocks as fast as the socket takes them.
    let flood = stored_batch(1_000, 64);
    for _ in 0..20_000 {
        source.send(&flood, false);
    }
    Waiting::new("a gap after a flood", Duration::from_secs(30))
        .every(Duration::from_millis(5))
        .until(|| {
            if source.stat(|s| s.gaps.load(Ordering::Relaxed)) > 0 {
                return Some(());
            }
            source.send(&flood, true);
            None
        });
    assert!(
        source.stat(|s| s.resyncs.load(Ordering::Relaxed)) >= 1,
        "a gap without replay resyncs"
    );
    // After the flood, a fresh block is applied as usual.
    source.until_held(900_000);
    source.events.shutdown();
}

/// Messages no engine sends — the wrong number of frames, a sequence number that is
/// not 8 bytes, a payload that is not msgpack — are counted and skipped; the bad batch
/// resyncs the worker (its events are lost), and the next good one is applied.
#[test]
fn malformed_frames_and_batches_are_counted_and_skipped_never_fatal() {
    use std::sync::atomic::Ordering;
    let mut source = InProcess::new(1_000);
    source.join();
    source
        .publisher
        .send_multipart([&b""[..], &b"only two frames"[..]], 0)
        .unwrap();
    source
        .publisher
        .send_multipart([&b""[..], &[1u8, 2, 3][..], &b"payload"[..]], 0)
        .unwrap();
    source.send(&[0xc1, 0xff, 0x00, 0x93], true);
    source.send(&[0x93, 0xcb], true);
    source.until_held(500_000);
    assert_eq!(source.stat(|s| s.frame_errors.load(Ordering::Relaxed)), 2);
    assert_eq!(source.stat(|s| s.decode_errors.load(Ordering::Relaxed)), 2);
    assert!(source.stat(|s| s.resyncs.load(Ordering::Relaxed)) >= 2);
    source.events.shutdown();
}

/// A source that must bind an address already in use keeps retrying with backoff,
/// says why in its status, and binds once the address frees.
#[test]
fn a_bind_address_in_use_is_retried_until_it_frees() {
    use std::sync::atomic::Ordering;
    let source = InProcess::new(1_000);
    source.events.detach(worker_1());
    let port = free_port();
    let squatter = TcpListener::bind(("127.0.0.1", port)).unwrap();
    source.attach(&format!("tcp://127.0.0.1:{port}"), true);
    wait::until_true("the bind to be retried", Duration::from_secs(20), || {
        source.stat(|s| s.socket_errors.load(Ordering::Relaxed)) >= 2
    });
    let view = &source.events.sources()[0];
    let error = view.stats().last_error().unwrap_or_default();
    assert!(error.contains("cannot bind tcp://127.0.0.1"), "{error}");
    assert_eq!(source.stat(|s| s.connects.load(Ordering::Relaxed)), 0);
    drop(squatter);
    wait::until_true(
        "a bind after the port freed",
        Duration::from_secs(20),
        || source.stat(|s| s.connects.load(Ordering::Relaxed)) > 0,
    );
    source.events.shutdown();
}

#[test]
fn an_unknown_parent_rebuilds_the_worker_from_the_replay_buffer() {
    let (mut publisher, fleet) = bound_with_replay();
    let server = &fleet.server;
    until_joined(server, &mut publisher);
    let kept = tokens(7_000, 1);
    publisher.publish(json!([stored(&[701], None, &kept)]), false);
    wait_held(server, &kept, 1, "a root block");
    let orphan = tokens(8_000, 1);
    publisher.publish(json!([stored(&[801], Some(123_456), &orphan)]), false);
    Waiting::new("an unknown parent to be seen", Duration::from_secs(20))
        .report(|| source_status(server).to_string())
        .until(|| {
            (source_status(server)["unknown_parent"]
                .as_u64()
                .unwrap_or(0)
                > 0)
            .then_some(())
        });
    // The rebuild clears the worker, then replays: once the second replay (the first
    // loaded the history at start) has begun, the clear is done, so a block seen from
    // then on came back from the replay buffer.
    Waiting::new("the second replay to begin", Duration::from_secs(20))
        .every(Duration::from_millis(5))
        .report(|| source_status(server).to_string())
        .until(|| (source_status(server)["replays"].as_u64().unwrap_or(0) >= 2).then_some(()));
    assert!(source_status(server)["resyncs"].as_u64().unwrap() >= 1);
    wait_held(server, &kept, 1, "the root block after the rebuild");
}

/// vLLM 0.23.0's own publisher (array-encoded events; replay replies without the topic
/// frame, as vLLM sent them before 0.26): a dropped batch comes back through its replay
/// socket, and a `kv.fetch` names its u64 hashes above 2^63 as they are.
#[test]
fn vllm_0_23_replay_without_the_topic_frame_recovers_a_gap() {
    let (port, replay) = (free_port(), free_port());
    // vLLM binds only a wildcard host; its replay socket always binds.
    let mut publisher = Publisher::vllm(&[
        "--endpoint".into(),
        format!("tcp://*:{port}"),
        "--replay-endpoint".into(),
        format!("tcp://*:{replay}"),
        "--topic".into(),
        "kv".into(),
    ]);
    let fleet = fleet(json!({"endpoint": format!("tcp://127.0.0.1:{port}"),
                             "replay_endpoint": format!("tcp://127.0.0.1:{replay}"),
                             "topic": "kv"}));
    let server = &fleet.server;
    until_joined(server, &mut publisher);
    let prompt = tokens(9_000, 3);
    let hashes: [u64; 3] = [18_446_744_073_709_551_557, 9_223_372_036_854_775_809, 5];
    let store = |hashes: &[u64], parent: Option<u64>, tokens: &[u32]| {
        json!({"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
               "token_ids": tokens, "block_size": BLOCK, "medium": "GPU"})
    };
    publisher.publish(json!([store(&hashes[..2], None, &prompt[..32])]), true);
    publisher.publish(
        json!([store(&hashes[2..], Some(hashes[1]), &prompt[32..])]),
        false,
    );
    wait_held(server, &prompt, 3, "vLLM's replayed blocks");
    let status = source_status(server);
    assert!(status["gaps"].as_u64().unwrap() >= 1, "{status}");
    assert_eq!(status["hashes"], "unsigned", "{status}");
    let mut fetch = None;
    for i in 0..6 {
        let (_, booking) = server.post(
            "/book",
            &json!({"request_id": format!("vllm-load-{i}"), "role": "decode", "token_ids": prompt}),
        );
        if let Some(action) = booking["hint"]["actions"]
            .as_array()
            .and_then(|a| a.iter().find(|a| a["action_type"] == "kv.fetch"))
        {
            fetch = Some(action["payload"]["block_hashes"].clone());
        }
    }
    assert_eq!(fetch, Some(json!(hashes)), "{}", server.log());
}

/// An engine whose block size is not the router's: its stores are refused and
/// counted, and the log says which setting to change.
#[test]
fn a_store_of_another_block_size_is_refused_and_the_log_names_the_setting() {
    let (mut publisher, fleet) = bound();
    let server = &fleet.server;
    until_joined(server, &mut publisher);
    let tokens: Vec<u32> = (0..32).collect();
    publisher.publish(
        json!([{"type": "BlockStored", "block_hashes": [32], "parent_block_hash": null,
                "token_ids": tokens, "block_size": 32, "medium": "GPU"}]),
        false,
    );
    server.wait_for("the wrong block size counted", |server| {
        let (_, metrics) = server.get("/metrics");
        metrics.contains(
            "kvhint_kv_source_events_total{worker_id=\"3\",dp_rank=\"0\",type=\"wrong_block_size\"} 1",
        )
    });
    server.wait_for("the log line", |server| {
        let log = server.log();
        log.contains("router_block_size=16") && log.contains("set `router.block_size`")
    });
    assert_eq!(held_by_3(server, "bs", &tokens), 0);
}
