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
    assert!(errors.iter().any(|e| e.starts_with("kvhint.yaml:8:15: replication.token_file: give one kind of NATS credentials, the one the NATS server asks for: `user` with `password_file`, `token_file`, `nkey_file` or `credentials_file`, not several")), "{errors:?}");
    assert!(errors.iter().any(|e| e.starts_with("kvhint.yaml:9:16: replication.tls_ca_file: <dir>/kvhint.yaml:")), "{errors:?}");

    // nkey and .creds files: a public key where the seed belongs, an account's
    // seed, a .creds file that is not one, one others may read, a missing one,
    // and two kinds of credentials at once.
    use kvhint_e2e::errors::config_errors_naming;
    use std::os::unix::fs::PermissionsExt;
    let files = private_dir();
    let user = nkeys::KeyPair::new_user();
    let account_seed = nkeys::KeyPair::new_account().seed().unwrap();
    secret_file(
        files.path(),
        "public.nk",
        &format!("{}\n", user.public_key()),
    );
    secret_file(files.path(), "account.nk", &format!("{account_seed}\n"));
    secret_file(
        files.path(),
        "user.nk",
        &format!("{}\n", user.seed().unwrap()),
    );
    secret_file(files.path(), "junk.creds", "not a creds file\n");
    let open = secret_file(files.path(), "open.creds", &operator_mode().creds);
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o644)).unwrap();
    let mine = [(files.path(), "<files>")];
    let one = |key: &str, file: &str| {
        config_errors_naming(
            &format!("{base}  {key}: {}/{file}\n", files.path().display()),
            &mine,
        )
    };
    let public = one("nkey_file", "public.nk");
    assert_eq!(public.len(), 1, "{public:?}");
    assert!(public[0].starts_with("kvhint.yaml:6:14: replication.nkey_file: <files>/public.nk: holds a user's public key (U…), which the server keeps; the replica needs the seed (SU…)"), "{public:?}");
    let account = one("nkey_file", "account.nk");
    assert!(account[0].starts_with("kvhint.yaml:6:14: replication.nkey_file: <files>/account.nk: holds the seed of an NKey of type Account, not of a user (SU…)"), "{account:?}");
    let missing = one("nkey_file", "no-such.nk");
    assert!(missing[0].starts_with("kvhint.yaml:6:14: replication.nkey_file: <files>/no-such.nk: there is no such file; write the NATS user's NKey seed (SU…) in it"), "{missing:?}");
    let junk = one("credentials_file", "junk.creds");
    assert!(junk[0].starts_with("kvhint.yaml:6:21: replication.credentials_file: <files>/junk.creds: is not a NATS .creds file (cannot parse user JWT from the credentials file)"), "{junk:?}");
    let readable = one("credentials_file", "open.creds");
    assert!(readable[0].starts_with("kvhint.yaml:6:21: replication.credentials_file: <files>/open.creds: may be read by other users (mode 0644)"), "{readable:?}");
    let absent = one("credentials_file", "no-such.creds");
    assert!(absent[0].starts_with("kvhint.yaml:6:21: replication.credentials_file: <files>/no-such.creds: there is no such file; write the NATS user's .creds file there"), "{absent:?}");
    let both = config_errors_naming(
        &format!(
            "{base}  token_file: {0}/user.nk\n  nkey_file: {0}/user.nk\n  credentials_file: {0}/open.creds\n",
            files.path().display()
        ),
        &mine,
    );
    for at in [
        "kvhint.yaml:7:14: replication.nkey_file: give one kind of NATS credentials",
        "kvhint.yaml:8:21: replication.credentials_file: give one kind of NATS credentials",
    ] {
        assert!(
            both.iter().any(|e| e.starts_with(at)),
            "{at:?} missing from {both:?}"
        );
    }
    // A good seed or .creds file alone is taken, and no error shows a secret.
    secret_file(files.path(), "good.creds", &operator_mode().creds);
    assert_eq!(one("nkey_file", "user.nk"), Vec::<String>::new());
    assert_eq!(one("credentials_file", "good.creds"), Vec::<String>::new());
    for errors in [public, account, junk, both] {
        for e in errors {
            assert!(
                !e.contains(&account_seed) && !e.contains(&user.seed().unwrap()),
                "{e}"
            );
        }
    }
}

