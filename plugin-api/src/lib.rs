//! The interface between the kvhint router and its policy plugins.
//!
//! Plugin authors use [`prelude`]: a [`HintPolicy`](prelude::HintPolicy) writes
//! engine-format actions for a booked worker into [`Actions`](prelude::Actions)
//! from a read-only [`HintContext`](prelude::HintContext); a
//! [`SelectionPolicy`](prelude::SelectionPolicy) picks the worker; both are
//! registered in a [`HintRegistry`](prelude::HintRegistry) by a function that
//! [`export_plugin!`] exports. Nothing in that surface is FFI-shaped: the macro
//! wraps the author's types in the stable-ABI adapters of `export`, which also
//! stop every panic at the boundary. [`testing`] runs policies in unit tests
//! without a router.
//!
//! The router (the host) uses `abi`, the `#[repr(C)]` types and `abi_stable`
//! trait objects that actually cross the boundary, and `writer`, its side of
//! the action writer. They are versioned by [`ABI_VERSION`] and by this crate's
//! version ([`API_VERSION`]); the compatibility rule is in this crate's README.
//!
//! This crate stays small on purpose — every plugin depends on it — so it holds
//! only types, traits and the thin adapters between the two views.

pub mod actions;
pub mod context;
pub mod policy;
pub mod registry;
pub mod selection;
pub mod testing;

#[doc(hidden)]
pub mod abi;
#[doc(hidden)]
pub mod export;
#[doc(hidden)]
pub mod log;
#[doc(hidden)]
pub mod writer;

/// The version of this crate a plugin was compiled against; the host compares it
/// with its own (see the README's compatibility rule).
pub const API_VERSION: &str = env!("CARGO_PKG_VERSION");

/// The layout version of the root module and the types in `abi`. Bumped on any
/// change a prefix type cannot absorb; a plugin with another value is refused.
/// 2: selection policies, actions written into the host's buffer, peers'
/// hashes on demand, kinds as integer codes, a root symbol per crate.
pub const ABI_VERSION: u32 = 2;

/// Everything a plugin author needs, in one import.
pub mod prelude {
    pub use crate::actions::Actions;
    pub use crate::context::{HintContext, KvCopy, Peer, Worker};
    pub use crate::export_plugin;
    pub use crate::policy::{Commitments, HintError, HintErrorKind, HintPolicy};
    pub use crate::registry::{
        HintHost, HintPolicyConstructor, HintPolicyProvider, HintRegistry, Parameters,
        RegistryError, RouterSettings, SelectionPolicyConstructor, SelectionPolicyProvider,
    };
    pub use crate::selection::{
        Candidate, Candidates, PeerCopy, Selection, SelectionPolicy, SelectionRequest,
    };
    pub use std::sync::Arc;
}

#[doc(hidden)]
pub mod __private {
    pub use abi_stable;
}
