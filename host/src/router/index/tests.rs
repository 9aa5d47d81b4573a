//! The index's own tests: every rule the previous index's tests held, on the new
//! structure, plus copies (one worker, many engine hashes for the same tokens).

use super::tree::{BUFFERS_KEEP, BUFFER_MAX};
use super::*;
use crate::router::index::holders::Slot;
use xxhash_rust::xxh3::xxh3_64_with_seed;

const BS: usize = 4;

fn w(worker_id: u64, dp_rank: u32) -> WorkerKey {
    WorkerKey { worker_id, dp_rank }
}

fn hashes(tokens: &[u32]) -> Vec<u64> {
    let mut out = Vec::new();
    block_hashes(tokens, BS, &mut out);
    out
}

/// A `stored` event for `tokens` (whole blocks) with engine hashes `engine`.
fn stored(parent: Option<u64>, tokens: &[u32], engine: &[u64]) -> KvEvent {
    assert_eq!(tokens.len(), engine.len() * BS);
    KvEvent::stored(
        parent,
        tokens
            .chunks(BS)
            .zip(engine)
            .map(|(t, &block_hash)| StoredBlock {
                block_hash,
                token_ids: t.into(),
            })
            .collect(),
    )
}

/// A `removed` event for `block_hashes` (engine hashes).
fn removed(block_hashes: Vec<u64>) -> KvEvent {
    KvEvent::Removed { block_hashes }
}

/// `event` as an engine subscription hands it over ([`KvEvent::Hashed`]): each block
/// hashed where it was decoded, with its extra keys, and the identity as a seed.
fn hashed_form(event: &KvEvent) -> KvEvent {
    match Stored::of(event) {
        Some((
            parent_block_hash,
            Stored {
                identity,
                contents: Contents::Tokens { blocks, extra_keys },
            },
        )) => KvEvent::Hashed {
            parent_block_hash,
            identity,
            blocks: hashed_blocks(
                blocks.iter().map(|b| (b.block_hash, &b.token_ids[..])),
                extra_keys,
            ),
        },
        _ => event.clone(),
    }
}

/// A xorshift generator: `next(bound)` is the next value below `bound`. Seeded, so a
/// failing random test fails the same way again.
fn xorshift(seed: u64) -> impl FnMut(u64) -> u64 {
    let mut rng = seed;
    move |bound| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % bound
    }
}

fn prompt(blocks: usize) -> Vec<u32> {
    (0..(blocks * BS) as u32).map(|t| t * 7 + 3).collect()
}

fn overlaps(index: &KvIndex, tokens: &[u32]) -> Overlaps {
    let mut out = Overlaps::new();
    index.overlaps(&hashes(tokens), &mut out);
    out
}

fn as_vec(out: &Overlaps) -> Vec<(WorkerKey, Vec<u64>)> {
    out.iter().map(|(k, h)| (k, h.to_vec())).collect()
}

/// The answer the router used to get in one piece — each matching worker, longest
/// prefix first (then by key), with its engine hashes — put together from
/// [`KvIndex::lookup`] and [`KvIndex::engine_hashes`], so these tests assert exactly
/// what they asserted of the previous index.
#[derive(Default)]
struct Overlaps {
    rows: Vec<(WorkerKey, Vec<u64>)>,
    matches: Matches,
}

impl Overlaps {
    fn new() -> Self {
        Self::default()
    }
    fn len(&self) -> usize {
        self.rows.len()
    }
    fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }
    fn iter(&self) -> impl Iterator<Item = (WorkerKey, &[u64])> {
        self.rows.iter().map(|(k, h)| (*k, h.as_slice()))
    }
    fn cached_blocks(&self, worker: WorkerKey) -> usize {
        self.engine_hashes(worker).len()
    }
    fn engine_hashes(&self, worker: WorkerKey) -> &[u64] {
        self.rows
            .iter()
            .find(|(k, _)| *k == worker)
            .map_or(&[], |(_, h)| h.as_slice())
    }
}

trait OverlapsExt {
    fn overlaps(&self, hashes: &[u64], out: &mut Overlaps);
}

impl OverlapsExt for KvIndex {
    fn overlaps(&self, hashes: &[u64], out: &mut Overlaps) {
        self.lookup(hashes, &mut out.matches);
        out.rows.clear();
        for found in out.matches.found() {
            let mut engine = Vec::new();
            let n = self.engine_hashes(found.slot, hashes, &mut engine);
            assert_eq!(n, found.cached, "engine hashes cover the match");
            assert_eq!(out.matches.cached_in_slot(found.slot), found.cached);
            out.rows.push((
                self.key_of(found.slot).expect("a match has a worker"),
                engine,
            ));
        }
        out.rows
            .sort_by(|a, b| b.1.len().cmp(&a.1.len()).then(a.0.cmp(&b.0)));
        // The batched form agrees with the one-worker form.
        let rows: Vec<(Slot, usize)> = {
            let mut f: Vec<_> = out.matches.found().to_vec();
            f.sort_by_key(|f| std::cmp::Reverse(f.cached));
            f.iter().map(|f| (f.slot, f.cached)).collect()
        };
        let (mut all, mut lengths) = (Vec::new(), Vec::new());
        self.engine_hashes_for(
            hashes,
            &rows,
            &mut all,
            &mut lengths,
            &mut Default::default(),
        );
        let mut at = 0;
        for (&(slot, len), _) in rows.iter().zip(&lengths) {
            let mut one = Vec::new();
            self.engine_hashes(slot, hashes, &mut one);
            assert_eq!(&all[at..at + len], one.as_slice());
            at += len;
        }
        assert_eq!(all.len(), rows.iter().map(|r| r.1).sum::<usize>());
        assert!(rows.iter().zip(&lengths).all(|(r, l)| r.1 == *l));
    }
}

#[test]
fn block_hashes_follow_the_documented_formula() {
    let tokens = [1u32, 2, 3, 4, 5, 6, 7, 8];
    let bytes = |t: &[u32]| t.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    // The definition in `hashing`, spelled out: content hashes chained by a folded
    // 128-bit multiply with wyhash's constants.
    let chain = |p: u64, c: u64| {
        let m = u128::from(p ^ 0xa076_1d64_78bd_642f) * u128::from(c ^ 0xe703_7ed1_a0b4_28db);
        (m as u64) ^ ((m >> 64) as u64)
    };
    let s0 = xxh3_64_with_seed(&bytes(&tokens[..4]), 1337);
    let s1 = chain(s0, xxh3_64_with_seed(&bytes(&tokens[4..]), 1337));
    assert_eq!(hashes(&tokens), vec![s0, s1]);

    // Any block size, odd ones included: a block's hash covers exactly its tokens.
    let mut out = Vec::new();
    block_hashes(&tokens[..7], 3, &mut out);
    assert_eq!(out.len(), 2);
    assert_eq!(out[0], xxh3_64_with_seed(&bytes(&tokens[..3]), 1337));
    assert_eq!(
        out[1],
        chain(out[0], xxh3_64_with_seed(&bytes(&tokens[3..6]), 1337))
    );
}

#[test]
fn block_hashes_chain_on_the_prefix() {
    let a = hashes(&[1, 2, 3, 4, 9, 9, 9, 9]);
    let b = hashes(&[5, 6, 7, 8, 9, 9, 9, 9]);
    // Same tokens in block 1, different prefix: different sequence hash.
    assert_ne!(a[1], b[1]);
    assert_ne!(a[0], b[0]);
    // Block 1 alone is not block 1 after a prefix.
    assert_ne!(hashes(&[9, 9, 9, 9])[0], a[1]);
}

#[test]
fn block_hashes_skip_a_partial_trailing_block_and_clear_out() {
    let mut out = vec![42, 43, 44, 45, 46];
    block_hashes(&[1, 2, 3, 4, 5, 6, 7], BS, &mut out);
    assert_eq!(out.len(), 1);
    assert_eq!(out, hashes(&[1, 2, 3, 4]));
    block_hashes(&[1, 2, 3], BS, &mut out);
    assert!(out.is_empty());
    block_hashes(&[1, 2, 3], 0, &mut out);
    assert!(out.is_empty());
}

#[test]
fn large_blocks_hash_like_small_ones() {
    // A large block hashes all its token bytes, like a small one.
    let tokens: Vec<u32> = (0..600).collect();
    let mut out = Vec::new();
    block_hashes(&tokens, 300, &mut out);
    let bytes: Vec<u8> = tokens[..300].iter().flat_map(|x| x.to_le_bytes()).collect();
    assert_eq!(out[0], xxh3_64_with_seed(&bytes, 1337));
    assert_eq!(out.len(), 2);
}

#[test]
fn stored_blocks_give_the_prefix_with_engine_hashes() {
    let mut index = KvIndex::new(BS);
    let tokens = prompt(3);
    let stats = index
        .apply(w(1, 0), &stored(None, &tokens, &[101, 102, 103]))
        .unwrap();
    assert_eq!(stats.stored, 3);
    assert_eq!(index.len(), 3);
    assert_eq!(index.distinct_blocks(), 3);

    // A longer request whose first three blocks are cached.
    let out = overlaps(&index, &prompt(5));
    assert_eq!(out.len(), 1);
    assert_eq!(out.cached_blocks(w(1, 0)), 3);
    assert_eq!(out.engine_hashes(w(1, 0)), &[101, 102, 103]);
    assert_eq!(out.cached_blocks(w(2, 0)), 0);
    assert!(out.engine_hashes(w(2, 0)).is_empty());

    // A shorter request matches only its own blocks.
    let out = overlaps(&index, &prompt(2));
    assert_eq!(out.engine_hashes(w(1, 0)), &[101, 102]);

    // A request with a different first block matches nothing.
    let mut other = prompt(3);
    other[0] += 1;
    assert!(overlaps(&index, &other).is_empty());
}

