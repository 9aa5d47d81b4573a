//! Issue 30, "Replicas": several `kvhint serve` processes sharing booking load over a
//! real `nats-server` (on 127.0.0.1, a free port per test). Every wait is bounded;
//! no test asserts a duration: the timers are shortened in the configs so the waits
//! are short, and what is asserted is load, peers and checksums as `/admin/status`
//! and `/metrics` show them.

use kvhint_e2e::http;
use kvhint_e2e::nats::NatsServer;
use kvhint_e2e::process::free_port;
use kvhint_e2e::wait::Waiting;
use kvhint_e2e::{drop_in, kvhint_bin, private_dir, Server, TempDir};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long any one wait may take before the test fails.
const BOUND: Duration = Duration::from_secs(30);

/// Workers every replica registers (ids 1..=WORKERS, aggregated).
const WORKERS: u64 = 4;

struct Replica {
    server: Server,
    name: String,
    _dir: TempDir,
}

/// The timers of a replica under test.
#[derive(Clone, Copy)]
struct Timers {
    digest_ms: u64,
    peer_timeout_ms: u64,
}

const FAST: Timers = Timers {
    digest_ms: 200,
    peer_timeout_ms: 1_500,
};

fn config(nats_url: &str, name: &str, block_size: u64, timers: Timers) -> String {
    format!(
        "router:\n  block_size: {block_size}\nworker_selection:\n  aggregated:\n    type: dynamo-default-cost-fn\nreplication:\n  nats_url: \"{nats_url}\"\n  fleet: test\n  name: {name}\n  digest_interval_ms: {}\n  peer_timeout_ms: {}\n  sync_timeout_ms: 300\n",
        timers.digest_ms, timers.peer_timeout_ms
    )
}

fn start(nats_url: &str, name: &str, block_size: u64, timers: Timers) -> Replica {
    let dir = private_dir();
    let path = dir.path().join("kvhint.yaml");
    drop_in(&path, config(nats_url, name, block_size, timers).as_bytes()).unwrap();
    let server = Server::start(&path, &["--booking-threads", "2"], dir.path());
    for id in 1..=WORKERS {
        let (status, body) = server.post(
            "/workers",
            &json!({"worker_id": id, "role": "aggregated", "runtime_data": {}}),
        );
        assert!(status == 201 || status == 200, "{body}");
    }
    Replica {
        server,
        name: name.to_string(),
        _dir: dir,
    }
}

fn tokens(seed: u32) -> Vec<u32> {
    (seed * 1000..seed * 1000 + 64).collect()
}

impl Replica {
    /// Books `id`; the booked worker.
    fn book(&self, id: &str) -> u64 {
        let booking = http::book(&self.server, id, "aggregated", &tokens(id.len() as u32));
        booking["worker_id"].as_u64().unwrap()
    }

    fn release(&self, id: &str) {
        http::release(&self.server, id);
    }

    /// Open requests per worker as this replica's selection sees them (its own and
    /// its peers').
    fn view(&self) -> Vec<u64> {
        let status = self.server.status();
        let mut loads = vec![0; WORKERS as usize];
        for w in status["workers"].as_array().unwrap() {
            let id = w["worker_id"].as_u64().unwrap();
            loads[(id - 1) as usize] = w["load"]["active_requests"].as_u64().unwrap();
        }
        loads
    }

    fn replication(&self) -> Value {
        self.server.status()["replication"].clone()
    }

