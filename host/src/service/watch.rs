//! Reload triggers from the file system: the plugins directory (always, when
//! the config names one) and, with `--watch-config`, the config file.
//!
//! Events are debounced, so a copy that lands in several writes reloads once.
//! Only names the loader would pick up count — the drop-in protocol writes a
//! dotfile or `*.tmp` first and renames it, so the half-written file never
//! triggers anything; the rename does. Access events are ignored: a reload
//! reads every plugin file, and counting those reads would make each reload
//! trigger the next.
//!
//! **A recreated plugins directory.** An inotify watch belongs to a directory,
//! not to its name: when the directory is deleted (or renamed away) the watch
//! ends with it, and a new directory under the same name would never be
//! watched. So the directory's parent is watched too, and a keeper thread
//! re-arms the watch whenever the name points at another directory: promptly
//! on the parent's events, and on a poll every [`POLL`] as a fallback (the
//! parent itself may be replaced). While the directory is missing the keeper
//! logs a warning (again every [`MISSING_REMINDER`]) and the current snapshot
//! keeps serving; once the directory is back it re-arms the watch first and
//! then reloads, so a plugin dropped in before the watch was re-armed is picked
//! up by that reload.

use super::reload::Trigger;
use super::App;
use crate::loader::is_plugin_file_name;
use crossbeam_channel::{Receiver, Sender};
use notify::event::ModifyKind;
use notify::{EventKind, RecursiveMode};
use notify_debouncer_full::{new_debouncer, DebounceEventResult, Debouncer, RecommendedCache};
use parking_lot::Mutex;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long the file system must be quiet before a reload.
pub const DEBOUNCE: Duration = Duration::from_millis(100);

/// How often the keeper checks, without an event, that the watched plugins
/// directory is still the one the name points at.
pub const POLL: Duration = Duration::from_secs(1);

/// How often the keeper repeats its warning while the directory is missing.
pub const MISSING_REMINDER: Duration = Duration::from_secs(60);

type FileDebouncer = Debouncer<notify::RecommendedWatcher, RecommendedCache>;

/// Keeps the watches alive; dropping it stops them (and the keeper thread).
pub struct Watches {
    _debouncer: Arc<Mutex<FileDebouncer>>,
    _keeper: Option<Sender<()>>,
}

/// Which directory a path names now: device and inode, or `None` if it names
/// no directory.
fn identity(dir: &Path) -> Option<(u64, u64)> {
    std::fs::metadata(dir)
        .ok()
        .filter(std::fs::Metadata::is_dir)
        .map(|m| (m.dev(), m.ino()))
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
    let (nudge, nudged) = crossbeam_channel::bounded::<()>(1);
    let plugins = plugins_dir.clone();
    let config = config_file.clone();
    let callback_app = Arc::clone(&app);
    let debouncer = new_debouncer(DEBOUNCE, None, move |result: DebounceEventResult| {
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
        // The plugins directory itself was created, removed or renamed (seen
        // from its parent, or its own watch ending): the keeper re-arms.
        let directory_changed = plugins.as_deref().is_some_and(|dir| {
            events.iter().any(|event| {
                matches!(
                    event.kind,
                    EventKind::Create(_)
                        | EventKind::Remove(_)
                        | EventKind::Modify(ModifyKind::Name(_))
                ) && event.paths.iter().any(|path| path == dir)
            })
        });
        if directory_changed {
            // A full channel already holds a nudge the keeper has yet to see.
            let _ = nudge.try_send(());
        }
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
        let _ = callback_app
            .reloader
            .reload(&callback_app.snapshot, trigger);
    })?;
    let debouncer = Arc::new(Mutex::new(debouncer));
    let config_dir = config_file.as_deref().and_then(Path::parent);
    if let Some(dir) = config_dir {
        debouncer.lock().watch(dir, RecursiveMode::NonRecursive)?;
    }
    if let Some(dir) = &plugins_dir {
        debouncer.lock().watch(dir, RecursiveMode::NonRecursive)?;
        // The parent only speeds up noticing a recreated directory (the keeper
        // polls anyway), so a parent that cannot be watched is no failure.
        if let Some(parent) = dir.parent().filter(|p| Some(*p) != config_dir) {
            if let Err(e) = debouncer.lock().watch(parent, RecursiveMode::NonRecursive) {
                tracing::warn!(
                    directory = %parent.display(),
                    error = %e,
                    "cannot watch the plugins directory's parent; a recreated plugins directory is noticed by polling, within {} s",
                    POLL.as_secs()
                );
            }
        }
    }
    let keeper = match plugins_dir {
        Some(dir) => {
            let (stop, stopped) = crossbeam_channel::bounded::<()>(0);
            let keeper_debouncer = Arc::clone(&debouncer);
            std::thread::Builder::new()
                .name("kvhint-watch-keeper".into())
                .spawn(move || keep(app, keeper_debouncer, dir, nudged, stopped))
                .map_err(notify::Error::io)?;
            Some(stop)
        }
        None => None,
    };
    Ok(Some(Watches {
        _debouncer: debouncer,
        _keeper: keeper,
    }))
}

/// Re-arms the plugins directory's watch whenever its name points at another
/// directory, logs while it is missing, and reloads when it comes back. Ends
/// when [`Watches`] is dropped (its `stop` sender with it).
fn keep(
    app: Arc<App>,
    debouncer: Arc<Mutex<FileDebouncer>>,
    dir: PathBuf,
    nudged: Receiver<()>,
    stopped: Receiver<()>,
) {
    let mut armed = identity(&dir);
    let mut warned_at: Option<Instant> = None;
    loop {
        let nudge = crossbeam_channel::select! {
            recv(stopped) -> _ => return,
            recv(nudged) -> message => {
                if message.is_err() {
                    return;
                }
                true
            }
            default(POLL) => false,
        };
        let now = identity(&dir);
        if now.is_none() {
            if warned_at.is_none_or(|at| at.elapsed() >= MISSING_REMINDER) {
                tracing::warn!(
                    directory = %dir.display(),
                    "the plugins directory is missing; the current plugins keep serving, and the router reloads when the directory is back"
                );
                warned_at = Some(Instant::now());
            }
            if armed.take().is_some() {
                // The old watch ended with its directory; forget it.
                let _ = debouncer.lock().unwatch(&dir);
            }
            continue;
        }
        // A nudge re-arms even when the identity looks unchanged: a directory
        // deleted and made again between two looks can get its inode number
        // back, and the old watch is gone all the same.
        if now == armed && !nudge {
            continue;
        }
        // Nudges already queued are answered by this re-arm and reload.
        while nudged.try_recv().is_ok() {}
        let mut watcher = debouncer.lock();
        let _ = watcher.unwatch(&dir);
        let result = watcher.watch(&dir, RecursiveMode::NonRecursive);
        drop(watcher);
        match result {
            Ok(()) => {
                if warned_at.take().is_some() || now != armed {
                    tracing::info!(
                        directory = %dir.display(),
                        "the plugins directory is back; watching it again"
                    );
                }
                armed = now;
                // Re-armed first, then reloaded: whatever was dropped in before
                // the watch existed is read now. Logged and kept in the status.
                let _ = app.reloader.reload(&app.snapshot, Trigger::PluginsWatch);
            }
            Err(e) => {
                tracing::warn!(
                    directory = %dir.display(),
                    error = %e,
                    "cannot watch the plugins directory; trying again"
                );
                armed = None;
            }
        }
    }
}
