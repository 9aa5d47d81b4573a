//! `kvhint serve`: the HTTP JSON API around the router, with reload.
//!
//! The state every handler shares is one [`App`] ([`app`], with its
//! construction); the booking API's handlers are in [`api`], the front door's
//! in [`gateway`], the endpoint picker's in [`endpoint_picker`]. This file
//! wires them: the routes behind their guards, and `serve`, which binds the
//! listeners and starts the background tasks.

mod api;
pub mod app;
pub mod auth;
pub mod body;
pub mod endpoint_picker;
pub mod error;
pub mod gateway;
pub mod listener;
pub mod metrics;
pub mod reload;
pub mod status;
mod watch;

pub use app::{build_app, App, ServeOptions};

use anyhow::Context;
use axum::http::StatusCode;
use axum::routing::{delete, get, post};
use error::ApiError;
use reload::Trigger;
use std::sync::Arc;

/// The API's routes over `app`, each group behind the guard of its caller class
/// (see [`auth`]).
pub fn routes(app: Arc<App>, max_body_bytes: usize) -> axum::Router {
    use crate::config::auth::Caller;
    let guarded = |routes: axum::Router<Arc<App>>, caller: Option<Caller>| {
        routes.route_layer(axum::middleware::from_fn_with_state(
            auth::Guard {
                snapshot: Arc::clone(&app.snapshot),
                exposure: app.exposure,
                caller,
            },
            auth::guard,
        ))
    };
    let admin = axum::Router::new()
        .route("/workers/{worker_id}", delete(api::deregister_worker))
        .route("/admin/status", get(status::status))
        .route("/admin/reload", post(api::admin_reload));
    let worker = axum::Router::new()
        .route("/workers", post(api::register_worker))
        .route("/kv_events", post(api::kv_event));
    let client = axum::Router::new()
        .route("/book", post(api::create_booking))
        .route("/release", post(api::release_booking));
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
        .route("/healthz", get(api::healthz))
        .route("/health", get(api::health))
        .route("/readiness", get(gateway::readiness))
        .route("/metrics", get(api::metrics));
    let routes = guarded(admin, Some(Caller::Admin))
        .merge(guarded(worker, Some(Caller::Worker)))
        .merge(guarded(client, Some(Caller::Client)))
        .merge(
            guarded(front_door, Some(Caller::Client))
                .layer(axum::middleware::map_response(error::openai_shape))
                .layer(axum::middleware::from_fn(
                    crate::gateway::access_log::access_log,
                )),
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
        Arc::clone(&app.metrics),
        error::count_errors,
    ))
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
    let health = tokio::spawn(crate::gateway::checks::health_checks(app.path.clone()));
    let picker = start_endpoint_picker(&options, &app).await?;

    let connection_counts = Arc::clone(&app.metrics.connections);
    let stopping = Arc::clone(&app);
    let replication = app.replication.get().cloned();
    listener::serve(
        listener,
        routes(app, options.max_body_bytes),
        connections,
        budget,
        connection_counts,
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
    let (path, metrics) = (app.path.clone(), Arc::clone(&app.metrics));
    let task = tokio::spawn(async move {
        let shutdown = async {
            let _ = stopped.await;
        };
        if let Err(error) = endpoint_picker::serve(path, metrics, config, listener, shutdown).await
        {
            tracing::error!(%error, "the endpoint picker's gRPC server stopped");
        }
    });
    Ok(Some((stop, task)))
}
