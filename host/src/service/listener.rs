//! The listener: HTTP/1.1 connections, each bounded in how long its peer may
//! take, and at most `max_connections` of them at once.
//!
//! `axum::serve` keeps a connection for as long as its peer likes: half a header,
//! a byte every few seconds, or nothing at all after a response, and a few hundred
//! such peers hold every file descriptor. So connections are served here, with
//! hyper directly, and each one's socket goes through [`Deadlines`], which knows
//! which phase the connection is in and closes it when that phase runs over:
//!
//! - **idle**: between connecting (or the last response) and the first byte of a
//!   request — `idle_timeout`;
//! - **head**: from a request's first byte until its head is complete —
//!   `header_timeout`, for the whole head, so a drip of bytes does not extend it;
//! - **handling**: from the request's head until the response's last byte; the
//!   handler reads the body under `body_timeout` (see `body.rs`), and the phase
//!   has no deadline of its own, so a response that streams for minutes is never
//!   cut by a connection timer (the gateway bounds the silence between a worker's
//!   bytes itself);
//! - **writing**: a response the peer does not read at all is given up after
//!   `idle_timeout` in which not one byte could be written. A peer that reads,
//!   however slowly, is never cut: until it reads, backpressure holds the rest
//!   (hyper's bounded write buffer, then the socket's), and nothing more is read
//!   from the worker.
//!
//! Over the cap, the listener stops accepting: new connections wait in the
//! kernel's backlog until one closes, which the deadlines make sure happens.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Sleep;

/// How long a peer may take, and how many peers at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    pub header_timeout: Duration,
    pub body_timeout: Duration,
    pub idle_timeout: Duration,
    pub max_connections: usize,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(60),
            max_connections: 1024,
        }
    }
}

impl ConnectionLimits {
    /// File descriptors kept back from connections: the plugins, the cache, the
    /// watch, engine sockets and log files need some too.
    pub const RESERVED_FDS: u64 = 64;

    /// These limits with the cap lowered to what the process's file-descriptor
    /// limit (`ulimit -n`) allows, and a warning if it had to be.
    /// The process's open-files limit (`ulimit -n`), if it can be read.
    pub fn open_files_limit() -> Option<u64> {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes the struct it is given and nothing else.
        (unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0).then_some(limit.rlim_cur)
    }

    /// `for_sources` descriptors are kept for KV-event sources on top of
    /// [`Self::RESERVED_FDS`]; of the rest, each connection is counted twice
    /// (its own socket and the one to the worker it is proxied to).
    pub fn capped_by_file_limit(self, for_sources: u64) -> Self {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes the struct it is given and nothing else.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
            return self;
        }
        // A client connection the gateway proxies needs a second descriptor,
        // its socket to the worker: half of what is left is for each side.
        let allowed = (limit
            .rlim_cur
            .saturating_sub(Self::RESERVED_FDS + for_sources)
            / 2)
        .max(1);
        if (self.max_connections as u64) <= allowed {
            return self;
        }
        tracing::warn!(
            max_connections = self.max_connections,
            open_files_limit = limit.rlim_cur,
            now = allowed,
            kept_for_kv_event_sources = for_sources,
            "--max-connections is more than the open-files limit allows; lowered (raise `ulimit -n` for more)"
        );
        Self {
            max_connections: allowed as usize,
            ..self
        }
    }
}

/// The connection cap, following the KV-event sources that exist: the descriptors
/// a source holds are kept out of the budget only while it holds them, so a
/// router without sources gets every connection its limit allows, and each source
/// that starts (from the config or a registration) takes its share from the cap,
/// which it gives back when its thread has closed its sockets.
///
/// The cap is a semaphore's permits. Lowering it forgets the permits that are
/// free; those held by open connections are owed, and forgotten as those
/// connections close, so the cap is reached without cutting anyone off.
pub struct ConnectionBudget {
    permits: Arc<tokio::sync::Semaphore>,
    /// `--max-connections`: the cap never goes above it.
    most: usize,
    /// The open-files limit, if it could be read (without it, `most` is the cap).
    open_files: Option<u64>,
    per_source: u64,
    sources: Box<dyn Fn() -> u64 + Send + Sync>,
    state: parking_lot::Mutex<BudgetState>,
}

