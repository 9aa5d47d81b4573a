//! Replicas: several kvhint instances that share booking load over NATS core.
//!
//! Each replica keeps its bookings, their ids, TTL and caps to itself; what it shares
//! is each worker's load from its own bookings, as absolute totals. Two parts, and
//! neither touches the booking path:
//! - the **publisher** (a thread of its own) reads the local load cells every
//!   `publish_interval_ms`, publishes the workers whose totals changed (coalesced
//!   between ticks), and every `digest_interval_ms` a full digest that doubles as the
//!   heartbeat;
//! - the **receiver** (an async task) folds the peers' messages into per-worker sums
//!   ([`merge::Merge`]) and stores each sum beside the local load, in the worker's
//!   own cache line ([`crate::router::workers::LoadCell::set_remote`]); selection
//!   reads local + remote. It drops silent peers and re-syncs after a reconnect.
//!
//! Fail open: a booking never waits for NATS. Without the bus a replica books on what
//! it knows, and its peers drop it after `peer_timeout_ms`; the client reconnects with
//! backoff, and the first thing a replica says on (re)connecting is `hello`, which
//! every peer answers with a digest.

pub mod merge;

use crate::config::{NatsAuth, ReplicationConfig};
use crate::domain::WorkerKey;
use crate::router::workers::Load;
use crate::router::Router;
use futures_util::StreamExt;
use merge::{encode, Body, Merge, Message, Outbox, PeerStatus, WorkerId};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Propagation-lag histogram bounds, in microseconds.
pub const LAG_BUCKETS_US: [u64; 12] = [
    100, 250, 500, 1_000, 1_500, 2_500, 5_000, 10_000, 25_000, 100_000, 1_000_000, 10_000_000,
];

/// What the replication counts, for `/metrics`.
#[derive(Debug, Default)]
pub struct Counters {
    /// Propagation lag of peers' deltas (their change seen → applied here).
    pub lag_buckets: [AtomicU64; LAG_BUCKETS_US.len()],
    pub lag_count: AtomicU64,
    pub lag_sum_us: AtomicU64,
    pub published: AtomicU64,
    /// Messages not published (the client's buffer full while NATS is away).
    pub publish_failures: AtomicU64,
    pub received: AtomicU64,
    pub decode_errors: AtomicU64,
    /// Times the connection to NATS was lost.
    pub disconnects: AtomicU64,
}

impl Counters {
    fn lag(&self, us: u64) {
        if let Some(i) = LAG_BUCKETS_US.iter().position(|b| us <= *b) {
            self.lag_buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        self.lag_count.fetch_add(1, Ordering::Relaxed);
        self.lag_sum_us.fetch_add(us, Ordering::Relaxed);
    }
}

/// What `/admin/status` shows of replication, refreshed by the receiver.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct View {
    pub ready: bool,
    pub peers: Vec<PeerStatus>,
    /// Peers refused for another block size: (name, their block size).
    pub refused: Vec<(String, u64)>,
    pub stats: StatsView,
}

/// The merge's counts as the metrics read them.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct StatsView {
    pub corrections: u64,
    pub dropped_silent: u64,
    pub left: u64,
    pub replaced: u64,
    pub refused_block_size: u64,
    pub refused_name: u64,
    pub refused_peers: u64,
    pub fingerprint_mismatches: u64,
}

/// Why replication could not start.
#[derive(Debug, thiserror::Error)]
pub enum ReplicationError {
    #[error("replication.nats_url {url:?}: {message}")]
    Connect { url: String, message: String },
    #[error("could not start the replication thread: {0}")]
    Thread(std::io::Error),
}

struct Shared {
    router: Arc<Router>,
    name: String,
    incarnation: u64,
    subject: String,
    config: ReplicationConfig,
    fingerprint: AtomicU64,
    connected: AtomicBool,
    digest_now: AtomicBool,
    hello_now: AtomicBool,
    stop: AtomicBool,
    counters: Counters,
    view: parking_lot::Mutex<View>,
    /// Set when the client (re)connects: the receiver re-syncs.
    reconnected: tokio::sync::Notify,
}

/// A running replication: the publisher thread and the receiver task.
pub struct Replication {
    shared: Arc<Shared>,
    client: async_nats::Client,
    publisher: parking_lot::Mutex<Option<std::thread::JoinHandle<()>>>,
    receiver: tokio::task::JoinHandle<()>,
    /// The other replicas' summed view, per worker, changes only through this.
    _handle: tokio::runtime::Handle,
}