#[test]
fn workers_keep_their_own_engine_hashes_for_the_same_tokens() {
    let mut index = KvIndex::new(BS);
    let tokens = prompt(2);
    index
        .apply(w(1, 0), &stored(None, &tokens, &[11, 12]))
        .unwrap();
    index
        .apply(w(2, 0), &stored(None, &tokens, &[21, 22]))
        .unwrap();
    assert_eq!(index.len(), 4);
    assert_eq!(index.distinct_blocks(), 2);
    let out = overlaps(&index, &tokens);
    assert_eq!(out.engine_hashes(w(1, 0)), &[11, 12]);
    assert_eq!(out.engine_hashes(w(2, 0)), &[21, 22]);
}

/// Nested prefixes of one prompt, each held by another worker, stay one node, whether
/// each worker names the blocks by names of its own (issue 29's `seeded` layout) or
/// all name them alike (`shared`, where the node's shared row stays entered as it
/// grows): a worker holding the first blocks of a node holds them by a cut instead of
/// splitting it, whether the longer prefixes came first (a join that stops inside the
/// node) or last (each extends the node in place, the others cut where it ended).
/// Lookups and each worker's own engine hashes are what they were with one node per
/// prefix length. A clear of the one worker holding every block, and a removal inside
/// the node, split it back into plain nodes first, and the blocks no one holds any
/// more go.
#[test]
fn nested_prefixes_are_one_node_with_cuts_until_a_removal_splits_it() {
    for shared_names in [false, true] {
        nested_prefixes(shared_names);
    }
}

fn nested_prefixes(shared_names: bool) {
    let blocks = 40;
    let tokens = prompt(blocks);
    let n = 20u64;
    let held = |i: u64| 1 + 2 * i as usize;
    let names = |i: u64| -> Vec<u64> {
        let own = if shared_names { 0 } else { i * 1000 };
        (0..held(i)).map(|p| own + p as u64 + 1).collect()
    };
    let expect = |index: &KvIndex, of: &dyn Fn(u64) -> usize| {
        let out = overlaps(index, &tokens);
        for i in 0..n {
            assert_eq!(
                out.engine_hashes(w(i, 0)),
                &names(i)[..of(i)],
                "worker {i}'s own names of its prefix"
            );
        }
    };
    for longest_first in [false, true] {
        let build = || {
            let mut index = KvIndex::new(BS);
            let order: Vec<u64> = match longest_first {
                true => (0..n).rev().collect(),
                false => (0..n).collect(),
            };
            for i in order {
                index
                    .apply(w(i, 0), &stored(None, &tokens[..held(i) * BS], &names(i)))
                    .unwrap();
                index.check_invariants();
            }
            index
        };
        let mut index = build();
        assert_eq!(
            index.node_count(),
            1,
            "longest first: {longest_first}, shared names: {shared_names}"
        );
        assert_eq!(index.held_blocks(), (0..n).map(held).sum::<usize>());
        expect(&index, &|i| held(i));
        let mut matches = Matches::new();
        index.lookup(&hashes(&tokens), &mut matches);
        let cached: Vec<usize> = matches.found().iter().map(|f| f.cached).collect();
        assert!(
            cached.windows(2).all(|p| p[0] <= p[1]),
            "matches come shortest first: {cached:?}"
        );

        // The worker holding every block goes: the blocks past the next longest
        // prefix are no one's and are pruned; the others keep their prefixes.
        index.apply(w(n - 1, 0), &KvEvent::Cleared).unwrap();
        index.check_invariants();
        assert_eq!(index.distinct_blocks(), held(n - 2));
        expect(&index, &|i| if i == n - 1 { 0 } else { held(i) });

        // A removal inside the node: worker 10 keeps the blocks before it.
        let mut index = build();
        index.apply(w(10, 0), &removed(vec![names(10)[5]])).unwrap();
        index.check_invariants();
        assert!(index.node_count() > 1, "split back into plain nodes");
        expect(&index, &|i| if i == 10 { 5 } else { held(i) });
        // Stored again, the gap closes.
        index
            .apply(
                w(10, 0),
                &stored(None, &tokens[..held(10) * BS], &names(10)),
            )
            .unwrap();
        index.check_invariants();
        expect(&index, &|i| held(i));
    }
}

/// A worker extending a node beside holders that hold its blocks through the shared
/// names (named alike) and one that names a block its own way: the names held through
/// the shared names stay entered (the invariant check), and each holder's names and
/// removals answer as before. (Moving a sole holder's own names into the row, as
/// before an append by the only holder, took the names the others held through the
/// shared names out of them here.)
#[test]
fn extending_a_node_beside_holders_keeps_their_shared_names() {
    let tokens = prompt(3);
    let mut index = KvIndex::new(BS);
    // A takes the first slot with a sequence of its own.
    index
        .apply(w(1, 0), &stored(None, &branch_block(1), &[500]))
        .unwrap();
    // B and C name p0 p1 alike (C's copies held through the shared names); A names
    // p1 its own way.
    index
        .apply(w(2, 0), &stored(None, &tokens[..2 * BS], &[1, 2]))
        .unwrap();
    index
        .apply(w(3, 0), &stored(None, &tokens[..2 * BS], &[1, 2]))
        .unwrap();
    index
        .apply(w(1, 0), &stored(None, &tokens[..2 * BS], &[1, 77]))
        .unwrap();
    // C goes on to p2: the node grows in place, A and B cut at 2.
    index
        .apply(w(3, 0), &stored(None, &tokens, &[1, 2, 3]))
        .unwrap();
    index.check_invariants();
    assert_eq!(index.node_count(), 2, "A's own block, then p0..p2");
    let out = overlaps(&index, &tokens);
    assert_eq!(out.engine_hashes(w(1, 0)), &[1, 77]);
    assert_eq!(out.engine_hashes(w(2, 0)), &[1, 2]);
    assert_eq!(out.engine_hashes(w(3, 0)), &[1, 2, 3]);

    // B removes p1 by its name: found, and B keeps p0 alone.
    index.apply(w(2, 0), &removed(vec![2])).unwrap();
    index.check_invariants();
    let out = overlaps(&index, &tokens);
    assert_eq!(out.engine_hashes(w(2, 0)), &[1]);
    assert_eq!(out.engine_hashes(w(3, 0)), &[1, 2, 3]);
    assert_eq!(out.engine_hashes(w(1, 0)), &[1, 77]);
}

/// Tokens unlike any prompt block, for a branch of one block.
fn branch_block(salt: u32) -> Vec<u32> {
    (0..BS as u32).map(|t| 1_000_000 + salt * 100 + t).collect()
}

/// Taking a worker out of a chain of nodes can make each agree with the next: the
/// chain merges whole. (A node merged into its parent is gone before its own turn to
/// merge with its child, and a parent left with one child by a prune merged only
/// that child: the rest of the chain stayed apart. Either fix alone passes this test;
/// seed `0x1234_5678_9abc_def1` of the model stream needs the prune's.)
#[test]
fn a_clear_that_makes_a_chain_agree_merges_it_whole() {
    let mut index = KvIndex::new(BS);
    let tokens = prompt(4);
    let (a, b, c) = (w(1, 0), w(2, 0), w(3, 0));
    index
        .apply(a, &stored(None, &tokens, &[10, 11, 12, 13]))
        .unwrap();
    index
        .apply(b, &stored(None, &tokens, &[20, 21, 22, 23]))
        .unwrap();
    // C holds p0 p1 p2 and a block of its own after p0, then drops p1: the prompt is
    // p0 {A,B,C}, p1 {A,B}, p2 {A,B,C}, p3 {A,B}, four nodes, and C's branch a fifth.
    index
        .apply(c, &stored(None, &tokens[..3 * BS], &[30, 31, 32]))
        .unwrap();
    index
        .apply(c, &stored(Some(30), &branch_block(1), &[39]))
        .unwrap();
    index.apply(c, &removed(vec![31])).unwrap();
    index.check_invariants();
    assert_eq!(index.node_count(), 5);
    // C leaves: A and B hold the whole prompt, one run.
    index.apply(c, &KvEvent::Cleared).unwrap();
    index.check_invariants();
    assert_eq!(index.node_count(), 1, "the prompt is one node again");
}

