//! kvhint's KV index side by side with its two anchors (design: docs/architecture.md;
//! targets: docs/performance.md): NVIDIA Dynamo's `RadixTree` (`dynamo-kv-router` 1.6.1)
//! and the SGLang model gateway's `ShardedChainIndex` (`kv-index` 2.0.0, printed as `smg`),
//! fed the same generated events and asked the same question: for a prompt's blocks, how
//! many leading blocks does each worker hold.
//!
//! Workload (block size 16; 2, 64 and 1,024 workers; prompts of 1k, 4k and 32k tokens):
//! - `sparse`: four workers hold prefixes of the prompt (¼, ½, ¾, all);
//! - `shared`: every worker holds a prefix of a different length, from one block to all;
//! - `salted`: worker 0 holds the whole prompt 64 times over, each time under other engine
//!   hashes (what 64 cache salts would publish), and up to three other workers hold ¼, ½, ¾;
//! - `seeded`: as `shared`, but every worker's engine hashes come from a seed of its own, in
//!   the layout and the background alike: the same tokens are named differently on every
//!   worker (vLLM with a non-cryptographic prefix-caching hash and no shared
//!   `PYTHONHASHSEED` seeds each process at random, issue 29);
//! - behind every layout a background of 131,072 blocks (2,048 in quick mode): each worker
//!   holds unrelated 64-block sequences, each opening with one of 32 shared 8-block "system
//!   prompts"; a worker's second sequence after the same system prompt is stored chained onto
//!   its parent, as an engine publishes it (under `seeded` restated whole instead, since
//!   Dynamo's `RadixTree` resolves a parent only by the engine hash of whichever worker
//!   stored that block first).
//!
//! Engine block hashes look random (full u64 range) but are a function of the block's prefix,
//! the cache salt and the worker's hash seed; outside `seeded` every worker has the same seed,
//! so every worker names the same unsalted prefix alike, as engines of one model and hash seed
//! do. Dynamo's `RadixTree` depends on that: it resolves a store's parent
//! and a removal through the engine hashes of whichever worker stored a block first.
//!
//! Figures:
//! - `ingest`: ns per stored block over building the whole index of a case (background and
//!   layout), hashing of the token ids included on every side: kvhint `block_content` per block
//!   into a `KvEvent::Hashed` (the form an engine subscription hands the index; `apply` chains
//!   the hashes), Dynamo `compute_block_hash_for_seq` per event, kv-index `compute_content_hash`
//!   per block. Each side's event structures are allocated before the clock starts (a decoder's
//!   work), with the token hashes filled in inside the timed loop from the workload's texts, the
//!   same token memory for all three. Median of 15 builds after one warm-up (with 5, one
//!   slow stretch of a few builds moved a side's median, and a ratio with it, by a tenth).
//!   `PEERS_KVHINT_EVENTS=stored` feeds kvhint `KvEvent::Stored` instead, each event carrying
//!   its own copy of the token ids (the form `POST /kv_events` decodes), hashed inside `apply`:
//!   the peers' events carry no tokens, so that run reads a copy of every block's tokens from
//!   memory that the peers read from one shared, cached text.
//! - `lookup`: ns per query for the case's prompt (query hashes computed beforehand), full
//!   per-worker prefix counts, no early exit: kvhint `KvIndex::lookup` (counts only; engine
//!   hashes are `KvIndex::engine_hashes`, on demand and not timed), Dynamo
//!   `find_matches(query.clone(), false)` (its API takes the query by value), kv-index
//!   `score_into(.., false, ..)` (the allocation-free lookup behind its `find_matches`) into a
//!   reused buffer. Median of batches.
//! - `hash`: ns to hash one 4,096-token prompt into query hashes: kvhint `block_hashes` (chained,
//!   into a reused buffer), Dynamo `compute_block_hash_for_seq`, kv-index
//!   `compute_request_content_hashes`; `ratio` = kvhint / Dynamo (the target: ≤ 1).
//!   `ratio` on the other lines = kvhint / the faster peer.
//!
//! Before timing, every case checks that the three sides return the same per-worker prefix
//! counts, equal to what the workload says each worker holds, and that every engine hash kvhint
//! hands back for a matched worker is one that worker stored at that position.
//!
//! Memory: every side's freed memory stays in the process for its next build (glibc's
//! trimming off, see `keep_freed_memory`), so a build pays for its own work and not for
//! faulting in again the pages the previous build of its side gave back.
//!
//! Quick mode (no `--bench`, as `cargo test -p kvhint-e2e --benches` runs it): the 1k-token
//! cases with 2 and 64 workers, a small background, one or two iterations, all checks.
//!
//! `PEERS_PROFILE_BUILDS=N` builds only kvhint's index (or the side `PEERS_PROFILE_SIDE`
//! names: `dynamo`, `smg`), `N` times per case, and prints its median ingest: for a
//! profiler (`perf record`, callgrind) to see one side's ingest alone.
//!
//! `cargo bench -p kvhint-e2e --bench peers`

