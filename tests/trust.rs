//! The trust boundary of `kvhint serve`, attacked as the issue's attacker did:
//! callers without tokens, pages of other sites, rebound host names, slow and
//! idle connections, oversized ids and bodies, bookings never released, and
//! request ids that try to forge log lines. Each test runs the real binary on
//! 127.0.0.1 and bounds every wait.

use kvhint_e2e::http::metric;
use kvhint_e2e::process::{wait_or_kill, LineReader};
use kvhint_e2e::wait::Waiting;
use kvhint_e2e::{kvhint_bin, private_dir, Server, TempDir};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const ADMIN: &str = "admin-7d1f0c2b9a8e4f6d5c3b";
const WORKER: &str = "worker-3e5a7c9b1d2f4e6a8c0b";
const CLIENT: &str = "client-9b8a7c6d5e4f3a2b1c0d";

const ROLES: &str = "worker_selection:\n  decode:\n    type: dynamo-default-cost-fn\n";

/// A private directory with `config.yaml` (`yaml` + a decode role), and the
/// three token files when `auth` is wanted.
fn setup(yaml: &str, auth: bool) -> (TempDir, PathBuf) {
    let dir = private_dir();
    let mut text = String::from(yaml);
    if auth {
        for (name, token) in [("admin", ADMIN), ("worker", WORKER), ("client", CLIENT)] {
            write_token(&dir.path().join(format!("{name}.token")), token);
        }
        text.push_str("auth:\n  admin_token_file: admin.token\n  worker_token_file: worker.token\n  client_token_file: client.token\n");
    }
    text.push_str(ROLES);
    let config = dir.path().join("config.yaml");
    std::fs::write(&config, text).unwrap();
    (dir, config)
}

fn write_token(path: &Path, text: &str) {
    std::fs::write(path, format!("{text}\n")).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
}

/// One request with optional bearer token and extra headers: (status, body,
/// `WWW-Authenticate`).
fn call(
    server: &Server,
    method: &str,
    path: &str,
    token: Option<&str>,
    headers: &[(&str, &str)],
    body: Option<&Value>,
) -> (u16, Value, Option<String>) {
    let url = format!("{}{path}", server.base);
    let mut request = ureq::http::Request::builder().method(method).uri(&url);
    if let Some(token) = token {
        request = request.header("authorization", format!("Bearer {token}"));
    }
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let mut response = match body {
        Some(body) => server
            .agent
            .run(
                request
                    .header("content-type", "application/json")
                    .body(body.to_string())
                    .unwrap(),
            )
            .unwrap(),
        None => server.agent.run(request.body(()).unwrap()).unwrap(),
    };
    let status = response.status().as_u16();
    let challenge = response
        .headers()
        .get("www-authenticate")
        .map(|v| v.to_str().unwrap_or("").to_string());
    let text = response.body_mut().read_to_string().unwrap_or_default();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
        challenge,
    )
}

fn worker_body(id: u64) -> Value {
    json!({"worker_id": id, "role": "decode", "runtime_data": {}})
}

fn book_body(id: &str) -> Value {
    json!({"request_id": id, "role": "decode", "token_ids": [1, 2, 3, 4]})
}

fn status_with(server: &Server, token: &str) -> Value {
    call(server, "GET", "/admin/status", Some(token), &[], None).1
}

#[test]
fn without_a_token_no_caller_can_register_book_deregister_or_reload() {
    let (dir, config) = setup("", true);
    let server = Server::start(&config, &[], dir.path());
    let attempts: [(&str, &str, Option<Value>); 6] = [
        ("POST", "/workers", Some(worker_body(66))),
        (
            "POST",
            "/kv_events",
            Some(json!({"worker_id": 66, "event": "cleared"})),
        ),
        ("POST", "/book", Some(book_body("r"))),
        ("POST", "/release", Some(json!({"request_id": "r"}))),
        ("DELETE", "/workers/1", None),
        ("POST", "/admin/reload", None),
    ];
    for (method, path, body) in &attempts {
        for token in [None, Some("not-a-token-of-this-router")] {
            let (status, body, challenge) = call(&server, method, path, token, &[], body.as_ref());
            assert_eq!(status, 401, "{method} {path} with {token:?}: {body}");
            assert_eq!(body["error"], "unauthorized", "{body}");
            assert!(
                body["detail"]
                    .as_str()
                    .unwrap()
                    .contains("Authorization: Bearer"),
                "{body}"
            );
            assert_eq!(challenge.as_deref(), Some("Bearer realm=\"kvhint\""));
        }
    }
    // Nothing changed: no worker, no reload, no booking.
    let status = status_with(&server, ADMIN);
    assert_eq!(status["workers"], json!([]), "{status}");
    assert_eq!(status["generation"], 1, "{status}");
    assert_eq!(status["reloads"]["ok"], 0, "{status}");
    assert_eq!(status["auth"], true, "{status}");
    // Health and metrics stay open, for probes and scrapers.
    assert_eq!(server.get("/healthz").0, 200);
    assert!(metric(&server, "kvhint_api_errors_total{error=\"unauthorized\"}") >= 12.0);
}

/// A request and the status it must get: method, path, token, extra headers, body.
type Step<'a> = (
    &'a str,
    &'a str,
    Option<&'a str>,
    Vec<(&'a str, &'a str)>,
    Option<Value>,
    u16,
);

