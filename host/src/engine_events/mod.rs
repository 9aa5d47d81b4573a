//! Engine KV events over ZMQ: one subscription per worker rank whose engine publishes.
//!
//! vLLM, SGLang and TensorRT-LLM's push publisher put every cache change on a ZMQ PUB
//! socket; this module is how the router hears them. [`EngineEvents`] keeps one
//! subscriber thread per source ([`subscriber`]), started when a worker registers with
//! a `kv_events` source or the config lists one, stopped when it goes (`fleet` does
//! both, with the worker's membership, and this module checks and runs them); each thread
//! decodes batches ([`decode`]) and hands them to the same ingestion path as
//! `POST /kv_events`, so engine events and API events are applied in one order.
//! Threads, not async tasks: libzmq sockets block, and a source's work is a poll, a
//! decode and a hand-off.

pub(crate) mod decode;
pub(crate) mod stats;
pub(crate) mod subscriber;

use crate::config::KvEventsConfig;
use crate::domain::event_source::{Endpoints, KvEventSource, SourceError};
use crate::domain::WorkerKey;
use crate::router::ingest::Ingest;
use crate::router::Router;
use arc_swap::ArcSwap;
use decode::DecodeSettings;
use parking_lot::Mutex;
use stats::{SourceState, SourceStats};
use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use subscriber::{Alive, Shared, Subscriber, SubscriberOptions};

/// Who asked for a source: a worker's registration, or the config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    Registration,
    Config,
}

impl Origin {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Registration => "registration",
            Self::Config => "config",
        }
    }
}

struct Running {
    origin: Origin,
    source: KvEventSource,
    shared: Arc<Shared>,
}

/// A source as `/admin/status` and `/metrics` show it.
pub struct SourceView {
    pub worker: WorkerKey,
    pub origin: Origin,
    pub endpoints: Endpoints,
    shared: Arc<Shared>,
}

impl SourceView {
    pub fn stats(&self) -> &SourceStats {
        &self.shared.stats
    }
}

/// Why a subscription could not start.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    /// The source itself is unusable: the caller's to fix.
    #[error("{0}")]
    Source(#[from] SourceError),
    /// The router keeps as many sources as `kv_events.max_sources` allows.
    #[error("this router already subscribes to {cap} KV-event sources, the most `kv_events.max_sources` allows (each takes file descriptors the connection budget leaves free); deregister a worker that no longer publishes, or raise `kv_events.max_sources` (and `ulimit -n`) and restart")]
    Full { cap: usize },
    /// The router could not start a thread for it: the host's problem.
    #[error("could not start a KV-event subscriber thread: {0}; the router is short of threads or memory")]
    Spawn(std::io::Error),
}

/// Every engine subscription of one router.
pub struct EngineEvents {
    context: zmq::Context,
    router: Arc<Router>,
    ingest: Ingest,
    settings: Arc<ArcSwap<DecodeSettings>>,
    /// For subscriptions started from now on (a reload may change them).
    options: ArcSwap<SubscriberOptions>,
    sources: Mutex<BTreeMap<WorkerKey, Running>>,
    /// `kv_events.max_sources`.
    max_sources: AtomicUsize,
    /// The `ipc://` paths this router has bound (libzmq made the socket there).
    bound_ipc: Mutex<HashSet<PathBuf>>,
    /// The directories of the `ipc://` paths the config's sources bind: a
    /// registration may bind there too.
    config_ipc_dirs: Mutex<Vec<PathBuf>>,
    /// Subscriber threads that hold sockets: every source's, and a stopped one's
    /// until it has closed them.
    alive: Arc<Alive>,
}

/// File descriptors one source may hold, kept out of the connection budget.
/// Measured (`trust::each_kv_event_source_holds_no_more_descriptors_than_the_budget_keeps`):
/// 6 for a subscription still connecting (the SUB socket's and its monitor's
/// mailboxes and libzmq's own), one more once the publisher's connection is up,
/// and 3 more while a replay is in flight (the DEALER socket's mailbox, its
/// connection, libzmq's reaper): 10.
pub const FDS_PER_SOURCE: u64 = 10;

/// Whether `path` is a directory only the router's user (or root) can change.
fn is_private_dir(path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).is_ok_and(|m| {
        let me = crate::trust::effective_uid();
        m.is_dir() && (m.uid() == me || m.uid() == 0) && m.mode() & 0o022 == 0
    })
}