/// A store that goes its own way from inside a node with cuts splits it there: the
/// head, without cuts now, agrees with the parent the cuts kept it apart from, and
/// is merged with it.
#[test]
fn a_split_where_a_node_had_cuts_merges_the_head_with_its_parent() {
    let mut index = KvIndex::new(BS);
    let tokens = prompt(5);
    let (a, b, c, x) = (w(1, 0), w(2, 0), w(3, 0), w(4, 0));
    index
        .apply(c, &stored(None, &tokens, &[30, 31, 32, 33, 34]))
        .unwrap();
    // A and B hold p0..p3 of C's p0..p4: one node, A and B cut at 4.
    index
        .apply(a, &stored(None, &tokens[..4 * BS], &[10, 11, 12, 13]))
        .unwrap();
    index
        .apply(b, &stored(None, &tokens[..4 * BS], &[20, 21, 22, 23]))
        .unwrap();
    // X holds p0 p1 and a block of its own: the node splits after p1; once X has left,
    // p0 p1 and p2.. have the same holders, and only the cuts keep them apart.
    let mut x_tokens = tokens[..2 * BS].to_vec();
    x_tokens.extend_from_slice(&branch_block(2));
    index
        .apply(x, &stored(None, &x_tokens, &[40, 41, 49]))
        .unwrap();
    index.apply(x, &KvEvent::Cleared).unwrap();
    index.check_invariants();
    assert_eq!(index.node_count(), 2, "p0 p1, then p2..p4 with A and B cut");
    // A goes its own way after p2: p2..p4 splits after p2, whose holders hold it
    // whole; p0..p2 is one node, then p3 p4 and A's block.
    index
        .apply(a, &stored(Some(12), &branch_block(3), &[19]))
        .unwrap();
    index.check_invariants();
    assert_eq!(index.node_count(), 3, "p0..p2, p3 p4, A's block");
}

/// A removal inside a node with cuts splits it back into plain nodes; the last of
/// them agrees with the child the cuts kept it apart from, and is merged with it,
/// though the removal split that piece again.
#[test]
fn a_removal_inside_a_node_with_cuts_merges_its_end_with_the_child() {
    let mut index = KvIndex::new(BS);
    let tokens = prompt(6);
    let (a, b, z) = (w(1, 0), w(2, 0), w(3, 0));
    index
        .apply(b, &stored(None, &tokens, &[20, 21, 22, 23, 24, 25]))
        .unwrap();
    // Z holds p0..p4 and a block of its own: p0..p4 {B,Z}, then p5 {B} and Z's block.
    let mut z_tokens = tokens[..5 * BS].to_vec();
    z_tokens.extend_from_slice(&branch_block(4));
    index
        .apply(z, &stored(None, &z_tokens, &[30, 31, 32, 33, 34, 39]))
        .unwrap();
    // A holds p0 (a cut); Z leaves: p0..p4 {A,B} with A cut at 1, then p5 {B}.
    index.apply(a, &stored(None, &tokens[..BS], &[10])).unwrap();
    index.apply(z, &KvEvent::Cleared).unwrap();
    index.check_invariants();
    assert_eq!(index.node_count(), 2);
    // B drops p2: p0 {A,B}, p1 {B}, p2 no one's (kept: it leads on), p3..p5 {B}.
    index.apply(b, &removed(vec![22])).unwrap();
    index.check_invariants();
    assert_eq!(index.node_count(), 4, "p0, p1, p2, then p3..p5 as one");
}

/// A node split back into plain nodes merges with the neighbours it now agrees with:
/// here a parent whose holders are those of the node's first blocks, which the cut
/// had kept apart, and which nothing else of the removal touches.
#[test]
fn pieces_of_a_node_with_cuts_merge_back_with_their_parent() {
    let mut index = KvIndex::new(BS);
    let tokens = prompt(5);
    let mut other = prompt(1);
    for t in &mut other {
        *t += 1_000_000;
    }
    let (a, b, c) = (w(1, 0), w(2, 0), w(3, 0));
    // A holds p0 n0 n1 n2 n3; C holds p0 and a block of its own, which splits p0 off.
    index
        .apply(a, &stored(None, &tokens, &[10, 11, 12, 13, 14]))
        .unwrap();
    let mut c_tokens = tokens[..BS].to_vec();
    c_tokens.extend_from_slice(&other);
    index.apply(c, &stored(None, &c_tokens, &[30, 31])).unwrap();
    // B holds p0 n0 n1: the node after p0 by a cut.
    index
        .apply(b, &stored(None, &tokens[..3 * BS], &[20, 21, 22]))
        .unwrap();
    // C leaves: p0 is A's and B's, as are n0 n1, but the cut keeps them apart.
    index.apply(c, &KvEvent::Cleared).unwrap();
    index.check_invariants();
    assert_eq!(index.node_count(), 2, "p0, then n0..n3 with B cut at 2");
    // A drops n3: the node goes back to plain nodes, and p0 n0 n1 are one again.
    index.apply(a, &removed(vec![14])).unwrap();
    index.check_invariants();
    assert_eq!(index.node_count(), 2, "p0 n0 n1 for A and B, then n2 for A");
    let out = overlaps(&index, &tokens);
    assert_eq!(out.engine_hashes(a), &[10, 11, 12, 13]);
    assert_eq!(out.engine_hashes(b), &[20, 21, 22]);
}

/// A worker that stores a block under several engine hashes (cache salts) keeps it
/// while any of them is held; when the name a fetch uses goes, the newest name still
/// held takes its place, whichever older ones went before.
#[test]
fn the_newest_name_still_held_takes_over_when_the_named_copy_goes() {
    let mut index = KvIndex::new(BS);
    let tokens = prompt(1);
    for name in [1, 2, 3, 4, 5] {
        index
            .apply(w(1, 0), &stored(None, &tokens, &[name]))
            .unwrap();
    }
    assert_eq!(index.len(), 5);
    assert_eq!(overlaps(&index, &tokens).engine_hashes(w(1, 0)), &[1]);
    // An older extra goes first; then the named copy: the newest left, 5, names it.
    index.apply(w(1, 0), &removed(vec![3, 1])).unwrap();
    index.check_invariants();
    assert_eq!(overlaps(&index, &tokens).engine_hashes(w(1, 0)), &[5]);
    // The newest goes while named: then 4, then 2.
    index.apply(w(1, 0), &removed(vec![5])).unwrap();
    assert_eq!(overlaps(&index, &tokens).engine_hashes(w(1, 0)), &[4]);
    index.apply(w(1, 0), &removed(vec![4])).unwrap();
    assert_eq!(overlaps(&index, &tokens).engine_hashes(w(1, 0)), &[2]);
    // A name stored again after others went is the newest.
    index.apply(w(1, 0), &stored(None, &tokens, &[5])).unwrap();
    index.apply(w(1, 0), &stored(None, &tokens, &[6])).unwrap();
    index.apply(w(1, 0), &removed(vec![2])).unwrap();
    index.check_invariants();
    assert_eq!(overlaps(&index, &tokens).engine_hashes(w(1, 0)), &[6]);
    index.apply(w(1, 0), &removed(vec![6, 5])).unwrap();
    assert!(overlaps(&index, &tokens).is_empty(), "the last name went");
    assert_eq!(index.len(), 0);
    index.check_invariants();
}

#[test]
fn prefix_stops_at_a_gap() {
    let mut index = KvIndex::new(BS);
    let tokens = prompt(4);
    index
        .apply(w(1, 0), &stored(None, &tokens, &[1, 2, 3, 4]))
        .unwrap();
    let stats = index.apply(w(1, 0), &removed(vec![2])).unwrap();
    assert_eq!(
        stats,
        ApplyStats {
            removed: 1,
            ..ApplyStats::default()
        }
    );
    // Blocks 3 and 4 are still held but worth nothing after the gap.
    assert_eq!(index.len(), 3);
    let out = overlaps(&index, &tokens);
    assert_eq!(out.engine_hashes(w(1, 0)), &[1]);
}

#[test]
fn removed_counts_missing_hashes_and_cleared_drops_everything() {
    let mut index = KvIndex::new(BS);
    let tokens = prompt(3);
    index
        .apply(w(1, 0), &stored(None, &tokens, &[1, 2, 3]))
        .unwrap();
    index
        .apply(w(2, 0), &stored(None, &tokens, &[1, 2, 3]))
        .unwrap();

    let stats = index.apply(w(1, 0), &removed(vec![3, 3, 99])).unwrap();
    assert_eq!(
        stats,
        ApplyStats {
            stored: 0,
            removed: 1,
            missing_removals: 2
        }
    );
    // Worker 2's block of the same engine hash is untouched.
    let out = overlaps(&index, &tokens);
    assert_eq!(out.cached_blocks(w(1, 0)), 2);
    assert_eq!(out.cached_blocks(w(2, 0)), 3);

    let stats = index.apply(w(2, 0), &KvEvent::Cleared).unwrap();
    assert_eq!(stats.removed, 3);
    assert_eq!(index.len(), 2);
    let out = overlaps(&index, &tokens);
    assert_eq!(out.len(), 1);
    assert_eq!(out.cached_blocks(w(2, 0)), 0);

    // Removals from a worker the index never saw are all missing, not errors.
    let stats = index.apply(w(9, 0), &removed(vec![1])).unwrap();
    assert_eq!(stats.missing_removals, 1);

    index.apply(w(1, 0), &KvEvent::Cleared).unwrap();
    assert!(index.is_empty());
    assert_eq!(index.distinct_blocks(), 0);

    // A cleared worker stores again from scratch.
    index
        .apply(w(2, 0), &stored(None, &tokens, &[7, 8, 9]))
        .unwrap();
    assert_eq!(overlaps(&index, &tokens).engine_hashes(w(2, 0)), &[7, 8, 9]);
}