#[test]
fn each_caller_class_is_admitted_where_it_belongs_and_the_admin_everywhere() {
    let (dir, config) = setup("", true);
    let server = Server::start(&config, &[], dir.path());
    let bearer_lower = format!("bearer {CLIENT}");
    // In order: refusals first (nothing they try may change anything), then
    // each class where it belongs, then the admin everywhere.
    let steps: Vec<Step> = vec![
        // A client token cannot register a rogue worker or act as an admin.
        (
            "POST",
            "/workers",
            Some(CLIENT),
            vec![],
            Some(worker_body(66)),
            401,
        ),
        ("DELETE", "/workers/1", Some(CLIENT), vec![], None, 401),
        ("POST", "/admin/reload", Some(CLIENT), vec![], None, 401),
        ("GET", "/admin/status", Some(CLIENT), vec![], None, 401),
        // A worker token cannot book, deregister or reload.
        (
            "POST",
            "/book",
            Some(WORKER),
            vec![],
            Some(book_body("w")),
            401,
        ),
        ("DELETE", "/workers/1", Some(WORKER), vec![], None, 401),
        ("POST", "/admin/reload", Some(WORKER), vec![], None, 401),
        (
            "POST",
            "/workers",
            Some(WORKER),
            vec![],
            Some(worker_body(1)),
            201,
        ),
        (
            "POST",
            "/book",
            Some(CLIENT),
            vec![],
            Some(book_body("c1")),
            200,
        ),
        (
            "POST",
            "/release",
            Some(CLIENT),
            vec![],
            Some(json!({"request_id": "c1"})),
            200,
        ),
        // The scheme is case-insensitive, as RFC 9110 says.
        (
            "POST",
            "/book",
            None,
            vec![("authorization", bearer_lower.as_str())],
            Some(book_body("c2")),
            200,
        ),
        // The admin token works everywhere.
        (
            "POST",
            "/workers",
            Some(ADMIN),
            vec![],
            Some(worker_body(2)),
            201,
        ),
        ("POST", "/admin/reload", Some(ADMIN), vec![], None, 200),
        ("DELETE", "/workers/2", Some(ADMIN), vec![], None, 200),
    ];
    for (method, path, token, headers, body, expected) in &steps {
        let (status, answer, _) = call(&server, method, path, *token, headers, body.as_ref());
        assert_eq!(
            status, *expected,
            "{method} {path} with {token:?}: {answer}"
        );
    }
}

