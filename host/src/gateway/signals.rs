//! What a response says about its generation, read as its bytes pass (nothing
//! is buffered, nothing re-serialised): when the first content came (time to
//! first token: the first SSE event with a non-empty `content`,
//! `reasoning_content` or `text`, or a
//! non-streaming body's first byte), how many content events followed and when
//! the last came (the time between tokens), and the engine's `usage` (prompt and
//! completion tokens) when it sends one: every non-streaming OpenAI answer, and
//! a stream's last chunk when the client asked for
//! `stream_options.include_usage`.
//!
//! The scan is a few substring searches per frame (memchr's SIMD finders); a
//! `usage` object split across two frames is put together from a small carry.

use memchr::memmem::Finder;
use std::sync::LazyLock;
use std::time::Instant;

static DATA: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"data:"));
static CONTENT: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"content\":\""));
static TEXT: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"text\":\""));
static REASONING: LazyLock<Finder<'static>> =
    LazyLock::new(|| Finder::new(b"\"reasoning_content\":\""));
static USAGE: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"usage\":"));

/// An object being put together across frames may grow to this at most.
const MAX_PENDING: usize = 4096;
/// Bytes kept from a frame's end, for a key cut by the frame boundary.
const TAIL: usize = 16;

/// The engine's token counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize)]
pub struct Usage {
    #[serde(default)]
    pub prompt_tokens: u64,
    #[serde(default)]
    pub completion_tokens: u64,
}

/// One response's signals so far.
#[derive(Debug)]
pub struct Signals {
    stream: bool,
    pub first_content: Option<Instant>,
    pub last_content: Option<Instant>,
    /// SSE events with content (a stream's tokens, as engines send one or a few
    /// per event).
    pub content_events: u64,
    pub usage: Option<Usage>,
    /// A `usage` object whose end has not come yet.
    pending: Vec<u8>,
    /// The previous frame's last bytes.
    tail: Vec<u8>,
}

impl Signals {
    pub fn new(stream: bool) -> Self {
        Self {
            stream,
            first_content: None,
            last_content: None,
            content_events: 0,
            usage: None,
            pending: Vec::new(),
            tail: Vec::new(),
        }
    }

    /// A frame of the body arrived at `now`.
    pub fn observe(&mut self, data: &[u8], now: Instant) {
        if data.is_empty() {
            return;
        }
        if !self.stream {
            self.first_content.get_or_insert(now);
            self.last_content = Some(now);
        } else {
            let events = count_content_events(data);
            if events > 0 {
                self.first_content.get_or_insert(now);
                self.last_content = Some(now);
                self.content_events += events;
            }
        }
        self.find_usage(data);
    }

    fn find_usage(&mut self, data: &[u8]) {
        if !self.pending.is_empty() {
            let room = MAX_PENDING.saturating_sub(self.pending.len());
            self.pending
                .extend_from_slice(&data[..data.len().min(room)]);
            self.try_usage();
        } else if let Some(i) = USAGE.find(data) {
            self.pending
                .extend_from_slice(&data[i..data.len().min(i + MAX_PENDING)]);
            self.try_usage();
        } else if !self.tail.is_empty() {
            // The key may straddle the boundary between two frames.
            let mut joined = std::mem::take(&mut self.tail);
            let head = data.len().min(TAIL);
            joined.extend_from_slice(&data[..head]);
            if let Some(i) = USAGE.find(&joined) {
                self.pending.extend_from_slice(&joined[i..]);
                self.pending
                    .extend_from_slice(&data[head..data.len().min(head + MAX_PENDING)]);
                self.try_usage();
            }
        }
        self.tail.clear();
        self.tail
            .extend_from_slice(&data[data.len().saturating_sub(TAIL)..]);
    }

    /// Parses `"usage": {...}` from `pending` once its object is whole; a
    /// `null` or anything that is not a usage object is dropped.
    fn try_usage(&mut self) {
        let rest = &self.pending[b"\"usage\":".len().min(self.pending.len())..];
        let start = rest.iter().position(|b| !b.is_ascii_whitespace());
        let Some(start) = start else {
            return; // more to come
        };
        if rest[start] != b'{' {
            self.pending.clear();
            return;
        }
        let mut values = serde_json::Deserializer::from_slice(&rest[start..]).into_iter::<Usage>();
        match values.next() {
            Some(Ok(usage)) => {
                self.usage = Some(usage);
                self.pending.clear();
            }
            Some(Err(e)) if e.is_eof() && self.pending.len() < MAX_PENDING => {}
            _ => self.pending.clear(),
        }
    }

    /// The mean time between content events after the first, in seconds: the
    /// time per output token where the engine sends one token an event.
    pub fn between_tokens(&self) -> Option<f64> {
        let (first, last) = (self.first_content?, self.last_content?);
        let gaps = self.content_events.checked_sub(1).filter(|n| *n > 0)?;
        Some(last.saturating_duration_since(first).as_secs_f64() / gaps as f64)
    }
}

/// SSE events in `data` with a token: a non-empty `content` (a chat's delta),
/// `reasoning_content` (a reasoning model's thinking, which comes first) or
/// `text` (a completion).
fn count_content_events(data: &[u8]) -> u64 {
    let mut count = 0;
    let mut events = DATA.find_iter(data).peekable();
    while let Some(start) = events.next() {
        let end = events.peek().copied().unwrap_or(data.len());
        let event = &data[start..end];
        let non_empty = |finder: &Finder<'_>, key_len: usize| {
            finder
                .find(event)
                .is_some_and(|i| event.get(i + key_len).is_some_and(|b| *b != b'"'))
        };
        if non_empty(&CONTENT, b"\"content\":\"".len())
            || non_empty(&TEXT, b"\"text\":\"".len())
            || non_empty(&REASONING, b"\"reasoning_content\":\"".len())
        {
            count += 1;
        }
    }
    count
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_s_content_events_and_its_usage_chunk_are_read_across_frames() {
        let mut signals = Signals::new(true);
        let now = Instant::now();
        signals.observe(
            b"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n",
            now,
        );
        assert_eq!(signals.content_events, 0);
        assert!(signals.first_content.is_none());
        signals.observe(b"data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\n\ndata: {\"choices\":[{\"delta\":{\"content\":\" there\"}}]}\n\n", now);
        assert_eq!(signals.content_events, 2);
        let usage = b"data: {\"choices\":[],\"usage\":{\"completion_tokens\":2,\"prompt_tokens\":11,\"total_tokens\":13}}\n\n";
        // Cut inside the key, then inside the object.
        signals.observe(&usage[..33], now);
        signals.observe(&usage[33..60], now);
        assert!(signals.usage.is_none());
        signals.observe(&usage[60..], now);
        assert_eq!(
            signals.usage,
            Some(Usage {
                prompt_tokens: 11,
                completion_tokens: 2
            })
        );
    }

    #[test]
    fn a_null_usage_is_no_usage_and_a_completion_s_text_counts() {
        let mut signals = Signals::new(true);
        let now = Instant::now();
        signals.observe(
            b"data: {\"choices\":[{\"text\":\"a\"}],\"usage\":null}\n\n",
            now,
        );
        assert_eq!(signals.content_events, 1);
        assert_eq!(signals.usage, None);
        let mut whole = Signals::new(false);
        whole.observe(b"{\"choices\":[{\"text\":\"\"}],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":0}}", now);
        assert!(whole.first_content.is_some());
        assert_eq!(whole.usage.map(|u| u.prompt_tokens), Some(3));
    }
}
