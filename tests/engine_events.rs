//! The engine KV-event decoder on golden bytes made by the engines' own code (vLLM
//! 0.33.0 and 0.23.0, SGLang 0.5.23: `tests/engines/make_golden.py`), what the decoded
//! events do to bookings, and random and mutated bytes (no panic, every error an `Err`).

use kvhint::router::index::{block_content, identity_seed, HashedBlock, KvEvent};
use kvhint::router::{BookRequest, Router};
use kvhint::testing::{decode_batch, DecodeSettings, DecodedBatch, GroupFilter};
use kvhint_e2e::engines::{self, write_msgpack};
use kvhint_e2e::{kvcr_snapshot, workspace_root};
use serde_json::json;
use std::path::PathBuf;

const ENGINES: [&str; 3] = ["vllm-0.33.0", "vllm-0.23.0", "sglang-0.5.23"];

fn fixture(engine: &str, case: &str) -> Option<Vec<u8>> {
    let path: PathBuf = workspace_root()
        .join("tests/fixtures/engine-events")
        .join(engine)
        .join(format!("{case}.msgpack"));
    std::fs::read(path).ok()
}

fn settings() -> DecodeSettings {
    DecodeSettings {
        block_size: 16,
        media: vec!["GPU".into()],
    }
}

fn decode(payload: &[u8]) -> DecodedBatch {
    let mut out = DecodedBatch::default();
    decode_batch(payload, &settings(), &mut GroupFilter::default(), &mut out)
        .unwrap_or_else(|e| panic!("{e}"));
    out
}

/// A decoded store: (parent, identity seed, blocks). The decoder hashes each block's
/// tokens (and any extra keys) where it decodes them (`KvEvent::Hashed`).
fn hashed(event: &KvEvent) -> (Option<u64>, Option<u64>, &[HashedBlock]) {
    match event {
        KvEvent::Hashed {
            parent_block_hash,
            identity,
            blocks,
        } => (*parent_block_hash, *identity, blocks),
        other => panic!("expected a stored event, got {other:?}"),
    }
}

fn stored_hashes(event: &KvEvent) -> (Option<u64>, Vec<u64>) {
    let (parent, _, blocks) = hashed(event);
    (parent, blocks.iter().map(|b| b.block_hash).collect())
}

/// The content hash of a block of `tokens` with no inputs besides its tokens.
fn plain(tokens: impl IntoIterator<Item = u32>) -> u64 {
    block_content(&tokens.into_iter().collect::<Vec<u32>>(), None)
}

/// The same four events — a root store, a continuation, a removal, a clear — in every
/// engine's encoding, with hashes as the engine wrote them.
fn assert_chain(engine: &str, case: &str, hashes: [u64; 3]) {
    let Some(payload) = fixture(engine, case) else {
        panic!("{engine}/{case}.msgpack is missing");
    };
    let batch = decode(&payload);
    assert_eq!(batch.ts, 1_700_000_000.25, "{engine}/{case}");
    assert_eq!(batch.dp_rank, Some(0), "{engine}/{case}");
    assert_eq!(batch.events.len(), 4, "{engine}/{case}: {:?}", batch.events);
    assert_eq!(
        stored_hashes(&batch.events[0]),
        (None, vec![hashes[0], hashes[1]]),
        "{engine}/{case}"
    );
    assert_eq!(
        stored_hashes(&batch.events[1]),
        (Some(hashes[1]), vec![hashes[2]]),
        "{engine}/{case}"
    );
    let (_, identity, blocks) = hashed(&batch.events[0]);
    assert_eq!(identity, None, "{engine}/{case}: no LoRA, no salt");
    assert_eq!(
        (blocks[0].content, blocks[1].content),
        (plain(0..16), plain(16..32)),
        "{engine}/{case}: each block's tokens"
    );
    assert_eq!(
        batch.events[2],
        KvEvent::Removed {
            block_hashes: vec![hashes[2]]
        },
        "{engine}/{case}"
    );
    assert_eq!(batch.events[3], KvEvent::Cleared, "{engine}/{case}");
    assert_eq!(
        (
            batch.counts.stored,
            batch.counts.removed,
            batch.counts.cleared
        ),
        (2, 1, 1)
    );
}

