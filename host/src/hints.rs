//! The hint stage: one booking's context through a role's ordered hint
//! policies, into at most one engine-format message.
//!
//! Rules enforced here, after the worker is booked (R1: the stage only reads the
//! booking):
//! - R7: actions are numbered `a1`, `a2`, … in policy order, at most
//!   [`MAX_ACTIONS`]; the surplus (from the later policies) is dropped and counted.
//! - R8: a policy that errors, panics (caught on the plugin side) or returns a
//!   malformed action loses all of its own actions for this booking and nothing
//!   else; failures are counted per policy, and a policy that has panicked
//!   `quarantine_after_panics` times is skipped until the next reload (a reload
//!   builds fresh instances). The stage never fails the booking.
//! - The time budget: plugins run in the router's process, on the booking's
//!   thread, so a policy that blocks holds up every booking behind it. A call
//!   that takes longer than `router.policy_budget_us` is counted; a policy whose
//!   last `quarantine_after_overruns` calls in a row all ran over is quarantined
//!   until the next reload, like one that keeps panicking. Calls in a row, not in
//!   total, so a healthy policy preempted now and then is never quarantined; and
//!   many of them (20 by default, over a 10 ms budget), because one stall of the
//!   whole process (CPU throttling of its cgroup, a VM pause) delays every call
//!   in flight at once. An overrunning call's actions still go out: it did
//!   finish.

use crate::domain::Worker;
use crate::policy_common::{ffi_identity, ffi_worker, reuse};
use crate::registry::{ConstructedPolicy, ErrorKind, Origin};
use abi_stable::marker_type::ErasedObject;
use abi_stable::std_types::{ROption, RResult, RSlice, RStr};
use elsa::FrozenVec;
use kvhint_plugin_api::abi::{FfiHintContext, FfiHintPolicyBox, FfiKvCopy, FfiPeer, FfiPeerHashes};
use kvhint_plugin_api::policy::Commitments;
use kvhint_plugin_api::writer::{MessageWriter, PolicyOutput, SignedHashes};
use serde_json::value::RawValue;
use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

pub use crate::policy_common::{
    HintLimits, LatencyHistogram, PolicyStats, PolicyStatsRegistry, Quarantine, QuarantineState,
    Timed, LATENCY_BUCKETS_US, MAX_ACTIONS,
};

/// One hint policy as a role runs it.
pub struct HintPolicyInstance {
    /// The item's `name` (its `type` unless the role lists the type twice).
    pub name: String,
    pub type_name: String,
    pub origin: Arc<Origin>,
    pub commitments: Commitments,
    policy: FfiHintPolicyBox,
    pub stats: Arc<PolicyStats>,
    /// Of this instance: quarantine is per snapshot, so a reload (a new instance)
    /// gives a fixed plugin a fresh start.
    quarantine: QuarantineState,
}

impl HintPolicyInstance {
    /// An instance with counters of its own.
    pub fn new(name: impl Into<String>, constructed: ConstructedPolicy) -> Self {
        Self::with_stats(name, constructed, Arc::default())
    }

    /// An instance counting into shared counters (see [`PolicyStatsRegistry`]).
    pub fn with_stats(
        name: impl Into<String>,
        constructed: ConstructedPolicy,
        stats: Arc<PolicyStats>,
    ) -> Self {
        Self {
            name: name.into(),
            type_name: constructed.type_name,
            origin: constructed.origin,
            commitments: constructed.commitments,
            policy: constructed.policy,
            stats,
            quarantine: QuarantineState::default(),
        }
    }

    pub fn is_quarantined(&self) -> bool {
        self.quarantine.is_quarantined()
    }

    /// Why it is quarantined, if it is.
    pub fn quarantine(&self) -> Option<Quarantine> {
        self.quarantine.reason()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    Error,
    Panic,
    Malformed,
}

/// A policy that lost its actions for one booking.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyFailure {
    pub policy: String,
    pub kind: FailureKind,
    pub message: String,
}