#[derive(Debug)]
struct BudgetState {
    /// The cap now.
    cap: usize,
    /// The sources it was worked out for.
    sources: u64,
    /// Permits the cap went down by that open connections still hold.
    owed: usize,
}

impl ConnectionBudget {
    /// `most` is `--max-connections`; `sources` counts the sources that hold
    /// descriptors now, `per_source` descriptors each.
    pub fn new(
        most: usize,
        open_files: Option<u64>,
        per_source: u64,
        sources: Box<dyn Fn() -> u64 + Send + Sync>,
    ) -> Arc<Self> {
        let now = sources();
        let budget = Self {
            permits: Arc::new(tokio::sync::Semaphore::new(0)),
            most,
            open_files,
            per_source,
            sources,
            state: parking_lot::Mutex::new(BudgetState {
                cap: 0,
                sources: now,
                owed: 0,
            }),
        };
        let cap = budget.cap_for(now);
        budget.permits.add_permits(cap);
        budget.state.lock().cap = cap;
        Arc::new(budget)
    }

    /// The cap with `sources` sources: `--max-connections`, or what the limit
    /// leaves after [`ConnectionLimits::RESERVED_FDS`] and the sources, halved
    /// (a proxied connection holds its socket and the one to its worker).
    pub fn cap_for(&self, sources: u64) -> usize {
        match self.open_files {
            None => self.most,
            Some(limit) => {
                let left = limit
                    .saturating_sub(ConnectionLimits::RESERVED_FDS)
                    .saturating_sub(sources.saturating_mul(self.per_source));
                (self.most as u64).min((left / 2).max(1)) as usize
            }
        }
    }

    /// The cap now.
    pub fn cap(&self) -> usize {
        self.state.lock().cap
    }

    /// Works the cap out again for the sources there are now (called after each
    /// change: it reads the count itself, under its lock, so changes that race
    /// each other leave the cap for the latest count).
    pub fn refresh(&self) {
        let mut state = self.state.lock();
        let sources = (self.sources)();
        let cap = self.cap_for(sources);
        let before = state.cap;
        if cap < before {
            let down = before - cap;
            let free = self.permits.forget_permits(down);
            state.owed += down - free;
        } else if cap > before {
            let up = cap - before;
            let repaid = up.min(state.owed);
            state.owed -= repaid;
            self.permits.add_permits(up - repaid);
        }
        let changed = cap != before;
        state.cap = cap;
        state.sources = sources;
        drop(state);
        if changed {
            tracing::info!(
                max_connections = self.most,
                open_files_limit = self.open_files.unwrap_or(0),
                now = cap,
                kept_for_kv_event_sources = sources * self.per_source,
                "the connection cap follows the KV-event sources' descriptors"
            );
        }
    }

    /// A connection's permit, back when it closes (or forgotten, if the cap went
    /// down while it was open).
    fn release(&self, permit: tokio::sync::OwnedSemaphorePermit) {
        let mut state = self.state.lock();
        if state.owed > 0 {
            state.owed -= 1;
            permit.forget();
        } else {
            drop(permit);
        }
    }
}

/// The deadline a handler's body read is under (a request extension).
#[derive(Debug, Clone, Copy)]
pub struct BodyDeadline(pub Duration);

/// Why a connection was closed by its deadline, for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Idle = 0,
    Head = 1,
    Handling = 2,
    Writing = 3,
}

