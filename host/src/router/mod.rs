//! The router around the hint stage: workers, the KV index, load, and bookings.
//!
//! A booking, top to bottom ([`Router::book`]):
//! 1. **hash** the prompt into the router's block hashes;
//! 2. **select and reserve** ([`Router::select_and_reserve`]): each candidate's cached
//!    prefix from the KV index, the role's selection policy (a plugin, called across the
//!    ABI, with the built-in default as its fallback) picks a worker and may commit a
//!    peer's copy, and the load is reserved — the result is a [`Plan`];
//! 3. **hint stage** ([`Router::hint`]): only on the KV path and only for a worker that
//!    advertises `router_hint`, the role's hint policies run on a read-only context,
//!    reading peers' engine hashes from the index only when they ask, and yield one
//!    message (written by the router's own writer, valid by construction) or the reason
//!    there is none; a committed copy whose fetch did not go out is withdrawn and its
//!    blocks reserved as prefill;
//! 4. the [`Booking`].
//!
//! Nothing here holds a lock across an index walk: the index is read without one
//! ([`index::shared`]), the worker table is an atomically swapped value, load is
//! atomics per worker, and open bookings are sharded maps locked for one insert.
//!
//! State that outlives a reload (workers, index, load) lives here; what a reload
//! replaces (config, plugins, constructed policies) is the snapshot, whose role a
//! booking is handed, so a booking runs wholly on the policies it started with.

pub(crate) mod background;
pub mod bookings;
pub mod hooks;
pub mod index;
pub(crate) mod ingest;
mod open_count;
pub mod persistent;
pub mod pool;
mod select;
pub mod workers;

pub use crate::hints::PolicyFailure;
pub use crate::hints::{Hint, HintSkip};

use crate::domain::{Role, Worker, WorkerKey};
use crate::hints::{BookedRequest, CommittedCopyView, PeerHashSource, PeerRows, PeerView};
use crate::selection::{SelectionRequest, SpareCandidates};
use crate::snapshot::{RoleRuntime, Snapshot};
use arc_swap::ArcSwap;
use bookings::{Bookings, Reservation};
use index::shared::SharedIndex;
use index::{identity_seed, seeded_block_hashes, KvEvent, Matches};
use select::Ranked;
use std::cell::RefCell;
use std::sync::Arc;
use workers::{Load, LoadCell, WorkerEntry, WorkerRegistration, WorkerTable};

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
        /// The event chained onto a block the worker does not hold: its events
        /// were lost, which an engine subscription recovers from.
        unknown_parent: bool,
    },
    #[error("unknown request {0:?}: it was never booked, is already released, or expired (router.booking_ttl)")]
    UnknownRequest(String),
    #[error("request {0:?} is already booked; release it first or use a new request id")]
    DuplicateRequest(String),
    #[error("no worker_selection entry for role {0}; add `worker_selection.{0}` to the config")]
    RoleNotConfigured(Role),
    #[error("no registered {0} workers to book on")]
    NoWorkers(Role),
    #[error("no {0} worker can take this request now: none serves its model, or every one that does is unhealthy, has its circuit open or was tried already")]
    NoEligibleWorkers(Role),
    #[error("the request has no token ids")]
    EmptyPrompt,
    #[error("the prompt has {tokens} tokens; this router accepts at most {max} (router.max_prompt_tokens): shorten the prompt, or raise router.max_prompt_tokens")]
    PromptTooLong { tokens: usize, max: usize },
    #[error("the request id is {bytes} bytes; this router accepts at most {max} (router.max_request_id_bytes): use a shorter id, such as a UUID")]
    RequestIdTooLong { bytes: usize, max: usize },
    #[error("{open} bookings are open, the most this router holds (router.max_open_bookings): release finished requests, or raise the limit")]
    TooManyOpenBookings { open: usize },
}