fn unix_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// This host's name (the default replica name).
pub fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: `buf` is writable for its whole length, which is what we pass.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    let name: String = String::from_utf8_lossy(&buf[..end])
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if rc != 0 || name.is_empty() {
        format!("kvhint-{}", std::process::id())
    } else {
        name
    }
}

impl Replication {
    /// Connects (in the background: a NATS server that is not up yet is retried with
    /// backoff, and bookings never wait) and starts publishing and receiving.
    pub async fn start(
        router: Arc<Router>,
        config: &ReplicationConfig,
        fingerprint: u64,
    ) -> Result<Arc<Self>, ReplicationError> {
        let name = config.name.clone().unwrap_or_else(host_name);
        // Nanoseconds since the epoch: a restart under the same name is larger.
        let incarnation = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64);
        let shared = Arc::new(Shared {
            router,
            name: name.clone(),
            incarnation,
            subject: format!("kvhint.load.{}", config.fleet),
            config: config.clone(),
            fingerprint: AtomicU64::new(fingerprint),
            connected: AtomicBool::new(false),
            digest_now: AtomicBool::new(true),
            hello_now: AtomicBool::new(true),
            stop: AtomicBool::new(false),
            counters: Counters::default(),
            view: parking_lot::Mutex::new(View::default()),
            reconnected: tokio::sync::Notify::new(),
        });
        let events = Arc::clone(&shared);
        let mut options = async_nats::ConnectOptions::new()
            .name(format!("kvhint {name}"))
            .retry_on_initial_connect()
            .max_reconnects(None)
            .ping_interval(Duration::from_secs(2))
            .connection_timeout(Duration::from_secs(2))
            .reconnect_delay_callback(|attempts| {
                Duration::from_millis(50u64 << attempts.min(5) as u64).min(Duration::from_secs(1))
            })
            .event_callback(move |event| {
                let shared = Arc::clone(&events);
                async move {
                    match event {
                        async_nats::Event::Connected => {
                            tracing::info!("replication: connected to NATS");
                            shared.connected.store(true, Ordering::Relaxed);
                            shared.reconnected.notify_one();
                        }
                        async_nats::Event::Disconnected => {
                            tracing::warn!("replication: lost NATS; booking on this replica's own view until it is back");
                            shared.connected.store(false, Ordering::Relaxed);
                            shared.counters.disconnects.fetch_add(1, Ordering::Relaxed);
                        }
                        // Refused credentials, a TLS failure: the operator must see them.
                        other @ (async_nats::Event::ServerError(_)
                        | async_nats::Event::ClientError(_)) => {
                            tracing::warn!(event = %other, "replication: NATS")
                        }
                        other => tracing::debug!(event = %other, "replication: NATS event"),
                    }
                }
            });
        match &config.auth {
            Some(NatsAuth::UserPassword { user, password }) => {
                options = options.user_and_password(user.clone(), password.clone());
            }
            Some(NatsAuth::Token(token)) => options = options.token(token.clone()),
            Some(NatsAuth::NKey(seed)) => options = options.nkey(seed.clone()),
            Some(NatsAuth::Credentials(creds)) => {
                // Parsed once already when the config was read; a failure here
                // says what, never the file's text.
                options = options
                    .credentials(creds)
                    .map_err(|e| ReplicationError::Connect {
                        url: config.nats_url.clone(),
                        message: format!("replication.credentials_file: {e}"),
                    })?;
            }
            None => {}
        }
        if let Some(ca) = &config.tls_ca_file {
            options = options.add_root_certificates(ca.clone()).require_tls(true);
        }
        let client = options
            .connect(config.nats_url.as_str())
            .await
            .map_err(|e| ReplicationError::Connect {
                url: config.nats_url.clone(),
                message: e.to_string(),
            })?;
        let subscriber = client
            .subscribe(shared.subject.clone())
            .await
            .map_err(|e| ReplicationError::Connect {
                url: config.nats_url.clone(),
                message: e.to_string(),
            })?;
        let handle = tokio::runtime::Handle::current();
        let receiver = tokio::spawn(receive(Arc::clone(&shared), client.clone(), subscriber));
        let publisher = {
            let shared = Arc::clone(&shared);
            let client = client.clone();
            let handle = handle.clone();
            std::thread::Builder::new()
                .name("kvhint-replication".into())
                .spawn(move || publish(&shared, &client, &handle))
                .map_err(ReplicationError::Thread)?
        };
        tracing::info!(replica = %name, fleet = %config.fleet, nats = %config.nats_url, "replication started");
        Ok(Arc::new(Self {
            shared,
            client,
            publisher: parking_lot::Mutex::new(Some(publisher)),
            receiver,
            _handle: handle,
        }))
    }

    pub fn name(&self) -> &str {
        &self.shared.name
    }

    pub fn incarnation(&self) -> u64 {
        self.shared.incarnation
    }

    pub fn fleet(&self) -> &str {
        &self.shared.config.fleet
    }

    pub fn connected(&self) -> bool {
        self.shared.connected.load(Ordering::Relaxed)
    }

    /// The config or plugin set changed (a reload): peers are told with the next message.
    pub fn set_fingerprint(&self, fingerprint: u64) {
        self.shared
            .fingerprint
            .store(fingerprint, Ordering::Relaxed);
    }

    pub fn counters(&self) -> &Counters {
        &self.shared.counters
    }

    pub fn view(&self) -> View {
        self.shared.view.lock().clone()
    }

    /// Says goodbye (peers drop this replica at once) and stops.
    pub async fn shutdown(&self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        let publisher = self.publisher.lock().take();
        if let Some(publisher) = publisher {
            let _ = tokio::task::spawn_blocking(move || publisher.join()).await;
        }
        self.receiver.abort();
        let _ = tokio::time::timeout(Duration::from_secs(1), self.client.flush()).await;
    }
}

