//! kvhint as Envoy's endpoint picker: the Gateway API Inference Extension's
//! protocol, gRPC `envoy.service.ext_proc.v3.ExternalProcessor/Process`, beside
//! the HTTP API when the config has `endpoint_picker:`.
//!
//! Envoy does the forwarding; kvhint does what its own front door does before it
//! (`gateway::dispatch`, the same function): read the body, render and
//! tokenize, book, splice the hint where the engine takes it. One gRPC stream is
//! one HTTP request, in full-duplex streamed body mode:
//!
//! ```text
//! Envoy                                   kvhint
//! request headers ───────────────────────► (:path names the route; subset hint read)
//! request body chunks … end_of_stream ───► dispatch on a booking thread
//!     ◄── headers response: x-gateway-destination-endpoint (+ envoy.lb metadata),
//!         the adapter's headers, content-length removed if the body changed
//!     ◄── the (spliced) body, in chunks, the last with end_of_stream
//! response headers ──────────────────────► status seen (worker health), echoed
//! response body chunks … end_of_stream ──► echoed back; release (completed)
//! stream closes or breaks before that ───► release (client disconnect)
//! ```
//!
//! No eligible worker answers 503, a full queue or too many open bookings 429,
//! both as Envoy immediate responses with OpenAI's error body.