impl RouterError {
    /// The index's refusal of an event, for its worker (each refusal names it).
    fn from_event(refused: index::KvEventError) -> Self {
        match &refused {
            index::KvEventError::UnknownWorker { worker } => Self::UnknownWorker {
                worker_id: worker.worker_id,
                dp_rank: worker.dp_rank,
            },
            index::KvEventError::WrongBlockSize { worker, .. }
            | index::KvEventError::UnknownParent { worker, .. } => Self::KvEvent {
                worker_id: worker.worker_id,
                dp_rank: worker.dp_rank,
                unknown_parent: matches!(refused, index::KvEventError::UnknownParent { .. }),
                message: refused.to_string(),
            },
        }
    }
}

/// The role `request` asks for in `snapshot`, or why it cannot be booked.
pub fn configured_role(snapshot: &Snapshot, role: Role) -> Result<&RoleRuntime, RouterError> {
    snapshot
        .role(role)
        .ok_or(RouterError::RoleNotConfigured(role))
}

/// A KV copy a booking was committed to: request blocks `first_block..last_block`
/// from `source`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct CommittedCopy {
    pub source: WorkerKey,
    pub first_block: usize,
    pub last_block: usize,
}

/// A request to book.
#[derive(Debug, Clone, Copy)]
pub struct BookRequest<'a> {
    pub request_id: &'a str,
    pub role: Role,
    pub token_ids: &'a [u32],
    /// The session context as JSON object text, if any.
    pub session_context: Option<&'a str>,
    /// The LoRA adapter and cache salt: they seed the request's block hashes, so
    /// a prompt matches only blocks an engine stored under the same identity.
    pub lora_name: Option<&'a str>,
    pub cache_salt: Option<&'a str>,
    /// For each worker running requests that share this prompt's leading blocks,
    /// how many of them those requests pin (the gateway's in-flight credits):
    /// blocks an engine cannot drop while they run. Empty outside the gateway.
    pub pinned_prefix: &'a [(WorkerKey, u32)],
    /// The worker this request's KV comes from: the prefill worker of a
    /// disaggregated pair, booked first. The booked worker computes none of the
    /// prompt (no prefill load is reserved for it), and its hint policies are
    /// told of a committed copy from that worker of every block it lacks, so
    /// `kv_fetch` names the prefill worker as their source.
    pub receive_from: Option<WorkerKey>,
}

/// Which registered workers a booking may choose from (see [`Router::book_among`]).
pub type Eligible<'a> = &'a (dyn Fn(&Worker) -> bool + Sync);

/// The result of a booking.
#[derive(Debug, Clone, PartialEq)]
pub struct Booking {
    /// Set when the role's selection policy failed or is quarantined, and the
    /// built-in default placed the request instead (`error`, `panic`,
    /// `out_of_range`, `quarantined`).
    pub selection_fallback: Option<&'static str>,
    pub request_id: String,
    pub role: Role,
    pub worker: WorkerKey,
    /// Leading request blocks the booked worker already holds.
    pub cached_blocks: usize,
    pub request_blocks: usize,
    pub committed_copy: Option<CommittedCopy>,
    /// The message for the booked worker, or why there is none.
    pub hint: Hint,
    pub dropped_actions: usize,
    pub policy_failures: Vec<PolicyFailure>,
}

impl Booking {
    pub fn hint_skipped(&self) -> Option<HintSkip> {
        self.hint.skipped()
    }

    pub fn action_types(&self) -> &[String] {
        self.hint.action_types()
    }
}

/// What select-and-reserve decided: the booked worker, what it holds, and the copy
/// it was committed to. The load is reserved by the time a plan exists.
///
/// It borrows the booked worker from the worker table the booking read: a clone of
/// its `Arc` would write the entry's reference count, a cache line every booking on
/// every core reads.
struct Plan<'t> {
    booked: &'t WorkerEntry,
    cached_blocks: usize,
    committed_copy: Option<CommittedCopy>,
    selection_fallback: Option<&'static str>,
}