/// A fingerprint of what makes two replicas choose alike: the router mode, each
/// role's selection (type and parameters) and hint policies, and the plugin files'
/// digests (not their paths, nor anything replica-specific such as the name).
pub fn fingerprint(snapshot: &crate::snapshot::Snapshot) -> u64 {
    let roles: Vec<serde_json::Value> = snapshot
        .roles
        .iter()
        .map(|role| {
            serde_json::json!([
                role.role,
                role.booking_selection_type,
                role.selection_parameters,
                role.hints
                    .policies()
                    .iter()
                    .map(|p| p.type_name.to_string())
                    .collect::<Vec<_>>(),
            ])
        })
        .collect();
    let mut plugins: Vec<&str> = snapshot.plugins.iter().map(|p| &*p.sha256).collect();
    plugins.sort_unstable();
    let text = serde_json::json!([snapshot.mode.as_str(), roles, plugins]).to_string();
    xxhash_rust::xxh3::xxh3_64(text.as_bytes())
}

/// The summed view's checksum: every worker's load as selection sees it (this
/// replica's and its peers'), in key order. Replicas that agree show the same.
pub fn checksum(router: &Router) -> String {
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    let mut workers = router.workers();
    workers.sort_by_key(|(w, _)| (w.key, w.role));
    for (worker, load) in workers {
        for n in [
            worker.key.worker_id,
            u64::from(worker.key.dp_rank),
            load.active_requests,
            load.active_blocks,
            load.prefill_blocks,
        ] {
            hasher.update(&n.to_le_bytes());
        }
    }
    format!("{:016x}", hasher.digest())
}

