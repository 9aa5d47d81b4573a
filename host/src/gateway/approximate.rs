//! Workers whose engines publish no KV events (llama.cpp; TRT-LLM without its
//! publisher), registered with `kv_events: approximate`: the router credits such a
//! worker with the blocks of each prompt it sent there, as if the engine had
//! published them, so repeated prompts land where their prefix is (Dynamo's
//! approximate mode is the anchor).
//!
//! A credit is a guess, so it is bounded: a block counts for
//! `gateway.approximate_ttl_s` after the last prompt that used it, and a worker is
//! credited with at most `gateway.approximate_max_blocks`; past that, the least
//! recently routed go first, and of one prompt's blocks the deepest first (the
//! prefix others share outlives each prompt's own tail, as in the engines' own
//! caches). The blocks go into the index through the same ingestion path as
//! engine events, under engine hashes of the router's own making, and status
//! shows the worker as `approximate`, apart from event-fed workers.
//!
//! **Busy prefixes.** A credit is made when the request is booked, before the
//! engine has computed anything, so that a burst of requests sharing a prefix
//! goes to one worker. But an engine reuses a prompt only once it is computed,
//! and llama.cpp only once the request that computed it has ended (its prompt
//! lives in that request's slot until then; a cached prompt is moved, not
//! copied, into the slot that loads it). A request sent while the one holding
//! its prefix is still running computes the prefix again, beside it, and slows
//! both. So each credit is also a [`Gate`]: the request's blocks are *busy* until
//! it settles (llama.cpp: when it ends; other engines: at its first byte), and a
//! later request on the same worker whose cached prefix ends in a busy block
//! waits for that gate (at most `gateway.prefix_wait_ms`) before it is sent,
//! then finds its prefix ready, if the prefix is worth a whole request's wait
//! (`gateway.prefix_wait_min_tokens`; the gateway decides). On llama.cpp,
//! requests waiting on one prefix are chained, one after the other, because
//! each takes the prompt into its own slot; on engines that share computed
//! blocks, all wait for the one request computing it.
//!
//! **Capacity.** A worker holds only what fits in its KV cache (for llama.cpp:
//! its slots and its host-memory prompt cache, `--cache-ram`, which it reports
//! nowhere). Credits beyond that are false hits: requests sent to a worker for a
//! prefix it dropped long ago. So each worker's credits are capped by its
//! capacity: `kv_capacity_tokens` where the worker's entry or registration gives
//! it, else learned from what the engine says it reused. Each answer carries the
//! engine's count of cached prompt tokens (llama.cpp's `timings.cache_n`, the
//! OpenAI `usage.prompt_tokens_details.cached_tokens`); against the prefix the
//! router credited, a shortfall (a *phantom*: the engine dropped blocks the
//! router still credits) shrinks the worker's cap to 90 % of what it credits
//! now, and a surplus (*unseen*: the engine kept blocks the cap had dropped)
//! grows it by the difference and 10 %, never past `kv_capacity_tokens` or
//! `gateway.approximate_max_blocks`. A request that was sent while its prefix was
//! still busy proves nothing about capacity and is not counted.
//!
//! **In flight, on workers with KV events.** An engine publishes a block once it
//! has computed it, so while a request is still waiting or prefilling, the index
//! shows nothing of its prompt on its worker, and the next requests sharing its
//! prefix scatter over the fleet, each computing it again (measured at fleet
//! scale: BENCHMARKS.md, "Routing at fleet scale"). So a worker whose engine
//! publishes events is credited too, with [`Approximate::in_flight`], for as long
//! as the request runs: an engine keeps a running request's blocks, so the credit
//! is never a false hit, and once the request ends the engine's own events say
//! what it kept. Its blocks are named by hashes of their own (never the engine's,
//! never an approximate worker's), counted per block over the requests running
//! with it, and taken back when the last of them ends, so the index holds them as
//! extra copies beside the engine's and loses nothing the engine published.
//! They are busy like an approximate credit's, so the prefix wait applies alike.
//! No ledger and no capacity: the engine's events bound what it holds.

use crate::domain::WorkerKey;
use crate::router::index::events::{KvEvent, StoredBlock};
use crate::router::ingest::Ingest;
use crate::router::workers::LoadCell;
use parking_lot::Mutex;
use smallvec::SmallVec;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What one worker was credited with.
#[derive(Default)]
struct Ledger {
    /// Engine hash → when a prompt last used the block.
    last_used: HashMap<u64, Instant>,
    /// (when, engine hash), oldest first, and of one credit the deepest block
    /// first; stale entries are skipped.
    order: VecDeque<(Instant, u64)>,
    /// The most blocks to credit it with: its configured capacity, or what the
    /// engine's answers taught (see the module's "Capacity"); `None` until
    /// either, when `gateway.approximate_max_blocks` bounds it alone.
    capacity: Option<u64>,
    /// `kv_capacity_tokens` in blocks, if its entry or registration gave it:
    /// learning never goes past it.
    configured: Option<u64>,
}

impl Ledger {
    /// The cap on its credits now.
    fn cap(&self, max_blocks: u64) -> u64 {
        self.capacity
            .or(self.configured)
            .unwrap_or(max_blocks)
            .min(max_blocks)
            .max(1)
    }
}

