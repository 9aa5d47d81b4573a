//! kvhint: a KV-cache-aware request router whose KV hint policies are plugins.
//!
//! The modules are layered; each names only modules of its own layer or of the
//! layers listed before it, never one after, and no two name each other in a cycle.
//! `tests/layers.rs` checks it on every `cargo test`, and README's "The router
//! core, layer by layer" describes each module. In order:
//!
//! 1. **domain**: [`domain`] (roles, workers, where engines publish events: it
//!    names nothing else in the crate), and leaf utilities: [`counters`],
//!    [`splice`], [`trust`], [`logging`].
//! 2. **config**: [`config`], the YAML file → a typed config (it knows no loader).
//! 3. **plugins**: what the config names, loaded: [`plugin_log`], [`loader`],
//!    [`registry`], [`catalog`]; and the served [`models`]' tokenizers.
//! 4. **policies**: [`policy_common`] (what the two stages share), [`selection`],
//!    [`hints`] → [`envelope`], and the [`snapshot`] holding them per role.
//! 5. **router**: [`router`], the data plane. It describes a booking to the policy
//!    stages in plain views; only the stages build the ABI's records.
//! 6. **feeds**, what drives the router: [`engine_events`], [`fleet`] (which
//!    workers the router has: registration, deregistration and the config's
//!    listed workers, each with its subscription), [`replication`] (load shared
//!    between replicas over NATS), [`gateway`] (the request path to the workers).
//! 7. **doors**, where the world reaches it: [`service`], [`wire`], [`report`]
//!    (what `check` and `plugins` print), [`replay`]; [`testing`], the few
//!    internals the end-to-end tests reach; and `main.rs`, the CLI, which nothing
//!    imports. A door may use a feed; a feed never names a door.

// 1. domain
pub mod counters;
pub mod domain;
pub mod logging;
pub mod splice;
pub mod trust;

// 2. config
pub mod config;

// 3. plugins
pub mod catalog;
pub mod loader;
pub mod models;
pub mod plugin_log;
pub mod registry;

// 4. policies
pub mod envelope;
pub mod hints;
pub mod policy_common;
pub mod selection;
pub mod snapshot;

// 5. router
pub mod router;

// 6. feeds
pub mod engine_events;
pub mod fleet;
pub mod gateway;
pub mod replication;

// 7. doors
pub mod replay;
pub mod report;
pub mod service;
pub mod testing;
pub mod wire;
