//! Disaggregated prefill and decode: a request for a model with
//! `disaggregation` is booked twice from the same token ids, once on the
//! prefill pool (role `prefill`) and once on the decode pool (role `decode`),
//! each on its own role's policies and its own workers' KV, and its KV is
//! handed over the way the engine does it:
//!
//! ```text
//! SGLang:  ─► prefill (bootstrap_host/port/room) ─┐  sent at once; the decode
//!          ─► decode  (same room)  ◄── pulls KV ──┘  server pulls the KV
//! vLLM:    ─► prefill (do_remote_decode, 1 token) ─► kv_transfer_params
//!          ─► decode  (those kv_transfer_params)  ─► streams to the client
//! ```
//!
//! The decode booking is told the prefill worker is its KV's source
//! (`BookRequest::receive_from`): no prefill work is reserved for it, and its
//! hint (`kv.fetch` through the `kv_fetch` policy) names the prefill worker.
//!
//! Each leg's booking has its own guard, so each is released exactly once
//! whatever ends the request: the prefill leg when its answer has been read
//! (or fails), the decode leg with its response. A client that leaves drops
//! this future and with it every leg in flight (the engines abort a request
//! whose connection closes), the SGLang prefill leg still draining included.
//! A leg that fails before any byte reached the client books the pair again
//! without the failed worker, within `gateway.max_attempts`; once no prefill
//! worker is left, `on_prefill_failure` decides (the decode worker alone, or
//! the error).

use super::adapter::{self, Handover, Route};
use super::dispatch::{count_hint, Booked};
use super::pair::{book_pair, Pair, Tried};
use super::release::ReleaseGuard;
use super::send::{respond, send, Answer, Answered, Sent};
use super::stats::{LegOutcome, Release};
use super::{GatewayError, Prepared, RequestPath};
use crate::config::disaggregation::{Mode, OnPrefillFailure};
use crate::domain::WorkerKey;
use crate::logging::with_causes;
use crate::splice::ParsedBody;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use http_body_util::BodyExt;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The client request a pair serves.
pub struct Request<'a> {
    pub route: Route,
    pub headers: &'a HeaderMap,
    pub received: Instant,
    pub request_id: &'a str,
    pub job_started: Instant,
}

/// Why a pair's attempt did not answer, and which worker to leave out next.
enum Retry {
    Prefill(WorkerKey, GatewayError),
    Decode(WorkerKey, GatewayError),
}