#[test]
fn remove_worker_forgets_it_and_reuses_its_slot() {
    let mut index = KvIndex::new(BS);
    let tokens = prompt(2);
    index
        .apply(w(1, 0), &stored(None, &tokens, &[11, 12]))
        .unwrap();
    index
        .apply(w(2, 0), &stored(None, &tokens, &[21, 22]))
        .unwrap();
    index.remove_worker(w(1, 0));
    assert_eq!(index.len(), 2);
    let out = overlaps(&index, &tokens);
    assert_eq!(as_vec(&out), vec![(w(2, 0), vec![21, 22])]);

    // Its parents are gone too.
    let more = prompt(3);
    let err = index
        .apply(w(1, 0), &stored(Some(12), &more[8..], &[13]))
        .unwrap_err();
    assert!(matches!(err, KvEventError::UnknownParent { .. }));

    // A new worker takes the freed slot without inheriting anything.
    index
        .apply(w(3, 0), &stored(None, &tokens[..4], &[31]))
        .unwrap();
    let out = overlaps(&index, &tokens);
    assert_eq!(
        as_vec(&out),
        vec![(w(2, 0), vec![21, 22]), (w(3, 0), vec![31])]
    );
    index.remove_worker(w(2, 0));
    index.remove_worker(w(3, 0));
    index.remove_worker(w(3, 0));
    assert!(index.is_empty());
    assert_eq!(index.distinct_blocks(), 0);
}

#[test]
fn unknown_parent_is_refused_and_changes_nothing() {
    let mut index = KvIndex::new(BS);
    let tokens = prompt(3);
    index
        .apply(w(1, 0), &stored(None, &tokens[..4], &[1]))
        .unwrap();
    let before = overlaps(&index, &tokens);

    let err = index
        .apply(w(1, 0), &stored(Some(77), &tokens[4..], &[2, 3]))
        .unwrap_err();
    assert_eq!(
        err,
        KvEventError::UnknownParent {
            worker: w(1, 0),
            parent_block_hash: 77
        }
    );
    let msg = err.to_string();
    assert!(
        msg.contains("77") && msg.contains("worker 1 dp_rank 0"),
        "{msg}"
    );
    assert!(
        msg.contains("ignored") && msg.contains("unchanged"),
        "{msg}"
    );

    // A parent another worker stored is still unknown to this one.
    index
        .apply(w(2, 0), &stored(None, &tokens[..4], &[5]))
        .unwrap();
    assert!(index
        .apply(w(1, 0), &stored(Some(5), &tokens[4..], &[2, 3]))
        .is_err());
    // Nor does an unknown worker get a slot from a refused event.
    assert!(index
        .apply(w(3, 0), &stored(Some(1), &tokens[4..], &[2, 3]))
        .is_err());

    assert_eq!(index.len(), 2);
    assert_eq!(index.distinct_blocks(), 1);
    let after = overlaps(&index, &tokens);
    assert_eq!(after.engine_hashes(w(1, 0)), before.engine_hashes(w(1, 0)));
    assert_eq!(after.len(), 2);
}

#[test]
fn wrong_token_count_is_refused_and_changes_nothing() {
    let mut index = KvIndex::new(BS);
    let event = KvEvent::stored(
        None,
        vec![
            StoredBlock {
                block_hash: 1,
                token_ids: vec![1, 2, 3, 4].into(),
            },
            StoredBlock {
                block_hash: 2,
                token_ids: vec![5, 6, 7].into(),
            },
        ],
    );
    let err = index.apply(w(1, 0), &event).unwrap_err();
    assert_eq!(
        err,
        KvEventError::WrongBlockSize {
            worker: w(1, 0),
            index: 1,
            block_hash: 2,
            tokens: 3,
            block_size: BS
        }
    );
    let msg = err.to_string();
    assert!(
        msg.contains("3 token ids") && msg.contains("block size is 4"),
        "{msg}"
    );
    assert!(msg.contains("unchanged"), "{msg}");
    // Even the valid first block was not stored.
    assert!(index.is_empty());
    assert!(overlaps(&index, &[1, 2, 3, 4]).is_empty());
    // With a parent the worker does not hold as well, the block size is still what
    // is reported: the event's own fault before the index's state.
    let KvEvent::Stored { blocks, .. } = event else {
        unreachable!("a stored event")
    };
    let orphan = KvEvent::stored(Some(99), blocks);
    assert!(matches!(
        index.apply(w(1, 0), &orphan),
        Err(KvEventError::WrongBlockSize { index: 1, .. })
    ));
    assert!(index.is_empty());
}

#[test]
fn chained_stored_events_continue_the_request_hashes() {
    let mut index = KvIndex::new(BS);
    let tokens = prompt(5);
    index
        .apply(w(1, 0), &stored(None, &tokens[..8], &[1, 2]))
        .unwrap();
    index
        .apply(w(1, 0), &stored(Some(2), &tokens[8..], &[3, 4, 5]))
        .unwrap();
    assert_eq!(index.distinct_blocks(), 5);
    let out = overlaps(&index, &tokens);
    assert_eq!(out.engine_hashes(w(1, 0)), &[1, 2, 3, 4, 5]);

    // Branching from a middle block shares the prefix and nothing after it.
    let mut branch = tokens.clone();
    branch[12] += 1;
    index
        .apply(w(2, 0), &stored(None, &branch[..12], &[1, 2, 3]))
        .unwrap();
    index
        .apply(w(2, 0), &stored(Some(3), &branch[12..], &[40, 50]))
        .unwrap();
    assert_eq!(index.distinct_blocks(), 7);
    let out = overlaps(&index, &tokens);
    assert_eq!(out.engine_hashes(w(2, 0)), &[1, 2, 3]);
    let out = overlaps(&index, &branch);
    assert_eq!(out.engine_hashes(w(2, 0)), &[1, 2, 3, 40, 50]);
    assert_eq!(out.engine_hashes(w(1, 0)), &[1, 2, 3]);
}

/// An engine subscription hashes each block where it decodes the event: stored that
/// way, a sequence (with a LoRA name, a salt and a block with an extra key) is the
/// same sequence as stored from its tokens.
#[test]
fn a_store_hashed_where_it_was_decoded_lands_where_its_tokens_would() {
    let tokens = prompt(6);
    let event = |parent: Option<u64>, range: std::ops::Range<usize>, extra_keys| {
        let blocks = tokens[range.start * BS..range.end * BS]
            .chunks(BS)
            .zip(range.clone())
            .map(|(t, i)| StoredBlock {
                block_hash: 1 + i as u64,
                token_ids: t.into(),
            })
            .collect();
        KvEvent::Stored {
            parent_block_hash: parent,
            blocks,
            lora_name: Some("adapter".into()),
            cache_salt: Some("salt".into()),
            extra_keys,
        }
    };
    // The second event's second block (block 4) also covers an image.
    let events = [
        event(None, 0..3, vec![]),
        event(Some(3), 3..6, vec![(1, 77)]),
    ];
    let (mut by_tokens, mut by_content) = (KvIndex::new(BS), KvIndex::new(BS));
    for e in &events {
        let expected = by_tokens.apply(w(1, 0), e);
        assert_eq!(by_content.apply(w(1, 0), &hashed_form(e)), expected);
    }
    let mut query = Vec::new();
    seeded_block_hashes(
        &tokens,
        BS,
        identity_seed(Some("adapter"), Some("salt")),
        &mut query,
    );
    let answer = |index: &KvIndex, query: &[u64]| {
        let mut out = Overlaps::new();
        index.overlaps(query, &mut out);
        as_vec(&out)
    };
    // Tokens alone match up to the block with the image, under the same identity only.
    assert_eq!(
        answer(&by_content, &query),
        vec![(w(1, 0), vec![1, 2, 3, 4])]
    );
    assert_eq!(answer(&by_content, &query), answer(&by_tokens, &query));
    assert!(answer(&by_content, &hashes(&tokens)).is_empty());
    by_content.check_invariants();
}

/// A node's offsets only grow along a sequence that keeps growing at its end while
/// losing its head; after 2^32 blocks through it they wrap, and the index must keep
/// working (a debug build used to panic on the overflow). The wrap is staged by moving
/// a sequence's offsets to just below 2^32, then growing, splitting and evicting it.
#[test]
fn node_offsets_that_wrap_past_u32_max_keep_every_answer() {
    let mut index = KvIndex::new(BS);
    let tokens = prompt(8);
    let engines: Vec<u64> = (1..=8).collect();
    index
        .apply(w(1, 0), &stored(None, &tokens[..3 * BS], &engines[..3]))
        .unwrap();
    let node = index.blocks[0].node;
    let base = u32::MAX - 1;
    index.nodes[node as usize].first = base;
    for (j, &block) in index.nodes[node as usize].ids.clone().iter().enumerate() {
        index.blocks[block as usize].offset = base.wrapping_add(j as u32);
    }
    index.check_invariants();
    // Appends past the wrap, a branch that splits the node, and an eviction of its head.
    index
        .apply(w(1, 0), &stored(Some(3), &tokens[3 * BS..], &engines[3..]))
        .unwrap();
    let mut branch = tokens.clone();
    branch[5 * BS] += 1;
    index
        .apply(
            w(2, 0),
            &stored(None, &branch[..6 * BS], &[1, 2, 3, 4, 5, 60]),
        )
        .unwrap();
    index.check_invariants();
    assert_eq!(
        as_vec(&overlaps(&index, &tokens)),
        vec![(w(1, 0), engines.clone()), (w(2, 0), vec![1, 2, 3, 4, 5])]
    );
    index.apply(w(1, 0), &removed(vec![1])).unwrap();
    index.check_invariants();
    assert_eq!(
        as_vec(&overlaps(&index, &branch)),
        vec![(w(2, 0), vec![1, 2, 3, 4, 5, 60])]
    );
}

