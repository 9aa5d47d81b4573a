#![allow(non_local_definitions)] // abi_stable 0.11's #[sabi_trait] expands impls inside a const.

//! The types that cross the plugin boundary (ABI 2).
//!
//! Everything here is `#[repr(C)]` and derives `StableAbi`, so `abi_stable` can
//! check at load time that host and plugin agree on every layout. Three choices
//! shape it:
//! - **Borrowed views.** A hint context and a selection request are borrowed
//!   (`RStr`, `RSlice`) from data the host already holds, for one call: the
//!   host allocates nothing per call to describe a booking.
//! - **Host-owned output.** A hint policy writes its actions through an
//!   [`FfiActionWriter`]: function pointers into a JSON writer the host owns,
//!   into a buffer the host reuses. Nothing the plugin allocates crosses back
//!   to be freed, and because the host writes every byte, the message is valid
//!   JSON by construction: no parse on the booking path.
//! - **Integers, not enums, for kinds.** Error kinds, hint-host kinds,
//!   registration kinds and policy flags cross as `u32` codes ([`error_code`],
//!   [`host_kind`], [`policy_kind`], [`selection_flags`]). A `#[repr(u8)]` enum
//!   value one side does not know would be undefined behaviour; an unknown code
//!   is mapped to a known meaning, which each module below states.
//!
//! Peers' engine hashes are not in the hint context: a policy asks for one
//! peer's through [`FfiPeerHashes`], so a booking where a thousand workers hold
//! parts of the prompt does not copy a thousand rows for a policy that reads one.
//!
//! Authors never touch these types; the adapters in [`crate::export`] translate.

use abi_stable::{
    library::RootModule,
    marker_type::ErasedObject,
    package_version_strings, sabi_trait,
    sabi_types::VersionStrings,
    std_types::{RBox, ROption, RResult, RSlice, RStr, RString, RVec},
    StableAbi,
};

/// The plugin's root module: one per `.so`, built by [`crate::export_plugin!`].
///
/// A prefix type: later versions may append fields after `set_log_sink`
/// without breaking plugins built against this one.
#[repr(C)]
#[derive(StableAbi)]
#[sabi(kind(Prefix(prefix_ref = PluginModRef)))]
#[sabi(missing_field(panic))]
pub struct PluginMod {
    /// [`crate::ABI_VERSION`] as the plugin saw it.
    pub abi_version: u32,
    /// `cfg!(panic = "unwind")` in the plugin. A `panic = "abort"` plugin would take
    /// the router down on its first panic, so the host refuses it.
    pub panic_unwind: bool,
    /// [`crate::API_VERSION`] as the plugin saw it.
    pub api_version: RStr<'static>,
    /// The plugin crate's name and version (`CARGO_PKG_NAME`, `CARGO_PKG_VERSION`).
    pub name: RStr<'static>,
    pub version: RStr<'static>,
    /// Runs the author's registration function and returns what it registered.
    pub register: extern "C" fn() -> RResult<RVec<FfiRegistration>, FfiError>,
    /// Hands the plugin the host's log sink: the plugin's `tracing` events go
    /// there from then on (see [`crate::log`]). Calling it again replaces the
    /// sink and its maximum level.
    #[sabi(last_prefix_field)]
    pub set_log_sink: extern "C" fn(FfiLogSink),
}

impl RootModule for PluginModRef {
    abi_stable::declare_root_module_statics! {PluginModRef}
    const BASE_NAME: &'static str = "kvhint_plugin";
    const NAME: &'static str = "kvhint_plugin";
    const VERSION_STRINGS: VersionStrings = package_version_strings!();
}

/// The prefix of the symbol a plugin `.so` exports its root module under; the
/// rest is the plugin crate's name (`CARGO_CRATE_NAME`). One name per crate,
/// not `abi_stable`'s single fixed name, so several plugin crates can be linked
/// into one router as built-ins without their symbols colliding. The loader
/// finds the one symbol with this prefix in the file's dynamic symbol table.
pub const ROOT_SYMBOL_PREFIX: &str = "kvhint_plugin_root_v2__";