/// What the stage produced for one booking.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct HintOutcome {
    /// The engine-format message, if any action survived.
    pub message: Option<String>,
    /// Action types in the message, in order (for metrics and summaries).
    pub action_types: Vec<String>,
    /// Actions dropped over the cap (rule R7).
    pub dropped_over_cap: usize,
    pub failures: Vec<PolicyFailure>,
    /// Whether a policy that declares `Commitments::KV_COPY` returned actions
    /// that made it into the message (so a committed copy was sent).
    pub kv_copy_sent: bool,
}

/// A role's ordered hint policies.
pub struct HintStage {
    policies: Vec<HintPolicyInstance>,
    limits: HintLimits,
    /// What times each policy call against the budget: the monotonic clock,
    /// or a test's script (so a test of the budget never depends on how fast
    /// the machine is).
    clock: Clock,
}

/// Nanoseconds on a monotonic clock; only differences between two readings mean
/// anything.
pub type Clock = fn() -> u64;

/// The monotonic clock, in nanoseconds since its first reading in this process.
pub fn monotonic_ns() -> u64 {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

impl HintStage {
    pub fn new(policies: Vec<HintPolicyInstance>, limits: HintLimits) -> Self {
        Self {
            policies,
            limits,
            clock: monotonic_ns,
        }
    }

    /// The same stage with its policy calls timed by `clock` (tests).
    pub fn with_clock(self, clock: Clock) -> Self {
        Self { clock, ..self }
    }

    pub fn policies(&self) -> &[HintPolicyInstance] {
        &self.policies
    }

    pub fn is_empty(&self) -> bool {
        self.policies.is_empty()
    }

    /// Runs every policy on `context`, each writing its actions straight into
    /// the message (this thread's writer, reused from booking to booking).
    pub fn run(&self, context: &FfiHintContext<'_>) -> HintOutcome {
        self.run_signed(context, None)
    }

    /// [`Self::run`], with the engine hashes lent to the policies that their engines
    /// publish signed: an array written from them goes out signed.
    fn run_signed(
        &self,
        context: &FfiHintContext<'_>,
        signed: Option<&Rc<SignedHashes>>,
    ) -> HintOutcome {
        WRITER.with(|writer| match writer.try_borrow_mut() {
            Ok(mut writer) => self.run_with(context, &mut writer, signed),
            // Only a policy calling back into the router could get here.
            Err(_) => self.run_with(context, &mut MessageWriter::default(), signed),
        })
    }

    fn run_with(
        &self,
        context: &FfiHintContext<'_>,
        writer: &mut MessageWriter,
        signed: Option<&Rc<SignedHashes>>,
    ) -> HintOutcome {
        let mut outcome = HintOutcome::default();
        writer.set_signed_hashes(signed.cloned());
        writer.begin_message(context.request_id.as_str(), self.limits.max_actions);
        for instance in &self.policies {
            let kept = self.call(instance, context, writer, &mut outcome.failures);
            if kept > 0 && instance.commitments.contains(Commitments::KV_COPY) {
                outcome.kv_copy_sent = true;
            }
        }
        outcome.dropped_over_cap = writer.dropped();
        outcome.action_types = writer.action_types().map(str::to_string).collect();
        outcome.message = writer.finish().map(str::to_string);
        writer.set_signed_hashes(None);
        outcome
    }

    /// Calls one policy; returns how many of its actions stayed in the message
    /// (none when it failed: the writer rolled them back).
    fn call(
        &self,
        instance: &HintPolicyInstance,
        context: &FfiHintContext<'_>,
        writer: &mut MessageWriter,
        failures: &mut Vec<PolicyFailure>,
    ) -> usize {
        let stats = &instance.stats;
        if instance.is_quarantined() {
            stats.skipped_quarantined.fetch_add(1, Ordering::Relaxed);
            return 0;
        }
        stats.calls.add(1);
        writer.begin_policy();
        let started = (self.clock)();
        let result = instance.policy.build_hints(context, &mut writer.ffi());
        let took = (self.clock)().saturating_sub(started);
        stats.latency.observe(took);
        let timed = instance.quarantine.timed(took, &self.limits);
        if timed.over_budget {
            stats.over_budget.fetch_add(1, Ordering::Relaxed);
        }
        if let Some(overruns) = timed.quarantined_after {
            stats.quarantines.fetch_add(1, Ordering::Relaxed);
            tracing::error!(
                policy = %instance.name,
                overruns,
                last_call_us = took / 1000,
                budget_us = self.limits.budget_ns / 1000,
                "hint policy quarantined until the next reload: its calls keep running over router.policy_budget_us (plugins run in the router's process and must not block)"
            );
        }
        let output = writer.end_policy(matches!(result, RResult::ROk(())));
        let mut fail = |kind: FailureKind, message: String| {
            stats.failures.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(policy = %instance.name, kind = ?kind, %message, "hint policy dropped its actions for this booking");
            failures.push(PolicyFailure {
                policy: instance.name.clone(),
                kind,
                message,
            });
            0
        };
        match (result, output) {
            (_, PolicyOutput::Malformed(problem)) => {
                stats.malformed.fetch_add(1, Ordering::Relaxed);
                fail(FailureKind::Malformed, problem)
            }
            (RResult::ROk(()), PolicyOutput::Kept(kept)) => {
                stats.actions.add(kept as u64);
                kept
            }
            (RResult::RErr(e), _) => match ErrorKind::of(&e) {
                ErrorKind::Malformed => {
                    stats.malformed.fetch_add(1, Ordering::Relaxed);
                    fail(FailureKind::Malformed, e.message.into_string())
                }
                ErrorKind::Panicked => {
                    stats.panics.fetch_add(1, Ordering::Relaxed);
                    if let Some(panics) = instance.quarantine.panicked(&self.limits) {
                        stats.quarantines.fetch_add(1, Ordering::Relaxed);
                        tracing::error!(policy = %instance.name, panics, "hint policy quarantined until the next reload");
                    }
                    fail(FailureKind::Panic, e.message.into_string())
                }
                ErrorKind::Failed | ErrorKind::BadParameters => {
                    stats.errors.fetch_add(1, Ordering::Relaxed);
                    fail(FailureKind::Error, e.message.into_string())
                }
            },
        }
    }
}

thread_local! {
    /// The message writer of this thread's bookings: its buffers are reused.
    static WRITER: RefCell<MessageWriter> = RefCell::new(MessageWriter::default());
}

/// Why a booking carries no hint message although it may have had one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HintSkip {
    /// The role is not on the KV path: `--router-mode` is not `kv`, or its
    /// selection policy is not KV-aware (rule R4).
    NotKvPath,
    /// The role resolves to no hint policies.
    NoPolicies,
    /// The booked worker does not advertise `router_hint` (rule R6).
    WorkerNotHintCapable,
    /// The policies ran and returned no action.
    NoActions,
}

