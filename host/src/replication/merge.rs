//! The replication protocol's pure logic: what a replica publishes (its [`Outbox`])
//! and how it folds its peers' messages into summed load ([`Merge`]).
//!
//! No clock, socket or thread here: the caller passes the time in, so the model test
//! drives it with a fake bus that drops, duplicates and reorders messages. Loads are
//! absolute totals per worker, stamped with the sender's incarnation and sequence: a
//! newer value replaces an older one and an older one is ignored, so a lost message
//! is corrected by the next one naming the worker (at the latest the periodic digest),
//! and a repeated or late one changes nothing.

use crate::domain::Role;
use crate::router::workers::Load;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

/// A worker as replicas name it to each other: by its registered identity, never by
/// a replica's local slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct WorkerId {
    pub role: Role,
    pub worker_id: u64,
    pub dp_rank: u32,
}

/// One worker's load in a message: `[role, worker_id, dp_rank, requests, blocks,
/// prefill blocks]` on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry(pub Role, pub u64, pub u32, pub u64, pub u64, pub u64);

impl Entry {
    pub fn new(id: WorkerId, load: Load) -> Self {
        Entry(
            id.role,
            id.worker_id,
            id.dp_rank,
            load.active_requests,
            load.active_blocks,
            load.prefill_blocks,
        )
    }

    pub fn id(&self) -> WorkerId {
        WorkerId {
            role: self.0,
            worker_id: self.1,
            dp_rank: self.2,
        }
    }

    pub fn load(&self) -> Load {
        Load {
            active_requests: self.3,
            active_blocks: self.4,
            prefill_blocks: self.5,
        }
    }
}

/// What a message says.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Body {
    /// The workers whose load changed since the last message, with their totals
    /// (zero for a worker with no load left).
    Delta { loads: Vec<Entry> },
    /// Every worker with load: workers not listed carry none. Also the heartbeat;
    /// `peers` are the replicas the sender hears, so a joiner knows whom to wait for.
    Digest {
        loads: Vec<Entry>,
        peers: Vec<String>,
    },
    /// A joiner (or a replica back on the bus) asks every peer for a digest.
    Hello,
    /// A replica shutting down: drop it now.
    Goodbye,
}

/// One message on the fleet's subject.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    pub replica: String,
    /// Larger on every start: a restart under the same name replaces its old self.
    pub incarnation: u64,
    /// Per incarnation, one more for every message.
    pub seq: u64,
    pub block_size: u64,
    /// Of the config's policies and the plugin set (see `replication::fingerprint`).
    pub fingerprint: u64,
    /// When the sender saw the change, in microseconds since the Unix epoch (for
    /// the propagation-lag metric).
    pub sent_us: u64,
    #[serde(flatten)]
    pub body: Body,
}

/// What a replica publishes: its local totals as last published, and its sequence.
#[derive(Debug)]
pub struct Outbox {
    pub replica: String,
    pub incarnation: u64,
    pub block_size: u64,
    seq: u64,
    published: HashMap<WorkerId, Load>,
}

impl Outbox {
    pub fn new(replica: impl Into<String>, incarnation: u64, block_size: u64) -> Self {
        Self {
            replica: replica.into(),
            incarnation,
            block_size,
            seq: 0,
            published: HashMap::new(),
        }
    }

    /// The workers whose load differs from what was last published (a worker gone
    /// from `current`, or back to zero, is published as zero once). Recorded as
    /// published.
    pub fn changes(&mut self, current: &[(WorkerId, Load)]) -> Vec<Entry> {
        let mut out = Vec::new();
        let mut seen = BTreeSet::new();
        for (id, load) in current {
            seen.insert(*id);
            let before = self.published.get(id).copied().unwrap_or_default();
            if before != *load {
                out.push(Entry::new(*id, *load));
                if load.is_zero() {
                    self.published.remove(id);
                } else {
                    self.published.insert(*id, *load);
                }
            }
        }
        let gone: Vec<WorkerId> = self
            .published
            .keys()
            .filter(|id| !seen.contains(id))
            .copied()
            .collect();
        for id in gone {
            self.published.remove(&id);
            out.push(Entry::new(id, Load::default()));
        }
        out
    }

