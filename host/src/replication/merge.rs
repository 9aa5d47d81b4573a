//! The replication protocol's pure logic: what a replica publishes (its [`Outbox`])
//! and how it folds its peers' messages into summed load ([`Merge`]).
//!
//! No clock, socket or thread here: the caller passes the time in, so the model test
//! drives it with a fake bus that drops, duplicates and reorders messages. Loads are
//! absolute totals per worker, stamped with the sender's incarnation and sequence: a
//! newer value replaces an older one and an older one is ignored, so a lost message
//! is corrected by the next one naming the worker (at the latest the periodic digest),
//! and a repeated or late one changes nothing.
//!
//! Every message fits the NATS server's max payload: a delta too large for one
//! is sent as several (each entry stands alone), and a digest too large for one
//! as `digest_part`s, each the whole truth about a contiguous range of workers
//! (see [`Body::DigestPart`]).

use crate::domain::Role;
use crate::router::workers::Load;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ops::Bound;
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
    /// One part of a digest too large for one message: every worker with load
    /// in the range `from` (inclusive; none in the first part) to `to`
    /// (exclusive; none in the last part), in [`WorkerId`] order. The parts of
    /// one digest share its sequence and cover every worker between them, so
    /// each is a digest of its range and needs none of the others: a lost part
    /// leaves its range as it was until the next digest, a repeated one changes
    /// nothing. `peers` is in the first part only. Only a digest over the max
    /// payload is sent so: replicas that predate parts cannot read them (they
    /// count a decode error), and they never received such a digest anyway.
    DigestPart {
        loads: Vec<Entry>,
        peers: Vec<String>,
        from: Option<WorkerId>,
        to: Option<WorkerId>,
        part: u32,
        parts: u32,
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
        self.stamped(body, self.seq, fingerprint, sent_us)
    }

    fn stamped(&self, body: Body, seq: u64, fingerprint: u64, sent_us: u64) -> Message {
        Message {
            replica: self.replica.clone(),
            incarnation: self.incarnation,
            seq,
            block_size: self.block_size,
            fingerprint,
            sent_us,
            body,
        }
    }

    /// `loads` (from [`Self::changes`]) as delta messages, encoded, each at most
    /// `max_bytes`: one when they fit. Each entry is a total on its own, so any
    /// split is sound. `None` when one entry alone does not fit.
    pub fn delta_messages(
        &mut self,
        loads: Vec<Entry>,
        fingerprint: u64,
        sent_us: u64,
        max_bytes: usize,
    ) -> Option<Vec<Vec<u8>>> {
        let next = self.seq + 1;
        let whole = self.stamped(Body::Delta { loads }, next, fingerprint, sent_us);
        let encoded = encode(&whole);
        if encoded.len() <= max_bytes {
            self.seq = next;
            return Some(vec![encoded]);
        }
        let Body::Delta { loads } = whole.body else {
            return None;
        };
        // The envelope at its longest (the sequence at u64::MAX), so every
        // chunk's real size is at most what is counted.
        let envelope = encode(&self.stamped(
            Body::Delta { loads: vec![] },
            u64::MAX,
            fingerprint,
            sent_us,
        ))
        .len();
        let chunks = chunk(&loads, envelope, max_bytes)?;
        Some(
            chunks
                .into_iter()
                .map(|range| {
                    let body = Body::Delta {
                        loads: loads[range].to_vec(),
                    };
                    encode(&self.message(body, fingerprint, sent_us))
                })
                .collect(),
        )
    }

    /// The digest (every worker with load, and `peers`) as encoded messages of
    /// at most `max_bytes` each: one `digest` when it fits, which every replica
    /// reads; else `digest_part`s, one sequence for all. `None` when one entry
    /// alone does not fit.
    pub fn digest_messages(
        &mut self,
        peers: Vec<String>,
        fingerprint: u64,
        sent_us: u64,
        max_bytes: usize,
    ) -> Option<Vec<Vec<u8>>> {
        let loads = self.digest();
        let seq = self.seq + 1;
        let whole = self.stamped(Body::Digest { loads, peers }, seq, fingerprint, sent_us);
        let encoded = encode(&whole);
        if encoded.len() <= max_bytes {
            self.seq = seq;
            return Some(vec![encoded]);
        }
        let Body::Digest { loads, mut peers } = whole.body else {
            return None;
        };
        let widest = Some(WorkerId {
            role: Role::Aggregated,
            worker_id: u64::MAX,
            dp_rank: u32::MAX,
        });
        let envelope = |peers: Vec<String>| {
            encode(&self.stamped(
                Body::DigestPart {
                    loads: vec![],
                    peers,
                    from: widest,
                    to: widest,
                    part: u32::MAX,
                    parts: u32::MAX,
                },
                u64::MAX,
                fingerprint,
                sent_us,
            ))
            .len()
        };
        // The peers a joiner waits for ride in the first part; so many that
        // they would crowd out the loads are cut to half a message (a joiner
        // then waits `sync_timeout_ms` at most, as for a peer it never heard).
        while !peers.is_empty() && envelope(peers.clone()) > max_bytes / 2 {
            peers.truncate(peers.len() / 2);
        }
        let first = envelope(peers.clone());
        let rest = envelope(Vec::new());
        // The first chunk with the peers' room, the others without: chunked
        // against the larger envelope, so every part fits.
        let chunks = chunk(&loads, first.max(rest), max_bytes)?;
        let parts = u32::try_from(chunks.len()).ok()?;
        if parts > MAX_DIGEST_PARTS {
            return None;
        }
        self.seq = seq;
        let bounds: Vec<usize> = chunks.iter().map(|r| r.start).collect();
        Some(
            chunks
                .into_iter()
                .enumerate()
                .map(|(i, range)| {
                    let from = (i > 0).then(|| loads[range.start].id());
                    let to = bounds.get(i + 1).map(|at| loads[*at].id());
                    let body = Body::DigestPart {
                        loads: loads[range].to_vec(),
                        peers: if i == 0 {
                            std::mem::take(&mut peers)
                        } else {
                            Vec::new()
                        },
                        from,
                        to,
                        part: i as u32,
                        parts,
                    };
                    encode(&self.stamped(body, seq, fingerprint, sent_us))
                })
                .collect(),
        )
    }
}

