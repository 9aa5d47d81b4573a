//! The registered workers and the load each carries.
//!
//! Bookings read the worker table far more often than workers come and go, so the table
//! is an immutable value behind an atomic pointer (`arc-swap`): a booking loads it once,
//! without a lock; a registration builds a new one and swaps it in. Load is apart from
//! the table, one cache-line-sized block of atomics per worker, shared by every table
//! that lists the worker, so a re-registration keeps it and bookings on different
//! workers never write the same cache line. A booking may see a load a few microseconds
//! stale (another booking's reservation landing while it compares costs), as Dynamo's
//! router does; each reservation itself is exact.
//!
//! With replication (`host/src/replication/`), a cell also holds the sum of the other
//! replicas' load on the worker, in the same cache line: only the replication task
//! writes it, a booking reads it beside the local load, and selection sees the two
//! added ([`LoadCell::get`]). Bookings add to and free the local part only.

use super::index::Slot;
use super::persistent::{Keyed, SlotVec, SortedSeq};
use crate::domain::{Role, Worker, WorkerKey, WorkerView};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

pub use crate::domain::{RuntimeDataError, WorkerRegistration};

/// The load a worker carries from its open bookings.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Load {
    pub active_requests: u64,
    /// KV blocks held by open requests (their prompts).
    pub active_blocks: u64,
    /// Blocks still to prefill for open requests (their uncached part).
    pub prefill_blocks: u64,
}

impl Load {
    /// The two loads added (saturating).
    pub fn plus(self, other: Load) -> Load {
        Load {
            active_requests: self.active_requests.saturating_add(other.active_requests),
            active_blocks: self.active_blocks.saturating_add(other.active_blocks),
            prefill_blocks: self.prefill_blocks.saturating_add(other.prefill_blocks),
        }
    }

    pub fn is_zero(&self) -> bool {
        *self == Load::default()
    }
}

/// A worker's load as atomics; aligned so two workers' counters never share a line.
#[derive(Debug)]
#[repr(align(64))]
pub struct LoadCell {
    active_requests: AtomicU64,
    active_blocks: AtomicU64,
    prefill_blocks: AtomicU64,
    /// The other replicas' load on this worker, summed; written by the replication
    /// task only (zero without replication).
    remote_requests: AtomicU64,
    remote_blocks: AtomicU64,
    remote_prefill: AtomicU64,
    /// Which cell this is, never reused: an open booking names the cell it added its
    /// load to by this, so a release frees the load from that cell only.
    id: u64,
    /// What the gateway knows of an event-fed worker's KV cache, for a booking to
    /// anticipate the evictions it makes certain ([`Residency`]): its capacity in
    /// blocks (0: unknown, or not anticipated) and the distinct blocks its running
    /// requests pin. 32 bits each keep the cell in one cache line.
    capacity_blocks: AtomicU32,
    pinned_blocks: AtomicU32,
}

/// An event-fed worker's KV cache as a booking sees it: how many blocks it holds
/// at most, and how many of those the requests it is running pin.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Residency {
    pub capacity_blocks: u32,
    pub pinned_blocks: u32,
}

impl Residency {
    /// Of a prefix of `cached` blocks the index shows on the worker, the leading
    /// blocks still there when the request reaches it, given that its first
    /// `pinned` blocks are pinned by requests running there.
    ///
    /// An engine keeps the blocks its running requests use and, past its
    /// capacity, drops the least recently used of the rest, a prompt's deepest
    /// blocks first. Once the running requests' blocks are all in the cache, at
    /// most `capacity − pinned` unpinned blocks remain, whichever they are: of the
    /// prefix's unpinned part, more than that is certainly gone by then (the
    /// engine's events say so only afterwards). Capacity unknown: all of it.
    pub fn surviving(self, cached: usize, pinned: usize) -> usize {
        if self.capacity_blocks == 0 {
            return cached;
        }
        let ours = pinned.min(cached);
        let room = (self.capacity_blocks as usize).saturating_sub(self.pinned_blocks as usize);
        ours + (cached - ours).min(room)
    }
}