    /// Every worker with load, as published.
    pub fn digest(&self) -> Vec<Entry> {
        let mut loads: Vec<Entry> = self
            .published
            .iter()
            .map(|(id, load)| Entry::new(*id, *load))
            .collect();
        loads.sort_by_key(|e| e.id());
        loads
    }

    /// `body` as the next message.
    pub fn message(&mut self, body: Body, fingerprint: u64, sent_us: u64) -> Message {
        self.seq += 1;
        Message {
            replica: self.replica.clone(),
            incarnation: self.incarnation,
            seq: self.seq,
            block_size: self.block_size,
            fingerprint,
            sent_us,
            body,
        }
    }
}

/// One peer as a replica knows it.
#[derive(Debug)]
struct Peer {
    incarnation: u64,
    /// The highest sequence received.
    seq: u64,
    last_seen: Instant,
    fingerprint: u64,
    /// Each worker's total and the sequence of the message that set it.
    loads: HashMap<WorkerId, (Load, u64)>,
    /// A digest has arrived since this incarnation was first heard.
    synced: bool,
    /// The newest digest's sequence: every worker it did not list had no load then,
    /// so an older message about one (reordered) is stale even if it is the first
    /// heard about that worker.
    digest_seq: u64,
}

/// Why a peer's messages are ignored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    pub block_size: u64,
    pub last_seen: Instant,
}

/// Counts the merge keeps (the metrics read them).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct MergeStats {
    /// Worker totals a digest changed for a peer already in sync: a message was lost.
    pub corrections: u64,
    /// Peers dropped after falling silent.
    pub dropped_silent: u64,
    /// Peers that said goodbye.
    pub left: u64,
    /// Peers replaced by a newer incarnation under the same name.
    pub replaced: u64,
    /// Messages ignored for another block size.
    pub refused_block_size: u64,
    /// Messages ignored for a replica name over [`MAX_NAME_BYTES`].
    pub refused_name: u64,
    /// Messages ignored from a new peer while [`MAX_PEERS`] are summed.
    pub refused_peers: u64,
    /// Messages from a peer whose config or plugin set differs (applied; warned).
    pub fingerprint_mismatches: u64,
    pub messages: u64,
}

/// What one message did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    /// Workers whose summed load changed.
    pub changed: Vec<WorkerId>,
    /// The sender asked for state: publish a digest.
    pub send_digest: bool,
    /// The sender is heard without its full state: ask for a digest.
    pub want_sync: bool,
    /// The sender was refused for its block size (first time for this incarnation).
    pub refused: bool,
    /// The sender's config or plugins differ (first time for this incarnation).
    pub fingerprint_mismatch: bool,
}

/// A peer as `/admin/status` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PeerStatus {
    pub name: String,
    pub incarnation: u64,
    pub last_message_age_ms: u64,
    pub workers_with_load: usize,
    pub synced: bool,
    pub same_config: bool,
}

/// Goodbyes remembered at once at most: a flood of goodbyes under made-up
/// names must not grow a replica without bound.
pub const MAX_GONE: usize = 4_096;

/// The longest replica name taken; a message from a longer one is dropped.
pub const MAX_NAME_BYTES: usize = 256;

/// Peers summed at once at most. A fleet has a handful of replicas; made-up
/// peers past this are not taken, so a digest (which names the peers heard)
/// stays far below NATS's 1 MiB payload: 256 names of at most 256 bytes.
pub const MAX_PEERS: usize = 256;

