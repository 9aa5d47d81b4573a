//! Reload: build a complete new snapshot, validate every rule, and only then
//! swap it in. On any failure the old snapshot keeps serving, and the error is
//! logged, counted and kept for `/admin/status`.
//!
//! Reloads are serialized (one at a time) and run off the async workers: they
//! read files and dlopen libraries. Bookings never wait for them; a booking
//! loads the current snapshot once and finishes on it even if a reload swaps
//! another in meanwhile.

use crate::config::{self, ConfigErrors, RouterMode};
use crate::hints::PolicyStatsRegistry;
use crate::loader::Loader;
use crate::snapshot::{self, BuildOptions, FixedSettings, Snapshot};
use arc_swap::ArcSwap;
use parking_lot::Mutex;
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

/// What asked for a reload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Trigger {
    Startup,
    /// The plugins directory changed.
    PluginsWatch,
    /// The config file changed (`--watch-config`).
    ConfigWatch,
    Sighup,
    Admin,
}

impl Trigger {
    /// The name `/admin/status` shows, and the log uses (`trigger=sighup`).
    pub fn as_str(self) -> &'static str {
        match self {
            Trigger::Startup => "startup",
            Trigger::PluginsWatch => "plugins_watch",
            Trigger::ConfigWatch => "config_watch",
            Trigger::Sighup => "sighup",
            Trigger::Admin => "admin",
        }
    }
}

impl std::fmt::Display for Trigger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How long a reload waits for the one before it to finish. Reading the config
/// never blocks (it must be a regular file, opened with `O_NONBLOCK`), so a
/// reload takes as long as its plugin checks and loads; one that waited longer
/// than this for another fails, logged and counted, instead of queueing behind
/// it for ever.
pub const RELOAD_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