/// A message as it goes on the wire (JSON).
pub fn encode(message: &Message) -> Vec<u8> {
    // Serialising these types cannot fail (no maps with non-string keys, no
    // custom serialisers); an empty payload would be dropped as undecodable.
    serde_json::to_vec(message).unwrap_or_default()
}

/// `loads` cut into consecutive ranges whose message, `envelope` bytes with
/// an empty list, stays within `max_bytes` with the range's entries in it
/// (each entry's JSON and a comma between two). `None` when one entry alone
/// does not fit. Always at least one range (empty when `loads` is).
fn chunk(
    loads: &[Entry],
    envelope: usize,
    max_bytes: usize,
) -> Option<Vec<std::ops::Range<usize>>> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut size = envelope;
    for (i, entry) in loads.iter().enumerate() {
        let len = serde_json::to_vec(entry).map_or(usize::MAX / 2, |v| v.len());
        let add = if i == start { len } else { len + 1 };
        if size + add > max_bytes {
            if i == start {
                return None;
            }
            out.push(start..i);
            start = i;
            size = envelope + len;
            if size > max_bytes {
                return None;
            }
        } else {
            size += add;
        }
    }
    out.push(start..loads.len());
    Some(out)
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
    /// In worker order, so a digest part walks its own range only.
    loads: BTreeMap<WorkerId, (Load, u64)>,
    /// A digest has arrived since this incarnation was first heard.
    synced: bool,
    /// The newest digest's sequence: every worker it did not list had no load then,
    /// so an older message about one (reordered) is stale even if it is the first
    /// heard about that worker.
    digest_seq: u64,
    /// The newest split digest's sequence and which of its parts were
    /// received (a bit each, so at most [`MAX_DIGEST_PARTS`] / 8 bytes a peer
    /// whatever a sender claims): the peer is synced once all have come.
    assembling: (u64, Vec<u64>),
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

