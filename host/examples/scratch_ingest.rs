use kvhint::domain::WorkerKey;
use kvhint::router::index::{KvEvent, KvIndex, StoredBlock};
use std::time::Instant;
fn main() {
    let bs = 16;
    let workers: u64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(2);
    let mut events = Vec::new();
    let mut rng = 0x1234_5678_9abc_def0u64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let system: Vec<Vec<u32>> = (0..32)
        .map(|s| (0..8 * bs as u32).map(|t| t * 31 + s * 7).collect())
        .collect();
    let per_worker = 131072 / 64 / workers as usize;
    for w in 0..workers {
        for seq in 0..per_worker as u64 {
            let sys = &system[(seq % 32) as usize];
            let mut tokens = sys.clone();
            tokens.extend((0..56 * bs).map(|_| (next() % 50000) as u32));
            let blocks = tokens
                .chunks_exact(bs)
                .enumerate()
                .map(|(i, c)| StoredBlock {
                    block_hash: if i < 8 {
                        (seq % 32) * 1000 + i as u64
                    } else {
                        next()
                    },
                    token_ids: c.to_vec(),
                })
                .collect();
            events.push((
                WorkerKey {
                    worker_id: w,
                    dp_rank: 0,
                },
                KvEvent::Stored {
                    parent_block_hash: None,
                    blocks,
                },
            ));
        }
    }
    let total: usize = events
        .iter()
        .map(|(_, e)| match e {
            KvEvent::Stored { blocks, .. } => blocks.len(),
            _ => 0,
        })
        .sum();
    for _ in 0..5 {
        let mut index = KvIndex::new(bs);
        let t = Instant::now();
        for (k, e) in &events {
            index.apply(*k, e).unwrap();
        }
        println!(
            "ingest {:.1} ns/block ({} blocks, {} nodes)",
            t.elapsed().as_nanos() as f64 / total as f64,
            total,
            index.node_count()
        );
    }
}