/// A nats-server config file (`-c`) in `dir` with `text`.
fn nats_config(dir: &std::path::Path, text: &str) -> String {
    let path = dir.join("nats.conf");
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

#[test]
fn replicas_join_a_nats_server_that_asks_for_an_nkey_and_others_do_not() {
    let user = nkeys::KeyPair::new_user();
    let seed = user.seed().unwrap();
    let stranger = nkeys::KeyPair::new_user().seed().unwrap();
    let dir = private_dir();
    let conf = nats_config(
        dir.path(),
        &format!(
            "authorization {{\n  users = [\n    {{ nkey: \"{}\" }}\n  ]\n}}\n",
            user.public_key()
        ),
    );
    let nats = NatsServer::start_with(free_port(), &["-c", &conf]);
    let url = nats.url();
    let with_seed = |seed: String| {
        move |dir: &std::path::Path| {
            secret_file(dir, "nats.nk", &format!("{seed}\n"));
            "  nkey_file: nats.nk\n".to_string()
        }
    };
    // Two replicas with the user's seed find each other.
    let a = start_with(&url, "a", with_seed(seed.clone()));
    let b = start_with(&url, "b", with_seed(seed.clone()));
    a.wait("b among its peers", |_| a.peers() == vec!["b".to_string()]);
    b.wait("a among its peers", |_| b.peers() == vec!["a".to_string()]);
    // No credentials, and another user's seed: refused, and each log says so.
    let none = start_with(&url, "none", |_| String::new());
    let other = start_with(&url, "other", with_seed(stranger.clone()));
    for replica in [&none, &other] {
        replica.wait("the refusal in its log", |s| {
            s.log().to_lowercase().contains("authorization")
        });
        assert_eq!(
            replica.replication()["connected"],
            false,
            "{}",
            replica.server.log()
        );
    }
    assert_eq!(a.peers(), vec!["b".to_string()]);
    // The seeds are in no log and not in status.
    for replica in [&a, &b, &none, &other] {
        for secret in [&seed, &stranger] {
            assert!(!replica.server.log().contains(secret.as_str()));
            assert!(!replica
                .server
                .status()
                .to_string()
                .contains(secret.as_str()));
        }
    }
}

/// base64url without padding, as a JWT's three parts are written.
fn base64url(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
        for i in 0..=chunk.len() {
            out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
        }
    }
    out
}

/// A NATS JWT (v2): `claims` about `subject`, signed by `issuer` (the
/// operator signs itself and its accounts, an account its users).
fn nats_jwt(issuer: &nkeys::KeyPair, subject: &str, name: &str, nats: Value) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let claims = json!({
        "jti": format!("{:X}{}", now, name.len()),
        "iat": now,
        "iss": issuer.public_key(),
        "name": name,
        "sub": subject,
        "nats": nats,
    });
    let signed = format!(
        "{}.{}",
        base64url(br#"{"typ":"JWT","alg":"ed25519-nkey"}"#),
        base64url(claims.to_string().as_bytes())
    );
    let signature = issuer.sign(signed.as_bytes()).unwrap();
    format!("{signed}.{}", base64url(&signature))
}

/// An operator-mode NATS setup: the server's config (the operator's JWT, the
/// account's preloaded) and a `.creds` file's text for a user of the account.
struct Operator {
    server_config: String,
    creds: String,
    user_seed: String,
}

fn operator_mode() -> Operator {
    let operator = nkeys::KeyPair::new_operator();
    let account = nkeys::KeyPair::new_account();
    let user = nkeys::KeyPair::new_user();
    let operator_jwt = nats_jwt(
        &operator,
        &operator.public_key(),
        "kvhint-test",
        json!({"type": "operator", "version": 2}),
    );
    let unlimited = json!({
        "subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1,
        "wildcards": true, "conn": -1, "leaf": -1,
    });
    let account_jwt = nats_jwt(
        &operator,
        &account.public_key(),
        "replicas",
        json!({"limits": unlimited, "default_permissions": {"pub": {}, "sub": {}},
               "type": "account", "version": 2}),
    );
    let user_jwt = nats_jwt(
        &account,
        &user.public_key(),
        "kvhint",
        json!({"pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1,
               "type": "user", "version": 2}),
    );
    let user_seed = user.seed().unwrap();
    let creds = format!(
        "-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n\
         ************************* IMPORTANT *************************\n\
         NKEY Seed printed below can be used to sign and prove identity.\n\
         NKEYs are sensitive and should be treated as secrets.\n\n\
         -----BEGIN USER NKEY SEED-----\n{user_seed}\n------END USER NKEY SEED------\n\n\
         *************************************************************\n"
    );
    let server_config = format!(
        "operator: {operator_jwt}\nresolver: MEMORY\nresolver_preload: {{\n  {}: {account_jwt}\n}}\n",
        account.public_key()
    );
    Operator {
        server_config,
        creds,
        user_seed,
    }
}