impl Default for LoadCell {
    fn default() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        Self {
            active_requests: AtomicU64::new(0),
            active_blocks: AtomicU64::new(0),
            prefill_blocks: AtomicU64::new(0),
            remote_requests: AtomicU64::new(0),
            remote_blocks: AtomicU64::new(0),
            remote_prefill: AtomicU64::new(0),
            id: NEXT.fetch_add(1, Ordering::Relaxed),
            capacity_blocks: AtomicU32::new(0),
            pinned_blocks: AtomicU32::new(0),
        }
    }
}

impl LoadCell {
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The load selection sees: this replica's bookings and the other replicas',
    /// added saturating: a peer's forged load of 2^64 − n must make the worker
    /// look full, never (wrapped around) idle.
    pub fn get(&self) -> Load {
        Load {
            active_requests: self
                .active_requests
                .load(Ordering::Relaxed)
                .saturating_add(self.remote_requests.load(Ordering::Relaxed)),
            active_blocks: self
                .active_blocks
                .load(Ordering::Relaxed)
                .saturating_add(self.remote_blocks.load(Ordering::Relaxed)),
            prefill_blocks: self
                .prefill_blocks
                .load(Ordering::Relaxed)
                .saturating_add(self.remote_prefill.load(Ordering::Relaxed)),
        }
    }

    /// This replica's bookings' load only (what it publishes to its peers).
    pub fn local(&self) -> Load {
        Load {
            active_requests: self.active_requests.load(Ordering::Relaxed),
            active_blocks: self.active_blocks.load(Ordering::Relaxed),
            prefill_blocks: self.prefill_blocks.load(Ordering::Relaxed),
        }
    }

    /// The other replicas' load, summed, as last set.
    pub fn remote(&self) -> Load {
        Load {
            active_requests: self.remote_requests.load(Ordering::Relaxed),
            active_blocks: self.remote_blocks.load(Ordering::Relaxed),
            prefill_blocks: self.remote_prefill.load(Ordering::Relaxed),
        }
    }

    /// What a booking knows of the worker's KV cache.
    pub fn residency(&self) -> Residency {
        Residency {
            capacity_blocks: self.capacity_blocks.load(Ordering::Relaxed),
            pinned_blocks: self.pinned_blocks.load(Ordering::Relaxed),
        }
    }

    /// Its KV capacity in blocks (`None`: unknown, or not to be anticipated).
    pub fn set_capacity_blocks(&self, blocks: Option<u64>) {
        let blocks = blocks.map_or(0, |b| u32::try_from(b).unwrap_or(u32::MAX));
        self.capacity_blocks.store(blocks, Ordering::Relaxed);
    }

    /// The distinct blocks its running requests pin (the gateway's in-flight credits).
    pub fn set_pinned_blocks(&self, blocks: usize) {
        let blocks = u32::try_from(blocks).unwrap_or(u32::MAX);
        self.pinned_blocks.store(blocks, Ordering::Relaxed);
    }

    /// Sets the other replicas' summed load (the replication task only).
    pub fn set_remote(&self, load: Load) {
        self.remote_requests
            .store(load.active_requests, Ordering::Relaxed);
        self.remote_blocks
            .store(load.active_blocks, Ordering::Relaxed);
        self.remote_prefill
            .store(load.prefill_blocks, Ordering::Relaxed);
    }

    pub fn add(&self, load: Load) {
        self.active_requests
            .fetch_add(load.active_requests, Ordering::Relaxed);
        self.active_blocks
            .fetch_add(load.active_blocks, Ordering::Relaxed);
        self.prefill_blocks
            .fetch_add(load.prefill_blocks, Ordering::Relaxed);
    }