/// Serves a booked pair, and books it again while a leg fails before any
/// byte reached the client (see the module's doc).
pub async fn serve(
    path: &RequestPath,
    snapshot: &Arc<crate::snapshot::Snapshot>,
    request: Request<'_>,
    first: Pair,
    trace: &mut Option<super::trace::RequestTrace>,
) -> Result<Response, GatewayError> {
    let settings = snapshot.gateway.clone();
    let deadline = (settings.request_timeout_ms > 0)
        .then(|| request.received + Duration::from_millis(settings.request_timeout_ms));
    let Some(disaggregation) = first.prepared.model.disaggregation.clone() else {
        return Err(GatewayError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "internal",
            "a pair was booked for a model served whole",
        ));
    };
    let mut tried_prefill: Vec<WorkerKey> = Vec::new();
    let mut tried_decode: Vec<WorkerKey> = Vec::new();
    let (body, prepared) = (Arc::clone(&first.body), Arc::clone(&first.prepared));
    let mut pair = first;
    let mut attempt = 1;
    let mut backoff = Duration::from_millis(settings.retry_backoff_ms);
    loop {
        if let Some(trace) = trace.as_mut() {
            trace.booked(
                request.job_started,
                pair.prepared.tokenize,
                Instant::now(),
                pair.decode.worker,
            );
        }
        path.gateway.stats.pairs.path(pair.path);
        let context = Context {
            path,
            request: &request,
            settings: &settings,
            deadline,
        };
        let Pair {
            prepared: this_prepared,
            body: this_body,
            mode,
            decode,
            prefill,
            ..
        } = pair;
        let decode = ready(&this_prepared, decode);
        let outcome = match (mode, prefill) {
            (_, None) => context.decode(decode, trace, None).await,
            (Mode::Sglang, Some(prefill)) => {
                let prefill = ready(&this_prepared, prefill);
                context.sglang(prefill, decode, trace).await
            }
            (Mode::Vllm, Some(prefill)) => {
                let prefill = ready(&this_prepared, prefill);
                context
                    .vllm(this_prepared, this_body, prefill, decode, trace)
                    .await
            }
        };
        let retry = match outcome {
            Ok(response) => return Ok(response),
            Err(Err(error)) => return Err(error),
            Err(Ok(retry)) => retry,
        };
        let (failure, prefill_failed) = match retry {
            Retry::Prefill(key, failure) => {
                tried_prefill.push(key);
                (failure, true)
            }
            Retry::Decode(key, failure) => {
                tried_decode.push(key);
                (failure, false)
            }
        };
        path.gateway
            .stats
            .retries
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        attempt += 1;
        let exhausted = attempt > settings.max_attempts;
        let past_deadline = deadline.is_some_and(|at| Instant::now() >= at);
        // Out of attempts after a prefill failure: the decode worker alone,
        // if the model says so (one more attempt, on decode only).
        let fall_back = prefill_failed
            && exhausted
            && !past_deadline
            && disaggregation.on_prefill_failure == OnPrefillFailure::DecodeAlone;
        if (exhausted || past_deadline) && !fall_back {
            return Err(failure);
        }
        tracing::warn!(request_id = %request.request_id, error = %failure.message, attempt, "a leg of a disaggregated pair failed before any byte reached the client; booking the pair again");
        if !fall_back {
            tokio::time::sleep(backoff).await;
            backoff = backoff.mul_f32(1.5);
        }
        let again = {
            let path2 = path.clone();
            let snapshot = Arc::clone(snapshot);
            let request_id = request.request_id.to_string();
            let tried_prefill = tried_prefill.clone();
            let tried_decode = tried_decode.clone();
            let disaggregation = disaggregation.clone();
            let body = Arc::clone(&body);
            let prepared = Arc::clone(&prepared);
            move || {
                book_pair(
                    &path2,
                    &snapshot,
                    &disaggregation,
                    &body,
                    &prepared,
                    Tried {
                        request_id: &request_id,
                        prefill: &tried_prefill,
                        decode: &tried_decode,
                        prefill_exhausted: fall_back,
                    },
                )
            }
        };
        pair = match path.bookings.run(again).await? {
            Ok(pair) => pair,
            Err(error) if error.code == super::error::NO_WORKERS.openai.code => {
                return Err(failure)
            }
            Err(error) => return Err(error),
        };
    }
}

/// A booked leg ready to send: its guard, its request, what the router found
/// cached on its worker, and what building its request again needs.
struct Ready {
    guard: ReleaseGuard,
    sent: Sent,
    cached_tokens: usize,
    target: Arc<crate::domain::HttpTarget>,
    hint: Option<Box<serde_json::value::RawValue>>,
}

fn ready(prepared: &Arc<Prepared>, booked: Booked) -> Ready {
    let Booked {
        guard,
        cached_tokens,
        worker,
        base,
        engine,
        forward,
        api_key,
        target,
        hint,
        ..
    } = booked;
    Ready {
        guard,
        cached_tokens,
        target,
        hint,
        sent: Sent {
            prepared: Arc::clone(prepared),
            worker,
            base,
            engine,
            forward,
            api_key,
        },
    }
}

/// What an attempt came to: the client's response, or why the pair must be
/// booked again, or the error to answer with.
type Outcome = Result<Response, Result<Retry, GatewayError>>;

/// What every leg of one request reads.
struct Context<'a> {
    path: &'a RequestPath,
    request: &'a Request<'a>,
    settings: &'a crate::config::GatewayConfig,
    deadline: Option<Instant>,
}