    fn peers(&self) -> Vec<String> {
        self.replication()["peers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["name"].as_str().unwrap().to_string())
            .collect()
    }

    fn metric(&self, line_prefix: &str) -> f64 {
        http::metric(&self.server, line_prefix)
    }

    /// Waits until `check` holds, or fails with every log.
    fn wait(&self, what: &str, check: impl FnMut(&Server) -> bool) {
        self.server
            .wait_for(&format!("{}: {what}", self.name), check);
    }
}

/// Waits (bounded) until every replica's view is `want` and their checksums agree.
fn agree(replicas: &[&Replica], want: &[u64]) {
    Waiting::new(&format!("the replicas to agree on {want:?}"), BOUND)
        .every(Duration::from_millis(25))
        .report(|| {
            let logs: Vec<String> = replicas
                .iter()
                .map(|r| format!("--- {} ---\n{}", r.name, r.server.log()))
                .collect();
            logs.join("\n")
        })
        .until_ok(|| {
            let views: Vec<Vec<u64>> = replicas.iter().map(|r| r.view()).collect();
            let sums: Vec<String> = replicas
                .iter()
                .map(|r| r.replication()["checksum"].as_str().unwrap().to_string())
                .collect();
            if views.iter().all(|v| v == want) && sums.windows(2).all(|w| w[0] == w[1]) {
                Ok(())
            } else {
                Err(format!("views {views:?}, checksums {sums:?}"))
            }
        });
}

/// Waits (bounded) until every replica shows the same view, with `open` open
/// requests in all, and the same checksum; returns that view.
fn converge(replicas: &[&Replica], open: u64) -> Vec<u64> {
    let view = same_views(replicas, open);
    agree(replicas, &view);
    view
}

/// Waits (bounded) until every replica shows the same view with `open` open
/// requests in all; returns it.
fn same_views(replicas: &[&Replica], open: u64) -> Vec<u64> {
    Waiting::new(&format!("one view with {open} open"), BOUND)
        .every(Duration::from_millis(25))
        .until_ok(|| {
            let views: Vec<Vec<u64>> = replicas.iter().map(|r| r.view()).collect();
            if views.iter().all(|v| *v == views[0] && total(v) == open) {
                Ok(views[0].clone())
            } else {
                Err(format!("views {views:?}"))
            }
        })
}

fn total(view: &[u64]) -> u64 {
    view.iter().sum()
}

#[test]
fn a_booking_on_one_replica_shows_in_anothers_view_and_leaves_on_release() {
    let nats = NatsServer::start();
    let a = start(&nats.url(), "a", 16, FAST);
    let b = start(&nats.url(), "b", 16, FAST);
    a.wait("hears b", |_| a.peers() == ["b"]);
    let worker = a.book("req-1");
    let mut want = vec![0; WORKERS as usize];
    want[(worker - 1) as usize] = 1;
    agree(&[&a, &b], &want);
    // b's own bookings avoid the worker a loaded: it sees a's booking.
    let next = b.book("req-2");
    assert_ne!(next, worker, "b booked the worker a had loaded");
    a.release("req-1");
    b.release("req-2");
    agree(&[&a, &b], &[0; WORKERS as usize]);
    assert!(b.metric("kvhint_replication_propagation_lag_seconds_count") >= 1.0);
    assert_eq!(b.metric("kvhint_replication_digest_corrections_total"), 0.0);
    assert_eq!(a.metric("kvhint_replication_digest_corrections_total"), 0.0);
    b.wait("is ready", |_| b.replication()["ready"] == true);
}

#[test]
fn three_replicas_agree_exactly_after_concurrent_bookings_and_releases() {
    let nats = NatsServer::start();
    let replicas: Vec<Replica> = ["a", "b", "c"]
        .iter()
        .map(|n| start(&nats.url(), n, 16, FAST))
        .collect();
    for r in &replicas {
        r.wait("hears both peers", |_| r.peers().len() == 2);
    }
    // Each replica books 40 and releases every other one, all at once.
    std::thread::scope(|scope| {
        for r in &replicas {
            scope.spawn(move || {
                for i in 0..40 {
                    let id = format!("{}-{i}", r.name);
                    r.book(&id);
                    if i % 2 == 1 {
                        r.release(&id);
                    }
                }
            });
        }
    });
    let open: u64 = replicas
        .iter()
        .map(|r| r.server.status()["open_bookings"].as_u64().unwrap())
        .sum();
    assert_eq!(open, 60);
    // The truth: each replica's own open bookings per worker, summed.
    let views = same_views(&replicas.iter().collect::<Vec<_>>(), open);
    agree(&replicas.iter().collect::<Vec<_>>(), &views);
}

#[test]
fn a_killed_replicas_load_leaves_every_peers_view() {
    let nats = NatsServer::start();
    let a = start(&nats.url(), "a", 16, FAST);
    let b = start(&nats.url(), "b", 16, FAST);
    let mut c = start(&nats.url(), "c", 16, FAST);
    c.wait("hears both peers", |_| c.peers().len() == 2);
    for i in 0..5 {
        c.book(&format!("c-{i}"));
    }
    a.book("a-0");
    a.wait("sees c's bookings", |_| total(&a.view()) == 6);
    b.wait("sees c's bookings", |_| total(&b.view()) == 6);
    // kill -9: no goodbye; the peers drop c after its silence.
    c.server.child.kill().unwrap();
    c.server.child.wait().unwrap();
    a.wait("drops c's load", |_| total(&a.view()) == 1);
    b.wait("drops c's load", |_| total(&b.view()) == 1);
    // The status and metrics are refreshed a little after the load itself.
    a.wait("lists b alone and counts c dropped", |_| {
        a.peers() == ["b"]
            && a.metric("kvhint_replication_peers_dropped_total{reason=\"silent\"}") >= 1.0
    });
}

/// With a peer timeout far longer than the test, only the restart's new
/// incarnation can take the old self's load away.
#[test]
fn a_restart_under_the_same_name_replaces_the_old_self_at_once() {
    let slow = Timers {
        digest_ms: 200,
        peer_timeout_ms: 600_000,
    };
    let nats = NatsServer::start();
    let a = start(&nats.url(), "a", 16, slow);
    let mut b = start(&nats.url(), "b", 16, slow);
    b.wait("hears a", |_| b.peers() == ["a"]);
    for i in 0..5 {
        b.book(&format!("old-{i}"));
    }
    a.wait("sees b's 5", |_| total(&a.view()) == 5);
    b.server.child.kill().unwrap();
    b.server.child.wait().unwrap();
    let b = start(&nats.url(), "b", 16, slow);
    b.book("new-0");
    a.wait("sees the new b's 1 only", |_| total(&a.view()) == 1);
    // The status and metrics are refreshed a little after the load itself.
    a.wait("counts the restart", |_| {
        a.metric("kvhint_replication_peers_dropped_total{reason=\"restarted\"}") == 1.0
    });
    agree(&[&a, &b], &a.view());
}

/// A graceful shutdown says goodbye: the peers drop it at once, not after the
/// (here, very long) timeout.
#[test]
fn a_replica_that_shuts_down_says_goodbye() {
    let slow = Timers {
        digest_ms: 200,
        peer_timeout_ms: 600_000,
    };
    let nats = NatsServer::start();
    let a = start(&nats.url(), "a", 16, slow);
    let b = start(&nats.url(), "b", 16, slow);
    b.wait("hears a", |_| b.peers() == ["a"]);
    b.book("b-0");
    a.wait("sees b's booking", |_| total(&a.view()) == 1);
    // SAFETY: sending SIGTERM to our own child, whose pid we hold.
    unsafe { libc::kill(b.server.child.id() as i32, libc::SIGTERM) };
    a.wait("drops b on its goodbye", |_| {
        total(&a.view()) == 0 && a.peers().is_empty()
    });
    assert_eq!(
        a.metric("kvhint_replication_peers_dropped_total{reason=\"goodbye\"}"),
        1.0
    );
}

#[test]
fn a_late_joiner_converges() {
    let nats = NatsServer::start();
    let a = start(&nats.url(), "a", 16, FAST);
    let b = start(&nats.url(), "b", 16, FAST);
    a.wait("hears b", |_| a.peers() == ["b"]);
    for i in 0..3 {
        a.book(&format!("a-{i}"));
        b.book(&format!("b-{i}"));
    }
    let before = converge(&[&a, &b], 6);
    let c = start(&nats.url(), "c", 16, FAST);
    c.wait("is ready", |_| c.replication()["ready"] == true);
    agree(&[&a, &b, &c], &before);
    c.wait("lists both peers", |_| c.peers() == ["a", "b"]);
}

#[test]
fn with_nats_down_no_booking_fails_and_the_views_converge_when_it_is_back() {
    let mut nats = NatsServer::start();
    let a = start(&nats.url(), "a", 16, FAST);
    let b = start(&nats.url(), "b", 16, FAST);
    a.wait("hears b", |_| a.peers() == ["b"]);
    a.book("before");
    agree(&[&a, &b], &a.view());
    nats.stop();
    a.wait("sees NATS gone", |_| a.replication()["connected"] == false);
    // Every booking and release succeeds (`book` asserts 200) on each replica's own view.
    for i in 0..50 {
        a.book(&format!("a-{i}"));
        b.book(&format!("b-{i}"));
        if i % 5 == 0 {
            a.release(&format!("a-{i}"));
        }
    }
    // Alone, each forgets the other after the timeout.
    a.wait("drops b while NATS is away", |_| a.peers().is_empty());
    nats.restart();
    a.wait("reconnects", |_| a.replication()["connected"] == true);
    converge(&[&a, &b], 1 + 40 + 50);
}

/// A replica whose NATS server is not up yet starts and books on its own view;
/// once the server is up, it joins.
#[test]
fn a_replica_starts_and_books_before_nats_is_up() {
    let port = free_port();
    let url = format!("nats://127.0.0.1:{port}");
    let a = start(&url, "a", 16, FAST);
    assert_eq!(a.replication()["connected"], false);
    a.book("early");
    assert_eq!(total(&a.view()), 1);
    let _nats = NatsServer::start_on(port);
    let b = start(&url, "b", 16, FAST);
    a.wait("connects", |_| a.replication()["connected"] == true);
    agree(&[&a, &b], &a.view());
    assert_eq!(total(&b.view()), 1);
}

/// A TCP proxy between one replica and NATS, which the test can cut (every
/// connection closed, new ones refused) and restore on the same port.
struct Proxy {
    port: u16,
    cut: Arc<AtomicBool>,
    open: Arc<Mutex<Vec<TcpStream>>>,
}

impl Proxy {
    fn start(to: u16) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let cut = Arc::new(AtomicBool::new(false));
        let open: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let (cut_flag, conns) = (Arc::clone(&cut), Arc::clone(&open));
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                if cut_flag.load(Ordering::SeqCst) {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                }
                let Ok(server) = TcpStream::connect(("127.0.0.1", to)) else {
                    continue;
                };
                let mut held = conns.lock().unwrap();
                held.push(client.try_clone().unwrap());
                held.push(server.try_clone().unwrap());
                for (mut from, mut into) in [
                    (client.try_clone().unwrap(), server.try_clone().unwrap()),
                    (server, client),
                ] {
                    std::thread::spawn(move || {
                        let mut buf = [0u8; 16 * 1024];
                        while let Ok(n) = from.read(&mut buf) {
                            if n == 0 || into.write_all(&buf[..n]).is_err() {
                                break;
                            }
                        }
                        let _ = into.shutdown(Shutdown::Both);
                        let _ = from.shutdown(Shutdown::Both);
                    });
                }
            }
        });
        Proxy { port, cut, open }
    }

    fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        for stream in self.open.lock().unwrap().drain(..) {
            let _ = stream.shutdown(Shutdown::Both);
        }
    }

    fn restore(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }
}