#[test]
fn replicas_join_an_operator_mode_nats_server_with_a_creds_file_and_others_do_not() {
    let setup = operator_mode();
    // Another operator's user: a well-formed .creds file the server does not trust.
    let foreign = operator_mode();
    let dir = private_dir();
    let conf = nats_config(dir.path(), &setup.server_config);
    let nats = NatsServer::start_with(free_port(), &["-c", &conf]);
    let url = nats.url();
    let with_creds = |creds: String| {
        move |dir: &std::path::Path| {
            secret_file(dir, "user.creds", &creds);
            "  credentials_file: user.creds\n".to_string()
        }
    };
    let a = start_with(&url, "a", with_creds(setup.creds.clone()));
    let b = start_with(&url, "b", with_creds(setup.creds.clone()));
    a.wait("b among its peers", |_| a.peers() == vec!["b".to_string()]);
    b.wait("a among its peers", |_| b.peers() == vec!["a".to_string()]);
    let none = start_with(&url, "none", |_| String::new());
    let stranger = start_with(&url, "stranger", with_creds(foreign.creds.clone()));
    for replica in [&none, &stranger] {
        replica.wait("the refusal in its log", |s| {
            s.log().to_lowercase().contains("authorization")
        });
        assert_eq!(
            replica.replication()["connected"],
            false,
            "{}",
            replica.server.log()
        );
    }
    assert_eq!(a.peers(), vec!["b".to_string()]);
    for replica in [&a, &b, &none, &stranger] {
        for secret in [&setup.user_seed, &foreign.user_seed] {
            assert!(!replica.server.log().contains(secret.as_str()));
            assert!(!replica
                .server
                .status()
                .to_string()
                .contains(secret.as_str()));
        }
    }
}

/// Every worker's open requests as `server`'s selection sees them.
fn all_loads(server: &Server) -> std::collections::BTreeMap<u64, u64> {
    server.status()["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| {
            (
                w["worker_id"].as_u64().unwrap(),
                w["load"]["active_requests"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// Issue 44: a digest over the server's max payload was refused whole, so a
/// joiner never learned its peers' load. With `max_payload` at 16 KiB and 900
/// workers loaded (a digest of about 30 KB), a late joiner, which hears the
/// load only from digests, ends with exactly the other replica's view.
#[test]
fn a_joiner_converges_when_the_digest_is_over_the_servers_max_payload() {
    const MANY: u64 = 900;
    let dir = private_dir();
    let conf = nats_config(dir.path(), "max_payload: 16384\n");
    let nats = NatsServer::start_with(free_port(), &["-c", &conf]);
    let url = nats.url();
    let register = |replica: &Replica| {
        for id in 1..=MANY {
            let (status, body) = replica.server.post(
                "/workers",
                &json!({"worker_id": id, "role": "aggregated", "runtime_data": {}}),
            );
            assert!(status == 201 || status == 200, "{body}");
        }
    };
    let a = start_with(&url, "a", |_| String::new());
    register(&a);
    a.wait("connected", |_| a.replication()["connected"] == true);
    for i in 0..MANY {
        http::book(
            &a.server,
            &format!("a-{i}"),
            "aggregated",
            &tokens(i as u32 + 1),
        );
    }
    let want = all_loads(&a.server);
    let loaded = want.values().filter(|n| **n > 0).count();
    assert!(
        loaded > 600,
        "{loaded} workers loaded: the digest would fit"
    );
    // b joins after every booking: only a's digest can tell it a's load.
    let b = start_with(&url, "b", |_| String::new());
    register(&b);
    b.wait("a's whole view, from a's digest in parts", |_| {
        all_loads(&b.server) == want
    });
    Waiting::new("the same checksum", BOUND)
        .every(Duration::from_millis(25))
        .until_ok(|| {
            let (x, y) = (
                a.replication()["checksum"].clone(),
                b.replication()["checksum"].clone(),
            );
            if x == y {
                Ok(())
            } else {
                Err(format!("{x} and {y}"))
            }
        });
    assert_eq!(b.metric("kvhint_replication_decode_errors_total"), 0.0);
    assert_eq!(
        a.metric("kvhint_replication_messages_total{direction=\"publish_failed\"}"),
        0.0
    );
}