impl Plan<'_> {
    /// The booking this plan makes, before the hint stage fills in its hint.
    fn booking(&self, request: &BookRequest<'_>, request_blocks: usize) -> Booking {
        Booking {
            selection_fallback: self.selection_fallback,
            request_id: request.request_id.to_string(),
            role: request.role,
            worker: self.booked.worker.key,
            cached_blocks: self.cached_blocks,
            request_blocks,
            committed_copy: self.committed_copy,
            hint: Hint::Skipped(HintSkip::NoActions),
            dropped_actions: 0,
            policy_failures: Vec::new(),
        }
    }
}

/// Buffers a booking reuses on its thread, so the hot path does not allocate
/// them per call.
#[derive(Default)]
struct Scratch {
    hashes: Vec<u64>,
    matches: Matches,
    /// Spare: the candidates of a booking borrow its worker table, so they
    /// live in a list of that lifetime and come back here empty.
    candidates: SpareCandidates,
    ranked: Vec<Ranked>,
    /// With a filter ([`Router::book_among`]): the position in the role's list of
    /// each admitted candidate.
    admitted: Vec<usize>,
    /// Each candidate's best peer copy, by position in `ranked`.
    peer_copies: Vec<Option<usize>>,
    rows: PeerRows,
}

impl Scratch {
    fn retained_bytes(&mut self) -> usize {
        self.matches.retained_bytes()
            + self.hashes.capacity() * 8
            + self.candidates.retained_bytes()
            + self.ranked.capacity() * std::mem::size_of::<Ranked>()
            + self.rows.retained_bytes()
    }
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Above this, a thread's scratch is dropped after the booking.
const SCRATCH_KEEP_BYTES: usize = 16 << 20;

/// The router's live state.
pub struct Router {
    block_size: usize,
    index: SharedIndex,
    workers: ArcSwap<WorkerTable>,
    /// Serialises registrations (each rewrites the table); bookings never take it.
    registration: parking_lot::Mutex<()>,
    bookings: Bookings,
}

impl Router {
    pub fn new(block_size: usize) -> Self {
        Self {
            block_size,
            index: SharedIndex::new(block_size.max(1)),
            workers: ArcSwap::from_pointee(WorkerTable::default()),
            registration: parking_lot::Mutex::new(()),
            bookings: Bookings::default(),
        }
    }

    /// Records that `key`'s engine publishes signed 64-bit hashes (SGLang's), so a
    /// `kv.fetch` from it names them as the engine spelled them. False (and nothing
    /// recorded) for a worker that is not registered.
    pub fn mark_signed_hashes(&self, key: WorkerKey) -> bool {
        use std::sync::atomic::Ordering;
        match self.workers.load().get(key) {
            Some(entry) => {
                entry.signed_hashes.store(true, Ordering::Relaxed);
                true
            }
            None => false,
        }
    }

