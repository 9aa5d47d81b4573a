//! The author's view of a booking: safe accessors over the borrowed
//! [`FfiHintContext`], so policies read plain `&str`
//! and `&[u64]` and never see ABI types.

use crate::abi::{FfiHintContext, FfiKvCopy, FfiPeer, FfiWorker};
use crate::policy::HintError;
use serde::de::DeserializeOwned;

/// What a hint policy sees of one booking. It is read-only: a policy cannot
/// change which worker was booked (rule R1).
#[derive(Clone, Copy)]
pub struct HintContext<'a> {
    raw: &'a FfiHintContext<'a>,
}

impl<'a> HintContext<'a> {
    /// Wraps the borrowed context the host passed in.
    #[doc(hidden)]
    pub fn new(raw: &'a FfiHintContext<'a>) -> Self {
        Self { raw }
    }

    pub fn request_id(&self) -> &'a str {
        self.raw.request_id.as_str()
    }

    /// The booked worker.
    pub fn worker(&self) -> Worker<'a> {
        Worker {
            raw: &self.raw.worker,
        }
    }

    /// How many of the request's leading blocks the booked worker already holds.
    pub fn cached_blocks(&self) -> usize {
        self.raw.cached_blocks as usize
    }

    /// The prompt's length in tokens.
    pub fn prompt_tokens(&self) -> usize {
        self.raw.prompt_tokens as usize
    }

    /// Tokens per KV block.
    pub fn block_size(&self) -> usize {
        self.raw.block_size as usize
    }

    /// The request's session context (the `session_context` JSON object of
    /// `POST /book`), deserialized into the policy's own type: `Ok(None)` when
    /// the request had none, an error when it does not fit `T` (which fails
    /// this policy for this booking only).
    pub fn session<T: DeserializeOwned>(&self) -> Result<Option<T>, HintError> {
        session(self.raw.session_context.as_str())
    }

    /// The LoRA adapter the request is for, if any.
    pub fn lora_name(&self) -> Option<&'a str> {
        non_empty(self.raw.identity.lora_name.as_str())
    }

    /// The request's cache salt, if any.
    pub fn cache_salt(&self) -> Option<&'a str> {
        non_empty(self.raw.identity.cache_salt.as_str())
    }

    /// The selection-policy type that booked the worker (`kvcr`, ...).
    pub fn selection_policy(&self) -> &'a str {
        self.raw.selection_policy.as_str()
    }

    /// The request's block hashes as the router computes them: one per full
    /// block of the prompt, each chained on the one before.
    pub fn block_hashes(&self) -> &'a [u64] {
        self.raw.block_hashes.as_slice()
    }

    /// Other workers that hold a prefix of the request, longest prefix first,
    /// then by worker id and dp rank. Their engine hashes are read on demand,
    /// with [`Peer::block_hashes`].
    pub fn peers(&self) -> impl ExactSizeIterator<Item = Peer<'a>> + 'a {
        let raw = self.raw;
        raw.peers
            .as_slice()
            .iter()
            .enumerate()
            .map(move |(index, peer)| Peer {
                raw: peer,
                context: raw,
                index,
            })
    }

    /// The KV copy the selection policy committed this booking to, if any. A
    /// policy that declares [`Commitments::KV_COPY`](crate::policy::Commitments)
    /// must send it.
    pub fn committed_kv_copy(&self) -> Option<KvCopy<'a>> {
        match &self.raw.committed_kv_copy {
            abi_stable::std_types::ROption::RSome(raw) => Some(KvCopy { raw }),
            abi_stable::std_types::ROption::RNone => None,
        }
    }
}

/// A worker: the booked one, a peer, or a copy's source.
#[derive(Clone, Copy)]
pub struct Worker<'a> {
    pub(crate) raw: &'a FfiWorker<'a>,
}

impl<'a> Worker<'a> {
    pub fn id(&self) -> u64 {
        self.raw.worker_id
    }

    pub fn dp_rank(&self) -> u32 {
        self.raw.dp_rank
    }

    /// Whether the worker advertises `router_hint` (can receive hints and serve
    /// KV to peers).
    pub fn router_hint(&self) -> bool {
        self.raw.router_hint
    }

    /// `router_hint_worker_type`, if the worker advertised one.
    pub fn worker_type(&self) -> Option<&'a str> {
        let text = self.raw.worker_type.as_str();
        (!text.is_empty()).then_some(text)
    }

    /// The endpoint peers pull this worker's KV from, if it advertised one.
    pub fn source_control_endpoint(&self) -> Option<&'a str> {
        let text = self.raw.source_control_endpoint.as_str();
        (!text.is_empty()).then_some(text)
    }
}

/// Another worker holding a prefix of the request.
#[derive(Clone, Copy)]
pub struct Peer<'a> {
    raw: &'a FfiPeer<'a>,
    context: &'a FfiHintContext<'a>,
    index: usize,
}

impl<'a> Peer<'a> {
    pub fn worker(&self) -> Worker<'a> {
        Worker {
            raw: &self.raw.worker,
        }
    }

    /// How many of the request's leading blocks the peer holds.
    pub fn cached_blocks(&self) -> usize {
        self.raw.cached_blocks as usize
    }

    /// The peer engine's own hashes of those blocks, root-aligned (entry `i`
    /// is request block `i`), as it published them. Read from the router's KV
    /// index when asked, so a policy pays only for the peers it reads. Fewer
    /// than [`cached_blocks`](Self::cached_blocks) if the peer's cache shrank
    /// since the booking's lookup.
    pub fn block_hashes(&self) -> &'a [u64] {
        let hashes = &self.context.peer_hashes;
        (hashes.get)(hashes.state, self.index as u64).as_slice()
    }
}

pub(crate) fn non_empty(text: &str) -> Option<&str> {
    (!text.is_empty()).then_some(text)
}

pub(crate) fn session<T: DeserializeOwned>(text: &str) -> Result<Option<T>, HintError> {
    if text.is_empty() {
        return Ok(None);
    }
    serde_json::from_str(text)
        .map(Some)
        .map_err(|e| HintError::new(format!("the session context does not fit: {e}")))
}

/// A committed KV copy: pull from `source` the request blocks from `first_block`
/// to the end of `block_hashes`, which are the source engine's hashes,
/// root-aligned (entry `i` is request block `i`), as Dynamo's router hint is.
#[derive(Clone, Copy)]
pub struct KvCopy<'a> {
    raw: &'a FfiKvCopy<'a>,
}

impl<'a> KvCopy<'a> {
    pub fn source(&self) -> Worker<'a> {
        Worker {
            raw: &self.raw.source,
        }
    }

    pub fn first_block(&self) -> usize {
        self.raw.first_block as usize
    }

    pub fn block_hashes(&self) -> &'a [u64] {
        self.raw.block_hashes.as_slice()
    }
}