#[test]
fn token_files_are_read_again_on_reload_and_tokens_never_reach_the_log() {
    let (dir, config) = setup("", true);
    let server = Server::start(&config, &[], dir.path());
    let (status, _, _) = call(
        &server,
        "POST",
        "/workers",
        Some(WORKER),
        &[],
        Some(&worker_body(1)),
    );
    assert_eq!(status, 201);
    // Rotate the client token: the new one in, the old one out, then reload.
    let rotated = "client-rotated-5f4e3d2c1b0a9";
    write_token(&dir.path().join("client.token"), rotated);
    let (status, body, _) = call(&server, "POST", "/admin/reload", Some(ADMIN), &[], None);
    assert_eq!(status, 200, "{body}");
    let (status, _, _) = call(
        &server,
        "POST",
        "/book",
        Some(CLIENT),
        &[],
        Some(&book_body("old")),
    );
    assert_eq!(
        status, 401,
        "the old client token is refused after the reload"
    );
    let (status, body, _) = call(
        &server,
        "POST",
        "/book",
        Some(rotated),
        &[],
        Some(&book_body("new")),
    );
    assert_eq!(status, 200, "{body}");
    // A token file made readable by others fails the reload, and the tokens
    // in force stay in force.
    std::fs::set_permissions(
        dir.path().join("client.token"),
        std::fs::Permissions::from_mode(0o644),
    )
    .unwrap();
    let (status, body, _) = call(&server, "POST", "/admin/reload", Some(ADMIN), &[], None);
    assert_eq!(status, 422, "{body}");
    let detail = body["detail"].as_str().unwrap();
    assert!(
        detail.contains("client.token") && detail.contains("chmod 600"),
        "{detail}"
    );
    assert!(detail.contains("auth.client_token_file"), "{detail}");
    let (status, _, _) = call(
        &server,
        "POST",
        "/book",
        Some(rotated),
        &[],
        Some(&book_body("still")),
    );
    assert_eq!(status, 200);
    let log = server.log();
    for token in [ADMIN, WORKER, CLIENT, rotated] {
        assert!(!log.contains(token), "a token reached the log:\n{log}");
        assert!(!detail.contains(token));
    }
    // And there is no way to pass one on the command line, where `ps` shows it.
    let help = Command::new(kvhint_bin())
        .args(["serve", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout).to_lowercase();
    assert!(
        !help.contains("--token") && !help.contains("--admin-token"),
        "{help}"
    );
}

/// Starts `kvhint serve` with `args`, returning its exit status and output if it
/// exits within a few seconds, or `None` (and the child) if it is serving.
fn start_raw(
    config: &Path,
    args: &[&str],
) -> (
    Option<std::process::ExitStatus>,
    String,
    std::process::Child,
) {
    let mut child = Command::new(kvhint_bin())
        .arg("serve")
        .arg("--config")
        .arg(config)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let bound = Duration::from_secs(30);
    let stdout = LineReader::new(child.stdout.take().unwrap());
    let line = stdout.line(bound).unwrap_or_default();
    if line.starts_with("listening on ") {
        return (None, line, child);
    }
    let stderr = LineReader::new(child.stderr.take().unwrap());
    let status = wait_or_kill(&mut child, bound)
        .unwrap_or_else(|| panic!("serve neither listened nor exited within {bound:?}"));
    (Some(status), stderr.rest(bound), child)
}

#[test]
fn a_non_loopback_listen_without_auth_refuses_to_start_unless_allowed_and_then_warns() {
    let (_dir, config) = setup("", false);
    let (status, err, _) = start_raw(&config, &["--listen", "0.0.0.0:0"]);
    let status = status.expect("serve must not start");
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(
        err.contains("0.0.0.0:0")
            && err.contains("auth")
            && err.contains("--allow-unauthenticated"),
        "{err}"
    );

    let (status, line, mut child) = start_raw(
        &config,
        &["--listen", "0.0.0.0:0", "--allow-unauthenticated"],
    );
    assert!(status.is_none(), "serve started: {line}");
    let _ = child.kill();
    let _ = child.wait();
    let err = LineReader::new(child.stderr.take().unwrap()).rest(Duration::from_secs(10));
    assert!(err.contains("serving without authentication"), "{err}");

    // With auth, a non-loopback address needs no flag.
    let (dir, config) = setup("", true);
    let (status, line, mut child) = start_raw(&config, &["--listen", "0.0.0.0:0"]);
    assert!(status.is_none(), "serve started with auth: {line}");
    // And a reload may not take auth away while exposed.
    let address = line
        .trim()
        .trim_start_matches("listening on ")
        .replace("0.0.0.0", "127.0.0.1");
    let text = std::fs::read_to_string(&config).unwrap();
    let without_auth: String = text
        .lines()
        .filter(|l| !l.starts_with("auth:") && !l.contains("_token_file"))
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(&config, without_auth).unwrap();
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .new_agent();
    let mut response = agent
        .post(&format!("http://{address}/admin/reload"))
        .header("authorization", format!("Bearer {ADMIN}"))
        .send_empty()
        .unwrap();
    let body = response.body_mut().read_to_string().unwrap();
    assert_eq!(response.status().as_u16(), 422, "{body}");
    assert!(body.contains("no longer has `auth`"), "{body}");
    let _ = child.kill();
    let _ = child.wait();
    drop(dir);
}

#[test]
fn without_auth_a_rebound_host_name_is_refused() {
    let (dir, config) = setup("", false);
    let server = Server::start(&config, &[], dir.path());
    let port = server.address().rsplit(':').next().unwrap().to_string();
    let rebound = format!("attacker.example:{port}");
    let (status, body, _) = call(
        &server,
        "GET",
        "/admin/status",
        None,
        &[("host", &rebound)],
        None,
    );
    assert_eq!(status, 403, "{body}");
    assert_eq!(body["error"], "forbidden_host", "{body}");
    let (status, body, _) = call(
        &server,
        "POST",
        "/workers",
        None,
        &[("host", &rebound)],
        Some(&worker_body(66)),
    );
    assert_eq!(status, 403, "{body}");
    // Loopback names are fine.
    for host in [format!("localhost:{port}"), format!("127.0.0.1:{port}")] {
        let (status, body, _) = call(&server, "GET", "/healthz", None, &[("host", &host)], None);
        assert_eq!(status, 200, "{host}: {body}");
    }
    assert_eq!(server.status()["workers"], json!([]));
}

#[test]
fn without_auth_a_cross_site_form_post_is_refused() {
    let (dir, config) = setup("", false);
    let server = Server::start(&config, &[], dir.path());
    // What a page on another site submits: a simple form post, no preflight.
    let mut response = server
        .agent
        .post(&format!("{}/workers", server.base))
        .header("content-type", "application/x-www-form-urlencoded")
        .header("origin", "https://attacker.example")
        .send(worker_body(66).to_string())
        .unwrap();
    let body = response.body_mut().read_to_string().unwrap();
    assert_eq!(response.status().as_u16(), 403, "{body}");
    assert!(body.contains("cross_origin_refused"), "{body}");
    let (status, body, _) = call(
        &server,
        "POST",
        "/admin/reload",
        None,
        &[("origin", "null")],
        None,
    );
    assert_eq!(status, 403, "{body}");
    assert_eq!(server.status()["workers"], json!([]));
    assert_eq!(server.status()["reloads"]["ok"], 0);
    // The same post from the operator's shell (no Origin) works.
    let (status, body) = server.post_raw(
        "/workers",
        "application/x-www-form-urlencoded",
        &worker_body(1).to_string(),
    );
    assert_eq!(status, 201, "{body}");
}

/// Reads until the server closes the connection (or `limit` passes); returns
/// what it sent and whether it closed.
fn read_until_closed(stream: &mut TcpStream, limit: Duration) -> (String, bool) {
    stream
        .set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let deadline = Instant::now() + limit;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while Instant::now() < deadline {
        match stream.read(&mut buf) {
            Ok(0) => return (String::from_utf8_lossy(&got).into_owned(), true),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return (String::from_utf8_lossy(&got).into_owned(), true),
        }
    }
    (String::from_utf8_lossy(&got).into_owned(), false)
}

const FAST: &[&str] = &[
    "--header-timeout-ms",
    "400",
    "--body-timeout-ms",
    "400",
    "--idle-timeout-ms",
    "600",
];

#[test]
fn a_half_sent_header_is_closed_after_the_header_timeout() {
    let (dir, config) = setup("", false);
    let server = Server::start(&config, FAST, dir.path());
    let mut stream = TcpStream::connect(server.address()).unwrap();
    stream
        .write_all(b"POST /book HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty")
        .unwrap();
    let (_, closed) = read_until_closed(&mut stream, Duration::from_secs(15));
    assert!(closed, "a half-sent head is not kept forever");
    assert!(
        metric(
            &server,
            "kvhint_connection_timeouts_total{phase=\"header\"}"
        ) >= 1.0
    );
}

#[test]
fn a_header_dripped_a_byte_at_a_time_is_closed_before_it_completes() {
    let (dir, config) = setup("", false);
    let server = Server::start(&config, FAST, dir.path());
    let mut stream = TcpStream::connect(server.address()).unwrap();
    let head = format!(
        "GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: {}\r\n\r\n",
        "a".repeat(200)
    );
    let mut sent = 0;
    let mut closed = false;
    // A byte every 50 ms keeps every read busy, but the head as a whole has 400 ms.
    for byte in head.as_bytes() {
        if stream.write_all(std::slice::from_ref(byte)).is_err() {
            closed = true;
            break;
        }
        sent += 1;
        std::thread::sleep(Duration::from_millis(50));
    }
    if !closed {
        closed = read_until_closed(&mut stream, Duration::from_secs(2)).1;
    }
    assert!(
        closed && sent < head.len(),
        "closed after {sent} of {} bytes",
        head.len()
    );
}

#[test]
fn a_half_sent_body_gets_408_after_the_body_timeout() {
    let (dir, config) = setup("", false);
    let server = Server::start(&config, FAST, dir.path());
    let mut stream = TcpStream::connect(server.address()).unwrap();
    stream
        .write_all(b"POST /book HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"request_id\"")
        .unwrap();
    let (answer, _) = read_until_closed(&mut stream, Duration::from_secs(15));
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("body_timeout"), "{answer}");
}