#[test]
fn a_replica_cut_off_from_the_bus_rejoins() {
    let nats = NatsServer::start();
    let proxy = Proxy::start(nats.port);
    let a = start(&nats.url(), "a", 16, FAST);
    let b = start(&nats.url(), "b", 16, FAST);
    let c = start(&format!("nats://127.0.0.1:{}", proxy.port), "c", 16, FAST);
    c.wait("hears both peers", |_| c.peers().len() == 2);
    c.book("c-0");
    a.wait("sees c's booking", |_| total(&a.view()) == 1);
    proxy.cut();
    a.wait("drops the cut-off c", |_| {
        a.peers() == ["b"] && total(&a.view()) == 0
    });
    c.wait("drops its unreachable peers", |_| c.peers().is_empty());
    // Cut off, c books on its own view; a and b go on.
    c.book("c-1");
    c.book("c-2");
    a.book("a-0");
    proxy.restore();
    c.wait("reconnects", |_| c.replication()["connected"] == true);
    converge(&[&a, &b, &c], 4);
}

#[test]
fn a_peer_with_another_block_size_is_refused() {
    let nats = NatsServer::start();
    let a = start(&nats.url(), "a", 16, FAST);
    let odd = start(&nats.url(), "odd", 32, FAST);
    a.wait("refuses odd", |_| {
        a.replication()["refused"][0]["name"] == "odd"
    });
    assert_eq!(a.replication()["refused"][0]["block_size"], 32);
    odd.book("odd-0");
    odd.book("odd-1");
    a.book("a-0");
    // odd's bookings never reach a's view; a's own is there.
    odd.wait("refuses a too", |_| {
        odd.metric("kvhint_replication_refused_total") >= 2.0
    });
    assert_eq!(total(&a.view()), 1);
    assert!(a.peers().is_empty());
    assert!(a.metric("kvhint_replication_refused_total") >= 1.0);
    assert!(
        a.server
            .log()
            .contains("a peer with another block size is ignored"),
        "{}",
        a.server.log()
    );
}