/// Why a call into a plugin failed ([`FfiError::code`]). A code the host does
/// not know is read as [`FAILED`](error_code::FAILED).
pub mod error_code {
    /// The policy or provider returned an error.
    pub const FAILED: u32 = 1;
    /// The parameters did not deserialize.
    pub const BAD_PARAMETERS: u32 = 2;
    /// The code panicked; the panic was caught on the plugin side.
    pub const PANICKED: u32 = 3;
    /// The policy's output was malformed (checked where it was produced).
    pub const MALFORMED: u32 = 4;
}

#[repr(C)]
#[derive(StableAbi, Debug, Clone)]
pub struct FfiError {
    /// One of [`error_code`].
    pub code: u32,
    /// For `BAD_PARAMETERS`, one problem per line, each naming the offending
    /// top-level key in backticks where there is one: leading for a bad value
    /// (`` `min_blocks`: invalid type… ``), in serde's own wording for a key
    /// the policy does not know (`` unknown field `min_block`, expected … ``).
    pub message: RString,
}

/// What a registration registers ([`FfiRegistration::kind`]). A kind the host
/// does not know is refused at registration, with the plugin named.
pub mod policy_kind {
    pub const HINT: u32 = 1;
    pub const SELECTION: u32 = 2;
}

/// Where a hint policy runs by default ([`FfiHintHost::kind`]). A kind the host
/// does not know is read as [`WORKER_SELECTION`](host_kind::WORKER_SELECTION)
/// with the entry's name: it then runs only under a selection policy of that
/// exact name, never somewhere its author did not ask for.
pub mod host_kind {
    pub const ANY_WORKER_SELECTION: u32 = 1;
    pub const WORKER_SELECTION: u32 = 2;
}

#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq, Eq)]
pub struct FfiHintHost {
    /// One of [`host_kind`].
    pub kind: u32,
    /// The selection-policy type, for `WORKER_SELECTION` ("" otherwise).
    pub selection: RString,
}

/// One `register_*_policy` call, as it crosses the boundary.
#[repr(C)]
#[derive(StableAbi)]
pub struct FfiRegistration {
    /// One of [`policy_kind`]; says which provider is set.
    pub kind: u32,
    pub name: RString,
    /// Hint policies only: where it runs when a role does not list `hints`.
    pub default_hosts: RVec<FfiHintHost>,
    pub hint_provider: ROption<FfiHintProviderBox>,
    pub selection_provider: ROption<FfiSelectionProviderBox>,
}

/// What the router tells a provider besides the parameters.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Copy, Default)]
pub struct FfiRouterSettings {
    /// Tokens per KV block (`router.block_size`).
    pub block_size: u32,
    /// `router.seed`, for policies that draw random numbers reproducibly.
    pub seed: u64,
}

/// A constructed hint policy with the commitments it declared.
#[repr(C)]
#[derive(StableAbi)]
pub struct FfiConstructed {
    pub policy: FfiHintPolicyBox,
    pub commitments: u32,
}

/// Builds a hint policy from its parameters (a JSON object, as text).
#[sabi_trait]
pub trait FfiHintProvider: Send + Sync {
    #[sabi(last_prefix_field)]
    fn construct(
        &self,
        parameters_json: RStr<'_>,
        settings: &FfiRouterSettings,
    ) -> RResult<FfiConstructed, FfiError>;
}

pub type FfiHintProviderBox = FfiHintProvider_TO<'static, RBox<()>>;

/// A constructed hint policy; called once per booking. It writes its actions
/// through `out`; on an error the host discards whatever it wrote.
#[sabi_trait]
pub trait FfiHintPolicy: Send + Sync {
    #[sabi(last_prefix_field)]
    fn build_hints(
        &self,
        context: &FfiHintContext<'_>,
        out: &mut FfiActionWriter,
    ) -> RResult<(), FfiError>;
}

pub type FfiHintPolicyBox = FfiHintPolicy_TO<'static, RBox<()>>;