#[test]
fn an_idle_keep_alive_connection_is_closed_after_the_idle_timeout() {
    let (dir, config) = setup("", false);
    let server = Server::start(&config, FAST, dir.path());
    let mut stream = TcpStream::connect(server.address()).unwrap();
    stream
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        .unwrap();
    let (answer, closed) = read_until_closed(&mut stream, Duration::from_secs(15));
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(closed, "an idle keep-alive connection is closed");
    assert!(metric(&server, "kvhint_connection_timeouts_total{phase=\"idle\"}") >= 1.0);
}

#[test]
fn slow_connections_beyond_the_file_limit_do_not_lock_new_clients_out() {
    // The attack: 256 file descriptors, 300 connections that each send half a
    // head. Before, every new client was locked out for good.
    let (dir, config) = setup("", false);
    let mut shell = Command::new("sh");
    shell
        .arg("-c")
        .arg("ulimit -n 256 && exec \"$0\" \"$@\"")
        .arg(kvhint_bin());
    let server = Server::start_command(shell, &config, FAST, dir.path());
    let mut slow = Vec::new();
    for _ in 0..300 {
        if let Ok(mut stream) = TcpStream::connect(server.address()) {
            let _ = stream.write_all(b"POST /book HTTP/1.1\r\nHost: 127.0.0.1\r\n");
            slow.push(stream);
        }
    }
    // A new client is served once the deadlines have cleared the slow ones.
    Waiting::new("a new client to be served", Duration::from_secs(30))
        .every(Duration::ZERO)
        .report(|| format!("a new client was locked out\n{}", server.log()))
        .until(|| {
            server
                .agent
                .get(format!("{}/healthz", server.base))
                .call()
                .is_ok_and(|r| r.status().as_u16() == 200)
                .then_some(())
        });
    assert!(
        server.log().contains("lowered"),
        "the cap was lowered to the file limit:\n{}",
        server.log()
    );
    // Lowered with room for both sides of each proxied connection: its own
    // socket and the one to the worker.
    let log = server.log();
    let field = |name: &str| -> u64 {
        log.lines()
            .find(|l| l.contains("--max-connections is more than"))
            .and_then(|l| l.split_whitespace().find_map(|w| w.strip_prefix(name)))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in the warning:\n{log}"))
    };
    let (cap, sources) = (field("now="), field("kept_for_kv_event_sources="));
    assert!(
        64 + sources + 2 * cap <= 256,
        "cap {cap}, {sources} kept for sources: no room for the upstream sockets\n{log}"
    );
}

#[test]
fn json_media_types_are_parsed_not_prefix_matched() {
    let (dir, config) = setup("", false);
    let server = Server::start(&config, &[], dir.path());
    let (status, body) =
        server.post_raw("/workers", "APPLICATION/JSON", &worker_body(1).to_string());
    assert_eq!(status, 201, "{body}");
    let (status, body) = server.post_raw(
        "/workers",
        "application/json; charset=UTF-8",
        &worker_body(2).to_string(),
    );
    assert_eq!(status, 201, "{body}");
    let (status, body) = server.post_raw(
        "/workers",
        "application/jsonfoo",
        &worker_body(3).to_string(),
    );
    assert_eq!(status, 415, "{body}");
    assert_eq!(body["error"], "unsupported_media_type");
    assert_eq!(server.status()["workers"].as_array().unwrap().len(), 2);
}

#[test]
fn expect_100_continue_with_an_oversized_body_gets_413_at_once() {
    let (dir, config) = setup("", false);
    let server = Server::start(&config, &["--max-body-bytes", "1024"], dir.path());
    let mut stream = TcpStream::connect(server.address()).unwrap();
    stream
        .write_all(b"POST /book HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 1073741824\r\nExpect: 100-continue\r\n\r\n")
        .unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut first = [0u8; 12];
    stream.read_exact(&mut first).unwrap();
    assert_eq!(
        &first,
        b"HTTP/1.1 413",
        "{}",
        String::from_utf8_lossy(&first)
    );
}

#[test]
fn a_request_id_over_the_cap_is_refused_before_it_is_kept() {
    let (dir, config) = setup("router: {max_request_id_bytes: 64}\n", false);
    let server = Server::start(&config, &[], dir.path());
    assert_eq!(server.post("/workers", &worker_body(1)).0, 201);
    let (status, body) = server.post("/book", &book_body(&"x".repeat(65)));
    assert_eq!(status, 422, "{body}");
    assert_eq!(body["error"], "request_id_too_long", "{body}");
    assert!(body["detail"]
        .as_str()
        .unwrap()
        .contains("router.max_request_id_bytes"));
    assert_eq!(server.status()["open_bookings"], 0);
    let (status, body) = server.post("/book", &book_body(&"x".repeat(64)));
    assert_eq!(status, 200, "{body}");
}

#[test]
fn open_bookings_are_capped_and_a_release_makes_room() {
    let (dir, config) = setup("router: {max_open_bookings: 3}\n", false);
    let server = Server::start(&config, &[], dir.path());
    assert_eq!(server.post("/workers", &worker_body(1)).0, 201);
    for i in 0..3 {
        assert_eq!(server.post("/book", &book_body(&format!("r{i}"))).0, 200);
    }
    let (status, body) = server.post("/book", &book_body("r3"));
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"], "too_many_open_bookings", "{body}");
    assert_eq!(server.status()["open_bookings"], 3);
    assert_eq!(server.post("/release", &json!({"request_id": "r0"})).0, 200);
    assert_eq!(server.post("/book", &book_body("r3")).0, 200);
}