    /// Whether `key` is registered.
    pub fn has_worker(&self, key: WorkerKey) -> bool {
        self.workers.load().get(key).is_some()
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Registers (or re-registers, keeping its load and cache) a worker.
    pub fn register_worker(&self, registration: WorkerRegistration) -> Result<bool, RouterError> {
        let worker = Arc::new(Worker::from_registration(registration)?);
        let _serialised = self.registration.lock();
        let table = self.workers.load_full();
        let (entry, added) = match table.get(worker.key) {
            Some(old) => (
                WorkerEntry {
                    worker,
                    slot: old.slot,
                    load: Arc::clone(&old.load),
                    signed_hashes: Arc::clone(&old.signed_hashes),
                },
                false,
            ),
            None => (
                WorkerEntry {
                    slot: self.index.add_worker(worker.key),
                    worker,
                    load: Arc::new(LoadCell::default()),
                    signed_hashes: Arc::default(),
                },
                true,
            ),
        };
        // O(log n): the new table shares all but the path to this worker.
        self.workers.store(Arc::new(table.with(Arc::new(entry))));
        Ok(added)
    }

    /// Removes a worker, its cached blocks, and its open bookings' load.
    pub fn deregister_worker(&self, key: WorkerKey) -> Result<(), RouterError> {
        let _serialised = self.registration.lock();
        let table = self.workers.load_full();
        if table.get(key).is_none() {
            return Err(RouterError::UnknownWorker {
                worker_id: key.worker_id,
                dp_rank: key.dp_rank,
            });
        }
        self.workers.store(Arc::new(table.without(key)));
        self.index.remove_worker(key);
        self.bookings.forget_worker(key);
        Ok(())
    }

    /// Applies one worker's KV event; it is visible to bookings when this returns.
    pub fn apply_kv_event(
        &self,
        key: WorkerKey,
        event: KvEvent,
    ) -> Result<index::ApplyStats, RouterError> {
        self.apply_kv_events(std::iter::once((key, event)))
            .pop()
            .unwrap_or(Ok(index::ApplyStats::default()))
    }

    /// Applies events in order, each atomically (a refused event changes nothing),
    /// published to bookings together.
    pub fn apply_kv_events(
        &self,
        events: impl IntoIterator<Item = (WorkerKey, KvEvent)>,
    ) -> Vec<Result<index::ApplyStats, RouterError>> {
        let table = self.workers.load();
        hooks::pause(hooks::Pause::EventsTableRead);
        // An event for an unknown worker is answered here; the others go to the index
        // in order, and their results fill the places kept for them.
        let mut results: Vec<Result<index::ApplyStats, RouterError>> = Vec::new();
        let applied = self
            .index
            .apply_batch(events.into_iter().filter_map(|(key, event)| {
                if table.get(key).is_none() {
                    results.push(Err(RouterError::UnknownWorker {
                        worker_id: key.worker_id,
                        dp_rank: key.dp_rank,
                    }));
                    None
                } else {
                    results.push(Ok(index::ApplyStats::default()));
                    Some((key, event))
                }
            }));
        let mut applied = applied.into_iter();
        for slot in results.iter_mut().filter(|r| r.is_ok()) {
            let Some(result) = applied.next() else {
                break;
            };
            *slot = result.map_err(RouterError::from_event);
        }
        results
    }

    /// The booked worker has started answering: its prefill is done, so the
    /// booking's prefill load is freed now rather than at release (as Dynamo marks
    /// prefill done at the first token). A booking already released is left alone.
    pub fn prefill_done(&self, request_id: &str) {
        self.bookings
            .finish_prefill(request_id, &self.workers.load());
    }

    /// Frees the load a booking reserved.
    pub fn release(&self, request_id: &str) -> Result<WorkerKey, RouterError> {
        self.bookings
            .remove(request_id, &self.workers.load())
            .map(|r| r.worker)
            .ok_or_else(|| RouterError::UnknownRequest(request_id.to_string()))
    }

    /// A registered worker, as the current table lists it.
    pub fn worker(&self, key: WorkerKey) -> Option<Arc<Worker>> {
        self.workers.load().get(key).map(|e| Arc::clone(&e.worker))
    }

    /// A registered worker's load cell: what the gateway tells bookings of its KV
    /// cache goes there ([`workers::Residency`]).
    pub fn load_cell(&self, key: WorkerKey) -> Option<Arc<workers::LoadCell>> {
        self.workers.load().get(key).map(|e| Arc::clone(&e.load))
    }

    /// The worker table as bookings see it now (the replication task reads and
    /// writes the load cells through it).
    pub fn worker_table(&self) -> Arc<WorkerTable> {
        self.workers.load_full()
    }

    /// Every worker with its load, by key.
    pub fn workers(&self) -> Vec<(Arc<Worker>, Load)> {
        self.workers
            .load()
            .all()
            .map(|e| (Arc::clone(&e.worker), e.load.get()))
            .collect()
    }

    /// (worker, engine hash) copies in the index, for metrics.
    pub fn index_len(&self) -> usize {
        self.index.read(|index| index.len())
    }

    /// Runs `f` on the KV index as bookings see it now.
    pub fn read_index<R>(&self, f: impl FnOnce(&index::KvIndex) -> R) -> R {
        self.index.read(f)
    }

    pub fn open_bookings(&self) -> usize {
        self.bookings.len()
    }

    /// Releases the bookings open longer than `ttl` (`router.booking_ttl`); returns
    /// how many.
    pub fn expire_bookings(&self, ttl: std::time::Duration) -> usize {
        self.bookings.expire(ttl, &self.workers.load())
    }

    /// Bookings [`Self::expire_bookings`] released since start.
    pub fn expired_bookings(&self) -> u64 {
        self.bookings.expired()
    }

    /// The longest prefix of `request`'s blocks that a worker of its role,
    /// admitted by `eligible`, holds: read from the index, nothing booked.
    /// What a caller deciding whether a booking is worth making reads (a
    /// disaggregated request's decode pool, before its prefill leg).
    pub fn held_prefix(&self, request: &BookRequest<'_>, eligible: Option<Eligible<'_>>) -> usize {
        SCRATCH.with(|scratch| {
            let mut scratch = scratch.borrow_mut();
            let Scratch {
                hashes, matches, ..
            } = &mut *scratch;
            seeded_block_hashes(
                request.token_ids,
                self.block_size,
                identity_seed(request.lora_name, request.cache_salt),
                hashes,
            );
            self.index.read(|index| index.lookup(hashes, matches));
            let table = self.workers.load();
            table
                .role(request.role)
                .iter()
                .filter(|listed| {
                    eligible.is_none_or(|eligible| {
                        table
                            .by_slot(listed.slot)
                            .is_some_and(|entry| eligible(&entry.worker))
                    })
                })
                .map(|listed| matches.cached_in_slot(listed.slot))
                .max()
                .unwrap_or(0)
        })
    }

    /// Books a request on `role`'s policies (from the snapshot the caller loaded).
    pub fn book(
        &self,
        role: &RoleRuntime,
        request: &BookRequest<'_>,
    ) -> Result<Booking, RouterError> {
        self.book_among(role, request, None)
    }

    /// Books a request on the workers of its role that `eligible` admits (the
    /// gateway's: those that serve the model, are healthy, and were not tried
    /// already); `None` admits every one. The selection policy sees only those.
    pub fn book_among(
        &self,
        role: &RoleRuntime,
        request: &BookRequest<'_>,
        eligible: Option<Eligible<'_>>,
    ) -> Result<Booking, RouterError> {
        if request.token_ids.is_empty() {
            return Err(RouterError::EmptyPrompt);
        }
        let limits = &role.limits;
        if request.token_ids.len() > limits.max_prompt_tokens {
            return Err(RouterError::PromptTooLong {
                tokens: request.token_ids.len(),
                max: limits.max_prompt_tokens,
            });
        }
        if request.request_id.len() > limits.max_request_id_bytes {
            return Err(RouterError::RequestIdTooLong {
                bytes: request.request_id.len(),
                max: limits.max_request_id_bytes,
            });
        }
        SCRATCH.with(|scratch| {
            let mut scratch = scratch.borrow_mut();
            let booking = self.book_with(role, request, eligible, &mut scratch);
            // The buffers only grow; one very long prompt must not leave a
            // thread holding large buffers for good.
            if scratch.retained_bytes() > SCRATCH_KEEP_BYTES {
                *scratch = Scratch::default();
            }
            booking
        })
    }

    fn book_with(
        &self,
        role: &RoleRuntime,
        request: &BookRequest<'_>,
        eligible: Option<Eligible<'_>>,
        scratch: &mut Scratch,
    ) -> Result<Booking, RouterError> {
        seeded_block_hashes(
            request.token_ids,
            self.block_size,
            identity_seed(request.lora_name, request.cache_salt),
            &mut scratch.hashes,
        );
        // Refused before any work; `select_and_reserve` checks again as it inserts,
        // which is what keeps the check exact under concurrent bookings.
        if self.bookings.contains(request.request_id) {
            return Err(RouterError::DuplicateRequest(
                request.request_id.to_string(),
            ));
        }
        // A deregistration swaps the table, then drops the worker's bookings. A booking
        // that selected on the old table and reserved after that sweep would stay open
        // on a worker that is gone; so once reserved, it checks the table again and
        // books afresh if its worker left meanwhile (rare: a few tries at most).
        let mut tries = 0;
        loop {
            let table = self.workers.load();
            let plan = self.select_and_reserve(role, request, &table, eligible, scratch)?;
            hooks::pause(hooks::Pause::Reserved {
                worker: plan.booked.worker.key,
                copy_source: plan.committed_copy.map(|copy| copy.source),
            });
            if self.workers.load().get(plan.booked.worker.key).is_some() {
                let mut booking = plan.booking(request, scratch.hashes.len());
                self.hint(role, request, &plan, &table, scratch, &mut booking);
                return Ok(booking);
            }
            self.bookings
                .remove(request.request_id, &self.workers.load());
            tries += 1;
            if tries == 3 {
                // Workers leave faster than this request can be booked.
                return Err(RouterError::NoWorkers(request.role));
            }
        }
    }

    /// Step 2: candidates with their cached prefixes → the selection policy → the
    /// load reserved. Each part is in `select`; this reads as the order they run in.
    fn select_and_reserve<'t>(
        &self,
        role: &RoleRuntime,
        request: &BookRequest<'_>,
        table: &'t WorkerTable,
        eligible: Option<Eligible<'_>>,
        scratch: &mut Scratch,
    ) -> Result<Plan<'t>, RouterError> {
        let entries = table.role(request.role);
        if entries.is_empty() {
            return Err(RouterError::NoWorkers(request.role));
        }
        let filtered = select::admit(table, entries, eligible, &mut scratch.admitted)
            .ok_or(RouterError::NoEligibleWorkers(request.role))?;
        let kv = role.on_kv_path;
        let policy = role.booking_selection();
        let wants_peer_copies = kv && policy.wants_peer_copies();
        let Scratch {
            hashes,
            matches,
            candidates: spare,
            ranked,
            peer_copies,
            admitted,
            ..
        } = scratch;
        let query: &[u64] = if kv { hashes } else { &[] };
        self.index.read(|index| index.lookup(query, matches));
        select::rank_holders(
            table,
            matches,
            kv && (wants_peer_copies || !role.hints.is_empty()),
            ranked,
        );
        let admitted = filtered.then_some(&admitted[..]);
        let mut candidates = spare.take();
        select::offer(
            table,
            entries,
            admitted,
            matches,
            ranked,
            wants_peer_copies,
            request.pinned_prefix,
            &mut candidates,
            peer_copies,
        );
        let chosen = policy.select_candidates(
            &SelectionRequest {
                request_id: request.request_id,
                role: request.role,
                request_blocks: hashes.len(),
                prompt_tokens: request.token_ids.len(),
                block_size: self.block_size,
                lora_name: request.lora_name,
                cache_salt: request.cache_salt,
                session_context: request.session_context,
            },
            &candidates,
        );
        let chosen_cached = candidates.cached_blocks(chosen.index);
        spare.put_back(candidates);
        // The table lists every candidate by slot too; it is the one this booking read.
        let entry_at = admitted.map_or(chosen.index, |admitted| admitted[chosen.index]);
        let Some(booked) = table.by_slot(entries[entry_at].slot).map(|e| &**e) else {
            return Err(RouterError::NoWorkers(request.role));
        };
        // A copy is only ever committed to a worker that can receive the hint
        // carrying it (rule R6).
        let request_blocks = hashes.len();
        let committed_copy = match request.receive_from {
            // The prefill worker will hold every block: the copy is what the
            // booked worker lacks, to the last block.
            Some(source) => (booked.worker.router_hint
                && source != booked.worker.key
                && request_blocks > chosen_cached)
                .then_some(CommittedCopy {
                    source,
                    first_block: chosen_cached,
                    last_block: request_blocks,
                }),
            None => peer_copies[chosen.index]
                .filter(|_| chosen.commit_kv_copy)
                .map(|at| ranked[at])
                .and_then(|source| {
                    (booked.worker.router_hint && source.cached > chosen_cached).then_some(
                        CommittedCopy {
                            source: source.key,
                            first_block: chosen_cached,
                            last_block: source.cached,
                        },
                    )
                }),
        };
        hooks::pause(hooks::Pause::Chosen {
            worker: booked.worker.key,
        });
        self.reserve(
            role,
            request,
            hashes.len(),
            booked,
            chosen_cached,
            committed_copy,
        )?;
        Ok(Plan {
            booked,
            cached_blocks: chosen_cached,
            committed_copy,
            selection_fallback: chosen.fallback.map(|reason| reason.as_str()),
        })
    }

