//! Booking a disaggregated request's two legs (see `super::disaggregated` for
//! how they are sent): the prefill leg on role `prefill`, then the decode leg
//! on role `decode`, told its KV comes from the prefill worker, each leg's
//! request carrying what its engine's hand-over needs. On a booking thread.

use super::adapter::Route;
use super::dispatch::{book_leg, Booked, HandoverPlan, Leg};
use super::stats::{PairPath, Release};
use super::{BookAs, GatewayError, Prepared, RequestPath};
use crate::config::disaggregation::{Disaggregation, Mode, OnPrefillFailure};
use crate::domain::{Role, WorkerKey};
use crate::splice::ParsedBody;
use std::sync::Arc;

/// The workers a pair may no longer be booked on, and the request's id.
#[derive(Clone, Copy)]
pub struct Tried<'a> {
    pub request_id: &'a str,
    pub prefill: &'a [WorkerKey],
    pub decode: &'a [WorkerKey],
    /// Every prefill worker failed or none is there: book decode alone
    /// (`on_prefill_failure: decode_alone`).
    pub prefill_exhausted: bool,
}

/// A disaggregated request booked: its decode leg, and its prefill leg unless
/// the decode worker serves it alone.
pub struct Pair {
    pub prepared: Arc<Prepared>,
    pub body: Arc<ParsedBody>,
    pub mode: Mode,
    pub decode: Booked,
    pub prefill: Option<Booked>,
    pub path: PairPath,
}

/// The prompt tokens the decode worker best placed for `prepared` holds: the
/// longest cached prefix among the decode workers it may be booked on.
fn held_prefix_tokens(
    path: &RequestPath,
    snapshot: &crate::snapshot::Snapshot,
    prepared: &Prepared,
    tried: &[WorkerKey],
) -> usize {
    let request = crate::router::BookRequest {
        request_id: "",
        role: Role::Decode,
        token_ids: &prepared.token_ids,
        session_context: None,
        lora_name: prepared.model.lora.as_deref(),
        cache_salt: prepared.cache_salt.as_deref(),
        pinned_prefix: &[],
        receive_from: None,
    };
    let eligible = |worker: &crate::domain::Worker| {
        super::eligible(&path.gateway, prepared, tried, None, worker)
    };
    path.router.held_prefix(&request, Some(&eligible)) * snapshot.block_size
}

/// The request id of a pair's prefill leg: its own booking beside the decode
/// leg's, under the client request's id.
fn prefill_id(request_id: &str) -> String {
    format!("{request_id}-prefill")
}

/// Books a pair, on a booking thread: the prefill leg first (so that the
/// decode booking can name it as its KV's source), then the decode leg. With
/// `decode_alone_within_tokens`, the decode leg alone when the decode pool
/// already holds all but that many of the prompt's tokens.
pub fn book_pair(
    path: &RequestPath,
    snapshot: &crate::snapshot::Snapshot,
    disaggregation: &Disaggregation,
    body: &Arc<ParsedBody>,
    prepared: &Arc<Prepared>,
    tried: Tried<'_>,
) -> Result<Pair, GatewayError> {
    let route = prepared.route;
    if route == Route::Embeddings {
        return Err(GatewayError::bad_request(
            "disaggregated_model",
            format!(
                "model {} is disaggregated (prefill and decode on two pools); an embedding is not generated: ask a model served whole",
                prepared.model.name
            ),
        )
        .at("model"));
    }
    let mode = disaggregation.mode;
    let leg = |book_as: BookAs<'_>, tried: &[WorkerKey], handover: HandoverPlan<'_>| {
        book_leg(
            path,
            snapshot,
            Arc::clone(body),
            Arc::clone(prepared),
            Leg {
                route,
                book_as,
                tried,
                allowed: None,
                handover,
            },
        )
    };
    let pair = |decode, prefill, path| Pair {
        prepared: Arc::clone(prepared),
        body: Arc::clone(body),
        mode,
        decode,
        prefill,
        path,
    };
    let decode_alone = BookAs {
        request_id: tried.request_id,
        role: Role::Decode,
        receive_from: None,
    };
    if tried.prefill_exhausted {
        let decode = leg(decode_alone, tried.decode, HandoverPlan::Whole)?;
        return Ok(pair(decode, None, PairPath::DecodeAlonePrefillFailed));
    }
    // Conditional disaggregation: what the decode pool already holds decides
    // whether a prefill leg is worth its hop (read from the index, nothing
    // booked, so a decode booking made after the prefill's still names it).
    if disaggregation.decode_alone_within_tokens > 0 {
        let held = held_prefix_tokens(path, snapshot, prepared, tried.decode);
        let missing = prepared.token_ids.len().saturating_sub(held) as u64;
        if missing <= disaggregation.decode_alone_within_tokens {
            let decode = leg(decode_alone, tried.decode, HandoverPlan::Whole)?;
            return Ok(pair(decode, None, PairPath::DecodeAloneCached));
        }
    }
    let room = path.gateway.bootstrap_room();
    let prefill_request_id = prefill_id(tried.request_id);
    let prefill_plan = match mode {
        Mode::Sglang => HandoverPlan::SglangPrefill { room },
        Mode::Vllm => HandoverPlan::VllmPrefill,
    };
    let prefill = leg(
        BookAs {
            request_id: &prefill_request_id,
            role: Role::Prefill,
            receive_from: None,
        },
        tried.prefill,
        prefill_plan,
    );
    let prefill = match prefill {
        Ok(prefill) => prefill,
        Err(error) if error.code == super::error::NO_WORKERS.openai.code => {
            // No prefill worker to try (none serves the model, none is
            // healthy, or every one failed this request already).
            return match disaggregation.on_prefill_failure {
                OnPrefillFailure::DecodeAlone => {
                    let decode = leg(decode_alone, tried.decode, HandoverPlan::Whole)?;
                    Ok(pair(decode, None, PairPath::DecodeAlonePrefillFailed))
                }
                OnPrefillFailure::Fail => Err(GatewayError::answer(
                    super::error::NO_WORKERS.openai,
                    format!(
                        "no prefill worker of model {} can take this request (none is registered, healthy and untried); on_prefill_failure: fail",
                        prepared.model.name
                    ),
                )),
            };
        }
        Err(error) => return Err(error),
    };
    let prefill_key = prefill.worker;
    let prefill_target = Arc::clone(&prefill.target);
    let decode_plan = match mode {
        Mode::Sglang => HandoverPlan::SglangDecode {
            prefill: &prefill_target,
            prefill_dp_rank: prefill_key.dp_rank,
            room,
        },
        // Built once the prefill has answered (`Context::vllm`).
        Mode::Vllm => HandoverPlan::Whole,
    };
    let decode = leg(
        BookAs {
            request_id: tried.request_id,
            role: Role::Decode,
            receive_from: Some(prefill_key),
        },
        tried.decode,
        decode_plan,
    );
    match decode {
        Ok(decode) => Ok(pair(decode, Some(prefill), PairPath::Disaggregated)),
        Err(error) => {
            let mut prefill = prefill;
            prefill.guard.finish(Release::PairAbandoned);
            Err(error)
        }
    }
}