/// The in-flight request each credited block is busy with, by worker and
/// engine hash.
type BusyTable = Mutex<HashMap<(WorkerKey, u64), Arc<Gate>>>;

type Ledgers = Mutex<HashMap<WorkerKey, Ledger>>;

/// Event-fed workers' in-flight credits. The lock is held while a credit's
/// events are queued, so a block's store and its withdrawal reach the index in
/// order.
type InFlightTable = Mutex<InFlight>;

/// Requests running with each in-flight block, by (in-flight) hash and worker,
/// and the distinct blocks each worker's running requests pin, which the
/// bookings read from the worker's load cell (`Residency`) to anticipate the
/// evictions those blocks will force (`gateway.anticipate_evictions`).
#[derive(Default)]
struct InFlight {
    blocks: HashMap<u64, SmallVec<[(WorkerKey, u32); 2]>>,
    pinned: HashMap<WorkerKey, Pinned>,
}

#[derive(Default)]
struct Pinned {
    blocks: usize,
    /// Where bookings read it (`None` in unit tests without a router).
    cell: Option<Arc<LoadCell>>,
}

impl InFlight {
    /// One more running request on `worker` holds `hash`.
    fn hold(&mut self, worker: WorkerKey, hash: u64) {
        let holders = self.blocks.entry(hash).or_default();
        match holders.iter_mut().find(|(k, _)| *k == worker) {
            Some((_, running)) => *running += 1,
            None => {
                holders.push((worker, 1));
                self.pinned.entry(worker).or_default().blocks += 1;
            }
        }
    }

    /// One request on `worker` holding `hash` ended; whether none holds it now.
    fn release(&mut self, worker: WorkerKey, hash: u64) -> bool {
        let std::collections::hash_map::Entry::Occupied(mut entry) = self.blocks.entry(hash) else {
            return false;
        };
        let holders = entry.get_mut();
        let Some(at) = holders.iter().position(|(k, _)| *k == worker) else {
            return false;
        };
        holders[at].1 -= 1;
        if holders[at].1 > 0 {
            return false;
        }
        holders.swap_remove(at);
        if holders.is_empty() {
            entry.remove();
        }
        if let Some(pinned) = self.pinned.get_mut(&worker) {
            pinned.blocks = pinned.blocks.saturating_sub(1);
        }
        true
    }

    /// Tells bookings how many blocks `worker`'s running requests pin now.
    fn publish(&mut self, worker: WorkerKey) {
        let Some(pinned) = self.pinned.get(&worker) else {
            return;
        };
        if let Some(cell) = &pinned.cell {
            cell.set_pinned_blocks(pinned.blocks);
        }
        if pinned.blocks == 0 {
            self.pinned.remove(&worker);
        }
    }

    /// (worker, hash) pairs held, over every worker.
    fn len(&self) -> usize {
        self.pinned.values().map(|p| p.blocks).sum()
    }

    fn retain(&mut self, keep: impl Fn(&WorkerKey) -> bool) {
        self.blocks.retain(|_, holders| {
            holders.retain(|(k, _)| keep(k));
            !holders.is_empty()
        });
        self.pinned.retain(|k, _| keep(k));
    }

    /// For each worker whose running requests hold the first of `hashes`, how
    /// many of its leading ones they hold.
    fn prefix(&self, hashes: impl Iterator<Item = u64>) -> Vec<(WorkerKey, u32)> {
        let mut found: Vec<(WorkerKey, u32)> = Vec::new();
        for (depth, hash) in hashes.enumerate() {
            let Some(holders) = self.blocks.get(&hash) else {
                break;
            };
            if depth == 0 {
                found.extend(holders.iter().map(|(k, _)| (*k, 1)));
                continue;
            }
            let mut longer = false;
            for (worker, held) in found.iter_mut() {
                if *held as usize == depth && holders.iter().any(|(k, _)| k == worker) {
                    *held += 1;
                    longer = true;
                }
            }
            if !longer {
                break;
            }
        }
        found
    }
}

/// Mixed into the seed of in-flight credits' hashes, so they never name an
/// approximate credit's blocks (a worker registered again in the other mode).
const IN_FLIGHT_SEED: u64 = 0x6b76_6869_6e74_2d66;

/// Every approximate worker's ledger, and every event-fed worker's in-flight
/// credits.
#[derive(Default)]
pub struct Approximate {
    ledgers: Arc<Ledgers>,
    busy: Arc<BusyTable>,
    in_flight: Arc<InFlightTable>,
    pub stats: Arc<PredictionStats>,
    /// What each worker's engine said it holds, in tokens (`None`: it did not
    /// say), and when it was asked (`capacity`).
    reported: Mutex<HashMap<WorkerKey, (Instant, Option<u64>)>>,
}

/// How the router's credited prefixes compared with what the engines reused.
#[derive(Debug, Default)]
pub struct PredictionStats {
    /// By [`Prediction`].
    outcomes: [AtomicU64; 4],
}