    /// Reserves the booking's load on `booked`: the prompt's blocks as decode load,
    /// the uncached part (less any committed copy) as prefill work; refused for a
    /// request id already open or past the open-bookings cap.
    fn reserve(
        &self,
        role: &RoleRuntime,
        request: &BookRequest<'_>,
        request_blocks: usize,
        booked: &WorkerEntry,
        cached_blocks: usize,
        committed_copy: Option<CommittedCopy>,
    ) -> Result<(), RouterError> {
        // A worker that receives its KV from a prefill worker computes none of it.
        let prefill_start = match request.receive_from {
            Some(_) => request_blocks,
            None => committed_copy.map_or(cached_blocks, |c| c.last_block),
        };
        let load = Load {
            active_requests: 1,
            active_blocks: request.token_ids.len().div_ceil(self.block_size) as u64,
            prefill_blocks: request_blocks.saturating_sub(prefill_start) as u64,
        };
        let reserved = self.bookings.insert(
            request.request_id,
            Reservation {
                worker: booked.worker.key,
                load,
                cell: booked.load.id(),
                booked_at: std::time::Instant::now(),
            },
            &booked.load,
            role.limits.max_open_bookings,
        );
        match reserved {
            Ok(()) => Ok(()),
            Err(bookings::Refused::Duplicate) => Err(RouterError::DuplicateRequest(
                request.request_id.to_string(),
            )),
            Err(bookings::Refused::Full { open }) => Err(RouterError::TooManyOpenBookings { open }),
        }
    }

