//! Owned stand-ins for a booking, so a plugin's unit tests can call its policy
//! without a router: fill a [`TestBooking`], then [`TestBooking::run`].

use crate::abi::{FfiHintContext, FfiKvCopy, FfiPeer, FfiWorker};
use crate::context::HintContext;
use crate::policy::{Action, HintError, HintPolicy};
use abi_stable::std_types::{ROption, RSlice, RStr};

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
    pub session_context: String,
    pub selection_policy: String,
    pub block_hashes: Vec<u64>,
    pub peers: Vec<TestPeer>,
    pub committed_kv_copy: Option<TestKvCopy>,
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
                block_hashes: RSlice::from_slice(&peer.block_hashes),
            })
            .collect();
        let raw = FfiHintContext {
            request_id: RStr::from_str(&self.request_id),
            worker: self.worker.ffi(),
            cached_blocks: self.cached_blocks as u64,
            prompt_tokens: self.prompt_tokens as u64,
            block_size: self.block_size as u32,
            session_context: RStr::from_str(&self.session_context),
            selection_policy: RStr::from_str(&self.selection_policy),
            block_hashes: RSlice::from_slice(&self.block_hashes),
            peers: RSlice::from_slice(&peers),
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

    /// Runs `policy` on this booking.
    pub fn run(&self, policy: &dyn HintPolicy) -> Result<Vec<Action>, HintError> {
        self.with_context(|context| policy.build_hints(context))
    }
}