/// The host's JSON writer for one booking's actions: `state` is the host's,
/// opaque to the plugin, and passed back to every function of `vtable`.
///
/// The calls form one action at a time: `begin_action`, then exactly one JSON
/// object as the payload (`begin_object` … `end_object`, with `key` before each
/// member's value), then `end_action`. The host checks that grammar as it
/// writes; a policy that breaks it (a value without a key, an unclosed array, a
/// payload that is not an object, a non-finite float) has its actions for this
/// booking discarded as malformed (rule R8). Beyond the message's action cap
/// the host drops whole actions (rule R7) and the calls are cheap no-ops.
#[repr(C)]
#[derive(StableAbi)]
pub struct FfiActionWriter {
    pub state: *mut ErasedObject,
    pub vtable: &'static FfiWriterVtable,
}

/// The functions of an [`FfiActionWriter`]. None of them unwinds, and none
/// fails: misuse is recorded in the state and reported when the policy returns.
/// Appending a function is an ABI change (bump [`crate::ABI_VERSION`]).
#[repr(C)]
#[derive(StableAbi)]
pub struct FfiWriterVtable {
    pub begin_action:
        extern "C" fn(state: *mut ErasedObject, action_type: RStr<'_>, action_version: RStr<'_>),
    pub end_action: extern "C" fn(state: *mut ErasedObject),
    pub begin_object: extern "C" fn(state: *mut ErasedObject),
    pub end_object: extern "C" fn(state: *mut ErasedObject),
    pub begin_array: extern "C" fn(state: *mut ErasedObject),
    pub end_array: extern "C" fn(state: *mut ErasedObject),
    pub key: extern "C" fn(state: *mut ErasedObject, key: RStr<'_>),
    pub string: extern "C" fn(state: *mut ErasedObject, value: RStr<'_>),
    pub u64: extern "C" fn(state: *mut ErasedObject, value: u64),
    pub i64: extern "C" fn(state: *mut ErasedObject, value: i64),
    pub f64: extern "C" fn(state: *mut ErasedObject, value: f64),
    pub bool: extern "C" fn(state: *mut ErasedObject, value: bool),
    pub null: extern "C" fn(state: *mut ErasedObject),
    /// A whole array of unsigned integers, in one call (a fetch's hashes).
    pub u64_array: extern "C" fn(state: *mut ErasedObject, values: RSlice<'_, u64>),
    /// Records that the payload could not be produced (the serializer failed
    /// half-way): the action is discarded as malformed with this message.
    pub fail: extern "C" fn(state: *mut ErasedObject, message: RStr<'_>),
}

/// A worker as a policy sees it.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Copy)]
pub struct FfiWorker<'a> {
    pub worker_id: u64,
    pub dp_rank: u32,
    /// `router_hint` in the worker's runtime data.
    pub router_hint: bool,
    /// `router_hint_worker_type` in the worker's runtime data ("" if absent).
    pub worker_type: RStr<'a>,
    /// The worker's KV source endpoint for this dp rank, from
    /// `router_hint_source_control_endpoints` ("" if it has none).
    pub source_control_endpoint: RStr<'a>,
}

/// Another worker that holds part of the request's prefix. Its engine hashes
/// come on demand, through [`FfiHintContext::peer_hashes`].
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Copy)]
pub struct FfiPeer<'a> {
    pub worker: FfiWorker<'a>,
    /// How many of the request's leading blocks this peer holds.
    pub cached_blocks: u64,
}

/// Reads one peer's engine hashes on demand: `get(state, i)` returns the
/// engine hashes of the request's first `peers[i].cached_blocks` blocks as peer
/// `i`'s engine published them, root-aligned (entry `j` is request block `j`),
/// valid until the policy's call returns. Fewer if the peer's cache shrank
/// since the lookup; empty for an index out of range.
#[repr(C)]
#[derive(StableAbi, Clone, Copy)]
pub struct FfiPeerHashes<'a> {
    pub state: *const ErasedObject,
    pub get: extern "C" fn(state: *const ErasedObject, peer: u64) -> RSlice<'a, u64>,
}