/// The peers' load as this replica sums it.
#[derive(Debug)]
pub struct Merge {
    me: String,
    block_size: u64,
    fingerprint: u64,
    peer_timeout: Duration,
    peers: BTreeMap<String, Peer>,
    /// Peers gone by goodbye: (incarnation, last sequence, when), so a late
    /// message of theirs does not bring them back. Kept for a peer timeout
    /// only (a late message comes within it; a goodbye forged with sequence
    /// u64::MAX silences a name no longer than that), and at most
    /// [`MAX_GONE`] of them.
    gone: HashMap<String, (u64, u64, Instant)>,
    refused: BTreeMap<String, Refused>,
    sums: HashMap<WorkerId, Load>,
    stats: MergeStats,
    started: Instant,
    sync_timeout: Duration,
    answered: BTreeSet<String>,
    mentioned: BTreeSet<String>,
    ready: bool,
}

impl Merge {
    pub fn new(
        me: impl Into<String>,
        block_size: u64,
        fingerprint: u64,
        peer_timeout: Duration,
        sync_timeout: Duration,
        now: Instant,
    ) -> Self {
        Self {
            me: me.into(),
            block_size,
            fingerprint,
            peer_timeout,
            peers: BTreeMap::new(),
            gone: HashMap::new(),
            refused: BTreeMap::new(),
            sums: HashMap::new(),
            stats: MergeStats::default(),
            started: now,
            sync_timeout,
            answered: BTreeSet::new(),
            mentioned: BTreeSet::new(),
            ready: false,
        }
    }

    /// The config and plugin set changed here (a reload).
    pub fn set_fingerprint(&mut self, fingerprint: u64) {
        self.fingerprint = fingerprint;
    }

    /// Back on the bus after being cut off: the answers are collected afresh. A
    /// replica that was ready stays ready (it books on its own view meanwhile, as it
    /// did while cut off); one still joining waits again from now.
    pub fn rejoin(&mut self, now: Instant) {
        self.answered.clear();
        self.mentioned.clear();
        if !self.ready {
            self.started = now;
        }
    }

    pub fn stats(&self) -> MergeStats {
        self.stats
    }

    /// The other replicas' load on `id`, summed.
    pub fn sum(&self, id: &WorkerId) -> Load {
        self.sums.get(id).copied().unwrap_or_default()
    }

    /// Every worker some peer has load on, with the sum.
    pub fn sums(&self) -> impl Iterator<Item = (&WorkerId, &Load)> {
        self.sums.iter().filter(|(_, l)| !l.is_zero())
    }

    /// Joined: every peer any answer named has answered, or the wait is over.
    pub fn is_ready(&mut self, now: Instant) -> bool {
        if !self.ready {
            let all_answered = !self.answered.is_empty()
                && self
                    .mentioned
                    .iter()
                    .all(|p| *p == self.me || self.answered.contains(p));
            self.ready = all_answered || now.duration_since(self.started) >= self.sync_timeout;
        }
        self.ready
    }

    pub fn peers(&self, now: Instant) -> Vec<PeerStatus> {
        self.peers
            .iter()
            .map(|(name, p)| PeerStatus {
                name: name.clone(),
                incarnation: p.incarnation,
                last_message_age_ms: now.duration_since(p.last_seen).as_millis() as u64,
                workers_with_load: p.loads.values().filter(|(l, _)| !l.is_zero()).count(),
                synced: p.synced,
                same_config: p.fingerprint == self.fingerprint,
            })
            .collect()
    }

    /// Peers refused for their block size, heard within the peer timeout.
    pub fn refused(&self, now: Instant) -> Vec<(String, u64)> {
        self.refused
            .iter()
            .filter(|(_, r)| now.duration_since(r.last_seen) < self.peer_timeout)
            .map(|(n, r)| (n.clone(), r.block_size))
            .collect()
    }

