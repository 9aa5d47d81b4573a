//! Owned stand-ins for a booking, so a plugin's unit tests can call its
//! policies without a router:
//! - [`construct`] and [`construct_selection`] build a policy through the
//!   provider the plugin registered, from JSON parameters, as the router does;
//! - [`TestBooking::run`] calls a hint policy and returns the actions it wrote,
//!   through the router's own message writer (so a payload the router would
//!   refuse is refused here too);
//! - [`TestPlacement::select`] calls a selection policy on candidates.

use crate::abi::{
    FfiCandidate, FfiHintContext, FfiKvCopy, FfiPeer, FfiPeerCopy, FfiPeerHashes,
    FfiRequestIdentity, FfiSelectionRequest, FfiWorker,
};
use crate::actions::Actions;
use crate::context::HintContext;
use crate::policy::{HintError, HintPolicy};
use crate::registry::{HintRegistry, Parameters, Provider, RouterSettings};
use crate::selection::{Candidates, Selection, SelectionPolicy, SelectionRequest};
use crate::writer::{MessageWriter, PolicyOutput};
use abi_stable::marker_type::ErasedObject;
use abi_stable::std_types::{ROption, RSlice, RStr};
use std::fmt::Display;
use std::sync::Arc;

/// Runs `register` and builds hint policy `name` from `parameters` (a JSON
/// object) through its provider, as the router would.
pub fn construct<E: Display>(
    register: impl FnOnce(&mut HintRegistry) -> Result<(), E>,
    name: &str,
    parameters: serde_json::Value,
) -> Result<Arc<dyn HintPolicy>, HintError> {
    match find(register, name)? {
        Provider::Hint { provider, .. } => Ok(provider(&test_parameters(parameters)?)?.policy),
        Provider::Selection(_) => Err(HintError::new(format!(
            "{name:?} is a selection policy: use testing::construct_selection"
        ))),
    }
}

/// Runs `register` and builds selection policy `name` from `parameters`.
pub fn construct_selection<E: Display>(
    register: impl FnOnce(&mut HintRegistry) -> Result<(), E>,
    name: &str,
    parameters: serde_json::Value,
) -> Result<Arc<dyn SelectionPolicy>, HintError> {
    match find(register, name)? {
        Provider::Selection(provider) => Ok(provider(&test_parameters(parameters)?)?.policy),
        Provider::Hint { .. } => Err(HintError::new(format!(
            "{name:?} is a hint policy: use testing::construct"
        ))),
    }
}

fn test_parameters(value: serde_json::Value) -> Result<Parameters, HintError> {
    Ok(Parameters::from_value(value)?.with_router(RouterSettings {
        block_size: 16,
        seed: 0,
    }))
}

fn find<E: Display>(
    register: impl FnOnce(&mut HintRegistry) -> Result<(), E>,
    name: &str,
) -> Result<Provider, HintError> {
    let mut registry = HintRegistry::new();
    register(&mut registry)
        .map_err(|e| HintError::new(format!("the registration function failed: {e}")))?;
    let known: Vec<String> = registry.names().map(str::to_string).collect();
    registry
        .entries
        .into_iter()
        .find(|entry| entry.name == name)
        .map(|entry| entry.provider)
        .ok_or_else(|| {
            HintError::new(format!(
                "no policy {name:?} is registered; registered: {}",
                known.join(", ")
            ))
        })
}

/// One action a policy wrote, decoded.
#[derive(Debug, Clone, PartialEq)]
pub struct Action {
    pub action_type: String,
    pub action_version: String,
    pub payload: serde_json::Value,
}

#[derive(Debug, Clone, Default)]
pub struct TestWorker {
    pub id: u64,
    pub dp_rank: u32,
    pub router_hint: bool,
    pub worker_type: String,
    pub source_control_endpoint: String,
}

impl TestWorker {
    /// A hint-capable worker of type `decode` with endpoint `tcp://10.0.0.<id>:23280`.
    pub fn capable(id: u64) -> Self {
        Self {
            id,
            dp_rank: 0,
            router_hint: true,
            worker_type: "decode".into(),
            source_control_endpoint: format!("tcp://10.0.0.{id}:23280"),
        }
    }