/// What an engine's count of reused tokens said of a credited prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prediction {
    /// The engine reused what the router credited (within a block).
    Held,
    /// The engine reused less: it had dropped blocks the router credited.
    Phantom,
    /// The engine reused more: it kept blocks the router had stopped crediting.
    Unseen,
    /// The request was sent while its prefix was still busy: no evidence.
    Speculative,
}

impl Prediction {
    pub const ALL: [Prediction; 4] = [Self::Held, Self::Phantom, Self::Unseen, Self::Speculative];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Held => "held",
            Self::Phantom => "phantom",
            Self::Unseen => "unseen",
            Self::Speculative => "speculative",
        }
    }
}

impl PredictionStats {
    pub fn count(&self, outcome: Prediction) -> u64 {
        self.outcomes[outcome as usize].load(Ordering::Relaxed)
    }
}

/// Opens when the request that made it settles: its prompt is reusable by
/// another request on its worker.
#[derive(Default)]
pub struct Gate {
    open: AtomicBool,
    notify: tokio::sync::Notify,
}

impl Gate {
    pub fn is_open(&self) -> bool {
        self.open.load(Ordering::Acquire)
    }

    /// Returns once the gate is open.
    pub async fn opened(&self) {
        loop {
            let notified = self.notify.notified();
            if self.is_open() {
                return;
            }
            notified.await;
        }
    }

    fn open(&self) {
        self.open.store(true, Ordering::Release);
        self.notify.notify_waiters();
    }
}

pub use crate::domain::Settle;

/// When a request on `engine` becomes reusable: its row of `Engine::TABLE` says.
pub fn settles(engine: crate::domain::Engine) -> Settle {
    engine.facts().settle
}

/// One request's credit: its blocks stay busy until it settles (or is dropped).
pub struct Credit {
    busy: Arc<BusyTable>,
    ledgers: Arc<Ledgers>,
    stats: Arc<PredictionStats>,
    ingest: Ingest,
    worker: WorkerKey,
    hashes: Vec<u64>,
    gate: Arc<Gate>,
    pub settle: Settle,
    /// The gate of the in-flight request whose prompt holds this one's cached
    /// prefix, if it has not settled: wait for it before sending.
    pub wait_for: Option<Arc<Gate>>,
    /// The prefix the router credited the worker with when it booked this
    /// request, in blocks.
    predicted_blocks: usize,
    block_size: usize,
    max_blocks: u64,
    /// Sent while its prefix was still busy (the wait ran out).
    speculative: AtomicBool,
    /// Whether the engine's count has been heard (it is taken once).
    reported: AtomicBool,
    /// An event-fed worker's in-flight credit: its blocks are taken back from
    /// the index when the request ends (see the module's "In flight").
    in_flight: Option<Arc<InFlightTable>>,
}

impl Credit {
    /// The request's prompt is reusable now: its blocks are no longer busy
    /// (those a later request took over stay that one's), and whoever waits
    /// on it goes. Idempotent.
    pub fn settle(&self) {
        if self.gate.is_open() {
            return;
        }
        {
            let mut busy = self.busy.lock();
            for hash in &self.hashes {
                let key = (self.worker, *hash);
                if busy.get(&key).is_some_and(|g| Arc::ptr_eq(g, &self.gate)) {
                    busy.remove(&key);
                }
            }
        }
        self.gate.open();
    }
}

impl Credit {
    /// Whether the engine's count of reused tokens is wanted: it teaches an
    /// approximate worker's cap; an event-fed worker's events say it all.
    pub fn wants_reuse_report(&self) -> bool {
        self.in_flight.is_none()
    }

    /// The request was sent before the request holding its prefix settled:
    /// what the engine reuses then says nothing of its capacity.
    pub fn sent_while_busy(&self) {
        self.speculative.store(true, Ordering::Relaxed);
    }

    /// The engine reports it reused `cached_tokens` of the prompt: against the
    /// credited prefix, it confirms the worker's cap, shrinks it or grows it
    /// (see the module's "Capacity"). Only the first report counts.
    pub fn engine_reused(&self, cached_tokens: u64) -> Prediction {
        if self.in_flight.is_some() || self.reported.swap(true, Ordering::Relaxed) {
            return Prediction::Held;
        }
        let reused = (cached_tokens / self.block_size.max(1) as u64) as usize;
        let predicted = self.predicted_blocks;
        let outcome = if self.speculative.load(Ordering::Relaxed) {
            Prediction::Speculative
        } else if reused + 1 < predicted {
            Prediction::Phantom
        } else if reused > predicted + 1 {
            Prediction::Unseen
        } else {
            Prediction::Held
        };
        self.stats.outcomes[outcome as usize].fetch_add(1, Ordering::Relaxed);
        if !matches!(outcome, Prediction::Phantom | Prediction::Unseen) {
            return outcome;
        }
        // Never below what a few prompts of this size need.
        let floor = (self.hashes.len() as u64 * 4).max(64);
        let evicted = {
            let mut ledgers = self.ledgers.lock();
            let Some(ledger) = ledgers.get_mut(&self.worker) else {
                return outcome;
            };
            let cap = ledger.cap(self.max_blocks);
            let ceiling = ledger
                .configured
                .unwrap_or(self.max_blocks)
                .min(self.max_blocks);
            let credited = ledger.last_used.len() as u64;
            let learned = if outcome == Prediction::Phantom {
                (cap.min(credited) as f64 * 0.9) as u64
            } else if ledger.capacity.is_some() || ledger.configured.is_some() {
                let gap = (reused - predicted) as u64;
                (cap as f64 * 1.1) as u64 + gap
            } else {
                // Not capped yet: nothing to grow.
                return outcome;
            };
            ledger.capacity = Some(learned.clamp(floor.min(ceiling), ceiling));
            let cap = ledger.cap(self.max_blocks);
            ledger.evict(|ledger| ledger.last_used.len() as u64 > cap)
        };
        if !evicted.is_empty() {
            let _ = self.ingest.submit_detached(
                self.worker,
                KvEvent::Removed {
                    block_hashes: evicted,
                },
            );
        }
        outcome
    }
}