/// A booking's hint: the one message that goes to the booked worker, or why
/// there is none. The message is valid JSON by construction: the router's own
/// writer produced every byte of it, checking the grammar as the policies
/// called in (`kvhint_plugin_api::writer`).
#[derive(Debug, Clone)]
pub enum Hint {
    Sent {
        /// The engine-format message (rule R10), valid JSON, embedded as is.
        message: Box<RawValue>,
        /// Its action types, in order.
        action_types: Vec<String>,
    },
    Skipped(HintSkip),
}

impl Hint {
    pub fn message(&self) -> Option<&RawValue> {
        match self {
            Self::Sent { message, .. } => Some(message),
            Self::Skipped(_) => None,
        }
    }

    pub fn skipped(&self) -> Option<HintSkip> {
        match self {
            Self::Sent { .. } => None,
            Self::Skipped(skip) => Some(*skip),
        }
    }

    pub fn action_types(&self) -> &[String] {
        match self {
            Self::Sent { action_types, .. } => action_types,
            Self::Skipped(_) => &[],
        }
    }
}

impl PartialEq for Hint {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (
                Self::Sent {
                    message: a,
                    action_types: at,
                },
                Self::Sent {
                    message: b,
                    action_types: bt,
                },
            ) => a.get() == b.get() && at == bt,
            (Self::Skipped(a), Self::Skipped(b)) => a == b,
            _ => false,
        }
    }
}