use std::collections::{HashMap, HashSet};
use std::hint::black_box;
use std::time::{Duration, Instant};

use kvhint_e2e::bench::{is_bench, median};

const BLOCK: usize = 16;
/// Stored copies of the whole prompt on the salted worker.
const SALTS: u64 = 64;
const BACKGROUND_SEQ_BLOCKS: usize = 64;
const SYSTEM_PROMPTS: usize = 32;
const SYSTEM_PROMPT_BLOCKS: usize = 8;
const INGEST_BUILDS: usize = 15;
/// Time each side spends on lookup samples per case.
const LOOKUP_BUDGET: Duration = Duration::from_millis(250);
/// The sides take turns at lookups this many times per case.
const LOOKUP_ROUNDS: usize = 5;
/// Shortest lookup batch; a batch is timed as one sample.
const LOOKUP_BATCH: Duration = Duration::from_micros(50);

// ---------------------------------------------------------------------------------------
// The three sides.

/// One index under test. Everything a side needs to speak its own index's API lives in its
/// `impl Side`; the workload, the checks and the timing are shared.
trait Side: Sized {
    const NAME: &'static str;
    /// The case's stored events in this side's own event type, allocated before timing.
    type Events;
    /// A prompt's query hashes in this side's form.
    type Query: Default;

    fn new(workers: usize) -> Self;
    /// Builds the events for `workload.events`, token hashes not yet computed.
    fn prepare(workload: &Workload) -> Self::Events;
    /// Applies every event in order, hashing the token ids as it goes (timed).
    fn ingest(&mut self, workload: &Workload, events: &mut Self::Events);
    /// The query hashes of `tokens`.
    fn hash(tokens: &[u32], out: &mut Self::Query);
    /// One lookup with full per-worker prefix counts; returns the number of matched workers.
    fn lookup(&mut self, query: &Self::Query) -> usize;
    /// `(worker, leading blocks held)` of every worker holding at least the first block.
    fn counts(&mut self, query: &Self::Query) -> Vec<(u64, usize)>;
    /// `worker`'s engine hashes of its matched prefix, if this side can say (kv.fetch).
    fn engine_hashes(&mut self, _query: &Self::Query, _worker: u64) -> Option<Vec<u64>> {
        None
    }
}

/// kvhint's index. The only module that names kvhint's API.
mod kvhint_side {
    use super::{Side, Workload, BLOCK};
    use kvhint::router::index::{
        block_content, block_hashes, HashedBlock, KvEvent, KvIndex, Matches, StoredBlock, WorkerKey,
    };

    pub struct Kvhint {
        index: KvIndex,
        matches: Matches,
    }

    /// Whether kvhint is fed `KvEvent::Stored` (`PEERS_KVHINT_EVENTS=stored`) instead of
    /// `KvEvent::Hashed` (`hashed`, the default); see the module documentation.
    fn stored_events() -> bool {
        match std::env::var("PEERS_KVHINT_EVENTS").as_deref() {
            Ok("stored") => true,
            Ok("hashed") | Err(_) => false,
            Ok(other) => panic!("PEERS_KVHINT_EVENTS={other}: expected `hashed` or `stored`"),
        }
    }

    fn key(worker: u64) -> WorkerKey {
        WorkerKey {
            worker_id: worker,
            dp_rank: 0,
        }
    }

    impl Side for Kvhint {
        const NAME: &'static str = "kvhint";
        type Events = Vec<(WorkerKey, KvEvent)>;
        type Query = Vec<u64>;

        fn new(_workers: usize) -> Self {
            Self {
                index: KvIndex::new(BLOCK),
                matches: Matches::new(),
            }
        }

        fn prepare(workload: &Workload) -> Self::Events {
            let stored = stored_events();
            workload
                .events
                .iter()
                .map(|e| {
                    let event = if stored {
                        let blocks = workload
                            .tokens(e)
                            .chunks_exact(BLOCK)
                            .zip(&e.engine)
                            .map(|(tokens, &block_hash)| StoredBlock {
                                block_hash,
                                token_ids: tokens.into(),
                            })
                            .collect();
                        KvEvent::stored(e.parent, blocks)
                    } else {
                        KvEvent::Hashed {
                            parent_block_hash: e.parent,
                            identity: None,
                            blocks: e
                                .engine
                                .iter()
                                .map(|&block_hash| HashedBlock {
                                    block_hash,
                                    // Filled in by `ingest`.
                                    content: 0,
                                })
                                .collect(),
                        }
                    };
                    (key(e.worker), event)
                })
                .collect()
        }