impl Phase {
    pub const NAMES: [&'static str; 4] = ["idle", "header", "body", "write"];
}

/// What the listener counts of its connections, read by the metrics at scrape
/// time. Atomics only: updated as connections open, close and time out.
#[derive(Debug, Default)]
pub struct ConnectionCounts {
    pub open: AtomicU64,
    pub total: AtomicU64,
    /// Connections closed by a deadline, by [`Phase`].
    pub timeouts: [AtomicU64; 4],
}

impl ConnectionCounts {
    pub fn opened(&self) {
        self.open.fetch_add(1, Ordering::Relaxed);
        self.total.fetch_add(1, Ordering::Relaxed);
    }

    pub fn closed(&self) {
        self.open.fetch_sub(1, Ordering::Relaxed);
    }

    pub fn timed_out(&self, phase: Phase) {
        self.timeouts[phase as usize].fetch_add(1, Ordering::Relaxed);
    }
}

/// A connection's phase, shared by its socket wrapper and its service.
struct Clock {
    start: Instant,
    phase: AtomicU8,
    /// When the phase began, in ns since `start`.
    since_ns: AtomicU64,
    /// The connection task, if a read found nothing while a handler ran: hyper
    /// will not read again until woken, and the idle deadline must be armed
    /// once the handler is done.
    reader: parking_lot::Mutex<Option<std::task::Waker>>,
}

impl Clock {
    fn new() -> Self {
        Self {
            start: Instant::now(),
            phase: AtomicU8::new(Phase::Idle as u8),
            since_ns: AtomicU64::new(0),
            reader: parking_lot::Mutex::new(None),
        }
    }

    fn now_ns(&self) -> u64 {
        self.start.elapsed().as_nanos() as u64
    }

    fn enter(&self, phase: Phase) {
        self.since_ns.store(self.now_ns(), Ordering::Relaxed);
        self.phase.store(phase as u8, Ordering::Release);
    }

    /// The handler is done: the connection is idle until its next request.
    fn handled(&self) {
        self.enter(Phase::Idle);
        if let Some(reader) = self.reader.lock().take() {
            reader.wake();
        }
    }

    fn phase(&self) -> u8 {
        self.phase.load(Ordering::Acquire)
    }

    fn since(&self) -> Instant {
        self.start + Duration::from_nanos(self.since_ns.load(Ordering::Relaxed))
    }
}

/// A socket whose reads and writes fail with `TimedOut` once its connection's
/// phase has run over (see the module docs).
struct Deadlines {
    inner: TcpStream,
    clock: Arc<Clock>,
    limits: ConnectionLimits,
    sleep: Pin<Box<Sleep>>,
    /// When writes stopped making progress, if they have.
    write_stalled: Option<Instant>,
    counts: Arc<ConnectionCounts>,
    timed_out: bool,
}

impl Deadlines {
    /// Pending, or `TimedOut` if `deadline` has passed; arms the timer to wake
    /// this task at `deadline` otherwise.
    fn wait_until(
        &mut self,
        cx: &mut Context<'_>,
        deadline: Instant,
        phase: Phase,
    ) -> Poll<io::Result<()>> {
        if Instant::now() >= deadline {
            return self.time_out(phase);
        }
        let deadline = tokio::time::Instant::from_std(deadline);
        if self.sleep.deadline() != deadline {
            self.sleep.as_mut().reset(deadline);
        }
        match self.sleep.as_mut().poll(cx) {
            Poll::Ready(()) => self.time_out(phase),
            Poll::Pending => Poll::Pending,
        }
    }

    fn time_out(&mut self, phase: Phase) -> Poll<io::Result<()>> {
        if !self.timed_out {
            self.timed_out = true;
            self.counts.timed_out(phase);
        }
        Poll::Ready(Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!(
                "the peer took too long ({} phase)",
                Phase::NAMES[phase as usize]
            ),
        )))
    }
}

