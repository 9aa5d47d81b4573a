//! The router around the hint stage: workers, the KV index, load, and bookings.
//!
//! A booking's data path: the request's block hashes → each candidate's cached
//! prefix from the KV index → the role's selection policy picks a worker (and,
//! under `kvcr`, may commit a peer's copy) → the load is reserved → only then,
//! and only for a worker that advertises `router_hint`, the role's hint
//! policies run on a read-only context → one engine-format message.
//!
//! State that outlives a reload (workers, index, load) lives here; what a reload
//! replaces (config, plugins, constructed policies) is the [`Snapshot`] a
//! booking is handed, so a booking runs wholly on the snapshot it started with.

pub mod kv_index;
pub mod selection;
pub mod workers;

use crate::config::Role;
use crate::hints::{HintOutcome, PolicyFailure};
use crate::snapshot::Snapshot;
use abi_stable::std_types::{ROption, RSlice, RStr};
use kv_index::{block_hashes, KvEvent, KvIndex, Overlaps, WorkerKey};
use kvhint_plugin_api::abi::{FfiHintContext, FfiKvCopy, FfiPeer, FfiWorker};
use selection::{Candidate, SelectionInput};
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use workers::{Load, Worker, WorkerRegistration};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouterError {
    #[error("unknown worker {worker_id} rank {dp_rank}: register it first")]
    UnknownWorker { worker_id: u64, dp_rank: u32 },
    #[error("{0}")]
    RuntimeData(#[from] workers::RuntimeDataError),
    #[error("KV event for worker {worker_id} rank {dp_rank} ignored: {message}")]
    KvEvent {
        worker_id: u64,
        dp_rank: u32,
        message: String,
    },
    #[error("unknown request {0:?}: it was never booked or is already released")]
    UnknownRequest(String),
    #[error("request {0:?} is already booked; release it first or use a new request id")]
    DuplicateRequest(String),
    #[error("no worker_selection entry for role {0}; add `worker_selection.{0}` to the config")]
    RoleNotConfigured(Role),
    #[error("no registered {0} workers to book on")]
    NoWorkers(Role),
    #[error("the request has no token ids")]
    EmptyPrompt,
    #[error("the prompt has {tokens} tokens; this router accepts at most {max} (router.max_prompt_tokens)")]
    PromptTooLong { tokens: usize, max: usize },
}

/// A KV copy a booking was committed to: request blocks `first_block..last_block`
/// from `source`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct CommittedCopy {
    pub source: WorkerKey,
    pub first_block: usize,
    pub last_block: usize,
}

/// Why a booking carries no hint message although it may have had one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HintSkip {
    /// The role is not on the KV path: `--router-mode` is not `kv`, or its
    /// selection policy is not KV-aware (rule R4).
    NotKvPath,
    /// The role resolves to no hint policies.
    NoPolicies,
    /// The booked worker does not advertise `router_hint` (rule R6).
    WorkerNotHintCapable,
    /// The policies ran and returned no action.
    NoActions,
    /// The message was not valid JSON, so it was not sent. Only a plugin that
    /// implements the raw ABI trait by hand, bypassing the plugin-api adapter,
    /// can cause this.
    MalformedMessage,
}

/// A request to book.
#[derive(Debug, Clone, Copy)]
pub struct BookRequest<'a> {
    pub request_id: &'a str,
    pub role: Role,
    pub token_ids: &'a [u32],
    /// The session context as JSON object text, if any.
    pub session_context: Option<&'a str>,
}

/// The result of a booking.
#[derive(Debug, Clone, PartialEq)]
pub struct Booking {
    pub request_id: String,
    pub role: Role,
    pub worker: WorkerKey,
    /// Leading request blocks the booked worker already holds.
    pub cached_blocks: usize,
    pub request_blocks: usize,
    pub committed_copy: Option<CommittedCopy>,
    /// The engine-format hint message (rule R10), if any.
    pub hint: Option<String>,
    pub hint_skipped: Option<HintSkip>,
    pub action_types: Vec<String>,
    pub dropped_actions: usize,
    pub policy_failures: Vec<PolicyFailure>,
}

struct WorkerEntry {
    worker: Arc<Worker>,
    load: Load,
}

struct Reservation {
    worker: WorkerKey,
    load: Load,
}

struct State {
    workers: BTreeMap<WorkerKey, WorkerEntry>,
    index: KvIndex,
    reservations: HashMap<String, Reservation>,
}