#[test]
fn unsigned_hashes_above_2_63_decode_exactly_in_both_encodings() {
    for engine in ENGINES {
        assert_chain(
            engine,
            "u64",
            [18_446_744_073_709_551_557, 9_223_372_036_854_775_809, 42],
        );
        let batch = decode(&fixture(engine, "u64").unwrap());
        assert!(!batch.hashes.signed && !batch.hashes.digest);
    }
}

#[test]
fn signed_hashes_keep_their_64_bits_and_mark_the_source_signed() {
    for engine in ENGINES {
        assert_chain(
            engine,
            "i64",
            [(-3i64) as u64, (-9_223_372_036_854_775_807i64) as u64, 42],
        );
        assert!(decode(&fixture(engine, "i64").unwrap()).hashes.signed);
    }
}

#[test]
fn digest_hashes_become_the_integer_vllm_publishes_in_its_default_mode() {
    // vLLM's integer mode publishes int.from_bytes(digest, "big") & (2^64 - 1): the
    // digest's last 8 bytes, big-endian.
    let last8 = |text: &str| -> u64 {
        use sha2::Digest;
        let digest = sha2::Sha256::digest(text.as_bytes());
        u64::from_be_bytes(digest[24..32].try_into().unwrap())
    };
    for engine in ["vllm-0.33.0", "vllm-0.23.0"] {
        assert_chain(
            engine,
            "bytes",
            [last8("block-0"), last8("block-1"), last8("block-2")],
        );
        assert!(decode(&fixture(engine, "bytes").unwrap()).hashes.digest);
    }
}

#[test]
fn lora_and_salt_come_from_each_engines_own_fields() {
    for engine in ENGINES {
        let batch = decode(&fixture(engine, "lora-salt").unwrap());
        let [event] = batch.events.as_slice() else {
            panic!("{engine}: {:?}", batch.events);
        };
        let (_, identity, blocks) = hashed(event);
        assert_eq!(
            identity,
            identity_seed(Some("adapter-a"), Some("salt-1")),
            "{engine}: the LoRA name and the salt seed the hashes"
        );
        assert_eq!(
            (blocks[0].content, blocks[1].content),
            (plain(100..116), plain(116..132)),
            "{engine}: the LoRA name and salt are identity, not extra keys"
        );
    }
}

#[test]
fn multimodal_extra_keys_are_hashed_into_their_block() {
    for engine in ["vllm-0.33.0", "vllm-0.23.0"] {
        let batch = decode(&fixture(engine, "multimodal").unwrap());
        let [event] = batch.events.as_slice() else {
            panic!("{engine}: {:?}", batch.events);
        };
        let (_, identity, blocks) = hashed(event);
        assert_eq!(blocks.len(), 1, "{engine}");
        assert_ne!(
            blocks[0].content,
            plain(200..216),
            "{engine}: the image's key is hashed into its block"
        );
        assert_eq!(identity, None, "{engine}: an mm pair is not a salt");
    }
}

#[test]
fn only_device_blocks_of_full_attention_groups_count() {
    for engine in ENGINES {
        let batch = decode(&fixture(engine, "media-and-groups").unwrap());
        let stored: Vec<Vec<u64>> = batch.events.iter().map(|e| stored_hashes(e).1).collect();
        assert!(stored.contains(&vec![3003]), "{engine}: {stored:?}");
        assert!(
            !stored.iter().flatten().any(|h| *h == 3001),
            "{engine}: a CPU block is not the device cache"
        );
        assert!(
            !stored.iter().flatten().any(|h| *h == 3002),
            "{engine}: a sliding-window group is skipped"
        );
        assert!(batch.counts.other_medium >= 1, "{engine}");
    }
    // With CPU media configured, the CPU block counts too.
    let mut out = DecodedBatch::default();
    let settings = DecodeSettings {
        block_size: 16,
        media: vec!["GPU".into(), "cpu".into()],
    };
    decode_batch(
        &fixture("vllm-0.33.0", "media-and-groups").unwrap(),
        &settings,
        &mut GroupFilter::default(),
        &mut out,
    )
    .unwrap();
    assert!(out.events.iter().any(|e| stored_hashes(e).1 == vec![3001]));
}

#[test]
fn the_batch_rank_field_is_read_or_absent() {
    for engine in ENGINES {
        assert_eq!(
            decode(&fixture(engine, "dp-rank").unwrap()).dp_rank,
            Some(3),
            "{engine}"
        );
        assert_eq!(
            decode(&fixture(engine, "dp-rank-none").unwrap()).dp_rank,
            None,
            "{engine}"
        );
    }
}

