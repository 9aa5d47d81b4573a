//! The index's writer in a steady stream: once warm, an engine that stores new
//! sequences as fast as it evicts old ones costs the writer no node arrays. Freed nodes'
//! arrays are pooled and reused by the nodes made next (`router/index/mod.rs`,
//! `Buffers`); before, every new sequence allocated its arrays and grew them block by
//! block, and every evicted one gave them back.
//!
//! Allocations are counted by a global allocator while the stream is applied (no
//! timing is asserted: the machines are noisy).

use kvhint::domain::WorkerKey;
use kvhint::router::index::{KvEvent, KvIndex, StoredBlock};
use kvhint_e2e::allocations::{counted, Counting};

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const BLOCK: usize = 16;
const WORKERS: u64 = 8;
const BLOCKS_PER_EVENT: usize = 32;
/// Events per sequence: each continues the worker's previous one.
const SEQUENCE: usize = 8;
/// Events after which a worker evicts what it stored (a multiple of `WORKERS`).
const KEPT: usize = 64;

/// The engines' stream, built before anything is counted: event `i` is worker
/// `i % WORKERS`'s, stores 32 new blocks (a new sequence every 8th of its events) and
/// evicts the blocks of its event `KEPT` events earlier.
fn stream(events: usize) -> Vec<(WorkerKey, KvEvent)> {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut stored: Vec<Vec<u64>> = Vec::new();
    let mut out = Vec::new();
    for i in 0..events {
        let worker = WorkerKey {
            worker_id: i as u64 % WORKERS,
            dp_rank: 0,
        };
        if i >= KEPT {
            out.push((
                worker,
                KvEvent::Removed {
                    block_hashes: stored[i - KEPT].clone(),
                },
            ));
        }
        let parent = (!(i / WORKERS as usize).is_multiple_of(SEQUENCE))
            .then(|| i.checked_sub(WORKERS as usize))
            .flatten()
            .and_then(|earlier| stored[earlier].last().copied());
        let blocks: Vec<StoredBlock> = (0..BLOCKS_PER_EVENT)
            .map(|_| StoredBlock {
                block_hash: next(),
                token_ids: (0..BLOCK).map(|_| (next() % 150_000) as u32).collect(),
            })
            .collect();
        stored.push(blocks.iter().map(|b| b.block_hash).collect());
        out.push((worker, KvEvent::stored(parent, blocks)));
    }
    out
}

#[test]
fn a_warm_steady_stream_of_stores_and_evictions_allocates_no_node_arrays() {
    let events = stream(4_000);
    let (warm_up, measured) = events.split_at(events.len() / 2);
    let mut index = KvIndex::new(BLOCK);
    for (worker, event) in warm_up {
        index.apply(*worker, event).expect("applies");
    }
    let blocks = index.len();
    let ((), allocated) = counted(|| {
        for (worker, event) in measured {
            let _ = index.apply(*worker, event);
        }
    });
    let calls = allocated.calls;
    // The index stays level: what is evicted is what was stored 64 events earlier.
    assert_eq!(index.len(), blocks);
    assert_eq!(index.len(), KEPT * BLOCKS_PER_EVENT);
    println!("{calls} allocations over {} events", measured.len());
    // Without the pool each new sequence allocated its three arrays and grew them
    // three times, and each split allocated three more: 10,416 allocations here.
    assert_eq!(
        calls,
        0,
        "allocations for {} stores and their evictions",
        measured.len() / 2
    );
}
