//! Every booking the gateway makes is owned by a [`ReleaseGuard`], and the
//! response body that streams the worker's answer owns the guard: whatever ends
//! the request — the last byte, a client that goes away (the body is dropped), an
//! upstream error, no byte for `gateway.idle_timeout_ms`, the wall-clock deadline —
//! releases the booking exactly once and counts why. The router's TTL stays the
//! last resort for a guard that never runs (a killed process leaves nothing).

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
}

impl ReleaseGuard {
    pub fn new(router: Arc<Router>, stats: Arc<GatewayStats>, request_id: String) -> Self {
        Self {
            router,
            stats,
            request_id,
            open: true,
        }
    }

    pub fn request_id(&self) -> &str {
        &self.request_id
    }

    /// Releases the booking now, for `reason`.
    pub fn finish(&mut self, reason: Release) {
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
