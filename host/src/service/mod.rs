//! `kvhint serve`: the HTTP JSON API around the router, with reload.
//!
//! State is explicit and shared as one [`App`]: the router's live state
//! (workers, KV index, load — it survives reloads), the current [`Snapshot`]
//! behind an `ArcSwap` (what a reload replaces), the reloader, and metrics.
//! Handlers are thin: decode, call the router, encode; every failure maps to
//! the one error shape in [`error`].

pub mod auth;
pub mod body;
pub mod endpoint_picker;
pub mod error;
pub mod gateway;
pub mod listener;
pub mod metrics;
pub mod pool;
pub mod reload;
pub mod status;
mod watch;

use crate::config::{self, RouterMode};
use crate::engine_events::decode::DecodeSettings;
use crate::engine_events::subscriber::SubscriberOptions;
use crate::engine_events::{AttachError, EngineEvents};
use crate::fleet::{Fleet, MembershipError, Origin};
use crate::loader::Loader;
use crate::router::ingest::Ingest;
use crate::router::workers::WorkerRegistration;
use crate::router::{configured_role, Router};
use crate::snapshot::Snapshot;
use crate::wire::{BookBody, BookingView, KvEventBody, ReleaseBody};
use anyhow::Context;
use arc_swap::ArcSwap;
use axum::extract::{Path as UrlPath, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::Json;
use body::JsonBody;
use error::ApiError;
use reload::{Reloader, Trigger};
use serde::Deserialize;
use serde_json::json;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Everything the handlers share.
pub struct App {
    /// The plugins directory watched for reloads (fixed until restart).
    pub plugins_dir: Option<PathBuf>,
    pub router: Arc<Router>,
    /// The one path KV events take into the index (batched, bounded).
    pub ingest: Ingest,
    /// Where bookings run, off the async runtime's workers.
    pub bookings: pool::BookingPool,
    pub snapshot: ArcSwap<Snapshot>,
    pub reloader: Reloader,
    pub metrics: Arc<metrics::Metrics>,
    /// Subscriptions to engines' KV-event publishers.
    pub engine_events: Arc<EngineEvents>,
    /// The workers and their subscriptions, changed together.
    pub fleet: Arc<Fleet>,
    /// Where the router listens, for the guards of an unauthenticated router.
    pub exposure: auth::Exposure,
    /// The front door's upstream client, worker health and counters.
    pub gateway: crate::gateway::Gateway,
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

/// The API's routes over `app`, each group behind the guard of its caller class
/// (see [`auth`]).
pub fn routes(app: Arc<App>, max_body_bytes: usize) -> axum::Router {
    use crate::config::auth::Caller;
    let guarded = |routes: axum::Router<Arc<App>>, caller: Option<Caller>| {
        routes.route_layer(axum::middleware::from_fn_with_state(
            (Arc::clone(&app), caller),
            auth::guard,
        ))
    };
    let admin = axum::Router::new()
        .route("/workers/{worker_id}", delete(deregister_worker))
        .route("/admin/status", get(status::status))
        .route("/admin/reload", post(admin_reload));
    let worker = axum::Router::new()
        .route("/workers", post(register_worker))
        .route("/kv_events", post(kv_event));
    let client = axum::Router::new()
        .route("/book", post(book))
        .route("/release", post(release));
    // The front door: the client token class guards it too, and its errors take
    // OpenAI's shape (the guard's included).
    let front_door = axum::Router::new()
        .route("/v1/chat/completions", post(gateway::chat_completions))
        .route("/v1/completions", post(gateway::completions))
        .route("/generate", post(gateway::generate))
        .route("/v1/models", get(gateway::models))
        .route("/v1/models/{id}", get(gateway::model))
        .route("/v1/embeddings", post(gateway::embeddings))
        .route("/tokenize", post(gateway::tokenize))
        .route("/detokenize", post(gateway::detokenize))
        .route("/v1/{*rest}", axum::routing::any(gateway::unknown_route));
    let open = axum::Router::new()
        .route("/healthz", get(healthz))
        .route("/health", get(health))
        .route("/readiness", get(gateway::readiness))
        .route("/metrics", get(metrics));
    let routes = guarded(admin, Some(Caller::Admin))
        .merge(guarded(worker, Some(Caller::Worker)))
        .merge(guarded(client, Some(Caller::Client)))
        .merge(
            guarded(front_door, Some(Caller::Client))
                .layer(axum::middleware::map_response(error::openai_shape))
                .layer(axum::middleware::from_fn(gateway::access_log)),
        )
        .merge(guarded(open, None))
        .fallback(|| async {
            ApiError::new(
                StatusCode::NOT_FOUND,
                "not_found",
                "no such endpoint; see docs/api.md",
            )
        })
        .method_not_allowed_fallback(|| async {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                "this endpoint does not take that method; see docs/api.md",
            )
        })
        .with_state(Arc::clone(&app));
    // Outermost, so it sees every response: each error answer carries its code
    // (`error::ErrorCode`), and this is the one place they are counted.
    body::limit_layers(routes, max_body_bytes).layer(axum::middleware::from_fn_with_state(
        app,
        error::count_errors,
    ))
}

async fn register_worker(
    State(app): State<Arc<App>>,
    body: Result<JsonBody<WorkerRegistration>, ApiError>,
) -> Result<Response, ApiError> {
    let JsonBody(registration) = body?;
    let (worker_id, dp_rank) = (registration.worker_id, registration.dp_rank);
    if let (Some(endpoint), Some(listen)) = (&registration.http_endpoint, app.listen.get()) {
        if points_at(endpoint, *listen) {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_runtime_data",
                format!("worker {worker_id} rank {dp_rank}: http_endpoint {endpoint} is this router's own address ({listen}): every request sent there would come back to the router; point it at the engine"),
            ));
        }
    }
    let max = app.snapshot.load().gateway.max_workers;
    let workers = app.router.workers();
    let known = workers
        .iter()
        .any(|(w, _)| w.key.worker_id == worker_id && w.key.dp_rank == dp_rank);
    if !known && workers.len() as u64 >= max {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "too_many_workers",
            format!("{} workers are registered, gateway.max_workers ({max}); deregister one, or raise it", workers.len()),
        ));
    }
    let new = app
        .fleet
        .register(registration, Origin::Registration)
        .map_err(membership_error)?;
    let status = if new {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    let body = json!({"worker_id": worker_id, "dp_rank": dp_rank, "registered": if new { "new" } else { "updated" }});
    Ok((status, Json(body)).into_response())
}

