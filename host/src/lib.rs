//! kvhint: a KV-cache-aware request router whose KV hint policies are plugins.
//!
//! The modules follow a booking's data path and the plugin life cycle:
//! - [`loader`]: plugin files → checked, privately copied, dlopened root modules.
//! - [`registry`]: root modules (built-in or loaded) → named hint types →
//!   constructed policies.
//! - [`hints`]: a booking's context → the role's policies → [`envelope`], the one
//!   engine-format message for the booked worker.

pub mod catalog;
pub mod config;
pub mod counters;
pub mod domain;
pub mod engine_events;
pub mod envelope;
pub mod event_source;
pub mod gateway;
pub mod hints;
pub mod loader;
pub mod logging;
pub mod models;
pub mod plugin_log;
pub mod registry;
pub mod replay;
pub mod router;
pub mod selection;
pub mod service;
pub mod snapshot;
pub mod splice;
pub mod wire;