impl Drop for Credit {
    fn drop(&mut self) {
        self.settle();
        if let Some(table) = &self.in_flight {
            withdraw(table, &self.ingest, self.worker, &self.hashes);
        }
    }
}

/// The request that made an in-flight credit ended: each of its blocks loses it,
/// and those no running request holds any more leave the index (under the lock,
/// so that a store made meanwhile by another request is queued before or after
/// this, not between).
fn withdraw(table: &InFlightTable, ingest: &Ingest, worker: WorkerKey, hashes: &[u64]) {
    if hashes.is_empty() {
        return;
    }
    let mut table = table.lock();
    let mut gone = Vec::new();
    for hash in hashes {
        if table.release(worker, *hash) {
            gone.push(*hash);
        }
    }
    table.publish(worker);
    if !gone.is_empty() {
        let _ = ingest.submit_detached(worker, KvEvent::Removed { block_hashes: gone });
    }
}

/// The engine hashes the router names a prompt's full blocks by: chained, so a
/// block's hash stands for its whole prefix, and seeded by the LoRA adapter and
/// cache salt, as an engine's own are.
pub fn block_hashes(
    token_ids: &[u32],
    block_size: usize,
    lora: Option<&str>,
    salt: Option<&str>,
) -> Vec<u64> {
    seeded_hashes(0, token_ids, block_size, lora, salt)
}

fn seeded_hashes(
    mix: u64,
    token_ids: &[u32],
    block_size: usize,
    lora: Option<&str>,
    salt: Option<&str>,
) -> Vec<u64> {
    seeded_hash_iter(mix, token_ids, block_size, lora, salt).collect()
}

/// [`seeded_hashes`] one block at a time, for readers that may stop early.
fn seeded_hash_iter<'a>(
    mix: u64,
    token_ids: &'a [u32],
    block_size: usize,
    lora: Option<&str>,
    salt: Option<&str>,
) -> impl Iterator<Item = u64> + 'a {
    let mut seed = xxhash_rust::xxh3::xxh3_64(lora.unwrap_or("").as_bytes());
    seed ^= xxhash_rust::xxh3::xxh3_64(salt.unwrap_or("").as_bytes()).rotate_left(17);
    let mut parent = seed ^ mix;
    let block_size = block_size.max(1);
    let mut bytes = Vec::with_capacity(block_size * 4);
    token_ids.chunks_exact(block_size).map(move |chunk| {
        bytes.clear();
        bytes.extend(chunk.iter().flat_map(|t| t.to_le_bytes()));
        parent = xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, parent);
        parent
    })
}

/// A prompt to credit to a worker.
pub struct Prompt<'a> {
    pub token_ids: &'a [u32],
    pub block_size: usize,
    pub lora: Option<&'a str>,
    pub salt: Option<&'a str>,
    /// Leading blocks the booking found cached on the worker.
    pub cached_blocks: usize,
}

/// The stored event that credits `prompt`'s full blocks under `hashes`.
fn stored(prompt: &Prompt<'_>, hashes: &[u64]) -> KvEvent {
    KvEvent::Stored {
        parent_block_hash: None,
        blocks: prompt
            .token_ids
            .chunks_exact(prompt.block_size.max(1))
            .zip(hashes)
            .map(|(chunk, hash)| StoredBlock {
                block_hash: *hash,
                token_ids: chunk.into(),
            })
            .collect(),
        lora_name: prompt.lora.map(str::to_string),
        cache_salt: prompt.salt.map(str::to_string),
        extra_keys: Vec::new(),
    }
}