impl EngineEvents {
    pub fn new(
        router: Arc<Router>,
        ingest: Ingest,
        settings: DecodeSettings,
        options: SubscriberOptions,
    ) -> Self {
        let context = zmq::Context::new();
        // libzmq starts its I/O and reaper threads with a context's first socket, and a
        // new thread takes its creator's scheduling policy. Opening one here, on the
        // thread that builds the router, starts them under the process's own policy,
        // not under whatever `kv_events.thread_policy` was when the first subscription
        // opened (which they would then keep through reloads). A failure here is the
        // first subscription's to report.
        drop(context.socket(zmq::SUB));
        Self {
            context,
            router,
            ingest,
            settings: Arc::new(ArcSwap::from_pointee(settings)),
            options: ArcSwap::from_pointee(options),
            sources: Mutex::new(BTreeMap::new()),
            max_sources: AtomicUsize::new(crate::config::DEFAULT_MAX_SOURCES as usize),
            bound_ipc: Mutex::new(HashSet::new()),
            config_ipc_dirs: Mutex::new(Vec::new()),
            alive: Arc::new(Alive::default()),
        }
    }

    /// The subscriber threads holding sockets now (the descriptor budget counts
    /// these, not `kv_events.max_sources`), and the hook that hears each change.
    pub fn alive(&self) -> &Arc<Alive> {
        &self.alive
    }

    /// Sets `kv_events.max_sources` (at start).
    pub fn set_max_sources(&self, cap: usize) {
        self.max_sources.store(cap.max(1), Ordering::Relaxed);
    }

    pub fn max_sources(&self) -> usize {
        self.max_sources.load(Ordering::Relaxed)
    }