#[test]
fn a_store_of_another_block_size_is_refused_and_counted() {
    for engine in ENGINES {
        let batch = decode(&fixture(engine, "block-size-32").unwrap());
        assert!(batch.events.is_empty(), "{engine}");
        assert_eq!(batch.counts.wrong_block_size, 1, "{engine}");
        assert_eq!(batch.counts.last_wrong_block_size, Some(32));
    }
}

/// A prompt under another adapter or salt never matches, and under the same one it
/// does: the engine's events and `POST /book` seed the hashes alike.
#[test]
fn prompts_match_only_blocks_stored_under_the_same_lora_and_salt() {
    for engine in ENGINES {
        let (snapshot, _loader, _config) = kvcr_snapshot();
        let router = Router::new(16);
        router
            .register_worker(
                serde_json::from_value(json!({"worker_id": 1, "role": "decode"})).unwrap(),
            )
            .unwrap();
        let key = kvhint::domain::WorkerKey {
            worker_id: 1,
            dp_rank: 0,
        };
        let batch = decode(&fixture(engine, "lora-salt").unwrap());
        for result in router.apply_kv_events(batch.events.into_iter().map(|e| (key, e))) {
            result.unwrap();
        }
        let tokens: Vec<u32> = (100..132).collect();
        let role =
            kvhint::router::configured_role(&snapshot, kvhint::domain::Role::Decode).unwrap();
        let mut cached = Vec::new();
        for (i, (lora, salt)) in [
            (Some("adapter-a"), Some("salt-1")),
            (None, None),
            (Some("adapter-a"), None),
            (None, Some("salt-1")),
            (Some("adapter-b"), Some("salt-1")),
        ]
        .into_iter()
        .enumerate()
        {
            let id = format!("{engine}-{i}");
            let booking = router
                .book(
                    role,
                    &BookRequest {
                        request_id: &id,
                        role: kvhint::domain::Role::Decode,
                        token_ids: &tokens,
                        session_context: None,
                        lora_name: lora,
                        cache_salt: salt,
                        pinned_prefix: &[],
                        receive_from: None,
                    },
                )
                .unwrap();
            cached.push(booking.cached_blocks);
            router.release(&id).unwrap();
        }
        assert_eq!(cached, vec![2, 0, 0, 0, 0], "{engine}");
    }
}

/// xorshift64*: deterministic bytes without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

#[test]
fn random_and_mutated_bytes_never_panic_and_every_failure_is_an_error() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut goldens = Vec::new();
    for engine in ENGINES {
        for case in [
            "u64",
            "i64",
            "bytes",
            "lora-salt",
            "multimodal",
            "media-and-groups",
        ] {
            if let Some(bytes) = fixture(engine, case) {
                goldens.push(bytes);
            }
        }
    }
    assert!(goldens.len() >= 15, "the golden fixtures are missing");
    let mut out = DecodedBatch::default();
    let (mut ok, mut failed) = (0u32, 0u32);
    let mut run = |payload: &[u8]| {
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            decode_batch(payload, &settings(), &mut GroupFilter::default(), &mut out)
        }));
        match result {
            Ok(Ok(())) => ok += 1,
            Ok(Err(error)) => {
                assert!(error.offset <= payload.len(), "{error}");
                failed += 1;
            }
            Err(_) => panic!("the decoder panicked on {payload:02x?}"),
        }
    };
    for _ in 0..20_000 {
        let len = (rng.next() % 64) as usize;
        let bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        run(&bytes);
    }
    for _ in 0..20_000 {
        let golden = &goldens[(rng.next() % goldens.len() as u64) as usize];
        let mut bytes = golden.clone();
        match rng.next() % 3 {
            0 => bytes.truncate((rng.next() % golden.len() as u64) as usize),
            1 => {
                for _ in 0..1 + rng.next() % 4 {
                    let at = (rng.next() % bytes.len() as u64) as usize;
                    bytes[at] ^= 1 << (rng.next() % 8);
                }
            }
            _ => {
                let at = (rng.next() % bytes.len() as u64) as usize;
                bytes[at] = rng.next() as u8;
            }
        }
        run(&bytes);
    }
    // Both outcomes must occur, or the mutations test nothing.
    assert!(ok > 100 && failed > 10_000, "ok {ok}, failed {failed}");
}

