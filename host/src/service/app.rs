//! The service's state: [`App`], what every handler and background task shares,
//! and [`build_app`], which makes it from a config file.
//!
//! Apart from the handlers so that a handler file names the state it reads and
//! nothing else names the handlers: the router's live state (workers, KV index,
//! load: it survives reloads), the current [`Snapshot`] behind an `ArcSwap`
//! (what a reload replaces), the reloader, and the counters.

use super::reload::Reloader;
use super::{auth, listener, metrics};
use crate::config::{self, RouterMode};
use crate::engine_events::decode::DecodeSettings;
use crate::engine_events::subscriber::SubscriberOptions;
use crate::engine_events::EngineEvents;
use crate::fleet::Fleet;
use crate::gateway::RequestPath;
use crate::loader::Loader;
use crate::router::ingest::Ingest;
use crate::router::pool;
use crate::router::Router;
use crate::snapshot::Snapshot;
use arc_swap::ArcSwap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

/// Everything the handlers share.
pub struct App {
    /// The plugins directory watched for reloads (fixed until restart).
    pub plugins_dir: Option<PathBuf>,
    pub router: Arc<Router>,
    /// The one path KV events take into the index (batched, bounded).
    pub ingest: Ingest,
    /// Where bookings run, off the async runtime's workers.
    pub bookings: Arc<pool::BookingPool>,
    /// Shared with the guards, which read its tokens on every request.
    pub snapshot: Arc<ArcSwap<Snapshot>>,
    pub reloader: Reloader,
    pub metrics: Arc<metrics::Metrics>,
    /// Subscriptions to engines' KV-event publishers.
    pub engine_events: Arc<EngineEvents>,
    /// The workers and their subscriptions, changed together.
    pub fleet: Arc<Fleet>,
    /// Where the router listens, for the guards of an unauthenticated router.
    pub exposure: auth::Exposure,
    /// The front door's upstream client, worker health and counters.
    pub gateway: Arc<crate::gateway::Gateway>,
    /// What the request path reads (the router, ingest, bookings, snapshot and
    /// gateway above, shared), for the front door and the endpoint picker.
    pub path: RequestPath,
    /// `endpoint_picker:` as the config had it at start (the gRPC listener's).
    pub endpoint_picker: Option<config::EndpointPickerConfig>,
    /// `replication:` as configured at start (fixed until restart).
    pub replication_config: Option<config::ReplicationConfig>,
    /// Load shared with the other replicas, once `serve` started it.
    pub replication: std::sync::OnceLock<Arc<crate::replication::Replication>>,
    /// The address the HTTP API listens on, once bound: a worker registered
    /// there would send every request back to the router.
    pub listen: std::sync::OnceLock<SocketAddr>,
}

#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub config: PathBuf,
    pub mode: Option<RouterMode>,
    pub listen: SocketAddr,
    pub watch_config: bool,
    pub max_body_bytes: usize,
    /// Booking threads; the machine's parallelism if `None`.
    pub booking_threads: Option<usize>,
    /// Deadlines and the connection cap.
    pub connections: listener::ConnectionLimits,
    /// Serve a non-loopback address without `auth` (warned about).
    pub allow_unauthenticated: bool,
}

/// Entries (an API event, or an engine batch) waiting for the ingestion thread at most.
const INGEST_QUEUE: usize = 65_536;
/// Bookings waiting for a booking thread at most.
const BOOKING_QUEUE: usize = 4_096;