impl Approximate {
    /// Credits `worker` with the full blocks of `prompt`: stores them in the
    /// index (through `ingest`, without waiting), notes when, and marks them busy
    /// until the returned credit settles.
    pub fn credit(
        &self,
        ingest: &Ingest,
        worker: WorkerKey,
        prompt: &Prompt<'_>,
        max_blocks: u64,
        settle: Settle,
    ) -> Credit {
        let hashes = block_hashes(
            prompt.token_ids,
            prompt.block_size.max(1),
            prompt.lora,
            prompt.salt,
        );
        let mut credit = self.new_credit(ingest, worker, prompt, max_blocks, settle);
        if hashes.is_empty() {
            return credit;
        }
        self.mark_busy(&mut credit, &hashes, prompt.cached_blocks);
        let now = Instant::now();
        let evicted = {
            let mut ledgers = self.ledgers.lock();
            let ledger = ledgers.entry(worker).or_default();
            // Deepest first, so that of this prompt the tail goes before the
            // prefix it may share with others.
            for hash in hashes.iter().rev() {
                ledger.last_used.insert(*hash, now);
                ledger.order.push_back((now, *hash));
            }
            let cap = ledger.cap(max_blocks);
            ledger.evict(|ledger| ledger.last_used.len() as u64 > cap)
        };
        if ingest
            .submit_detached(worker, stored(prompt, &hashes))
            .is_err()
        {
            tracing::debug!(%worker, "approximate credit dropped: the ingestion queue is full");
        }
        if !evicted.is_empty() {
            let _ = ingest.submit_detached(
                worker,
                KvEvent::Removed {
                    block_hashes: evicted,
                },
            );
        }
        credit.hashes = hashes;
        credit
    }

    /// Credits an event-fed `worker` with the full blocks of `prompt` while the
    /// request runs (see the module's "In flight"): stored in the index beside
    /// the engine's own blocks, busy until the request settles, taken back when
    /// the returned credit is dropped (the request's end) and no other running
    /// request holds them.
    ///
    /// `cell` is the worker's load cell, where bookings read how many blocks
    /// its running requests pin.
    pub fn in_flight(
        &self,
        ingest: &Ingest,
        worker: WorkerKey,
        cell: Option<Arc<LoadCell>>,
        prompt: &Prompt<'_>,
        settle: Settle,
    ) -> Credit {
        let hashes = seeded_hashes(
            IN_FLIGHT_SEED,
            prompt.token_ids,
            prompt.block_size.max(1),
            prompt.lora,
            prompt.salt,
        );
        let mut credit = self.new_credit(ingest, worker, prompt, 0, settle);
        if hashes.is_empty() {
            return credit;
        }
        self.mark_busy(&mut credit, &hashes, prompt.cached_blocks);
        {
            let mut table = self.in_flight.lock();
            for hash in &hashes {
                table.hold(worker, *hash);
            }
            if let Some(pinned) = table.pinned.get_mut(&worker) {
                if cell.is_some() {
                    pinned.cell = cell;
                }
            }
            table.publish(worker);
            // Queued under the lock: see `withdraw`. Stored again for a block
            // another running request holds, it changes nothing in the index.
            if ingest
                .submit_detached(worker, stored(prompt, &hashes))
                .is_err()
            {
                tracing::debug!(%worker, "in-flight credit dropped: the ingestion queue is full");
            }
        }
        credit.in_flight = Some(Arc::clone(&self.in_flight));
        credit.hashes = hashes;
        credit
    }

    fn new_credit(
        &self,
        ingest: &Ingest,
        worker: WorkerKey,
        prompt: &Prompt<'_>,
        max_blocks: u64,
        settle: Settle,
    ) -> Credit {
        Credit {
            busy: Arc::clone(&self.busy),
            ledgers: Arc::clone(&self.ledgers),
            stats: Arc::clone(&self.stats),
            ingest: ingest.clone(),
            worker,
            hashes: Vec::new(),
            gate: Arc::new(Gate::default()),
            settle,
            wait_for: None,
            predicted_blocks: prompt.cached_blocks,
            block_size: prompt.block_size.max(1),
            max_blocks,
            speculative: AtomicBool::new(false),
            reported: AtomicBool::new(false),
            in_flight: None,
        }
    }

    /// Marks `hashes` busy with `credit`'s request, and finds the in-flight
    /// request whose prompt holds its cached prefix (`cached_blocks` long), if
    /// it has not settled.
    ///
    /// On an engine that settles at the end (llama.cpp), requests on one prefix
    /// are chained: each takes the prompt into its own slot, so the next waits
    /// for the last. On one that settles at the first byte (vLLM, SGLang,
    /// TRT-LLM), the prefix is reusable by every request once the request that
    /// computes it is prefilled: a block stays busy with that request, and
    /// later ones all wait for it, not each for the one before (a burst of a
    /// group's requests would otherwise wait for each other's prefills in turn).
    fn mark_busy(&self, credit: &mut Credit, hashes: &[u64], cached_blocks: usize) {
        let worker = credit.worker;
        let mut busy = self.busy.lock();
        credit.wait_for = cached_blocks
            .checked_sub(1)
            .and_then(|last| hashes.get(last))
            .and_then(|hash| busy.get(&(worker, *hash)))
            .filter(|g| !g.is_open())
            .cloned();
        for hash in hashes {
            let gate = Arc::clone(&credit.gate);
            match credit.settle {
                Settle::End => {
                    busy.insert((worker, *hash), gate);
                }
                Settle::FirstByte => {
                    busy.entry((worker, *hash))
                        .and_modify(|held| {
                            if held.is_open() {
                                *held = Arc::clone(&credit.gate);
                            }
                        })
                        .or_insert(gate);
                }
            }
        }
    }

    /// Blocks of event-fed workers credited to requests in flight, over every
    /// worker.
    pub fn in_flight_blocks(&self) -> usize {
        self.in_flight.lock().len()
    }