    /// Step 3: the hint stage, or why it does not run; fills `booking.hint`.
    fn hint(
        &self,
        role: &RoleRuntime,
        request: &BookRequest<'_>,
        plan: &Plan<'_>,
        table: &WorkerTable,
        scratch: &mut Scratch,
        booking: &mut Booking,
    ) {
        let booked = &plan.booked.worker;
        let skip = if !role.on_kv_path {
            Some(HintSkip::NotKvPath)
        } else if role.hints.is_empty() {
            Some(HintSkip::NoPolicies)
        } else if !booked.router_hint {
            Some(HintSkip::WorkerNotHintCapable)
        } else {
            None
        };
        if let Some(skip) = skip {
            booking.hint = Hint::Skipped(skip);
            if request.receive_from.is_some() {
                // No hint names the source; the engines hand the KV over anyway.
                booking.committed_copy = None;
            }
            return;
        }

        // The peers a policy may read, longest prefix first: every matching worker
        // but the booked one. Their engine hashes are read from the index only
        // when a policy (or the committed copy) asks for them.
        let Scratch {
            hashes,
            ranked,
            rows,
            ..
        } = scratch;
        ranked.retain(|r| r.key != booked.key && table.by_slot(r.slot).is_some());
        rows.reset(ranked.len());
        let source = IndexRows {
            router: self,
            table,
            hashes,
            ranked,
        };
        // The source's cache may have shrunk since the lookup: the copy is what it can
        // still name, and what the policies are told is what the booking claims. A copy
        // that shrank claims fewer blocks (the booked worker prefills the rest); one the
        // source can no longer supply at all is withdrawn, whatever a sender does.
        let receiving = request.receive_from.is_some();
        let committed = plan.committed_copy.and_then(|copy| {
            if receiving {
                // The prefill worker has not computed the blocks yet, so no index
                // row names them: the fetch names them by the request's block
                // hashes, the ones the router keys its index on.
                return Some(CommittedCopyView {
                    source: &table.get(copy.source)?.worker,
                    first_block: copy.first_block,
                    block_hashes: &hashes[..copy.last_block.min(hashes.len())],
                });
            }
            let at = ranked.iter().position(|r| r.key == copy.source)?;
            let source_worker = &*table.by_slot(ranked[at].slot)?.worker;
            let row = rows.row(at, &source);
            let last = copy.last_block.min(row.len());
            (last > copy.first_block).then(|| CommittedCopyView {
                source: source_worker,
                first_block: copy.first_block,
                block_hashes: &row[..last],
            })
        });
        if let Some(copy) = booking.committed_copy.filter(|_| !receiving) {
            let named = committed.as_ref().map_or(0, |c| c.block_hashes.len());
            if named < copy.last_block {
                self.reduce_copy(booking, named);
            }
        }
        let selection_policy = role.booking_selection_type.as_str();
        let peers = ranked.iter().filter_map(|r| {
            Some(PeerView {
                worker: &table.by_slot(r.slot)?.worker,
                cached_blocks: r.cached,
            })
        });
        let result = role.hints.run_booking(
            &BookedRequest {
                request_id: request.request_id,
                worker: booked,
                cached_blocks: plan.cached_blocks,
                prompt_tokens: request.token_ids.len(),
                block_size: self.block_size,
                lora_name: request.lora_name,
                cache_salt: request.cache_salt,
                session_context: request.session_context,
                selection_policy,
                block_hashes: hashes,
            },
            peers,
            rows,
            &source,
            committed,
        );
        booking.hint = result.hint;
        booking.dropped_actions = result.dropped_actions;
        booking.policy_failures = result.failures;
        if !result.kv_copy_sent {
            if receiving {
                // The engines hand the KV over whatever the hint said: no
                // prefill work moves to the booked worker.
                booking.committed_copy = None;
            } else {
                self.reduce_copy(booking, 0);
            }
        }
    }

