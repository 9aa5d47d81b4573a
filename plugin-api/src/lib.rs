//! The interface between the kvhint router and its hint-policy plugins.
//!
//! Plugin authors use [`prelude`] — [`HintPolicy`](prelude::HintPolicy),
//! [`HintContext`](prelude::HintContext), [`Action`](prelude::Action), the
//! [`HintRegistry`](prelude::HintRegistry) — and call [`export_plugin!`] once.
//! Nothing in that surface is FFI-shaped: the macro wraps the author's types in
//! the stable-ABI adapters of [`export`], which also stop every panic at the
//! boundary.
//!
//! The router (the host) uses [`abi`]: the `#[repr(C)]` types and `abi_stable`
//! trait objects that actually cross the boundary. They are versioned by
//! [`ABI_VERSION`] and by this crate's version ([`API_VERSION`]); the
//! compatibility rule is in this crate's README.
//!
//! A plugin's `tracing` events reach the router's log through [`log`]: the
//! host hands each loaded plugin a sink, and `export_plugin!` installs a
//! subscriber in the plugin that forwards to it.
//!
//! This crate stays small on purpose — every plugin depends on it — so it holds
//! only types, traits and the thin adapters between the two views.

pub mod abi;
pub mod context;
pub mod export;
pub mod log;
pub mod policy;
pub mod registry;
pub mod testing;

/// The version of this crate a plugin was compiled against; the host compares it
/// with its own (see the README's compatibility rule).
pub const API_VERSION: &str = env!("CARGO_PKG_VERSION");

/// The layout version of the root module and the types in [`abi`]. Bumped on any
/// change a prefix type cannot absorb; a plugin with another value is refused.
pub const ABI_VERSION: u32 = 1;

/// Everything a plugin author needs, in one import.
pub mod prelude {
    pub use crate::context::{HintContext, KvCopy, Peer, Worker};
    pub use crate::export_plugin;
    pub use crate::policy::{Action, Commitments, HintError, HintErrorKind, HintPolicy, Payload};
    pub use crate::registry::{
        HintHost, HintPolicyConstructor, HintPolicyProvider, HintRegistry, Parameters,
        RegistryError,
    };
    pub use std::sync::Arc;
}

#[doc(hidden)]
pub mod __private {
    pub use abi_stable;
}