impl Context<'_> {
    /// How long a leg's head may take: a stream's comes at once (the idle
    /// bound), a one-body answer when it is complete (the response bound);
    /// never past the deadline.
    fn head_bound(&self, stream: bool) -> Duration {
        let bound = Duration::from_millis(if stream {
            self.settings.idle_timeout_ms
        } else {
            self.settings.response_timeout_ms
        });
        match self.deadline {
            Some(at) => bound.min(at.saturating_duration_since(Instant::now())),
            None => bound,
        }
    }

    /// Judges a leg's head as the attempt loop judges a single request's: a
    /// refused connection, a 429, a 5xx or a redirect is the worker's failure
    /// (`Ok`: book the pair again without it); no head in time, or the
    /// router's own shortage of descriptors, fails the request (`Err`).
    /// Counted per leg; the worker's health is told either way.
    fn judge(
        &self,
        prefill: bool,
        key: WorkerKey,
        answer: Answer,
        waited: Duration,
    ) -> Result<hyper::Response<hyper::body::Incoming>, (Result<GatewayError, GatewayError>, Release)>
    {
        let (gateway, settings) = (&self.path.gateway, self.settings);
        let stats = &gateway.stats.pairs;
        let leg = if prefill { "prefill" } else { "decode" };
        match answer {
            Err(_) => {
                stats.leg(prefill, LegOutcome::TimedOut);
                gateway.health.timed_out(
                    key,
                    settings.circuit_failures,
                    settings.circuit_open_ms,
                    format!("it sent no response head within {} ms", waited.as_millis()),
                );
                Err((
                    Err(GatewayError::new(
                        StatusCode::GATEWAY_TIMEOUT,
                        "timeout_error",
                        "response_timeout",
                        format!(
                            "the {leg} leg's worker {key} sent no response within {} ms (gateway.response_timeout_ms for a one-body answer, gateway.idle_timeout_ms for a stream, gateway.request_timeout_ms in all); raise them for longer prompts",
                            waited.as_millis()
                        ),
                    )),
                    Release::ResponseTimeout,
                ))
            }
            Ok(Err(error)) => {
                if let Some(shortage) = super::send::local_shortage(&error) {
                    return Err((
                        Err(GatewayError::new(
                            StatusCode::SERVICE_UNAVAILABLE,
                            "server_error",
                            "router_out_of_resources",
                            format!("the router could not open a connection to {key}: {shortage}; the router is short of file descriptors or memory, {key} is not at fault (raise `ulimit -n`, or lower --max-connections)"),
                        )),
                        Release::UpstreamError,
                    ));
                }
                stats.leg(prefill, LegOutcome::Failed);
                let why = with_causes(&error);
                if error.is_connect() {
                    gateway
                        .health
                        .refused(key, settings.circuit_open_ms, why.clone());
                } else {
                    gateway.health.request_failed(
                        key,
                        settings.circuit_failures,
                        settings.circuit_open_ms,
                        why.clone(),
                    );
                }
                Err((
                    Ok(GatewayError::new(
                        StatusCode::BAD_GATEWAY,
                        "upstream_error",
                        "upstream_unreachable",
                        format!("the {leg} leg's worker {key} could not be reached: {why}"),
                    )),
                    Release::UpstreamError,
                ))
            }
            Ok(Ok(response)) => {
                let status = response.status();
                if status.is_redirection()
                    || status == StatusCode::TOO_MANY_REQUESTS
                    || status.is_server_error()
                {
                    stats.leg(prefill, LegOutcome::Failed);
                    gateway.health.request_failed(
                        key,
                        settings.circuit_failures,
                        settings.circuit_open_ms,
                        format!("it answered {status}"),
                    );
                    return Err((
                        Ok(GatewayError::new(
                            StatusCode::BAD_GATEWAY,
                            "upstream_error",
                            "upstream_status",
                            format!("the {leg} leg's worker {key} answered {status}"),
                        )),
                        Release::UpstreamError,
                    ));
                }
                stats.leg(prefill, LegOutcome::Answered);
                gateway.health.request_succeeded(key);
                Ok(response)
            }
        }
    }

    /// Sends the decode leg and streams its answer to the client;
    /// `also_on_end` runs when that ends, however it ends.
    async fn decode(
        &self,
        decode: Ready,
        trace: &mut Option<super::trace::RequestTrace>,
        also_on_end: Option<Box<dyn FnOnce(Release) + Send + Sync>>,
    ) -> Outcome {
        let Ready {
            mut guard,
            sent: leg,
            cached_tokens,
            ..
        } = decode;
        count_hint(&self.path.gateway, &leg.forward, leg.engine);
        let waited = self.head_bound(leg.prepared.stream);
        let sent_at = Instant::now();
        let traceparent = trace.as_mut().and_then(|t| t.sending(sent_at));
        let answer = send(
            &self.path.gateway,
            &leg,
            self.request.headers,
            sent_at + waited,
            self.request.request_id,
            traceparent.as_ref(),
        )
        .await
        .map_err(Err)?;
        match self.judge(false, leg.worker, answer, waited) {
            Err((Ok(failure), release)) => {
                guard.finish(release);
                Err(Ok(Retry::Decode(leg.worker, failure)))
            }
            Err((Err(error), release)) => {
                guard.finish(release);
                Err(Err(error))
            }
            Ok(response) => Ok(self.respond(
                &leg,
                guard,
                response,
                sent_at,
                cached_tokens,
                trace,
                also_on_end,
            )),
        }
    }

    /// The client's response from a leg's head (see `proxy::respond`).
    #[allow(clippy::too_many_arguments)]
    fn respond(
        &self,
        leg: &Sent,
        guard: ReleaseGuard,
        response: hyper::Response<hyper::body::Incoming>,
        sent_at: Instant,
        cached_tokens: usize,
        trace: &mut Option<super::trace::RequestTrace>,
        also_on_end: Option<Box<dyn FnOnce(Release) + Send + Sync>>,
    ) -> Response {
        let answered = Answered {
            status: response.status(),
            sent: sent_at,
            received: self.request.received,
            cached_tokens,
            idle: Duration::from_millis(self.settings.idle_timeout_ms),
            deadline: self.deadline,
            also_on_end,
        };
        respond(
            self.path,
            leg,
            guard,
            response,
            answered,
            self.request.request_id,
            trace.take(),
        )
    }

    /// vLLM: the prefill leg (one token, `do_remote_decode`) to its end, its
    /// booking released; then the decode leg with the `kv_transfer_params`
    /// it answered, streamed to the client. A prefill that answers none (its
    /// engine has no KV connector, or kept nothing) leaves the decode worker
    /// to compute the prompt, and is counted.
    async fn vllm(
        &self,
        prepared: Arc<Prepared>,
        body: Arc<ParsedBody>,
        prefill: Ready,
        mut decode: Ready,
        trace: &mut Option<super::trace::RequestTrace>,
    ) -> Outcome {
        let Ready {
            guard: mut held,
            sent: leg,
            cached_tokens,
            ..
        } = prefill;
        let key = leg.worker;
        count_hint(&self.path.gateway, &leg.forward, leg.engine);
        let waited = self.head_bound(false);
        let sent_at = Instant::now();
        let answer = send(
            &self.path.gateway,
            &leg,
            self.request.headers,
            sent_at + waited,
            held.request_id(),
            None,
        )
        .await
        .map_err(Err)?;
        let response = match self.judge(true, key, answer, waited) {
            Ok(response) => response,
            Err((failure, release)) => {
                held.finish(release);
                decode.guard.finish(Release::PairAbandoned);
                return Err(failure.map(|f| Retry::Prefill(key, f)));
            }
        };
        if response.status().is_client_error() {
            // The client's request is at fault (the decode leg would be
            // refused alike): the prefill's answer is the client's.
            decode.guard.finish(Release::PairAbandoned);
            return Ok(self.respond(&leg, held, response, sent_at, cached_tokens, trace, None));
        }
        let bound = self.head_bound(false);
        let bytes = match tokio::time::timeout(bound, response.into_body().collect()).await {
            Ok(Ok(collected)) => collected.to_bytes(),
            Ok(Err(error)) => {
                self.path.gateway.stats.pairs.leg(true, LegOutcome::Failed);
                held.finish(Release::UpstreamError);
                decode.guard.finish(Release::PairAbandoned);
                let failure = GatewayError::new(
                    StatusCode::BAD_GATEWAY,
                    "upstream_error",
                    "upstream_broken",
                    format!("the prefill leg's worker {key} broke off its answer: {error}"),
                );
                return Err(Ok(Retry::Prefill(key, failure)));
            }
            Err(_) => {
                held.finish(Release::ResponseTimeout);
                decode.guard.finish(Release::PairAbandoned);
                return Err(Err(GatewayError::new(
                    StatusCode::GATEWAY_TIMEOUT,
                    "timeout_error",
                    "response_timeout",
                    format!("the prefill leg's worker {key} did not finish its answer within {} ms (gateway.response_timeout_ms)", bound.as_millis()),
                )));
            }
        };
        held.finish(Release::Completed);
        let params = kv_transfer_params(&bytes);
        if params.is_none() {
            self.path
                .gateway
                .stats
                .pairs
                .not_transferred
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            tracing::warn!(request_id = %self.request.request_id, prefill = %key, "the prefill answered no kv_transfer_params: no KV is handed over, the decode worker computes the prompt (is the prefill engine started with --kv-transfer-config kv_role kv_producer or kv_both?)");
        }
        decode.sent.forward = adapter::build_forward(
            &decode.target,
            self.request.route,
            &body.body(),
            &adapter::Prompt {
                token_ids: &prepared.token_ids,
                handover: params.as_deref().map(|p| Handover::VllmDecode {
                    kv_transfer_params: p,
                }),
            },
            decode.sent.worker,
            self.request.request_id,
            decode.hint.as_deref().map(serde_json::value::RawValue::get),
        );
        self.decode(decode, trace, None).await
    }

    /// SGLang: both legs at once (the decode server waits in the room for
    /// the prefill server's KV). The prefill's head decides: a failure before
    /// it abandons the decode leg (its connection closed, so its engine drops
    /// the request) and books the pair again; an answer is drained in the
    /// background, its booking released at its end, and aborted (its
    /// connection closed) if the client's response ends otherwise.
    async fn sglang(
        &self,
        prefill: Ready,
        decode: Ready,
        trace: &mut Option<super::trace::RequestTrace>,
    ) -> Outcome {
        let Ready {
            guard: mut held,
            sent: prefill_leg,
            cached_tokens: prefill_cached,
            ..
        } = prefill;
        let Ready {
            guard: mut decode_guard,
            sent: decode_leg,
            cached_tokens,
            ..
        } = decode;
        let key = prefill_leg.worker;
        count_hint(&self.path.gateway, &prefill_leg.forward, prefill_leg.engine);
        count_hint(&self.path.gateway, &decode_leg.forward, decode_leg.engine);
        let prefill_waited = self.head_bound(false);
        let decode_waited = self.head_bound(decode_leg.prepared.stream);
        let sent_at = Instant::now();
        let traceparent = trace.as_mut().and_then(|t| t.sending(sent_at));
        let prefill_id = held.request_id().to_string();
        let headers = self.request.headers;
        let prefill_send = send(
            &self.path.gateway,
            &prefill_leg,
            headers,
            sent_at + prefill_waited,
            &prefill_id,
            None,
        );
        let decode_send = send(
            &self.path.gateway,
            &decode_leg,
            headers,
            sent_at + decode_waited,
            self.request.request_id,
            traceparent.as_ref(),
        );
        tokio::pin!(prefill_send, decode_send);
        let mut decode_answer = None;
        let prefill_answer = loop {
            tokio::select! {
                answer = &mut prefill_send => break answer,
                answer = &mut decode_send, if decode_answer.is_none() => decode_answer = Some(answer),
            }
        };
        let abandon = |held: &mut ReleaseGuard, release, decode_guard: &mut ReleaseGuard| {
            held.finish(release);
            decode_guard.finish(Release::PairAbandoned);
        };
        let prefill_answer = match prefill_answer {
            Ok(answer) => answer,
            Err(error) => {
                abandon(&mut held, Release::UpstreamError, &mut decode_guard);
                return Err(Err(error));
            }
        };
        let response = match self.judge(true, key, prefill_answer, prefill_waited) {
            Ok(response) => response,
            Err((failure, release)) => {
                abandon(&mut held, release, &mut decode_guard);
                return Err(failure.map(|f| Retry::Prefill(key, f)));
            }
        };
        if response.status().is_client_error() {
            decode_guard.finish(Release::PairAbandoned);
            return Ok(self.respond(
                &prefill_leg,
                held,
                response,
                sent_at,
                prefill_cached,
                trace,
                None,
            ));
        }
        let bound = prefill_waited;
        let drain = Drain(Some(
            tokio::spawn(async move {
                let mut held = held;
                let end = tokio::time::timeout(bound, response.into_body().collect()).await;
                held.finish(match end {
                    Ok(Ok(_)) => Release::Completed,
                    Ok(Err(_)) => Release::UpstreamError,
                    Err(_) => Release::ResponseTimeout,
                });
            })
            .abort_handle(),
        ));
        let decode_answer = match decode_answer {
            Some(answer) => answer,
            None => decode_send.await,
        };
        let decode_answer = match decode_answer {
            Ok(answer) => answer,
            Err(error) => {
                drain.detach();
                decode_guard.finish(Release::UpstreamError);
                return Err(Err(error));
            }
        };
        let decode_key = decode_leg.worker;
        match self.judge(false, decode_key, decode_answer, decode_waited) {
            Ok(response) => {
                let also: Box<dyn FnOnce(Release) + Send + Sync> = Box::new(move |reason| {
                    // The answer is whole: the prefill's is too (the KV came
                    // before the first token), let its drain end by itself.
                    if reason == Release::Completed {
                        drain.detach();
                    }
                });
                Ok(self.respond(
                    &decode_leg,
                    decode_guard,
                    response,
                    sent_at,
                    cached_tokens,
                    trace,
                    Some(also),
                ))
            }
            Err((failure, release)) => {
                drain.detach();
                decode_guard.finish(release);
                Err(failure.map(|f| Retry::Decode(decode_key, f)))
            }
        }
    }
}

