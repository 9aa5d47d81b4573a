//! One source's thread: a ZMQ SUB socket, its sequence numbers, and recovery.
//!
//! Each message is `[topic, seq (u64 big-endian), payload]`. The thread keeps the next
//! sequence number it expects and, when one goes missing (the network, a full socket
//! buffer, a batch this router could not queue), asks the engine's replay socket (a
//! ROUTER; we use a DEALER, since a REQ socket takes only the first reply) for every
//! buffered batch from the first one missed. When there is no replay socket, or its
//! buffer no longer reaches back, or the publisher restarted (its sequence went back to
//! 0), the worker's index entries are cleared and rebuilt from the events that follow:
//! the router then under-credits that worker for a while, never credits blocks it lost.
//! A stored event whose parent the worker never stored means the same loss and takes
//! the same recovery, once per loss: blocks whose parents are older than anything the
//! engine still buffers stay unknown (refused, counted) until the engine stores them
//! again, rather than clearing the worker in a loop. Recoveries run one at a time,
//! never nested, with a backoff between rounds when the router is overloaded.
//!
//! Between the socket and the index nothing grows without bound: the socket's receive
//! high-water mark drops what a stalled router cannot take (seen as a gap), and a batch
//! the ingestion queue refuses is dropped and recovered the same way.
//!
//! The SUB socket's connection events come from libzmq's socket monitor, and libzmq
//! sends each one from its single I/O thread with a *blocking* send to a PAIR socket
//! only this thread reads ([`Sockets`]). That thread is shared by every socket of the
//! router: an event it cannot deliver stops all of them. So the monitor is read
//! whenever this thread waits (never left to fill), and it is stopped inside libzmq
//! before its PAIR closes (never an event sent to a PAIR that is gone; issue 44: a
//! storm of restarted subscriptions to a port that accepted and dropped connections
//! blocked the I/O thread, after which no socket was ever closed again, 1,023 sockets
//! later none could be made, and no source heard its engine).

use super::decode::{decode_batch, DecodeSettings, DecodedBatch, GroupFilter};
use super::stats::{SourceState, SourceStats};
use crate::domain::event_source::Endpoints;
use crate::domain::WorkerKey;
use crate::router::background::Follower;
use crate::router::index::{ApplyStats, KvEvent};
use crate::router::ingest::Ingest;
use crate::router::{Router, RouterError};
use arc_swap::ArcSwap;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod recovery;

/// The replay socket's end marker (the sequence field of its last message).
const END_SEQ: [u8; 8] = [0xff; 8];
/// How long the thread blocks in one poll: the bound on noticing a stop.
const POLL: Duration = Duration::from_millis(50);
/// Rounds of one recovery (each a replay whose batches could not all be queued) before
/// it settles for a clear.
const MAX_RECOVERY_ROUNDS: u32 = 6;
/// How long a queued batch may take to be applied before it counts as lost.
const SUBMIT_WAIT: Duration = Duration::from_secs(30);
/// Largest message a socket accepts (a batch or a replayed one): bounds what one
/// message from a publisher can make the router allocate.
const MAX_MESSAGE_BYTES: i64 = 64 << 20;
/// Names of the sockets' monitors, unique in the process.
static MONITORS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
/// Warnings of one kind per source at most this often.
const WARN_EVERY: Duration = Duration::from_secs(10);

/// Tuning of every subscription.
#[derive(Debug, Clone)]
pub struct SubscriberOptions {
    /// Messages the SUB socket buffers before it drops (ZMQ_RCVHWM).
    pub receive_hwm: i32,
    /// How long a replay may take before it is given up (and the worker resynced).
    pub replay_timeout: Duration,
    /// Most batches one replay may return.
    pub replay_max_batches: usize,
    /// First and longest wait between attempts to bind or reconnect.
    pub backoff: (Duration, Duration),
}

impl Default for SubscriberOptions {
    fn default() -> Self {
        Self {
            receive_hwm: 100_000,
            replay_timeout: Duration::from_secs(5),
            replay_max_batches: 100_000,
            backoff: (Duration::from_millis(100), Duration::from_secs(5)),
        }
    }
}

/// What the manager and the thread share.
pub struct Shared {
    /// The worker the source belongs to (a batch's dp rank may name a sibling).
    pub worker: WorkerKey,
    pub endpoints: Endpoints,
    pub stats: SourceStats,
    pub stop: AtomicBool,
}