    /// Folds one message in.
    pub fn receive(&mut self, message: &Message, now: Instant) -> Outcome {
        let mut out = Outcome::default();
        if message.replica == self.me {
            return out;
        }
        self.stats.messages += 1;
        if message.replica.len() > MAX_NAME_BYTES {
            self.stats.refused_name += 1;
            return out;
        }
        if message.block_size != self.block_size {
            self.stats.refused_block_size += 1;
            let first = self
                .refused
                .insert(
                    message.replica.clone(),
                    Refused {
                        block_size: message.block_size,
                        last_seen: now,
                    },
                )
                .is_none_or(|r| r.block_size != message.block_size);
            out.refused = first;
            return out;
        }
        self.refused.remove(&message.replica);
        if let Some(&(incarnation, seq, _)) = self.gone.get(&message.replica) {
            if message.incarnation < incarnation
                || (message.incarnation == incarnation && message.seq <= seq)
            {
                return out;
            }
            self.gone.remove(&message.replica);
        }
        // A newer incarnation replaces the old self at once; an older one is a ghost.
        let fresh = match self.peers.get(&message.replica) {
            Some(peer) if message.incarnation < peer.incarnation => return out,
            Some(peer) if message.incarnation > peer.incarnation => {
                self.stats.replaced += 1;
                out.changed = self.drop_peer(&message.replica);
                true
            }
            Some(_) => false,
            None if self.peers.len() >= MAX_PEERS => {
                self.stats.refused_peers += 1;
                return out;
            }
            None => true,
        };
        if fresh {
            self.peers.insert(
                message.replica.clone(),
                Peer {
                    incarnation: message.incarnation,
                    seq: 0,
                    last_seen: now,
                    fingerprint: message.fingerprint,
                    loads: HashMap::new(),
                    synced: false,
                    digest_seq: 0,
                },
            );
            if message.fingerprint != self.fingerprint {
                self.stats.fingerprint_mismatches += 1;
                out.fingerprint_mismatch = true;
            }
        }
        let Some(peer) = self.peers.get_mut(&message.replica) else {
            return out;
        };
        peer.last_seen = now;
        peer.seq = peer.seq.max(message.seq);
        if peer.fingerprint != message.fingerprint {
            peer.fingerprint = message.fingerprint;
            if message.fingerprint != self.fingerprint {
                self.stats.fingerprint_mismatches += 1;
                out.fingerprint_mismatch = true;
            }
        }
        let mut touched = Vec::new();
        match &message.body {
            Body::Delta { loads } => {
                for entry in loads {
                    let slot = peer.loads.entry(entry.id()).or_default();
                    if message.seq > slot.1.max(peer.digest_seq) {
                        if slot.0 != entry.load() {
                            touched.push(entry.id());
                        }
                        *slot = (entry.load(), message.seq);
                    }
                }
                out.want_sync = !peer.synced;
            }
            Body::Digest { loads, peers } => {
                let synced = peer.synced;
                let listed: HashMap<WorkerId, Load> =
                    loads.iter().map(|e| (e.id(), e.load())).collect();
                let floor = peer.digest_seq;
                for (id, load) in &listed {
                    let slot = peer.loads.entry(*id).or_default();
                    if message.seq > slot.1.max(floor) {
                        if slot.0 != *load {
                            touched.push(*id);
                        }
                        *slot = (*load, message.seq);
                    }
                }
                for (id, slot) in peer.loads.iter_mut() {
                    if !listed.contains_key(id) && message.seq > slot.1 {
                        if !slot.0.is_zero() {
                            touched.push(*id);
                        }
                        *slot = (Load::default(), message.seq);
                    }
                }
                if synced {
                    self.stats.corrections += touched.len() as u64;
                }
                peer.digest_seq = peer.digest_seq.max(message.seq);
                peer.synced = true;
                self.answered.insert(message.replica.clone());
                self.mentioned.extend(peers.iter().cloned());
            }
            Body::Hello => {
                out.send_digest = true;
                out.want_sync = !peer.synced;
            }
            Body::Goodbye => {
                if self.gone.len() < MAX_GONE || self.gone.contains_key(&message.replica) {
                    self.gone.insert(
                        message.replica.clone(),
                        (message.incarnation, message.seq, now),
                    );
                }
                self.stats.left += 1;
                let dropped = self.drop_peer(&message.replica);
                out.changed.extend(dropped);
                return out;
            }
        }
        for id in &touched {
            self.recompute(*id);
        }
        out.changed.extend(touched);
        out
    }