/// A `replication` section with mistakes is refused with each located.
#[test]
fn a_bad_replication_section_is_refused_with_its_place() {
    let dir = private_dir();
    let path = dir.path().join("kvhint.yaml");
    drop_in(
        &path,
        b"worker_selection:\n  aggregated:\n    type: dynamo-default-cost-fn\nreplication:\n  nats_url: localhost:4222\n  fleet: a.b\n  peer_timeout_ms: 50\n  colour: red\n",
    )
    .unwrap();
    let output = kvhint_e2e::run_bounded(
        Command::new(kvhint_bin())
            .args(["check", "--config"])
            .arg(&path),
        BOUND,
    );
    let text = String::from_utf8_lossy(&output.stderr).to_string()
        + &String::from_utf8_lossy(&output.stdout);
    assert!(!output.status.success(), "{text}");
    for needle in [
        "replication.nats_url",
        "nats://HOST:PORT",
        "replication.fleet",
        "replication.peer_timeout_ms",
        "replication.colour",
        ":5:",
    ] {
        assert!(text.contains(needle), "{needle:?} missing from\n{text}");
    }
}

/// Writes `text` to a private file in `dir` (0600, as a token file must be).
fn secret_file(dir: &std::path::Path, name: &str, text: &str) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    path
}

/// A replica whose `replication:` also has `extra` (YAML lines), its files
/// written into its directory by `files`.
fn start_with(nats_url: &str, name: &str, extra: impl Fn(&std::path::Path) -> String) -> Replica {
    let dir = private_dir();
    let path = dir.path().join("kvhint.yaml");
    let yaml = format!("{}{}", config(nats_url, name, 16, FAST), extra(dir.path()));
    drop_in(&path, yaml.as_bytes()).unwrap();
    let server = Server::start(&path, &["--booking-threads", "2"], dir.path());
    Replica {
        server,
        name: name.to_string(),
        _dir: dir,
    }
}