#[test]
fn overlaps_are_ordered_longest_then_worker_then_rank() {
    let mut index = KvIndex::new(BS);
    let tokens = prompt(3);
    let store = |index: &mut KvIndex, key: WorkerKey, blocks: usize| {
        let engine: Vec<u64> = (0..blocks as u64).map(|b| key.worker_id * 10 + b).collect();
        index
            .apply(key, &stored(None, &tokens[..blocks * BS], &engine))
            .unwrap();
    };
    store(&mut index, w(5, 1), 1);
    store(&mut index, w(3, 0), 2);
    store(&mut index, w(9, 0), 3);
    store(&mut index, w(5, 0), 1);
    store(&mut index, w(2, 0), 1);
    store(&mut index, w(4, 0), 3);
    let mut out = Overlaps::new();
    index.overlaps(&hashes(&tokens), &mut out);
    let order: Vec<(WorkerKey, usize)> = out.iter().map(|(k, h)| (k, h.len())).collect();
    assert_eq!(
        order,
        vec![
            (w(4, 0), 3),
            (w(9, 0), 3),
            (w(3, 0), 2),
            (w(2, 0), 1),
            (w(5, 0), 1),
            (w(5, 1), 1),
        ]
    );
    assert_eq!(out.engine_hashes(w(9, 0)), &[90, 91, 92]);
    assert_eq!(out.cached_blocks(w(5, 1)), 1);

    // Reusing the output for a shorter request leaves nothing stale behind.
    index.overlaps(&hashes(&tokens[..4]), &mut out);
    assert_eq!(out.len(), 6);
    assert!(out.iter().all(|(_, h)| h.len() == 1));
    assert_eq!(out.engine_hashes(w(4, 0)), &[40]);
    index.overlaps(&[], &mut out);
    assert!(out.is_empty());
    assert_eq!(out.cached_blocks(w(4, 0)), 0);
}

#[test]
fn same_tokens_under_two_engine_hashes_survive_one_removal() {
    let mut index = KvIndex::new(BS);
    let tokens = prompt(1);
    index.apply(w(1, 0), &stored(None, &tokens, &[1])).unwrap();
    index.apply(w(1, 0), &stored(None, &tokens, &[2])).unwrap();
    assert_eq!(index.len(), 2);
    let out = overlaps(&index, &tokens);
    assert_eq!(out.len(), 1);
    assert_eq!(out.cached_blocks(w(1, 0)), 1);
    index.apply(w(1, 0), &removed(vec![1])).unwrap();
    assert_eq!(overlaps(&index, &tokens).engine_hashes(w(1, 0)), &[2]);

    // Storing the same engine hash again is idempotent.
    index.apply(w(1, 0), &stored(None, &tokens, &[2])).unwrap();
    assert_eq!(index.len(), 1);
    // Reusing an engine hash for other tokens moves it.
    let other = prompt(2);
    index
        .apply(w(1, 0), &stored(None, &other[4..], &[2]))
        .unwrap();
    assert_eq!(index.len(), 1);
    assert!(overlaps(&index, &tokens).is_empty());
    assert_eq!(overlaps(&index, &other[4..]).engine_hashes(w(1, 0)), &[2]);
}

/// Random event streams against a naive model: per worker, the set of router hashes
/// it holds; a worker's overlap is the leading run of a request's hashes in its set.
#[test]
fn random_event_streams_match_a_naive_model() {
    let workers = [w(1, 0), w(1, 1), w(2, 0), w(3, 0), w(4, 2)];
    streams_against_the_naive_model(&workers, 3000, 0x2545_f491_4f6c_dd1d_u64);
}

/// The same with 200 workers: holder sets of four 64-slot words, so a lookup meets
/// nodes whose words line up with the ones still matching (the dense path) and nodes
/// that lack some of them (the merge by word index).
#[test]
fn random_event_streams_over_many_workers_match_a_naive_model() {
    let workers: Vec<WorkerKey> = (0..200).map(|i| w(100 + i / 2, (i % 2) as u32)).collect();
    streams_against_the_naive_model(&workers, 4000, 0x9e37_79b9_7f4a_7c15);
}

fn streams_against_the_naive_model(workers: &[WorkerKey], steps: usize, seed: u64) {
    use std::collections::{BTreeMap, HashSet};

    let mut next = xorshift(seed);
    let base = prompt(8);
    let mut docs = [base.clone(), base.clone(), base, prompt(8)];
    docs[1][3 * BS] += 1; // shares 3 blocks with doc 0
    docs[2][6 * BS + 1] += 1; // shares 6 blocks
    docs[3].reverse(); // shares nothing
    let doc_hashes: Vec<Vec<u64>> = docs.iter().map(|d| hashes(d)).collect();
    // Engines name blocks by content, but each worker differently.
    let engine = |k: WorkerKey, seq: u64| seq ^ (k.worker_id << 40) ^ u64::from(k.dp_rank);

    let mut index = KvIndex::new(BS);
    let mut model: BTreeMap<WorkerKey, HashSet<u64>> = BTreeMap::new();
    let mut out = Overlaps::new();
    let (mut chained, mut refused, mut longest) = (0, 0, 0);
    for _ in 0..steps {
        let k = workers[next(workers.len() as u64) as usize];
        let held = model.entry(k).or_default();
        match next(10) {
            0..=5 => {
                let d = next(docs.len() as u64) as usize;
                let start = next(8) as usize;
                let count = 1 + next((8 - start) as u64) as usize;
                let parent = (start > 0).then(|| engine(k, doc_hashes[d][start - 1]));
                let blocks = &doc_hashes[d][start..start + count];
                let ev = stored(
                    parent,
                    &docs[d][start * BS..(start + count) * BS],
                    &blocks.iter().map(|&h| engine(k, h)).collect::<Vec<_>>(),
                );
                let known = start == 0 || held.contains(&doc_hashes[d][start - 1]);
                match index.apply(k, &ev) {
                    Ok(stats) => {
                        assert!(known);
                        chained += usize::from(start > 0);
                        assert_eq!(stats.stored, count);
                        held.extend(blocks);
                    }
                    Err(err) => {
                        assert!(!known);
                        refused += 1;
                        assert!(matches!(err, KvEventError::UnknownParent { .. }));
                    }
                }
            }
            6..=7 => {
                let d = next(docs.len() as u64) as usize;
                let victims: Vec<u64> = (0..1 + next(3))
                    .map(|_| doc_hashes[d][next(8) as usize])
                    .collect();
                let mut removed = 0;
                for v in &victims {
                    removed += usize::from(held.remove(v));
                }
                let ev = KvEvent::Removed {
                    block_hashes: victims.iter().map(|&h| engine(k, h)).collect(),
                };
                let stats = index.apply(k, &ev).unwrap();
                assert_eq!(stats.removed, removed);
                assert_eq!(stats.missing_removals, victims.len() - removed);
            }
            8 => {
                let stats = index.apply(k, &KvEvent::Cleared).unwrap();
                assert_eq!(stats.removed, held.len());
                held.clear();
            }
            _ => {
                index.remove_worker(k);
                held.clear();
            }
        }

        assert_eq!(index.len(), model.values().map(HashSet::len).sum::<usize>());
        let distinct: HashSet<u64> = model.values().flatten().copied().collect();
        assert_eq!(index.distinct_blocks(), distinct.len());
        for request in &doc_hashes {
            let n = 1 + next(8) as usize;
            let request = &request[..n];
            let mut expected: Vec<(WorkerKey, Vec<u64>)> = model
                .iter()
                .map(|(&k, held)| {
                    let prefix = request.iter().take_while(|h| held.contains(h));
                    (k, prefix.map(|&h| engine(k, h)).collect::<Vec<_>>())
                })
                .filter(|(_, e)| !e.is_empty())
                .collect();
            expected.sort_by(|a, b| b.1.len().cmp(&a.1.len()).then(a.0.cmp(&b.0)));
            index.overlaps(request, &mut out);
            longest = longest.max(expected.first().map_or(0, |e| e.1.len()));
            assert_eq!(as_vec(&out), expected);
            for (k, e) in &expected {
                assert_eq!(out.engine_hashes(*k), e.as_slice());
            }
        }
    }
    // The stream must have exercised chaining, refusal and deep prefixes.
    assert!(
        chained > 100 && refused > 100 && longest == 8,
        "{chained} {refused} {longest}"
    );
}

