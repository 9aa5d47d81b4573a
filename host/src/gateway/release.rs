//! Every booking the gateway makes is owned by a [`ReleaseGuard`], and the
//! response body that streams the worker's answer owns the guard: whatever ends
//! the request — the last byte, a client that goes away (the body is dropped), an
//! upstream error, no byte for `gateway.idle_timeout_ms`, the wall-clock deadline —
//! releases the booking exactly once and counts why. The router's TTL stays the
//! last resort for a guard that never runs (a killed process leaves nothing).

use super::approximate::{Credit, Settle};
use super::signals::Signals;
use super::stats::{GatewayStats, Release};
use crate::router::Router;
use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::time::Sleep;

/// Owns one open booking; releases it when dropped (as a client disconnect,
/// unless [`ReleaseGuard::finish`] named another reason first).
pub struct ReleaseGuard {
    router: Arc<Router>,
    stats: Arc<GatewayStats>,
    request_id: String,
    open: bool,
    /// The worker's credit for this request (an approximate worker's, or an
    /// event-fed worker's while it runs): settled when its prompt is reusable
    /// (first byte or end, by engine), and at the latest with the booking.
    credit: Option<Credit>,
}

impl ReleaseGuard {
    pub fn new(router: Arc<Router>, stats: Arc<GatewayStats>, request_id: String) -> Self {
        Self {
            router,
            stats,
            request_id,
            open: true,
            credit: None,
        }
    }

    /// Keeps `credit` until the request settles it.
    pub fn hold(&mut self, credit: Credit) {
        self.credit = Some(credit);
    }

    /// The request was sent before the one holding its prefix settled.
    pub fn sent_while_busy(&self) {
        if let Some(credit) = &self.credit {
            credit.sent_while_busy();
        }
    }

    /// Whether the engine's count of reused prompt tokens is wanted (the
    /// request went to an approximate worker).
    fn wants_reuse_report(&self) -> bool {
        self.credit.as_ref().is_some_and(Credit::wants_reuse_report)
    }

    fn engine_reused(&self, cached_tokens: u64) {
        if let Some(credit) = &self.credit {
            credit.engine_reused(cached_tokens);
        }
    }

    pub fn request_id(&self) -> &str {
        &self.request_id
    }

    /// Releases the booking now, for `reason`.
    pub fn finish(&mut self, reason: Release) {
        if let Some(credit) = self.credit.take() {
            credit.settle();
        }
        if std::mem::take(&mut self.open) {
            // Already gone if the TTL sweep released it first.
            if self.router.release(&self.request_id).is_ok() {
                self.stats.released(reason);
            } else {
                self.stats.released(Release::Ttl);
            }
        }
    }

    /// The worker has answered its first byte: the prompt is prefilled.
    pub fn prefill_done(&self) {
        if self.open {
            self.router.prefill_done(&self.request_id);
        }
        if let Some(credit) = self
            .credit
            .as_ref()
            .filter(|c| c.settle == Settle::FirstByte)
        {
            credit.settle();
        }
    }
}

impl Drop for ReleaseGuard {
    fn drop(&mut self) {
        self.finish(Release::ClientDisconnect);
    }
}

/// Why the gateway cut a response short.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    #[error("the worker sent no byte for {0:?} (gateway.idle_timeout_ms)")]
    Idle(Duration),
    #[error("the request ran past its deadline (gateway.request_timeout_ms)")]
    Deadline,
    #[error("the worker's response broke off: {0}")]
    Upstream(hyper::Error),
}

/// A worker's response body on its way to the client, frame by frame as it
/// arrives (nothing is buffered), with the booking's guard.
pub struct GuardedBody {
    inner: hyper::body::Incoming,
    guard: ReleaseGuard,
    idle_timeout: Duration,
    idle: Pin<Box<Sleep>>,
    deadline: Option<Pin<Box<Sleep>>>,
    first_byte: bool,
    /// Still looking for the engine's count of reused prompt tokens.
    seeking_reuse: bool,
    /// When the request reached the router, for the duration figure.
    received: Instant,
    done: bool,
    /// Time to first token, time between tokens, token counts.
    signals: Signals,
    on_end: Option<OnEnd>,
}

/// What runs once when a response ends: why, how long after the request came,
/// and what the response said of its generation.
pub type OnEnd = Box<dyn FnOnce(Release, Duration, &Signals) + Send + Sync>;

impl GuardedBody {
    pub fn new(
        inner: hyper::body::Incoming,
        guard: ReleaseGuard,
        idle_timeout: Duration,
        deadline: Option<Instant>,
        received: Instant,
        stream: bool,
        on_end: OnEnd,
    ) -> Self {
        Self {
            inner,
            seeking_reuse: guard.wants_reuse_report(),
            guard,
            idle_timeout,
            idle: Box::pin(tokio::time::sleep(idle_timeout)),
            deadline: deadline.map(|at| Box::pin(tokio::time::sleep_until(at.into()))),
            first_byte: false,
            received,
            done: false,
            signals: Signals::new(stream),
            on_end: Some(on_end),
        }
    }

