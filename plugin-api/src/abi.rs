#![allow(non_local_definitions)] // abi_stable 0.11's #[sabi_trait] expands impls inside a const.

//! The types that cross the plugin boundary.
//!
//! Everything here is `#[repr(C)]` and derives `StableAbi`, so `abi_stable` can
//! check at load time that host and plugin agree on every layout. The hint
//! context is a borrowed view (`RStr`, `RSlice`): the host builds it once per
//! booking from data it already holds and every policy reads the same one, so a
//! call across the boundary allocates nothing on the host side.
//!
//! Authors never touch these types; the adapters in [`crate::export`] translate.

use abi_stable::{
    library::RootModule,
    package_version_strings, sabi_trait,
    sabi_types::VersionStrings,
    std_types::{RBox, ROption, RResult, RSlice, RStr, RString, RVec},
    StableAbi,
};

/// The plugin's root module: one per `.so`, built by [`crate::export_plugin!`].
///
/// A prefix type: later versions may append fields after `register` without
/// breaking plugins built against this one.
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
    #[sabi(last_prefix_field)]
    pub register: extern "C" fn() -> RResult<RVec<FfiRegistration>, FfiError>,
    /// Hands the plugin the host's log sink: the plugin's `tracing` events go
    /// there from then on (see [`crate::log`]). Calling it again replaces the
    /// sink and its maximum level.
    ///
    /// Appended after the last prefix field, as prefix-type evolution requires.
    /// In practice every plugin the router loads has it: `abi_stable`'s
    /// `init_root_module` refuses a root module with fewer fields than the
    /// router's ("too many fields"), as the compatibility rule refuses older
    /// builds. `missing_field(option)` still overrides the struct's `panic`
    /// default here, so the loader's accessor is an `Option` and no layout
    /// surprise can become a panic inside the loader.
    #[sabi(missing_field(option))]
    pub set_log_sink: extern "C" fn(FfiLogSink),
}

impl RootModule for PluginModRef {
    abi_stable::declare_root_module_statics! {PluginModRef}
    const BASE_NAME: &'static str = "kvhint_plugin";
    const NAME: &'static str = "kvhint_plugin";
    const VERSION_STRINGS: VersionStrings = package_version_strings!();
}

/// One `register_hint_policy` call, as it crosses the boundary.
#[repr(C)]
#[derive(StableAbi)]
pub struct FfiRegistration {
    pub name: RString,
    pub default_hosts: RVec<FfiHintHost>,
    pub provider: FfiHintProviderBox,
}

/// Where a hint policy runs by default (see `HintHost` in the prelude).
#[repr(u8)]
#[derive(StableAbi, Debug, Clone, PartialEq, Eq)]
pub enum FfiHintHost {
    AnyWorkerSelection,
    WorkerSelection(RString),
}

/// Why a call into a plugin failed.
#[repr(u8)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq)]
pub enum FfiErrorKind {
    /// The policy or provider returned an error.
    Failed,
    /// The parameters did not deserialize.
    BadParameters,
    /// The code panicked; the panic was caught on the plugin side.
    Panicked,
    /// The policy returned a malformed action (empty type or version, payload
    /// not a JSON object). Checked on the plugin side, where the payload's JSON
    /// is produced, so the host embeds payloads without parsing them again.
    Malformed,
}

#[repr(C)]
#[derive(StableAbi, Debug, Clone)]
pub struct FfiError {
    pub kind: FfiErrorKind,
    pub message: RString,
}

/// A constructed policy with the commitments it declared.
#[repr(C)]
#[derive(StableAbi)]
pub struct FfiConstructed {
    pub policy: FfiHintPolicyBox,
    pub commitments: u32,
}

/// Builds a policy from its parameters (a JSON object, as text).
#[sabi_trait]
pub trait FfiHintProvider: Send + Sync {
    #[sabi(last_prefix_field)]
    fn construct(&self, parameters_json: RStr<'_>) -> RResult<FfiConstructed, FfiError>;
}

pub type FfiHintProviderBox = FfiHintProvider_TO<'static, RBox<()>>;

/// A constructed policy; called once per booking.
#[sabi_trait]
pub trait FfiHintPolicy: Send + Sync {
    #[sabi(last_prefix_field)]
    fn build_hints(&self, context: &FfiHintContext<'_>) -> RResult<RVec<FfiAction>, FfiError>;
}

pub type FfiHintPolicyBox = FfiHintPolicy_TO<'static, RBox<()>>;

/// One KV action. `payload_json` is the payload as JSON text, produced by
/// serde_json inside the plugin and checked there to be an object; the host
/// checks only the cheap invariants and embeds it in the envelope as it is.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq, Eq)]
pub struct FfiAction {
    pub action_type: RString,
    pub action_version: RString,
    pub payload_json: RString,
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

/// Another worker that holds part of the request's prefix.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Copy)]
pub struct FfiPeer<'a> {
    pub worker: FfiWorker<'a>,
    /// How many of the request's leading blocks this peer holds.
    pub cached_blocks: u64,
    /// The peer engine's own hashes for those blocks (`cached_blocks` of them).
    pub block_hashes: RSlice<'a, u64>,
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

/// What a policy sees of one booking. Borrowed from the host for one call.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Copy)]
pub struct FfiHintContext<'a> {
    pub request_id: RStr<'a>,
    /// The booked worker.
    pub worker: FfiWorker<'a>,
    /// How many of the request's leading blocks the booked worker already holds.
    pub cached_blocks: u64,
    pub prompt_tokens: u64,
    pub block_size: u32,
    /// The request's session context as a JSON object in text ("" if none).
    pub session_context: RStr<'a>,
    /// The role's selection-policy type, e.g. `kvcr`.
    pub selection_policy: RStr<'a>,
    /// The request's block hashes as the router computes them (chained, one per
    /// full block of the prompt).
    pub block_hashes: RSlice<'a, u64>,
    /// Other workers holding a prefix of the request, longest first.
    pub peers: RSlice<'a, FfiPeer<'a>>,
    pub committed_kv_copy: ROption<FfiKvCopy<'a>>,
}

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
