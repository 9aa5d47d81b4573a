//! OpenTelemetry traces of the front door's requests, exported over OTLP/gRPC
//! to the collector `gateway.tracing` names (off without it: then no span is
//! made and a request pays one branch).
//!
//! A request is one trace (or a part of the client's, continuing its
//! `traceparent`): a `receive` span from the request's arrival to its last byte,
//! with children `tokenize` (render and tokenize), `book` (select the worker,
//! reserve, run the hint policies), `connect` (the request sent to the worker
//! until its response head; the worker gets a `traceparent` naming this span, so
//! an engine that traces hangs its spans under it) and `first_byte` (the head
//! until the first token), and an `end` event saying how the request ended.
//!
//! The spans are built when the request ends, from the instants the request path
//! records anyway, with those instants as their start and end times: the path
//! makes no span, enters none and takes no lock while the request runs.

use crate::config::TracingConfig;
use crate::domain::WorkerKey;
use axum::http::{HeaderMap, HeaderValue};
use opentelemetry::trace::{
    Span as _, SpanContext, SpanId, SpanKind, Status, TraceContextExt, TraceFlags, TraceId,
    TraceState, Tracer as _, TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::trace::{Sampler, SdkTracer, SdkTracerProvider};
use std::time::{Duration, Instant, SystemTime};

/// The tracer, while tracing is configured.
pub struct Tracing {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
}

impl Tracing {
    /// Starts exporting to `config.otlp_endpoint`. Call it inside the Tokio
    /// runtime (the gRPC client lives there); the connection is made lazily, so
    /// a collector that is down costs dropped spans, never a request.
    pub fn start(config: &TracingConfig) -> Result<Self, String> {
        use opentelemetry_otlp::WithExportConfig;
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(config.otlp_endpoint.clone())
            .build()
            .map_err(|e| {
                format!(
                    "the OTLP exporter to {} cannot be made: {e}",
                    config.otlp_endpoint
                )
            })?;
        let ratio = f64::from(config.sample_percent) / 100.0;
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
                ratio,
            ))))
            .with_resource(
                opentelemetry_sdk::Resource::builder()
                    .with_service_name(config.service_name.clone())
                    .build(),
            )
            .build();
        let tracer = provider.tracer("kvhint");
        Ok(Self { provider, tracer })
    }

    /// A request that arrived at `received` with `headers`, on `route`; `None`
    /// when the sampler does not keep it.
    pub fn request(
        &self,
        headers: &HeaderMap,
        route: &'static str,
        received: Instant,
    ) -> Option<RequestTrace> {
        let parent = remote_parent(headers).map_or_else(Context::new, |remote| {
            Context::new().with_remote_span_context(remote)
        });
        let base = (received, SystemTime::now() - received.elapsed());
        let root = self
            .tracer
            .span_builder("receive")
            .with_kind(SpanKind::Server)
            .with_start_time(base.1)
            .with_attributes([KeyValue::new("kvhint.route", route)])
            .start_with_context(&self.tracer, &parent);
        if !root.span_context().is_sampled() {
            return None;
        }
        let cx = Context::new().with_remote_span_context(root.span_context().clone());
        Some(RequestTrace {
            tracer: self.tracer.clone(),
            root,
            cx,
            base,
            connect: None,
            booked: None,
            head: None,
            worker: None,
        })
    }

    /// Sends what is batched, before the process exits.
    pub fn shutdown(&self) {
        if let Err(error) = self.provider.shutdown() {
            tracing::warn!(%error, "the last spans could not be exported");
        }
    }
}

/// A client's `traceparent` (W3C Trace Context, version 00) and `tracestate`.
fn remote_parent(headers: &HeaderMap) -> Option<SpanContext> {
    let text = headers.get("traceparent")?.to_str().ok()?;
    let mut parts = text.trim().split('-');
    let (version, trace, span, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    if version.len() != 2
        || version == "ff"
        || trace.len() != 32
        || span.len() != 16
        || flags.len() != 2
    {
        return None;
    }
    let trace = TraceId::from_hex(trace)
        .ok()
        .filter(|t| *t != TraceId::INVALID)?;
    let span = SpanId::from_hex(span)
        .ok()
        .filter(|s| *s != SpanId::INVALID)?;
    let flags = u8::from_str_radix(flags, 16).ok()?;
    let state = headers
        .get("tracestate")
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.parse::<TraceState>().ok())
        .unwrap_or_default();
    Some(SpanContext::new(
        trace,
        span,
        TraceFlags::new(flags & 1),
        true,
        state,
    ))
}