/// A prefill leg's answer being read in the background: aborted when dropped
/// (the client's response ended before it, or the request was dropped), which
/// closes its connection (SGLang then aborts the request) and releases its
/// booking through the guard the task owns.
struct Drain(Option<tokio::task::AbortHandle>);

impl Drain {
    /// Lets the drain run to its end.
    fn detach(mut self) {
        self.0 = None;
    }
}

impl Drop for Drain {
    fn drop(&mut self) {
        if let Some(handle) = self.0.take() {
            handle.abort();
        }
    }
}

/// The `kv_transfer_params` of a vLLM prefill's answer, as raw JSON: a
/// non-empty object, or `None` when the answer has none (or is not JSON).
fn kv_transfer_params(answer: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Answer<'a> {
        #[serde(borrow, default)]
        kv_transfer_params: Option<&'a serde_json::value::RawValue>,
    }
    let answer: Answer<'_> = serde_json::from_slice(answer).ok()?;
    let raw = answer.kv_transfer_params?.get();
    let is_object = serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(raw)
        .is_ok_and(|map| !map.is_empty());
    is_object.then(|| raw.to_string())
}

#[cfg(test)]
mod tests {
    use super::kv_transfer_params;

    #[test]
    fn a_prefill_answer_hands_over_only_a_non_empty_params_object() {
        let with = br#"{"id":"c","choices":[],"kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[[1,2]]}}"#;
        assert_eq!(
            kv_transfer_params(with).as_deref(),
            Some(r#"{"do_remote_prefill":true,"remote_block_ids":[[1,2]]}"#)
        );
        for none in [
            &br#"{"id":"c","choices":[]}"#[..],
            br#"{"kv_transfer_params":null}"#,
            br#"{"kv_transfer_params":{}}"#,
            br#"{"kv_transfer_params":[1]}"#,
            b"not json",
        ] {
            assert_eq!(
                kv_transfer_params(none),
                None,
                "{}",
                String::from_utf8_lossy(none)
            );
        }
    }
}