    fn ffi(&self) -> FfiWorker<'_> {
        FfiWorker {
            worker_id: self.id,
            dp_rank: self.dp_rank,
            router_hint: self.router_hint,
            worker_type: RStr::from_str(&self.worker_type),
            source_control_endpoint: RStr::from_str(&self.source_control_endpoint),
        }
    }
}

/// A peer holding `block_hashes.len()` leading blocks of the request.
#[derive(Debug, Clone, Default)]
pub struct TestPeer {
    pub worker: TestWorker,
    pub block_hashes: Vec<u64>,
}

#[derive(Debug, Clone, Default)]
pub struct TestKvCopy {
    pub source: TestWorker,
    pub first_block: usize,
    pub block_hashes: Vec<u64>,
}

#[derive(Debug, Clone, Default)]
pub struct TestBooking {
    pub request_id: String,
    pub worker: TestWorker,
    pub cached_blocks: usize,
    pub prompt_tokens: usize,
    pub block_size: usize,
    pub lora_name: String,
    pub cache_salt: String,
    /// A JSON object as text ("" for none).
    pub session_context: String,
    pub selection_policy: String,
    pub block_hashes: Vec<u64>,
    pub peers: Vec<TestPeer>,
    pub committed_kv_copy: Option<TestKvCopy>,
}

extern "C" fn test_peer_hashes(state: *const ErasedObject, peer: u64) -> RSlice<'static, u64> {
    // SAFETY: `state` is the `TestBooking` that `with_raw_context` borrows for
    // the call; the slice lives as long as that borrow, which outlives the
    // policy's call (the `'static` is the ABI's way of spelling "this call").
    let booking = unsafe { &*state.cast::<TestBooking>() };
    match booking.peers.get(peer as usize) {
        // SAFETY: the pointer and length are one live `Vec`'s, so they make a
        // valid slice; that `Vec` is in the borrowed booking, so the slice
        // stays valid for the policy's call, as the `'static` above means.
        Some(peer) => unsafe {
            RSlice::from_raw_parts(peer.block_hashes.as_ptr(), peer.block_hashes.len())
        },
        None => RSlice::from_slice(&[]),
    }
}

