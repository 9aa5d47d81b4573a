//! Issue 44, item 8: engine-event sources under churn. A storm of reloads that
//! swapped `kv_events.sources` while the config's workers were re-registered over
//! the API, against a port that answers something other than a ZMQ publisher,
//! grew the router from 37 to 2,069 descriptors; past libzmq's 1,023 sockets no
//! subscription could be made, yet every source stayed `connecting` with no error.
//! (The cause: a subscription closed the PAIR its socket monitor reports to while
//! libzmq could still send it an event; that send blocks libzmq's one I/O thread
//! for good, after which no socket is ever closed or connected again.)
//!
//! Here: a seeded, bounded interleaving of reloads and registrations against such
//! a port; what a source that cannot make its socket shows and does; and the
//! connection cap, which keeps descriptors only for the sources there are. Every
//! assertion is on counts (descriptors, threads, states, log fields); every wait
//! is bounded. Loopback only.

use kvhint_e2e::engines::batch;
use kvhint_e2e::http::{metric, metrics, sample};
use kvhint_e2e::process::free_port;
use kvhint_e2e::wait::Waiting;
use kvhint_e2e::{kvhint_bin, private_dir, Server};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// A loopback port that accepts every connection, answers an HTTP error and
/// garbage, and hangs up: what a source pointed at a web server (or at any port
/// that is not a publisher) meets. Stopped on drop.
struct NotAPublisher {
    port: u16,
    accepted: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl NotAPublisher {
    fn start() -> NotAPublisher {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let (accepted, stop) = (
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicBool::new(false)),
        );
        let thread = {
            let (accepted, stop) = (Arc::clone(&accepted), Arc::clone(&stop));
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let Ok((mut stream, _)) = listener.accept() else {
                        std::thread::sleep(Duration::from_millis(2));
                        continue;
                    };
                    accepted.fetch_add(1, Ordering::Relaxed);
                    let _ = stream.set_nonblocking(false);
                    let _ = stream.set_read_timeout(Some(Duration::from_millis(50)));
                    // libzmq sends its greeting first: read it, answer nonsense.
                    let mut greeting = [0u8; 64];
                    let _ = stream.read(&mut greeting);
                    let mut answer =
                        b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n".to_vec();
                    let mut noise = Seeded(accepted.load(Ordering::Relaxed) | 1);
                    answer.extend((0..64).map(|_| noise.next() as u8));
                    let _ = stream.write_all(&answer);
                }
            })
        };
        NotAPublisher {
            port,
            accepted,
            stop,
            thread: Some(thread),
        }
    }

    fn endpoint(&self) -> String {
        format!("tcp://127.0.0.1:{}", self.port)
    }
}

impl Drop for NotAPublisher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A PUB socket in this process, bound on a free loopback port: a real publisher.
struct RealPublisher {
    socket: zmq::Socket,
    port: u16,
    seq: u64,
    _context: zmq::Context,
}

impl RealPublisher {
    fn bind() -> RealPublisher {
        Self::bind_on(free_port(), 0)
    }

    /// On `port`, its sequence going on from `seq`.
    fn bind_on(port: u16, seq: u64) -> RealPublisher {
        let context = zmq::Context::new();
        let socket = context.socket(zmq::PUB).unwrap();
        socket.set_linger(0).unwrap();
        socket.bind(&format!("tcp://127.0.0.1:{port}")).unwrap();
        RealPublisher {
            socket,
            port,
            seq,
            _context: context,
        }
    }

    /// Publishes a batch (a removal of a block nobody holds) on topic "".
    fn probe(&mut self) {
        let payload = batch(json!([{"type": "BlockRemoved", "block_hashes": [7]}]));
        let _ = self.socket.send_multipart(
            [&b""[..], &self.seq.to_be_bytes()[..], &payload[..]],
            zmq::DONTWAIT,
        );
        self.seq += 1;
    }
}

/// xorshift64*: the interleaving is the same on every run.
struct Seeded(u64);