    /// For each event-fed worker running requests that share `prompt`'s leading
    /// blocks, how many of them those requests hold: blocks its engine cannot
    /// drop before this request reaches it (`BookRequest::pinned_prefix`).
    pub fn pinned_prefix(&self, prompt: &Prompt<'_>) -> Vec<(WorkerKey, u32)> {
        let table = self.in_flight.lock();
        if table.blocks.is_empty() {
            return Vec::new();
        }
        table.prefix(seeded_hash_iter(
            IN_FLIGHT_SEED,
            prompt.token_ids,
            prompt.block_size.max(1),
            prompt.lora,
            prompt.salt,
        ))
    }

    /// Takes back credits older than `ttl`; returns how many blocks.
    pub fn expire(&self, ingest: &Ingest, ttl: Duration) -> usize {
        let Some(cutoff) = Instant::now().checked_sub(ttl) else {
            return 0;
        };
        let mut removals = Vec::new();
        {
            let mut ledgers = self.ledgers.lock();
            for (worker, ledger) in ledgers.iter_mut() {
                let evicted =
                    ledger.evict(|ledger| ledger.order.front().is_some_and(|(at, _)| *at < cutoff));
                if !evicted.is_empty() {
                    removals.push((*worker, evicted));
                }
            }
            ledgers.retain(|_, l| {
                !l.last_used.is_empty() || l.capacity.is_some() || l.configured.is_some()
            });
        }
        let mut removed = 0;
        for (worker, block_hashes) in removals {
            removed += block_hashes.len();
            let _ = ingest.submit_detached(worker, KvEvent::Removed { block_hashes });
        }
        removed
    }

    /// Sets each worker's configured capacity (`kv_capacity_tokens`, in
    /// blocks; `None`: not configured), as the worker table has it now.
    pub fn configure(&self, worker: WorkerKey, capacity_blocks: Option<u64>) {
        let mut ledgers = self.ledgers.lock();
        let ledger = ledgers.entry(worker).or_default();
        if ledger.configured != capacity_blocks {
            ledger.configured = capacity_blocks;
            // Learning starts again from the new figure.
            ledger.capacity = None;
        }
    }

    /// The cap on `worker`'s credits now, and whether it was learned from the
    /// engine's answers (rather than configured or the global bound).
    pub fn cap(&self, worker: WorkerKey, max_blocks: u64) -> (u64, bool) {
        self.ledgers
            .lock()
            .get(&worker)
            .map_or((max_blocks, false), |l| {
                (l.cap(max_blocks), l.capacity.is_some())
            })
    }

    /// Forgets a worker that left (its index entries went with it).
    pub fn forget(&self, keep: impl Fn(&WorkerKey) -> bool) {
        self.ledgers.lock().retain(|k, _| keep(k));
        self.busy.lock().retain(|(k, _), _| keep(k));
        self.in_flight.lock().retain(&keep);
        self.reported.lock().retain(|k, _| keep(k));
    }

    /// Whether to ask `worker`'s engine for its capacity now: never asked, or
    /// it did not say and [`capacity::RETRY`](super::capacity::RETRY) has
    /// passed. Marks it asked.
    pub fn should_read(&self, worker: WorkerKey, now: Instant) -> bool {
        let mut reported = self.reported.lock();
        match reported.get(&worker) {
            Some((_, Some(_))) => false,
            Some((at, None)) if now.duration_since(*at) < super::capacity::RETRY => false,
            _ => {
                reported.insert(worker, (now, None));
                true
            }
        }
    }

    /// What `worker`'s engine said it holds, in tokens.
    pub fn reported(&self, worker: WorkerKey, tokens: Option<u64>, now: Instant) {
        self.reported.lock().insert(worker, (now, tokens));
    }

    /// The capacity in tokens `worker`'s engine reported, if it did.
    pub fn engine_capacity(&self, worker: WorkerKey) -> Option<u64> {
        self.reported.lock().get(&worker).and_then(|(_, t)| *t)
    }

    /// Blocks credited to `worker` now.
    pub fn blocks(&self, worker: WorkerKey) -> usize {
        self.ledgers
            .lock()
            .get(&worker)
            .map_or(0, |l| l.last_used.len())
    }

    /// Blocks busy with in-flight requests, over every worker.
    pub fn busy_blocks(&self) -> usize {
        self.busy.lock().len()
    }
}