/// Everything one thread needs.
pub struct Subscriber {
    pub shared: Arc<Shared>,
    pub context: zmq::Context,
    pub router: Arc<Router>,
    pub ingest: Ingest,
    pub settings: Arc<ArcSwap<DecodeSettings>>,
    pub options: SubscriberOptions,
    /// Counts the thread from before it starts until its sockets are closed: a
    /// stopped source's thread still holds descriptors until then (see [`Alive`]).
    pub alive: AliveGuard,
}

/// How many subscriber threads hold sockets now, whether their source is still
/// wanted or was stopped and they have not finished yet; `changed` runs after each
/// change (the connection budget follows it).
#[derive(Default)]
pub struct Alive {
    count: AtomicUsize,
    changed: std::sync::OnceLock<Box<dyn Fn() + Send + Sync>>,
}

impl Alive {
    pub fn count(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }

    /// Sets what runs after each change (once; later calls change nothing).
    pub fn on_change(&self, changed: Box<dyn Fn() + Send + Sync>) {
        let _ = self.changed.set(changed);
    }

    /// One more thread; it is counted until the guard drops.
    pub fn enter(self: &Arc<Self>) -> AliveGuard {
        self.count.fetch_add(1, Ordering::AcqRel);
        self.notify();
        AliveGuard(Arc::clone(self))
    }

    fn notify(&self) {
        if let Some(changed) = self.changed.get() {
            changed();
        }
    }
}

/// A subscriber thread's place in [`Alive`].
pub struct AliveGuard(Arc<Alive>);

impl Drop for AliveGuard {
    fn drop(&mut self) {
        self.0.count.fetch_sub(1, Ordering::AcqRel);
        self.0.notify();
    }
}

/// libzmq's `zmq_socket_monitor`, which the `zmq` crate wraps only for starting a
/// monitor: a null endpoint stops one (socket_base.cpp: "Support deregistering
/// monitoring endpoints as well"), the only way to stop it before the socket closes.
mod libzmq {
    use std::os::raw::{c_char, c_int, c_void};
    extern "C" {
        pub fn zmq_socket_monitor(
            socket: *mut c_void,
            endpoint: *const c_char,
            events: c_int,
        ) -> c_int;
    }
}

/// A subscription's SUB socket and the PAIR its monitor reports to, closed in the one
/// order that cannot block libzmq's I/O thread (see the module's comment).
struct Sockets {
    sub: zmq::Socket,
    monitor: zmq::Socket,
}

impl Drop for Sockets {
    fn drop(&mut self) {
        // Empty the PAIR first: an event blocked on a full PAIR holds the lock that
        // stopping the monitor takes. Then stop the monitor, which closes libzmq's end
        // of the pair under that lock, so no event is sent from here on; only then
        // may our end close (an event sent to a PAIR whose peer is gone blocks the I/O
        // thread for good).
        while self.monitor.recv_msg(zmq::DONTWAIT).is_ok() {}
        // SAFETY: `as_mut_ptr` is the live socket `self.sub` owns, borrowed mutably, so
        // no other call uses it meanwhile; a null endpoint with no events is how
        // libzmq 4.3 stops a monitor (it reads nothing else through the pointers).
        let stopped =
            unsafe { libzmq::zmq_socket_monitor(self.sub.as_mut_ptr(), std::ptr::null(), 0) };
        // It fails only once the context is terminating (ETERM), when libzmq's
        // threads are being shut down and nothing waits on them any more.
        if stopped != 0 {
            tracing::debug!("a KV-event socket's monitor was stopped by the context's end");
        }
    }
}

/// Where the sequence stands.
#[derive(Debug, Default)]
struct Cursor {
    /// The next sequence number expected (`None` before the first batch).
    expected: Option<u64>,
    /// The first sequence number of the last replay: live batches from there up to
    /// `expected` were already applied from the replay and are duplicates.
    replayed_from: Option<u64>,
}

/// What applying one batch came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Applied {
    Ok,
    /// The ingestion queue could not take it (or the source stopped).
    Lost,
    /// It could not be decoded.
    Malformed,
    /// A stored event chained onto a block the worker does not hold.
    UnknownParent,
}

/// How to get back in step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Recovery {
    /// Batches from `from` on were missed: replay them, or clear if that fails.
    Gap { from: u64 },
    /// The worker's state is unknown: clear it, then replay everything buffered.
    Rebuild,
    /// The state is unknown and a replay cannot help: clear it.
    Clear,
    /// At start: load whatever the engine buffers, clearing nothing.
    History,
}

