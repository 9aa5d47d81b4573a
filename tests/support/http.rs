//! The HTTP client side of the tests: a bounded agent, the router's API calls
//! every test makes the same way (register a worker, book, release, read a
//! metric), requests through the gateway (the booked worker from its header,
//! raw connections a test can cut, timed requests for the benches) and the
//! zero-leak load that cuts requests off at random points.
//!
//! Each call has a deadline (the agent's), and each API helper asserts the
//! status a well-formed call gets, so a test reads as its steps.

use crate::server::Server;
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// A client for the tests' HTTP calls: statuses are answers, not errors, and
/// every call has a deadline.
pub fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(30)))
        .build()
        .new_agent()
}

/// `GET url` (a failure to connect fails the test): the status and the body.
pub fn get(agent: &ureq::Agent, url: &str) -> (u16, String) {
    let mut response = agent
        .get(url)
        .call()
        .unwrap_or_else(|e| panic!("GET {url}: {e}"));
    let status = response.status().as_u16();
    let body = response
        .body_mut()
        .read_to_string()
        .unwrap_or_else(|e| panic!("GET {url}: reading the body: {e}"));
    (status, body)
}

/// `POST url` with a JSON body: the status and the body as JSON (a string if
/// it is not JSON).
pub fn post(agent: &ureq::Agent, url: &str, body: &Value) -> (u16, Value) {
    let mut response = agent
        .post(url)
        .header("content-type", "application/json")
        .send(body.to_string())
        .unwrap_or_else(|e| panic!("POST {url}: {e}"));
    let status = response.status().as_u16();
    let text = response
        .body_mut()
        .read_to_string()
        .unwrap_or_else(|e| panic!("POST {url}: reading the body: {e}"));
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

// ---------------------------------------------------------------- the API

/// The registration of a hint-capable decode worker `id` whose engine takes
/// hints at `tcp://10.0.<id / 256>.<id % 256>:23280` (rank 0).
pub fn decode_worker_body(id: u64) -> Value {
    json!({"worker_id": id, "role": "decode", "runtime_data": {
        "router_hint": true, "router_hint_worker_type": "decode",
        "router_hint_source_control_endpoints": {"0": format!("tcp://10.0.{}.{}:23280", id / 256, id % 256)}}})
}

/// `POST /workers` with `body`; the registration must be new (201).
pub fn register_worker(server: &Server, body: &Value) -> Value {
    let (status, reply) = server.post("/workers", body);
    assert_eq!(status, 201, "registering {body}: {reply}");
    reply
}

/// Registers [`decode_worker_body`]`(id)`.
pub fn register_decode_worker(server: &Server, id: u64) {
    register_worker(server, &decode_worker_body(id));
}

/// `POST /book` of `tokens` under `role` as request `id`; the booking (200).
pub fn book(server: &Server, id: &str, role: &str, tokens: &[u32]) -> Value {
    let (status, booking) = server.post(
        "/book",
        &json!({"request_id": id, "role": role, "token_ids": tokens}),
    );
    assert_eq!(status, 200, "booking {id}: {booking}");
    booking
}

/// `POST /release` of request `id` (200).
pub fn release(server: &Server, id: &str) {
    let (status, reply) = server.post("/release", &json!({"request_id": id}));
    assert_eq!(status, 200, "releasing {id}: {reply}");
}

/// Books `tokens` as a decode request `id` and releases it at once: the
/// booking, with nothing left open.
pub fn book_and_release(server: &Server, id: &str, tokens: &[u32]) -> Value {
    let booking = book(server, id, "decode", tokens);
    release(server, id);
    booking
}

/// `GET /metrics` (200): the Prometheus text.
pub fn metrics(server: &Server) -> String {
    let (status, text) = server.get("/metrics");
    assert_eq!(status, 200, "{text}");
    text
}

/// The value of the sample whose line starts with `name_and_labels` (a family
/// name with its labels, `kvhint_bookings_total{role="decode"}`); fails the
/// test, showing every metric, if there is none.
pub fn metric(server: &Server, name_and_labels: &str) -> f64 {
    let text = metrics(server);
    sample(&text, name_and_labels)
        .unwrap_or_else(|| panic!("no metric {name_and_labels} in\n{text}"))
}

/// Like [`metric`], 0 when the sample is absent (a labelled counter appears
/// only once it counted).
pub fn metric_or_zero(server: &Server, name_and_labels: &str) -> f64 {
    sample(&metrics(server), name_and_labels).unwrap_or(0.0)
}

/// The value of the first sample in `metrics` whose line starts with `prefix`.
pub fn sample(metrics: &str, prefix: &str) -> Option<f64> {
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(prefix)?.trim().parse().ok())
}