/// Whether `endpoint` (`http://host:port`) is the router's own `listen`
/// address: the same port on the same IP (`localhost` taken as 127.0.0.1), or
/// on a loopback address when the router listens on every address.
fn points_at(endpoint: &str, listen: SocketAddr) -> bool {
    let authority = endpoint
        .split_once("://")
        .map_or(endpoint, |(_, rest)| rest)
        .split('/')
        .next()
        .unwrap_or_default();
    let Some((host, port)) = authority.rsplit_once(':') else {
        return false;
    };
    if port.parse::<u16>().ok() != Some(listen.port()) {
        return false;
    }
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let ip = if host.eq_ignore_ascii_case("localhost") {
        std::net::IpAddr::from([127, 0, 0, 1])
    } else {
        match host.parse::<std::net::IpAddr>() {
            Ok(ip) => ip,
            // A host name: the hop header catches a loop through it.
            Err(_) => return false,
        }
    };
    // 0.0.0.0 as a destination reaches the local listener; a router listening
    // on every address is reached on any loopback address. Another loopback
    // address than the one the router listens on may be another process's.
    ip == listen.ip()
        || (ip.is_unspecified() && listen.ip().is_loopback())
        || (listen.ip().is_unspecified() && (ip.is_loopback() || ip.is_unspecified()))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RankQuery {
    #[serde(default)]
    dp_rank: u32,
}

/// A refused registration: the caller's source (400), the router's verdict, or a
/// thread the host could not start (500).
fn membership_error(error: MembershipError) -> ApiError {
    match error {
        MembershipError::Router(e) => e.into(),
        MembershipError::Attach(AttachError::Source(e)) => ApiError::bad_request(e.to_string()),
        MembershipError::Attach(e @ AttachError::Full { .. }) => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "too_many_sources",
            e.to_string(),
        ),
        MembershipError::Attach(e @ AttachError::Spawn(_)) => {
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string())
        }
    }
}