    fn end(&mut self, reason: Release) {
        self.done = true;
        self.guard.finish(reason);
        if let Some(on_end) = self.on_end.take() {
            on_end(reason, self.received.elapsed(), &self.signals);
        }
    }
}

impl Drop for GuardedBody {
    fn drop(&mut self) {
        if !self.done {
            // The client went away mid-stream: dropping `inner` closes the
            // connection to the worker, and the engine aborts the request.
            self.end(Release::ClientDisconnect);
        }
    }
}

impl HttpBody for GuardedBody {
    type Data = Bytes;
    type Error = StreamError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, StreamError>>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    if !data.is_empty() {
                        if !this.first_byte {
                            this.first_byte = true;
                            this.guard.prefill_done();
                        }
                        this.signals.observe(data, Instant::now());
                    }
                }
                if this.seeking_reuse {
                    if let Some(tokens) = frame.data_ref().and_then(|d| reused_tokens(d)) {
                        this.seeking_reuse = false;
                        this.guard.engine_reused(tokens);
                    }
                }
                // A body of known length is done with its last byte: the server
                // stops polling there and drops the body, which must not read
                // as the client going away.
                if this.inner.is_end_stream() {
                    this.end(Release::Completed);
                }
                let idle = this.idle_timeout;
                this.idle.as_mut().reset(tokio::time::Instant::now() + idle);
                return Poll::Ready(Some(Ok(frame)));
            }
            Poll::Ready(Some(Err(error))) => {
                this.end(Release::UpstreamError);
                return Poll::Ready(Some(Err(StreamError::Upstream(error))));
            }
            Poll::Ready(None) => {
                this.end(Release::Completed);
                return Poll::Ready(None);
            }
            Poll::Pending => {}
        }
        if let Some(deadline) = this.deadline.as_mut() {
            if deadline.as_mut().poll(cx).is_ready() {
                this.end(Release::Deadline);
                return Poll::Ready(Some(Err(StreamError::Deadline)));
            }
        }
        if this.idle.as_mut().poll(cx).is_ready() {
            let idle = this.idle_timeout;
            this.end(Release::IdleTimeout);
            return Poll::Ready(Some(Err(StreamError::Idle(idle))));
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

use std::future::Future;

/// The engine's count of prompt tokens it reused, where a response (or one
/// chunk of a stream) carries it: the OpenAI `usage.prompt_tokens_details.
/// cached_tokens`, SGLang's `meta_info.cached_tokens`, or llama.cpp's
/// `timings.cache_n`. A key split across two chunks is missed, which costs one
/// observation, never a wrong one.
fn reused_tokens(data: &[u8]) -> Option<u64> {
    static KEYS: std::sync::LazyLock<[memchr::memmem::Finder<'static>; 2]> =
        std::sync::LazyLock::new(|| {
            [
                memchr::memmem::Finder::new(b"\"cached_tokens\":"),
                memchr::memmem::Finder::new(b"\"cache_n\":"),
            ]
        });
    KEYS.iter().find_map(|key| {
        let at = key.find(data)? + key.needle().len();
        let rest = &data[at..];
        let digits = rest.iter().skip_while(|b| **b == b' ');
        let mut value: u64 = 0;
        let mut any = false;
        for b in digits {
            if !b.is_ascii_digit() {
                break;
            }
            any = true;
            value = value.checked_mul(10)?.checked_add(u64::from(b - b'0'))?;
        }
        any.then_some(value)
    })
}

#[cfg(test)]
mod tests {
    use super::reused_tokens;

    #[test]
    fn the_engines_reused_token_counts_are_found() {
        let openai = br#"data: {"choices":[],"usage":{"completion_tokens":8,"prompt_tokens":1561,"total_tokens":1569,"prompt_tokens_details":{"cached_tokens":1462}}}"#;
        assert_eq!(reused_tokens(openai), Some(1462));
        let llamacpp = br#"{"timings":{"cache_n": 96,"prompt_n":4}}"#;
        assert_eq!(reused_tokens(llamacpp), Some(96));
        let sglang = br#"{"meta_info":{"prompt_tokens":10,"cached_tokens":0}}"#;
        assert_eq!(reused_tokens(sglang), Some(0));
        assert_eq!(
            reused_tokens(br#"data: {"choices":[{"delta":{"content":"x"}}]}"#),
            None
        );
        assert_eq!(reused_tokens(br#"{"cached_tokens":null}"#), None);
        assert_eq!(
            reused_tokens(br#"{"cached_tokens":99999999999999999999999}"#),
            None
        );
    }
}