#[test]
fn bookings_never_released_expire_after_the_ttl_and_give_their_load_back() {
    let (dir, config) = setup("router: {booking_ttl: 1s}\n", false);
    let server = Server::start(&config, &[], dir.path());
    assert_eq!(server.post("/workers", &worker_body(1)).0, 201);
    assert_eq!(server.post("/book", &book_body("crashed-client")).0, 200);
    let status = server.status();
    assert_eq!(status["booking_ttl_s"], 1, "{status}");
    assert_eq!(
        status["workers"][0]["load"]["active_requests"], 1,
        "{status}"
    );
    server.wait_for("the booking to expire", |s| {
        s.status()["open_bookings"] == 0
    });
    let status = server.status();
    assert_eq!(status["expired_bookings"], 1, "{status}");
    assert_eq!(
        status["workers"][0]["load"]["active_requests"], 0,
        "{status}"
    );
    assert_eq!(status["workers"][0]["load"]["active_blocks"], 0, "{status}");
    assert_eq!(metric(&server, "kvhint_bookings_expired_total"), 1.0);
    let (status, body) = server.post("/release", &json!({"request_id": "crashed-client"}));
    assert_eq!(status, 404, "{body}");
    assert!(
        body["detail"]
            .as_str()
            .unwrap()
            .contains("router.booking_ttl"),
        "{body}"
    );
    assert!(server.log().contains("router.booking_ttl"));
}

#[test]
fn a_request_id_with_a_newline_cannot_forge_a_log_line() {
    let fixture = kvhint_e2e::config_file(
        "plugins:\n  files: ['{so:fixture_misbehaving}']\n  cache_dir: ./cache\nrouter: {block_size: 4}\nworker_selection:\n  decode:\n    type: dynamo-default-cost-fn\n    hints: [{type: logs}]\n",
    );
    let forged = "2026-12-01T00:00:00.000000Z ERROR kvhint: reload failed; FORGED";
    let records = [
        kvhint_e2e::trace::worker(1, 0, "decode", true, "decode"),
        kvhint_e2e::trace::request(
            &format!("req\n{forged}\r\u{1b}[2K"),
            "decode",
            &kvhint_e2e::trace::tokens(1, 8),
        ),
    ];
    let trace_path = fixture.dir.path().join("trace.jsonl");
    let text: String = records.iter().map(|r| format!("{r}\n")).collect();
    std::fs::write(&trace_path, text).unwrap();
    let output = Command::new(kvhint_bin())
        .args(["replay", "--config"])
        .arg(&fixture.path)
        .arg("--trace")
        .arg(&trace_path)
        .env("KVHINT_LOG", "warn")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("fixture log line"),
        "the plugin logged:\n{stderr}"
    );
    assert!(
        stderr.contains("req\\n2026-12-01"),
        "the newline is escaped:\n{stderr}"
    );
    assert!(
        !stderr.contains('\u{1b}') || !stderr.contains("\u{1b}[2K"),
        "no terminal escape passes:\n{stderr:?}"
    );
    for line in stderr.lines() {
        assert!(
            !line.starts_with("2026-12-01T00:00:00.000000Z"),
            "a forged line:\n{stderr}"
        );
    }
}

fn check(config: &Path) -> (bool, String) {
    let output = Command::new(kvhint_bin())
        .args(["check", "--config"])
        .arg(config)
        .output()
        .unwrap();
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[test]
fn auth_and_limit_mistakes_are_located_and_check_reads_the_token_files() {
    let (dir, config) = setup("", true);
    let file = config.display().to_string();
    let output = Command::new(kvhint_bin())
        .args(["check", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains("auth: admin 1 token, worker 1 token, client 1 token"),
        "{stdout}"
    );
    // An unsafe token file fails `check` as it would fail `serve`, at its key.
    std::fs::set_permissions(
        dir.path().join("worker.token"),
        std::fs::Permissions::from_mode(0o640),
    )
    .unwrap();
    let (ok, err) = check(&config);
    assert!(!ok);
    assert!(
        err.contains(&format!("{file}:3:22: auth.worker_token_file: ")),
        "{err}"
    );
    assert!(
        err.contains("worker.token: may be read by other users (mode 0640); run `chmod 600"),
        "{err}"
    );
    std::fs::remove_file(dir.path().join("worker.token")).unwrap();
    let (_, err) = check(&config);
    assert!(
        err.contains(
            "there is no such token file; make one with `(umask 077; openssl rand -hex 32 >"
        ),
        "{err}"
    );

    let cases = [
        ("auth:\n  worker_token_file: w.token\n", "2:3: auth: `auth` needs `admin_token_file`"),
        ("auth:\n  admin_token_fil: a.token\n", "auth.admin_token_fil: unknown key `admin_token_fil` (did you mean `admin_token_file`?)"),
        ("router:\n  booking_ttl: 10d\n", "2:16: router.booking_ttl: expected a duration: whole seconds (`600`) or a number with a unit (`90s`, `10m`, `2h`); 0 turns it off, found `10d`"),
        ("router:\n  booking_ttl: 9000h\n", "router.booking_ttl: `9000h` is longer than the most this accepts"),
        ("router:\n  max_request_id_bytes: 0\n", "router.max_request_id_bytes: expected a whole number from 1 to 65536, found `0`"),
        ("router:\n  max_open_bookings: lots\n", "router.max_open_bookings: expected a whole number from 1 to 67108864, found `lots`"),
    ];
    for (yaml, expected) in cases {
        let (dir, config) = setup(yaml, false);
        let (ok, err) = check(&config);
        assert!(!ok, "{yaml}");
        assert!(err.contains(expected), "{yaml}\n{err}");
        drop(dir);
    }
}

/// Issue 28, item 3: token files got only a mode check, so one another user owns
/// (mode 600), or one in a directory others can write, was taken: that user chose
/// the tokens at the next reload. They get the loader's StrictModes walk.
#[test]
fn a_token_file_another_user_owns_or_in_a_directory_others_can_write_is_refused() {
    // Owned by another user (only root can make one here).
    // SAFETY: `geteuid` takes no arguments, touches no memory of ours and
    // cannot fail (POSIX).
    if unsafe { libc::geteuid() } == 0 {
        let (dir, config) = setup("", true);
        let token = dir.path().join("worker.token");
        std::os::unix::fs::chown(&token, Some(65534), Some(65534)).unwrap();
        let (ok, err) = check(&config);
        assert!(!ok, "{err}");
        assert!(err.contains(":3:22: auth.worker_token_file: "), "{err}");
        assert!(
            err.contains(
                "is owned by uid 65534, not by the router's user (uid 0) or root; run `chown 0"
            ),
            "{err}"
        );
    }
    // In a directory others can write (the token file itself is 600 and ours).
    let (dir, config) = setup("", true);
    let open = dir.path().join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    write_token(
        &open.join("admin.token"),
        "admin-other-dir-0123456789abcdef",
    );
    let text = std::fs::read_to_string(&config).unwrap().replace(
        "admin_token_file: admin.token",
        "admin_token_file: open/admin.token",
    );
    std::fs::write(&config, text).unwrap();
    let (ok, err) = check(&config);
    assert!(!ok, "{err}");
    assert!(err.contains(":2:21: auth.admin_token_file: "), "{err}");
    assert!(
        err.contains("is writable by group or others (mode 0777")
            && err.contains("another user could choose the router's API tokens; run `chmod go-w"),
        "{err}"
    );
    // A symlink to it from a safe directory is followed, and refused the same.
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o755)).unwrap();
    let (ok, err) = check(&config);
    assert!(ok, "{err}");
    let ancestor = dir.path().join("group-writable");
    std::fs::create_dir(&ancestor).unwrap();
    std::fs::set_permissions(&ancestor, std::fs::Permissions::from_mode(0o775)).unwrap();
    std::fs::rename(&open, ancestor.join("open")).unwrap();
    std::os::unix::fs::symlink(ancestor.join("open"), &open).unwrap();
    let (ok, err) = check(&config);
    assert!(!ok, "{err}");
    assert!(
        err.contains("group-writable is writable by group or others (mode 0775"),
        "{err}"
    );
}