        fn ingest(&mut self, workload: &Workload, events: &mut Self::Events) {
            for ((worker, event), e) in events.iter_mut().zip(&workload.events) {
                if let KvEvent::Hashed { blocks, .. } = event {
                    let tokens = workload.tokens(e).chunks_exact(BLOCK);
                    for (block, tokens) in blocks.iter_mut().zip(tokens) {
                        block.content = block_content(tokens, None);
                    }
                }
                self.index.apply(*worker, event).expect("kvhint applies");
            }
        }

        fn hash(tokens: &[u32], out: &mut Self::Query) {
            block_hashes(tokens, BLOCK, out);
        }

        fn lookup(&mut self, query: &Self::Query) -> usize {
            self.index.lookup(query, &mut self.matches);
            self.matches.len()
        }

        fn counts(&mut self, query: &Self::Query) -> Vec<(u64, usize)> {
            self.lookup(query);
            self.matches
                .workers(&self.index)
                .map(|(worker, blocks)| (worker.worker_id, blocks))
                .collect()
        }

        fn engine_hashes(&mut self, query: &Self::Query, worker: u64) -> Option<Vec<u64>> {
            let slot = self.index.slot_of(key(worker))?;
            let mut out = Vec::new();
            self.index.engine_hashes(slot, query, &mut out);
            Some(out)
        }
    }
}

/// Dynamo's single-threaded `RadixTree`.
mod dynamo_side {
    use super::{Side, Workload, BLOCK};
    use dynamo_kv_router::protocols::{
        BlockHashOptions, ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData,
        KvCacheStoreData, KvCacheStoredBlockData, LocalBlockHash, RouterEvent,
    };
    use dynamo_kv_router::{compute_block_hash_for_seq, RadixTree};

    pub struct Dynamo {
        tree: RadixTree,
    }

    impl Side for Dynamo {
        const NAME: &'static str = "dynamo";
        type Events = Vec<RouterEvent>;
        type Query = Vec<LocalBlockHash>;

        fn new(_workers: usize) -> Self {
            Self {
                tree: RadixTree::new(),
            }
        }

        fn prepare(workload: &Workload) -> Self::Events {
            workload
                .events
                .iter()
                .enumerate()
                .map(|(id, e)| {
                    let blocks = e
                        .engine
                        .iter()
                        .map(|&hash| KvCacheStoredBlockData {
                            block_hash: ExternalSequenceBlockHash(hash),
                            // Filled in by `ingest`.
                            tokens_hash: LocalBlockHash(0),
                            mm_extra_info: None,
                        })
                        .collect();
                    let data = KvCacheEventData::Stored(KvCacheStoreData {
                        parent_hash: e.parent.map(ExternalSequenceBlockHash),
                        start_position: None,
                        blocks,
                    });
                    let event = KvCacheEvent {
                        event_id: id as u64,
                        data,
                        dp_rank: 0,
                    };
                    RouterEvent::new(e.worker, event)
                })
                .collect()
        }

        fn ingest(&mut self, workload: &Workload, events: &mut Self::Events) {
            for (mut event, e) in events.drain(..).zip(&workload.events) {
                let hashes = compute_block_hash_for_seq(
                    workload.tokens(e),
                    BLOCK as u32,
                    BlockHashOptions::default(),
                );
                if let KvCacheEventData::Stored(store) = &mut event.event.data {
                    for (block, hash) in store.blocks.iter_mut().zip(hashes) {
                        block.tokens_hash = hash;
                    }
                }
                self.tree.apply_event(event).expect("dynamo applies");
            }
        }

        fn hash(tokens: &[u32], out: &mut Self::Query) {
            *out = compute_block_hash_for_seq(tokens, BLOCK as u32, BlockHashOptions::default());
        }

        fn lookup(&mut self, query: &Self::Query) -> usize {
            self.tree.find_matches(query.clone(), false).scores.len()
        }

        fn counts(&mut self, query: &Self::Query) -> Vec<(u64, usize)> {
            self.tree
                .find_matches(query.clone(), false)
                .scores
                .iter()
                .map(|(worker, &blocks)| (worker.worker_id, blocks as usize))
                .collect()
        }
    }
}