impl Seeded {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn open_descriptors(server: &Server) -> usize {
    std::fs::read_dir(format!("/proc/{}/fd", server.child.id()))
        .unwrap()
        .count()
}

/// The router's subscriber threads (named `kvhint-kv-<worker>-<rank>`).
fn subscriber_threads(server: &Server) -> usize {
    std::fs::read_dir(format!("/proc/{}/task", server.child.id()))
        .unwrap()
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
        .filter(|name| name.starts_with("kvhint-kv-"))
        .count()
}

fn sources(server: &Server) -> Vec<Value> {
    server.status()["kv_event_sources"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

fn source(server: &Server, worker_id: u64) -> Value {
    sources(server)
        .into_iter()
        .find(|s| s["worker_id"] == worker_id)
        .unwrap_or(Value::Null)
}

fn reload(server: &Server) {
    let (status, body) = server.post("/admin/reload", &json!({}));
    assert_eq!(status, 200, "{body}");
}

const ROLES: &str =
    "worker_selection:\n  decode: dynamo-default-cost-fn\n  aggregated: dynamo-default-cost-fn\n";

/// The config's sources in each variant of the storm (ten each, no id shared).
fn config_sources(variant: u64) -> std::ops::RangeInclusive<u64> {
    if variant == 0 {
        1..=10
    } else {
        21..=30
    }
}

/// The config's workers (`workers:`), each with a source, in both variants.
const WORKERS: [u64; 4] = [40, 41, 42, 43];

/// The config the storm swaps between: variant 0 lists config sources 1-10,
/// variant 1 lists 21-30; both list the [`WORKERS`] with a source on `endpoint`,
/// whose topic (`a` or `b`) makes it another source in each variant. Every
/// source has a replay socket there too (which answers nothing useful either).
fn churn_config(variant: u64, endpoint: &str) -> String {
    let topic = if variant == 0 { "a" } else { "b" };
    let mut yaml = format!(
        "router:\n  block_size: 4\ngateway:\n  health:\n    interval_ms: 0\n{ROLES}kv_events:\n  sources:\n"
    );
    for id in config_sources(variant) {
        yaml.push_str(&format!(
            "    - {{worker_id: {id}, role: decode, endpoint: \"{endpoint}\", replay_endpoint: \"{endpoint}\"}}\n"
        ));
    }
    yaml.push_str("workers:\n");
    for id in WORKERS {
        yaml.push_str(&format!(
            "  - {{worker_id: {id}, http_endpoint: \"http://127.0.0.1:9\", engine: vllm, models: [m], kv_events: {{endpoint: \"{endpoint}\", replay_endpoint: \"{endpoint}\", topic: {topic}}}}}\n"
        ));
    }
    yaml
}

/// What a worker of the config registers over the API, with the source of
/// topic `topic` (the config's in one variant, another source in the other).
fn registration(id: u64, endpoint: &str, topic: &str) -> Value {
    json!({"worker_id": id, "role": "aggregated", "http_endpoint": "http://127.0.0.1:9",
           "engine": "vllm", "models": ["m"],
           "kv_events": {"endpoint": endpoint, "replay_endpoint": endpoint, "topic": topic}})
}

/// Steps of the storm: reloads and registrations, chosen by a seeded generator.
const STEPS: usize = 300;

/// The storm, bounded and seeded: [`STEPS`] steps, each a reload (the config
/// file swapped to the other variant, then `POST /admin/reload`: 14 sources
/// stopped, 14 started) or a registration of one of the [`WORKERS`] with
/// either topic's source, all against a port that is not a publisher. Then the
/// config of the start again and the same registrations: the router must hold
/// what it held at the start (give or take a connection in flight per source),
/// one thread per source, every source saying honestly that its peer is no
/// publisher, and a source pointed at a real publisher afterwards must still
/// hear it.
#[test]
fn reloads_and_registrations_interleaved_leak_no_sockets_and_sources_stay_honest() {
    let peer = NotAPublisher::start();
    let endpoint = peer.endpoint();
    let dir = private_dir();
    let config = dir.path().join("kvhint.yaml");
    std::fs::write(&config, churn_config(0, &endpoint)).unwrap();
    let server = Server::start(&config, &[], dir.path());
    let mut wanted: Vec<u64> = config_sources(0).chain(WORKERS).collect();
    wanted.sort_unstable();
    let settle = |what: &str| {
        // Every source there, each having met the peer at least once.
        server.wait_for(what, |s| {
            let all = sources(s);
            let mut ids: Vec<u64> = all.iter().filter_map(|x| x["worker_id"].as_u64()).collect();
            ids.sort_unstable();
            ids == wanted
                && all
                    .iter()
                    .all(|x| x["handshake_failures"].as_u64().unwrap_or(0) >= 1)
        });
    };
    let register_all = |topic: &str| {
        for id in WORKERS {
            let (status, body) = server.post("/workers", &registration(id, &endpoint, topic));
            assert!(status == 200 || status == 201, "{status}: {body}");
        }
    };
    register_all("a");
    settle("the sources to meet the peer");
    let before = open_descriptors(&server);
    assert_eq!(subscriber_threads(&server), wanted.len());

    let mut rng = Seeded(0x4b56_4849_4e54_0044);
    let (mut variant, mut reloads, mut registrations) = (0, 0, 0);
    for _ in 0..STEPS {
        if rng.below(2) == 0 {
            variant ^= 1;
            std::fs::write(&config, churn_config(variant, &endpoint)).unwrap();
            reload(&server);
            reloads += 1;
        } else {
            let id = WORKERS[rng.below(WORKERS.len() as u64) as usize];
            let topic = if rng.below(2) == 0 { "a" } else { "b" };
            let (status, body) = server.post("/workers", &registration(id, &endpoint, topic));
            assert!(status == 200 || status == 201, "{status}: {body}");
            registrations += 1;
        }
    }
    assert!(
        reloads >= STEPS / 3 && registrations >= STEPS / 3,
        "{reloads} reloads, {registrations} registrations"
    );
    // Back to the start's sources.
    std::fs::write(&config, churn_config(0, &endpoint)).unwrap();
    reload(&server);
    register_all("a");

    // Every stopped subscription's thread ends and its sockets close: one thread
    // per source, and the descriptors of the start, give or take a connection to
    // the peer in flight per source (and one source's budget besides).
    let bound = before + wanted.len() + kvhint::engine_events::FDS_PER_SOURCE as usize;
    Waiting::new("the storm's sockets to be closed", Duration::from_secs(30))
        .report(|| {
            format!(
                "{} descriptors open, {before} before the storm; {} subscriber threads; status {:#}",
                open_descriptors(&server),
                subscriber_threads(&server),
                Value::Array(sources(&server)),
            )
        })
        .until(|| {
            (open_descriptors(&server) <= bound && subscriber_threads(&server) == wanted.len())
                .then_some(())
        });

    // Each source says what it meets: connecting, never live (no handshake ever
    // completed; nor replaying, which says a publisher was heard), its error
    // naming the peer and the handshake, its failed handshakes counted in
    // /metrics.
    settle("the sources to meet the peer again");
    let all = sources(&server);
    for s in &all {
        assert_eq!(s["state"], "connecting", "{s:#}");
        assert_eq!(s["batches"], 0, "{s:#}");
        // A peer that never completed a handshake never dropped a publisher's
        // connection: nothing to rebuild the worker from.
        assert_eq!(s["reconnects"], 0, "{s:#}");
        assert_eq!(s["resyncs"], 0, "{s:#}");
        let error = s["last_error"].as_str().unwrap_or_default();
        assert!(
            error.contains("is not a ZMQ publisher") && error.contains(&endpoint),
            "{s:#}"
        );
        let expected = if WORKERS.contains(&s["worker_id"].as_u64().unwrap_or(0)) {
            "registration"
        } else {
            "config"
        };
        assert_eq!(s["origin"], expected, "{s:#}");
    }
    let text = metrics(&server);
    for id in &wanted {
        let labels = format!("{{worker_id=\"{id}\",dp_rank=\"0\"");
        assert_eq!(
            sample(
                &text,
                &format!("kvhint_kv_source_state{labels},state=\"connecting\"}}")
            ),
            Some(1.0),
            "{text}"
        );
        assert_eq!(
            sample(&text, &format!("kvhint_kv_source_up{labels}}}")),
            Some(0.0),
            "{text}"
        );
        assert!(
            sample(
                &text,
                &format!("kvhint_kv_source_handshake_failures_total{labels}}}")
            )
            .is_some_and(|n| n >= 1.0),
            "{text}"
        );
    }
    assert!(peer.accepted.load(Ordering::Relaxed) >= wanted.len() as u64);

    // And a source pointed at a real publisher still subscribes and hears it.
    let mut publisher = RealPublisher::bind();
    let body = json!({"worker_id": 60, "role": "decode",
                      "kv_events": {"endpoint": format!("tcp://127.0.0.1:{}", publisher.port)}});
    let (status, reply) = server.post("/workers", &body);
    assert_eq!(status, 201, "{reply}");
    Waiting::new("the real publisher to be heard", Duration::from_secs(30))
        .every(Duration::from_millis(50))
        .report(|| format!("{:#}\n{}", source(&server, 60), server.log()))
        .until(|| {
            publisher.probe();
            (source(&server, 60)["batches"].as_u64().unwrap_or(0) >= 1).then_some(())
        });
    let heard = source(&server, 60);
    assert_eq!(heard["state"], "live", "{heard:#}");
    assert_eq!(heard["last_error"], Value::Null, "{heard:#}");
}

/// The other side of telling a publisher by its handshake: one whose connection
/// drops and comes back (its sequence going on, so only the connection can tell)
/// may be a restarted engine, and the worker is rebuilt, once.
#[test]
fn a_publisher_that_drops_and_comes_back_rebuilds_the_worker_once() {
    let dir = private_dir();
    let config = dir.path().join("kvhint.yaml");
    std::fs::write(&config, format!("router:\n  block_size: 4\n{ROLES}")).unwrap();
    let server = Server::start(&config, &[], dir.path());
    let mut publisher = RealPublisher::bind();
    let port = publisher.port;
    let body = json!({"worker_id": 8, "role": "decode",
                      "kv_events": {"endpoint": format!("tcp://127.0.0.1:{port}")}});
    let (status, reply) = server.post("/workers", &body);
    assert_eq!(status, 201, "{reply}");
    let heard = |publisher: &mut RealPublisher, batches: u64, what: &str| {
        Waiting::new(what, Duration::from_secs(30))
            .every(Duration::from_millis(50))
            .report(|| format!("{:#}", source(&server, 8)))
            .until(|| {
                publisher.probe();
                (source(&server, 8)["batches"].as_u64().unwrap_or(0) >= batches).then_some(())
            });
    };
    heard(&mut publisher, 1, "the publisher to be heard");
    let first = source(&server, 8);
    assert_eq!(first["reconnects"], 0, "{first:#}");
    // Gone, and back on the same port.
    let seq = publisher.seq;
    drop(publisher);
    server.wait_for("the drop to be seen", |s| {
        source(s, 8)["state"] == "connecting"
    });
    let mut publisher = RealPublisher::bind_on(port, seq);
    let before = source(&server, 8)["batches"].as_u64().unwrap_or(0);
    heard(
        &mut publisher,
        before + 1,
        "the publisher to be heard again",
    );
    let back = source(&server, 8);
    assert_eq!(back["state"], "live", "{back:#}");
    assert_eq!(back["reconnects"], 1, "{back:#}");
    assert!(back["resyncs"].as_u64().unwrap_or(0) >= 1, "{back:#}");
    assert_eq!(back["restarts"], 0, "the sequence went on: {back:#}");
}

/// A subscription whose socket cannot be made (here: its bind address is taken)
/// says so, `failed` with the reason in status and `/metrics`, and is retried
/// with backoff until the address frees; then it binds, and a publisher that
/// connects is heard.
#[test]
fn a_source_whose_socket_cannot_be_made_shows_failed_and_is_retried_until_it_can() {
    let dir = private_dir();
    let config = dir.path().join("kvhint.yaml");
    std::fs::write(&config, format!("router:\n  block_size: 4\n{ROLES}")).unwrap();
    let server = Server::start(&config, &[], dir.path());
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let body = json!({"worker_id": 7, "role": "decode",
                      "kv_events": {"endpoint": endpoint, "bind": true}});
    let (status, reply) = server.post("/workers", &body);
    assert_eq!(status, 201, "{reply}");
    server.wait_for("three failed attempts to bind", |s| {
        source(s, 7)["socket_errors"].as_u64().unwrap_or(0) >= 3
    });
    let failed = source(&server, 7);
    assert_eq!(failed["state"], "failed", "{failed:#}");
    let error = failed["last_error"].as_str().unwrap_or_default();
    assert!(
        error.starts_with(&format!("cannot bind {endpoint}")),
        "{failed:#}"
    );
    let labels = "{worker_id=\"7\",dp_rank=\"0\"";
    assert_eq!(
        metric(
            &server,
            &format!("kvhint_kv_source_state{labels},state=\"failed\"}}")
        ),
        1.0
    );
    assert!(
        metric(
            &server,
            &format!("kvhint_kv_source_socket_errors_total{labels}}}")
        ) >= 3.0
    );

    // The address frees: the next attempt binds, and the attempts stop.
    drop(taken);
    server.wait_for("the source to bind", |s| {
        source(s, 7)["state"] == "connecting"
    });
    let errors = source(&server, 7)["socket_errors"].as_u64().unwrap_or(0);
    let context = zmq::Context::new();
    let publisher = context.socket(zmq::PUB).unwrap();
    publisher.connect(&endpoint).unwrap();
    let mut seq = 0u64;
    Waiting::new(
        "the connecting publisher to be heard",
        Duration::from_secs(30),
    )
    .every(Duration::from_millis(50))
    .report(|| format!("{:#}", source(&server, 7)))
    .until(|| {
        let payload = batch(json!([{"type": "BlockRemoved", "block_hashes": [7]}]));
        let _ = publisher.send_multipart(
            [&b""[..], &seq.to_be_bytes()[..], &payload[..]],
            zmq::DONTWAIT,
        );
        seq += 1;
        (source(&server, 7)["batches"].as_u64().unwrap_or(0) >= 1).then_some(())
    });
    let live = source(&server, 7);
    assert_eq!(live["state"], "live", "{live:#}");
    assert_eq!(live["last_error"], Value::Null, "{live:#}");
    assert_eq!(live["socket_errors"].as_u64(), Some(errors), "{live:#}");
}

/// The fields of the log's last line saying what the connection cap is now:
/// (cap, descriptors kept for KV-event sources).
fn last_cap(log: &str) -> Option<(u64, u64)> {
    log.lines()
        .rfind(|l| l.contains("kept_for_kv_event_sources="))
        .map(|line| {
            let field = |name: &str| -> u64 {
                line.split_whitespace()
                    .find_map(|w| w.strip_prefix(name))
                    .and_then(|v| v.parse().ok())
                    .unwrap_or_else(|| panic!("no {name} in {line}"))
            };
            (field("now="), field("kept_for_kv_event_sources="))
        })
}

fn serve_with_file_limit(config: &Path, dir: &Path, limit: u32) -> Server {
    let mut shell = Command::new("sh");
    shell
        .arg("-c")
        .arg(format!("ulimit -n {limit} && exec \"$0\" \"$@\""))
        .arg(kvhint_bin());
    Server::start_command(shell, config, &[], dir)
}

/// Issue 44: the budget kept descriptors for `kv_events.max_sources` sources
/// whether or not one existed (`ulimit -n 256`: 96 kept, 48 connections). Now
/// it keeps them for the sources there are: none at start (the cap is half of
/// 256 - 64), 10 for each of three registered sources (81), and none again once
/// they are deregistered and their threads have closed their sockets.
#[test]
fn the_connection_cap_keeps_descriptors_only_for_sources_that_exist() {
    let dir = private_dir();
    let config = dir.path().join("kvhint.yaml");
    std::fs::write(&config, format!("router:\n  block_size: 4\n{ROLES}")).unwrap();
    let server = serve_with_file_limit(&config, dir.path(), 256);
    let per_source = kvhint::engine_events::FDS_PER_SOURCE;
    assert_eq!(
        last_cap(&server.log()),
        Some(((256 - 64) / 2, 0)),
        "no source, nothing kept\n{}",
        server.log()
    );
    let closed = [free_port(), free_port(), free_port()];
    for (id, port) in (1..=3u64).zip(closed) {
        let body = json!({"worker_id": id, "role": "decode",
                          "kv_events": {"endpoint": format!("tcp://127.0.0.1:{port}")}});
        let (status, reply) = server.post("/workers", &body);
        assert_eq!(status, 201, "{reply}");
    }
    server.wait_for("the cap to keep room for three sources", |s| {
        last_cap(&s.log()) == Some(((256 - 64 - 3 * per_source) / 2, 3 * per_source))
    });
    for id in 1..=3u64 {
        let (status, text) = {
            let mut response = server
                .agent
                .delete(&format!("{}/workers/{id}", server.base))
                .call()
                .unwrap();
            (
                response.status().as_u16(),
                response.body_mut().read_to_string().unwrap_or_default(),
            )
        };
        assert_eq!(status, 200, "{text}");
    }
    server.wait_for("the cap to give the sources' room back", |s| {
        last_cap(&s.log()) == Some(((256 - 64) / 2, 0))
    });
    assert!(sources(&server).is_empty());
}