    /// Drops the peers silent longer than the timeout, and goodbyes older than
    /// it; the workers whose sums changed.
    pub fn expire(&mut self, now: Instant) -> Vec<WorkerId> {
        let timeout = self.peer_timeout;
        self.gone
            .retain(|_, (_, _, at)| now.duration_since(*at) <= timeout);
        let silent: Vec<String> = self
            .peers
            .iter()
            .filter(|(_, p)| now.duration_since(p.last_seen) > self.peer_timeout)
            .map(|(n, _)| n.clone())
            .collect();
        let mut changed = Vec::new();
        for name in silent {
            self.stats.dropped_silent += 1;
            changed.extend(self.drop_peer(&name));
        }
        changed
    }

    /// Removes a peer and recomputes the sums it contributed to.
    fn drop_peer(&mut self, name: &str) -> Vec<WorkerId> {
        let Some(peer) = self.peers.remove(name) else {
            return Vec::new();
        };
        self.answered.remove(name);
        let ids: Vec<WorkerId> = peer
            .loads
            .iter()
            .filter(|(_, (l, _))| !l.is_zero())
            .map(|(id, _)| *id)
            .collect();
        for id in &ids {
            self.recompute(*id);
        }
        ids
    }

    fn recompute(&mut self, id: WorkerId) {
        let sum = self
            .peers
            .values()
            .filter_map(|p| p.loads.get(&id))
            .fold(Load::default(), |sum, (l, _)| sum.plus(*l));
        if sum.is_zero() {
            self.sums.remove(&id);
        } else {
            self.sums.insert(id, sum);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small deterministic generator (xorshift64*), so a failing run replays.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
        fn chance(&mut self, percent: u64) -> bool {
            self.below(100) < percent
        }
    }

    const BLOCK: u64 = 16;
    const LONG: Duration = Duration::from_secs(3600);

    fn worker(i: u64) -> WorkerId {
        WorkerId {
            role: if i.is_multiple_of(2) {
                Role::Aggregated
            } else {
                Role::Decode
            },
            worker_id: i / 2,
            dp_rank: (i % 3) as u32,
        }
    }

    /// One replica of the model: its truth (local bookings' load), what it
    /// publishes, and what it merges.
    struct Replica {
        truth: BTreeMap<WorkerId, Load>,
        outbox: Outbox,
        merge: Merge,
    }

    impl Replica {
        fn new(name: &str, incarnation: u64, now: Instant) -> Self {
            Self {
                truth: BTreeMap::new(),
                outbox: Outbox::new(name, incarnation, BLOCK),
                merge: Merge::new(name, BLOCK, 7, LONG, Duration::ZERO, now),
            }
        }
        fn current(&self) -> Vec<(WorkerId, Load)> {
            self.truth.iter().map(|(k, v)| (*k, *v)).collect()
        }
        fn tick(&mut self) -> Option<Message> {
            let loads = self.outbox.changes(&self.current());
            (!loads.is_empty()).then(|| self.outbox.message(Body::Delta { loads }, 7, 0))
        }
        fn digest(&mut self) -> Message {
            self.tick();
            let loads = self.outbox.digest();
            self.outbox.message(
                Body::Digest {
                    loads,
                    peers: vec![],
                },
                7,
                0,
            )
        }
    }

    /// The fake bus: every message a replica sends is copied to each other replica,
    /// and each copy may be dropped, duplicated, and delivered in any order.
    struct Bus {
        pending: Vec<(usize, Message)>,
    }

    impl Bus {
        fn send(&mut self, rng: &mut Rng, from: usize, n: usize, message: Message, lossy: bool) {
            for to in (0..n).filter(|t| *t != from) {
                if lossy && rng.chance(20) {
                    continue;
                }
                self.pending.push((to, message.clone()));
                if rng.chance(10) {
                    self.pending.push((to, message.clone()));
                }
            }
        }
        /// A random pending message, taken off the bus.
        fn take(&mut self, rng: &mut Rng) -> Option<(usize, Message)> {
            if self.pending.is_empty() {
                return None;
            }
            let at = rng.below(self.pending.len() as u64) as usize;
            Some(self.pending.swap_remove(at))
        }
    }

    fn expected(replicas: &[Replica], me: usize, id: &WorkerId) -> Load {
        replicas
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != me)
            .fold(Load::default(), |sum, (_, r)| {
                sum.plus(r.truth.get(id).copied().unwrap_or_default())
            })
    }