/// What the router hands the hint stage for one booking (read-only, rule R1).
pub struct BookedRequest<'a> {
    pub request_id: &'a str,
    pub worker: &'a Worker,
    /// Leading request blocks the booked worker already holds.
    pub cached_blocks: usize,
    pub prompt_tokens: usize,
    pub block_size: usize,
    pub lora_name: Option<&'a str>,
    pub cache_salt: Option<&'a str>,
    /// JSON object text, if the request had a session context.
    pub session_context: Option<&'a str>,
    pub selection_policy: &'a str,
    pub block_hashes: &'a [u64],
}

/// The KV copy a booking was committed to, as the hint stage shows it.
pub struct CommittedCopyView<'a> {
    pub source: &'a Worker,
    pub first_block: usize,
    /// The source's engine hashes of blocks `0..last_block`, root-aligned.
    pub block_hashes: &'a [u64],
}

/// Where a policy's on-demand read of a peer's engine hashes goes: the router's
/// KV index, behind [`PeerRows`].
pub trait PeerHashSource {
    /// Appends the engine hashes of peer `peer`'s (as listed to the stage)
    /// leading request blocks, root-aligned, at most as many as it was listed
    /// with. True if the peer's engine publishes them as signed 64-bit integers
    /// (SGLang), so a message names them signed.
    fn fill(&self, peer: usize, out: &mut Vec<u64>) -> bool;
}

/// The rows of peers' engine hashes a booking's policies asked for, each read
/// once. A row handed out stays where it is until [`Self::reset`] (an
/// `elsa::FrozenVec` only ever appends, and a row's own heap buffer never moves),
/// so the slices policies hold stay valid while later rows are read, with no
/// `unsafe` here; the buffers go back to a spare list to be reused.
#[derive(Default)]
pub struct PeerRows {
    /// Per listed peer, its row in `rows`, if read.
    of_peer: RefCell<Vec<u32>>,
    rows: FrozenVec<Vec<u64>>,
    /// Emptied buffers of earlier bookings' rows.
    spare: RefCell<Vec<Vec<u64>>>,
    /// The rows in use whose engines publish signed hashes, for the writer.
    signed: Rc<SignedHashes>,
}

const NOT_READ: u32 = u32::MAX;

impl PeerRows {
    /// Forgets every row (keeping the buffers) for a booking of `peers` peers.
    pub fn reset(&mut self, peers: usize) {
        let of_peer = self.of_peer.get_mut();
        of_peer.clear();
        of_peer.resize(peers, NOT_READ);
        let spare = self.spare.get_mut();
        spare.extend(self.rows.as_mut().drain(..).map(|mut row| {
            row.clear();
            row
        }));
        self.signed.clear();
    }

    /// Bytes its buffers keep between bookings.
    pub fn retained_bytes(&mut self) -> usize {
        let in_use: usize = self.rows.as_mut().iter().map(|r| r.capacity() * 8).sum();
        let spare: usize = self.spare.get_mut().iter().map(|r| r.capacity() * 8).sum();
        in_use + spare + self.of_peer.get_mut().capacity() * 4
    }

    /// Peer `peer`'s row, read through `source` on first use.
    pub fn row(&self, peer: usize, source: &dyn PeerHashSource) -> &[u64] {
        let known = self.of_peer.borrow().get(peer).copied();
        match known {
            None => &[],
            Some(NOT_READ) => {
                let mut row = self.spare.borrow_mut().pop().unwrap_or_default();
                let signed = source.fill(peer, &mut row);
                let at = self.rows.len();
                let row = self.rows.push_get(row);
                if signed {
                    // The row stays where it is until `reset`, which forgets it.
                    self.signed.lend(row);
                }
                if let Some(slot) = self.of_peer.borrow_mut().get_mut(peer) {
                    *slot = at as u32;
                }
                row
            }
            Some(at) => self.rows.get(at as usize).unwrap_or(&[]),
        }
    }
}

