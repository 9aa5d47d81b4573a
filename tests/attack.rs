//! Bounded work per booking (issue 8's attack): one worker stores the same tokens under
//! tens of thousands of engine hashes — one-block `stored` events, as a buggy or hostile
//! engine could send — then a maximum-length prompt that starts with those tokens is
//! booked. Before the index was rebuilt, 20,000 such events made that booking allocate
//! 2.5 GB, and 70,000 aborted the process. Now a worker holds a block once whatever it
//! calls it, so the booking's work is bounded by the prompt and the workers.
//!
//! Bytes are counted by a global allocator while the booking runs (no timing is
//! asserted: the machines are noisy); entries visited by the index walk are counted by
//! the index itself.

use kvhint::domain::{Role, WorkerKey};
use kvhint::router::index::{block_hashes, KvEvent, Matches, StoredBlock};
use kvhint::router::workers::WorkerRegistration;
use kvhint::router::Router;
use kvhint_e2e::allocations::{counted, Counting};
use kvhint_e2e::replay::decode_request;
use kvhint_e2e::{config_file, snapshot_of};

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const BLOCK: usize = 16;
const MAX_TOKENS: usize = 262_144;

fn registration(id: u64) -> WorkerRegistration {
    serde_json::from_value(serde_json::json!({
        "worker_id": id, "role": "decode", "runtime_data": {
            "router_hint": true, "router_hint_worker_type": "decode",
            "router_hint_source_control_endpoints": {"0": format!("tcp://127.0.0.{id}:23280")}
        }
    }))
    .expect("registration")
}

fn key(id: u64) -> WorkerKey {
    WorkerKey {
        worker_id: id,
        dp_rank: 0,
    }
}

/// `count` one-block stored events of `tokens`, engine hashes from `first` on.
fn duplicates(tokens: &[u32], first: u64, count: u64) -> Vec<(WorkerKey, KvEvent)> {
    (first..first + count)
        .map(|engine| {
            (
                key(1),
                KvEvent::stored(
                    None,
                    vec![StoredBlock {
                        block_hash: engine,
                        token_ids: tokens.into(),
                    }],
                ),
            )
        })
        .collect()
}

#[test]
fn duplicate_engine_hashes_cannot_blow_up_a_maximum_length_booking() {
    let fixture = config_file(&format!(
        "router: {{block_size: {BLOCK}, max_prompt_tokens: {MAX_TOKENS}}}\nworker_selection:\n  decode:\n    type: kvcr\n    parameters: {{shared_cache_multiplier: 1.0}}\n"
    ));
    let (snapshot, _loader) = snapshot_of(&fixture, None).expect("config builds");
    let role = snapshot.role(Role::Decode).expect("decode role");
    let router = Router::new(BLOCK);
    for id in 1..=3 {
        router.register_worker(registration(id)).expect("registers");
    }
    let prompt: Vec<u32> = (0..MAX_TOKENS as u32)
        .map(|t| t.wrapping_mul(2_654_435_761) % 50_000)
        .collect();
    // An honest peer holds a long prefix, so the booking takes the whole path: the
    // walk, a committed copy, a kv.fetch naming 1,024 engine hashes.
    let honest: Vec<StoredBlock> = prompt[..1024 * BLOCK]
        .chunks_exact(BLOCK)
        .enumerate()
        .map(|(i, tokens)| StoredBlock {
            block_hash: 9_000_000 + i as u64,
            token_ids: tokens.into(),
        })
        .collect();
    router
        .apply_kv_event(key(2), KvEvent::stored(None, honest))
        .expect("stores");

    let mut hashes = Vec::new();
    block_hashes(&prompt, BLOCK, &mut hashes);
    let blocks = hashes.len();
    let mut stored = 0;
    for (round, total) in [20_000u64, 70_000].into_iter().enumerate() {
        for result in router.apply_kv_events(duplicates(&prompt[..BLOCK], stored, total - stored)) {
            result.expect("a duplicate store is accepted");
        }
        stored = total;
        // The index holds every name, but the block once.
        let (copies, distinct, held, visited) = router.read_index(|index| {
            let mut matches = Matches::new();
            index.lookup(&hashes, &mut matches);
            (
                index.len(),
                index.distinct_blocks(),
                index.held_blocks(),
                matches.visited(),
            )
        });
        assert_eq!(copies, total as usize + 1024);
        assert_eq!(distinct, 1024);
        assert_eq!(
            held,
            1024 + 1,
            "worker 1 holds block 0 once, under {total} names"
        );
        // Bounded by the prompt's blocks and the workers, not the names.
        assert!(
            visited <= 2 * blocks + 64,
            "visited {visited} for {blocks} blocks"
        );

        let request_id = format!("attack-{round}");
        let request = decode_request(&request_id, &prompt);
        let started = std::time::Instant::now();
        let (booking, allocated) = counted(|| router.book(role, &request));
        let elapsed = started.elapsed();
        let bytes = allocated.bytes;
        let booking = booking.expect("books");
        println!(
            "{total} duplicate names: booking took {elapsed:?}, allocated {bytes} bytes, booked {:?}, cached {}",
            booking.worker, booking.cached_blocks
        );
        assert_eq!(booking.request_blocks, blocks);
        assert!(
            bytes < 50 << 20,
            "a maximum-length booking allocated {bytes} bytes"
        );
        // What it does allocate is a few buffers the size of the prompt and the fetch,
        // the same with 20,000 names as with 70,000.
        assert!(bytes < 16 * blocks * 8 + (1 << 20), "{bytes} bytes");
        router.release(&request_id).expect("releases");
    }
}
