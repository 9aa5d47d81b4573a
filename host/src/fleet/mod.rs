//! The fleet: which workers the router has, and how they come and go.
//!
//! A worker joins by a registration (`POST /workers`) or by being listed in the
//! config (`workers:`, `kv_events.sources`), and leaves by a deregistration or by
//! no longer being listed after a reload. Each is one step over two pieces of
//! state that must agree: the router's worker table (`router::workers`) and the
//! worker's KV-event subscription (`engine_events`). [`Fleet`] is the one place
//! those steps are taken, under one lock, so that membership has one home: the
//! request path's view of a worker's health stays with the gateway
//! (`gateway::health`), and how a worker's advertised facts are checked stays
//! with the words every layer shares (`domain::Worker::from_registration`).

use crate::config::{ConfiguredWorker, KvEventsConfig};
use crate::domain::event_source::KvEvents;
use crate::domain::{WorkerKey, WorkerRegistration};
use crate::engine_events::{AttachError, EngineEvents};
use crate::router::{Router, RouterError};
use parking_lot::Mutex;
use std::collections::BTreeSet;
use std::sync::Arc;

pub use crate::engine_events::Origin;

/// Why a worker's registration (with its source) was refused; nothing changed.
#[derive(Debug, thiserror::Error)]
pub enum MembershipError {
    #[error(transparent)]
    Attach(#[from] AttachError),
    #[error(transparent)]
    Router(#[from] RouterError),
}

/// The router's workers and their subscriptions, changed together.
pub struct Fleet {
    router: Arc<Router>,
    events: Arc<EngineEvents>,
    /// The workers registered because the config lists them: a reload
    /// deregisters those it no longer lists, whether or not they publish KV
    /// events. Held across a worker's registration and its subscription's start
    /// (or stop), so concurrent registrations, deregistrations and reloads leave
    /// the two agreeing.
    membership: Mutex<BTreeSet<WorkerKey>>,
}

impl Fleet {
    pub fn new(router: Arc<Router>, events: Arc<EngineEvents>) -> Self {
        Self {
            router,
            events,
            membership: Mutex::new(BTreeSet::new()),
        }
    }

    /// Registers a worker and starts, keeps or stops its subscription to match its
    /// `kv_events`, as one step: a bad source refuses the registration before anything
    /// changes, and a subscription that cannot start undoes a new registration.
    /// Returns whether the worker is new.
    pub fn register(
        &self,
        registration: WorkerRegistration,
        origin: Origin,
    ) -> Result<bool, MembershipError> {
        let mut from_config = self.membership.lock();
        let key = WorkerKey {
            worker_id: registration.worker_id,
            dp_rank: registration.dp_rank,
        };
        let added = self.register_locked(registration, origin)?;
        // Registered by its own call now: a reload that stops listing it leaves
        // it, as a registered source's subscription is left.
        if origin != Origin::Config {
            from_config.remove(&key);
        }
        Ok(added)
    }

    fn register_locked(
        &self,
        registration: WorkerRegistration,
        origin: Origin,
    ) -> Result<bool, MembershipError> {
        let key = WorkerKey {
            worker_id: registration.worker_id,
            dp_rank: registration.dp_rank,
        };
        let source = registration
            .kv_events
            .as_ref()
            .and_then(|k| k.source())
            .cloned();
        if let Some(source) = &source {
            self.events.check_source(key, source, origin)?;
        }
        let added = self.router.register_worker(registration)?;
        match &source {
            Some(source) => {
                if let Err(error) = self.events.attach(key, source, origin) {
                    if added {
                        let _ = self.router.deregister_worker(key);
                    }
                    return Err(error.into());
                }
            }
            None => {
                self.events.detach(key);
            }
        }
        Ok(added)
    }

    /// Deregisters a worker and stops its subscription, as one step.
    pub fn deregister(&self, key: WorkerKey) -> Result<(), RouterError> {
        let mut from_config = self.membership.lock();
        self.router.deregister_worker(key)?;
        from_config.remove(&key);
        self.events.detach(key);
        Ok(())
    }

    /// Follows the config: its `kv_events` settings (see
    /// [`EngineEvents::apply_config`]), and the workers it lists — each listed
    /// worker registered (every rank) and subscribed, a worker no longer listed
    /// deregistered. Returns what failed, already logged.
    pub fn apply_config(
        &self,
        config: &KvEventsConfig,
        workers: &[ConfiguredWorker],
    ) -> Vec<String> {
        let mut from_config = self.membership.lock();
        self.events.apply_config(self.router.block_size(), config);
        let mut failures = Vec::new();
        let mut wanted = Vec::new();
        for listed in listed(config, workers) {
            let Listed {
                list,
                line,
                dp_size,
                registration,
            } = listed;
            for dp_rank in 0..dp_size {
                let worker = WorkerKey {
                    worker_id: registration.worker_id,
                    dp_rank,
                };
                wanted.push(worker);
                let registration = WorkerRegistration {
                    dp_rank,
                    ..registration.clone()
                };
                let result = self
                    .register_locked(registration, Origin::Config)
                    .map(|_| {
                        from_config.insert(worker);
                    })
                    .map_err(|e| e.to_string());
                if let Err(problem) = result {
                    tracing::error!(
                        worker_id = worker.worker_id,
                        dp_rank,
                        line,
                        "{list}: {problem}"
                    );
                    failures.push(format!(
                        "{list}: line {line}: worker {} rank {dp_rank}: {problem}",
                        worker.worker_id
                    ));
                }
            }
        }
        // Gone from the config: the router forgets each as a deregistration
        // would, with its subscription (a listed worker's, or a listed source's).
        let gone: Vec<WorkerKey> = from_config
            .iter()
            .copied()
            .chain(self.events.workers_from(Origin::Config))
            .filter(|worker| !wanted.contains(worker))
            .collect();
        for worker in gone {
            self.events.detach(worker);
            let _ = self.router.deregister_worker(worker);
            from_config.remove(&worker);
        }
        failures
    }
}

/// A worker the config lists, as its rank 0 would register.
struct Listed {
    /// The list it is in, as its errors name it.
    list: &'static str,
    line: usize,
    dp_size: u32,
    registration: WorkerRegistration,
}

/// The workers the config lists, in order: `kv_events.sources` (subscribed to
/// only), then `workers:` (engines the gateway forwards to, with their KV-event
/// source if they name one), each registered as a worker's registration would be.
fn listed(config: &KvEventsConfig, workers: &[ConfiguredWorker]) -> Vec<Listed> {
    let sources = config.sources.iter().map(|configured| Listed {
        list: "kv_events.sources",
        line: configured.at.line,
        dp_size: configured.dp_size,
        registration: WorkerRegistration {
            worker_id: configured.worker_id,
            dp_rank: 0,
            role: configured.role,
            runtime_data: configured.runtime_data.clone(),
            kv_events: Some(KvEvents::Source(configured.source.clone())),
            http_endpoint: None,
            engine: None,
            models: Vec::new(),
            kv_capacity_tokens: None,
            api_key: None,
        },
    });
    let workers = workers.iter().map(|configured| Listed {
        list: "workers",
        line: configured.at.line,
        dp_size: configured.dp_size,
        registration: WorkerRegistration {
            worker_id: configured.worker_id,
            dp_rank: 0,
            role: configured.role,
            runtime_data: configured.runtime_data.clone(),
            kv_events: configured.kv_events.clone(),
            http_endpoint: Some(configured.http_endpoint.clone()),
            engine: Some(configured.engine),
            models: configured.models.clone(),
            kv_capacity_tokens: configured.kv_capacity_tokens,
            api_key: configured.api_key.clone(),
        },
    });
    sources.chain(workers).collect()
}