/// Issue 28, item 7: without auth only the first `Host` was checked, and an
/// absolute-form target naming another host passed. A second `Host` is 400; the
/// target's authority is checked; every `Origin` is.
#[test]
fn without_auth_a_second_host_or_an_absolute_target_naming_another_host_is_refused() {
    let (dir, config) = setup("", false);
    let server = Server::start(&config, &[], dir.path());
    let raw = |head: &str, body: &str| {
        let mut stream = TcpStream::connect(server.address()).unwrap();
        let request = format!(
            "{head}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(request.as_bytes()).unwrap();
        let (answer, _) = read_until_closed(&mut stream, Duration::from_secs(10));
        answer
    };
    let body = worker_body(66).to_string();
    let attacks = [
        (
            "POST /workers HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: evil.example",
            "HTTP/1.1 400",
            "duplicate_host",
        ),
        (
            "POST /workers HTTP/1.1\r\nHost: evil.example\r\nHost: 127.0.0.1",
            "HTTP/1.1 400",
            "duplicate_host",
        ),
        (
            "POST http://evil.example/workers HTTP/1.1\r\nHost: 127.0.0.1",
            "HTTP/1.1 403",
            "forbidden_host",
        ),
        (
            "POST http://evil.example:80/workers HTTP/1.1\r\nHost: localhost",
            "HTTP/1.1 403",
            "forbidden_host",
        ),
        (
            "POST /workers HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: http://localhost\r\nOrigin: https://evil.example",
            "HTTP/1.1 403",
            "cross_origin_refused",
        ),
    ];
    for (head, status, code) in attacks {
        let answer = raw(head, &body);
        assert!(answer.starts_with(status), "{head}\n{answer}");
        assert!(answer.contains(code), "{head}\n{answer}");
    }
    assert_eq!(server.status()["workers"], json!([]));
    // An absolute-form target naming loopback is served.
    let answer = raw(
        "POST http://127.0.0.1/workers HTTP/1.1\r\nHost: 127.0.0.1",
        &body,
    );
    assert!(answer.starts_with("HTTP/1.1 201"), "{answer}");
}

/// Issue 28, item 4: a worker token could delete files: a source with
/// `"bind": true` on `ipc://PATH` made libzmq unlink PATH. A bound path must not
/// exist (or be a socket the router bound) and sit in a directory only the
/// router's user can write; otherwise 400 naming the field. Sources are capped
/// (`kv_events.max_sources`), and their descriptors kept out of the connection
/// budget: about 400 unreachable sources used to exhaust 1,024 descriptors.
#[test]
fn a_worker_token_cannot_make_the_router_delete_a_file_and_sources_are_capped() {
    let (dir, config) = setup("kv_events:\n  max_sources: 4\n", true);
    let mut shell = Command::new("sh");
    shell
        .arg("-c")
        .arg("ulimit -n 256 && exec \"$0\" \"$@\"")
        .arg(kvhint_bin());
    let server = Server::start_command(shell, &config, &[], dir.path());
    let register = |id: u64, source: Value| {
        let body =
            json!({"worker_id": id, "role": "decode", "runtime_data": {}, "kv_events": source});
        call(&server, "POST", "/workers", Some(WORKER), &[], Some(&body))
    };
    let victim = dir.path().join("victim.txt");
    std::fs::write(&victim, "precious").unwrap();
    let open_dir = dir.path().join("open");
    std::fs::create_dir(&open_dir).unwrap();
    std::fs::set_permissions(&open_dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let refused = [
        (
            format!("ipc://{}", victim.display()),
            "names an existing file; binding it would delete it",
        ),
        (
            format!("ipc://{}", dir.path().display()),
            "names an existing directory",
        ),
        (
            "ipc://relative.sock".to_string(),
            "must name an absolute path",
        ),
        (
            format!("ipc://{}/kv.sock", open_dir.display()),
            "which is not a directory only the router's user (or root) can write",
        ),
    ];
    for (endpoint, why) in &refused {
        let (status, body, _) = register(1, json!({"endpoint": endpoint, "bind": true}));
        assert_eq!(status, 400, "{endpoint}: {body}");
        let detail = body["detail"].as_str().unwrap_or_default();
        assert!(detail.starts_with("kv_events.endpoint "), "{body}");
        assert!(detail.contains(why), "{endpoint}: {body}");
    }
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
    assert_eq!(status_with(&server, ADMIN)["workers"], json!([]));
    // A new path in a private directory is bound; registering again keeps it.
    let socket = format!("ipc://{}/kv.sock", dir.path().display());
    let (status, body, _) = register(1, json!({"endpoint": socket, "bind": true}));
    assert_eq!(status, 201, "{body}");
    let (status, body, _) = register(1, json!({"endpoint": socket, "bind": true}));
    assert_eq!(status, 200, "{body}");
    // Another worker cannot bind the same path and take the endpoint over.
    let (status, body, _) = register(9, json!({"endpoint": socket, "bind": true}));
    assert_eq!(status, 400, "{body}");
    let detail = body["detail"].as_str().unwrap_or_default();
    assert!(
        detail.contains("is bound already for worker 1 dp_rank 0"),
        "{body}"
    );
    // Up to the cap, sources are taken: 3 more (unreachable) engines, then 503.
    let mut taken = 1;
    let mut full = 0;
    for id in 2..=20 {
        let (status, body, _) = register(
            id,
            json!({"endpoint": format!("tcp://127.0.0.1:{}", 1000 + id)}),
        );
        match status {
            201 => taken += 1,
            503 => {
                assert_eq!(body["error"], "too_many_sources", "{body}");
                full += 1;
            }
            other => panic!("{other}: {body}"),
        }
    }
    assert_eq!((taken, full), (4, 16));
    // The connection cap leaves the sources' descriptors free, and counts two
    // per connection (its socket and the one to its worker): (256 - 64 - 4 × 10) / 2.
    assert!(server.log().contains("now=76"), "{}", server.log());
    // And a reload still works.
    let (status, body, _) = call(&server, "POST", "/admin/reload", Some(ADMIN), &[], None);
    assert_eq!(status, 200, "{body}");
}

/// Issue 44: the budget kept 4 descriptors a source where one takes about 8,
/// so 64 sources under `ulimit -n 1024` ran out below the connection cap.
/// Counted here: what 16 subscriptions hold, against what the budget keeps.
#[test]
fn each_kv_event_source_holds_no_more_descriptors_than_the_budget_keeps() {
    let (dir, config) = setup("kv_events:\n  max_sources: 32\n", false);
    let server = Server::start(&config, &[], dir.path());
    let fds = || {
        std::fs::read_dir(format!("/proc/{}/fd", server.child.id()))
            .unwrap()
            .count() as u64
    };
    let before = fds();
    // Engines that are not there: each subscription keeps trying.
    for id in 1..=16u64 {
        let body = json!({"worker_id": id, "role": "decode", "runtime_data": {},
            "kv_events": {"endpoint": format!("tcp://127.0.0.1:{}", 1000 + id)}});
        let (status, reply) = server.post("/workers", &body);
        assert_eq!(status, 201, "{reply}");
    }
    server.wait_for("16 sources connecting", |s| {
        s.status()["kv_event_sources"]
            .as_array()
            .map_or(0, |a| a.len())
            == 16
    });
    // Every subscription has made its sockets (6 each while connecting: the
    // SUB socket's and its monitor's mailboxes and libzmq's own); a reconnect
    // attempt in flight holds its TCP socket, the one a connected source keeps.
    Waiting::new("the subscriptions' sockets", Duration::from_secs(20))
        .until(|| (fds() - before >= 16 * 6).then_some(()));
    let per_source = (fds() - before) as f64 / 16.0;
    let kept = kvhint::engine_events::FDS_PER_SOURCE as f64;
    // A replay in flight holds 3 more (its DEALER socket's mailbox, its
    // connection, libzmq's reaper; measured with a publisher's replay socket
    // that never answers).
    assert!(
        per_source + 3.0 <= kept,
        "{per_source} descriptors a connecting source (with its connection), and 3 for a replay: the budget keeps {kept}"
    );
}

/// Issue 44, item 7: a prompt far over `max_prompt_tokens` was tokenized in full
/// (about 1 s per MB) before it was refused. Now tokenizing stops once the count
/// passes the bound: an 8 MiB prompt, as a completion and as a chat's message,
/// is refused with the router's `prompt_too_long` after about the bound's worth
/// of text is tokenized (the tokenizer's own count of the bytes it encoded, not
/// a timing); 8 MiB with no place to cut it (one word, CJK with no punctuation)
/// is refused with none of it tokenized; and token ids are counted without
/// tokenizing anything.
#[test]
fn a_prompt_far_over_max_prompt_tokens_is_refused_after_tokenizing_about_the_bound() {
    const MAX: usize = 4_096;
    let dir = private_dir();
    let config = dir.path().join("config.yaml");
    std::fs::write(
        &config,
        format!(
            "router:\n  max_prompt_tokens: {MAX}\nworker_selection:\n  aggregated: dynamo-default-cost-fn\n\
             models:\n  qwen3:\n    tokenizer: {}\n",
            kvhint_e2e::llamacpp::qwen3_tokenizer_dir().display()
        ),
    )
    .unwrap();
    let server = Server::start(&config, &["--max-body-bytes", "16777216"], dir.path());
    let tokenized = || {
        kvhint_e2e::http::metric_or_zero(
            &server,
            "kvhint_tokenizer_cache_text_bytes_total{model=\"qwen3\",result=\"miss\"}",
        )
    };
    // About 4 bytes a token; 8 MiB is some 2 million tokens.
    let sentence = "The quick brown fox jumps over the lazy dog, 1234 times; naïve café 東京。\n";
    let prompt = sentence.repeat((8 << 20) / sentence.len());
    // The bound's worth of this text and one part (8 KiB) of slack, doubled.
    let about_the_bound = 2.0 * (MAX as f64 * 5.0 + 8192.0);
    let requests = [
        (
            "/v1/completions",
            json!({"model": "qwen3", "prompt": prompt}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": "qwen3", "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": prompt},
            ]}),
        ),
        (
            "/v1/completions",
            json!({"model": "qwen3", "prompt": "a".repeat(8 << 20)}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": "qwen3", "messages": [
                {"role": "user", "content": "中文测试数据".repeat((8 << 20) / 18)},
            ]}),
        ),
        (
            "/v1/completions",
            json!({"model": "qwen3", "prompt": (0..=MAX as u32).collect::<Vec<_>>()}),
        ),
    ];
    for (i, (path, body)) in requests.iter().enumerate() {
        let before = tokenized();
        let (status, reply) = server.post(path, body);
        let spent = tokenized() - before;
        let ids = i == requests.len() - 1;
        if ids {
            // Token ids: counted, nothing tokenized.
            assert_eq!(spent, 0.0, "{path}: token ids were tokenized");
        } else {
            assert!(
                spent <= about_the_bound,
                "{path}: {spent} bytes of 8 MiB tokenized before the refusal"
            );
        }
        // The router's own refusal, saying what was wrong and what to do.
        assert_eq!(status, 400, "{path}: {reply}");
        let error = &reply["error"];
        assert_eq!(error["code"], "prompt_too_long", "{path}: {reply}");
        assert_eq!(error["param"], "prompt", "{path}: {reply}");
        let message = error["message"].as_str().unwrap();
        let counted = if ids {
            format!("has {} tokens", MAX + 1)
        } else {
            "has at least".to_string()
        };
        assert!(
            message.contains(&counted)
                && message.contains(&format!("at most {MAX} (router.max_prompt_tokens)"))
                && message.contains("shorten the prompt"),
            "{path}: {message}"
        );
    }
}