async fn deregister_worker(
    State(app): State<Arc<App>>,
    worker_id: Result<UrlPath<u64>, axum::extract::rejection::PathRejection>,
    query: Result<Query<RankQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let UrlPath(worker_id) = worker_id.map_err(|e| {
        ApiError::bad_request(format!("{}; the worker id is a number", e.body_text()))
    })?;
    let Query(RankQuery { dp_rank }) = query.map_err(|e| ApiError::bad_request(e.body_text()))?;
    let key = crate::domain::WorkerKey { worker_id, dp_rank };
    app.fleet.deregister(key)?;
    Ok(Json(
        json!({"worker_id": worker_id, "dp_rank": dp_rank, "deregistered": true}),
    ))
}

async fn kv_event(
    State(app): State<Arc<App>>,
    body: Result<JsonBody<KvEventBody>, ApiError>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let JsonBody(body) = body?;
    let key = body.key();
    let applied = app
        .ingest
        .submit(key, body.event)
        .map_err(|e| ApiError::overloaded(e.to_string()))?;
    let stats = applied
        .await
        .map_err(|_| ApiError::overloaded("the KV-event ingestion path stopped"))??;
    app.metrics.kv_events.fetch_add(1, Ordering::Relaxed);
    Ok(Json(json!({
        "stored": stats.stored,
        "removed": stats.removed,
        "missing_removals": stats.missing_removals,
    })))
}

async fn book(
    State(app): State<Arc<App>>,
    body: Result<JsonBody<BookBody>, ApiError>,
) -> Result<Response, ApiError> {
    let JsonBody(body) = body?;
    let worker = Arc::clone(&app);
    let booked = app
        .bookings
        .run(move || {
            let session = body.session_text();
            // One snapshot for the whole booking, whatever a reload does meanwhile.
            let snapshot = worker.snapshot.load_full();
            let request = body.request(session.as_deref());
            let role = configured_role(&snapshot, request.role)?;
            let booking = worker.router.book(role, &request)?;
            worker
                .metrics
                .booked(&booking, booking.hint.message().is_some());
            serde_json::to_string(&BookingView::new(&booking, role)).map_err(|e| {
                ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string())
            })
        })
        .await?;
    let text = booked?;
    Ok(([(header::CONTENT_TYPE, "application/json")], text).into_response())
}

async fn release(
    State(app): State<Arc<App>>,
    body: Result<JsonBody<ReleaseBody>, ApiError>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let JsonBody(body) = body?;
    let worker = app.router.release(&body.request_id)?;
    Ok(Json(json!({
        "request_id": body.request_id,
        "worker_id": worker.worker_id,
        "dp_rank": worker.dp_rank,
        "released": true,
    })))
}

/// `GET /health`: the process is alive and serving (load balancers' and both
/// peer gateways' path); `/readiness` says whether it can route.
async fn health() -> Json<serde_json::Value> {
    Json(json!({"status": "ok"}))
}

async fn healthz(State(app): State<Arc<App>>) -> Json<serde_json::Value> {
    Json(json!({"status": "ok", "generation": app.snapshot.load().generation}))
}

/// OpenMetrics for a scraper that asks for it, else the Prometheus text format.
async fn metrics(State(app): State<Arc<App>>, headers: axum::http::HeaderMap) -> Response {
    let accept = headers
        .get(header::ACCEPT)
        .and_then(|value| value.to_str().ok());
    let registry = metrics::registry(&app);
    let (content_type, text) = metrics::encode(&registry, metrics::wants_openmetrics(accept));
    ([(header::CONTENT_TYPE, content_type)], text).into_response()
}

