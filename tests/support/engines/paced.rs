//! A paced engine: an OpenAI-shaped HTTP/1.1 server on 127.0.0.1 that takes
//! as long as a test says. A streaming chat or completion gets its head at once,
//! then one SSE chunk every `every` (`chunks` of them, a usage chunk if the
//! request asked for `stream_options.include_usage`, and `[DONE]`); a
//! non-streaming one gets nothing until `answer_after`, then the whole answer.
//! `GET /health` answers 200 at once, whatever is in flight (each connection
//! has a thread of its own), as a busy engine's does.
//!
//! The timers of the gateway are tested against it at their own scale: a stream
//! that outlasts a connection timer, an answer that comes after an idle bound.

use super::capture::read_request;
use serde_json::{json, Value};
use std::io::{BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How the server answers.
#[derive(Debug, Clone, Copy)]
pub struct Pace {
    /// SSE chunks in a streamed answer.
    pub chunks: usize,
    /// Between two chunks (and before the first).
    pub every: Duration,
    /// How long a non-streaming answer takes.
    pub answer_after: Duration,
    /// Close the connection this long after a stream's last byte, without
    /// reading what came meanwhile, as llama.cpp's server does after every
    /// streamed answer while its head says `Keep-Alive: timeout=5, max=100` (a
    /// client that reuses the connection at once writes its next request into
    /// the close).
    pub close_after_stream: Option<Duration>,
}

pub struct Paced {
    pub port: u16,
    /// Generation requests it got (streamed or not).
    requests: Arc<AtomicU64>,
    /// Streams it wrote to the end (`[DONE]` and the last chunk).
    streams_done: Arc<AtomicU64>,
}

impl Paced {
    pub fn start(pace: Pace) -> Paced {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let requests = Arc::new(AtomicU64::new(0));
        let streams_done = Arc::new(AtomicU64::new(0));
        let (count, done) = (Arc::clone(&requests), Arc::clone(&streams_done));
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                let (count, done) = (Arc::clone(&count), Arc::clone(&done));
                std::thread::spawn(move || serve_connection(stream, pace, &count, &done));
            }
        });
        Paced {
            port,
            requests,
            streams_done,
        }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::SeqCst)
    }

    pub fn streams_done(&self) -> u64 {
        self.streams_done.load(Ordering::SeqCst)
    }
}

/// The content of chunk `i` of a stream (`" t0"`, `" t1"`, …), so a test can
/// tell which arrived.
pub fn chunk_text(i: usize) -> String {
    format!(" t{i}")
}

fn serve_connection(stream: TcpStream, pace: Pace, count: &AtomicU64, done: &AtomicU64) {
    let Ok(mut writer) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(stream);
    while let Some(request) = read_request(&mut reader) {
        let body: Value = serde_json::from_slice(&request.body).unwrap_or(Value::Null);
        let chat = request.path == "/v1/chat/completions";
        let written = match (request.method.as_str(), request.path.as_str()) {
            ("GET", "/health") => answer(&mut writer, "200 OK", &json!({"status": "ok"})),
            ("POST", "/v1/chat/completions" | "/v1/completions") => {
                count.fetch_add(1, Ordering::SeqCst);
                if body["stream"] == true {
                    let usage = body["stream_options"]["include_usage"] == true;
                    let ended = stream_answer(&mut writer, pace, chat, usage);
                    if ended.is_ok() {
                        done.fetch_add(1, Ordering::SeqCst);
                    }
                    if let (Ok(()), Some(after)) = (&ended, pace.close_after_stream) {
                        std::thread::sleep(after);
                        return;
                    }
                    ended
                } else {
                    std::thread::sleep(pace.answer_after);
                    answer(&mut writer, "200 OK", &whole(pace, chat))
                }
            }
            _ => answer(
                &mut writer,
                "404 Not Found",
                &json!({"error": {"message": "not here", "type": "not_found", "code": 404}}),
            ),
        };
        if written.is_err() {
            return;
        }
    }
}

fn answer(writer: &mut TcpStream, status: &str, body: &Value) -> std::io::Result<()> {
    let body = body.to_string();
    write!(
        writer,
        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )?;
    writer.flush()
}

fn whole(pace: Pace, chat: bool) -> Value {
    let text: String = (0..pace.chunks).map(chunk_text).collect();
    let choice = if chat {
        json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"})
    } else {
        json!({"index": 0, "text": text, "finish_reason": "length"})
    };
    json!({"id": "paced", "object": if chat { "chat.completion" } else { "text_completion" },
           "created": 0, "model": "paced", "choices": [choice],
           "usage": {"prompt_tokens": 5, "completion_tokens": pace.chunks, "total_tokens": 5 + pace.chunks}})
}

fn stream_answer(
    writer: &mut TcpStream,
    pace: Pace,
    chat: bool,
    usage: bool,
) -> std::io::Result<()> {
    write!(
        writer,
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\nkeep-alive: timeout=5, max=100\r\n\r\n"
    )?;
    writer.flush()?;
    let mut send = |data: &str| -> std::io::Result<()> {
        let event = format!("data: {data}\n\n");
        write!(writer, "{:x}\r\n{event}\r\n", event.len())?;
        writer.flush()
    };
    for i in 0..pace.chunks {
        std::thread::sleep(pace.every);
        let choice = if chat {
            json!({"index": 0, "delta": {"content": chunk_text(i)}, "finish_reason": null})
        } else {
            json!({"index": 0, "text": chunk_text(i), "finish_reason": null})
        };
        send(
            &json!({"id": "paced", "created": 0, "model": "paced", "choices": [choice]})
                .to_string(),
        )?;
    }
    if usage {
        send(
            &json!({"id": "paced", "created": 0, "model": "paced", "choices": [],
                     "usage": {"prompt_tokens": 5, "completion_tokens": pace.chunks,
                               "total_tokens": 5 + pace.chunks}})
            .to_string(),
        )?;
    }
    send("[DONE]")?;
    write!(writer, "0\r\n\r\n")?;
    writer.flush()
}