/// kv-index's `ShardedChainIndex`, one shard sized for the case's workers.
mod smg_side {
    use super::{Side, Workload, BLOCK};
    use kv_index::{
        compute_content_hash, compute_request_content_hashes, ChainBlockMap, ContentHash,
        SequenceHash, ShardedChainIndex, StoredBlock,
    };
    use std::collections::HashMap;

    /// One shard: the chain index itself; more only split the workers between indexes.
    const SHARDS: usize = 1;

    pub struct Smg {
        index: ShardedChainIndex,
        /// kv-index worker id by workload worker.
        ids: Vec<u32>,
        workers: HashMap<u32, u64>,
        /// Each worker's lane map (engine hash to block), kept by the caller.
        maps: Vec<ChainBlockMap>,
        scores: Vec<(u32, u32)>,
    }

    impl Side for Smg {
        const NAME: &'static str = "smg";
        type Events = Vec<Vec<StoredBlock>>;
        type Query = Vec<ContentHash>;

        fn new(workers: usize) -> Self {
            let index = ShardedChainIndex::new(SHARDS, workers);
            let ids: Vec<u32> = (0..workers)
                .map(|w| index.intern_worker(&format!("worker-{w}")).expect("slot"))
                .collect();
            Self {
                workers: ids
                    .iter()
                    .enumerate()
                    .map(|(w, &id)| (id, w as u64))
                    .collect(),
                ids,
                maps: (0..workers).map(|_| ChainBlockMap::default()).collect(),
                index,
                scores: Vec::new(),
            }
        }

        fn prepare(workload: &Workload) -> Self::Events {
            workload
                .events
                .iter()
                .map(|e| {
                    e.engine
                        .iter()
                        .map(|&hash| StoredBlock {
                            seq_hash: SequenceHash(hash),
                            // Filled in by `ingest`.
                            content_hash: ContentHash(0),
                        })
                        .collect()
                })
                .collect()
        }

        fn ingest(&mut self, workload: &Workload, events: &mut Self::Events) {
            for (blocks, e) in events.iter_mut().zip(&workload.events) {
                let tokens = workload.tokens(e).chunks_exact(BLOCK);
                for (block, tokens) in blocks.iter_mut().zip(tokens) {
                    block.content_hash = compute_content_hash(tokens);
                }
                let worker = e.worker as usize;
                self.index
                    .apply_stored(
                        self.ids[worker],
                        blocks,
                        e.parent.map(SequenceHash),
                        &mut self.maps[worker],
                    )
                    .expect("kv-index applies");
            }
        }

        fn hash(tokens: &[u32], out: &mut Self::Query) {
            *out = compute_request_content_hashes(tokens, BLOCK);
        }

        fn lookup(&mut self, query: &Self::Query) -> usize {
            self.scores.clear();
            let scores = &mut self.scores;
            self.index.score_into(
                query,
                |c| c.0,
                false,
                |worker, blocks| {
                    scores.push((worker, blocks));
                },
            );
            self.scores.len()
        }

        fn counts(&mut self, query: &Self::Query) -> Vec<(u64, usize)> {
            let found: Vec<(u64, usize)> = self
                .index
                .find_matches(query, false)
                .scores
                .iter()
                .map(|(id, &blocks)| (self.workers[id], blocks as usize))
                .collect();
            // The timed path must give the same answer as `find_matches`.
            self.lookup(query);
            let mut timed: Vec<(u64, usize)> = self
                .scores
                .iter()
                .map(|(id, blocks)| (self.workers[id], *blocks as usize))
                .collect();
            let mut sorted = found.clone();
            sorted.sort_unstable();
            timed.sort_unstable();
            assert_eq!(
                sorted, timed,
                "kv-index: score_into differs from find_matches"
            );
            found
        }
    }
}

use dynamo_side::Dynamo;
use kvhint_side::Kvhint;
use smg_side::Smg;

// ---------------------------------------------------------------------------------------
// The workload.

/// splitmix64.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix(self.0)
    }

    fn tokens(&mut self, blocks: usize) -> Vec<u32> {
        (0..blocks * BLOCK)
            .map(|_| (self.next() % 150_000) as u32)
            .collect()
    }
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Engine hashes of every block of `tokens`: a chain over the blocks' tokens, keyed by
/// `seed` (a cache salt, a worker's hash seed; 0 = none), so they look random and a prefix is
/// named alike wherever it is stored under the same seed.
fn engine_chain(tokens: &[u32], seed: u64) -> Vec<u64> {
    let mut chain = mix(seed.wrapping_add(0x5EED));
    tokens
        .chunks_exact(BLOCK)
        .map(|block| {
            for &t in block {
                chain = mix(chain ^ u64::from(t));
            }
            chain
        })
        .collect()
}