    /// The committed copy can supply blocks only up to `last` now: its source's cache
    /// shrank, or (`last` at or below its first block) its fetch did not go out — the
    /// sender failed or was quarantined, or the message was refused — and it will not
    /// happen. The booked worker prefills the blocks the copy loses, so its reservation
    /// grows by them; a copy left with none is no longer claimed.
    fn reduce_copy(&self, booking: &mut Booking, last: usize) {
        let Some(copy) = booking.committed_copy.as_mut() else {
            return;
        };
        let kept = last.max(copy.first_block);
        let lost = copy.last_block.saturating_sub(kept) as u64;
        if kept == copy.first_block {
            tracing::warn!(request = ?booking.request_id, source = %copy.source, blocks = lost, "committed KV copy not sent; the booked worker prefills it");
            booking.committed_copy = None;
        } else {
            copy.last_block = kept;
        }
        self.bookings.grow(
            &booking.request_id,
            Load {
                prefill_blocks: lost,
                ..Load::default()
            },
            &self.workers.load(),
        );
    }
}

/// A booking's peers' engine hashes, read from the KV index on demand: peer `i`
/// is `ranked[i]`, named for its first `cached` request blocks.
struct IndexRows<'a> {
    router: &'a Router,
    table: &'a WorkerTable,
    hashes: &'a [u64],
    ranked: &'a [Ranked],
}

impl PeerHashSource for IndexRows<'_> {
    fn fill(&self, peer: usize, out: &mut Vec<u64>) -> bool {
        let Some(r) = self.ranked.get(peer) else {
            return false;
        };
        let query = &self.hashes[..r.cached.min(self.hashes.len())];
        self.router
            .index
            .read(|index| index.engine_hashes(r.slot, query, out));
        self.table.by_slot(r.slot).is_some_and(|entry| {
            entry
                .signed_hashes
                .load(std::sync::atomic::Ordering::Relaxed)
        })
    }
}