/// Builds the app from a config: the loader, the first snapshot, the router.
pub fn build_app(options: &ServeOptions) -> Result<Arc<App>, config::ConfigErrors> {
    let config = config::load(&options.config)?;
    let loader =
        Loader::new(&crate::loader::LoaderOptions::from_config(&config.plugins)).map_err(|e| {
            config::ConfigErrors(vec![config::ConfigError::new(&options.config, None, e)])
        })?;
    let reloader = Reloader::new(&options.config, options.mode, loader);
    let (snapshot, config) = reloader.initial()?;
    let router = Arc::new(Router::new(snapshot.block_size));
    let startup = |what: &str, e: std::io::Error| {
        config::ConfigErrors(vec![config::ConfigError::new(
            &options.config,
            None,
            format!("could not start the {what} threads: {e}"),
        )])
    };
    let (ingest, _thread) = Ingest::start(Arc::clone(&router), INGEST_QUEUE)
        .map_err(|e| startup("KV-event ingestion", e))?;
    let threads = options.booking_threads.unwrap_or_else(|| {
        std::thread::available_parallelism().map_or(2, std::num::NonZeroUsize::get)
    });
    let bookings = Arc::new(
        pool::BookingPool::new(threads, BOOKING_QUEUE).map_err(|e| startup("booking", e))?,
    );
    let engine_events = Arc::new(EngineEvents::new(
        Arc::clone(&router),
        ingest.clone(),
        DecodeSettings {
            block_size: snapshot.block_size,
            media: config.kv_events.media.clone(),
        },
        SubscriberOptions {
            receive_hwm: config.kv_events.receive_hwm as i32,
            replay_timeout: std::time::Duration::from_millis(config.kv_events.replay_timeout_ms),
            ..SubscriberOptions::default()
        },
    ));
    engine_events.set_max_sources(config.kv_events.max_sources as usize);
    let fleet = Arc::new(Fleet::new(Arc::clone(&router), Arc::clone(&engine_events)));
    let failures = fleet.apply_config(&config.kv_events, &config.workers);
    if !failures.is_empty() {
        return Err(config::ConfigErrors(
            failures
                .into_iter()
                .map(|f| config::ConfigError::new(&options.config, None, f.clone()))
                .collect(),
        ));
    }
    let gateway = Arc::new(crate::gateway::Gateway::new(&config.gateway).map_err(|e| {
        config::ConfigErrors(vec![config::ConfigError::new(&options.config, None, e)])
    })?);
    let hook_fleet = Arc::clone(&fleet);
    let _ = reloader
        .on_reload
        .set(Box::new(move |config: &config::Config| {
            hook_fleet.apply_config(&config.kv_events, &config.workers)
        }));
    let snapshot = Arc::new(ArcSwap::from_pointee(snapshot));
    let metrics = Arc::new(metrics::Metrics::default());
    let counted = Arc::clone(&metrics);
    let path = RequestPath {
        router: Arc::clone(&router),
        ingest: ingest.clone(),
        bookings: Arc::clone(&bookings),
        snapshot: Arc::clone(&snapshot),
        gateway: Arc::clone(&gateway),
        on_booked: Arc::new(move |booking| {
            counted.booked(booking, booking.hint.message().is_some())
        }),
    };
    Ok(Arc::new(App {
        endpoint_picker: config.endpoint_picker.clone(),
        plugins_dir: config
            .plugins
            .directory
            .as_deref()
            .and_then(|d| d.canonicalize().ok()),
        router,
        ingest,
        bookings,
        snapshot,
        reloader,
        metrics,
        engine_events,
        fleet,
        exposure: auth::Exposure {
            loopback: options.listen.ip().is_loopback(),
        },
        gateway,
        path,
        replication_config: config.replication.clone(),
        replication: std::sync::OnceLock::new(),
        listen: std::sync::OnceLock::new(),
    }))
}

impl App {
    /// The registry a scrape renders: every collector, given what it reads now.
    pub fn metrics_registry(&self) -> prometheus_client::registry::Registry {
        use metrics::{
            BookingCollector, GatewayCollector, PolicyCollector, ReplicationCollector,
            SourceCollector, StateCollector,
        };
        let mut registry = prometheus_client::registry::Registry::default();
        registry.register_collector(Box::new(BookingCollector(Arc::clone(&self.metrics))));
        let reloads = self.reloader.status();
        registry.register_collector(Box::new(StateCollector {
            expired_bookings: self.router.expired_bookings(),
            reloads_ok: reloads.ok,
            reloads_failed: reloads.failed,
            generation: self.snapshot.load().generation,
            libraries_mapped: self.reloader.loader.libraries_mapped(),
            workers: self.router.workers().len(),
            open_bookings: self.router.open_bookings(),
            index_blocks: self.router.index_len(),
        }));
        registry.register_collector(Box::new(PolicyCollector {
            hints: self.reloader.policy_stats.all(),
            selection: self.reloader.policy_stats.all_selection(),
        }));
        registry.register_collector(Box::new(SourceCollector(Arc::clone(&self.engine_events))));
        let workers_up = self
            .router
            .workers()
            .into_iter()
            .filter(|(worker, _)| worker.http.is_some())
            .map(|(worker, _)| (worker.key, self.gateway.health.looks_up(worker.key)))
            .collect();
        registry.register_collector(Box::new(GatewayCollector {
            stats: Arc::clone(&self.gateway.stats),
            predictions: Arc::clone(&self.gateway.approximate.stats),
            in_flight_blocks: self.gateway.approximate.in_flight_blocks(),
            snapshot: self.snapshot.load_full(),
            workers_up,
        }));
        registry.register_collector(Box::new(ReplicationCollector(
            self.replication.get().cloned(),
        )));
        registry
    }
}