    /// A source that binds an `ipc://` path makes libzmq unlink whatever is there
    /// first, so a worker token could delete any file the router can. A bound path
    /// must be absolute and either not exist or be a socket this router bound (or,
    /// for the config's own sources, any socket), in a directory only the router's
    /// user or root can write, or one the config's sources bind in.
    fn check_bound_path(&self, endpoints: &Endpoints, origin: Origin) -> Result<(), SourceError> {
        use std::os::unix::fs::FileTypeExt;
        let Some(path) = endpoints
            .bind
            .then(|| endpoints.events.strip_prefix("ipc://"))
            .flatten()
        else {
            return Ok(());
        };
        let fail = |problem: String| SourceError {
            field: "endpoint",
            problem,
        };
        let path = Path::new(path);
        if !path.is_absolute() {
            return Err(fail(format!(
                "`ipc://{}` with `bind: true` must name an absolute path (ipc:///run/kvhint/kv.sock)",
                path.display()
            )));
        }
        match std::fs::symlink_metadata(path) {
            Ok(meta) => {
                let ours = meta.file_type().is_socket()
                    && (origin == Origin::Config || self.bound_ipc.lock().contains(path));
                if !ours {
                    return Err(fail(format!(
                        "`ipc://{}` with `bind: true` names an existing {}; binding it would delete it (ZMQ removes the path first), so the router binds only a path that does not exist yet: name a new path in a directory the router owns",
                        path.display(),
                        if meta.file_type().is_socket() { "socket this router did not create" } else if meta.is_dir() { "directory" } else { "file" }
                    )));
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(fail(format!(
                    "`ipc://{}` cannot be inspected ({e}); name a new path in a directory the router owns",
                    path.display()
                )))
            }
        }
        let dir = path.parent().unwrap_or(Path::new("/"));
        let named =
            origin == Origin::Config || self.config_ipc_dirs.lock().iter().any(|d| d == dir);
        if !named && !is_private_dir(dir) {
            return Err(fail(format!(
                "`ipc://{}` with `bind: true` is in {}, which is not a directory only the router's user (or root) can write, nor one the config's kv_events.sources bind in; bind under such a directory (mkdir -m 700 /run/kvhint)",
                path.display(),
                dir.display()
            )));
        }
        Ok(())
    }

    /// Whether `worker` may subscribe to `source` (asked for by `origin`), checked
    /// before its registration changes anything (`fleet::Fleet::register`): the
    /// source resolves for its rank; a new or changed source binds no path it may
    /// not (see `check_bound_path`) nor one another worker binds; and a new source
    /// fits under `kv_events.max_sources`. The same source again passes.
    pub fn check_source(
        &self,
        worker: WorkerKey,
        source: &KvEventSource,
        origin: Origin,
    ) -> Result<(), AttachError> {
        let endpoints = Endpoints::resolve(worker.dp_rank, source)?;
        let sources = self.sources.lock();
        let same = sources.get(&worker).is_some_and(|r| r.source == *source);
        if !same {
            self.check_bound_path(&endpoints, origin)?;
            // One bound path per worker: a second binding the same path
            // would take the first one's endpoint over.
            if endpoints.bind {
                let holder = sources.iter().find(|(other, running)| {
                    **other != worker
                        && Endpoints::resolve(other.dp_rank, &running.source)
                            .is_ok_and(|theirs| theirs.bind && theirs.events == endpoints.events)
                });
                if let Some((holder, _)) = holder {
                    return Err(AttachError::from(SourceError {
                        field: "endpoint",
                        problem: format!(
                            "`{}` with `bind: true` is bound already for {holder}; give each worker a path of its own",
                            endpoints.events
                        ),
                    }));
                }
            }
        }
        let cap = self.max_sources();
        if !sources.contains_key(&worker) && sources.len() >= cap {
            return Err(AttachError::Full { cap });
        }
        Ok(())
    }

    /// Which media count, and the block size (a reload may change the media).
    pub fn set_settings(&self, settings: DecodeSettings) {
        self.settings.store(Arc::new(settings));
    }

    /// Starts (or, if its source changed, restarts) `worker`'s subscription. The same
    /// source again changes nothing: re-registering keeps the stream and its sequence.
    pub fn attach(
        &self,
        worker: WorkerKey,
        source: &KvEventSource,
        origin: Origin,
    ) -> Result<(), AttachError> {
        let endpoints = Endpoints::resolve(worker.dp_rank, source)?;
        let mut sources = self.sources.lock();
        if let Some(running) = sources.get_mut(&worker) {
            if running.source == *source {
                running.origin = origin;
                return Ok(());
            }
        }
        if let Some(old) = sources.remove(&worker) {
            // Its thread closes its sockets within a poll (every wait of the thread
            // checks the flag) and stays counted in `alive` until it has. It is not
            // joined here: this runs on the API's threads, under the fleet's membership lock.
            old.shared.stop.store(true, Ordering::Relaxed);
            old.shared.stats.set_state(SourceState::Stopped);
        }
        if endpoints.bind {
            if let Some(path) = endpoints.events.strip_prefix("ipc://") {
                self.bound_ipc.lock().insert(PathBuf::from(path));
            }
        }
        let shared = Arc::new(Shared {
            worker,
            endpoints,
            stats: SourceStats::default(),
            stop: Default::default(),
        });
        let subscriber = Subscriber {
            shared: Arc::clone(&shared),
            context: self.context.clone(),
            router: Arc::clone(&self.router),
            ingest: self.ingest.clone(),
            settings: Arc::clone(&self.settings),
            options: SubscriberOptions::clone(&self.options.load()),
            // Counted before the thread starts; a thread that cannot start drops it.
            alive: self.alive.enter(),
        };
        std::thread::Builder::new()
            .name(format!("kvhint-kv-{}-{}", worker.worker_id, worker.dp_rank))
            .spawn(move || subscriber.run())
            .map_err(AttachError::Spawn)?;
        tracing::info!(
            worker_id = worker.worker_id,
            dp_rank = worker.dp_rank,
            source = %shared.endpoints,
            origin = origin.as_str(),
            "subscribing to KV events"
        );
        sources.insert(
            worker,
            Running {
                origin,
                source: source.clone(),
                shared,
            },
        );
        Ok(())
    }

    /// Stops `worker`'s subscription, if it has one. Its thread ends within a poll.
    pub fn detach(&self, worker: WorkerKey) -> bool {
        match self.sources.lock().remove(&worker) {
            Some(running) => {
                running.shared.stop.store(true, Ordering::Relaxed);
                running.shared.stats.set_state(SourceState::Stopped);
                true
            }
            None => false,
        }
    }

    /// Workers whose source came from `origin`.
    pub fn workers_from(&self, origin: Origin) -> Vec<WorkerKey> {
        self.sources
            .lock()
            .iter()
            .filter(|(_, r)| r.origin == origin)
            .map(|(k, _)| *k)
            .collect()
    }

    pub fn sources(&self) -> Vec<SourceView> {
        self.sources
            .lock()
            .iter()
            .map(|(worker, running)| SourceView {
                worker: *worker,
                origin: running.origin,
                endpoints: running.shared.endpoints.clone(),
                shared: Arc::clone(&running.shared),
            })
            .collect()
    }

    /// Stops every subscription.
    pub fn shutdown(&self) {
        for (_, running) in std::mem::take(&mut *self.sources.lock()) {
            running.shared.stop.store(true, Ordering::Relaxed);
        }
    }
}

impl Drop for EngineEvents {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl EngineEvents {
    /// Follows the config's `kv_events` settings: the media setting (at once, for
    /// every source), the thread policy (every source's thread and the ingestion
    /// thread, within its next wait), the socket and replay settings (for
    /// subscriptions started from now on), and the directories its sources bind in.
    /// Its sources themselves are the fleet's to follow (`fleet::Fleet::apply_config`).
    pub fn apply_config(&self, block_size: usize, config: &KvEventsConfig) {
        self.ingest.set_thread_policy(config.thread_policy);
        self.set_settings(DecodeSettings {
            block_size,
            media: config.media.clone(),
        });
        self.options.store(Arc::new(SubscriberOptions {
            receive_hwm: i32::try_from(config.receive_hwm).unwrap_or(i32::MAX),
            replay_timeout: std::time::Duration::from_millis(config.replay_timeout_ms),
            ..SubscriberOptions::clone(&self.options.load())
        }));
        *self.config_ipc_dirs.lock() = config
            .sources
            .iter()
            .filter(|c| c.source.bind)
            .filter_map(|c| c.source.endpoint.trim().strip_prefix("ipc://"))
            .filter_map(|p| Path::new(p).parent().map(Path::to_path_buf))
            .collect();
    }
}