impl TestBooking {
    /// Calls `f` with the context a router would pass for this booking.
    pub fn with_context<R>(&self, f: impl FnOnce(&HintContext<'_>) -> R) -> R {
        self.with_raw_context(|raw| f(&HintContext::new(raw)))
    }

    /// Calls `f` with the raw, ABI-level context (for host-side tests).
    pub fn with_raw_context<R>(&self, f: impl FnOnce(&FfiHintContext<'_>) -> R) -> R {
        let peers: Vec<FfiPeer<'_>> = self
            .peers
            .iter()
            .map(|peer| FfiPeer {
                worker: peer.worker.ffi(),
                cached_blocks: peer.block_hashes.len() as u64,
            })
            .collect();
        let raw = FfiHintContext {
            request_id: RStr::from_str(&self.request_id),
            worker: self.worker.ffi(),
            cached_blocks: self.cached_blocks as u64,
            prompt_tokens: self.prompt_tokens as u64,
            block_size: self.block_size as u32,
            identity: FfiRequestIdentity {
                lora_name: RStr::from_str(&self.lora_name),
                cache_salt: RStr::from_str(&self.cache_salt),
            },
            session_context: RStr::from_str(&self.session_context),
            selection_policy: RStr::from_str(&self.selection_policy),
            block_hashes: RSlice::from_slice(&self.block_hashes),
            peers: RSlice::from_slice(&peers),
            peer_hashes: FfiPeerHashes {
                state: (self as *const Self).cast::<ErasedObject>(),
                get: test_peer_hashes,
            },
            committed_kv_copy: match &self.committed_kv_copy {
                Some(copy) => ROption::RSome(FfiKvCopy {
                    source: copy.source.ffi(),
                    first_block: copy.first_block as u64,
                    block_hashes: RSlice::from_slice(&copy.block_hashes),
                }),
                None => ROption::RNone,
            },
        };
        f(&raw)
    }

    /// Runs `policy` on this booking and decodes what it wrote. A payload the
    /// router would refuse as malformed is an error here.
    pub fn run(&self, policy: &dyn HintPolicy) -> Result<Vec<Action>, HintError> {
        let mut writer = MessageWriter::default();
        writer.begin_message(&self.request_id, 32);
        writer.begin_policy();
        let result = self.with_context(|context| {
            let mut ffi = writer.ffi();
            policy.build_hints(context, &mut Actions::new(&mut ffi))
        });
        match writer.end_policy(result.is_ok()) {
            PolicyOutput::Malformed(message) => {
                return Err(HintError::new(format!("malformed: {message}")))
            }
            PolicyOutput::Kept(_) => result?,
        }
        let Some(text) = writer.finish() else {
            return Ok(Vec::new());
        };
        let message: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| HintError::new(format!("the message is not JSON: {e}")))?;
        Ok(message["actions"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|action| Action {
                action_type: action["action_type"].as_str().unwrap_or_default().into(),
                action_version: action["action_version"].as_str().unwrap_or_default().into(),
                payload: action["payload"].clone(),
            })
            .collect())
    }
}

/// A candidate worker for a selection test.
#[derive(Debug, Clone, Default)]
pub struct TestCandidate {
    pub worker: TestWorker,
    pub cached_blocks: usize,
    pub active_requests: u64,
    pub active_blocks: u64,
    pub prefill_blocks: u64,
    /// The best peer copy: its source and how many leading blocks it holds.
    pub peer_copy: Option<(TestWorker, usize)>,
}

/// A request to place, with its candidates.
#[derive(Debug, Clone, Default)]
pub struct TestPlacement {
    pub request_id: String,
    pub role: String,
    pub request_blocks: usize,
    pub prompt_tokens: usize,
    pub block_size: usize,
    pub lora_name: String,
    pub cache_salt: String,
    /// A JSON object as text ("" for none).
    pub session_context: String,
    pub candidates: Vec<TestCandidate>,
}

impl TestPlacement {
    /// Calls `f` with the raw, ABI-level request and candidates.
    pub fn with_raw<R>(
        &self,
        f: impl FnOnce(&FfiSelectionRequest<'_>, RSlice<'_, FfiCandidate<'_>>) -> R,
    ) -> R {
        let candidates: Vec<FfiCandidate<'_>> = self
            .candidates
            .iter()
            .map(|c| FfiCandidate {
                worker: c.worker.ffi(),
                cached_blocks: c.cached_blocks as u64,
                active_requests: c.active_requests,
                active_blocks: c.active_blocks,
                prefill_blocks: c.prefill_blocks,
                peer_copy: match &c.peer_copy {
                    Some((source, blocks)) => ROption::RSome(FfiPeerCopy {
                        source: source.ffi(),
                        cached_blocks: *blocks as u64,
                    }),
                    None => ROption::RNone,
                },
            })
            .collect();
        let request = FfiSelectionRequest {
            request_id: RStr::from_str(&self.request_id),
            role: RStr::from_str(&self.role),
            request_blocks: self.request_blocks as u64,
            prompt_tokens: self.prompt_tokens as u64,
            block_size: self.block_size as u32,
            identity: FfiRequestIdentity {
                lora_name: RStr::from_str(&self.lora_name),
                cache_salt: RStr::from_str(&self.cache_salt),
            },
            session_context: RStr::from_str(&self.session_context),
        };
        f(&request, RSlice::from_slice(&candidates))
    }

    /// Runs `policy` on this placement. An answer the router would not take
    /// (an index past the candidates, or a committed copy the policy did not
    /// declare or the candidate does not have) is an error here, as the router
    /// would fall back on it.
    pub fn select(&self, policy: &dyn SelectionPolicy) -> Result<Selection, HintError> {
        let selection = self.with_raw(|request, candidates| {
            policy.select(
                &SelectionRequest::new(request),
                &Candidates::new(candidates.as_slice()),
            )
        })?;
        let Some(candidate) = self.candidates.get(selection.index()) else {
            return Err(HintError::new(format!(
                "out of range: candidate {} of {}; the router would book with its default",
                selection.index(),
                self.candidates.len()
            )));
        };
        if selection.commits_kv_copy() {
            if !policy.commits_kv_copies() {
                return Err(HintError::new(
                    "out of range: a committed copy from a policy that does not declare commits_kv_copies; the router would book with its default",
                ));
            }
            if candidate.peer_copy.is_none() {
                return Err(HintError::new(
                    "out of range: a committed copy on a candidate without a peer copy; the router would book with its default",
                ));
            }
        }
        Ok(selection)
    }
}