    /// The model: replicas change their load, publish deltas and digests, and
    /// restart under the same name, over a bus that drops, duplicates and reorders;
    /// once the dust settles (each publishes a digest, delivered with every stale
    /// message still in flight, in any order), every replica's sums are the truth.
    #[test]
    fn views_converge_to_the_truth_over_a_bus_that_drops_duplicates_and_reorders() {
        for seed in 1..=500u64 {
            let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
            let now = Instant::now();
            let n = 2 + (seed % 3) as usize;
            let names: Vec<String> = (0..n).map(|i| format!("r{i}")).collect();
            let mut incarnation = 1;
            let mut replicas: Vec<Replica> =
                names.iter().map(|n| Replica::new(n, 1, now)).collect();
            let mut bus = Bus { pending: vec![] };
            for _ in 0..400 {
                let r = rng.below(n as u64) as usize;
                match rng.below(10) {
                    0..=3 => {
                        let id = worker(rng.below(6));
                        let load = if rng.chance(25) {
                            Load::default()
                        } else {
                            Load {
                                active_requests: rng.below(5),
                                active_blocks: rng.below(100),
                                prefill_blocks: rng.below(50),
                            }
                        };
                        replicas[r].truth.insert(id, load);
                    }
                    4..=5 => {
                        if let Some(m) = replicas[r].tick() {
                            bus.send(&mut rng, r, n, m, true);
                        }
                    }
                    6 => {
                        let m = replicas[r].digest();
                        bus.send(&mut rng, r, n, m, true);
                    }
                    7 if rng.chance(10) => {
                        // Restart under the same name: a newer incarnation, no load.
                        incarnation += 1;
                        replicas[r] = Replica::new(&names[r], incarnation, now);
                    }
                    _ => {
                        for _ in 0..3 {
                            if let Some((to, m)) = bus.take(&mut rng) {
                                replicas[to].merge.receive(&m, now);
                            }
                        }
                    }
                }
            }
            // Settle: a digest from everyone, delivered without loss among the
            // stale messages still in flight.
            for (r, replica) in replicas.iter_mut().enumerate() {
                let m = replica.digest();
                bus.send(&mut rng, r, n, m, false);
            }
            while let Some((to, m)) = bus.take(&mut rng) {
                replicas[to].merge.receive(&m, now);
            }
            for me in 0..n {
                for w in 0..6 {
                    let id = worker(w);
                    assert_eq!(
                        replicas[me].merge.sum(&id),
                        expected(&replicas, me, &id),
                        "seed {seed}: replica {me}'s view of {id:?}"
                    );
                }
            }
        }
    }

    /// Over a reliable, ordered bus, digests correct nothing: a correction means a
    /// message was lost.
    #[test]
    fn an_ordered_lossless_bus_needs_no_correction() {
        let now = Instant::now();
        let mut a = Replica::new("a", 1, now);
        let mut b = Replica::new("b", 1, now);
        let mut rng = Rng(99);
        for _ in 0..500 {
            let id = worker(rng.below(4));
            a.truth.insert(
                id,
                Load {
                    active_requests: rng.below(3),
                    ..Load::default()
                },
            );
            if let Some(m) = a.tick() {
                b.merge.receive(&m, now);
            }
            if rng.chance(10) {
                b.merge.receive(&a.digest(), now);
            }
        }
        assert_eq!(b.merge.stats().corrections, 0);
        for w in 0..4 {
            let id = worker(w);
            assert_eq!(
                b.merge.sum(&id),
                a.truth.get(&id).copied().unwrap_or_default()
            );
        }
    }

    fn one(requests: u64) -> Load {
        Load {
            active_requests: requests,
            active_blocks: requests * 4,
            prefill_blocks: 0,
        }
    }