/// Parts of one digest at most (a receiver ignores a part claiming more): 1M
/// workers with load in 64 KiB messages take about 700.
pub const MAX_DIGEST_PARTS: u32 = 1 << 16;

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
                    loads: BTreeMap::new(),
                    synced: false,
                    digest_seq: 0,
                    assembling: (0, Vec::new()),
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
                    // Newer than what is known of the worker: its slot, or for
                    // one never heard, the newest digest (which said it had
                    // none). A worker whose digest part was lost keeps an
                    // older slot, so a delta between the two still counts.
                    let known = peer.loads.get(&entry.id()).map_or(peer.digest_seq, |s| s.1);
                    if message.seq > known {
                        let slot = peer.loads.entry(entry.id()).or_default();
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
                fold_digest(peer, message.seq, loads, None, None, &mut touched);
                if synced {
                    self.stats.corrections += touched.len() as u64;
                }
                peer.synced = true;
                self.answered.insert(message.replica.clone());
                self.mentioned.extend(peers.iter().cloned());
            }
            Body::DigestPart {
                loads,
                peers,
                from,
                to,
                part,
                parts,
            } => {
                // A part that cannot be one of a digest the sender split is
                // only a heartbeat.
                if *part >= *parts
                    || *parts > MAX_DIGEST_PARTS
                    || matches!((from, to), (Some(f), Some(t)) if f >= t)
                {
                    return out;
                }
                let synced = peer.synced;
                fold_digest(peer, message.seq, loads, *from, *to, &mut touched);
                if synced {
                    self.stats.corrections += touched.len() as u64;
                }
                if message.seq > peer.assembling.0 {
                    peer.assembling = (message.seq, vec![0; parts.div_ceil(64) as usize]);
                }
                let seen = &mut peer.assembling.1;
                let (word, bit) = ((*part / 64) as usize, 1u64 << (*part % 64));
                if message.seq == peer.assembling.0 && word < seen.len() {
                    seen[word] |= bit;
                    let received: u32 = seen.iter().map(|w| w.count_ones()).sum();
                    if received == *parts {
                        peer.synced = true;
                        self.answered.insert(message.replica.clone());
                    }
                }
                // No ask for a sync while the parts come in: every peer would
                // answer a hello with its whole digest again.
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

/// Folds a digest (or a part of one: the workers from `from`, inclusive, to
/// `to`, exclusive) with sequence `seq` into `peer`: each listed worker's total
/// and, for every worker in the range it does not list, zero. Newer knowledge
/// of a worker is kept: its slot's sequence, or for a worker never heard, the
/// newest digest's (which said it had none). The parts of one digest share a
/// sequence, so a part may come after a sibling that raised the floor to it.
fn fold_digest(
    peer: &mut Peer,
    seq: u64,
    loads: &[Entry],
    from: Option<WorkerId>,
    to: Option<WorkerId>,
    touched: &mut Vec<WorkerId>,
) {
    let in_range = |id: &WorkerId| from.is_none_or(|f| *id >= f) && to.is_none_or(|t| *id < t);
    let floor = peer.digest_seq;
    let listed: HashMap<WorkerId, Load> = loads
        .iter()
        .filter(|e| in_range(&e.id()))
        .map(|e| (e.id(), e.load()))
        .collect();
    for (id, load) in &listed {
        let newer = match peer.loads.get(id) {
            Some((_, at)) => seq > *at,
            None => seq >= floor,
        };
        if newer {
            let slot = peer.loads.entry(*id).or_default();
            if slot.0 != *load {
                touched.push(*id);
            }
            *slot = (*load, seq);
        }
    }
    let range = (
        from.map_or(Bound::Unbounded, Bound::Included),
        to.map_or(Bound::Unbounded, Bound::Excluded),
    );
    for (id, slot) in peer.loads.range_mut(range) {
        if !listed.contains_key(id) && seq > slot.1 {
            if !slot.0.is_zero() {
                touched.push(*id);
            }
            *slot = (Load::default(), seq);
        }
    }
    peer.digest_seq = peer.digest_seq.max(seq);
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
        /// The max payload its digests are cut to (parts when under a digest).
        max_bytes: usize,
    }

    fn decode(payload: &[u8]) -> Message {
        serde_json::from_slice(payload).unwrap_or_else(|e| panic!("{e}"))
    }

    impl Replica {
        fn new(name: &str, incarnation: u64, now: Instant) -> Self {
            Self {
                truth: BTreeMap::new(),
                outbox: Outbox::new(name, incarnation, BLOCK),
                merge: Merge::new(name, BLOCK, 7, LONG, Duration::ZERO, now),
                max_bytes: usize::MAX,
            }
        }
        fn current(&self) -> Vec<(WorkerId, Load)> {
            self.truth.iter().map(|(k, v)| (*k, *v)).collect()
        }
        fn tick(&mut self) -> Option<Message> {
            let loads = self.outbox.changes(&self.current());
            (!loads.is_empty()).then(|| self.outbox.message(Body::Delta { loads }, 7, 0))
        }
        /// A digest, as one message or in parts (its delta since the last
        /// tick is lost).
        fn digest(&mut self) -> Vec<Message> {
            self.tick();
            let payloads = self
                .outbox
                .digest_messages(vec![], 7, 0, self.max_bytes)
                .unwrap_or_else(|| panic!("{} bytes hold no entry", self.max_bytes));
            payloads.iter().map(|p| decode(p)).collect()
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
    /// Every other seed sends its digests in parts, each part dropped, repeated
    /// and reordered on its own.
    #[test]
    fn views_converge_to_the_truth_over_a_bus_that_drops_duplicates_and_reorders() {
        let mut split = 0;
        for seed in 1..=500u64 {
            let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
            let now = Instant::now();
            let n = 2 + (seed % 3) as usize;
            let names: Vec<String> = (0..n).map(|i| format!("r{i}")).collect();
            let mut incarnation = 1;
            // Every other seed, 40 workers and digests cut to about eight
            // workers a part, so the parts of one digest are dropped, repeated
            // and reordered each on their own.
            let (workers, max_bytes) = if seed % 2 == 0 {
                (6, usize::MAX)
            } else {
                (40, 600)
            };
            let replica = |name: &str, incarnation| Replica {
                max_bytes,
                ..Replica::new(name, incarnation, now)
            };
            let mut replicas: Vec<Replica> = names.iter().map(|n| replica(n, 1)).collect();
            let mut bus = Bus { pending: vec![] };
            for _ in 0..400 {
                let r = rng.below(n as u64) as usize;
                match rng.below(10) {
                    0..=3 => {
                        let id = worker(rng.below(workers));
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
                        let parts = replicas[r].digest();
                        split += usize::from(parts.len() > 1);
                        for m in parts {
                            bus.send(&mut rng, r, n, m, true);
                        }
                    }
                    7 if rng.chance(10) => {
                        // Restart under the same name: a newer incarnation, no load.
                        incarnation += 1;
                        replicas[r] = replica(&names[r], incarnation);
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
                for m in replica.digest() {
                    bus.send(&mut rng, r, n, m, false);
                }
            }
            while let Some((to, m)) = bus.take(&mut rng) {
                replicas[to].merge.receive(&m, now);
            }
            for me in 0..n {
                for w in 0..workers {
                    let id = worker(w);
                    assert_eq!(
                        replicas[me].merge.sum(&id),
                        expected(&replicas, me, &id),
                        "seed {seed}: replica {me}'s view of {id:?}"
                    );
                }
            }
        }
        assert!(split > 1_000, "only {split} digests were split");
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
                for m in a.digest() {
                    b.merge.receive(&m, now);
                }
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

    /// `count` workers, each with its own load (none zero).
    fn fleet(count: u64) -> Vec<(WorkerId, Load)> {
        (0..count)
            .map(|i| {
                let id = WorkerId {
                    role: Role::ALL[(i % 3) as usize],
                    worker_id: i / 3,
                    dp_rank: (i % 7) as u32,
                };
                let load = Load {
                    active_requests: 1 + i % 5,
                    active_blocks: i % 1_000,
                    prefill_blocks: i % 17,
                };
                (id, load)
            })
            .collect()
    }

    /// Every worker's sum in `merge`, sorted.
    fn view(merge: &Merge) -> Vec<(WorkerId, Load)> {
        let mut out: Vec<(WorkerId, Load)> = merge.sums().map(|(id, l)| (*id, *l)).collect();
        out.sort_by_key(|(id, _)| *id);
        out
    }

    /// Issue 44: 800 fake peers, or a fleet far past `gateway.max_workers`'s
    /// 4,096 default, pushed a digest over NATS's max payload; it was refused
    /// whole, and with it loss correction and a joiner's sync. A digest of
    /// 200,000 workers is sent as parts that each fit; a replica that hears
    /// them ends with exactly the sender's view; a lost part leaves only its
    /// range behind, a repeated one changes nothing, and the next digest, its
    /// parts in any order, corrects the rest.
    #[test]
    fn a_digest_over_the_max_payload_is_sent_in_parts_that_rebuild_the_senders_view() {
        const MAX: usize = 256 << 10;
        let now = Instant::now();
        let mut sender = Outbox::new("big", 1, BLOCK);
        let mut receiver = Merge::new("me", BLOCK, 7, LONG, Duration::ZERO, now);
        let mut truth = fleet(200_000);
        truth.sort_by_key(|(id, _)| *id);
        // Before: one message of several MB.
        let changes = sender.changes(&truth);
        let whole = encode(&Message {
            replica: "big".into(),
            incarnation: 1,
            seq: 1,
            block_size: BLOCK,
            fingerprint: 7,
            sent_us: 0,
            body: Body::Digest {
                loads: changes.clone(),
                peers: vec!["a".into()],
            },
        });
        assert!(whole.len() > 20 * MAX, "{} bytes", whole.len());
        // The deltas (all 200,000 changed at once) fit too, and are lost here:
        // the digest alone must bring the view.
        let deltas = sender
            .delta_messages(changes, 7, 0, MAX)
            .unwrap_or_default();
        assert!(deltas.len() > 20 && deltas.iter().all(|d| d.len() <= MAX));
        let mut by_deltas = Merge::new("other", BLOCK, 7, LONG, Duration::ZERO, now);
        for d in &deltas {
            by_deltas.receive(&decode(d), now);
        }
        assert_eq!(view(&by_deltas), truth);
        let parts = sender
            .digest_messages(vec!["a".into(), "me".into()], 7, 0, MAX)
            .unwrap_or_default();
        assert!(parts.len() > 20, "{} parts", parts.len());
        let messages: Vec<Message> = parts
            .iter()
            .map(|p| {
                assert!(p.len() <= MAX, "a part of {} bytes", p.len());
                decode(p)
            })
            .collect();
        // One sequence, every part's range starting where the last one's ended.
        assert!(messages.iter().all(|m| m.seq == messages[0].seq));
        let mut listed = 0;
        for (i, m) in messages.iter().enumerate() {
            let Body::DigestPart {
                loads,
                from,
                to,
                part,
                parts: of,
                ..
            } = &m.body
            else {
                panic!("part {i} is not a digest part");
            };
            assert_eq!((*part as usize, *of as usize), (i, messages.len()));
            assert_eq!(from.is_none(), i == 0);
            assert_eq!(to.is_none(), i + 1 == messages.len());
            listed += loads.len();
        }
        assert_eq!(listed, truth.len());
        // Delivered in reverse, one repeated: exactly the sender's view, synced.
        for m in messages.iter().rev().chain([&messages[3]]) {
            receiver.receive(m, now);
        }
        assert_eq!(view(&receiver), truth);
        assert!(receiver.peers(now)[0].synced);
        assert_eq!(receiver.stats().corrections, 0);
        assert!(receiver.is_ready(now));

        // The load moves: every third worker's goes, every fifth doubles, and
        // 500 new workers appear; the deltas saying so are all lost, and so is
        // part 5 of the next digest.
        let mut next: Vec<(WorkerId, Load)> = truth
            .iter()
            .enumerate()
            .filter(|(i, _)| i % 3 != 0)
            .map(|(i, (id, l))| (*id, if i % 5 == 0 { l.plus(*l) } else { *l }))
            .collect();
        next.extend(fleet(200_500).into_iter().skip(200_000).map(|(id, l)| {
            let id = WorkerId {
                worker_id: id.worker_id + 1_000_000,
                ..id
            };
            (id, l)
        }));
        next.sort_by_key(|(id, _)| *id);
        let _lost = sender.changes(&next);
        let parts: Vec<Message> = sender
            .digest_messages(vec![], 7, 0, MAX)
            .unwrap_or_default()
            .iter()
            .map(|p| decode(p))
            .collect();
        let Body::DigestPart { from, to, .. } = &parts[5].body else {
            panic!("not a part");
        };
        let (from, to) = (
            from.unwrap_or_else(|| panic!()),
            to.unwrap_or_else(|| panic!()),
        );
        for (i, m) in parts.iter().enumerate() {
            if i != 5 {
                receiver.receive(m, now);
                receiver.receive(m, now);
            }
        }
        // Right outside part 5's range; inside it, the old view.
        let inside = |id: &WorkerId| *id >= from && *id < to;
        let want_outside: Vec<_> = next.iter().filter(|(id, _)| !inside(id)).copied().collect();
        let got_outside: Vec<_> = view(&receiver)
            .into_iter()
            .filter(|(id, _)| !inside(id))
            .collect();
        assert_eq!(got_outside, want_outside);
        let old_inside: Vec<_> = truth.iter().filter(|(id, _)| inside(id)).copied().collect();
        let got_inside: Vec<_> = view(&receiver)
            .into_iter()
            .filter(|(id, _)| inside(id))
            .collect();
        assert_eq!(got_inside, old_inside);
        assert_ne!(
            old_inside,
            next.iter()
                .filter(|(id, _)| inside(id))
                .copied()
                .collect::<Vec<_>>()
        );
        // The next digest, its parts shuffled, corrects it.
        let mut rng = Rng(7);
        let mut parts: Vec<Message> = sender
            .digest_messages(vec![], 7, 0, MAX)
            .unwrap_or_default()
            .iter()
            .map(|p| decode(p))
            .collect();
        while !parts.is_empty() {
            let at = rng.below(parts.len() as u64) as usize;
            receiver.receive(&parts.swap_remove(at), now);
        }
        assert_eq!(view(&receiver), next);
        // A late part of the older digest changes nothing.
        let stale = sender.stamped(
            Body::DigestPart {
                loads: vec![],
                peers: vec![],
                from: None,
                to: None,
                part: 0,
                parts: 1,
            },
            2,
            7,
            0,
        );
        receiver.receive(&stale, now);
        assert_eq!(view(&receiver), next);
    }

    /// A digest that fits is one `digest`, which replicas without parts read;
    /// a max payload too small for one worker's entry is said, not sent.
    #[test]
    fn a_digest_that_fits_is_one_message_and_a_payload_too_small_for_one_entry_sends_none() {
        let mut o = Outbox::new("a", 1, BLOCK);
        o.changes(&fleet(10));
        let one = o
            .digest_messages(vec!["b".into()], 7, 0, 1 << 20)
            .unwrap_or_default();
        assert_eq!(one.len(), 1);
        assert!(
            matches!(decode(&one[0]).body, Body::Digest { ref loads, .. } if loads.len() == 10)
        );
        assert!(o.digest_messages(vec![], 7, 0, 200).is_none());
        assert!(o
            .delta_messages(Outbox::new("b", 1, BLOCK).changes(&fleet(3)), 7, 0, 100)
            .is_none());
        // A part naming its range backwards, or more parts than a digest has,
        // is a heartbeat only.
        let now = Instant::now();
        let mut merge = Merge::new("me", BLOCK, 7, LONG, Duration::ZERO, now);
        let (id, load) = fleet(1)[0];
        for (from, to, part, parts) in [
            (Some(id), Some(id), 0, 2),
            (None, None, 2, 2),
            (None, None, 0, MAX_DIGEST_PARTS + 1),
        ] {
            let m = o.message(
                Body::DigestPart {
                    loads: vec![Entry::new(id, load)],
                    peers: vec![],
                    from,
                    to,
                    part,
                    parts,
                },
                7,
                0,
            );
            merge.receive(&m, now);
        }
        assert_eq!(merge.sum(&id), Load::default());
        assert!(!merge.peers(now)[0].synced);
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