/// The count stops early only because Qwen3's long pieces are tokenized part by
/// part; the parts must give exactly the ids of the whole. Checked on the real
/// tokenizer: at every cut it allows in texts made of white-space runs, CJK and
/// its punctuation, combining marks, digits, contractions and emoji; and on
/// prompts and chats a few parts long, whose lengths sit around the part size,
/// with special tokens among them. And a stretch with no cut, bounded from below
/// before it is tokenized, is encoded at exactly its count and refused one under.
#[test]
fn qwen3_s_long_prompts_tokenized_part_by_part_get_the_ids_of_the_whole_text() {
    const FRAGMENTS: &[&str] = &[
        " ",
        "  ",
        "    ",
        "\t",
        "\n",
        "\n\n",
        "\r\n",
        " \n",
        "\u{a0}",
        "\u{3000}",
        "don't",
        "I'LL",
        "'s",
        "'",
        "x",
        "The quick brown fox",
        " jumps",
        "123456",
        "7",
        "٣٤٥",
        "中文测试",
        "数据",
        "，",
        "。",
        "、",
        "！",
        "é",
        "e\u{301}",
        "\u{301}",
        "ﬁne",
        "Ａ",
        "①",
        "Σσς",
        "🙂🙂",
        "...",
        "--",
        "(x)",
        "$5",
        "a.b",
        "<tag>",
        "x=1;",
        "\u{200b}",
        "<think>",
        "<|im_end|>",
        "<tool_call>",
        "<|im_",
    ];
    let tokenizer =
        kvhint::models::ModelTokenizer::load(kvhint_e2e::llamacpp::qwen3_tokenizer_dir(), 64 << 20)
            .unwrap();
    let cuts = tokenizer
        .cuts()
        .unwrap_or_else(|| panic!("Qwen3's pieces are not cut: {:?}", tokenizer.uncut()));
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state as usize
    };
    let mut text = |len: usize| -> String {
        (0..len)
            .map(|_| FRAGMENTS[next() % FRAGMENTS.len()])
            .collect()
    };
    let ids = |text: &str, special: bool| tokenizer.encode_uncached(text, special).unwrap();
    let mut allowed = 0;
    for _ in 0..150 {
        let text = text(10)
            .replace("<|im_end|>", "")
            .replace("<think>", "")
            .replace("<tool_call>", "");
        let whole = ids(&text, false);
        for q in (1..text.len()).filter(|&q| cuts.cuts_at(&text, q)) {
            allowed += 1;
            let mut joined = ids(&text[..q], false);
            joined.extend(ids(&text[q..], false));
            assert_eq!(joined, whole, "the cut {:?} | {:?}", &text[..q], &text[q..]);
        }
    }
    assert!(allowed > 300, "only {allowed} cuts tried");
    let part = kvhint::models::cuts::PART_BYTES;
    for size in [
        part - 1,
        part,
        part + 1,
        2 * part + 5,
        3 * part + 300,
        6 * part,
    ] {
        let mut prompt = text(size / 4);
        prompt.push_str(&" ".repeat(part / 3));
        prompt.push_str(&"z".repeat(part + 9));
        prompt.push_str(&text(size / 4));
        let mut end = size.min(prompt.len());
        while !prompt.is_char_boundary(end) {
            end -= 1;
        }
        prompt.truncate(end);
        let (ours, _) = tokenizer.encode_prompt(&prompt).unwrap();
        assert_eq!(
            ours,
            ids(&prompt, true),
            "a prompt of {} bytes",
            prompt.len()
        );
        let chat: kvhint::models::ChatRequest = serde_json::from_value(json!({"messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": prompt},
        ]}))
        .unwrap();
        let (ours, _) = tokenizer.encode_chat(&chat).unwrap();
        let rendered = tokenizer.render_chat(&chat).unwrap();
        assert_eq!(
            ours,
            ids(&rendered, false),
            "a chat of {} bytes",
            rendered.len()
        );
    }
    // At the bound exactly, and one token under it: stretches with no cut, long
    // enough to be bounded from below first (the bound must never refuse what
    // fits), alone and after a sentence and a special token.
    for stretch in [
        "a".repeat(40_000),
        "中文测试数据".repeat(8_000),
        " ".repeat(40_000),
        "!".repeat(40_000),
        format!(
            "The quick brown fox<|im_end|>{}<think> tail",
            "z".repeat(50_000)
        ),
    ] {
        let whole = ids(&stretch, true);
        let n = whole.len();
        let (ours, _) = tokenizer
            .encode_prompt_within(&stretch, n)
            .unwrap_or_else(|e| panic!("{} bytes at their {n} tokens: {e}", stretch.len()));
        assert_eq!(ours, whole, "{} bytes", stretch.len());
        assert!(
            matches!(
                tokenizer.encode_prompt_within(&stretch, n - 1),
                Err(kvhint::models::EncodeError::TooLong(_))
            ),
            "{} bytes, bound {}: not refused",
            stretch.len(),
            n - 1
        );
    }
}
