//! The host side of the log bridge: plugin `tracing` events, re-emitted in the
//! router's log.
//!
//! A loaded plugin has its own copy of `tracing`, whose events the router's
//! subscriber cannot see. The loader hands every plugin it opens the [`sink`]
//! (through the root module's `set_log_sink`); the plugin's bridge subscriber
//! (`kvhint_plugin_api::log`) formats each event and calls [`log_record`],
//! which emits it here, under target [`TARGET`] with the plugin's name, so an
//! operator filters all plugin output with `KVHINT_LOG=kvhint::plugin=…` and
//! sees which plugin said what.
//!
//! Built-in plugins are linked into the router and share its `tracing`; they
//! never go through the loader, so they never get a sink and their events are
//! not doubled.

use kvhint_plugin_api::abi::{FfiLogRecord, FfiLogSink};
use kvhint_plugin_api::log::{level_filter_to_ffi, level_from_ffi};
use std::panic::{catch_unwind, AssertUnwindSafe};
use tracing::level_filters::LevelFilter;
use tracing::Level;

/// The target of every plugin event in the router's log.
pub const TARGET: &str = "kvhint::plugin";

/// The sink to hand a plugin. Its maximum level is the router's at this moment
/// (`KVHINT_LOG` is read once at start-up), so a plugin does not format events
/// the router would discard anyway; finer per-target filtering happens here,
/// on [`TARGET`], like for any of the router's own events.
pub fn sink() -> FfiLogSink {
    FfiLogSink {
        max_level: level_filter_to_ffi(LevelFilter::current()),
        log: log_record,
    }
}

/// Emits one plugin event in the router's log. Called by plugins across the
/// ABI, so a panic (in a subscriber layer, say) is caught here: unwinding out
/// of an `extern "C"` function would abort the router.
pub extern "C" fn log_record(record: &FfiLogRecord<'_>) {
    let _ = catch_unwind(AssertUnwindSafe(|| emit(record)));
}

fn emit(record: &FfiLogRecord<'_>) {
    let plugin = record.plugin.as_str();
    let plugin_target = record.target.as_str();
    let message = record.message.as_str();
    // `tracing` fixes a callsite's level at compile time, hence one per level.
    macro_rules! at {
        ($level:expr) => {
            tracing::event!(
                target: TARGET,
                $level,
                plugin = %plugin,
                plugin_target = %plugin_target,
                "{message}"
            )
        };
    }
    match level_from_ffi(record.level) {
        Level::ERROR => at!(Level::ERROR),
        Level::WARN => at!(Level::WARN),
        Level::INFO => at!(Level::INFO),
        Level::DEBUG => at!(Level::DEBUG),
        Level::TRACE => at!(Level::TRACE),
    }
}