    /// A silent peer leaves the sums after the timeout; one that says goodbye at
    /// once; a restart under the same name replaces its old self at once.
    #[test]
    fn silent_departed_and_restarted_peers_leave_the_sums() {
        let t0 = Instant::now();
        let timeout = Duration::from_secs(3);
        let mut merge = Merge::new("me", BLOCK, 7, timeout, Duration::ZERO, t0);
        let mut a = Outbox::new("a", 1, BLOCK);
        let mut b = Outbox::new("b", 1, BLOCK);
        let id = worker(0);
        let delta = |o: &mut Outbox, n| {
            let loads = o.changes(&[(id, one(n))]);
            o.message(Body::Delta { loads }, 7, 0)
        };
        merge.receive(&delta(&mut a, 2), t0);
        merge.receive(&delta(&mut b, 3), t0);
        assert_eq!(merge.sum(&id), one(5));
        // `a` falls silent; `b` keeps talking.
        let later = t0 + Duration::from_secs(2);
        merge.receive(&delta(&mut b, 4), later);
        assert!(merge.expire(later).is_empty());
        let changed = merge.expire(t0 + Duration::from_millis(3_100));
        assert_eq!(changed, vec![id]);
        assert_eq!(merge.sum(&id), one(4));
        assert_eq!(merge.stats().dropped_silent, 1);
        // `b` restarts under its name with one booking: its old self's 4 go at once.
        let mut b2 = Outbox::new("b", 2, BLOCK);
        merge.receive(&delta(&mut b2, 1), later);
        assert_eq!(merge.sum(&id), one(1));
        assert_eq!(merge.stats().replaced, 1);
        // A late message of the old incarnation changes nothing.
        merge.receive(&delta(&mut b, 9), later);
        assert_eq!(merge.sum(&id), one(1));
        // Goodbye: gone at once, and a late message does not bring it back.
        let bye = b2.message(Body::Goodbye, 7, 0);
        let stale = delta(&mut b2, 6);
        let mut stale_before = stale.clone();
        stale_before.seq = bye.seq - 1;
        merge.receive(&bye, later);
        assert_eq!(merge.sum(&id), Load::default());
        merge.receive(&stale_before, later);
        assert_eq!(merge.sum(&id), Load::default());
        assert_eq!(merge.stats().left, 1);
    }

    /// Issue 44: a goodbye forged with sequence u64::MAX silenced a live replica
    /// for good, and goodbyes under made-up names grew a replica without bound.
    #[test]
    fn goodbyes_are_forgotten_after_a_peer_timeout_and_goodbyes_names_and_peers_bounded() {
        let t0 = Instant::now();
        let timeout = Duration::from_secs(5);
        let mut merge = Merge::new("a", BLOCK, 7, timeout, Duration::ZERO, t0);
        let mut b = Outbox::new("b", 1, BLOCK);
        let id = worker(1);
        let mut forged = b.message(Body::Goodbye, 7, 0);
        forged.seq = u64::MAX;
        merge.receive(&forged, t0);
        // Within the timeout, b's messages are taken for late ones.
        let mut live = Outbox::new("b", 1, BLOCK);
        let delta = |o: &mut Outbox, requests| {
            let loads = o.changes(&[(id, one(requests))]);
            o.message(Body::Delta { loads }, 7, 0)
        };
        merge.receive(&delta(&mut live, 2), t0 + Duration::from_secs(1));
        assert_eq!(merge.sum(&id), Load::default());
        // Past it, the goodbye is forgotten and b counts again.
        merge.expire(t0 + Duration::from_secs(6));
        merge.receive(&delta(&mut live, 3), t0 + Duration::from_secs(6));
        assert_eq!(merge.sum(&id), one(3));
        // A flood of goodbyes under made-up names: at most MAX_GONE remembered.
        for i in 0..(MAX_GONE + 500) {
            let mut bye = Outbox::new(format!("ghost-{i}"), 1, BLOCK);
            merge.receive(
                &bye.message(Body::Goodbye, 7, 0),
                t0 + Duration::from_secs(7),
            );
        }
        assert_eq!(merge.gone.len(), MAX_GONE);
        merge.expire(t0 + Duration::from_secs(20));
        assert!(merge.gone.is_empty());
        // Past MAX_PEERS live peers, a new one is not taken.
        for i in 0..(MAX_PEERS + 10) {
            let mut peer = Outbox::new(format!("peer-{i}"), 1, BLOCK);
            merge.receive(
                &peer.message(Body::Hello, 7, 0),
                t0 + Duration::from_secs(20),
            );
        }
        assert_eq!(merge.peers.len(), MAX_PEERS);
        assert_eq!(merge.stats().refused_peers, 10);
        // A name over the bound is not taken.
        let mut long = Outbox::new("x".repeat(MAX_NAME_BYTES + 1), 1, BLOCK);
        let loads = long.changes(&[(worker(2), one(1))]);
        merge.receive(
            &long.message(Body::Delta { loads }, 7, 0),
            t0 + Duration::from_secs(20),
        );
        assert_eq!(merge.sum(&worker(2)), Load::default());
        assert_eq!(merge.stats().refused_name, 1);
    }