/// Starts sharing load with the other replicas, if the config asks, and keeps the
/// config fingerprint they are told current across reloads.
async fn start_replication(app: &Arc<App>) -> anyhow::Result<()> {
    let Some(config) = app.replication_config.as_ref() else {
        return Ok(());
    };
    let fingerprint = crate::replication::fingerprint(&app.snapshot.load());
    let replication =
        crate::replication::Replication::start(Arc::clone(&app.router), config, fingerprint)
            .await?;
    let _ = app.replication.set(Arc::clone(&replication));
    let weak = Arc::downgrade(app);
    tokio::spawn(async move {
        let mut generation = 0;
        loop {
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            let Some(app) = weak.upgrade() else { return };
            let snapshot = app.snapshot.load();
            if snapshot.generation != generation {
                generation = snapshot.generation;
                replication.set_fingerprint(crate::replication::fingerprint(&snapshot));
            }
        }
    });
    Ok(())
}

async fn admin_reload(State(app): State<Arc<App>>) -> Result<Json<serde_json::Value>, ApiError> {
    let worker = Arc::clone(&app);
    let result = tokio::task::spawn_blocking(move || {
        worker.reloader.reload(&worker.snapshot, Trigger::Admin)
    })
    .await
    .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()))?;
    match result {
        Ok(generation) => Ok(Json(json!({"reloaded": true, "generation": generation}))),
        Err(errors) => Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "reload_failed",
            format!(
                "the previous snapshot keeps serving; {}",
                errors
                    .0
                    .iter()
                    .map(|e| e.to_string())
                    .collect::<Vec<_>>()
                    .join("; ")
            ),
        )),
    }
}

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
    let bookings =
        pool::BookingPool::new(threads, BOOKING_QUEUE).map_err(|e| startup("booking", e))?;
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
    let gateway = crate::gateway::Gateway::new(&config.gateway).map_err(|e| {
        config::ConfigErrors(vec![config::ConfigError::new(&options.config, None, e)])
    })?;
    let hook_fleet = Arc::clone(&fleet);
    let _ = reloader
        .on_reload
        .set(Box::new(move |config: &config::Config| {
            hook_fleet.apply_config(&config.kv_events, &config.workers)
        }));
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
        snapshot: ArcSwap::from_pointee(snapshot),
        reloader,
        metrics: Arc::new(metrics::Metrics::default()),
        engine_events,
        fleet,
        exposure: auth::Exposure {
            loopback: options.listen.ip().is_loopback(),
        },
        gateway,
        replication_config: config.replication.clone(),
        replication: std::sync::OnceLock::new(),
        listen: std::sync::OnceLock::new(),
    }))
}

/// Refuses to expose an unauthenticated router beyond loopback unless asked to.
fn check_exposure(options: &ServeOptions, app: &App) -> anyhow::Result<()> {
    if options.listen.ip().is_loopback() {
        return Ok(());
    }
    if app.snapshot.load().tokens.is_some() {
        // Exposed with tokens: a reload may not take them away.
        app.reloader.require_auth();
        return Ok(());
    }
    if !options.allow_unauthenticated {
        anyhow::bail!(
            "--listen {} is not a loopback address, and the config has no `auth`: anyone who reaches the port could register workers, book and reload. Configure `auth` (see the README's \"Authentication\"), or pass --allow-unauthenticated on a network only trusted callers reach",
            options.listen
        );
    }
    tracing::warn!(
        listen = %options.listen,
        "serving without authentication on a non-loopback address (--allow-unauthenticated): anyone who reaches the port controls this router"
    );
    Ok(())
}