/// The publisher thread: polls the local load, publishes changes, digests and the
/// goodbye.
fn publish(shared: &Shared, client: &async_nats::Client, handle: &tokio::runtime::Handle) {
    let config = &shared.config;
    let mut outbox = Outbox::new(
        shared.name.clone(),
        shared.incarnation,
        shared.router.block_size() as u64,
    );
    let tick = Duration::from_millis(config.publish_interval_ms);
    let digest_every = Duration::from_millis(config.digest_interval_ms);
    let mut last_digest = Instant::now();
    let mut current: Vec<(WorkerId, Load)> = Vec::new();
    let mut too_small = Throttle::new(Duration::from_secs(10));
    let send = |payload: Vec<u8>| {
        // The client buffers while NATS is away; when its buffer is full, the message
        // is dropped rather than wait (totals are absolute: the next one corrects it).
        let sent = handle.block_on(async {
            tokio::time::timeout(
                Duration::from_millis(50),
                client.publish(shared.subject.clone(), bytes::Bytes::from(payload)),
            )
            .await
        });
        if matches!(sent, Ok(Ok(()))) {
            shared.counters.published.fetch_add(1, Ordering::Relaxed);
        } else {
            shared
                .counters
                .publish_failures
                .fetch_add(1, Ordering::Relaxed);
        }
    };
    // Each message within the server's max payload (from its INFO; 1 MiB by
    // default): a larger one would be refused whole, and with it the loss
    // correction and a joiner's sync a digest carries.
    let mut send_all = |payloads: Option<Vec<Vec<u8>>>| match payloads {
        Some(payloads) => payloads.into_iter().for_each(&send),
        None => {
            shared
                .counters
                .publish_failures
                .fetch_add(1, Ordering::Relaxed);
            if let Some(suppressed) = too_small.allow(Instant::now()) {
                tracing::error!(max_payload = client.max_payload(), suppressed, "replication: the NATS server's max_payload is too small for one worker's load in a message; raise it");
            }
        }
    };
    loop {
        let max_payload = client.max_payload();
        let fingerprint = shared.fingerprint.load(Ordering::Relaxed);
        if shared.stop.load(Ordering::Relaxed) {
            send(encode(&outbox.message(
                Body::Goodbye,
                fingerprint,
                unix_us(),
            )));
            return;
        }
        std::thread::sleep(tick);
        let seen_us = unix_us();
        current.clear();
        current.extend(shared.router.worker_table().all().map(|e| {
            (
                WorkerId {
                    role: e.worker.role,
                    worker_id: e.worker.key.worker_id,
                    dp_rank: e.worker.key.dp_rank,
                },
                e.load.local(),
            )
        }));
        let loads = outbox.changes(&current);
        if !loads.is_empty() {
            send_all(outbox.delta_messages(loads, fingerprint, seen_us, max_payload));
        }
        if shared.hello_now.swap(false, Ordering::Relaxed) {
            send(encode(&outbox.message(Body::Hello, fingerprint, seen_us)));
        }
        if shared.digest_now.swap(false, Ordering::Relaxed) || last_digest.elapsed() >= digest_every
        {
            last_digest = Instant::now();
            let peers = shared
                .view
                .lock()
                .peers
                .iter()
                .map(|p| p.name.clone())
                .collect();
            send_all(outbox.digest_messages(peers, fingerprint, seen_us, max_payload));
        }
    }
}

/// Stores each changed worker's summed peer load beside its local load.
fn apply(router: &Router, merge: &Merge, changed: &[WorkerId]) {
    let table = router.worker_table();
    for id in changed {
        let key = WorkerKey {
            worker_id: id.worker_id,
            dp_rank: id.dp_rank,
        };
        if let Some(entry) = table.get(key).filter(|e| e.worker.role == id.role) {
            entry.load.set_remote(merge.sum(id));
        }
    }
}

/// Every registered worker's remote load set from the sums (workers registered since,
/// or re-registered under another role, included).
fn reconcile(router: &Router, merge: &Merge) {
    for entry in router.worker_table().all() {
        let id = WorkerId {
            role: entry.worker.role,
            worker_id: entry.worker.key.worker_id,
            dp_rank: entry.worker.key.dp_rank,
        };
        let want = merge.sum(&id);
        if entry.load.remote() != want {
            entry.load.set_remote(want);
        }
    }
}