/// The start of a batch `[ts, [event]]` whose one event the caller writes by hand.
fn one_event_batch() -> Vec<u8> {
    let mut payload = Vec::new();
    rmp::encode::write_array_len(&mut payload, 2).unwrap();
    rmp::encode::write_f64(&mut payload, 1.7e9).unwrap();
    rmp::encode::write_array_len(&mut payload, 1).unwrap();
    payload
}

/// Token ids in every msgpack width (fixint, u8, u16, u32) and at each width's edges,
/// in the map form and in the array form with the ids as the payload's last bytes
/// (where fewer than 8 bytes remain and the decoder reads them another way).
#[test]
fn token_ids_of_every_width_decode_exactly_up_to_the_payloads_last_byte() {
    let edges = [
        0u32,
        1,
        127,
        128,
        200,
        255,
        256,
        1_000,
        65_535,
        65_536,
        70_000,
        16_777_215,
        16_777_216,
        1 << 31,
        u32::MAX - 1,
        u32::MAX,
    ];
    let tokens: Vec<u32> = edges.iter().chain(edges.iter().rev()).copied().collect();
    let expected = vec![plain(tokens[..16].to_vec()), plain(tokens[16..].to_vec())];
    let map_form = engines::batch(json!([{"type": "BlockStored", "block_hashes": [1, 2],
        "parent_block_hash": null, "token_ids": tokens, "block_size": 16}]));
    let mut array_form = Vec::new();
    write_msgpack(
        &mut array_form,
        &json!([1.7e9, [["BlockStored", [1, 2], null, tokens]]]),
    );
    let mut ids = Vec::new();
    write_msgpack(&mut ids, &json!(tokens));
    assert!(array_form.ends_with(&ids), "the ids end the payload");
    for payload in [map_form, array_form] {
        let batch = decode(&payload);
        let [event] = batch.events.as_slice() else {
            panic!("{:?}", batch.events);
        };
        let contents: Vec<u64> = hashed(event).2.iter().map(|b| b.content).collect();
        assert_eq!(contents, expected);
    }
}

/// A long list read in stretches, where ids in encodings the fast loop does not read
/// (a u64, or signed widths for non-negative ids, as some encoders write them) and
/// SGLang's EAGLE bigrams turn up in the middle of a stretch, at its first id and at
/// its last: every id still lands in its block, and an event field named by bytes
/// that are not UTF-8 is skipped like any unknown field.
#[test]
fn ids_in_any_encoding_anywhere_in_a_long_list_decode_exactly() {
    const BLOCKS: usize = 24;
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let tokens: Vec<u32> = (0..BLOCKS * 16)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            // Every width, at random: fixint, u8, u16, u32.
            (state % 4) as u32 * 8 + ((state >> 8) as u32 >> ((state >> 40) % 4 * 8))
        })
        .collect();
    let mut ids = Vec::new();
    rmp::encode::write_array_len(&mut ids, tokens.len() as u32).unwrap();
    for (i, &t) in tokens.iter().enumerate() {
        match i % 37 {
            // The fast loop reads 16 ids a stretch: these land at a stretch's start,
            // in its middle and at its end, in turn.
            0 => rmp::encode::write_u64(&mut ids, u64::from(t)).unwrap(),
            5 => rmp::encode::write_i64(&mut ids, i64::from(t)).unwrap(),
            15 if t < 1 << 15 => rmp::encode::write_i16(&mut ids, t as i16).unwrap(),
            16 | 21 => {
                rmp::encode::write_array_len(&mut ids, 2).unwrap();
                rmp::encode::write_uint(&mut ids, u64::from(t)).unwrap();
                rmp::encode::write_uint(&mut ids, 7).unwrap();
            }
            _ => {
                rmp::encode::write_uint(&mut ids, u64::from(t)).unwrap();
            }
        }
    }
    let hashes: Vec<u64> = (1..=BLOCKS as u64).collect();
    let mut payload = one_event_batch();
    rmp::encode::write_map_len(&mut payload, 6).unwrap();
    rmp::encode::write_str(&mut payload, "type").unwrap();
    rmp::encode::write_str(&mut payload, "BlockStored").unwrap();
    // A key that is not UTF-8, with a value: an unknown field.
    payload.extend_from_slice(&[0xa2, 0xff, 0xfe]);
    rmp::encode::write_str(&mut payload, "ignored").unwrap();
    rmp::encode::write_str(&mut payload, "block_hashes").unwrap();
    write_msgpack(&mut payload, &json!(hashes));
    rmp::encode::write_str(&mut payload, "parent_block_hash").unwrap();
    rmp::encode::write_nil(&mut payload).unwrap();
    rmp::encode::write_str(&mut payload, "token_ids").unwrap();
    payload.extend_from_slice(&ids);
    rmp::encode::write_str(&mut payload, "block_size").unwrap();
    rmp::encode::write_uint(&mut payload, 16).unwrap();
    let batch = decode(&payload);
    assert_eq!(batch.counts.malformed, 0, "{:?}", batch.counts);
    let [event] = batch.events.as_slice() else {
        panic!("{:?}", batch.events);
    };
    let contents: Vec<u64> = hashed(event).2.iter().map(|b| b.content).collect();
    let expected: Vec<u64> = tokens
        .chunks(16)
        .map(|block| plain(block.to_vec()))
        .collect();
    assert_eq!(contents, expected);
}