/// A KV copy the selection policy committed the booked worker to.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Copy)]
pub struct FfiKvCopy<'a> {
    pub source: FfiWorker<'a>,
    /// The first request block the booked worker lacks (where the copy starts).
    pub first_block: u64,
    /// The source engine's hashes, root-aligned: entry `i` is request block `i`,
    /// from block 0 to the end of the copy.
    pub block_hashes: RSlice<'a, u64>,
}

/// What identifies a request beyond its tokens: both seed the router's block
/// hashes, so prompts for different adapters or salts never match.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Copy)]
pub struct FfiRequestIdentity<'a> {
    /// The LoRA adapter ("" for the base model).
    pub lora_name: RStr<'a>,
    /// The cache salt ("" for none).
    pub cache_salt: RStr<'a>,
}

/// What a hint policy sees of one booking. Borrowed from the host for one call.
#[repr(C)]
#[derive(StableAbi, Clone, Copy)]
pub struct FfiHintContext<'a> {
    pub request_id: RStr<'a>,
    /// The booked worker.
    pub worker: FfiWorker<'a>,
    /// How many of the request's leading blocks the booked worker already holds.
    pub cached_blocks: u64,
    pub prompt_tokens: u64,
    pub block_size: u32,
    pub identity: FfiRequestIdentity<'a>,
    /// The request's session context as a JSON object in text ("" if none).
    pub session_context: RStr<'a>,
    /// The role's selection-policy type, e.g. `kvcr`.
    pub selection_policy: RStr<'a>,
    /// The request's block hashes as the router computes them (chained, one per
    /// full block of the prompt).
    pub block_hashes: RSlice<'a, u64>,
    /// Other workers holding a prefix of the request, longest first, then by
    /// worker id and dp rank.
    pub peers: RSlice<'a, FfiPeer<'a>>,
    pub peer_hashes: FfiPeerHashes<'a>,
    pub committed_kv_copy: ROption<FfiKvCopy<'a>>,
}

/// What a selection policy declares about itself ([`FfiSelectionConstructed::flags`]).
/// Bits the host does not know are ignored.
pub mod selection_flags {
    /// It reads cached prefixes: the router consults the KV index for it and
    /// runs hint policies under it (rule R4). Without it, a role's `hints`
    /// must be empty.
    pub const KV_AWARE: u32 = 1;
    /// With its parameters it may commit bookings to a peer's KV copy (rule R5:
    /// the role must then run exactly one hint policy that sends it).
    pub const COMMITS_KV_COPIES: u32 = 2;
    /// It reads [`FfiCandidate::peer_copy`](super::FfiCandidate::peer_copy);
    /// without it the router leaves it empty and saves finding it.
    pub const WANTS_PEER_COPIES: u32 = 4;
}

/// A constructed selection policy with what it declared.
#[repr(C)]
#[derive(StableAbi)]
pub struct FfiSelectionConstructed {
    pub policy: FfiSelectionPolicyBox,
    /// [`selection_flags`].
    pub flags: u32,
}

/// Builds a selection policy from its parameters (a JSON object, as text).
#[sabi_trait]
pub trait FfiSelectionProvider: Send + Sync {
    #[sabi(last_prefix_field)]
    fn construct(
        &self,
        parameters_json: RStr<'_>,
        settings: &FfiRouterSettings,
    ) -> RResult<FfiSelectionConstructed, FfiError>;
}

pub type FfiSelectionProviderBox = FfiSelectionProvider_TO<'static, RBox<()>>;

/// One request to place, as a selection policy sees it.
#[repr(C)]
#[derive(StableAbi, Clone, Copy)]
pub struct FfiSelectionRequest<'a> {
    pub request_id: RStr<'a>,
    /// The role being booked (`aggregated`, `prefill`, `decode`).
    pub role: RStr<'a>,
    /// Full blocks in the prompt.
    pub request_blocks: u64,
    pub prompt_tokens: u64,
    pub block_size: u32,
    pub identity: FfiRequestIdentity<'a>,
    /// The request's session context as a JSON object in text ("" if none).
    pub session_context: RStr<'a>,
}