    pub fn sub(&self, load: Load) {
        self.active_requests
            .fetch_sub(load.active_requests, Ordering::Relaxed);
        self.active_blocks
            .fetch_sub(load.active_blocks, Ordering::Relaxed);
        self.prefill_blocks
            .fetch_sub(load.prefill_blocks, Ordering::Relaxed);
    }
}

/// One registered worker as the table lists it.
#[derive(Debug)]
pub struct WorkerEntry {
    pub worker: Arc<Worker>,
    /// Its slot in the KV index.
    pub slot: Slot,
    pub load: Arc<LoadCell>,
    /// Its engine publishes signed 64-bit hashes (SGLang): a `kv.fetch` naming them
    /// must write them back signed. Learnt from its events; kept across re-registration.
    pub signed_hashes: Arc<AtomicBool>,
}

/// A worker as a role's candidate list holds it: what a booking reads of every
/// candidate, inline, in 64 bytes.
///
/// A booking reads each of a role's workers, every time. Through `Arc<WorkerEntry>` that
/// was three pointers to follow per worker (the entry, its `Worker`, its load cell): a
/// cache simulation of the booking bench (callgrind `--cache-sim=yes`) put about 270
/// first-level read misses a booking, some four per candidate, in the booking's own
/// code and the loads inlined into it, and `perf` put about two fifths of its samples on the
/// loads through a worker's pointers. Listed contiguously, the candidates
/// are a run of memory the processor prefetches, and each has one pointer left to
/// follow: its load cell.
#[derive(Debug, Clone)]
pub struct Listed {
    pub key: WorkerKey,
    pub slot: Slot,
    pub router_hint: bool,
    pub worker_type: Arc<str>,
    /// `worker_type` as the table numbers it, so a booking matches a worker with
    /// the peers that may supply it a copy without comparing strings (16 bits keep
    /// this entry in 64 bytes; past 65,535 distinct types, [`UNSHARED_TYPE`]).
    pub type_id: u16,
    pub source_control_endpoint: Arc<str>,
    pub load: Arc<LoadCell>,
}

impl Listed {
    /// The worker as the policy stages show it, read from this inline entry
    /// rather than through the worker's `Arc`.
    pub fn view(&self) -> WorkerView<'_> {
        WorkerView {
            key: self.key,
            router_hint: self.router_hint,
            worker_type: &self.worker_type,
            source_control_endpoint: &self.source_control_endpoint,
        }
    }

    fn of(entry: &WorkerEntry, type_id: u16) -> Self {
        Self {
            key: entry.worker.key,
            slot: entry.slot,
            router_hint: entry.worker.router_hint,
            worker_type: Arc::clone(&entry.worker.worker_type),
            type_id,
            source_control_endpoint: Arc::clone(&entry.worker.source_control_endpoint),
            load: Arc::clone(&entry.load),
        }
    }
}

/// The type number of every worker whose type is the 65,536th distinct one or later:
/// it matches no other worker, so such workers are never offered a peer's copy or
/// asked to supply one (no fleet has that many types; a wrong match would send a
/// copy between engines that cannot share KV blocks).
pub const UNSHARED_TYPE: u16 = u16::MAX;

/// What the table keeps per KV-index slot.
#[derive(Debug, Clone, Default)]
struct SlotInfo {
    entry: Option<Arc<WorkerEntry>>,
    /// The worker's `worker_type` as a number (equal numbers, equal types, but for
    /// [`UNSHARED_TYPE`]), so a booking matches a worker with its peers without
    /// comparing strings.
    type_id: u16,
    /// Whether the worker can be a copy's source (it takes hints and names a
    /// control endpoint peers pull from).
    donor: bool,
}

impl Keyed for Arc<WorkerEntry> {
    type Key = WorkerKey;
    fn key(&self) -> WorkerKey {
        self.worker.key
    }
}

impl Keyed for Listed {
    type Key = WorkerKey;
    fn key(&self) -> WorkerKey {
        self.key
    }
}

/// A role's candidates in key order: a persistent sequence whose leaves hold up to
/// 64 [`Listed`] contiguously.
pub type RoleList = SortedSeq<Listed>;

