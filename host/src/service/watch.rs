//! Reload triggers from the file system: the plugins directory (always, when
//! the config names one) and, with `--watch-config`, the config file.
//!
//! Events are debounced, so a copy that lands in several writes reloads once.
//! Only names the loader would pick up count — the drop-in protocol writes a
//! dotfile or `*.tmp` first and renames it, so the half-written file never
//! triggers anything; the rename does. Access events are ignored: a reload
//! reads every plugin file, and counting those reads would make each reload
//! trigger the next.

use super::reload::Trigger;
use super::App;
use crate::loader::is_plugin_file_name;
use notify::{EventKind, RecursiveMode};
use notify_debouncer_full::{new_debouncer, DebounceEventResult, Debouncer, RecommendedCache};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// How long the file system must be quiet before a reload.
pub const DEBOUNCE: Duration = Duration::from_millis(100);

/// Keeps the watches alive; dropping it stops them.
pub struct Watches {
    _debouncer: Debouncer<notify::RecommendedWatcher, RecommendedCache>,
}

/// Starts watching `plugins_dir` (if any) and the config file (if asked).
pub fn start(
    app: Arc<App>,
    plugins_dir: Option<PathBuf>,
    config_file: Option<PathBuf>,
) -> notify::Result<Option<Watches>> {
    if plugins_dir.is_none() && config_file.is_none() {
        return Ok(None);
    }
    let plugins = plugins_dir.clone();
    let config = config_file.clone();
    let mut debouncer = new_debouncer(DEBOUNCE, None, move |result: DebounceEventResult| {
        let events = match result {
            Ok(events) => events,
            Err(errors) => {
                for e in errors {
                    tracing::warn!(error = %e, "file watch error");
                }
                return;
            }
        };
        let changed = |dir: Option<&Path>, wanted: &dyn Fn(&Path) -> bool| {
            events.iter().any(|event| {
                !matches!(event.kind, EventKind::Access(_))
                    && event.paths.iter().any(|path| {
                        dir.is_some_and(|dir| path.parent() == Some(dir)) && wanted(path)
                    })
            })
        };
        let plugins_changed = changed(plugins.as_deref(), &|path| is_plugin_file_name(path));
        let config_changed = changed(config.as_deref().and_then(Path::parent), &|path| {
            config.as_deref().and_then(Path::file_name) == path.file_name()
        });
        let trigger = if plugins_changed {
            Trigger::PluginsWatch
        } else if config_changed {
            Trigger::ConfigWatch
        } else {
            return;
        };
        // The outcome is logged and kept in the reload status either way.
        let _ = app.reloader.reload(&app.snapshot, trigger);
    })?;
    if let Some(dir) = &plugins_dir {
        debouncer.watch(dir, RecursiveMode::NonRecursive)?;
    }
    if let Some(dir) = config_file.as_deref().and_then(Path::parent) {
        debouncer.watch(dir, RecursiveMode::NonRecursive)?;
    }
    Ok(Some(Watches {
        _debouncer: debouncer,
    }))
}