/// The best copy a hint-capable candidate could fetch from a peer: the eligible
/// peer (same worker type, hint-capable, with a source endpoint) holding the
/// longest prefix beyond the candidate's own.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Copy)]
pub struct FfiPeerCopy<'a> {
    pub source: FfiWorker<'a>,
    /// The request's leading blocks the source holds.
    pub cached_blocks: u64,
}

/// One worker the request could go to. Candidates arrive ordered by worker id,
/// then dp rank, so "the first of equals" is a reproducible tie-break.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Copy)]
pub struct FfiCandidate<'a> {
    pub worker: FfiWorker<'a>,
    /// Leading request blocks this worker already holds.
    pub cached_blocks: u64,
    /// Open bookings on it, and the blocks they hold (decode load).
    pub active_requests: u64,
    pub active_blocks: u64,
    /// Blocks its open bookings still have to prefill.
    pub prefill_blocks: u64,
    /// Only for a policy that declares `WANTS_PEER_COPIES`, and only for a
    /// candidate that advertises `router_hint`.
    pub peer_copy: ROption<FfiPeerCopy<'a>>,
}

/// A selection policy's answer.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq)]
pub struct FfiSelection {
    /// Index into the candidates.
    pub index: u64,
    /// Commit the booking to the chosen candidate's `peer_copy`. Only a policy
    /// that declares `COMMITS_KV_COPIES` may, and only for a candidate that has
    /// one; otherwise the answer is out of range.
    pub commit_kv_copy: bool,
}

/// A constructed selection policy; called once per booking, from many threads.
#[sabi_trait]
pub trait FfiSelectionPolicy: Send + Sync {
    #[sabi(last_prefix_field)]
    fn select(
        &self,
        request: &FfiSelectionRequest<'_>,
        candidates: RSlice<'_, FfiCandidate<'_>>,
    ) -> RResult<FfiSelection, FfiError>;
}

pub type FfiSelectionPolicyBox = FfiSelectionPolicy_TO<'static, RBox<()>>;

/// Log levels as they cross the boundary, in [`FfiLogRecord::level`] and
/// [`FfiLogSink::max_level`]: a plain `u8`, not a `#[repr(u8)]` enum, because an
/// enum value one side does not know (a later plugin-api adding a level) would
/// be undefined behaviour, while an unknown number is just mapped to the nearest
/// known level. Ordered by verbosity, so "is this level enabled" is `<=`.
pub mod log_level {
    /// Only as a sink's `max_level`: the host wants no events at all.
    pub const OFF: u8 = 0;
    pub const ERROR: u8 = 1;
    pub const WARN: u8 = 2;
    pub const INFO: u8 = 3;
    pub const DEBUG: u8 = 4;
    pub const TRACE: u8 = 5;
}

/// One `tracing` event of a plugin, already formatted on the plugin side.
/// Borrowed for the duration of one [`FfiLogSink::log`] call.
///
/// Formatted text rather than structured fields: fields are `dyn Debug` values
/// that cannot cross the boundary, and the host only ever prints them.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Copy)]
pub struct FfiLogRecord<'a> {
    /// One of [`log_level`]'s event levels (`ERROR`..=`TRACE`).
    pub level: u8,
    /// The plugin crate's name (`CARGO_PKG_NAME`), as in [`PluginMod::name`].
    pub plugin: RStr<'a>,
    /// The event's own target in the plugin (by default its module path).
    pub target: RStr<'a>,
    /// The event's `message` field, then its other fields as ` key=value`.
    pub message: RStr<'a>,
}

/// Where a plugin's log events go: given to the plugin by the host through
/// [`PluginMod::set_log_sink`].
#[repr(C)]
#[derive(StableAbi, Clone, Copy)]
pub struct FfiLogSink {
    /// The most verbose [`log_level`] the host would print: the plugin does not
    /// even format events above it.
    pub max_level: u8,
    /// Takes one event. The host's implementation never unwinds.
    pub log: extern "C" fn(&FfiLogRecord<'_>),
}