/// Every registered worker, sorted by key, and per role (candidates in key order, so
/// selection policies break ties by the lowest worker id, then dp rank).
///
/// Persistent: [`Self::with`] and [`Self::without`] return a new table that shares
/// every part the change does not touch, copying O(log n) nodes of at most 64
/// entries, so registering n workers one by one costs O(n log n), not O(n²).
#[derive(Debug, Default, Clone)]
pub struct WorkerTable {
    all: SortedSeq<Arc<WorkerEntry>>,
    by_role: [RoleList; 3],
    /// Indexed by KV-index slot, so a lookup's matches map to workers without a search.
    by_slot: SlotVec<SlotInfo>,
    /// The distinct worker types, in the order first seen (few: usually one).
    types: Arc<Vec<Arc<str>>>,
}

fn role_index(role: Role) -> usize {
    match role {
        Role::Aggregated => 0,
        Role::Prefill => 1,
        Role::Decode => 2,
    }
}

impl WorkerTable {
    pub fn from_entries(all: Vec<Arc<WorkerEntry>>) -> Self {
        all.into_iter()
            .fold(Self::default(), |table, entry| table.with(entry))
    }

    /// This table with `entry` added, or replacing the entry of its key.
    pub fn with(&self, entry: Arc<WorkerEntry>) -> Self {
        let mut table = self.without(entry.worker.key);
        let worker = &entry.worker;
        let type_id = match table.types.iter().position(|t| **t == *worker.worker_type) {
            Some(id) => id,
            None => {
                let mut types = Vec::clone(&table.types);
                types.push(Arc::clone(&worker.worker_type));
                table.types = Arc::new(types);
                table.types.len() - 1
            }
        };
        let type_id = u16::try_from(type_id)
            .ok()
            .filter(|&id| id != UNSHARED_TYPE)
            .unwrap_or(UNSHARED_TYPE);
        let role = role_index(worker.role);
        table.by_role[role] = table.by_role[role].upsert(Listed::of(&entry, type_id));
        table.by_slot = table.by_slot.set(
            entry.slot as usize,
            SlotInfo {
                entry: Some(Arc::clone(&entry)),
                type_id,
                donor: worker.router_hint && !worker.source_control_endpoint.is_empty(),
            },
        );
        table.all = table.all.upsert(entry);
        table
    }

    /// This table without the worker `key` (the same table, if it has none).
    pub fn without(&self, key: WorkerKey) -> Self {
        let Some(old) = self.all.get(key) else {
            return self.clone();
        };
        let mut table = self.clone();
        let role = role_index(old.worker.role);
        table.by_role[role] = table.by_role[role].remove(key);
        table.by_slot = table.by_slot.set(old.slot as usize, SlotInfo::default());
        table.all = table.all.remove(key);
        table
    }

    /// The worker in `slot` and, if it can be a copy's source (it takes hints and
    /// names a control endpoint peers pull from), its worker type's number: a
    /// booking reads this once per prefix holder, then matches each candidate's
    /// [`Listed::type_id`] against it without going back to the table.
    pub fn holder(&self, slot: Slot) -> Option<(&Arc<WorkerEntry>, Option<u16>)> {
        let info = self.by_slot.get(slot as usize)?;
        let entry = info.entry.as_ref()?;
        let donor = info.donor && info.type_id != UNSHARED_TYPE;
        Some((entry, donor.then_some(info.type_id)))
    }

    pub fn by_slot(&self, slot: Slot) -> Option<&Arc<WorkerEntry>> {
        self.by_slot.get(slot as usize)?.entry.as_ref()
    }

    /// Every worker, in key order.
    pub fn all(&self) -> impl Iterator<Item = &Arc<WorkerEntry>> {
        self.all.iter()
    }

    pub fn role(&self, role: Role) -> &RoleList {
        &self.by_role[role_index(role)]
    }