use super::metrics::Metrics;
use crate::config::EndpointPickerConfig;
use crate::domain::{HttpTarget, WorkerKey};
use crate::gateway::adapter::Route;
use crate::gateway::dispatch::{count_hint, dispatch, wait_for_prefix, Attempt, Body, Booked};
use crate::gateway::stats::Release;
use crate::gateway::GatewayError;
use crate::gateway::RequestPath;
use axum::http::StatusCode;
use envoy_types::pb::envoy::config::core::v3::{
    header_value_option::HeaderAppendAction, HeaderValue, HeaderValueOption, Metadata,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_request, processing_response, BodyMutation, BodyResponse,
    CommonResponse, HeaderMutation, HeadersResponse, HttpHeaders, ImmediateResponse,
    ProcessingRequest, ProcessingResponse, StreamedBodyResponse, TrailersResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

/// The header (and `envoy.lb` metadata key) naming where Envoy sends the request.
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
/// The dynamic-metadata namespace Envoy's load balancer reads the destination from.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// Where the proxy puts the endpoints a request may go to (its subset hint).
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
/// The gRPC health service name that reports readiness (the ext_proc service's).
pub const READINESS_SERVICE: &str = "envoy.service.ext_proc.v3.ExternalProcessor";
/// A body chunk sent back to Envoy at most (as the reference picker does: under
/// the 64 KiB Envoy buffers per chunk by default).
const CHUNK: usize = 62_000;
/// Messages queued to Envoy per stream before the sender waits.
const QUEUE: usize = 16;

/// The ext_proc service.
pub struct Picker {
    path: RequestPath,
    /// Where its refusals are counted, as the HTTP API's are.
    metrics: Arc<Metrics>,
    config: EndpointPickerConfig,
    /// Streams open now (`endpoint_picker.max_streams`).
    streams: Arc<AtomicU64>,
    /// Request-body bytes held now, across streams
    /// (`endpoint_picker.max_buffered_bytes`).
    buffered: Arc<AtomicU64>,
}

/// A stream's place in the count of open streams, given back when it ends.
struct StreamSlot(Arc<AtomicU64>);

impl Drop for StreamSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The body bytes one stream holds, counted in the picker's total and given
/// back when the body is taken or the stream ends.
struct Held {
    total: Arc<AtomicU64>,
    here: u64,
}

impl Held {
    /// Counts `n` more bytes unless the total would pass `max`.
    fn take(&mut self, n: u64, max: u64) -> bool {
        let before = self.total.fetch_add(n, Ordering::Relaxed);
        if before.saturating_add(n) > max {
            self.total.fetch_sub(n, Ordering::Relaxed);
            return false;
        }
        self.here += n;
        true
    }

    fn release(&mut self) {
        self.total
            .fetch_sub(std::mem::take(&mut self.here), Ordering::Relaxed);
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.release();
    }
}

/// The gRPC server on `listener` (ext_proc and `grpc.health.v1.Health`) until
/// `shutdown` resolves.
pub async fn serve(
    path: RequestPath,
    metrics: Arc<Metrics>,
    config: EndpointPickerConfig,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    let (reporter, health) = tonic_health::server::health_reporter();
    // Liveness: the empty service name answers SERVING while the server runs.
    reporter
        .set_service_status("", tonic_health::ServingStatus::Serving)
        .await;
    let readiness = tokio::spawn(readiness(path.clone(), reporter));
    let picker = Picker {
        path,
        metrics,
        config,
        streams: Arc::default(),
        buffered: Arc::default(),
    };
    // No Nagle: each ext_proc message is small and answered at once (with it, a
    // message waits for the peer's delayed ACK, ~40 ms).
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    let result = tonic::transport::Server::builder()
        .add_service(health)
        .add_service(ExternalProcessorServer::new(picker))
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await;
    readiness.abort();
    result
}

/// Readiness: SERVING while at least one worker with an HTTP endpoint is
/// healthy (a request could be booked), NOT_SERVING otherwise; checked each
/// second.
async fn readiness(path: RequestPath, reporter: tonic_health::server::HealthReporter) {
    let mut last = None;
    loop {
        let ready = path
            .router
            .workers()
            .iter()
            .any(|(worker, _)| worker.http.is_some() && path.gateway.health.admits(worker.key));
        if last != Some(ready) {
            let status = if ready {
                tonic_health::ServingStatus::Serving
            } else {
                tonic_health::ServingStatus::NotServing
            };
            reporter.set_service_status(READINESS_SERVICE, status).await;
            last = Some(ready);
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

#[tonic::async_trait]
impl ExternalProcessor for Picker {
    type ProcessStream = ReceiverStream<Result<ProcessingResponse, Status>>;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let open = self.streams.fetch_add(1, Ordering::Relaxed);
        let slot = StreamSlot(Arc::clone(&self.streams));
        if open >= self.config.max_streams {
            drop(slot);
            return Err(Status::resource_exhausted(format!(
                "{open} ext_proc streams are open, endpoint_picker.max_streams ({}); retry when some have ended, or raise it",
                self.config.max_streams
            )));
        }
        let inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(QUEUE);
        let exchange = Exchange {
            _slot: slot,
            held: Held {
                total: Arc::clone(&self.buffered),
                here: 0,
            },
            body_deadline: None,
            path: self.path.clone(),
            metrics: Arc::clone(&self.metrics),
            config: self.config.clone(),
            tx,
            received: Instant::now(),
            route: None,
            subset: None,
            body: Vec::new(),
            booked: None,
            status: None,
            first_byte: false,
            booked_at: Instant::now(),
        };
        tokio::spawn(exchange.run(inbound));
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// What ends an exchange early: Envoy went away, or an immediate response was sent.
struct Stop;

/// One HTTP request's conversation with Envoy.
struct Exchange {
    _slot: StreamSlot,
    /// The body bytes buffered here, counted across streams.
    held: Held,
    /// When the request's body must have ended (set at its headers, cleared
    /// once it has).
    body_deadline: Option<Instant>,
    path: RequestPath,
    metrics: Arc<Metrics>,
    config: EndpointPickerConfig,
    tx: mpsc::Sender<Result<ProcessingResponse, Status>>,
    received: Instant,
    /// From `:path`; `None` until the request headers came.
    route: Option<Route>,
    /// The proxy's subset hint: `ip:port` endpoints the request may go to.
    subset: Option<Vec<String>>,
    body: Vec<u8>,
    /// The open booking (its guard releases it when this exchange ends).
    booked: Option<Booked>,
    /// The worker's response status, once its headers came.
    status: Option<u16>,
    first_byte: bool,
    booked_at: Instant,
}

impl Exchange {
    async fn run(mut self, mut inbound: Streaming<ProcessingRequest>) {
        loop {
            let next = match self.body_deadline {
                Some(at) => match tokio::time::timeout_at(at.into(), inbound.message()).await {
                    Ok(next) => next,
                    Err(_) => {
                        let _ = self
                            .tx
                            .send(Err(Status::deadline_exceeded(format!(
                                "the request body did not end within {} ms of its headers (endpoint_picker.body_timeout_ms)",
                                self.config.body_timeout_ms
                            ))))
                            .await;
                        break;
                    }
                },
                None => inbound.message().await,
            };
            let message = match next {
                Ok(Some(message)) => message,
                // Envoy closed the stream (the request is over) or it broke.
                Ok(None) | Err(_) => break,
            };
            let Some(request) = message.request else {
                continue;
            };
            let step = match request {
                processing_request::Request::RequestHeaders(headers) => {
                    self.request_headers(headers, message.metadata_context)
                        .await
                }
                processing_request::Request::RequestBody(body) => {
                    if !self
                        .held
                        .take(body.body.len() as u64, self.config.max_buffered_bytes)
                    {
                        let _ = self
                            .tx
                            .send(Err(Status::resource_exhausted(format!(
                                "the picker holds endpoint_picker.max_buffered_bytes ({}) of request bodies across its streams; retry shortly",
                                self.config.max_buffered_bytes
                            ))))
                            .await;
                        break;
                    }
                    self.body.extend_from_slice(&body.body);
                    if self.body.len() as u64 > self.config.max_body_bytes {
                        let error = GatewayError::new(
                            StatusCode::PAYLOAD_TOO_LARGE,
                            "invalid_request_error",
                            "body_too_large",
                            format!(
                                "the body is over {} bytes (endpoint_picker.max_body_bytes)",
                                self.config.max_body_bytes
                            ),
                        );
                        self.refuse(error).await
                    } else if body.end_of_stream {
                        self.dispatch(true).await
                    } else {
                        Ok(())
                    }
                }
                processing_request::Request::RequestTrailers(_) => {
                    // The body ended without end_of_stream: trailers follow it.
                    match self.dispatch(false).await {
                        Ok(()) => {
                            self.send(processing_response::Response::RequestTrailers(
                                TrailersResponse::default(),
                            ))
                            .await
                        }
                        stop => stop,
                    }
                }
                processing_request::Request::ResponseHeaders(headers) => {
                    self.response_headers(headers).await
                }
                processing_request::Request::ResponseBody(body) => {
                    if !self.first_byte && !body.body.is_empty() {
                        self.first_byte = true;
                        if let Some(booked) = &self.booked {
                            booked.guard.prefill_done();
                        }
                    }
                    let end = body.end_of_stream;
                    let sent = self
                        .send(processing_response::Response::ResponseBody(streamed(
                            body.body, end,
                        )))
                        .await;
                    if end {
                        self.end(Release::Completed);
                    }
                    sent
                }
                processing_request::Request::ResponseTrailers(_) => {
                    self.end(Release::Completed);
                    self.send(processing_response::Response::ResponseTrailers(
                        TrailersResponse::default(),
                    ))
                    .await
                }
            };
            if step.is_err() {
                break;
            }
        }
        // Whatever is still open (Envoy reset the stream: the client left, or the
        // upstream failed before answering) is released here.
        self.end(Release::ClientDisconnect);
    }

    async fn send(&self, response: processing_response::Response) -> Result<(), Stop> {
        self.send_message(ProcessingResponse {
            response: Some(response),
            ..Default::default()
        })
        .await
    }

    async fn send_message(&self, message: ProcessingResponse) -> Result<(), Stop> {
        self.tx.send(Ok(message)).await.map_err(|_| Stop)
    }

    async fn request_headers(
        &mut self,
        headers: HttpHeaders,
        metadata: Option<Metadata>,
    ) -> Result<(), Stop> {
        self.received = Instant::now();
        let path = header(&headers, ":path").unwrap_or_default();
        let path = path.split('?').next().unwrap_or_default();
        let method = header(&headers, ":method").unwrap_or_default();
        self.route = match path {
            "/v1/chat/completions" => Some(Route::Chat),
            "/v1/completions" => Some(Route::Completions),
            "/generate" => Some(Route::Generate),
            _ => None,
        };
        if self.route.is_none() || method != "POST" {
            return self
                .refuse(GatewayError::new(
                    StatusCode::NOT_FOUND,
                    "invalid_request_error",
                    "unknown_route",
                    format!(
                        "{method} {path} is not a route kvhint picks an endpoint for; send POST /v1/chat/completions, /v1/completions or /generate"
                    ),
                ))
                .await;
        }
        match subset(metadata.as_ref()) {
            Ok(subset) => self.subset = subset,
            Err(message) => {
                return self
                    .refuse(GatewayError::bad_request("invalid_subset_hint", message))
                    .await
            }
        }
        if headers.end_of_stream {
            return self
                .refuse(GatewayError::bad_request(
                    "missing_body",
                    "the request has no body; send the JSON request",
                ))
                .await;
        }
        // Nothing is sent yet: the headers' answer names the endpoint, which
        // needs the body (full-duplex mode lets it wait for it), within its bound.
        self.body_deadline =
            Some(Instant::now() + Duration::from_millis(self.config.body_timeout_ms));
        Ok(())
    }

    /// The whole body is here: book, then send the headers' answer and the body.
    async fn dispatch(&mut self, end_of_stream: bool) -> Result<(), Stop> {
        let Some(route) = self.route else {
            return Err(Stop);
        };
        if self.booked.is_some() {
            return Ok(());
        }
        let snapshot = self.path.snapshot.load_full();
        let request_id = self.path.gateway.request_id();
        let job = {
            let path = self.path.clone();
            let body = std::mem::take(&mut self.body);
            self.body_deadline = None;
            self.held.release();
            let subset = self.subset.clone();
            let snapshot = Arc::clone(&snapshot);
            let request_id = request_id.clone();
            let most = self.config.fallbacks as usize;
            move || -> Result<(Booked, Vec<String>), GatewayError> {
                let allowed = subset
                    .as_ref()
                    .map(|subset| move |target: &HttpTarget| in_subset(subset, &target.authority));
                let allowed_ref = allowed
                    .as_ref()
                    .map(|f| f as &(dyn Fn(&HttpTarget) -> bool + Sync));
                let text: Arc<str> = std::str::from_utf8(&body)
                    .map_err(|_| GatewayError::not_utf8())?
                    .into();
                let attempt = Attempt {
                    route,
                    request_id: &request_id,
                    tried: &[],
                    prepared: None,
                    allowed: allowed_ref,
                };
                let booked = dispatch(&path, &snapshot, Body::Text(text), attempt)?;
                let fallbacks = fallbacks(&path, &booked, route, allowed_ref, most);
                Ok((booked, fallbacks))
            }
        };
        let result = self
            .path
            .bookings
            .run(job)
            .await
            .map_err(GatewayError::from);
        let (booked, fallbacks) = match result {
            Ok(Ok(done)) => done,
            Ok(Err(error)) | Err(error) => return self.refuse(error).await,
        };
        count_hint(&self.path.gateway, &booked.forward, booked.engine);
        if let Some(gate) = booked.wait_for.as_deref() {
            let settings = self.path.snapshot.load().gateway.clone();
            if !wait_for_prefix(&self.path.gateway, gate, booked.cached_tokens, &settings).await {
                booked.guard.sent_while_busy();
            }
        }
        self.booked_at = Instant::now();
        let mut endpoints = booked.authority.to_string();
        for fallback in &fallbacks {
            endpoints.push(',');
            endpoints.push_str(fallback);
        }
        let mut set = vec![set_header(DESTINATION, &endpoints)];
        for (name, value) in &booked.forward.headers {
            set.push(set_header(name, value));
        }
        set.push(set_header("x-kvhint-request-id", booked.guard.request_id()));
        let changed = booked.forward.body != booked.body.text().as_bytes();
        let mutation = HeaderMutation {
            set_headers: set,
            // A changed body goes chunked: its old length would be a lie.
            remove_headers: if changed {
                vec!["content-length".to_string()]
            } else {
                Vec::new()
            },
        };
        let lb = Struct {
            fields: HashMap::from([(
                DESTINATION.to_string(),
                Value {
                    kind: Some(Kind::StringValue(endpoints)),
                },
            )]),
        };
        let dynamic_metadata = Struct {
            fields: HashMap::from([(
                LB_NAMESPACE.to_string(),
                Value {
                    kind: Some(Kind::StructValue(lb)),
                },
            )]),
        };
        let body = booked.forward.body.clone();
        // From here the booking is this exchange's: released at the response's
        // end, or when the stream ends first.
        self.booked = Some(booked);
        self.send_message(ProcessingResponse {
            response: Some(processing_response::Response::RequestHeaders(
                HeadersResponse {
                    response: Some(CommonResponse {
                        header_mutation: Some(mutation),
                        clear_route_cache: true,
                        ..Default::default()
                    }),
                },
            )),
            dynamic_metadata: Some(dynamic_metadata),
            ..Default::default()
        })
        .await?;
        let mut chunks = body.chunks(CHUNK).peekable();
        if chunks.peek().is_none() {
            return self
                .send(processing_response::Response::RequestBody(streamed(
                    Vec::new(),
                    end_of_stream,
                )))
                .await;
        }
        while let Some(chunk) = chunks.next() {
            let last = chunks.peek().is_none();
            self.send(processing_response::Response::RequestBody(streamed(
                chunk.to_vec(),
                last && end_of_stream,
            )))
            .await?;
        }
        Ok(())
    }

    async fn response_headers(&mut self, headers: HttpHeaders) -> Result<(), Stop> {
        let status = header(&headers, ":status")
            .and_then(|s| s.parse::<u16>().ok())
            .unwrap_or(0);
        self.status = Some(status);
        let mut set = Vec::new();
        if let Some(booked) = &self.booked {
            let key = booked.worker;
            let settings = &self.path.snapshot.load().gateway;
            if status == 429 || status >= 500 {
                self.path.gateway.health.request_failed(
                    key,
                    settings.circuit_failures,
                    settings.circuit_open_ms,
                    format!("it answered {status} (through the proxy)"),
                );
            } else {
                self.path.gateway.health.request_succeeded(key);
            }
            let now = Instant::now();
            self.path.gateway.stats.answered(
                &booked.prepared.model.name,
                key,
                status,
                self.booked_at.saturating_duration_since(self.received),
                booked.prepared.tokenize,
                now.saturating_duration_since(self.received),
            );
            set.push(set_header(
                "x-kvhint-worker",
                &format!("{} {}", key.worker_id, key.dp_rank),
            ));
            set.push(set_header("x-kvhint-request-id", booked.guard.request_id()));
        }
        let sent = self
            .send(processing_response::Response::ResponseHeaders(
                HeadersResponse {
                    response: Some(CommonResponse {
                        header_mutation: Some(HeaderMutation {
                            set_headers: set,
                            remove_headers: Vec::new(),
                        }),
                        ..Default::default()
                    }),
                },
            ))
            .await;
        if headers.end_of_stream {
            self.end(Release::Completed);
        }
        sent
    }

    /// Answers Envoy with an error response in OpenAI's shape, counted as the
    /// front door counts its refusals; the exchange ends.
    async fn refuse(&mut self, error: GatewayError) -> Result<(), Stop> {
        self.path.gateway.stats.refused(error.status.as_u16());
        self.metrics.error(error.code);
        let body = serde_json::to_vec(&error.body()).unwrap_or_default();
        let _ = self
            .send(processing_response::Response::ImmediateResponse(
                ImmediateResponse {
                    status: Some(HttpStatus {
                        code: i32::from(error.status.as_u16()),
                    }),
                    headers: Some(HeaderMutation {
                        set_headers: vec![set_header("content-type", "application/json")],
                        remove_headers: Vec::new(),
                    }),
                    body,
                    details: error.code.to_string(),
                    ..Default::default()
                },
            ))
            .await;
        Err(Stop)
    }

    /// Releases the booking, if still open, for `reason` (once).
    fn end(&mut self, reason: Release) {
        let Some(mut booked) = self.booked.take() else {
            return;
        };
        booked.guard.finish(reason);
        let key: WorkerKey = booked.worker;
        let duration = self.received.elapsed();
        self.path
            .gateway
            .stats
            .ended(&booked.prepared.model.name, key, duration, None);
        tracing::info!(
            target: "kvhint::access",
            request_id = %booked.guard.request_id(),
            model = %booked.prepared.model.name,
            worker = key.worker_id,
            dp_rank = key.dp_rank,
            status = self.status.unwrap_or(0),
            duration_ms = duration.as_secs_f64() * 1e3,
            end = reason.as_str(),
            via = "endpoint_picker",
            "request"
        );
    }
}

/// Other workers the request could go to if the booked one fails (the proxy's
/// retries): healthy, serving the model and route, allowed by the subset hint,
/// at another address; in the router's order.
fn fallbacks(
    path: &RequestPath,
    booked: &Booked,
    route: Route,
    allowed: crate::gateway::Allowed<'_>,
    most: usize,
) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for (worker, _) in path.router.workers() {
        if out.len() >= most {
            break;
        }
        let Some(http) = &worker.http else {
            continue;
        };
        if worker.key == booked.worker
            || *http.authority == *booked.authority
            || !http.serves(&booked.prepared.model.name)
            || !route.served_by(http.engine)
            || !allowed.is_none_or(|allowed| allowed(http))
            || !path.gateway.health.admits(worker.key)
            || out.iter().any(|a| **a == *http.authority)
        {
            continue;
        }
        out.push(http.authority.to_string());
    }
    out
}

/// Whether `authority` (`host:port`) is in the proxy's subset: as `ip:port`, or
/// as the bare address (all its ports).
fn in_subset(subset: &[String], authority: &str) -> bool {
    let host = authority
        .rsplit_once(':')
        .map_or(authority, |(host, _)| host);
    subset
        .iter()
        .any(|entry| entry == authority || entry == host)
}

/// The proxy's subset hint, from `filter_metadata["envoy.lb.subset_hint"]
/// ["x-gateway-destination-endpoint-subset"]`: a list of `ip:port` strings.
/// An empty list is a subset with nothing in it (the protocol answers 503).
fn subset(metadata: Option<&Metadata>) -> Result<Option<Vec<String>>, String> {
    let Some(value) = metadata
        .and_then(|m| m.filter_metadata.get(SUBSET_NAMESPACE))
        .and_then(|s| s.fields.get(SUBSET_KEY))
    else {
        return Ok(None);
    };
    let entries = match &value.kind {
        Some(Kind::ListValue(list)) => list
            .values
            .iter()
            .map(|v| match &v.kind {
                Some(Kind::StringValue(s)) => Ok(s.clone()),
                _ => Err(format!(
                    "`{SUBSET_NAMESPACE}.{SUBSET_KEY}` holds a list entry that is not a string; give `ip:port` strings"
                )),
            })
            .collect::<Result<Vec<_>, _>>()?,
        // A single string (comma-separated), as a header would carry it.
        Some(Kind::StringValue(s)) => s
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect(),
        _ => {
            return Err(format!(
                "`{SUBSET_NAMESPACE}.{SUBSET_KEY}` is not a list of `ip:port` strings"
            ))
        }
    };
    Ok(Some(entries))
}

/// A header's value from Envoy (in `raw_value` since Envoy 1.27, `value` before).
fn header(headers: &HttpHeaders, name: &str) -> Option<String> {
    headers
        .headers
        .as_ref()?
        .headers
        .iter()
        .find(|h| h.key.eq_ignore_ascii_case(name))
        .map(|h| {
            if h.raw_value.is_empty() {
                h.value.clone()
            } else {
                String::from_utf8_lossy(&h.raw_value).into_owned()
            }
        })
}

fn set_header(name: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: name.to_string(),
            raw_value: value.as_bytes().to_vec(),
            ..Default::default()
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..Default::default()
    }
}

/// A body chunk sent back in full-duplex streamed mode.
fn streamed(body: Vec<u8>, end_of_stream: bool) -> BodyResponse {
    BodyResponse {
        response: Some(CommonResponse {
            body_mutation: Some(BodyMutation {
                mutation: Some(body_mutation::Mutation::StreamedResponse(
                    StreamedBodyResponse {
                        body,
                        end_of_stream,
                        ..Default::default()
                    },
                )),
            }),
            ..Default::default()
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::google::protobuf::ListValue;

    fn metadata(value: Kind) -> Metadata {
        Metadata {
            filter_metadata: HashMap::from([(
                SUBSET_NAMESPACE.to_string(),
                Struct {
                    fields: HashMap::from([(SUBSET_KEY.to_string(), Value { kind: Some(value) })]),
                },
            )]),
            ..Default::default()
        }
    }

    #[test]
    fn the_subset_hint_is_a_list_of_endpoints() {
        let list = Kind::ListValue(ListValue {
            values: vec![Value {
                kind: Some(Kind::StringValue("10.0.0.1:8000".into())),
            }],
        });
        let listed = subset(Some(&metadata(list))).ok().flatten();
        assert_eq!(listed, Some(vec!["10.0.0.1:8000".to_string()]));
        assert_eq!(subset(None), Ok(None));
        assert!(subset(Some(&metadata(Kind::NumberValue(1.0)))).is_err());
        let empty = Kind::ListValue(ListValue { values: vec![] });
        assert_eq!(subset(Some(&metadata(empty))), Ok(Some(vec![])));
    }

    #[test]
    fn an_endpoint_is_in_the_subset_by_address_and_port_or_by_address() {
        let subset = vec!["10.0.0.1:8000".to_string(), "10.0.0.2".to_string()];
        assert!(in_subset(&subset, "10.0.0.1:8000"));
        assert!(!in_subset(&subset, "10.0.0.1:8001"));
        assert!(in_subset(&subset, "10.0.0.2:9000"));
        assert!(!in_subset(&subset, "10.0.0.3:8000"));
    }
}