/// Releases bookings older than the current snapshot's `router.booking_ttl`, for
/// as long as the router runs.
async fn expire_bookings(app: Arc<App>) {
    loop {
        let ttl = std::time::Duration::from_secs(app.snapshot.load().booking_ttl_s);
        // A quarter of the TTL between sweeps: a booking is released at most 25%
        // late, and a sweep (one pass over each shard) runs rarely.
        let period = (ttl / 4).clamp(
            std::time::Duration::from_millis(250),
            std::time::Duration::from_secs(60),
        );
        tokio::time::sleep(period).await;
        if ttl.is_zero() {
            continue;
        }
        let router = Arc::clone(&app.router);
        let expired = tokio::task::spawn_blocking(move || router.expire_bookings(ttl))
            .await
            .unwrap_or(0);
        if expired > 0 {
            tracing::warn!(
                expired,
                ttl_s = ttl.as_secs(),
                "released bookings that were never released (router.booking_ttl)"
            );
        }
    }
}

/// Runs the service until SIGINT or SIGTERM. Prints `listening on ADDR` once
/// the socket is bound (on stdout, for scripts and tests). `hangups` must have
/// been created before anything slow ran: until a SIGHUP handler exists, the
/// signal's default action ends the process.
pub async fn serve(
    options: ServeOptions,
    app: Arc<App>,
    mut hangups: tokio::signal::unix::Signal,
) -> anyhow::Result<()> {
    check_exposure(&options, &app)?;
    let config_file = if options.watch_config {
        options.config.canonicalize().ok()
    } else {
        None
    };
    let _watches = watch::start(Arc::clone(&app), app.plugins_dir.clone(), config_file)?;

    let listener = tokio::net::TcpListener::bind(options.listen)
        .await
        .with_context(|| format!("cannot listen on {}", options.listen))?;
    let address = listener.local_addr()?;
    let _ = app.listen.set(address);
    // Each KV-event source holds descriptors too: they are kept out of the
    // connection budget while a source holds them (from its thread's start until
    // its sockets are closed), so subscriptions never starve connections (or a
    // reload) of descriptors, and a router with no source keeps none back for
    // them. Sources take at most half of what the limit leaves: a lower
    // `ulimit -n` lowers the source cap too, with a warning.
    let per_source = crate::engine_events::FDS_PER_SOURCE;
    let open_files = listener::ConnectionLimits::open_files_limit();
    if let Some(limit) = open_files {
        let sources = app.engine_events.max_sources() as u64;
        let most =
            (limit.saturating_sub(listener::ConnectionLimits::RESERVED_FDS) / 2 / per_source)
                .max(1);
        if sources > most {
            tracing::warn!(
                max_sources = sources,
                open_files_limit = limit,
                now = most,
                "kv_events.max_sources is more than the open-files limit leaves room for; lowered (raise `ulimit -n` for more)"
            );
            app.engine_events.set_max_sources(most as usize);
        }
    }
    start_replication(&app).await?;
    let alive = Arc::clone(app.engine_events.alive());
    let count = Arc::clone(&alive);
    let budget = listener::ConnectionBudget::new(
        options.connections.max_connections,
        open_files,
        per_source,
        Box::new(move || count.count() as u64),
    );
    // Said once at start for the sources there are now (the config's), as before;
    // the budget says each change after.
    let connections = options
        .connections
        .capped_by_file_limit(alive.count() as u64 * per_source);
    let follow = Arc::downgrade(&budget);
    alive.on_change(Box::new(move || {
        if let Some(budget) = follow.upgrade() {
            budget.refresh();
        }
    }));
    // A source that started or stopped before the hook was set.
    budget.refresh();
    println!("listening on {address}");
    tracing::info!(
        %address,
        generation = app.snapshot.load().generation,
        auth = app.snapshot.load().tokens.is_some(),
        max_connections = budget.cap(),
        "kvhint serving"
    );

    let hup_app = Arc::clone(&app);
    tokio::spawn(async move {
        while hangups.recv().await.is_some() {
            let app = Arc::clone(&hup_app);
            let _ = tokio::task::spawn_blocking(move || {
                app.reloader.reload(&app.snapshot, Trigger::Sighup)
            })
            .await;
        }
    });
    let sweeper = tokio::spawn(expire_bookings(Arc::clone(&app)));
    let health = tokio::spawn(gateway::health_checks(Arc::clone(&app)));
    let picker = start_endpoint_picker(&options, &app).await?;

    let metrics = Arc::clone(&app.metrics);
    let stopping = Arc::clone(&app);
    let replication = app.replication.get().cloned();
    listener::serve(
        listener,
        routes(app, options.max_body_bytes),
        connections,
        budget,
        metrics,
        async {
            use tokio::signal::unix::{signal, SignalKind};
            let mut term = match signal(SignalKind::terminate()) {
                Ok(term) => term,
                Err(_) => return std::future::pending().await,
            };
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            // A reload in flight is abandoned (its probe killed) and queued ones
            // are dropped: the exit waits for neither (each could otherwise run a
            // whole probe timeout).
            stopping.reloader.shut_down();
            let probes_killed = crate::loader::probe::abandon_all();
            tracing::info!(probes_killed, "shutting down");
        },
        std::time::Duration::from_secs(10),
    )
    .await;
    sweeper.abort();
    health.abort();
    if let Some((stop, picker)) = picker {
        let _ = stop.send(());
        let _ = picker.await;
    }
    if let Some(replication) = replication {
        // Goodbye: the peers drop this replica's load now, not after the timeout.
        replication.shutdown().await;
    }
    Ok(())
}