#[test]
fn replicas_join_a_nats_server_that_asks_for_a_password_over_tls_and_others_do_not() {
    let ca = kvhint_e2e::tls::TestCa::new();
    let (cert, key) = (ca.cert.display().to_string(), ca.key.display().to_string());
    let nats = NatsServer::start_with(
        free_port(),
        &[
            "--user",
            "kvhint",
            "--pass",
            "s3cret-nats-pass",
            "--tls",
            "--tlscert",
            &cert,
            "--tlskey",
            &key,
        ],
    );
    let url = nats.url();
    let ca_file = ca.ca.display().to_string();
    let good = |password: &'static str, with_ca: bool| {
        let ca_file = ca_file.clone();
        move |dir: &std::path::Path| {
            secret_file(dir, "nats.pass", &format!("{password}\n"));
            let mut extra = "  user: kvhint\n  password_file: nats.pass\n".to_string();
            if with_ca {
                extra.push_str(&format!("  tls_ca_file: {ca_file}\n"));
            }
            extra
        }
    };
    // Two replicas with the password and the CA: they find each other.
    let a = start_with(&url, "a", good("s3cret-nats-pass", true));
    let b = start_with(&url, "b", good("s3cret-nats-pass", true));
    a.wait("b among its peers", |_| a.peers() == vec!["b".to_string()]);
    b.wait("a among its peers", |_| b.peers() == vec!["a".to_string()]);
    // A wrong password, and the right one without the CA (the system's roots
    // do not know it): neither connects, and each log says so.
    let wrong = start_with(&url, "wrong", good("not-the-password", true));
    let no_ca = start_with(&url, "no-ca", good("s3cret-nats-pass", false));
    wrong.wait("the refusal in its log", |s| {
        s.log().to_lowercase().contains("authorization")
    });
    // (async-nats reports a failed TLS handshake as an IO error.)
    no_ca.wait("the connection's failure in its log", |s| {
        s.log().contains("replication: NATS event=client error")
    });
    for replica in [&wrong, &no_ca] {
        assert_eq!(
            replica.replication()["connected"],
            false,
            "{}",
            replica.server.log()
        );
    }
    assert_eq!(a.peers(), vec!["b".to_string()]);
    // The password is in no log and not in status.
    for replica in [&a, &b, &wrong, &no_ca] {
        assert!(!replica.server.log().contains("s3cret-nats-pass"));
        assert!(!replica
            .server
            .status()
            .to_string()
            .contains("s3cret-nats-pass"));
    }
}