/// One request's trace while it runs: the root span, and the instants its
/// children will span.
pub struct RequestTrace {
    tracer: SdkTracer,
    root: opentelemetry_sdk::trace::Span,
    /// The root span as a parent.
    cx: Context,
    /// An instant and the wall-clock time it was.
    base: (Instant, SystemTime),
    /// The `connect` span of the attempt in flight, made when the request is
    /// sent (the worker gets its id in its `traceparent`).
    connect: Option<opentelemetry_sdk::trace::Span>,
    /// The booking job's start, the end of tokenization, the job's end.
    booked: Option<(Instant, Instant, Instant)>,
    head: Option<(Instant, u16)>,
    worker: Option<WorkerKey>,
}

impl RequestTrace {
    fn at(&self, instant: Instant) -> SystemTime {
        match instant.checked_duration_since(self.base.0) {
            Some(after) => self.base.1 + after,
            None => self.base.1 - self.base.0.saturating_duration_since(instant),
        }
    }

    /// The booking job ran from `start` to `end`, tokenizing for `tokenize`.
    pub fn booked(&mut self, start: Instant, tokenize: Duration, end: Instant, worker: WorkerKey) {
        self.booked = Some((start, (start + tokenize).min(end), end));
        self.worker = Some(worker);
    }

    /// An attempt failed and the request is booked again elsewhere.
    pub fn retried(&mut self, worker: WorkerKey, why: &str) {
        let now = self.at(Instant::now());
        if let Some(mut connect) = self.connect.take() {
            connect.set_status(Status::error(why.to_string()));
            connect.end_with_timestamp(now);
        }
        self.root.add_event(
            "retry",
            vec![
                KeyValue::new("kvhint.worker_id", worker.worker_id as i64),
                KeyValue::new("kvhint.dp_rank", i64::from(worker.dp_rank)),
                KeyValue::new("kvhint.why", why.to_string()),
            ],
        );
    }

    /// The request goes to the worker now: the `traceparent` it carries there.
    pub fn sending(&mut self, at: Instant) -> Option<HeaderValue> {
        let connect = self
            .tracer
            .span_builder("connect")
            .with_kind(SpanKind::Client)
            .with_start_time(self.at(at))
            .start_with_context(&self.tracer, &self.cx);
        let context = connect.span_context().clone();
        self.connect = Some(connect);
        HeaderValue::from_str(&format!(
            "00-{}-{}-{:02x}",
            context.trace_id(),
            context.span_id(),
            context.trace_flags().to_u8()
        ))
        .ok()
    }

    /// The worker's response head came at `at`.
    pub fn head(&mut self, at: Instant, status: u16) {
        self.head = Some((at, status));
        let at = self.at(at);
        if let Some(mut connect) = self.connect.take() {
            connect.set_attribute(KeyValue::new(
                "http.response.status_code",
                i64::from(status),
            ));
            connect.end_with_timestamp(at);
        }
    }

    fn child(&self, name: &'static str, from: Instant, to: Instant) {
        let mut span = self
            .tracer
            .span_builder(name)
            .with_kind(SpanKind::Internal)
            .with_start_time(self.at(from))
            .start_with_context(&self.tracer, &self.cx);
        span.end_with_timestamp(self.at(to));
    }

    /// The request ended at `end`, `how` (a release reason, or
    /// `answered_by_router`), with `status` to the client; `first_token` and
    /// the engine's token counts from its bytes.
    pub fn finish(
        mut self,
        end: Instant,
        how: &'static str,
        status: u16,
        first_token: Option<Instant>,
        usage: Option<(u64, u64)>,
    ) {
        if let Some((start, tokenized, booked)) = self.booked {
            self.child("tokenize", start, tokenized);
            self.child("book", tokenized, booked);
        }
        if let Some(mut connect) = self.connect.take() {
            // No head came.
            connect.set_status(Status::error(how));
            connect.end_with_timestamp(self.at(end));
        }
        if let Some((head, _)) = self.head {
            self.child("first_byte", head, first_token.unwrap_or(end).max(head));
        }
        let mut attributes = vec![
            KeyValue::new("http.response.status_code", i64::from(status)),
            KeyValue::new("kvhint.end", how),
        ];
        if let Some(worker) = self.worker {
            attributes.push(KeyValue::new("kvhint.worker_id", worker.worker_id as i64));
            attributes.push(KeyValue::new("kvhint.dp_rank", i64::from(worker.dp_rank)));
        }
        if let Some((prompt, completion)) = usage {
            attributes.push(KeyValue::new("gen_ai.usage.input_tokens", prompt as i64));
            attributes.push(KeyValue::new(
                "gen_ai.usage.output_tokens",
                completion as i64,
            ));
        }
        self.root
            .add_event("end", vec![KeyValue::new("kvhint.end", how)]);
        self.root.set_attributes(attributes);
        if status >= 500 {
            self.root.set_status(Status::error(how));
        }
        let end = self.at(end);
        self.root.end_with_timestamp(end);
    }
}