impl AsyncRead for Deadlines {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let before = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before && this.clock.phase() == Phase::Idle as u8 {
                    this.clock.enter(Phase::Head);
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => {
                let since = this.clock.since();
                let (deadline, phase) = match this.clock.phase() {
                    p if p == Phase::Idle as u8 => (since + this.limits.idle_timeout, Phase::Idle),
                    p if p == Phase::Head as u8 => {
                        (since + this.limits.header_timeout, Phase::Head)
                    }
                    // The handler bounds its own body read; once it is done,
                    // `handled` wakes this read to arm the idle deadline.
                    _ => {
                        *this.clock.reader.lock() = Some(cx.waker().clone());
                        return Poll::Pending;
                    }
                };
                this.wait_until(cx, deadline, phase)
            }
        }
    }
}

impl AsyncWrite for Deadlines {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_write(cx, data) {
            Poll::Pending => {
                let stalled = *this.write_stalled.get_or_insert_with(Instant::now);
                match this.wait_until(cx, stalled + this.limits.idle_timeout, Phase::Writing) {
                    Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
                    _ => Poll::Pending,
                }
            }
            ready => {
                this.write_stalled = None;
                ready
            }
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Serves `router` on `listener` until `shutdown` resolves, then lets open
/// connections finish their requests (for up to `drain`).
pub async fn serve(
    listener: TcpListener,
    router: axum::Router,
    limits: ConnectionLimits,
    budget: Arc<ConnectionBudget>,
    counts: Arc<ConnectionCounts>,
    shutdown: impl Future<Output = ()>,
    drain: Duration,
) {
    use hyper_util::rt::TokioIo;
    let permits = Arc::clone(&budget.permits);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    let mut accept_errors_logged = Instant::now() - Duration::from_secs(60);
    loop {
        let permit = tokio::select! {
            permit = Arc::clone(&permits).acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => break,
            },
            () = &mut shutdown => break,
        };
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _peer)) => stream,
                Err(e) => {
                    // Out of file descriptors, most likely: wait for some to free
                    // rather than spin, and say so at most every few seconds.
                    if accept_errors_logged.elapsed() > Duration::from_secs(5) {
                        tracing::warn!(error = %e, "cannot accept a connection; retrying");
                        accept_errors_logged = Instant::now();
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let clock = Arc::new(Clock::new());
        let io = Deadlines {
            inner: stream,
            clock: Arc::clone(&clock),
            limits,
            sleep: Box::pin(tokio::time::sleep(limits.idle_timeout)),
            write_stalled: None,
            counts: Arc::clone(&counts),
            timed_out: false,
        };
        let router = router.clone();
        let service = hyper::service::service_fn(move |mut request: hyper::Request<_>| {
            clock.enter(Phase::Handling);
            request
                .extensions_mut()
                .insert(BodyDeadline(limits.body_timeout));
            let response = tower_oneshot(router.clone(), request);
            let clock = Arc::clone(&clock);
            async move {
                // The connection stays in the handling phase until the response's
                // last byte: a stream that lasts minutes is still being answered,
                // and the idle deadline (meant for between requests) must not
                // cut it. The only bound on a streaming response is the gateway's
                // own, between the worker's bytes.
                let response = response.await;
                Ok::<_, std::convert::Infallible>(match response {
                    Ok(response) => response.map(|body| {
                        axum::body::Body::new(Answering {
                            inner: body,
                            clock,
                            done: false,
                        })
                    }),
                    Err(never) => match never {},
                })
            }
        });
        let connection = hyper::server::conn::http1::Builder::new()
            .keep_alive(true)
            .serve_connection(TokioIo::new(io), service);
        let connection = graceful.watch(connection);
        let counts = Arc::clone(&counts);
        let budget = Arc::clone(&budget);
        counts.opened();
        tokio::spawn(async move {
            // A connection's errors (a reset, a timeout, a malformed head) are the
            // peer's; hyper has answered what it could.
            let _ = connection.await;
            counts.closed();
            budget.release(permit);
        });
    }
    drop(listener);
    tokio::select! {
        () = graceful.shutdown() => {}
        () = tokio::time::sleep(drain) => {
            tracing::warn!(?drain, "connections still open at shutdown were cut");
        }
    }
}

/// A response body on its way out: when it ends (its last frame, or dropped
/// because the peer went away) the connection is idle again, and the idle
/// deadline applies until the next request.
struct Answering {
    inner: axum::body::Body,
    clock: Arc<Clock>,
    done: bool,
}

impl Answering {
    fn finish(&mut self) {
        if !std::mem::replace(&mut self.done, true) {
            self.clock.handled();
        }
    }
}

impl Drop for Answering {
    fn drop(&mut self) {
        self.finish();
    }
}

impl http_body::Body for Answering {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(None) | Poll::Ready(Some(Err(_))) => this.finish(),
            Poll::Ready(Some(Ok(_))) if this.inner.is_end_stream() => this.finish(),
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// Calls axum's router as a tower service, once.
fn tower_oneshot(
    router: axum::Router,
    request: hyper::Request<hyper::body::Incoming>,
) -> impl Future<Output = Result<axum::response::Response, std::convert::Infallible>> {
    use tower_service::Service;
    let mut router = router;
    let request = request.map(axum::body::Body::new);
    router.call(request)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    /// Issue 44: descriptors are kept for the KV-event sources there are, not for
    /// `kv_events.max_sources`; a cap lowered while connections hold its permits
    /// is reached as they close, without cutting them.
    #[test]
    fn the_cap_follows_the_sources_and_a_lowered_cap_is_reached_as_connections_close() {
        let sources = Arc::new(AtomicU64::new(0));
        let count = Arc::clone(&sources);
        // 256 descriptors: 64 reserved, 8 a source, 2 a connection.
        let budget = ConnectionBudget::new(
            1024,
            Some(256),
            8,
            Box::new(move || count.load(Ordering::Relaxed)),
        );
        assert_eq!(budget.cap(), 96, "no source: nothing kept for one");
        assert_eq!(budget.permits.available_permits(), 96);
        // 90 connections open, then 3 sources start: the cap is 84 at once, and
        // the 6 permits it owes are forgotten as connections close.
        let mut open: Vec<_> = (0..90)
            .map(|_| Arc::clone(&budget.permits).try_acquire_owned().unwrap())
            .collect();
        sources.store(3, Ordering::Relaxed);
        budget.refresh();
        assert_eq!(budget.cap(), 84);
        assert_eq!(budget.permits.available_permits(), 0);
        for permit in open.drain(..10) {
            budget.release(permit);
        }
        // 6 closings paid what was owed; the other 4 are free again: 80 open + 4 = 84.
        assert_eq!(budget.permits.available_permits(), 4);
        // The sources go: the room comes back.
        sources.store(0, Ordering::Relaxed);
        budget.refresh();
        assert_eq!(budget.cap(), 96);
        assert_eq!(budget.permits.available_permits(), 16);
        for permit in open.drain(..) {
            budget.release(permit);
        }
        assert_eq!(budget.permits.available_permits(), 96);
        // Lowered while nothing was owed, raised before the debt was paid: the
        // raise cancels the debt first.
        let held: Vec<_> = (0..96)
            .map(|_| Arc::clone(&budget.permits).try_acquire_owned().unwrap())
            .collect();
        sources.store(2, Ordering::Relaxed);
        budget.refresh();
        sources.store(1, Ordering::Relaxed);
        budget.refresh();
        assert_eq!(budget.cap(), 92);
        for permit in held {
            budget.release(permit);
        }
        assert_eq!(budget.permits.available_permits(), 92);
        // Never above --max-connections, never below 1.
        let small = ConnectionBudget::new(10, Some(256), 8, Box::new(|| 0));
        assert_eq!(small.cap(), 10);
        let starved = ConnectionBudget::new(1024, Some(64), 8, Box::new(|| 5));
        assert_eq!(starved.cap(), 1);
        let unknown = ConnectionBudget::new(1024, None, 8, Box::new(|| 5));
        assert_eq!(unknown.cap(), 1024);
    }
}