#[test]
fn nats_credential_mistakes_are_located() {
    use kvhint_e2e::errors::config_errors;
    let base = "worker_selection:\n  aggregated: dynamo-default-cost-fn\nreplication:\n  nats_url: nats://127.0.0.1:4222\n  fleet: test\n";
    // A user without its password file, a token beside a user, a missing
    // password file, a CA file that is not PEM.
    assert_eq!(
        config_errors(&format!("{base}  user: kvhint\n")),
        vec!["kvhint.yaml:6:9: replication.user: `user` needs `password_file`: the file holding the NATS user's password"]
    );
    let errors = config_errors(&format!(
        "{base}  user: kvhint\n  password_file: no-such.pass\n  token_file: no-such.token\n  tls_ca_file: kvhint.yaml\n"
    ));
    assert_eq!(errors.len(), 4, "{errors:?}");
    assert!(errors[0].starts_with("kvhint.yaml:7:18: replication.password_file: <dir>/no-such.pass: there is no such file; write the NATS password in it"), "{errors:?}");
    assert!(
        errors[1].starts_with(
            "kvhint.yaml:8:15: replication.token_file: <dir>/no-such.token: there is no such file"
        ),
        "{errors:?}"
    );
    assert!(errors.iter().any(|e| e.starts_with("kvhint.yaml:8:15: replication.token_file: give either `user` with `password_file` or `token_file`")), "{errors:?}");
    assert!(errors.iter().any(|e| e.starts_with("kvhint.yaml:9:16: replication.tls_ca_file: <dir>/kvhint.yaml:")), "{errors:?}");
}
