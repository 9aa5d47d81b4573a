//! What the end-to-end tests and benches (the `kvhint-e2e` crate) reach inside the
//! router that is not its API: a few internals, re-exported here so their modules
//! can stay private to the crate. Nothing in the router uses this module.

/// How many times this thread scanned a config text whole to locate errors.
pub use crate::config::yaml::text_scans;
/// The engine-event decoder, its settings and what it yields.
pub use crate::engine_events::decode::{decode_batch, DecodeSettings, DecodedBatch, GroupFilter};
/// One event source's counters.
pub use crate::engine_events::stats::SourceStats;
/// A subscriber's settings (timeouts, buffer sizes).
pub use crate::engine_events::subscriber::SubscriberOptions;
/// Pins the calling thread as an event thread, as the router's own are.
pub use crate::router::background::set_current_thread;
/// Batched KV-event ingestion into the index.
pub use crate::router::ingest::Ingest;