    /// `key`'s load cell if it is still the cell `id` (the worker was not
    /// deregistered since; re-registering keeps the cell).
    pub fn load_cell(&self, key: WorkerKey, id: u64) -> Option<&LoadCell> {
        self.get(key).map(|e| &*e.load).filter(|c| c.id() == id)
    }

    pub fn get(&self, key: WorkerKey) -> Option<&Arc<WorkerEntry>> {
        self.all.get(key)
    }

    pub fn len(&self) -> usize {
        self.all.len()
    }

    pub fn is_empty(&self) -> bool {
        self.all.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::{Listed, Load, LoadCell, Residency};

    /// Of a cached prefix, what fits beside the blocks running requests pin
    /// survives; blocks the request's own prefix has pinned always do; an
    /// unknown capacity anticipates nothing.
    #[test]
    fn a_cached_prefix_counts_only_what_the_capacity_leaves_beside_the_pinned_blocks() {
        let cell = LoadCell::default();
        assert_eq!(cell.residency().surviving(40, 0), 40, "capacity unknown");
        cell.set_capacity_blocks(Some(64));
        assert_eq!(cell.residency().surviving(40, 0), 40, "nothing running");
        cell.set_pinned_blocks(45);
        assert_eq!(cell.residency().surviving(40, 0), 19);
        assert_eq!(
            cell.residency().surviving(10, 0),
            10,
            "small enough to stay"
        );
        // 30 of the prefix's blocks are the running requests' own: pinned, and
        // counted among the 45; 19 unpinned ones fit beside them.
        assert_eq!(cell.residency().surviving(40, 30), 40);
        cell.set_pinned_blocks(70);
        assert_eq!(cell.residency().surviving(40, 0), 0, "pinned past capacity");
        assert_eq!(cell.residency().surviving(40, 30), 30);
        assert_eq!(cell.residency().surviving(20, 30), 20);
        cell.set_capacity_blocks(None);
        assert_eq!(cell.residency().surviving(40, 0), 40, "anticipation off");
        cell.set_capacity_blocks(Some(u64::MAX));
        assert_eq!(
            cell.residency(),
            Residency {
                capacity_blocks: u32::MAX,
                pinned_blocks: 70
            }
        );
    }

    /// A cell is one cache line: the remote sums sit beside the local load.
    #[test]
    fn a_load_cell_is_one_cache_line_and_adds_the_remote_sum() {
        assert_eq!(std::mem::size_of::<LoadCell>(), 64);
        let cell = LoadCell::default();
        let one = Load {
            active_requests: 1,
            active_blocks: 4,
            prefill_blocks: 2,
        };
        cell.add(one);
        cell.set_remote(one.plus(one));
        assert_eq!(cell.local(), one);
        assert_eq!(cell.get().active_requests, 3);
        cell.sub(one);
        assert_eq!(cell.get(), one.plus(one));
    }

    /// A forged remote load near 2^64 (issue 44: 2^64 − n made a busy worker
    /// look idle and drew bookings to it) saturates instead of wrapping.
    #[test]
    fn a_remote_load_near_the_top_saturates_and_never_wraps_to_idle() {
        let cell = LoadCell::default();
        cell.add(Load {
            active_requests: 5,
            active_blocks: 50,
            prefill_blocks: 20,
        });
        cell.set_remote(Load {
            active_requests: u64::MAX - 2,
            active_blocks: u64::MAX - 10,
            prefill_blocks: u64::MAX,
        });
        assert_eq!(
            cell.get(),
            Load {
                active_requests: u64::MAX,
                active_blocks: u64::MAX,
                prefill_blocks: u64::MAX,
            }
        );
    }

    /// The candidate list is read whole by every booking: a field added to `Listed`
    /// should be worth the bytes every booking then reads per worker.
    #[test]
    #[cfg(target_pointer_width = "64")]
    fn a_listed_candidate_is_64_bytes() {
        assert_eq!(std::mem::size_of::<Listed>(), 64);
    }
}