impl Ledger {
    /// Pops the oldest credits while `more` says so; a block used again since is
    /// kept (its newer entry stays queued). Returns the blocks taken back.
    fn evict(&mut self, more: impl Fn(&Ledger) -> bool) -> Vec<u64> {
        let mut evicted = Vec::new();
        while more(self) {
            let Some((at, hash)) = self.order.pop_front() else {
                break;
            };
            if self.last_used.get(&hash) == Some(&at) {
                self.last_used.remove(&hash);
                evicted.push(hash);
            }
        }
        evicted
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(id: u64) -> WorkerKey {
        WorkerKey {
            worker_id: id,
            dp_rank: 0,
        }
    }

    fn credit(
        approximate: &Approximate,
        ingest: &Ingest,
        worker: u64,
        tokens: &[u32],
        cached_blocks: usize,
    ) -> Credit {
        approximate.credit(
            ingest,
            key(worker),
            &Prompt {
                token_ids: tokens,
                block_size: 2,
                lora: None,
                salt: None,
                cached_blocks,
            },
            1_000,
            Settle::End,
        )
    }

    /// An ingestion path into a router of its own (the credits' events are
    /// refused there, for workers it does not know, which these tests ignore).
    fn ingest() -> Ingest {
        let router = Arc::new(crate::router::Router::new(2));
        Ingest::start(router, 64).expect("the ingestion thread").0
    }

    #[test]
    fn a_request_whose_prefix_is_busy_waits_for_the_one_holding_it() {
        let approximate = Approximate::default();
        let ingest = ingest();
        let first = credit(&approximate, &ingest, 1, &[1, 2, 3, 4, 5, 6], 0);
        assert!(first.wait_for.is_none(), "nothing was cached");
        // The same prefix (two blocks) with another tail, on the same worker.
        let second = credit(&approximate, &ingest, 1, &[1, 2, 3, 4, 9, 9], 2);
        let gate = second.wait_for.clone().expect("the first holds the prefix");
        assert!(!gate.is_open());
        // On another worker, nothing is busy.
        let elsewhere = credit(&approximate, &ingest, 2, &[1, 2, 3, 4, 9, 9], 2);
        assert!(elsewhere.wait_for.is_none());
        // A third waits for the second, not the first: each takes the prompt
        // into its own slot in turn.
        let third = credit(&approximate, &ingest, 1, &[1, 2, 3, 4, 7, 7], 2);
        let behind = third.wait_for.clone().expect("chained");
        assert!(Arc::ptr_eq(&behind, &second.gate));
        first.settle();
        assert!(gate.is_open());
        assert!(!behind.is_open(), "the second still runs");
        drop(second);
        assert!(behind.is_open(), "a dropped credit settles");
        drop(third);
        drop(elsewhere);
        assert_eq!(approximate.busy_blocks(), 0, "nothing stays busy");
    }

    #[test]
    fn a_settled_prefix_is_not_waited_for() {
        let approximate = Approximate::default();
        let ingest = ingest();
        let first = credit(&approximate, &ingest, 1, &[1, 2, 3, 4], 0);
        first.settle();
        let second = credit(&approximate, &ingest, 1, &[1, 2, 3, 4, 5, 6], 2);
        assert!(second.wait_for.is_none());
        // A request that found less cached than the busy blocks waits only on
        // the block its prefix ends in.
        let third = credit(&approximate, &ingest, 1, &[1, 2, 8, 8], 1);
        assert!(third.wait_for.is_some(), "block 0 is busy with the second");
    }

    #[test]
    fn past_the_cap_a_prompts_tail_goes_before_the_prefix_others_share() {
        let approximate = Approximate::default();
        let ingest = ingest();
        // Two prompts sharing two blocks, then one of their own each, under a
        // cap of three blocks: the first's tail goes, the shared prefix stays.
        let a = [1, 2, 3, 4, 10, 10];
        let b = [1, 2, 3, 4, 20, 20];
        let cap = |tokens: &[u32]| {
            approximate.credit(
                &ingest,
                key(1),
                &Prompt {
                    token_ids: tokens,
                    block_size: 2,
                    lora: None,
                    salt: None,
                    cached_blocks: 0,
                },
                3,
                Settle::End,
            )
        };
        drop(cap(&a));
        assert_eq!(approximate.blocks(key(1)), 3);
        drop(cap(&b));
        assert_eq!(approximate.blocks(key(1)), 3);
        let hashes_a = block_hashes(&a, 2, None, None);
        let hashes_b = block_hashes(&b, 2, None, None);
        let ledgers = approximate.ledgers.lock();
        let ledger = &ledgers[&key(1)];
        assert!(
            !ledger.last_used.contains_key(&hashes_a[2]),
            "a's tail went"
        );
        for kept in [hashes_a[0], hashes_a[1], hashes_b[2]] {
            assert!(ledger.last_used.contains_key(&kept));
        }
        drop(ledgers);
        // One prompt longer than the cap keeps its first blocks, the part a
        // lookup can use, not its last.
        let long = [5, 5, 6, 6, 7, 7, 8, 8];
        drop(approximate.credit(
            &ingest,
            key(2),
            &Prompt {
                token_ids: &long,
                block_size: 2,
                lora: None,
                salt: None,
                cached_blocks: 0,
            },
            2,
            Settle::End,
        ));
        let hashes = block_hashes(&long, 2, None, None);
        let ledgers = approximate.ledgers.lock();
        let kept: Vec<bool> = hashes
            .iter()
            .map(|h| ledgers[&key(2)].last_used.contains_key(h))
            .collect();
        assert_eq!(kept, [true, true, false, false]);
    }

    #[test]
    fn an_in_flight_block_stays_credited_until_the_last_request_holding_it_ends() {
        let approximate = Approximate::default();
        let ingest = ingest();
        let prompt = |tokens: &'static [u32], cached_blocks| Prompt {
            token_ids: tokens,
            block_size: 2,
            lora: None,
            salt: None,
            cached_blocks,
        };
        let a = approximate.in_flight(
            &ingest,
            key(1),
            None,
            &prompt(&[1, 2, 3, 4], 0),
            Settle::FirstByte,
        );
        assert!(!a.wants_reuse_report(), "the engine's events say it all");
        // The same prefix, one more block, on the same worker: it waits for the
        // first to be prefilled.
        let b = approximate.in_flight(
            &ingest,
            key(1),
            None,
            &prompt(&[1, 2, 3, 4, 5, 6], 2),
            Settle::FirstByte,
        );
        assert!(b.wait_for.is_some());
        assert_eq!(approximate.in_flight_blocks(), 3);
        // Not an approximate credit: no ledger, no hashes of an approximate
        // worker's.
        assert_eq!(approximate.blocks(key(1)), 0);
        assert!(a
            .hashes
            .iter()
            .all(|h| !block_hashes(&[1, 2, 3, 4], 2, None, None).contains(h)));
        drop(a);
        assert_eq!(
            approximate.in_flight_blocks(),
            3,
            "the second still runs with the shared blocks"
        );
        drop(b);
        assert_eq!(approximate.in_flight_blocks(), 0);
        assert_eq!(approximate.busy_blocks(), 0);
    }