/// The sum of every sample in `metrics` whose line starts with `prefix` (all
/// the label sets of a family: `kvhint_bookings_total{`).
pub fn sum_of(metrics: &str, prefix: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

// ---------------------------------------------------------------- the gateway

/// The worker a gateway response names in `x-kvhint-worker` (`ID RANK`), if
/// it names one; a header that does not parse fails the test.
pub fn booked_worker(response: &ureq::http::Response<ureq::Body>) -> Option<u64> {
    let header = response.headers().get("x-kvhint-worker")?;
    let worker = header
        .to_str()
        .ok()
        .and_then(|v| v.split(' ').next())
        .and_then(|v| v.parse().ok());
    Some(worker.unwrap_or_else(|| panic!("x-kvhint-worker does not parse: {header:?}")))
}

/// POSTs `body` to `url` with [`agent`]: the status, the worker kvhint booked
/// ([`booked_worker`]; 0 if none), the body.
pub fn call(url: &str, body: &Value) -> (u16, u64, String) {
    call_with(&agent(), url, body)
}

/// [`call`] with a given agent.
pub fn call_with(agent: &ureq::Agent, url: &str, body: &Value) -> (u16, u64, String) {
    let mut response = agent
        .post(url)
        .header("content-type", "application/json")
        .send(body.to_string())
        .unwrap_or_else(|e| panic!("POST {url}: {e}"));
    let status = response.status().as_u16();
    let worker = booked_worker(&response).unwrap_or(0);
    let text = response.body_mut().read_to_string().unwrap();
    (status, worker, text)
}

/// Sends `body` to `path` on `address` over a raw connection (reads bounded
/// at 20 s), so a test can close it whenever it likes.
pub fn raw_post(address: &str, path: &str, body: &Value) -> TcpStream {
    let mut stream = TcpStream::connect(address).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let body = body.to_string();
    write!(
        stream,
        "POST {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    stream
}

/// Reads until `want` bytes came (or the stream ended or timed out).
pub fn read_some(stream: &mut TcpStream, want: usize) -> Vec<u8> {
    let mut got = Vec::new();
    let mut buffer = [0u8; 4096];
    while got.len() < want {
        match stream.read(&mut buffer) {
            Ok(0) | Err(_) => break,
            Ok(n) => got.extend_from_slice(&buffer[..n]),
        }
    }
    got
}

/// One POST for a benchmark, read to its last byte: (total seconds, seconds to
/// the first body byte). A status other than 200 fails the run.
pub fn timed_post(agent: &ureq::Agent, url: &str, body: &str) -> (f64, f64) {
    let started = Instant::now();
    let mut response = agent
        .post(url)
        .header("content-type", "application/json")
        .send(body)
        .unwrap_or_else(|e| panic!("POST {url}: {e}"));
    if response.status().as_u16() != 200 {
        let status = response.status();
        let text = response.body_mut().read_to_string().unwrap_or_default();
        panic!("POST {url}: {status}: {text}");
    }
    let mut reader = response.body_mut().as_reader();
    let mut buffer = [0u8; 8192];
    let mut first = None;
    loop {
        match reader.read(&mut buffer) {
            Ok(0) => break,
            Ok(_) => {
                first.get_or_insert_with(|| started.elapsed().as_secs_f64());
            }
            Err(e) => panic!("reading {url}: {e}"),
        }
    }
    let total = started.elapsed().as_secs_f64();
    (total, first.unwrap_or(total))
}

/// A small deterministic generator, so a failing run can be replayed.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
}

/// The zero-leak load: `threads` clients each send `per_thread` completions of
/// `model` (streamed or not, of random length) to `address`, and each goes away
/// at a random point. Returns how many went away at each: 0 before the head (at
/// once), 1 during prefill (a few ms in), 2 mid-stream, 3 after reading to the
/// end. `seed` makes a run replayable.
pub fn cut_off_requests(
    address: &str,
    model: &str,
    threads: u64,
    per_thread: usize,
    seed: u64,
) -> [usize; 4] {
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let address = address.to_string();
            let model = model.to_string();
            std::thread::spawn(move || {
                let mut rng = Lcg(seed ^ t);
                let mut ends = [0usize; 4];
                for i in 0..per_thread {
                    let stream = rng.next().is_multiple_of(2);
                    let body = json!({"model": model,
                        "prompt": format!("Request {t}-{i}: {}", "lorem ipsum ".repeat((rng.next() % 40) as usize)),
                        "max_tokens": 1 + rng.next() % 40, "temperature": 0, "stream": stream});
                    let mut connection = raw_post(&address, "/v1/completions", &body);
                    let cut = (rng.next() % 4) as usize;
                    ends[cut] += 1;
                    match cut {
                        0 => {}
                        1 => std::thread::sleep(Duration::from_micros(rng.next() % 3_000)),
                        2 => {
                            let _ = read_some(&mut connection, 1 + (rng.next() % 700) as usize);
                        }
                        _ => {
                            let _ = read_some(&mut connection, usize::MAX);
                        }
                    }
                    drop(connection);
                }
                ends
            })
        })
        .collect();
    let mut ends = [0usize; 4];
    for handle in handles {
        let counts = handle.join().unwrap();
        for (total, n) in ends.iter_mut().zip(counts) {
            *total += n;
        }
    }
    ends
}