/// What the peer-hash callback needs: the rows and where to read them.
struct PeerHashState<'a> {
    rows: &'a PeerRows,
    source: &'a dyn PeerHashSource,
}

extern "C" fn peer_hashes<'a>(state: *const ErasedObject, peer: u64) -> RSlice<'a, u64> {
    // SAFETY: `state` is the `PeerHashState` that `run_booking` keeps alive
    // across the policies' calls, and the rows it hands out outlive them.
    let state = unsafe { &*state.cast::<PeerHashState<'a>>() };
    let row = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        state.rows.row(peer as usize, state.source)
    }))
    .unwrap_or(&[]);
    // SAFETY: as above; `'a` is the booking's hint stage.
    unsafe { RSlice::from_raw_parts(row.as_ptr(), row.len()) }
}

/// A booking's peer, listed in the context (longest prefix first).
pub struct PeerView<'a> {
    pub worker: &'a Worker,
    pub cached_blocks: usize,
}

/// What the hint stage did for one booking.
#[derive(Debug, Clone, PartialEq)]
pub struct HintResult {
    pub hint: Hint,
    /// Actions dropped over the cap (rule R7).
    pub dropped_actions: usize,
    pub failures: Vec<PolicyFailure>,
    /// Whether a committed copy's sender got its actions into the message that
    /// went out; if not, the copy will not happen.
    pub kv_copy_sent: bool,
}

thread_local! {
    /// Spare buffer for a context's peer list.
    static PEERS: RefCell<Vec<FfiPeer<'static>>> = const { RefCell::new(Vec::new()) };
}

impl HintStage {
    /// Builds the borrowed context for a booking, runs the policies on it, and
    /// returns the message or why there is none. `peers`: the other workers
    /// holding a prefix of the request, longest first; their engine hashes are
    /// read through `rows` and `source` only when a policy asks.
    pub fn run_booking<'p>(
        &self,
        booked: &BookedRequest<'_>,
        peers: impl Iterator<Item = PeerView<'p>>,
        rows: &PeerRows,
        source: &dyn PeerHashSource,
        committed: Option<CommittedCopyView<'_>>,
    ) -> HintResult {
        let mut ffi_peers: Vec<FfiPeer<'_>> =
            reuse(PEERS.with(|spare| std::mem::take(&mut *spare.borrow_mut())));
        ffi_peers.extend(peers.map(|peer| FfiPeer {
            worker: ffi_worker(peer.worker.view()),
            cached_blocks: peer.cached_blocks as u64,
        }));
        let state = PeerHashState { rows, source };
        let context = FfiHintContext {
            request_id: RStr::from_str(booked.request_id),
            worker: ffi_worker(booked.worker.view()),
            cached_blocks: booked.cached_blocks as u64,
            prompt_tokens: booked.prompt_tokens as u64,
            block_size: booked.block_size as u32,
            identity: ffi_identity(booked.lora_name, booked.cache_salt),
            session_context: RStr::from_str(booked.session_context.unwrap_or("")),
            selection_policy: RStr::from_str(booked.selection_policy),
            block_hashes: RSlice::from_slice(booked.block_hashes),
            peers: RSlice::from_slice(&ffi_peers),
            peer_hashes: FfiPeerHashes {
                state: (&state as *const PeerHashState<'_>).cast::<ErasedObject>(),
                get: peer_hashes,
            },
            committed_kv_copy: match committed {
                Some(copy) => ROption::RSome(FfiKvCopy {
                    source: ffi_worker(copy.source.view()),
                    first_block: copy.first_block as u64,
                    block_hashes: RSlice::from_slice(copy.block_hashes),
                }),
                None => ROption::RNone,
            },
        };
        let outcome = self.run_signed(&context, Some(&rows.signed));
        PEERS.with(|spare| *spare.borrow_mut() = reuse(ffi_peers));
        let hint = match outcome.message {
            None => Hint::Skipped(HintSkip::NoActions),
            Some(text) => Hint::Sent {
                // SAFETY: the router's writer produced every byte of it and
                // checked the grammar as it went (see `Hint`); a single JSON
                // object without surrounding whitespace.
                message: unsafe { RawValue::from_string_unchecked(text) },
                action_types: outcome.action_types,
            },
        };
        HintResult {
            kv_copy_sent: outcome.kv_copy_sent && matches!(hint, Hint::Sent { .. }),
            hint,
            dropped_actions: outcome.dropped_over_cap,
            failures: outcome.failures,
        }
    }
}