    /// Bookings learn, through the worker's load cell, how many distinct blocks
    /// its running requests pin, and, per prompt, how much of its prefix they
    /// hold on each worker.
    #[test]
    fn running_requests_pinned_blocks_reach_the_bookings_per_worker_and_per_prefix() {
        let approximate = Approximate::default();
        let ingest = ingest();
        let prompt = |tokens: &'static [u32]| Prompt {
            token_ids: tokens,
            block_size: 2,
            lora: None,
            salt: None,
            cached_blocks: 0,
        };
        let one = Arc::new(LoadCell::default());
        let two = Arc::new(LoadCell::default());
        let pinned = |cell: &LoadCell| cell.residency().pinned_blocks;
        let a = approximate.in_flight(
            &ingest,
            key(1),
            Some(Arc::clone(&one)),
            &prompt(&[1, 2, 3, 4, 5, 6]),
            Settle::FirstByte,
        );
        let b = approximate.in_flight(
            &ingest,
            key(1),
            Some(Arc::clone(&one)),
            &prompt(&[1, 2, 3, 4, 7, 8]),
            Settle::FirstByte,
        );
        let c = approximate.in_flight(
            &ingest,
            key(2),
            Some(Arc::clone(&two)),
            &prompt(&[1, 2, 9, 9]),
            Settle::FirstByte,
        );
        // Worker 1: blocks [1 2] [3 4] shared, [5 6] and [7 8] apart.
        assert_eq!((pinned(&one), pinned(&two)), (4, 2));
        let mut held = approximate.pinned_prefix(&prompt(&[1, 2, 3, 4, 5, 6, 0, 0]));
        held.sort();
        assert_eq!(held, vec![(key(1), 3), (key(2), 1)]);
        assert!(approximate.pinned_prefix(&prompt(&[0, 0, 1, 2])).is_empty());
        drop(a);
        assert_eq!(pinned(&one), 3, "[5 6] left with its only request");
        let mut held = approximate.pinned_prefix(&prompt(&[1, 2, 3, 4, 5, 6]));
        held.sort();
        assert_eq!(held, vec![(key(1), 2), (key(2), 1)]);
        drop((b, c));
        assert_eq!((pinned(&one), pinned(&two)), (0, 0));
        assert_eq!(approximate.in_flight_blocks(), 0);
        assert!(approximate.pinned_prefix(&prompt(&[1, 2])).is_empty());
    }

    #[test]
    fn on_an_engine_that_shares_computed_blocks_every_request_waits_for_the_one_computing_the_prefix(
    ) {
        let approximate = Approximate::default();
        let ingest = ingest();
        let prompt = |tokens: &'static [u32], cached_blocks| Prompt {
            token_ids: tokens,
            block_size: 2,
            lora: None,
            salt: None,
            cached_blocks,
        };
        let first = approximate.in_flight(
            &ingest,
            key(1),
            None,
            &prompt(&[1, 2, 3, 4, 5, 6], 0),
            Settle::FirstByte,
        );
        let second = approximate.in_flight(
            &ingest,
            key(1),
            None,
            &prompt(&[1, 2, 3, 4, 7, 7], 2),
            Settle::FirstByte,
        );
        let third = approximate.in_flight(
            &ingest,
            key(1),
            None,
            &prompt(&[1, 2, 3, 4, 8, 8], 2),
            Settle::FirstByte,
        );
        for waiting in [&second, &third] {
            let gate = waiting
                .wait_for
                .clone()
                .expect("the prefix is being computed");
            assert!(
                Arc::ptr_eq(&gate, &first.gate),
                "waits for the first, not the one before"
            );
        }
        first.settle();
        // Prefilled: a fourth goes at once, though the second and third run.
        let fourth = approximate.in_flight(
            &ingest,
            key(1),
            None,
            &prompt(&[1, 2, 3, 4, 9, 9], 2),
            Settle::FirstByte,
        );
        assert!(fourth.wait_for.is_none());
        drop((second, third, fourth));
    }
}
