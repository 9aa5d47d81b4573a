//! The selection-policy trait: which worker a request is booked on.
//!
//! A selection policy runs before any hint policy (rule R1: hints cannot change
//! its choice). It sees the request and every candidate worker of the role,
//! with what the router knows of each (cached prefix, load, hint capability,
//! the best peer copy it could fetch), and names one. An error, a panic or an
//! answer out of range falls back to the router's built-in default selection
//! for that booking; the booking never fails because of it.

use crate::abi::{FfiCandidate, FfiPeerCopy, FfiSelectionRequest};
use crate::context::{non_empty, session, Worker};
use crate::policy::HintError;
use serde::de::DeserializeOwned;

/// A selection policy. [`select`](SelectionPolicy::select) is called once per
/// booking, from many threads at once; like a hint policy it runs in the
/// router's process and must not block.
pub trait SelectionPolicy: Send + Sync + 'static {
    /// The chosen candidate.
    fn select(
        &self,
        request: &SelectionRequest<'_>,
        candidates: &Candidates<'_>,
    ) -> Result<Selection, HintError>;

    /// Whether it reads cached prefixes. The router consults the KV index only
    /// for a KV-aware policy, and runs hint policies only under one (rule R4).
    fn kv_aware(&self) -> bool {
        true
    }

    /// Whether, with its parameters, it may commit bookings to a peer's KV copy
    /// ([`Selection::with_kv_copy`]). A role under such a policy must run
    /// exactly one hint policy that sends the copy (rule R5), as under `kvcr`.
    fn commits_kv_copies(&self) -> bool {
        false
    }

    /// Whether it reads [`Candidate::peer_copy`]; finding each candidate's best
    /// peer costs the router a little, so it is done only when asked.
    fn wants_peer_copies(&self) -> bool {
        self.commits_kv_copies()
    }
}

/// A selection policy's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Selection {
    pub(crate) index: usize,
    pub(crate) commit_kv_copy: bool,
}

impl Selection {
    /// Book candidate `index`.
    pub fn worker(index: usize) -> Self {
        Self {
            index,
            commit_kv_copy: false,
        }
    }

    /// Book candidate `index` and commit it to fetching its
    /// [`peer_copy`](Candidate::peer_copy). Only for a policy that declares
    /// [`commits_kv_copies`](SelectionPolicy::commits_kv_copies), and a
    /// candidate that has a peer copy; otherwise the router falls back.
    pub fn with_kv_copy(index: usize) -> Self {
        Self {
            index,
            commit_kv_copy: true,
        }
    }

    pub fn index(&self) -> usize {
        self.index
    }

    pub fn commits_kv_copy(&self) -> bool {
        self.commit_kv_copy
    }
}

/// The request being placed.
#[derive(Clone, Copy)]
pub struct SelectionRequest<'a> {
    raw: &'a FfiSelectionRequest<'a>,
}

impl<'a> SelectionRequest<'a> {
    #[doc(hidden)]
    pub fn new(raw: &'a FfiSelectionRequest<'a>) -> Self {
        Self { raw }
    }

    pub fn request_id(&self) -> &'a str {
        self.raw.request_id.as_str()
    }

    /// The role being booked: `aggregated`, `prefill` or `decode`.
    pub fn role(&self) -> &'a str {
        self.raw.role.as_str()
    }

    /// Full KV blocks in the prompt.
    pub fn request_blocks(&self) -> usize {
        self.raw.request_blocks as usize
    }

    pub fn prompt_tokens(&self) -> usize {
        self.raw.prompt_tokens as usize
    }

    /// Tokens per KV block.
    pub fn block_size(&self) -> usize {
        self.raw.block_size as usize
    }

    /// The LoRA adapter the request is for, if any.
    pub fn lora_name(&self) -> Option<&'a str> {
        non_empty(self.raw.identity.lora_name.as_str())
    }

    /// The request's cache salt, if any.
    pub fn cache_salt(&self) -> Option<&'a str> {
        non_empty(self.raw.identity.cache_salt.as_str())
    }

    /// The request's session context (a JSON object), deserialized into the
    /// policy's own type; `Ok(None)` when the request had none.
    pub fn session<T: DeserializeOwned>(&self) -> Result<Option<T>, HintError> {
        session(self.raw.session_context.as_str())
    }
}

/// The role's workers the request could go to, ordered by worker id, then dp
/// rank: the first of equals is a reproducible tie-break.
#[derive(Clone, Copy)]
pub struct Candidates<'a> {
    raw: &'a [FfiCandidate<'a>],
}

impl<'a> Candidates<'a> {
    #[doc(hidden)]
    pub fn new(raw: &'a [FfiCandidate<'a>]) -> Self {
        Self { raw }
    }

    pub fn len(&self) -> usize {
        self.raw.len()
    }

    pub fn is_empty(&self) -> bool {
        self.raw.is_empty()
    }

    pub fn get(&self, index: usize) -> Option<Candidate<'a>> {
        self.raw.get(index).map(|raw| Candidate { raw })
    }

    /// The candidates in order; `enumerate()` gives the index to select.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = Candidate<'a>> + 'a {
        self.raw.iter().map(|raw| Candidate { raw })
    }
}

/// One worker the request could go to.
#[derive(Clone, Copy)]
pub struct Candidate<'a> {
    raw: &'a FfiCandidate<'a>,
}

impl<'a> Candidate<'a> {
    pub fn worker(&self) -> Worker<'a> {
        Worker {
            raw: &self.raw.worker,
        }
    }

    /// Leading request blocks this worker already holds.
    pub fn cached_blocks(&self) -> usize {
        self.raw.cached_blocks as usize
    }

    /// Open bookings on this worker.
    pub fn active_requests(&self) -> u64 {
        self.raw.active_requests
    }

    /// Blocks its open bookings hold (decode load).
    pub fn active_blocks(&self) -> u64 {
        self.raw.active_blocks
    }

    /// Blocks its open bookings still have to prefill.
    pub fn prefill_blocks(&self) -> u64 {
        self.raw.prefill_blocks
    }

    /// The best copy it could fetch from a peer, for a hint-capable worker
    /// under a policy that [wants peer copies](SelectionPolicy::wants_peer_copies).
    pub fn peer_copy(&self) -> Option<PeerCopy<'a>> {
        match &self.raw.peer_copy {
            abi_stable::std_types::ROption::RSome(raw) => Some(PeerCopy { raw }),
            abi_stable::std_types::ROption::RNone => None,
        }
    }
}

/// The eligible peer (same worker type, hint-capable, with a source endpoint)
/// holding the longest prefix beyond a candidate's own.
#[derive(Clone, Copy)]
pub struct PeerCopy<'a> {
    raw: &'a FfiPeerCopy<'a>,
}

impl<'a> PeerCopy<'a> {
    pub fn source(&self) -> Worker<'a> {
        Worker {
            raw: &self.raw.source,
        }
    }

    /// The request's leading blocks the source holds.
    pub fn cached_blocks(&self) -> usize {
        self.raw.cached_blocks as usize
    }
}