/// A hostile count: a `token_ids` array that promises two billion ids in a few
/// bytes is refused as malformed at its count, which comes ahead of the ids' buffer.
#[test]
fn a_token_count_past_the_end_of_the_payload_is_refused_at_the_count() {
    let mut payload = one_event_batch();
    rmp::encode::write_array_len(&mut payload, 4).unwrap();
    rmp::encode::write_str(&mut payload, "BlockStored").unwrap();
    write_msgpack(&mut payload, &json!([1]));
    rmp::encode::write_nil(&mut payload).unwrap();
    // token_ids: an array32 header of 2^31 ids, then three bytes.
    payload.extend_from_slice(&[0xdd, 0x80, 0, 0, 0, 1, 2, 3]);
    let mut out = DecodedBatch::default();
    let error = decode_batch(&payload, &settings(), &mut GroupFilter::default(), &mut out)
        .expect_err("a count past the end is malformed");
    assert!(
        error
            .problem
            .contains("token_ids promises 2147483648 ids but 3 bytes remain"),
        "{error}"
    );
    assert!(error.offset <= payload.len());
}

#[test]
fn sglang_eagle_bigram_tokens_decode_to_their_first_token() {
    let pairs: Vec<serde_json::Value> = (0..16u32).map(|t| json!([t, t + 1])).collect();
    let batch = decode(&engines::batch(
        json!([{"type": "BlockStored", "block_hashes": [-1],
        "parent_block_hash": null, "token_ids": pairs, "block_size": 16, "lora_id": null}]),
    ));
    let [event] = batch.events.as_slice() else {
        panic!("{:?}", batch.events);
    };
    assert_eq!(hashed(event).2[0].content, plain(0..16));
}

#[test]
fn a_contradictory_event_is_refused_alone_and_skipped_events_do_not_set_the_hash_form() {
    let batch = decode(&engines::batch(json!([
        // 2 hashes, 1 block of tokens: refused, counted.
        {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": null,
         "token_ids": (0..16).collect::<Vec<u32>>(), "block_size": 16},
        // vLLM's offloading placeholder: no tokens, block size 0.
        {"type": "BlockStored", "block_hashes": [{"bytes": vec![7; 32]}], "parent_block_hash": null,
         "token_ids": [], "block_size": 0, "medium": "CPU"},
        // A CPU block with a digest hash: skipped, and says nothing of the device's hashes.
        {"type": "BlockStored", "block_hashes": [{"bytes": vec![9; 32]}], "parent_block_hash": null,
         "token_ids": (0..16).collect::<Vec<u32>>(), "block_size": 16, "medium": "CPU"},
        {"type": "BlockStored", "block_hashes": [3], "parent_block_hash": null,
         "token_ids": (0..16).collect::<Vec<u32>>(), "block_size": 16, "medium": "GPU"}
    ])));
    assert_eq!(batch.events.len(), 1, "{:?}", batch.events);
    assert_eq!(stored_hashes(&batch.events[0]).1, vec![3]);
    assert_eq!(batch.counts.malformed, 1);
    assert!(
        batch
            .counts
            .last_malformed
            .as_deref()
            .unwrap()
            .contains("2 block hashes but 16 token ids"),
        "{:?}",
        batch.counts.last_malformed
    );
    assert_eq!(
        batch.counts.other_medium, 2,
        "the placeholder is a CPU event too"
    );
    assert!(
        !batch.hashes.digest,
        "only counted events set the hash form"
    );
    let mut settings = settings();
    settings.media.push("CPU".into());
    let mut out = DecodedBatch::default();
    decode_batch(
        &engines::batch(
            json!([{"type": "BlockStored", "block_hashes": [{"bytes": vec![7; 32]}],
            "parent_block_hash": null, "token_ids": [], "block_size": 0, "medium": "CPU"}]),
        ),
        &settings,
        &mut GroupFilter::default(),
        &mut out,
    )
    .unwrap();
    assert_eq!(
        (out.counts.placeholder, out.counts.wrong_block_size),
        (1, 0)
    );
}