/// The hint stage driven in process, through the same ABI records a loaded `.so`
/// gets, with policies linked into the test binary: what `.ci/run` also runs under
/// Miri, where the stage's `unsafe` (the peer-hash callback, the rows it lends,
/// the signed-hash addresses) is checked against the aliasing rules.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{Role, Worker, WorkerRegistration};
    use crate::registry::Registry;
    use kvhint_plugin_api::prelude::{
        export_plugin, Actions, HintContext, HintError, HintPolicy, HintPolicyConstructor,
        HintRegistry, RegistryError,
    };
    use std::cell::Cell;

    /// Reads every peer's row, holding the earlier ones while it reads the later
    /// ones, and sends one fetch per peer: the arena must keep them all in place.
    struct FetchFromEveryPeer;

    #[derive(serde::Serialize)]
    struct Fetch<'a> {
        peer: u64,
        #[serde(serialize_with = "kvhint_plugin_api::actions::u64_array")]
        block_hashes: &'a [u64],
    }

    impl HintPolicy for FetchFromEveryPeer {
        fn build_hints(
            &self,
            context: &HintContext<'_>,
            actions: &mut Actions<'_>,
        ) -> Result<(), HintError> {
            let rows: Vec<(u64, &[u64])> = context
                .peers()
                .map(|peer| (peer.worker().id(), peer.block_hashes()))
                .collect();
            // Read again: the second read of a peer is the same row, not a new one.
            let again: Vec<&[u64]> = context.peers().map(|peer| peer.block_hashes()).collect();
            for ((peer, row), second) in rows.iter().zip(&again) {
                assert_eq!(row.as_ptr(), second.as_ptr());
                actions.push(
                    "kv.fetch",
                    "1.0",
                    &Fetch {
                        peer: *peer,
                        block_hashes: row,
                    },
                )?;
            }
            Ok(())
        }
    }

    fn register(registry: &mut HintRegistry) -> Result<(), RegistryError> {
        registry.register_hint_policy(
            "fetch_from_every_peer",
            Arc::new(|_| Ok(HintPolicyConstructor::shared(FetchFromEveryPeer))),
            [],
        )
    }

    export_plugin!(register);

    fn stage(policy: &str) -> HintStage {
        let mut registry = Registry::with_builtins().expect("the built-ins register");
        registry
            .add_module(
                Origin::BuiltIn {
                    crate_name: "hint-stage-test".into(),
                },
                kvhint_plugin_module(),
            )
            .expect("the test module registers");
        let constructed = registry
            .construct(policy, &serde_json::json!({}))
            .expect("the policy builds");
        HintStage::new(
            vec![HintPolicyInstance::new(policy, constructed)],
            HintLimits::default(),
        )
    }

    fn worker(id: u64) -> Worker {
        let registration: WorkerRegistration = serde_json::from_value(serde_json::json!({
            "worker_id": id,
            "role": "decode",
            "runtime_data": {
                "router_hint": true,
                "router_hint_worker_type": "decode",
                "router_hint_source_control_endpoints": {"0": format!("tcp://10.0.0.{id}:23280")},
            },
        }))
        .expect("a registration");
        assert_eq!(registration.role, Role::Decode);
        Worker::from_registration(registration).expect("a worker")
    }

    /// Peer `i`'s row is `i * 100 + 0..len`; peers listed odd publish signed.
    struct Rows {
        lens: Vec<usize>,
        reads: Cell<usize>,
    }

    impl PeerHashSource for Rows {
        fn fill(&self, peer: usize, out: &mut Vec<u64>) -> bool {
            self.reads.set(self.reads.get() + 1);
            let len = self.lens.get(peer).copied().unwrap_or(0);
            out.extend((0..len as u64).map(|b| {
                if peer % 2 == 1 {
                    u64::MAX - b
                } else {
                    peer as u64 * 100 + b
                }
            }));
            peer % 2 == 1
        }
    }

    fn run(
        stage: &HintStage,
        rows: &mut PeerRows,
        source: &Rows,
        peers: &[Worker],
    ) -> serde_json::Value {
        let booked = worker(1);
        rows.reset(peers.len());
        let result = stage.run_booking(
            &BookedRequest {
                request_id: "r1",
                worker: &booked,
                cached_blocks: 0,
                prompt_tokens: 64,
                block_size: 16,
                lora_name: None,
                cache_salt: None,
                session_context: None,
                selection_policy: "kvcr",
                block_hashes: &[1, 2, 3, 4],
            },
            peers
                .iter()
                .zip(&source.lens)
                .map(|(worker, &len)| PeerView {
                    worker,
                    cached_blocks: len,
                }),
            rows,
            source,
            None,
        );
        assert!(result.failures.is_empty(), "{:?}", result.failures);
        let message = result.hint.message().expect("a message went out");
        serde_json::from_str(message.get()).expect("the message is JSON")
    }

    #[test]
    fn every_peer_row_a_policy_holds_stays_valid_while_it_reads_the_next_and_signed_rows_go_out_signed(
    ) {
        let stage = stage("fetch_from_every_peer");
        let peers = [worker(2), worker(3), worker(4)];
        let source = Rows {
            lens: vec![3, 2, 4],
            reads: Cell::new(0),
        };
        let mut rows = PeerRows::default();
        for booking in 0..2 {
            source.reads.set(0);
            let message = run(&stage, &mut rows, &source, &peers);
            assert_eq!(
                source.reads.get(),
                3,
                "booking {booking}: each row read once"
            );
            let actions = message["actions"].as_array().expect("actions");
            let fetched: Vec<(u64, serde_json::Value)> = actions
                .iter()
                .map(|a| {
                    (
                        a["payload"]["peer"].as_u64().unwrap_or(0),
                        a["payload"]["block_hashes"].clone(),
                    )
                })
                .collect();
            assert_eq!(
                fetched,
                [
                    (2, serde_json::json!([0, 1, 2])),
                    // Listed second (odd): published signed, so written signed.
                    (3, serde_json::json!([-1, -2])),
                    (4, serde_json::json!([200, 201, 202, 203])),
                ],
                "booking {booking}"
            );
        }
        // The second booking reused the first one's buffers.
        assert!(rows.retained_bytes() >= 9 * 8);
    }

    #[test]
    fn kv_fetch_reads_only_the_chosen_peers_row() {
        let stage = stage("kv_fetch");
        let peers = [worker(2), worker(3)];
        let source = Rows {
            lens: vec![4, 2],
            reads: Cell::new(0),
        };
        let mut rows = PeerRows::default();
        let message = run(&stage, &mut rows, &source, &peers);
        assert_eq!(source.reads.get(), 1);
        assert_eq!(
            message["actions"][0]["action_type"], "kv.fetch",
            "{message}"
        );
        assert_eq!(
            message["actions"][0]["payload"]["block_hashes"],
            serde_json::json!([0, 1, 2, 3])
        );
        assert_eq!(
            message["actions"][0]["payload"]["source_control_endpoint"],
            "tcp://10.0.0.2:23280"
        );
    }
}