#[derive(Clone, Copy)]
enum Layout {
    Sparse,
    Shared,
    Salted,
    Seeded,
}

impl Layout {
    fn name(self) -> &'static str {
        match self {
            Layout::Sparse => "sparse",
            Layout::Shared => "shared",
            Layout::Salted => "salted",
            Layout::Seeded => "seeded",
        }
    }

    /// Whether a worker's second sequence after a system prompt is stored chained onto
    /// its parent. Not under `seeded`: Dynamo's `RadixTree` keeps one engine hash per
    /// block position (the first storer's), so a parent named by another worker's seed
    /// is `ParentBlockNotFound` there; the engine restates the system prompt instead,
    /// as it does on a prefix hit with `kv_cache_report_mode="full"`.
    fn chains(self) -> bool {
        !matches!(self, Layout::Seeded)
    }

    /// The seed of `worker`'s engine hashes: its own under `seeded` (never a salt's value),
    /// else the one every worker shares.
    fn seed(self, worker: u64) -> u64 {
        match self {
            Layout::Seeded => mix(worker ^ 0x5EED_ED29) | 1 << 63,
            Layout::Sparse | Layout::Shared | Layout::Salted => 0,
        }
    }
}

/// One `stored` event: `worker` stores blocks `start..end` of `texts[text]` under `engine`,
/// chained onto `parent` (its engine hash of block `start - 1`).
struct Event {
    worker: u64,
    text: usize,
    start: usize,
    end: usize,
    parent: Option<u64>,
    engine: Vec<u64>,
}

struct Workload {
    case: String,
    workers: usize,
    /// `texts[0]` is the prompt.
    texts: Vec<Vec<u32>>,
    events: Vec<Event>,
    /// Blocks stored over all events.
    blocks: usize,
    /// Leading prompt blocks each worker holds (what every side must answer).
    expected: Vec<(u64, usize)>,
    /// `(worker, block position, engine hash)` of every prompt block stored.
    prompt_engine: HashSet<(u64, usize, u64)>,
}

impl Workload {
    fn tokens(&self, e: &Event) -> &[u32] {
        &self.texts[e.text][e.start * BLOCK..e.end * BLOCK]
    }

    fn prompt(&self) -> &[u32] {
        &self.texts[0]
    }

    fn new(layout: Layout, workers: usize, prompt_tokens: usize, background_blocks: usize) -> Self {
        let blocks = prompt_tokens / BLOCK;
        let mut rng = Rng(0x6B76_6869_6E74 ^ ((workers as u64) << 32) ^ prompt_tokens as u64);
        let mut texts = vec![rng.tokens(blocks)];
        let mut events = Vec::new();

        // Background: each worker's unrelated sequences after shared system prompts.
        let system: Vec<Vec<u32>> = (0..SYSTEM_PROMPTS)
            .map(|_| rng.tokens(SYSTEM_PROMPT_BLOCKS))
            .collect();
        let per_worker = (background_blocks / (workers * BACKGROUND_SEQ_BLOCKS)).max(1);
        let mut opened: HashMap<(u64, usize), u64> = HashMap::new();
        for seq in 0..per_worker {
            for worker in 0..workers as u64 {
                let sys = (worker as usize * 7 + seq) % SYSTEM_PROMPTS;
                let mut text = system[sys].clone();
                text.extend(rng.tokens(BACKGROUND_SEQ_BLOCKS - SYSTEM_PROMPT_BLOCKS));
                let engine = engine_chain(&text, layout.seed(worker));
                let (start, parent) = match opened.get(&(worker, sys)) {
                    Some(&parent) if layout.chains() => (SYSTEM_PROMPT_BLOCKS, Some(parent)),
                    // Restated whole, system prompt and all (see `Layout::chains`).
                    Some(_) => (0, None),
                    None => {
                        opened.insert((worker, sys), engine[SYSTEM_PROMPT_BLOCKS - 1]);
                        (0, None)
                    }
                };
                events.push(Event {
                    worker,
                    text: texts.len(),
                    start,
                    end: BACKGROUND_SEQ_BLOCKS,
                    parent,
                    engine: engine[start..].to_vec(),
                });
                texts.push(text);
            }
        }

        // The layout: (worker, prompt blocks held, engine-hash seed: a salt, or the worker's
        // own seed under `seeded`).
        let n = workers as u64;
        let holders: Vec<(u64, usize, u64)> = match layout {
            Layout::Sparse => {
                let k = n.min(4);
                (0..k)
                    .map(|i| (i * n / k, blocks * (i as usize + 1) / k as usize, 0))
                    .collect()
            }
            Layout::Shared | Layout::Seeded => (0..n)
                .map(|w| {
                    let held = 1 + (blocks - 1) * w as usize / (workers - 1).max(1);
                    (w, held, layout.seed(w))
                })
                .collect(),
            Layout::Salted => {
                let others = (n - 1).min(3);
                let mut holders: Vec<(u64, usize, u64)> = (0..others)
                    .map(|i| {
                        let worker = 1 + i * (n - 1) / others;
                        (worker, blocks * (i as usize + 1) / (others as usize + 1), 0)
                    })
                    .collect();
                holders.extend((1..=SALTS).map(|salt| (0, blocks, salt)));
                holders
            }
        };
        let mut held: HashMap<u64, usize> = HashMap::new();
        let mut prompt_engine = HashSet::new();
        for (worker, blocks, seed) in holders {
            let engine = engine_chain(&texts[0][..blocks * BLOCK], seed);
            prompt_engine.extend(engine.iter().enumerate().map(|(d, &h)| (worker, d, h)));
            let most = held.entry(worker).or_default();
            *most = (*most).max(blocks);
            events.push(Event {
                worker,
                text: 0,
                start: 0,
                end: blocks,
                parent: None,
                engine,
            });
        }
        let mut expected: Vec<(u64, usize)> = held.into_iter().collect();
        expected.sort_unstable();

        let prompt = match prompt_tokens {
            t if t % 1024 == 0 => format!("{}k", t / 1024),
            t => t.to_string(),
        };
        Self {
            case: format!("{}/{workers}w/{prompt}", layout.name()),
            workers,
            blocks: events.iter().map(|e| e.end - e.start).sum(),
            texts,
            events,
            expected,
            prompt_engine,
        }
    }
}