/// Buffers a booking reuses on its thread, so the hot path does not allocate
/// them per call.
#[derive(Default)]
struct Scratch {
    hashes: Vec<u64>,
    overlaps: Overlaps,
    candidates: Vec<Candidate>,
    peer_workers: Vec<(Arc<Worker>, usize)>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Above this, a thread's scratch is dropped after the booking.
const SCRATCH_KEEP_BYTES: usize = 16 << 20;

/// The router's live state.
pub struct Router {
    state: Mutex<State>,
    block_size: usize,
}

impl Router {
    pub fn new(block_size: usize) -> Self {
        Self {
            state: Mutex::new(State {
                workers: BTreeMap::new(),
                index: KvIndex::new(block_size),
                reservations: HashMap::new(),
            }),
            block_size,
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the state half-updated in
        // a way later calls care about (every update is one insert or remove),
        // so a poisoned lock is taken over rather than failing every request.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers (or re-registers, keeping its load and cache) a worker.
    pub fn register_worker(&self, registration: WorkerRegistration) -> Result<bool, RouterError> {
        let worker = Arc::new(Worker::from_registration(registration)?);
        let mut state = self.lock();
        match state.workers.get_mut(&worker.key) {
            Some(entry) => {
                entry.worker = worker;
                Ok(false)
            }
            None => {
                state.workers.insert(
                    worker.key,
                    WorkerEntry {
                        worker,
                        load: Load::default(),
                    },
                );
                Ok(true)
            }
        }
    }

    /// Removes a worker, its cached blocks, and its open bookings' load.
    pub fn deregister_worker(&self, key: WorkerKey) -> Result<(), RouterError> {
        let mut state = self.lock();
        if state.workers.remove(&key).is_none() {
            return Err(RouterError::UnknownWorker {
                worker_id: key.worker_id,
                dp_rank: key.dp_rank,
            });
        }
        state.index.remove_worker(key);
        state.reservations.retain(|_, r| r.worker != key);
        Ok(())
    }

    pub fn apply_kv_event(
        &self,
        key: WorkerKey,
        event: &KvEvent,
    ) -> Result<kv_index::ApplyStats, RouterError> {
        let mut state = self.lock();
        if !state.workers.contains_key(&key) {
            return Err(RouterError::UnknownWorker {
                worker_id: key.worker_id,
                dp_rank: key.dp_rank,
            });
        }
        state
            .index
            .apply(key, event)
            .map_err(|e| RouterError::KvEvent {
                worker_id: key.worker_id,
                dp_rank: key.dp_rank,
                message: e.to_string(),
            })
    }

    /// A committed copy whose fetch did not go out (its sender failed or was
    /// quarantined) will not happen: the booked worker prefills those blocks
    /// itself, so its reservation grows by them and the booking stops
    /// claiming the copy.
    fn withdraw_copy(&self, booking: &mut Booking) {
        let Some(copy) = booking.committed_copy.take() else {
            return;
        };
        let blocks = copy.last_block.saturating_sub(copy.first_block) as u64;
        tracing::warn!(request = %booking.request_id, source = %copy.source, blocks, "committed KV copy not sent; the booked worker prefills it");
        let mut state = self.lock();
        let State {
            workers,
            reservations,
            ..
        } = &mut *state;
        if let Some(reservation) = reservations.get_mut(&booking.request_id) {
            reservation.load.prefill_blocks += blocks;
            if let Some(entry) = workers.get_mut(&reservation.worker) {
                entry.load.prefill_blocks += blocks;
            }
        }
    }

    /// Frees the load a booking reserved.
    pub fn release(&self, request_id: &str) -> Result<WorkerKey, RouterError> {
        let mut state = self.lock();
        let reservation = state
            .reservations
            .remove(request_id)
            .ok_or_else(|| RouterError::UnknownRequest(request_id.to_string()))?;
        if let Some(entry) = state.workers.get_mut(&reservation.worker) {
            entry.load.active_requests -= reservation.load.active_requests;
            entry.load.active_blocks -= reservation.load.active_blocks;
            entry.load.prefill_blocks -= reservation.load.prefill_blocks;
        }
        Ok(reservation.worker)
    }

    /// Every worker with its load, by key.
    pub fn workers(&self) -> Vec<(Arc<Worker>, Load)> {
        self.lock()
            .workers
            .values()
            .map(|e| (Arc::clone(&e.worker), e.load))
            .collect()
    }

    /// Cached blocks in the index, for metrics.
    pub fn index_len(&self) -> usize {
        self.lock().index.len()
    }

    pub fn open_bookings(&self) -> usize {
        self.lock().reservations.len()
    }

    /// Books a request on `snapshot`'s policies.
    pub fn book(
        &self,
        snapshot: &Snapshot,
        request: &BookRequest<'_>,
    ) -> Result<Booking, RouterError> {
        let role = snapshot
            .role(request.role)
            .ok_or(RouterError::RoleNotConfigured(request.role))?;
        if request.token_ids.is_empty() {
            return Err(RouterError::EmptyPrompt);
        }
        if request.token_ids.len() > snapshot.max_prompt_tokens {
            return Err(RouterError::PromptTooLong {
                tokens: request.token_ids.len(),
                max: snapshot.max_prompt_tokens,
            });
        }
        SCRATCH.with(|scratch| {
            let mut scratch = scratch.borrow_mut();
            let booking = self.book_with(snapshot, role, request, &mut scratch);
            // The buffers only grow; one very long prompt must not leave a
            // thread holding a large lookup matrix for good.
            if scratch.overlaps.retained_bytes() > SCRATCH_KEEP_BYTES {
                *scratch = Scratch::default();
            }
            booking
        })
    }

    fn book_with(
        &self,
        snapshot: &Snapshot,
        role: &crate::snapshot::RoleRuntime,
        request: &BookRequest<'_>,
        scratch: &mut Scratch,
    ) -> Result<Booking, RouterError> {
        block_hashes(request.token_ids, self.block_size, &mut scratch.hashes);
        let request_blocks = scratch.hashes.len();
        let kv = role.on_kv_path;
        let policy = role.booking_selection();

        let (booked, cached_blocks, committed_copy) = {
            let mut state = self.lock();
            if state.reservations.contains_key(request.request_id) {
                return Err(RouterError::DuplicateRequest(
                    request.request_id.to_string(),
                ));
            }
            if kv {
                state.index.overlaps(&scratch.hashes, &mut scratch.overlaps);
            } else {
                state.index.overlaps(&[], &mut scratch.overlaps);
            }
            scratch.candidates.clear();
            for entry in state
                .workers
                .values()
                .filter(|e| e.worker.role == request.role)
            {
                let worker = &entry.worker;
                let cached_blocks = scratch.overlaps.cached_blocks(worker.key);
                let peer_copy = if policy.wants_peer_copies() && worker.router_hint {
                    best_peer(&state.workers, &scratch.overlaps, worker, cached_blocks)
                } else {
                    None
                };
                scratch.candidates.push(Candidate {
                    key: worker.key,
                    cached_blocks,
                    active_blocks: entry.load.active_blocks,
                    prefill_blocks: entry.load.prefill_blocks,
                    peer_copy,
                });
            }
            let selected = policy
                .select(&SelectionInput {
                    request_blocks,
                    candidates: &scratch.candidates,
                })
                .filter(|s| s.index < scratch.candidates.len())
                .ok_or(RouterError::NoWorkers(request.role))?;
            let chosen = scratch.candidates[selected.index];
            let booked = state
                .workers
                .get(&chosen.key)
                .map(|entry| Arc::clone(&entry.worker))
                .ok_or(RouterError::NoWorkers(request.role))?;
            // A copy is only ever committed to a worker that can receive
            // the hint carrying it (rule R6).
            let committed_copy = selected.committed_copy_from.and_then(|source| {
                let last_block = scratch.overlaps.cached_blocks(source);
                (booked.router_hint && last_block > chosen.cached_blocks).then_some(CommittedCopy {
                    source,
                    first_block: chosen.cached_blocks,
                    last_block,
                })
            });
            // Reserve: the prompt's blocks as decode load, the uncached
            // part (less any committed copy) as prefill work.
            let prefill_start = committed_copy
                .map(|c| c.last_block)
                .unwrap_or(chosen.cached_blocks);
            let load = Load {
                active_requests: 1,
                active_blocks: request.token_ids.len().div_ceil(self.block_size) as u64,
                prefill_blocks: request_blocks.saturating_sub(prefill_start) as u64,
            };
            if let Some(entry) = state.workers.get_mut(&chosen.key) {
                entry.load.active_requests += load.active_requests;
                entry.load.active_blocks += load.active_blocks;
                entry.load.prefill_blocks += load.prefill_blocks;
            }
            state.reservations.insert(
                request.request_id.to_string(),
                Reservation {
                    worker: chosen.key,
                    load,
                },
            );
            // Peers for the hint context, copied out so the hint stage runs
            // without the lock.
            scratch.peer_workers.clear();
            if kv {
                for (i, (key, _)) in scratch.overlaps.iter().enumerate() {
                    if key != chosen.key {
                        if let Some(entry) = state.workers.get(&key) {
                            scratch.peer_workers.push((Arc::clone(&entry.worker), i));
                        }
                    }
                }
            }
            (booked, chosen.cached_blocks, committed_copy)
        };

        let mut booking = Booking {
            request_id: request.request_id.to_string(),
            role: request.role,
            worker: booked.key,
            cached_blocks,
            request_blocks,
            committed_copy,
            hint: None,
            hint_skipped: None,
            action_types: Vec::new(),
            dropped_actions: 0,
            policy_failures: Vec::new(),
        };
        if !kv {
            booking.hint_skipped = Some(HintSkip::NotKvPath);
        } else if role.hints.is_empty() {
            booking.hint_skipped = Some(HintSkip::NoPolicies);
        } else if !booked.router_hint {
            booking.hint_skipped = Some(HintSkip::WorkerNotHintCapable);
        } else {
            let outcome = run_hints(
                role,
                &booked,
                &booking,
                scratch,
                request,
                snapshot.selection_type(request.role),
                self.block_size,
            );
            booking.hint_skipped = outcome.message.is_none().then_some(HintSkip::NoActions);
            booking.hint = outcome.message;
            booking.action_types = outcome.action_types;
            booking.dropped_actions = outcome.dropped_over_cap;
            booking.policy_failures = outcome.failures;
            if !outcome.kv_copy_sent {
                self.withdraw_copy(&mut booking);
            }
        }
        Ok(booking)
    }
}

/// The eligible peer (same worker type, hint-capable, with a source endpoint)
/// holding the longest prefix beyond `worker`'s own. `overlaps` is sorted
/// longest first, then by key, so the first eligible one wins ties by key.
fn best_peer(
    workers: &BTreeMap<WorkerKey, WorkerEntry>,
    overlaps: &Overlaps,
    worker: &Worker,
    cached_blocks: usize,
) -> Option<(WorkerKey, usize)> {
    overlaps
        .iter()
        .take_while(|(_, hashes)| hashes.len() > cached_blocks)
        .find(|(key, _)| {
            *key != worker.key
                && workers.get(key).is_some_and(|peer| {
                    peer.worker.router_hint
                        && peer.worker.worker_type == worker.worker_type
                        && !peer.worker.source_control_endpoint.is_empty()
                })
        })
        .map(|(key, hashes)| (key, hashes.len()))
}

fn ffi_worker(worker: &Worker) -> FfiWorker<'_> {
    FfiWorker {
        worker_id: worker.key.worker_id,
        dp_rank: worker.key.dp_rank,
        router_hint: worker.router_hint,
        worker_type: RStr::from_str(&worker.worker_type),
        source_control_endpoint: RStr::from_str(&worker.source_control_endpoint),
    }
}

/// Builds the borrowed context and runs the role's hint policies.
fn run_hints(
    role: &crate::snapshot::RoleRuntime,
    booked: &Worker,
    booking: &Booking,
    scratch: &Scratch,
    request: &BookRequest<'_>,
    selection_type: &str,
    block_size: usize,
) -> HintOutcome {
    // `peer_workers` holds overlap positions in increasing order: one merge pass.
    let mut pending = scratch.peer_workers.iter().peekable();
    let mut peers: Vec<FfiPeer<'_>> = Vec::with_capacity(scratch.peer_workers.len());
    for (i, (_, hashes)) in scratch.overlaps.iter().enumerate() {
        if let Some((worker, _)) = pending.next_if(|(_, at)| *at == i) {
            peers.push(FfiPeer {
                worker: ffi_worker(worker),
                cached_blocks: hashes.len() as u64,
                block_hashes: RSlice::from_slice(hashes),
            });
        }
    }
    let committed = booking.committed_copy.and_then(|copy| {
        let (source, _) = scratch
            .peer_workers
            .iter()
            .find(|(worker, _)| worker.key == copy.source)?;
        let hashes = scratch.overlaps.engine_hashes(copy.source);
        Some(FfiKvCopy {
            source: ffi_worker(source),
            first_block: copy.first_block as u64,
            block_hashes: RSlice::from_slice(hashes.get(..copy.last_block)?),
        })
    });
    let context = FfiHintContext {
        request_id: RStr::from_str(request.request_id),
        worker: ffi_worker(booked),
        cached_blocks: booking.cached_blocks as u64,
        prompt_tokens: request.token_ids.len() as u64,
        block_size: block_size as u32,
        session_context: RStr::from_str(request.session_context.unwrap_or("")),
        selection_policy: RStr::from_str(selection_type),
        block_hashes: RSlice::from_slice(&scratch.hashes),
        peers: RSlice::from_slice(&peers),
        committed_kv_copy: match committed {
            Some(copy) => ROption::RSome(copy),
            None => ROption::RNone,
        },
    };
    role.hints.run(&context)
}