enum Next {
    Apply,
    Gap { from: u64 },
    Duplicate,
    Restart,
}

impl Cursor {
    fn classify(&self, seq: u64) -> Next {
        match self.expected {
            None => Next::Apply,
            Some(expected) if seq == expected => Next::Apply,
            Some(expected) if seq > expected => Next::Gap { from: expected },
            // Right after a replay, the socket still delivers the live copies of what
            // it replayed (batch 0 included: a real restart shows in the socket's
            // reconnect, or in a sequence below the replay's first).
            Some(_) if self.replayed_from.is_some_and(|from| seq >= from) => Next::Duplicate,
            Some(_) => Next::Restart,
        }
    }
}

struct Warnings {
    last: [Option<Instant>; 7],
}

#[derive(Clone, Copy)]
enum Warn {
    Decode = 0,
    BlockSize = 1,
    Socket = 2,
    Recovery = 3,
    Topic = 4,
    Rank = 5,
    Handshake = 6,
}

impl Warnings {
    fn due(&mut self, kind: Warn) -> bool {
        let slot = &mut self.last[kind as usize];
        if slot.is_some_and(|at| at.elapsed() < WARN_EVERY) {
            return false;
        }
        *slot = Some(Instant::now());
        true
    }
}

impl Subscriber {
    /// Runs until the source is stopped; returns once its sockets are closed.
    pub fn run(self) {
        let mut thread = Thread {
            sub: &self,
            sockets: None,
            link: Link::default(),
            cursor: Cursor::default(),
            decoded: DecodedBatch::default(),
            groups: GroupFilter::default(),
            keys: vec![self.shared.worker],
            signed: Vec::new(),
            warnings: Warnings { last: [None; 7] },
            pending_clear: false,
            parent_rebuilt: false,
            follower: Follower::default(),
        };
        thread.run();
        // Closes the sockets, if the loop left any open.
        drop(thread);
        let Self { shared, alive, .. } = self;
        shared.stats.set_state(SourceState::Stopped);
        // Only now, with its sockets closed, does the thread stop counting.
        drop(alive);
    }
}

/// What the monitor said about the publisher's connection, since the socket opened.
#[derive(Debug, Default)]
struct Link {
    /// A publisher completed the ZMTP handshake and has not dropped since: something
    /// that speaks ZMQ is there (a TCP connection alone proves nothing: any server
    /// accepts one).
    up: bool,
    /// It dropped after a handshake: whoever completes the next one may be a
    /// restarted engine.
    dropped: bool,
    /// A handshake completed after a drop and the worker is not rebuilt yet.
    rejoined: bool,
}

struct Thread<'a> {
    sub: &'a Subscriber,
    /// The open sockets (between a successful open and the end of the socket loop);
    /// shared with the loop that reads them so that any wait can read the monitor.
    sockets: Option<Rc<Sockets>>,
    link: Link,
    cursor: Cursor,
    decoded: DecodedBatch,
    groups: GroupFilter,
    /// Every worker key this source has fed (its own, and registered sibling ranks a
    /// batch's dp rank named).
    keys: Vec<WorkerKey>,
    /// Workers already marked as publishing signed hashes.
    signed: Vec<WorkerKey>,
    warnings: Warnings,
    /// A clear the ingestion queue could not take yet: it goes before the next batch.
    pending_clear: bool,
    /// An unknown parent already rebuilt the worker since the last loss.
    parent_rebuilt: bool,
    /// This thread's scheduling policy, as the ingestion path's setting says.
    follower: Follower,
}