    /// A peer with another block size is refused (its load never counts); another
    /// config is applied but flagged.
    #[test]
    fn another_block_size_is_refused_and_another_config_is_flagged() {
        let now = Instant::now();
        let mut merge = Merge::new("me", BLOCK, 7, LONG, Duration::ZERO, now);
        let id = worker(1);
        let mut odd = Outbox::new("odd", 1, 32);
        let loads = odd.changes(&[(id, one(3))]);
        let outcome = merge.receive(&odd.message(Body::Delta { loads }, 7, 0), now);
        assert!(outcome.refused);
        assert_eq!(merge.sum(&id), Load::default());
        assert_eq!(merge.refused(now), vec![("odd".to_string(), 32)]);
        assert_eq!(merge.stats().refused_block_size, 1);
        let mut other = Outbox::new("other", 1, BLOCK);
        let loads = other.changes(&[(id, one(2))]);
        let outcome = merge.receive(&other.message(Body::Delta { loads }, 8, 0), now);
        assert!(outcome.fingerprint_mismatch && !outcome.refused);
        assert_eq!(merge.sum(&id), one(2));
        assert!(!merge.peers(now)[0].same_config);
    }

    /// A joiner is ready once every peer any answer names has answered, or when the
    /// wait is over.
    #[test]
    fn a_joiner_is_ready_when_every_named_peer_answered_or_the_wait_is_over() {
        let t0 = Instant::now();
        let wait = Duration::from_millis(500);
        let mut merge = Merge::new("me", BLOCK, 7, LONG, wait, t0);
        assert!(!merge.is_ready(t0));
        let digest = |name: &str, peers: &[&str]| {
            let mut o = Outbox::new(name, 1, BLOCK);
            o.message(
                Body::Digest {
                    loads: vec![],
                    peers: peers.iter().map(|p| p.to_string()).collect(),
                },
                7,
                0,
            )
        };
        merge.receive(&digest("a", &["b", "me"]), t0);
        assert!(!merge.is_ready(t0), "b is named and has not answered");
        merge.receive(&digest("b", &["a"]), t0);
        assert!(merge.is_ready(t0));
        let mut alone = Merge::new("me", BLOCK, 7, LONG, wait, t0);
        assert!(!alone.is_ready(t0 + Duration::from_millis(100)));
        assert!(alone.is_ready(t0 + wait));
    }

    /// Messages round-trip through JSON, the wire format.
    #[test]
    fn a_message_round_trips_through_json() {
        let mut o = Outbox::new("a", 5, BLOCK);
        let loads = o.changes(&[(worker(3), one(2))]);
        let m = o.message(Body::Delta { loads }, 11, 123);
        let text = serde_json::to_string(&m).unwrap_or_default();
        let back: Message = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert_eq!(back, m);
    }
}
