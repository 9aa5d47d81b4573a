//! Fake engines for the disaggregated prefill/decode tests: an HTTP/1.1 server
//! on 127.0.0.1 that records every request (method, path, headers, JSON body)
//! and answers each as the test's handler says: a JSON body, an SSE stream,
//! nothing (holding the connection until the router closes it, which is
//! recorded as `abandoned`), or a closed connection.

use serde_json::Value;
use std::io::{BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// One request a fake engine got.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub method: String,
    pub path: String,
    /// Lower-cased names.
    pub headers: Vec<(String, String)>,
    pub body: Value,
    /// The fake held it unanswered ([`Reply::Hang`]) and the router closed
    /// the connection.
    pub abandoned: bool,
}

impl Recorded {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// How a fake engine answers one request.
pub enum Reply {
    Json(u16, Value),
    /// `data: …` events, then `data: [DONE]`, chunked.
    Sse(Vec<Value>),
    /// No answer: wait (20 s at most) until the router closes the connection.
    Hang,
    /// The head and these events of a stream, then silence until the router
    /// closes the connection (recorded as `abandoned`).
    Stall(Vec<Value>),
    /// A whole stream, its events this far apart.
    Paced(Vec<Value>, Duration),
    /// Close the connection without answering.
    Close,
}

type Handler = dyn Fn(&Recorded, usize) -> Reply + Send + Sync;

pub struct Fake {
    pub port: u16,
    seen: Arc<Mutex<Vec<Recorded>>>,
}

impl Fake {
    /// A fake engine whose POSTs are answered by `handler` (given the request
    /// and how many POSTs came before it); `GET`s get `200 {}`.
    pub fn start(handler: impl Fn(&Recorded, usize) -> Reply + Send + Sync + 'static) -> Fake {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let record = Arc::clone(&seen);
        let handler: Arc<Handler> = Arc::new(handler);
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                let record = Arc::clone(&record);
                let handler = Arc::clone(&handler);
                std::thread::spawn(move || serve(stream, &record, &*handler));
            }
        });
        Fake { port, seen }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Every POST it got, in order.
    pub fn posts(&self) -> Vec<Recorded> {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .filter(|r| r.method == "POST")
            .cloned()
            .collect()
    }

    pub fn clear(&self) {
        self.seen.lock().unwrap().clear();
    }
}

/// A port nothing listens on (bound, then closed).
pub fn closed_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

/// One request as the capture server reads it, its body read as JSON.
fn read_request(reader: &mut BufReader<TcpStream>) -> Option<Recorded> {
    let captured = crate::engines::capture::read_request(reader)?;
    let body = if captured.body.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&captured.body)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&captured.body).into_owned()))
    };
    Some(Recorded {
        method: captured.method,
        path: captured.path,
        headers: captured.headers,
        body,
        abandoned: false,
    })
}

fn serve(stream: TcpStream, seen: &Mutex<Vec<Recorded>>, handler: &Handler) {
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut writer = stream.try_clone().unwrap();
    let mut reader = BufReader::new(stream);
    while let Some(request) = read_request(&mut reader) {
        if request.method != "POST" {
            seen.lock().unwrap().push(request);
            if write_json(&mut writer, 200, &Value::Object(Default::default())).is_err() {
                return;
            }
            continue;
        }
        let (index, nth) = {
            let mut seen = seen.lock().unwrap();
            let nth = seen.iter().filter(|r| r.method == "POST").count();
            seen.push(request.clone());
            (seen.len() - 1, nth)
        };
        let ok = match handler(&request, nth) {
            Reply::Json(status, value) => write_json(&mut writer, status, &value).is_ok(),
            Reply::Sse(events) => write_sse(&mut writer, &events).is_ok(),
            Reply::Paced(events, gap) => write_paced(&mut writer, &events, gap).is_ok(),
            Reply::Close => return,
            Reply::Stall(events) => {
                if write_sse_head(&mut writer, &events).is_err() {
                    return;
                }
                let mut byte = [0u8; 1];
                if let Ok(0) = reader.read(&mut byte) {
                    if let Some(r) = seen.lock().unwrap().get_mut(index) {
                        r.abandoned = true;
                    }
                }
                return;
            }
            Reply::Hang => {
                let mut byte = [0u8; 1];
                if let Ok(0) = reader.read(&mut byte) {
                    if let Some(r) = seen.lock().unwrap().get_mut(index) {
                        r.abandoned = true;
                    }
                }
                return;
            }
        };
        if !ok {
            return;
        }
    }
}

fn write_json(writer: &mut TcpStream, status: u16, value: &Value) -> std::io::Result<()> {
    let text = value.to_string();
    let head = format!(
        "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        text.len()
    );
    writer.write_all(head.as_bytes())?;
    writer.write_all(text.as_bytes())?;
    writer.flush()
}

/// A whole stream whose events come `gap` apart.
fn write_paced(writer: &mut TcpStream, events: &[Value], gap: Duration) -> std::io::Result<()> {
    write_sse_head(writer, &[])?;
    for event in events {
        std::thread::sleep(gap);
        let text = format!("data: {event}\n\n");
        write!(writer, "{:x}\r\n{text}\r\n", text.len())?;
        writer.flush()?;
    }
    let done = "data: [DONE]\n\n";
    write!(writer, "{:x}\r\n{done}\r\n0\r\n\r\n", done.len())?;
    writer.flush()
}

/// A stream's head and `events`, no end.
fn write_sse_head(writer: &mut TcpStream, events: &[Value]) -> std::io::Result<()> {
    writer.write_all(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n",
    )?;
    for event in events {
        let text = format!("data: {event}\n\n");
        write!(writer, "{:x}\r\n{text}\r\n", text.len())?;
    }
    writer.flush()
}

fn write_sse(writer: &mut TcpStream, events: &[Value]) -> std::io::Result<()> {
    writer.write_all(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n",
    )?;
    let mut chunk = |data: &str| -> std::io::Result<()> {
        let text = format!("data: {data}\n\n");
        write!(writer, "{:x}\r\n{text}\r\n", text.len())?;
        writer.flush()
    };
    for event in events {
        chunk(&event.to_string())?;
    }
    chunk("[DONE]")?;
    writer.write_all(b"0\r\n\r\n")?;
    writer.flush()
}