impl Thread<'_> {
    fn stopped(&self) -> bool {
        self.sub.shared.stop.load(Ordering::Relaxed)
    }

    fn stats(&self) -> &SourceStats {
        &self.sub.shared.stats
    }

    fn endpoints(&self) -> &Endpoints {
        &self.sub.shared.endpoints
    }

    /// Sleeps `wait`, waking early when stopped; the monitor is read meanwhile.
    fn pause(&mut self, wait: Duration) {
        let until = Instant::now() + wait;
        while !self.stopped() && Instant::now() < until {
            self.follower.follow(self.sub.ingest.scheduling());
            self.read_monitor();
            std::thread::sleep(POLL.min(until.saturating_duration_since(Instant::now())));
        }
    }

    /// Takes every event the monitor holds, noting what it says in `self.link` (and
    /// the stats); acting on it is the socket loop's. Called from every wait, so
    /// libzmq's I/O thread, shared by all sockets, never blocks on a full monitor.
    fn read_monitor(&mut self) {
        let Some(sockets) = self.sockets.clone() else {
            return;
        };
        while let Ok(frames) = sockets.monitor.recv_multipart(zmq::DONTWAIT) {
            // The first frame: the event (u16) and its value (u32), little-endian.
            let Some(head) = frames.first().and_then(|f| f.get(..6)) else {
                continue;
            };
            let event = u16::from_le_bytes([head[0], head[1]]);
            let value = u32::from_le_bytes([head[2], head[3], head[4], head[5]]);
            self.link_event(event, value);
        }
    }

    fn link_event(&mut self, event: u16, value: u32) {
        use zmq::SocketEvent as E;
        if event == E::HANDSHAKE_SUCCEEDED.to_raw() {
            self.link.up = true;
            if self.link.dropped {
                self.link.dropped = false;
                self.link.rejoined = true;
            }
        } else if event == E::DISCONNECTED.to_raw() {
            // Only a publisher's drop counts: a peer that never completed a handshake
            // (not a publisher, or not yet) held nothing the worker's entries rest on.
            if self.link.up {
                self.link.up = false;
                self.link.dropped = true;
            }
        } else if [
            E::HANDSHAKE_FAILED_NO_DETAIL,
            E::HANDSHAKE_FAILED_PROTOCOL,
            E::HANDSHAKE_FAILED_AUTH,
        ]
        .iter()
        .any(|e| e.to_raw() == event)
        {
            self.stats()
                .handshake_failures
                .fetch_add(1, Ordering::Relaxed);
            let why = if event == E::HANDSHAKE_FAILED_NO_DETAIL.to_raw() {
                // The value is the errno of the failure; 0 when the peer just hung up.
                match value {
                    0 => "the peer closed the connection".to_string(),
                    errno => std::io::Error::from_raw_os_error(errno as i32).to_string(),
                }
            } else {
                format!("ZMTP error {value:#x}")
            };
            let endpoints = self.endpoints();
            let problem = if endpoints.bind {
                format!(
                    "a peer that connected to {} is not a ZMQ publisher: its handshake failed ({why})",
                    endpoints.events
                )
            } else {
                format!(
                    "the peer at {} is not a ZMQ publisher, or not yet: its handshake failed ({why}); retrying",
                    endpoints.events
                )
            };
            if self.warnings.due(Warn::Handshake) {
                tracing::warn!(
                    worker_id = self.sub.shared.worker.worker_id,
                    dp_rank = self.sub.shared.worker.dp_rank,
                    "KV-event source: {problem}"
                );
            }
            self.stats().set_error(&problem);
        }
    }

    fn run(&mut self) {
        let (first, longest) = self.sub.options.backoff;
        let mut backoff = first;
        let mut replayed_history = false;
        while !self.stopped() {
            self.follower.follow(self.sub.ingest.scheduling());
            let sockets = match self.open() {
                Ok(sockets) => sockets,
                Err(problem) => {
                    // Failed, not connecting: status and `/metrics` say so (with the
                    // reason) until an attempt succeeds.
                    self.stats().socket_errors.fetch_add(1, Ordering::Relaxed);
                    self.stats().set_error(&problem);
                    self.stats().set_state(SourceState::Failed);
                    if self.warnings.due(Warn::Socket) {
                        tracing::warn!(
                            worker_id = self.sub.shared.worker.worker_id,
                            dp_rank = self.sub.shared.worker.dp_rank,
                            source = %self.endpoints(),
                            "KV-event subscription failed, retrying in {backoff:?}: {problem}"
                        );
                    }
                    self.pause(backoff);
                    backoff = (backoff * 2).min(longest);
                    continue;
                }
            };
            backoff = first;
            self.stats().connects.fetch_add(1, Ordering::Relaxed);
            // Live once a publisher's handshake completes (the socket monitor says so)
            // or a batch arrives; until then, connecting.
            self.stats().set_state(SourceState::Connecting);
            self.sockets = Some(Rc::new(sockets));
            self.link = Link::default();
            // The replay buffer is the only history an engine keeps: load it once, so
            // a router started after the engine knows what the engine cached lately.
            if !replayed_history && self.endpoints().replay.is_some() {
                replayed_history = true;
                self.recover(Recovery::History);
            }
            self.receive();
            // Closes both sockets, in the order `Sockets` keeps.
            self.sockets = None;
        }
    }

    fn open(&self) -> Result<Sockets, String> {
        let endpoints = self.endpoints();
        let socket = self
            .sub
            .context
            .socket(zmq::SUB)
            .map_err(|e| format!("cannot create a SUB socket: {e}"))?;
        let setup = || -> Result<(), zmq::Error> {
            socket.set_linger(0)?;
            socket.set_maxmsgsize(MAX_MESSAGE_BYTES)?;
            socket.set_rcvhwm(self.sub.options.receive_hwm)?;
            socket.set_reconnect_ivl(self.sub.options.backoff.0.as_millis() as i32)?;
            socket.set_reconnect_ivl_max(self.sub.options.backoff.1.as_millis() as i32)?;
            socket.set_ipv6(endpoints.events.contains('['))?;
            socket.set_subscribe(endpoints.topic.as_bytes())?;
            Ok(())
        };
        setup().map_err(|e| format!("cannot configure the SUB socket: {e}"))?;
        // The socket's own connection events: a publisher that went away and came back
        // may be a restarted engine whose first batches were lost before the
        // subscription rejoined, which its sequence numbers alone cannot show.
        // Monitored before it binds or connects: libzmq's monitor blocks on an event
        // until our PAIR is there to take it, so the PAIR is connected before any
        // connection activity can raise one.
        let address = format!(
            "inproc://kvhint-monitor-{}",
            MONITORS.fetch_add(1, Ordering::Relaxed)
        );
        // The handshake's outcome, not the TCP connection: any server accepts one, and
        // only a completed ZMTP handshake says a publisher is there.
        let events = zmq::SocketEvent::HANDSHAKE_SUCCEEDED.to_raw()
            | zmq::SocketEvent::HANDSHAKE_FAILED_NO_DETAIL.to_raw()
            | zmq::SocketEvent::HANDSHAKE_FAILED_PROTOCOL.to_raw()
            | zmq::SocketEvent::HANDSHAKE_FAILED_AUTH.to_raw()
            | zmq::SocketEvent::DISCONNECTED.to_raw();
        let monitor = self
            .sub
            .context
            .socket(zmq::PAIR)
            .map_err(|e| format!("cannot create a monitor socket: {e}"))?;
        socket
            .monitor(&address, i32::from(events))
            .map_err(|e| format!("cannot monitor the SUB socket: {e}"))?;
        // From here the monitor runs: `Sockets` stops it before anything closes,
        // whatever fails next.
        let sockets = Sockets {
            sub: socket,
            monitor,
        };
        sockets
            .monitor
            .connect(&address)
            .map_err(|e| format!("cannot monitor the SUB socket: {e}"))?;
        if endpoints.bind {
            sockets.sub.bind(&endpoints.events).map_err(|e| {
                format!(
                    "cannot bind {}: {e} (is another process, or another worker's source, \
                     bound there?)",
                    endpoints.events
                )
            })?;
        } else {
            sockets
                .sub
                .connect(&endpoints.events)
                .map_err(|e| format!("cannot connect to {}: {e}", endpoints.events))?;
        }
        Ok(sockets)
    }

    /// Reads batches until stopped or the socket fails.
    fn receive(&mut self) {
        let Some(sockets) = self.sockets.clone() else {
            return;
        };
        while !self.stopped() {
            self.follower.follow(self.sub.ingest.scheduling());
            // The monitor first: libzmq sends an event before the batches that follow
            // it, so a publisher's return is mostly seen before its first batch (one
            // that arrives first is caught in `message`).
            self.read_monitor();
            self.follow_link();
            let mut items = [
                sockets.sub.as_poll_item(zmq::POLLIN),
                sockets.monitor.as_poll_item(zmq::POLLIN),
            ];
            match zmq::poll(&mut items, POLL.as_millis() as i64) {
                Ok(0) => continue,
                Ok(_) => {}
                Err(e) => {
                    self.stats()
                        .set_error(&format!("polling the SUB socket failed: {e}"));
                    return;
                }
            }
            if !items[0].is_readable() {
                continue;
            }
            let frames = match sockets.sub.recv_multipart(zmq::DONTWAIT) {
                Ok(frames) => frames,
                Err(zmq::Error::EAGAIN) => continue,
                Err(e) => {
                    self.stats().set_error(&format!("receiving failed: {e}"));
                    return;
                }
            };
            self.message(&frames);
        }
    }

    /// Acts on what the monitor said: live while a publisher's handshake holds, and a
    /// publisher that came back after a drop may be a restarted engine whose first
    /// batches were lost before the subscription rejoined, which its sequence numbers
    /// alone cannot show.
    fn follow_link(&mut self) {
        let state = self.stats().state();
        if self.link.up && state == SourceState::Connecting {
            self.stats().set_state(SourceState::Live);
        } else if self.link.dropped && state == SourceState::Live {
            self.stats().set_state(SourceState::Connecting);
        }
        if std::mem::take(&mut self.link.rejoined) {
            self.reconnected();
        }
    }

    fn message(&mut self, frames: &[Vec<u8>]) {
        let [topic, seq, payload] = frames else {
            self.stats().frame_errors.fetch_add(1, Ordering::Relaxed);
            return;
        };
        // A SUB subscription matches by prefix; only this exact topic is ours.
        if topic.as_slice() != self.endpoints().topic.as_bytes() {
            self.stats().other_topic.fetch_add(1, Ordering::Relaxed);
            if self.warnings.due(Warn::Topic) {
                tracing::warn!(
                    worker_id = self.sub.shared.worker.worker_id,
                    dp_rank = self.sub.shared.worker.dp_rank,
                    "ignored a KV-event batch on topic {:?}; this source expects {:?}: set                      the source's `topic` to the engine's",
                    String::from_utf8_lossy(topic),
                    self.endpoints().topic
                );
            }
            return;
        }
        let Ok(seq) = <[u8; 8]>::try_from(seq.as_slice()).map(u64::from_be_bytes) else {
            self.stats().frame_errors.fetch_add(1, Ordering::Relaxed);
            return;
        };
        // A batch of ours: a publisher is there, whether or not its handshake was
        // reported yet (the event may still be on its way; a ZMTP 2 peer reports
        // none). Junk frames are not one.
        if self.stats().state() == SourceState::Connecting {
            self.stats().set_state(SourceState::Live);
        }
        if !self.link.up {
            self.link.up = true;
            if std::mem::take(&mut self.link.dropped) {
                self.reconnected();
            }
        }
        match self.cursor.classify(seq) {
            // The socket delivers in order: once the next new batch arrives, the live
            // copies of replayed batches are behind it, and a lower sequence from now
            // on can only be a restarted publisher.
            Next::Apply => self.cursor.replayed_from = None,
            Next::Duplicate => {
                self.stats().duplicates.fetch_add(1, Ordering::Relaxed);
                return;
            }
            Next::Restart => {
                self.stats().restarts.fetch_add(1, Ordering::Relaxed);
                if self.warnings.due(Warn::Recovery) {
                    tracing::warn!(
                        worker_id = self.sub.shared.worker.worker_id,
                        dp_rank = self.sub.shared.worker.dp_rank,
                        seq,
                        expected = self.cursor.expected,
                        "the KV-event publisher restarted (its sequence went back); clearing \
                         this worker's index entries, they are rebuilt from its new events"
                    );
                }
                self.cursor = Cursor::default();
                self.recover(Recovery::Rebuild);
            }
            Next::Gap { from } => {
                self.stats().gaps.fetch_add(1, Ordering::Relaxed);
                self.recover(Recovery::Gap { from });
            }
        }
        if self.cursor.expected.is_some_and(|e| e > seq) {
            // A replay already brought this batch.
            return;
        }
        let outcome = self.apply(seq, payload);
        self.after(seq, outcome);
    }

    /// What a live batch's outcome asks for.
    fn after(&mut self, seq: u64, outcome: Applied) {
        match outcome {
            Applied::Ok => {}
            // Not queued: lost, as a dropped message would be; the replay may have it.
            Applied::Lost => self.recover(Recovery::Gap { from: seq }),
            // A replay would bring the same bytes: the worker's state is unknown.
            Applied::Malformed => self.recover(Recovery::Clear),
            Applied::UnknownParent if !self.parent_rebuilt => {
                if self.warnings.due(Warn::Recovery) {
                    tracing::warn!(
                        worker_id = self.sub.shared.worker.worker_id,
                        dp_rank = self.sub.shared.worker.dp_rank,
                        seq,
                        "a stored KV event chains onto a block this worker never stored: \
                         its events were lost; rebuilding its index entries"
                    );
                }
                self.recover(Recovery::Rebuild);
                // Blocks whose parents are older than anything the engine still has
                // stay unknown: rebuild once per loss, not on every orphan.
                self.parent_rebuilt = true;
            }
            Applied::UnknownParent => {}
        }
    }

    /// The publisher came back after its connection dropped. It may be the same
    /// process (a network blip) or a restarted engine with an empty cache and a new
    /// sequence whose first batches this socket missed: assume the worse, forget the
    /// worker's entries and rebuild them from what the engine still buffers.
    fn reconnected(&mut self) {
        self.stats().reconnects.fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            worker_id = self.sub.shared.worker.worker_id,
            dp_rank = self.sub.shared.worker.dp_rank,
            "the KV-event publisher reconnected; rebuilding this worker's index entries"
        );
        self.cursor = Cursor::default();
        self.recover(Recovery::Rebuild);
    }

    /// The worker key a batch's events belong to: its own rank field names a sibling
    /// rank only if that rank is registered (anything else is counted and dropped, so
    /// a publisher cannot make this source track keys without bound).
    fn key_for(&self, dp_rank: Option<u32>) -> Option<WorkerKey> {
        let own = self.sub.shared.worker;
        match dp_rank {
            None => Some(own),
            Some(rank) if rank == own.dp_rank => Some(own),
            Some(rank) => {
                let key = WorkerKey {
                    worker_id: own.worker_id,
                    dp_rank: rank,
                };
                self.sub.router.has_worker(key).then_some(key)
            }
        }
    }

    /// Decodes and applies one batch; `seq` becomes the last one applied. Never
    /// recovers by itself: the caller decides from the outcome.
    fn apply(&mut self, seq: u64, payload: &[u8]) -> Applied {
        self.cursor.expected = Some(seq.wrapping_add(1));
        let stats = &self.sub.shared.stats;
        stats.last_seq.store(seq, Ordering::Relaxed);
        stats.touch();
        let settings = self.sub.settings.load();
        if let Err(error) = decode_batch(payload, &settings, &mut self.groups, &mut self.decoded) {
            stats.decode_errors.fetch_add(1, Ordering::Relaxed);
            if self.warnings.due(Warn::Decode) {
                tracing::warn!(
                    worker_id = self.sub.shared.worker.worker_id,
                    dp_rank = self.sub.shared.worker.dp_rank,
                    seq,
                    "skipped a KV-event batch ({error}); its events are lost, so this \
                     worker's index entries are cleared and rebuilt from its next events"
                );
            }
            return Applied::Malformed;
        }
        stats.batches.fetch_add(1, Ordering::Relaxed);
        stats.record(&self.decoded);
        if self.decoded.counts.wrong_block_size > 0 && self.warnings.due(Warn::BlockSize) {
            tracing::warn!(
                worker_id = self.sub.shared.worker.worker_id,
                dp_rank = self.sub.shared.worker.dp_rank,
                engine_block_size = self.decoded.counts.last_wrong_block_size,
                router_block_size = settings.block_size,
                "refused stored KV events: the engine's block size differs from the router's; \
                 set `router.block_size` to the engine's block size (vLLM --block-size, SGLang \
                 --page-size), or the engine's to the router's"
            );
        }
        if let Some(problem) = &self.decoded.counts.last_malformed {
            if self.warnings.due(Warn::Decode) {
                tracing::warn!(
                    worker_id = self.sub.shared.worker.worker_id,
                    dp_rank = self.sub.shared.worker.dp_rank,
                    seq,
                    "refused a KV event: {problem}"
                );
            }
        }
        if self.decoded.events.is_empty() {
            return Applied::Ok;
        }
        let Some(worker) = self.key_for(self.decoded.dp_rank) else {
            stats.unknown_worker.fetch_add(1, Ordering::Relaxed);
            if self.warnings.due(Warn::Rank) {
                tracing::warn!(
                    worker_id = self.sub.shared.worker.worker_id,
                    dp_rank = self.sub.shared.worker.dp_rank,
                    batch_dp_rank = self.decoded.dp_rank,
                    "dropped a KV-event batch whose dp_rank names a rank of this worker that \
                     is not registered; register that rank (or give each rank its own source)"
                );
            }
            self.decoded.events.clear();
            return Applied::Ok;
        };
        if !self.keys.contains(&worker) {
            self.keys.push(worker);
        }
        if self.decoded.hashes.signed
            && !self.signed.contains(&worker)
            && self.sub.router.mark_signed_hashes(worker)
        {
            // Once per worker: its kv.fetch hashes are written back signed.
            self.signed.push(worker);
        }
        let events: Vec<(WorkerKey, KvEvent)> = self
            .decoded
            .events
            .drain(..)
            .map(|event| (worker, event))
            .collect();
        let Some(results) = self.submit(events) else {
            self.stats().dropped.fetch_add(1, Ordering::Relaxed);
            return Applied::Lost;
        };
        let mut outcome = Applied::Ok;
        for result in results {
            match result {
                Ok(_) => {}
                Err(RouterError::KvEvent {
                    unknown_parent: true,
                    ..
                }) => {
                    stats.unknown_parent.fetch_add(1, Ordering::Relaxed);
                    outcome = Applied::UnknownParent;
                }
                Err(RouterError::UnknownWorker { .. }) => {
                    stats.unknown_worker.fetch_add(1, Ordering::Relaxed);
                }
                Err(_) => {
                    stats.refused.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        outcome
    }

    /// Queues events and waits until they are visible, or `None` if the queue stayed
    /// full (the router is overloaded: the batch is dropped and recovered later) or the
    /// source was stopped. A clear that could not be queued before goes first.
    fn submit(
        &mut self,
        mut events: Vec<(WorkerKey, KvEvent)>,
    ) -> Option<Vec<Result<ApplyStats, RouterError>>> {
        let clears = if self.pending_clear {
            let clears: Vec<_> = self.keys.iter().map(|k| (*k, KvEvent::Cleared)).collect();
            let n = clears.len();
            events.splice(0..0, clears);
            n
        } else {
            0
        };
        // A fresh reply channel per batch: a reply that comes too late cannot be
        // taken for the next batch's.
        let (reply, results) = crossbeam_channel::bounded(1);
        // A full queue is a burst: wait for room a little (1 + 2 + … + 64 ms), then
        // give the batch up rather than stall the socket behind it.
        for attempt in 0..8u32 {
            if self.stopped() {
                return None;
            }
            match self.sub.ingest.submit_batch(events, reply.clone()) {
                Ok(()) => {
                    self.pending_clear = false;
                    let mut waited = Duration::ZERO;
                    while waited < SUBMIT_WAIT {
                        // A stopped source ends now (its sockets closed), not when
                        // the router gets round to the batch.
                        if self.stopped() {
                            return None;
                        }
                        self.read_monitor();
                        match results.recv_timeout(POLL) {
                            Ok(mut results) => {
                                results.drain(..clears.min(results.len()));
                                return Some(results);
                            }
                            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                                waited += POLL;
                            }
                            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => {
                                return None;
                            }
                        }
                    }
                    return None;
                }
                Err((_, back)) => {
                    events = back;
                    std::thread::sleep(Duration::from_millis(1 << attempt.min(6)));
                }
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(next: Next) -> &'static str {
        match next {
            Next::Apply => "apply",
            Next::Gap { .. } => "gap",
            Next::Duplicate => "duplicate",
            Next::Restart => "restart",
        }
    }

    #[test]
    fn sequences_classify_as_next_gap_duplicate_or_restart() {
        let mut cursor = Cursor::default();
        assert_eq!(kind(cursor.classify(17)), "apply", "the first batch heard");
        cursor.expected = Some(18);
        assert_eq!(kind(cursor.classify(18)), "apply");
        assert!(matches!(cursor.classify(21), Next::Gap { from: 18 }));
        assert_eq!(
            kind(cursor.classify(5)),
            "restart",
            "back, with no replay behind"
        );
        assert_eq!(kind(cursor.classify(0)), "restart");
        // Right after a replay of 10.., live copies of 10..18 are duplicates; below the
        // replay's first batch is a restart.
        cursor.replayed_from = Some(10);
        assert_eq!(kind(cursor.classify(12)), "duplicate");
        assert_eq!(kind(cursor.classify(9)), "restart");
        assert_eq!(kind(cursor.classify(0)), "restart");
        cursor.replayed_from = Some(0);
        assert_eq!(
            kind(cursor.classify(0)),
            "duplicate",
            "a replay from 0 overlaps 0"
        );
    }
}