#[test]
fn wire_forms_round_trip() {
    let forms = [
        (
            r#"{"stored":{"parent_block_hash":7,"blocks":[{"block_hash":11,"token_ids":[1,2,3,4]}]}}"#,
            KvEvent::stored(
                Some(7),
                vec![StoredBlock {
                    block_hash: 11,
                    token_ids: vec![1, 2, 3, 4].into(),
                }],
            ),
        ),
        (
            r#"{"stored":{"parent_block_hash":null,"blocks":[]}}"#,
            KvEvent::stored(None, vec![]),
        ),
        (
            r#"{"removed":{"block_hashes":[11,22,18446744073709551615]}}"#,
            KvEvent::Removed {
                block_hashes: vec![11, 22, u64::MAX],
            },
        ),
        (r#""cleared""#, KvEvent::Cleared),
    ];
    for (json, event) in forms {
        let parsed: KvEvent = serde_json::from_str(json).unwrap();
        assert_eq!(parsed, event, "{json}");
        assert_eq!(serde_json::to_string(&event).unwrap(), json);
    }
    let key = w(3, 1);
    let json = serde_json::to_string(&key).unwrap();
    assert_eq!(json, r#"{"worker_id":3,"dp_rank":1}"#);
    assert_eq!(serde_json::from_str::<WorkerKey>(&json).unwrap(), key);
}

#[test]
fn wire_forms_refuse_unknown_fields_and_variants() {
    for json in [
        r#"{"stored":{"parent_block_hash":null,"blocks":[],"lora_id":3}}"#,
        r#"{"stored":{"parent_block_hash":null,"blocks":[{"block_hash":1,"token_ids":[],"extra":1}]}}"#,
        r#"{"removed":{"block_hashes":[1],"medium":"gpu"}}"#,
    ] {
        let err = serde_json::from_str::<KvEvent>(json).unwrap_err();
        assert!(err.to_string().contains("unknown field"), "{json}: {err}");
    }
    for json in [
        r#""evicted""#,
        r#"{"Stored":{"parent_block_hash":null,"blocks":[]}}"#,
        r#"{"removed":{"block_hashes":[-1]}}"#,
    ] {
        assert!(serde_json::from_str::<KvEvent>(json).is_err(), "{json}");
    }
}

impl KvIndex {
    /// Copies held through the shared names, over all workers.
    fn backed_copies(&self) -> usize {
        let book = self.book();
        let book = book.lock();
        book.all().map(|(_, w)| w.backed).sum()
    }

    /// Own names (a holder naming a block otherwise than its node's shared row), over
    /// all workers.
    fn own_names(&self) -> usize {
        self.own.len()
    }

    /// Every structural invariant the tree relies on; panics with the first broken one.
    fn check_invariants(&self) {
        let book = self.book();
        let book = book.lock();
        let mut copies = 0;
        // Backed copies per slot, counted from the rows.
        let mut backed: std::collections::HashMap<Slot, usize> = Default::default();
        for (id, node) in self.nodes.iter().enumerate() {
            if !node.live {
                continue;
            }
            let id = id as NodeId;
            assert!(node.len() > 0, "node {id} is empty");
            assert_eq!(node.ids.len(), node.len(), "node {id} ids");
            for (j, &block) in node.ids.iter().enumerate() {
                let at = self.blocks[block as usize];
                assert_eq!(at.node, id, "block {block} points at another node");
                assert_eq!(
                    at.offset,
                    node.first.wrapping_add(j as u32),
                    "block {block} offset"
                );
            }
            assert_eq!(
                node.engines.common().len(),
                node.len(),
                "node {id}: shared row"
            );
            // A node and its parent that could be one are one: every restructuring
            // merges what it leaves agreeing (else runs shatter and walks slow down).
            if node.parent != NO_NODE {
                let p = &self.nodes[node.parent as usize];
                assert!(
                    !(p.children.only() == Some(id)
                        && p.holders.same_members(&node.holders)
                        && p.cuts.is_none()
                        && node.cuts.is_none()),
                    "node {id} and its parent {} agree but are not merged",
                    node.parent
                );
            }
            if let Some(cuts) = &node.cuts {
                assert!(!cuts.is_empty(), "node {id}: no empty cuts are kept");
                cuts.check();
                assert!(
                    node.holders.len() > cuts.len(),
                    "node {id}: some holder holds every block"
                );
                for &(cut, slot) in cuts.by_cut() {
                    assert!(
                        cut > 0 && (cut as usize) < node.len(),
                        "node {id}: slot {slot}'s cut {cut} is inside the node"
                    );
                    assert!(
                        node.holders.contains(slot),
                        "node {id}: a cut holder is a holder"
                    );
                    assert_eq!(
                        cuts.cut_of(slot),
                        Some(cut as usize),
                        "node {id}: cut by slot"
                    );
                }
            }
            for slot in node.holders.slots() {
                let mut row = node.row(&self.own, slot);
                row.truncate(node.held_until(slot));
                let w = book.worker(slot).expect("holder is live");
                for (j, engine) in row.iter().enumerate() {
                    match w.by_engine.get(*engine) {
                        Some(copy) => {
                            assert_eq!(copy.block, node.ids[j], "row engine names its block")
                        }
                        // Backed: the shared names give this block for the name.
                        None => {
                            assert_eq!(
                                book.shared.by_engine.get(engine),
                                Some(&node.ids[j]),
                                "node {id}: a name in no own map is entered for its block"
                            );
                            *backed.entry(slot).or_insert(0) += 1;
                        }
                    }
                }
            }
            if node.entered {
                assert!(node.listed, "node {id}: an entered node is listed");
                for (j, engine) in node.engines.common().iter().enumerate() {
                    assert_eq!(
                        book.shared.by_engine.get(engine),
                        Some(&node.ids[j]),
                        "node {id}: an entered node's shared row is entered"
                    );
                }
            }
            assert!(
                !(node.holders.is_empty() && node.children.is_empty()),
                "node {id} should have been pruned"
            );
            if node.parent == NO_NODE {
                assert_eq!(self.roots.get(&node.seqs[0]), Some(&id), "root {id} listed");
            } else {
                let parent = &self.nodes[node.parent as usize];
                assert!(parent.live, "node {id}'s parent is live");
                assert_eq!(
                    parent.children.get(node.seqs[0]),
                    Some(id),
                    "child {id} listed"
                );
            }
            for child in node.children.nodes() {
                assert_eq!(self.nodes[child as usize].parent, id, "child's parent");
            }
        }
        for (&seq, &root) in &self.roots {
            let node = &self.nodes[root as usize];
            assert!(node.live && node.parent == NO_NODE && node.seqs[0] == seq);
        }
        for (slot, _) in self
            .slot_keys
            .iter()
            .enumerate()
            .filter(|(_, k)| k.is_some())
        {
            assert!(book.worker(slot as Slot).is_some(), "a live slot has names");
        }
        // Every own name is a holder's, of a block of a node marked odd, and differs
        // from the shared row's.
        self.own.check();
        for (slot, block, engine) in self.own.all() {
            let (node, pos) = self.at(block);
            let n = &self.nodes[node as usize];
            assert!(n.live, "an own name's node is live");
            assert!(n.holds(slot, pos), "node {node}: an own name is a holder's");
            assert!(n.engines.has_odd(), "node {node}: own names mark it odd");
            assert_ne!(
                n.engines.common()[pos],
                engine,
                "node {node}: an own name differs from the shared row"
            );
        }
        // Every shared name is its block's shared row's, in a listed node.
        for (&engine, &block) in &book.shared.by_engine {
            let (node, pos) = self.at(block);
            let n = &self.nodes[node as usize];
            assert!(
                n.live && n.listed,
                "an entered block's node is live and listed"
            );
            assert_eq!(
                n.engines.common()[pos],
                engine,
                "an entered name is its block's in the shared row"
            );
        }
        for (slot, w) in book.all() {
            assert!(self.key_of(slot).is_some(), "names belong to a live slot");
            assert_eq!(
                w.backed,
                backed.get(&slot).copied().unwrap_or(0),
                "slot {slot}: backed copies counted"
            );
            w.by_engine.check();
            copies += w.by_engine.len() + w.backed;
            for (engine, copy) in w.by_engine.iter() {
                let (node, pos) = self.at(copy.block);
                let n = &self.nodes[node as usize];
                assert!(n.live, "copy's node is live");
                assert!(n.holds(slot, pos), "a copy's block is held");
                let row = n.row(&self.own, slot);
                if copy.extra == names::NAMED {
                    assert_eq!(row[pos], engine, "the named copy is the node's");
                } else {
                    assert_eq!(
                        w.extras.engine(copy.extra),
                        Some(engine),
                        "an extra knows its entry"
                    );
                    assert_ne!(row[pos], engine, "an extra is not the named copy");
                }
            }
            for (block, extras) in w.extras.lists() {
                assert!(!extras.is_empty(), "no empty extras list is kept");
                for (at, engine) in extras {
                    assert_eq!(
                        w.by_engine.get(engine),
                        Some(names::Copy { block, extra: at })
                    );
                }
            }
        }
        assert_eq!(copies, self.entries, "entries count every copy");
    }
}

/// Random event streams — salts and copies (several engine hashes for one block), engine
/// hashes reused for other tokens, chained stores, removals, clears, deregistrations —
/// against a reference model that keeps, per worker, each block's named copy and its
/// extra copies. A worker's overlap is the leading run of a request's blocks it holds;
/// the name a fetch uses is the first copy stored while it lasts, then the newest of the
/// extras still held. Every answer is compared, and the tree's invariants are checked
/// after every event.
#[test]
fn random_events_with_copies_match_a_reference_model() {
    for seed in [
        0x9e37_79b9_7f4a_7c15_u64,
        0x2545_f491_4f6c_dd1d,
        0xdead_beef_cafe_f00d,
        // A clear whose prune merges a parent with its last child, which then agrees
        // with its own child in turn (step 355): `prune` merges the chain.
        0x1234_5678_9abc_def1,
    ] {
        events_against_the_model(seed, Naming::PerWorker, &model_workers(6));
    }
}

/// The same streams with every worker naming a block alike (engines of one model and
/// hash seed), so that most copies are held through the shared names: joins, removals
/// of such copies (twice in one event, too), their blocks renamed to an extra, hashes
/// reused for other tokens while held that way, clears and deregistrations.
#[test]
fn random_events_with_names_shared_by_every_worker_match_a_reference_model() {
    for seed in [0x51ed_2701_4f6c_dd1d_u64, 0x0bad_5eed_1234_5678] {
        events_against_the_model(seed, Naming::Shared, &model_workers(6));
    }
}

/// The same streams with every worker hashing blocks under a seed of its own (vLLM with
/// a non-cryptographic prefix-caching hash and no shared `PYTHONHASHSEED`: issue 29), so
/// that the same tokens have unrelated names on every worker, but for two workers that
/// share a seed; with a fleet of a few workers, and one spread over two holder words.
#[test]
fn random_events_with_a_hash_seed_per_worker_match_a_reference_model() {
    for seed in [0x5eed_2901_9e37_79b9_u64, 0x0dd5_eed5_2545_f491] {
        events_against_the_model(seed, Naming::Seeded, &model_workers(6));
    }
    events_against_the_model(0x29_5eed_dead_beef, Naming::Seeded, &model_workers(70));
}

/// How the model's workers name blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Naming {
    /// Alike on every worker (engines of one model and hash seed).
    Shared,
    /// The shared names with the worker's id mixed in.
    PerWorker,
    /// A hash of the block under the worker's own seed; the first and the last worker
    /// share one.
    Seeded,
}

/// `n` workers for the reference-model streams: ids 1.., with a few dp ranks.
fn model_workers(n: u64) -> Vec<WorkerKey> {
    (0..n)
        .map(|i| match i {
            1 => w(1, 1),
            4 => w(4, 2),
            _ => w(i + 1, 0),
        })
        .collect()
}

fn events_against_the_model(seed: u64, naming: Naming, workers: &[WorkerKey]) {
    use std::collections::BTreeMap;
    let shared_names = naming == Naming::Shared;

    /// A copy goes; if it is the named copy, the newest extra becomes the named one.
    fn drop_name(h: &mut BTreeMap<u64, (u64, Vec<u64>)>, seq: u64, engine: u64) {
        if let Some((named, extras)) = h.get_mut(&seq) {
            if *named == engine {
                match extras.pop() {
                    Some(last) => *named = last,
                    None => {
                        h.remove(&seq);
                    }
                }
            } else if let Some(at) = extras.iter().position(|&e| e == engine) {
                extras.remove(at);
            }
        }
    }

    let mut next = xorshift(seed);
    const DOC: usize = 12;
    let base = prompt(DOC);
    let mut docs = vec![base.clone(); 6];
    docs[1][4 * BS] += 1; // shares 4 blocks with doc 0
    docs[2][8 * BS + 1] += 1; // shares 8
    docs[3][BS] += 2; // shares 1
    docs[4].reverse(); // shares nothing
    docs[5][10 * BS] += 5; // shares 10
    let last = workers.len() - 1;

    // seq → (the name a fetch uses, the other engine hashes held for it)
    type Held = BTreeMap<u64, (u64, Vec<u64>)>;
    let mut index = KvIndex::new(BS);
    let mut held: BTreeMap<WorkerKey, Held> = BTreeMap::new();
    let mut seq_of: BTreeMap<(WorkerKey, u64), u64> = BTreeMap::new();
    let mut matches = Matches::new();
    let (mut rings, mut reused, mut merged_back, mut most_backed) = (0, 0, 0, 0);
    let mut most_own_names = 0;
    let steps = if workers.len() > 8 { 3000 } else { 6000 };
    for step in 0..steps {
        let at = next(workers.len() as u64) as usize;
        let k = workers[at];
        let h = held.entry(k).or_default();
        // Engine names: a function of the block and a salt (and of the worker, unless
        // every worker names blocks alike); sometimes another block's.
        let own = match naming {
            Naming::Shared => 0,
            Naming::PerWorker => k.worker_id << 48,
            // The first and the last worker share a seed.
            Naming::Seeded => 0x5eed ^ (if at == last { 0 } else { at as u64 }) << 32,
        };
        let name = |seq: u64, salt: u64| match naming {
            Naming::Shared | Naming::PerWorker => seq.rotate_left(17) ^ own ^ salt,
            Naming::Seeded => {
                // Nothing in common with the name under another seed.
                let z = (seq ^ own).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                (z ^ (z >> 29)).wrapping_mul(0xBF58_476D_1CE4_E5B9) ^ salt
            }
        };
        match next(12) {
            0..=6 => {
                let d = next(docs.len() as u64) as usize;
                let start = next(DOC as u64) as usize;
                let count = 1 + next((DOC - start) as u64) as usize;
                let doc_hashes = hashes(&docs[d]);
                let parent_seq = (start > 0).then(|| doc_hashes[start - 1]);
                // The parent by one of the names this worker holds it under, if any.
                let parent =
                    parent_seq.map(|s| h.get(&s).map(|(named, _)| *named).unwrap_or(name(s, 99)));
                let engines: Vec<u64> = doc_hashes[start..start + count]
                    .iter()
                    .map(|&s| match next(if shared_names { 30 } else { 10 }) {
                        // (With shared names, mostly the plain name: a node whose row
                        // holds a reused name cannot be entered.)
                        0..=5 | 10.. => name(s, 0),
                        6..=7 => name(s, 1 + next(2)),
                        // Reuse: the name of another of this doc's blocks.
                        _ => name(doc_hashes[next(DOC as u64) as usize], 0),
                    })
                    .collect();
                let event = stored(parent, &docs[d][start * BS..(start + count) * BS], &engines);
                let known = parent.is_none_or(|p| seq_of.contains_key(&(k, p)));
                let result = index.apply(k, &event);
                assert_eq!(result.is_ok(), known, "step {step}: {result:?}");
                if known {
                    for (&engine, &seq) in engines.iter().zip(&doc_hashes[start..start + count]) {
                        match seq_of.get(&(k, engine)) {
                            Some(&old) if old == seq => continue,
                            Some(&old) => {
                                reused += 1;
                                drop_name(h, old, engine);
                            }
                            None => {}
                        }
                        seq_of.insert((k, engine), seq);
                        match h.get_mut(&seq) {
                            Some((_, extras)) => {
                                extras.push(engine);
                                rings += 1;
                            }
                            None => {
                                h.insert(seq, (engine, Vec::new()));
                            }
                        }
                    }
                }
            }
            7..=9 => {
                let victims: Vec<u64> = (0..1 + next(4))
                    .map(|_| {
                        let names: Vec<u64> = h
                            .values()
                            .flat_map(|(named, extras)| std::iter::once(named).chain(extras))
                            .copied()
                            .collect();
                        if names.is_empty() || next(5) == 0 {
                            next(1 << 40)
                        } else {
                            names[next(names.len() as u64) as usize]
                        }
                    })
                    .collect();
                let mut removed = 0;
                let mut missing = 0;
                for &v in &victims {
                    match seq_of.remove(&(k, v)) {
                        Some(seq) => {
                            removed += 1;
                            drop_name(h, seq, v);
                        }
                        None => missing += 1,
                    }
                }
                let stats = index
                    .apply(
                        k,
                        &KvEvent::Removed {
                            block_hashes: victims,
                        },
                    )
                    .expect("removals apply");
                assert_eq!((stats.removed, stats.missing_removals), (removed, missing));
            }
            10 => {
                let before = index.node_count();
                let stats = index.apply(k, &KvEvent::Cleared).expect("clears");
                assert_eq!(
                    stats.removed,
                    h.values().map(|(_, n)| 1 + n.len()).sum::<usize>()
                );
                h.clear();
                seq_of.retain(|(worker, _), _| *worker != k);
                merged_back += usize::from(index.node_count() < before);
            }
            _ => {
                index.remove_worker(k);
                h.clear();
                seq_of.retain(|(worker, _), _| *worker != k);
            }
        }
        index.check_invariants();
        most_backed = most_backed.max(index.backed_copies());
        most_own_names = most_own_names.max(index.own_names());
        assert_eq!(index.len(), seq_of.len(), "step {step}: copies");
        let distinct: std::collections::BTreeSet<u64> =
            held.values().flat_map(|h| h.keys().copied()).collect();
        assert_eq!(
            index.distinct_blocks(),
            distinct.len(),
            "step {step}: distinct"
        );
        for doc in &docs {
            let doc_hashes = hashes(doc);
            let n = 1 + next(DOC as u64) as usize;
            let request = &doc_hashes[..n];
            index.lookup(request, &mut matches);
            let mut got: Vec<(WorkerKey, usize)> = matches.workers(&index).collect();
            got.sort();
            let expected: Vec<(WorkerKey, usize)> = held
                .iter()
                .map(|(&k, h)| (k, request.iter().take_while(|s| h.contains_key(s)).count()))
                .filter(|(_, c)| *c > 0)
                .collect();
            assert_eq!(got, expected, "step {step}");
            for (key, cached) in expected {
                let slot = index.slot_of(key).expect("a matching worker has a slot");
                let mut names = Vec::new();
                index.engine_hashes(slot, request, &mut names);
                let want: Vec<u64> = request[..cached].iter().map(|s| held[&key][s].0).collect();
                assert_eq!(
                    names, want,
                    "step {step}: {key} names each block by its named copy"
                );
            }
            // Work is bounded by the request and the matching workers, not the index.
            assert!(
                matches.visited() <= 4 * n + 4 * workers.len() + 8,
                "{}",
                matches.visited()
            );
        }
    }
    // (Fewer salts with shared names: fewer blocks held under several names.)
    // (And with a large fleet: fewer stores per worker.)
    let rings_wanted = if shared_names || workers.len() > 8 {
        50
    } else {
        200
    };
    assert!(
        rings > rings_wanted && reused > 100 && merged_back > 10,
        "{rings} {reused} {merged_back}"
    );
    // Shared names must have held many copies at once when every worker names alike.
    assert!(
        !shared_names || most_backed >= 10,
        "backed copies at most {most_backed}"
    );
    // Seeds of their own must have put many holders' names of their own in their maps.
    assert!(
        naming != Naming::Seeded || most_own_names >= 10,
        "own names at most {most_own_names}"
    );
}

/// The shared index keeps two trees and one book of names: the first copy to apply a
/// batch asks the book and records its answers, the other replays them. Random
/// batches (stores chained or not, names shared between workers, re-used, or several
/// for one block; removals; clears; deregistrations) go to a shared index and to a
/// plain one; after every publish the copy bookings read — each copy in turn, since a
/// publish swaps them — gives the plain index's answers and keeps every invariant.
#[test]
fn both_copies_of_a_shared_index_agree_with_a_plain_one() {
    let mut next = xorshift(0x05ee_d0f5_a4ed_u64);
    const DOC: usize = 10;
    let mut docs = vec![prompt(DOC); 4];
    docs[1][3 * BS] += 1;
    docs[2][6 * BS + 1] += 1;
    docs[3].reverse();
    let doc_hashes: Vec<Vec<u64>> = docs.iter().map(|d| hashes(d)).collect();
    let workers = [w(1, 0), w(1, 1), w(2, 0), w(3, 0)];
    let shared = shared::SharedIndex::new(BS);
    let mut plain = KvIndex::new(BS);
    for &k in &workers {
        assert_eq!(shared.add_worker(k), plain.add_worker(k));
    }
    // Each registration publishes.
    let (mut publishes, mut compared, mut renamed) = (workers.len() as u64, 0, 0);
    let mut most_backed = 0;
    for round in 0..1500 {
        let mut batch = Vec::new();
        for _ in 0..1 + next(4) {
            let k = workers[next(workers.len() as u64) as usize];
            // Most workers name a block alike (one model, one hash seed); worker 3 by a
            // salt of its own; sometimes a block gets a second name.
            let name = |seq: u64, salt: u64| {
                seq.rotate_left(9) ^ if k.worker_id == 3 { 0xabc } else { 0 } ^ salt
            };
            let event = match next(10) {
                0..=5 => {
                    let d = next(docs.len() as u64) as usize;
                    let start = next(DOC as u64) as usize;
                    let count = 1 + next((DOC - start) as u64) as usize;
                    let parent = (start > 0).then(|| name(doc_hashes[d][start - 1], 0));
                    let engines: Vec<u64> = doc_hashes[d][start..start + count]
                        .iter()
                        .map(|&s| match next(8) {
                            0 => name(s, 1),
                            1 => name(doc_hashes[d][next(DOC as u64) as usize], 0),
                            _ => name(s, 0),
                        })
                        .collect();
                    stored(parent, &docs[d][start * BS..(start + count) * BS], &engines)
                }
                6..=8 => {
                    let d = next(docs.len() as u64) as usize;
                    let salt = next(2);
                    let hashes: Vec<u64> = (0..1 + next(4))
                        .map(|_| name(doc_hashes[d][next(DOC as u64) as usize], salt))
                        .collect();
                    renamed += usize::from(salt == 1);
                    KvEvent::Removed {
                        block_hashes: hashes,
                    }
                }
                _ => KvEvent::Cleared,
            };
            batch.push((k, event));
        }
        let expected: Vec<_> = batch.iter().map(|(k, e)| plain.apply(*k, e)).collect();
        // Half the stores come as an engine subscription hands them over, hashed.
        let batch = batch.into_iter().map(|(k, e)| match next(2) {
            0 => (k, hashed_form(&e)),
            _ => (k, e),
        });
        assert_eq!(shared.apply_batch(batch), expected, "round {round}");
        publishes += 1;
        if round % 250 == 249 {
            // A worker leaves and comes back: its slot is freed and handed out again.
            let k = workers[next(workers.len() as u64) as usize];
            shared.remove_worker(k);
            plain.remove_worker(k);
            assert_eq!(shared.add_worker(k), plain.add_worker(k));
            publishes += 2;
        }
        shared.read(|copy| {
            copy.check_invariants();
            most_backed = most_backed.max(copy.backed_copies());
            assert_eq!(copy.len(), plain.len(), "round {round}: copies held");
            assert_eq!(
                copy.node_count(),
                plain.node_count(),
                "round {round}: nodes"
            );
            for d in &docs {
                let got = as_vec(&overlaps(copy, d));
                assert_eq!(got, as_vec(&overlaps(&plain, d)), "round {round}");
                compared += got.len();
            }
        });
    }
    assert_eq!(shared.publishes(), publishes);
    assert!(compared > 1000 && renamed > 50, "{compared} {renamed}");
    // Workers naming blocks alike held many copies through the shared names, and the
    // second copy replayed their stores, removals and clears.
    assert!(most_backed >= 10, "backed copies at most {most_backed}");
}

/// Freed nodes' arrays are kept for reuse (`Buffers`), but an index that shrinks gives
/// its memory back: at most `BUFFERS_KEEP` arrays of each kind, none over `BUFFER_MAX`
/// entries, are kept, and a node made from kept arrays starts empty.
#[test]
fn freed_nodes_arrays_are_kept_bounded_and_reused_empty() {
    let mut index = KvIndex::new(BS);
    let mut next = xorshift(7);
    // 600 sequences of 4 blocks under one shared first block (many nodes), and one
    // sequence longer than `BUFFER_MAX`.
    let shared = prompt(1);
    for s in 0..600u64 {
        let mut tokens = shared.clone();
        tokens.extend((0..3 * BS).map(|_| next(50_000) as u32));
        let engine = [1, 10 + 3 * s, 11 + 3 * s, 12 + 3 * s];
        index
            .apply(w(s % 4, 0), &stored(None, &tokens, &engine))
            .unwrap();
    }
    let long = BUFFER_MAX + 10;
    let tokens: Vec<u32> = (0..long * BS).map(|_| next(50_000) as u32).collect();
    let engine: Vec<u64> = (0..long as u64).map(|i| 1_000_000 + i).collect();
    index
        .apply(w(9, 0), &stored(None, &tokens, &engine))
        .unwrap();
    index.check_invariants();
    for s in [0, 1, 2, 3, 9] {
        index.apply(w(s, 0), &KvEvent::Cleared).unwrap();
    }
    assert!(index.is_empty());
    let kept = &index.buffers;
    assert!(kept.wide.len() <= BUFFERS_KEEP && kept.ids.len() <= BUFFERS_KEEP);
    assert!(!kept.wide.is_empty(), "freed arrays are kept");
    assert!(kept
        .wide
        .iter()
        .all(|b| b.is_empty() && b.capacity() <= BUFFER_MAX));
    assert!(kept
        .ids
        .iter()
        .all(|b| b.is_empty() && b.capacity() <= BUFFER_MAX));
    // Reused, they hold the new blocks only.
    let tokens = prompt(5);
    index
        .apply(w(1, 0), &stored(None, &tokens, &[1, 2, 3, 4, 5]))
        .unwrap();
    index.check_invariants();
    let out = overlaps(&index, &tokens);
    assert_eq!(out.engine_hashes(w(1, 0)), &[1, 2, 3, 4, 5]);
}

/// A lookup that carries three 64-slot words of matching workers into a node whose
/// holders lack one of them, then into a node that has all three again: the words no
/// longer line up by position, and each worker's count still stops at its gap.
#[test]
fn holder_words_that_stop_lining_up_keep_every_count() {
    let mut index = KvIndex::new(BS);
    let tokens = prompt(3);
    let workers: Vec<WorkerKey> = (0..130).map(|i| w(1_000 + i, 0)).collect();
    for &k in &workers {
        index
            .apply(k, &stored(None, &tokens, &[11, 12, 13]))
            .unwrap();
    }
    // The second word's workers (slots 64..128) lose block 1 and keep blocks 0 and 2,
    // but for the first two (bits 0 and 1, as the third word's two workers), which
    // lose block 2 as well.
    for (i, &k) in workers.iter().enumerate().take(128).skip(64) {
        let lost = if i < 66 { vec![12, 13] } else { vec![12] };
        let stats = index.apply(k, &removed(lost.clone())).unwrap();
        assert_eq!(stats.removed, lost.len());
    }
    index.check_invariants();
    let out = overlaps(&index, &tokens);
    for (i, &k) in workers.iter().enumerate() {
        let expected = if (64..128).contains(&i) { 1 } else { 3 };
        assert_eq!(out.cached_blocks(k), expected, "worker {i}");
    }
    assert_eq!(out.len(), 130);
}
