//! The fleet's background checks, for as long as the router runs: each HTTP
//! worker's health path on its interval (the health table follows the
//! results), and what bounds the router's picture of each worker's KV cache
//! (its capacity, configured or asked of the engine).

use super::send::local_shortage;
use super::RequestPath;
use crate::logging::with_causes;
use axum::http::header;
use bytes::Bytes;
use http_body_util::Full;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Bounds what the router believes of each worker's KV cache by its capacity:
/// its `kv_capacity_tokens`, else what its engine says (asked in the background,
/// once it answers; see [`super::capacity`]). An approximate worker's credits
/// are capped by it (else learned from its answers); an event-fed worker's goes
/// to the bookings, which anticipate the evictions it makes certain
/// (`gateway.anticipate_evictions`, with `credit_in_flight`).
fn bound_kv_pictures(
    path: &RequestPath,
    workers: &[(Arc<crate::domain::Worker>, crate::router::workers::Load)],
    block_size: usize,
    settings: &crate::config::HealthConfig,
    anticipate: bool,
) {
    let now = Instant::now();
    let approximate = &path.gateway.approximate;
    for (worker, _) in workers {
        let tokens = worker
            .kv_capacity_tokens
            .or_else(|| approximate.engine_capacity(worker.key));
        let blocks = tokens.map(|t| (t / block_size.max(1) as u64).max(1));
        let anticipated = anticipate && !worker.approximate_kv;
        if worker.approximate_kv {
            approximate.configure(worker.key, blocks);
        }
        if let Some(cell) = path.router.load_cell(worker.key) {
            cell.set_capacity_blocks(blocks.filter(|_| anticipated));
        }
        if !worker.approximate_kv && !anticipated {
            continue;
        }
        let Some(http) = worker.http.clone() else {
            continue;
        };
        let Some(capacity_path) = super::capacity::path(http.engine) else {
            continue;
        };
        if worker.kv_capacity_tokens.is_some() || !approximate.should_read(worker.key, now) {
            continue;
        }
        let request_path = path.clone();
        let key = worker.key;
        let timeout = Duration::from_millis(settings.timeout_ms.max(1000));
        let what = if worker.approximate_kv {
            "its approximate credits are bounded by that"
        } else {
            "bookings anticipate the evictions that makes certain"
        };
        tokio::spawn(async move {
            let path = capacity_path;
            let tokens = read_capacity(&request_path.gateway, &http, path, timeout).await;
            match tokens {
                Some(tokens) => tracing::info!(
                    worker = %key,
                    tokens,
                    "the engine says its KV cache holds {tokens} tokens (GET {path}); {what}"
                ),
                None => {
                    tracing::debug!(worker = %key, "GET {path} said no KV capacity; asking again later")
                }
            }
            request_path
                .gateway
                .approximate
                .reported(key, tokens, Instant::now());
        });
    }
}

/// `GET {path}` of a worker, read as [`super::capacity::parse`] reads it.
async fn read_capacity(
    gateway: &super::Gateway,
    http: &crate::domain::HttpTarget,
    path: &str,
    timeout: Duration,
) -> Option<u64> {
    use http_body_util::BodyExt;
    let mut request = hyper::Request::get(format!("{}{path}", http.base));
    if let Some((headers, key)) = request
        .headers_mut()
        .zip(http.api_key.as_ref().and_then(|k| k.authorization()))
    {
        headers.insert(header::AUTHORIZATION, key);
    }
    let request = request.body(Full::new(Bytes::new())).ok()?;
    let read = async {
        let response = gateway.client.request(request).await.ok()?;
        if !response.status().is_success() {
            return None;
        }
        // A vLLM server's metrics are tens of KiB; anything past 8 MiB is not one.
        let body = http_body_util::Limited::new(response.into_body(), 8 << 20)
            .collect()
            .await
            .ok()?
            .to_bytes();
        super::capacity::parse(http.engine, &body)
    };
    tokio::time::timeout(timeout, read).await.ok().flatten()
}

/// Checks every HTTP worker's `GET /health` each `gateway.health.interval_ms`,
/// for as long as the router runs; the health table follows the results, and
/// forgets workers that left.
pub async fn health_checks(path: RequestPath) {
    loop {
        let gateway_settings = path.snapshot.load().gateway.clone();
        let settings = gateway_settings.health.clone();
        path.gateway.approximate.expire(
            &path.ingest,
            Duration::from_secs(gateway_settings.approximate_ttl_s),
        );
        let block_size = path.snapshot.load().block_size;
        let anticipate = gateway_settings.credit_in_flight && gateway_settings.anticipate_evictions;
        bound_kv_pictures(
            &path,
            &path.router.workers(),
            block_size,
            &settings,
            anticipate,
        );
        if settings.interval_ms == 0 {
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        }
        let started = tokio::time::Instant::now();
        let workers = path.router.workers();
        path.gateway
            .health
            .retain(|key| workers.iter().any(|(w, _)| w.key == *key));
        path.gateway
            .approximate
            .forget(|key| workers.iter().any(|(w, _)| w.key == *key));
        let mut checks = tokio::task::JoinSet::new();
        for (worker, _) in &workers {
            let Some(http) = worker.http.clone() else {
                continue;
            };
            let key = worker.key;
            let client = path.gateway.client.clone();
            let timeout = Duration::from_millis(settings.timeout_ms);
            let health_path = settings.path(http.engine).to_string();
            checks.spawn(async move {
                let uri = format!("{}{health_path}", http.base);
                let mut request = hyper::Request::get(uri);
                if let Some((headers, key)) = request
                    .headers_mut()
                    .zip(http.api_key.as_ref().and_then(|k| k.authorization()))
                {
                    headers.insert(header::AUTHORIZATION, key);
                }
                let request = match request.body(Full::new(Bytes::new())) {
                    Ok(request) => request,
                    Err(e) => return (key, Some(Err(e.to_string()))),
                };
                let result = match tokio::time::timeout(timeout, client.request(request)).await {
                    Err(_) => Err(format!("no answer within {} ms", timeout.as_millis())),
                    // The router's own shortage: no verdict on the worker.
                    Ok(Err(e)) if local_shortage(&e).is_some() => return (key, None),
                    Ok(Err(e)) => Err(with_causes(&e)),
                    Ok(Ok(response)) if response.status().is_success() => Ok(()),
                    Ok(Ok(response)) => {
                        Err(format!("GET {health_path} answered {}", response.status()))
                    }
                };
                (key, Some(result))
            });
        }
        while let Some(done) = checks.join_next().await {
            if let Ok((key, Some(result))) = done {
                let ok = result.is_ok();
                path.gateway.health.checked(
                    key,
                    ok,
                    result.err().unwrap_or_default(),
                    settings.failures,
                    settings.successes,
                );
            }
        }
        tokio::time::sleep_until(started + Duration::from_millis(settings.interval_ms)).await;
    }
}