#[test]
fn unknown_event_types_are_counted_and_skipped() {
    let batch = decode(&engines::batch(json!([
        {"type": "BlockPinned", "block_hashes": [1], "whatever": {"nested": [1, 2]}},
        ["SomethingNew", 1, 2, 3],
        {"type": "AllBlocksCleared"}
    ])));
    assert_eq!(batch.counts.unknown_type, 2);
    assert_eq!(batch.events, vec![KvEvent::Cleared]);
}

/// A booking counts of a worker's published prefix only what its engine can
/// still hold beside the blocks its running requests pin (the gateway sets the
/// worker's capacity and those pinned blocks with `gateway.anticipate_evictions`;
/// see docs/gateway.md, "Workers with KV events: anticipating evictions"): a
/// prefix the engine is bound to drop no
/// longer draws the request to a busy worker.
#[test]
fn a_prefix_a_worker_must_drop_for_its_running_requests_does_not_draw_the_booking() {
    let fixture = kvhint_e2e::plugins::config_file("router: {block_size: 16}\n");
    let (snapshot, _loader) = kvhint_e2e::plugins::snapshot_of(&fixture, None).unwrap();
    let router = Router::new(16);
    let key = |id| kvhint::domain::WorkerKey {
        worker_id: id,
        dp_rank: 0,
    };
    for id in [1, 2] {
        router
            .register_worker(kvhint_e2e::replay::decode_worker(id))
            .unwrap();
    }
    let prompt: Vec<u32> = (1000..1000 + 8 * 16).collect();
    for result in router.apply_kv_events([(
        key(1),
        kvhint_e2e::replay::stored_event(&prompt, 16, 8, 500),
    )]) {
        result.unwrap();
    }
    let role = kvhint::router::configured_role(&snapshot, kvhint::domain::Role::Decode).unwrap();
    let book = |id: &str, pinned: &[(kvhint::domain::WorkerKey, u32)]| {
        let request = BookRequest {
            pinned_prefix: pinned,
            ..kvhint_e2e::replay::decode_request(id, &prompt)
        };
        let booking = router.book(role, &request).unwrap();
        router.release(id).unwrap();
        (booking.worker.worker_id, booking.cached_blocks)
    };
    assert_eq!(book("plain", &[]), (1, 8));
    let cell = router.load_cell(key(1)).unwrap();
    // A capacity of 10 blocks, 6 of them pinned by running requests: 4 of the
    // prefix can stay.
    cell.set_capacity_blocks(Some(10));
    cell.set_pinned_blocks(6);
    assert_eq!(book("room-for-four", &[]), (1, 4));
    // Those running requests hold this prompt's first 6 blocks themselves:
    // pinned, and 4 more fit beside them.
    assert_eq!(book("own-prefix-pinned", &[(key(1), 6)]), (1, 8));
    // Pinned to capacity, and busy with an open booking: the prefix draws
    // nothing, and the idle worker gets the request.
    cell.set_pinned_blocks(10);
    let other: Vec<u32> = (5000..5000 + 8 * 16).collect();
    let only_one = |w: &kvhint::domain::Worker| w.key == key(1);
    router
        .book_among(
            role,
            &kvhint_e2e::replay::decode_request("running", &other),
            Some(&only_one),
        )
        .unwrap();
    assert_eq!(book("bound-to-be-dropped", &[]), (2, 0));
    // Unknown capacity: nothing anticipated.
    cell.set_capacity_blocks(None);
    assert_eq!(book("capacity-unknown", &[]), (1, 8));
}