/// The endpoint picker's gRPC listener (`endpoint_picker.listen`), if the config
/// has one; its server stops when the returned sender fires. Like the API, a
/// non-loopback address needs `--allow-unauthenticated` (Envoy's ext_proc calls
/// carry no kvhint token).
async fn start_endpoint_picker(
    options: &ServeOptions,
    app: &Arc<App>,
) -> anyhow::Result<
    Option<(
        tokio::sync::oneshot::Sender<()>,
        tokio::task::JoinHandle<()>,
    )>,
> {
    let Some(config) = app.endpoint_picker.clone() else {
        return Ok(None);
    };
    if !config.listen.ip().is_loopback() && !options.allow_unauthenticated {
        anyhow::bail!(
            "endpoint_picker.listen {} is not a loopback address: the endpoint picker takes no tokens, so anyone who reaches it could book; listen on loopback (a sidecar beside Envoy), or pass --allow-unauthenticated on a network only the proxy reaches",
            config.listen
        );
    }
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| {
            format!(
                "cannot listen on {} (endpoint_picker.listen)",
                config.listen
            )
        })?;
    let address = listener.local_addr()?;
    println!("endpoint picker listening on {address}");
    tracing::info!(%address, "kvhint endpoint picker (Envoy ext_proc) serving");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let app = Arc::clone(app);
    let task = tokio::spawn(async move {
        let shutdown = async {
            let _ = stopped.await;
        };
        if let Err(error) = endpoint_picker::serve(app, config, listener, shutdown).await {
            tracing::error!(%error, "the endpoint picker's gRPC server stopped");
        }
    });
    Ok(Some((stop, task)))
}

#[cfg(test)]
mod tests {
    use super::points_at;

    #[test]
    fn a_worker_endpoint_at_the_router_s_own_address_is_recognised_and_no_other() {
        let loopback = "127.0.0.1:8080".parse().unwrap();
        for (endpoint, own) in [
            ("http://127.0.0.1:8080", true),
            ("http://localhost:8080", true),
            ("http://0.0.0.0:8080", true),
            ("http://127.0.0.1:8081", false),
            // Another loopback address may be another process's.
            ("http://127.0.0.2:8080", false),
            ("http://10.0.0.1:8080", false),
            ("https://worker.example:8080", false),
        ] {
            assert_eq!(points_at(endpoint, loopback), own, "{endpoint}");
        }
        let every = "0.0.0.0:8080".parse().unwrap();
        for (endpoint, own) in [
            ("http://127.0.0.5:8080", true),
            ("http://[::1]:8080", true),
            ("http://localhost:8080", true),
            ("http://127.0.0.5:9090", false),
        ] {
            assert_eq!(points_at(endpoint, every), own, "{endpoint}");
        }
    }
}
