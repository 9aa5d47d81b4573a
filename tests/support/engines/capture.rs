//! A capture server: an engine's HTTP front on 127.0.0.1 that records each
//! request it is sent (method, path, body, whether the body came chunked) and
//! answers a fixed SGLang-shaped `/generate` and an OpenAI `/v1/completions`.
//! The gateway hint tests and the endpoint-picker tests see through it what
//! reached the worker.

use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct Captured {
    pub method: String,
    pub path: String,
    pub body: Vec<u8>,
    /// The body came with `transfer-encoding: chunked` (no content-length).
    pub chunked: bool,
    /// Its headers, names lower-cased, in order.
    pub headers: Vec<(String, String)>,
}

pub struct Upstream {
    pub port: u16,
    seen: Arc<Mutex<Vec<Captured>>>,
}

impl Upstream {
    /// A capture server whose `/v1/completions` answer names `model`.
    pub fn start_for(model: &str) -> Upstream {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let record = Arc::clone(&seen);
        let model = model.to_string();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                let record = Arc::clone(&record);
                let model = model.clone();
                std::thread::spawn(move || serve_connection(stream, &record, &model));
            }
        });
        Upstream { port, seen }
    }

    /// A capture server for the model `qwen3`.
    pub fn start() -> Upstream {
        Self::start_for("qwen3")
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// `127.0.0.1:PORT`.
    pub fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Every request it got, in order.
    pub fn requests(&self) -> Vec<Captured> {
        self.seen.lock().unwrap().clone()
    }

    /// The bodies of the POSTs it got on `path`.
    pub fn posts(&self, path: &str) -> Vec<Value> {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .filter(|c| c.method == "POST" && c.path == path)
            .map(|c| {
                serde_json::from_slice(&c.body).unwrap_or_else(|e| {
                    panic!("not JSON ({e}): {}", String::from_utf8_lossy(&c.body))
                })
            })
            .collect()
    }

    pub fn clear(&self) {
        self.seen.lock().unwrap().clear();
    }
}

/// Reads one HTTP/1.1 request (a content-length or chunked body) from a
/// connection; `None` when it closes first.
pub fn read_request(reader: &mut BufReader<TcpStream>) -> Option<Captured> {
    let mut line = String::new();
    if reader.read_line(&mut line).unwrap_or(0) == 0 {
        return None;
    }
    let mut parts = line.split_whitespace();
    let (method, path) = (
        parts.next().unwrap_or("").to_string(),
        parts.next().unwrap_or("").to_string(),
    );
    let (mut length, mut chunked, mut headers) = (0usize, false, Vec::new());
    loop {
        let mut header = String::new();
        if reader.read_line(&mut header).unwrap_or(0) == 0 {
            return None;
        }
        let header = header.trim_end();
        if header.is_empty() {
            break;
        }
        let (name, value) = header.split_once(':').unwrap_or((header, ""));
        let (name, value) = (name.trim().to_ascii_lowercase(), value.trim());
        if name == "content-length" {
            length = value.parse().unwrap_or(0);
        } else if name == "transfer-encoding" && value.contains("chunked") {
            chunked = true;
        }
        headers.push((name, value.to_string()));
    }
    let mut body = Vec::new();
    if chunked {
        loop {
            let mut size = String::new();
            if reader.read_line(&mut size).unwrap_or(0) == 0 {
                return None;
            }
            let size = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
            let mut chunk = vec![0; size + 2];
            reader.read_exact(&mut chunk).ok()?;
            if size == 0 {
                break;
            }
            body.extend_from_slice(&chunk[..size]);
        }
    } else {
        body.resize(length, 0);
        reader.read_exact(&mut body).ok()?;
    }
    Some(Captured {
        method,
        path,
        body,
        chunked,
        headers,
    })
}

/// Answers requests on one connection (keep-alive) until it closes or is quiet
/// for 10 s.
fn serve_connection(stream: TcpStream, seen: &Mutex<Vec<Captured>>, model: &str) {
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut writer = stream.try_clone().unwrap();
    let mut reader = BufReader::new(stream);
    while let Some(request) = read_request(&mut reader) {
        let (method, path) = (request.method.as_str(), request.path.as_str());
        let answer = match (method, path) {
            ("GET", "/health") => json!({}),
            ("POST", "/generate") => json!({
                "text": "ok", "output_ids": [9707],
                "meta_info": {"id": "captured", "finish_reason": {"type": "length", "length": 1},
                              "prompt_tokens": 1, "completion_tokens": 1, "cached_tokens": 0}}),
            ("POST", "/v1/completions") => json!({
                "id": "cmpl-captured", "object": "text_completion", "created": 0, "model": model,
                "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}),
            _ => json!({"error": "not here"}),
        };
        seen.lock().unwrap().push(request);
        let answer = answer.to_string();
        let head = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            answer.len()
        );
        if writer
            .write_all(head.as_bytes())
            .and_then(|()| writer.write_all(answer.as_bytes()))
            .and_then(|()| writer.flush())
            .is_err()
        {
            return;
        }
    }
}