#[derive(Debug, Clone, Serialize)]
pub struct ReloadFailure {
    pub trigger: Trigger,
    pub at_unix_ms: u64,
    pub errors: Vec<String>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct ReloadStatus {
    pub ok: u64,
    pub failed: u64,
    pub last_ok_unix_ms: Option<u64>,
    pub last_ok_trigger: Option<Trigger>,
    /// The most recent failure, kept until the next successful reload.
    pub last_error: Option<ReloadFailure>,
    /// What the last successful reload could not apply to the engine subscriptions
    /// (a `kv_events.sources` entry whose worker or subscription failed); the rest of
    /// the reload stands.
    pub kv_source_errors: Vec<String>,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// What runs after a successful reload, with the config it loaded.
pub type ReloadHook = Box<dyn Fn(&config::Config) -> Vec<String> + Send + Sync>;

pub struct Reloader {
    pub config_path: PathBuf,
    pub mode: Option<RouterMode>,
    pub loader: Loader,
    pub policy_stats: PolicyStatsRegistry,
    /// Tokenizers kept from one snapshot to the next while their files stay the same.
    tokenizers: crate::models::TokenizerCache,
    generation: AtomicU64,
    /// Set by the first snapshot: what later reloads may not change.
    fixed: Mutex<Option<FixedSettings>>,
    /// Held for the whole of a reload: one at a time.
    running: Mutex<()>,
    /// How long a reload waits for `running` ([`RELOAD_WAIT`]).
    wait: std::time::Duration,
    status: Mutex<ReloadStatus>,
    /// Run with the new config after each successful reload (the engine
    /// subscriptions follow the config's `kv_events` section).
    pub on_reload: std::sync::OnceLock<ReloadHook>,
    /// The router listens beyond loopback with `auth`: a config without it is
    /// refused, so an edit cannot open the router to the network.
    auth_required: std::sync::atomic::AtomicBool,
    /// Set on shutdown: reloads not yet running are dropped.
    shutting_down: std::sync::atomic::AtomicBool,
}

impl Reloader {
    pub fn new(config_path: &Path, mode: Option<RouterMode>, loader: Loader) -> Self {
        Self {
            config_path: config_path.to_path_buf(),
            mode,
            loader,
            policy_stats: PolicyStatsRegistry::default(),
            tokenizers: crate::models::TokenizerCache::default(),
            generation: AtomicU64::new(0),
            fixed: Mutex::new(None),
            running: Mutex::new(()),
            wait: RELOAD_WAIT,
            status: Mutex::new(ReloadStatus::default()),
            on_reload: std::sync::OnceLock::new(),
            auth_required: std::sync::atomic::AtomicBool::new(false),
            shutting_down: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// From now on, refuse a config without `auth` (see `auth_required`).
    pub fn require_auth(&self) {
        self.auth_required.store(true, Ordering::Relaxed);
    }

    /// The router is shutting down: every reload from now on (a queued one
    /// included) is dropped without running. A reload in flight is ended by
    /// killing its probe ([`crate::loader::probe::abandon_all`]).
    pub fn shut_down(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
    }

    fn dropped(&self, trigger: Trigger) -> ConfigErrors {
        tracing::info!(%trigger, "reload dropped: the router is shutting down");
        ConfigErrors(vec![config::ConfigError::new(
            &self.config_path,
            None,
            "this reload was not run: the router is shutting down",
        )])
    }

    pub fn status(&self) -> ReloadStatus {
        self.status.lock().clone()
    }

    /// Builds a snapshot from the config file as it is now.
    fn build(
        &self,
        fixed: Option<&FixedSettings>,
    ) -> Result<(Snapshot, config::Config), ConfigErrors> {
        let config = config::load(&self.config_path)?;
        if config.auth.is_none() && self.auth_required.load(Ordering::Relaxed) {
            return Err(ConfigErrors(vec![config::ConfigError::new(
                &self.config_path,
                None,
                "the config no longer has `auth`, but this router listens on a non-loopback address with it: removing `auth` needs a restart (with --allow-unauthenticated, if that is really meant)",
            )]));
        }
        let snapshot = snapshot::build(
            &config,
            &BuildOptions {
                loader: &self.loader,
                mode: self.mode,
                generation: self.generation.load(Ordering::Relaxed) + 1,
                fixed,
                policy_stats: Some(&self.policy_stats),
                tokenizers: Some(&self.tokenizers),
            },
        )?;
        Ok((snapshot, config))
    }

    /// What this router keeps until it restarts (known after [`Self::initial`]).
    pub fn fixed(&self) -> Option<FixedSettings> {
        self.fixed.lock().clone()
    }

    /// The first snapshot, and the config it was built from, at start-up.
    pub fn initial(&self) -> Result<(Snapshot, config::Config), ConfigErrors> {
        let _running = self.running.lock();
        let (snapshot, config) = self.build(None)?;
        let fixed = FixedSettings::of(&config);
        self.generation
            .store(snapshot.generation, Ordering::Relaxed);
        *self.fixed.lock() = Some(fixed);
        let mut status = self.status.lock();
        status.last_ok_unix_ms = Some(now_ms());
        status.last_ok_trigger = Some(Trigger::Startup);
        Ok((snapshot, config))
    }

    /// Rebuilds and, if every rule holds, swaps the new snapshot in. Returns
    /// the generation now serving.
    pub fn reload(
        &self,
        current: &ArcSwap<Snapshot>,
        trigger: Trigger,
    ) -> Result<u64, ConfigErrors> {
        if self.shutting_down.load(Ordering::SeqCst) {
            return Err(self.dropped(trigger));
        }
        let Some(_running) = self.running.try_lock_for(self.wait) else {
            let errors = ConfigErrors(vec![config::ConfigError::new(
                &self.config_path,
                None,
                format!(
                    "this reload was not run: the one before it has been running for over {} s; the previous snapshot keeps serving; see the log for what that reload is loading, and reload again once it ends",
                    self.wait.as_secs_f64()
                ),
            )]);
            return Err(self.failed(trigger, errors));
        };
        // Queued behind one that was running when shutdown began: dropped.
        if self.shutting_down.load(Ordering::SeqCst) {
            return Err(self.dropped(trigger));
        }
        let fixed = self.fixed();
        match self.build(fixed.as_ref()) {
            Ok((snapshot, config)) => {
                let generation = snapshot.generation;
                self.generation.store(generation, Ordering::Relaxed);
                current.store(Arc::new(snapshot));
                let kv_source_errors = match self.on_reload.get() {
                    Some(hook) => hook(&config),
                    None => Vec::new(),
                };
                let mut status = self.status.lock();
                status.ok += 1;
                status.last_ok_unix_ms = Some(now_ms());
                status.last_ok_trigger = Some(trigger);
                status.last_error = None;
                status.kv_source_errors = kv_source_errors;
                tracing::info!(generation, %trigger, "reloaded");
                Ok(generation)
            }
            // A reload whose probe the shutdown killed is abandoned, not failed.
            Err(_) if self.shutting_down.load(Ordering::SeqCst) => Err(self.dropped(trigger)),
            Err(errors) => Err(self.failed(trigger, errors)),
        }
    }

    /// Logs, counts and keeps a failed reload's errors (in file order).
    fn failed(&self, trigger: Trigger, mut errors: ConfigErrors) -> ConfigErrors {
        errors.sort_in_file_order();
        for error in &errors.0 {
            tracing::error!(%trigger, %error, "reload failed; the previous snapshot keeps serving");
        }
        let mut status = self.status.lock();
        status.failed += 1;
        status.last_error = Some(ReloadFailure {
            trigger,
            at_unix_ms: now_ms(),
            errors: errors.0.iter().map(|e| e.to_string()).collect(),
        });
        errors
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reload_waits_for_the_one_before_it_only_so_long() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let file = dir.path().join("kvhint.yaml");
        std::fs::write(&file, "worker_selection:\n  decode: kvcr\n").expect("the config");
        let loader = Loader::new(&crate::loader::LoaderOptions {
            cache_dir: dir.path().join("cache"),
            max_libraries: 4,
            ..crate::loader::LoaderOptions::default()
        })
        .expect("a loader");
        let mut reloader = Reloader::new(&file, None, loader);
        let (snapshot, _) = reloader.initial().expect("the first snapshot");
        let current = ArcSwap::from_pointee(snapshot);
        reloader.wait = std::time::Duration::from_millis(50);
        // A reload that never ends holds the lock.
        let held = reloader.running.lock();
        let errors = reloader
            .reload(&current, Trigger::Admin)
            .expect_err("refused while another runs");
        drop(held);
        assert!(
            errors.0[0].message.contains("this reload was not run"),
            "{errors}"
        );
        let status = reloader.status();
        assert_eq!(status.failed, 1);
        assert_eq!(status.last_error.map(|e| e.trigger), Some(Trigger::Admin));
        // Once it ends, reloads run again.
        assert_eq!(reloader.reload(&current, Trigger::Admin).ok(), Some(2));
    }

    #[test]
    fn the_log_and_the_status_name_a_trigger_alike() {
        for trigger in [
            Trigger::Startup,
            Trigger::PluginsWatch,
            Trigger::ConfigWatch,
            Trigger::Sighup,
            Trigger::Admin,
        ] {
            assert_eq!(
                serde_json::to_value(trigger).ok(),
                Some(serde_json::Value::from(trigger.to_string()))
            );
        }
    }
}