// ---------------------------------------------------------------------------------------
// Checks and timing.

fn query<S: Side>(tokens: &[u32]) -> S::Query {
    let mut query = S::Query::default();
    S::hash(tokens, &mut query);
    query
}

/// What one side answers for the case's prompt, sorted by worker.
fn answer<S: Side>(side: &mut S, query: &S::Query) -> Vec<(u64, usize)> {
    let mut counts = side.counts(query);
    counts.sort_unstable();
    counts
}

fn differences(a: &[(u64, usize)], b: &[(u64, usize)]) -> String {
    let a: HashMap<u64, usize> = a.iter().copied().collect();
    let b: HashMap<u64, usize> = b.iter().copied().collect();
    let mut workers: Vec<u64> = a.keys().chain(b.keys()).copied().collect();
    workers.sort_unstable();
    workers.dedup();
    workers
        .into_iter()
        .filter(|w| a.get(w) != b.get(w))
        .take(8)
        .map(|w| {
            let show = |m: &HashMap<u64, usize>| m.get(&w).map_or("-".into(), |n| n.to_string());
            format!("worker {w}: {} vs {}", show(&a), show(&b))
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The three sides agree with each other and with the workload, and kvhint's engine hashes
/// are the matched workers' own.
fn check(w: &Workload, k: &mut Kvhint, d: &mut Dynamo, s: &mut Smg) {
    let (qk, qd, qs) = (
        query::<Kvhint>(w.prompt()),
        query::<Dynamo>(w.prompt()),
        query::<Smg>(w.prompt()),
    );
    let per_block: Vec<u64> = qd.iter().map(|h| h.0).collect();
    let content: Vec<u64> = qs.iter().map(|h| h.0).collect();
    assert_eq!(
        per_block, content,
        "peers {}: Dynamo's and kv-index's per-block hashes differ",
        w.case
    );
    let answers = [
        (Kvhint::NAME, answer(k, &qk)),
        (Dynamo::NAME, answer(d, &qd)),
        (Smg::NAME, answer(s, &qs)),
    ];
    for (name, got) in &answers {
        assert!(
            *got == w.expected,
            "peers {}: AGREEMENT FAILED: {name} answers {} workers, the workload has {} \
             holders (got vs expected: {})",
            w.case,
            got.len(),
            w.expected.len(),
            differences(got, &w.expected)
        );
    }
    for &(worker, held) in &w.expected {
        let engine = k
            .engine_hashes(&qk, worker)
            .expect("kvhint names engine hashes");
        assert_eq!(
            engine.len(),
            held,
            "peers {}: kvhint engine hashes of worker {worker}",
            w.case
        );
        for (position, &hash) in engine.iter().enumerate() {
            assert!(
                w.prompt_engine.contains(&(worker, position, hash)),
                "peers {}: kvhint hands back engine hash {hash:#x} at block {position} for \
                 worker {worker}, which that worker never stored there",
                w.case
            );
        }
    }
}

/// One index build: ns per stored block, and the index.
fn build<S: Side>(w: &Workload) -> (f64, S) {
    let mut side = S::new(w.workers);
    let mut events = S::prepare(w);
    let start = Instant::now();
    side.ingest(w, &mut events);
    let elapsed = start.elapsed();
    drop(events);
    (elapsed.as_nanos() as f64 / w.blocks as f64, side)
}

/// Calls per timed batch so that a batch lasts at least `LOOKUP_BATCH`.
fn batch_size(mut call: impl FnMut()) -> usize {
    let start = Instant::now();
    call();
    let once = start.elapsed().max(Duration::from_nanos(20));
    (LOOKUP_BATCH.as_nanos() / once.as_nanos()).clamp(1, 100_000) as usize
}

/// `samples` batches of `batch` calls: ns per call of each batch.
fn sample(samples: usize, batch: usize, mut call: impl FnMut()) -> Vec<f64> {
    (0..samples)
        .map(|_| {
            let start = Instant::now();
            for _ in 0..batch {
                call();
            }
            start.elapsed().as_nanos() as f64 / batch as f64
        })
        .collect()
}

fn lookups<S: Side>(side: &mut S, query: &S::Query, batch: usize, samples: usize) -> Vec<f64> {
    sample(samples, batch, || {
        black_box(side.lookup(query));
    })
}

/// Batch size and ns per call of `side`'s lookup.
fn calibrate<S: Side>(side: &mut S, query: &S::Query) -> (usize, f64) {
    let batch = batch_size(|| {
        black_box(side.lookup(query));
    });
    (batch, median(&mut lookups(side, query, batch, 3)))
}

/// One round of lookup samples: a warm-up, then the round's share of the time budget.
fn round<S: Side>(side: &mut S, query: &S::Query, (batch, once): (usize, f64), out: &mut Vec<f64>) {
    lookups(side, query, batch, 2);
    let share = LOOKUP_BUDGET.as_nanos() as f64 / LOOKUP_ROUNDS as f64;
    let samples = ((share / (batch as f64 * once)) as usize).clamp(7, 101);
    out.extend(lookups(side, query, batch, samples));
}

struct Timing {
    ingest: [f64; 3],
    lookup: [f64; 3],
}

fn measure(w: &Workload, quick: bool) -> Timing {
    let builds = if quick { 1 } else { INGEST_BUILDS + 1 };
    let (mut ik, mut id, mut is) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..builds {
        // The sides take turns, so drift on the machine spreads over all three, and
        // each index is dropped before the next is built: every build starts from a
        // heap the others have given back. (Kept alive, the other sides' indexes made
        // each side's figure depend on how the others allocate: one side's change
        // moved another's ingest by 9 %.)
        let tk = build::<Kvhint>(w).0;
        let td = build::<Dynamo>(w).0;
        let ts = build::<Smg>(w).0;
        // The first build of each side warms the allocator and is not counted.
        if quick || round > 0 {
            ik.push(tk);
            id.push(td);
            is.push(ts);
        }
    }
    // The indexes the checks and lookups use: one more build of each, untimed.
    let (mut k, mut d, mut s) = (
        build::<Kvhint>(w).1,
        build::<Dynamo>(w).1,
        build::<Smg>(w).1,
    );
    check(w, &mut k, &mut d, &mut s);

    let (qk, qd, qs) = (
        query::<Kvhint>(w.prompt()),
        query::<Dynamo>(w.prompt()),
        query::<Smg>(w.prompt()),
    );
    let (mut lk, mut ld, mut ls) = if quick {
        (
            lookups(&mut k, &qk, 1, 2),
            lookups(&mut d, &qd, 1, 2),
            lookups(&mut s, &qs, 1, 2),
        )
    } else {
        let ck = calibrate(&mut k, &qk);
        let cd = calibrate(&mut d, &qd);
        let cs = calibrate(&mut s, &qs);
        let (mut lk, mut ld, mut ls) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..LOOKUP_ROUNDS {
            round(&mut k, &qk, ck, &mut lk);
            round(&mut d, &qd, cd, &mut ld);
            round(&mut s, &qs, cs, &mut ls);
        }
        (lk, ld, ls)
    };
    Timing {
        ingest: [median(&mut ik), median(&mut id), median(&mut is)],
        lookup: [median(&mut lk), median(&mut ld), median(&mut ls)],
    }
}

/// `PEERS_PROFILE_BUILDS=N`: only one side's index (kvhint's, or the one
/// `PEERS_PROFILE_SIDE` names), built `N` times, with no checks and no lookups, for a
/// profiler to see its ingest alone.
fn profile_side(w: &Workload, builds: usize) {
    fn run<S: Side>(w: &Workload, builds: usize) {
        let mut times: Vec<f64> = (0..builds).map(|_| build::<S>(w).0).collect();
        println!(
            "peers {} ingest {}={:.1} (profile: {builds} builds, median)",
            w.case,
            S::NAME,
            median(&mut times)
        );
    }
    match std::env::var("PEERS_PROFILE_SIDE").as_deref() {
        Ok("kvhint") | Err(_) => run::<Kvhint>(w, builds),
        Ok("dynamo") => run::<Dynamo>(w, builds),
        Ok("smg") => run::<Smg>(w, builds),
        Ok(other) => panic!("PEERS_PROFILE_SIDE={other}: expected kvhint, dynamo or smg"),
    }
}

fn line(case: &str, kind: &str, [k, d, s]: [f64; 3]) {
    println!(
        "peers {case} {kind} kvhint={k:.1} dynamo={d:.1} smg={s:.1} ratio={:.2}",
        k / d.min(s)
    );
}

/// Query hashing of a 4,096-token prompt: ns per prompt.
fn hashing(quick: bool) {
    let prompt = Rng(4096).tokens(4096 / BLOCK);
    let (mut qk, mut qd, mut qs) = Default::default();
    let (samples, batch) = if quick { (2, 1) } else { (201, 200) };
    let mut run = |warm: bool| {
        let n = if warm { 3 } else { samples };
        let k = sample(n, batch, || Kvhint::hash(black_box(&prompt), &mut qk));
        let d = sample(n, batch, || Dynamo::hash(black_box(&prompt), &mut qd));
        let s = sample(n, batch, || Smg::hash(black_box(&prompt), &mut qs));
        (k, d, s)
    };
    run(true);
    let (mut k, mut d, mut s) = run(false);
    let (k, d, s) = (median(&mut k), median(&mut d), median(&mut s));
    println!(
        "peers hash kvhint={k:.1} dynamo={d:.1} smg={s:.1} ratio={:.2}",
        k / d
    );
}

/// Keeps the memory each build frees in the process for the next, for every side alike.
///
/// A case builds each side's index 15 times and drops it between builds. With glibc's
/// default settings, whether a dropped index's memory goes back to the kernel depends on
/// how its blocks lie in the heap: kvhint's few large arrays coalesce at the top and are
/// trimmed, Dynamo's many small nodes are not, so kvhint's next build faulted its memory
/// in again page by page (17,500 page faults a build of `seeded/1024w/32k`, none for
/// Dynamo's) and `sparse/2w/1k`, the first case, read 1.3–1.4× where it is 0.9× once
/// the heap is warm. A router builds its index once and keeps it; the figures are meant
/// to be the indexes' own cost, so no side's freed memory is handed back during the run
/// (no trimming; nothing under 32 MiB mapped apart), which is what
/// `GLIBC_TUNABLES=glibc.malloc.trim_threshold=…:glibc.malloc.mmap_threshold=…` did by hand.
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `mallopt` only changes the allocator's parameters; it is called before
    // any other thread exists.
    unsafe {
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
    }
}

fn main() {
    keep_freed_memory();
    let quick = !is_bench();
    if quick {
        println!("peers quick mode: debug build, figures are not measurements");
    }
    let (workers, prompts, background): (&[usize], &[usize], usize) = if quick {
        (&[2, 64], &[1024], 2_048)
    } else {
        (&[2, 64, 1024], &[1024, 4096, 32768], 131_072)
    };
    // PEERS_CASES=sparse/64w/4k,shared/1024w/1k measures only those cases.
    let only = std::env::var("PEERS_CASES").ok();
    let profile = std::env::var("PEERS_PROFILE_BUILDS").ok().map(|n| {
        n.parse::<usize>()
            .expect("PEERS_PROFILE_BUILDS: a number of builds")
    });
    for layout in [
        Layout::Sparse,
        Layout::Shared,
        Layout::Salted,
        Layout::Seeded,
    ] {
        for &n in workers {
            for &tokens in prompts {
                let name = format!("{}/{n}w/{}k", layout.name(), tokens / 1024);
                if only
                    .as_deref()
                    .is_some_and(|cases| !cases.split(',').any(|c| c.trim() == name))
                {
                    continue;
                }
                let workload = Workload::new(layout, n, tokens, background);
                if let Some(builds) = profile {
                    profile_side(&workload, builds);
                    continue;
                }
                let timing = measure(&workload, quick);
                line(&workload.case, "ingest", timing.ingest);
                line(&workload.case, "lookup", timing.lookup);
            }
        }
    }
    hashing(quick);
}