/// The receiver task: folds peers' messages in, drops silent peers, re-syncs after a
/// reconnect.
async fn receive(
    shared: Arc<Shared>,
    client: async_nats::Client,
    mut subscriber: async_nats::Subscriber,
) {
    let config = &shared.config;
    let mut merge = Merge::new(
        shared.name.clone(),
        shared.router.block_size() as u64,
        shared.fingerprint.load(Ordering::Relaxed),
        Duration::from_millis(config.peer_timeout_ms),
        Duration::from_millis(config.sync_timeout_ms),
        Instant::now(),
    );
    let mut housekeeping = tokio::time::interval(Duration::from_millis(100));
    housekeeping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_sync_ask = Instant::now();
    let mut connected_once = false;
    let mut decode_warnings = Throttle::new(Duration::from_secs(10));
    loop {
        tokio::select! {
            next = subscriber.next() => {
                let Some(raw) = next else {
                    // The subscription ended (the client closed): resubscribe.
                    match client.subscribe(shared.subject.clone()).await {
                        Ok(s) => subscriber = s,
                        Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
                    }
                    continue;
                };
                shared.counters.received.fetch_add(1, Ordering::Relaxed);
                let message: Message = match serde_json::from_slice(&raw.payload) {
                    Ok(m) => m,
                    Err(e) => {
                        shared.counters.decode_errors.fetch_add(1, Ordering::Relaxed);
                        if let Some(suppressed) = decode_warnings.allow(Instant::now()) {
                            tracing::warn!(error = %e, suppressed, "replication: a message on the fleet's subject is not kvhint's; ignored (one warning per 10 s at most; kvhint_replication_decode_errors_total counts them all)");
                        }
                        continue;
                    }
                };
                if message.replica == shared.name {
                    if message.incarnation > shared.incarnation {
                        tracing::error!(replica = %shared.name, "replication: another replica publishes under this replica's name; give each replica its own `replication.name`");
                    }
                    continue;
                }
                let now = Instant::now();
                let outcome = merge.receive(&message, now);
                if !outcome.changed.is_empty() {
                    apply(&shared.router, &merge, &outcome.changed);
                }
                if matches!(message.body, Body::Delta { .. }) && !outcome.refused {
                    shared.counters.lag(unix_us().saturating_sub(message.sent_us));
                }
                if outcome.send_digest {
                    shared.digest_now.store(true, Ordering::Relaxed);
                }
                if outcome.want_sync && last_sync_ask.elapsed() > Duration::from_millis(250) {
                    last_sync_ask = now;
                    shared.hello_now.store(true, Ordering::Relaxed);
                }
                if outcome.refused {
                    tracing::error!(peer = %message.replica, their_block_size = message.block_size, our_block_size = shared.router.block_size(), "replication: a peer with another block size is ignored; replicas of one fleet must share router.block_size");
                }
                if outcome.fingerprint_mismatch {
                    tracing::warn!(peer = %message.replica, "replication: a peer runs another config or plugin set; its load is summed, but its selection may differ");
                }
            }
            _ = housekeeping.tick() => {
                let now = Instant::now();
                merge.set_fingerprint(shared.fingerprint.load(Ordering::Relaxed));
                let dropped = merge.expire(now);
                if !dropped.is_empty() {
                    tracing::warn!(workers = dropped.len(), "replication: dropped a silent peer's load");
                }
                reconcile(&shared.router, &merge);
                let ready = merge.is_ready(now);
                let stats = merge.stats();
                *shared.view.lock() = View {
                    ready,
                    peers: merge.peers(now),
                    refused: merge.refused(now),
                    stats: StatsView {
                        corrections: stats.corrections,
                        dropped_silent: stats.dropped_silent,
                        left: stats.left,
                        replaced: stats.replaced,
                        refused_block_size: stats.refused_block_size,
                        refused_name: stats.refused_name,
                        refused_peers: stats.refused_peers,
                        fingerprint_mismatches: stats.fingerprint_mismatches,
                    },
                };
            }
            _ = shared.reconnected.notified() => {
                // Back on the bus (or on it for the first time): ask everyone for
                // their state and tell them ours.
                if connected_once {
                    merge.rejoin(Instant::now());
                }
                connected_once = true;
                shared.hello_now.store(true, Ordering::Relaxed);
                shared.digest_now.store(true, Ordering::Relaxed);
            }
        }
    }
}

/// At most one warning per `every`: a flood of bad messages must not become a
/// flood of log lines (100,000 malformed messages wrote 14.9 MB of them).
struct Throttle {
    every: Duration,
    last: Option<Instant>,
    suppressed: u64,
}

impl Throttle {
    fn new(every: Duration) -> Self {
        Self {
            every,
            last: None,
            suppressed: 0,
        }
    }

    /// Whether to warn now; if so, how many warnings were held back since the
    /// last one.
    fn allow(&mut self, now: Instant) -> Option<u64> {
        if self
            .last
            .is_some_and(|last| now.duration_since(last) < self.every)
        {
            self.suppressed += 1;
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.suppressed))
    }
}

#[cfg(test)]
mod throttle_tests {
    use super::Throttle;
    use std::time::{Duration, Instant};

    #[test]
    fn a_flood_of_bad_messages_warns_once_per_interval_with_the_count_held_back() {
        let t0 = Instant::now();
        let mut throttle = Throttle::new(Duration::from_secs(10));
        let warned: Vec<(u64, u64)> = (0..100_000u64)
            .filter_map(|i| {
                // 100,000 messages over 25 s.
                let at = t0 + Duration::from_micros(i * 250);
                throttle.allow(at).map(|held| (i, held))
            })
            .collect();
        assert_eq!(warned.len(), 3, "{warned:?}");
        assert_eq!(warned[0], (0, 0));
        assert_eq!(warned[1], (40_000, 39_999));
        assert_eq!(warned[2], (80_000, 39_999));
    }
}
