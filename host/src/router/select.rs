//! Step 2 of a booking, in parts: which of the role's workers are candidates,
//! the peers holding the request's prefix ranked as copy sources, and the
//! candidate list the selection policy reads.
//!
//! Free functions over the worker table and the booking's thread-local buffers,
//! so the hot path allocates nothing and `Router::select_and_reserve` reads as
//! the order of the steps.

use super::index::{Matches, Slot};
use super::workers::{Listed, RoleList, WorkerTable};
use super::Eligible;
use crate::domain::{WorkerKey, WorkerView};
use crate::selection::{Candidate, Candidates};

/// A matching worker as the booking ranks peers: longest prefix first, then by key.
/// By slot, not by `Arc`: cloning every matched worker's `Arc` per booking would make
/// their reference counts cache lines that every core writes.
#[derive(Clone, Copy)]
pub(super) struct Ranked {
    pub(super) cached: usize,
    pub(super) slot: Slot,
    pub(super) key: WorkerKey,
    /// Its worker type's number if it can be a copy's source (`None` if not).
    pub(super) donor_type: Option<u16>,
}

/// With a filter, fills `admitted` with the positions in `entries` of the workers
/// it admits and returns `Some(true)` (`None` if it admits none); without one,
/// `Some(false)`: every entry is a candidate.
#[inline]
pub(super) fn admit(
    table: &WorkerTable,
    entries: &RoleList,
    eligible: Option<Eligible<'_>>,
    admitted: &mut Vec<usize>,
) -> Option<bool> {
    admitted.clear();
    let Some(eligible) = eligible else {
        return Some(false);
    };
    admitted.extend(
        entries
            .iter()
            .enumerate()
            .filter(|(_, listed)| {
                table
                    .by_slot(listed.slot)
                    .is_some_and(|entry| eligible(&entry.worker))
            })
            .map(|(at, _)| at),
    );
    (!admitted.is_empty()).then_some(true)
}

/// The workers holding a prefix of the request, as copy sources: longest prefix
/// first, then by key; empty unless `wanted` (a policy may copy, or hints run).
/// The matches come shortest first, so reversed they are nearly sorted already and
/// the (adaptive) sort is about linear.
#[inline]
pub(super) fn rank_holders(
    table: &WorkerTable,
    matches: &Matches,
    wanted: bool,
    ranked: &mut Vec<Ranked>,
) {
    ranked.clear();
    if !wanted {
        return;
    }
    ranked.extend(matches.found().iter().rev().filter_map(|f| {
        table.holder(f.slot).map(|(entry, donor_type)| Ranked {
            cached: f.cached,
            slot: f.slot,
            key: entry.worker.key,
            donor_type,
        })
    }));
    ranked.sort_by(|a, b| b.cached.cmp(&a.cached).then(a.key.cmp(&b.key)));
}

/// The candidates, in the role's order (only the `admitted` ones, if filtered):
/// each with its cached prefix, its load, and the best peer copy it could be
/// offered (its position in `ranked` also goes to `peer_copies`).
#[inline]
#[allow(clippy::too_many_arguments)] // the booking's buffers, each its own.
pub(super) fn offer<'t>(
    table: &'t WorkerTable,
    entries: &'t RoleList,
    admitted: Option<&[usize]>,
    matches: &Matches,
    ranked: &[Ranked],
    wants_peer_copies: bool,
    pinned_prefix: &[(WorkerKey, u32)],
    candidates: &mut Candidates<'t>,
    peer_copies: &mut Vec<Option<usize>>,
) {
    peer_copies.clear();
    // The candidates offered a copy are mostly offered it by one peer (the longest
    // holder that can supply them), so its view is read once and reused: read per
    // candidate, its four dependent loads were a quarter of this loop's time.
    let mut last_source: Option<(usize, WorkerView<'t>)> = None;
    let mut source = |at: usize| match last_source {
        Some((cached_at, worker)) if cached_at == at => Some(worker),
        _ => {
            let worker = table.by_slot(ranked[at].slot)?.worker.view();
            last_source = Some((at, worker));
            Some(worker)
        }
    };
    // In the role's order, walked leaf by leaf: indexing the persistent list by
    // position would walk it from the root for every candidate.
    let mut admitted = admitted.map(|admitted| admitted.iter().peekable());
    let listed_in_order = entries.iter().enumerate().filter_map(|(at, listed)| {
        let Some(admitted) = admitted.as_mut() else {
            return Some(listed);
        };
        // `admitted` holds positions in ascending order (`admit` makes it so).
        admitted.next_if_eq(&&at).map(|_| listed)
    });
    for listed in listed_in_order {
        // What the index shows, less what the worker's engine must drop once the
        // requests it runs hold their blocks (event-fed workers whose capacity
        // the gateway sets, with `gateway.anticipate_evictions`; see
        // `Residency::surviving`).
        let cached_blocks = match matches.cached_in_slot(listed.slot) {
            0 => 0,
            cached => {
                let pinned = pinned_prefix
                    .iter()
                    .find(|(key, _)| *key == listed.key)
                    .map_or(0, |(_, blocks)| *blocks as usize);
                listed.load.residency().surviving(cached, pinned)
            }
        };
        let peer_copy = if wants_peer_copies && listed.router_hint {
            best_peer(ranked, listed, cached_blocks)
        } else {
            None
        };
        peer_copies.push(peer_copy);
        let load = listed.load.get();
        candidates.push(Candidate {
            worker: listed.view(),
            cached_blocks,
            active_requests: load.active_requests,
            active_blocks: load.active_blocks,
            prefill_blocks: load.prefill_blocks,
            peer_copy: peer_copy.and_then(|at| Some((source(at)?, ranked[at].cached))),
        });
    }
}

/// The eligible peer (same worker type, hint-capable, with a source endpoint)
/// holding the longest prefix beyond `worker`'s own, as its position in
/// `ranked`. `ranked` is sorted longest first, then by key, so the first
/// eligible one wins ties by key.
fn best_peer(ranked: &[Ranked], worker: &Listed, cached_blocks: usize) -> Option<usize> {
    ranked
        .iter()
        .take_while(|r| r.cached > cached_blocks)
        .position(|r| r.key != worker.key && r.donor_type == Some(worker.type_id))
}
