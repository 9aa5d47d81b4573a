//! The Mooncake conversation trace (`tests/fixtures/mooncake/`, Apache-2.0: its
//! README says where it comes from) as a workload for the fleet bench.
//!
//! Each trace line is a request: its arrival (ms), its prompt's length in tokens
//! and `hash_ids`, one id per 512-token block of the prompt, prefix-chained (an
//! id stands for its whole prefix, so a shared leading run of ids is a shared
//! prompt prefix). The prompts are made here: each block becomes
//! `words_per_block` words of [`workloads::text`] drawn from a seed of its id
//! (the last block fewer, in proportion to how much of 512 tokens it holds), so
//! equal ids give equal text; blocks are joined by one space, and every word
//! after the first starts with its space, so a shared run of blocks tokenizes to
//! the same tokens whatever follows it.
//!
//! [`workloads::text`]: crate::workloads::text

use crate::workloads::{self, Item};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;

/// Tokens in one of the trace's blocks.
pub const BLOCK_TOKENS: u64 = 512;

/// Words a block becomes by default (`FLEET_TRACE_BLOCK_WORDS` in the fleet
/// bench): about 35 tokens, the trace's prompts shrunk 15-fold, so a mean
/// prompt (24 blocks) is ~770 words and the longest (247 blocks) ~7,900.
pub const BLOCK_WORDS: usize = 32;

/// One line of the trace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    /// Arrival, in ms from the trace's start.
    pub timestamp_ms: u64,
    pub input_length: u64,
    pub output_length: u64,
    pub hash_ids: Vec<u64>,
}

/// The vendored trace file (gzipped JSON lines).
pub fn path() -> PathBuf {
    crate::paths::workspace_root().join("tests/fixtures/mooncake/conversation_trace.jsonl.gz")
}

/// Every request of the vendored trace, in its order (12,031).
pub fn load() -> Vec<Request> {
    let path = path();
    let file = std::fs::File::open(&path)
        .unwrap_or_else(|e| panic!("cannot open {}: {e}", path.display()));
    let reader = BufReader::new(flate2::read::GzDecoder::new(file));
    reader
        .lines()
        .enumerate()
        .map(|(n, line)| {
            let line = line.unwrap_or_else(|e| panic!("{} line {}: {e}", path.display(), n + 1));
            parse(&line).unwrap_or_else(|e| panic!("{} line {}: {e}", path.display(), n + 1))
        })
        .collect()
}

/// One trace line.
pub fn parse(line: &str) -> Result<Request, String> {
    let value: Value = serde_json::from_str(line).map_err(|e| e.to_string())?;
    let number = |field: &str| {
        value[field]
            .as_u64()
            .ok_or_else(|| format!("no {field} (an integer) in {line}"))
    };
    let hash_ids = value["hash_ids"]
        .as_array()
        .ok_or_else(|| format!("no hash_ids in {line}"))?
        .iter()
        .map(|id| {
            id.as_u64()
                .ok_or_else(|| format!("a hash id {id} in {line}"))
        })
        .collect::<Result<Vec<u64>, String>>()?;
    let request = Request {
        timestamp_ms: number("timestamp")?,
        input_length: number("input_length")?,
        output_length: number("output_length")?,
        hash_ids,
    };
    if request.hash_ids.len() as u64 != request.input_length.div_ceil(BLOCK_TOKENS) {
        return Err(format!(
            "{} hash ids for {} tokens: {line}",
            request.hash_ids.len(),
            request.input_length
        ));
    }
    Ok(request)
}

/// Words each block of `request` becomes: `words_per_block`, the last one in
/// proportion to its tokens (at least one word).
pub fn block_words(request: &Request, words_per_block: usize) -> Vec<usize> {
    let blocks = request.hash_ids.len();
    (0..blocks)
        .map(|i| {
            let tokens = if i + 1 < blocks {
                BLOCK_TOKENS
            } else {
                request.input_length - BLOCK_TOKENS * (blocks as u64 - 1)
            };
            ((words_per_block as u64 * tokens).div_ceil(BLOCK_TOKENS) as usize).max(1)
        })
        .collect()
}

/// The text of the block `id`, `words` long. A shorter text of the same id is a
/// prefix of a longer one.
pub fn block_text(id: u64, words: usize) -> String {
    workloads::text(id ^ 0x6D6F_6F6E_6361_6B65, words)
}

/// `request`'s prompt: its blocks' texts joined by one space.
pub fn prompt(request: &Request, words_per_block: usize) -> String {
    let words = block_words(request, words_per_block);
    request
        .hash_ids
        .iter()
        .zip(&words)
        .map(|(&id, &n)| block_text(id, n))
        .collect::<Vec<String>>()
        .join(" ")
}

/// A window of the trace as a workload.
pub struct Window {
    /// One user message each, keyed `t<line>` (the 0-based trace line); `words`,
    /// and `reusable_words`: the words of the leading blocks that earlier
    /// requests in the window brought (what a cache that kept everything would
    /// hold).
    pub items: Vec<Item>,
    /// Each request's arrival, in the trace's seconds from the window's first.
    pub arrivals: Vec<f64>,
    /// The window's length in the trace's seconds: up to the arrival of the
    /// request after it (at the trace's end: the last arrival plus the window's
    /// mean gap), so that `items.len() / duration` is its rate.
    pub duration: f64,
}

impl Window {
    /// The arrivals, stretched by `scale` (each arrival times `scale`).
    pub fn times(&self, scale: f64) -> Vec<f64> {
        self.arrivals.iter().map(|t| t * scale).collect()
    }
}

/// The `count` requests from line `start` (0-based) of `trace` (fewer at its
/// end), each block `words_per_block` words.
pub fn window(trace: &[Request], start: usize, count: usize, words_per_block: usize) -> Window {
    assert!(
        start < trace.len(),
        "the trace has {} requests: none from line {start}",
        trace.len()
    );
    let end = (start + count).min(trace.len());
    let requests = &trace[start..end];
    assert!(!requests.is_empty(), "an empty window of the trace");
    let first = requests[0].timestamp_ms;
    let seconds = |ms: u64| (ms - first) as f64 / 1e3;
    let arrivals: Vec<f64> = requests.iter().map(|r| seconds(r.timestamp_ms)).collect();
    let last = arrivals[arrivals.len() - 1];
    let duration = match trace.get(end) {
        Some(next) => seconds(next.timestamp_ms),
        None if requests.len() > 1 => last * requests.len() as f64 / (requests.len() - 1) as f64,
        None => 1.0,
    }
    .max(1e-3);
    // Per block id, the most words an earlier request of the window held of it.
    let mut held: HashMap<u64, usize> = HashMap::new();
    let items = requests
        .iter()
        .enumerate()
        .map(|(i, request)| {
            let words = block_words(request, words_per_block);
            let mut reusable = 0;
            for (id, &n) in request.hash_ids.iter().zip(&words) {
                let have = held.get(id).copied().unwrap_or(0);
                reusable += have.min(n);
                if have < n {
                    break;
                }
            }
            for (&id, &n) in request.hash_ids.iter().zip(&words) {
                let have = held.entry(id).or_insert(0);
                *have = (*have).max(n);
            }
            Item {
                key: format!("t{}", start + i),
                after: None,
                messages: json!([{"role": "user", "content": prompt(request, words_per_block)}]),
                words: words.iter().sum(),
                reusable_words: reusable,
            }
        })
        .collect();
    Window {
        items,
        arrivals,
        duration,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn content(item: &Item) -> &str {
        item.messages[0]["content"]
            .as_str()
            .expect("a user message")
    }

    #[test]
    fn the_vendored_trace_parses_whole() {
        let trace = load();
        assert_eq!(trace.len(), 12_031);
        assert_eq!(
            trace[0],
            Request {
                timestamp_ms: 0,
                input_length: 6758,
                output_length: 500,
                hash_ids: (0..14).collect(),
            }
        );
        assert_eq!(trace[12_030].timestamp_ms, 3_536_999);
        assert!(trace
            .windows(2)
            .all(|w| w[0].timestamp_ms <= w[1].timestamp_ms));
    }

    #[test]
    fn shared_leading_blocks_are_a_shared_prompt_prefix() {
        let trace = load();
        let words_per_block = 8;
        // The pair of the first 3,000 requests sharing the longest leading run
        // of ids (and not all of the shorter one's).
        let shared = |a: &Request, b: &Request| {
            a.hash_ids
                .iter()
                .zip(&b.hash_ids)
                .take_while(|(x, y)| x == y)
                .count()
        };
        let mut first_of: HashMap<u64, usize> = HashMap::new();
        let mut best = (0, 0, 0);
        for (j, request) in trace.iter().enumerate().take(3_000) {
            for &id in request.hash_ids.iter().skip(1).take(1) {
                if let Some(&i) = first_of.get(&id) {
                    let k = shared(&trace[i], request);
                    if k > best.2 && k < trace[i].hash_ids.len().min(request.hash_ids.len()) {
                        best = (i, j, k);
                    }
                }
                first_of.entry(id).or_insert(j);
            }
        }
        let (i, j, k) = best;
        assert!(k >= 5, "no two requests share 5 leading blocks: {best:?}");
        let window = window(&trace, i, j - i + 1, words_per_block);
        let (a, b) = (&window.items[0], &window.items[j - i]);
        let (a, b) = (content(a), content(b));
        // Exactly the k shared blocks' text (and the space after it).
        let blocks: Vec<String> = trace[i].hash_ids[..k]
            .iter()
            .map(|&id| block_text(id, words_per_block))
            .collect();
        let prefix = format!("{} ", blocks.join(" "));
        assert!(a.starts_with(&prefix) && b.starts_with(&prefix));
        let next = |s: &str| {
            s[prefix.len()..]
                .split(' ')
                .next()
                .unwrap_or("")
                .to_string()
        };
        assert_ne!(
            next(a),
            next(b),
            "requests {i} and {j} agree past {k} blocks"
        );
        assert_eq!(
            next(a),
            block_text(trace[i].hash_ids[k], 1).trim_end_matches('.')
        );
        // What an infinite cache holds of b: at least the k shared blocks.
        assert!(window.items[j - i].reusable_words >= k * words_per_block);
        assert_eq!(window.items[0].reusable_words, 0);
    }

    #[test]
    fn a_partial_last_block_is_a_prefix_of_the_full_one() {
        let request = Request {
            timestamp_ms: 0,
            input_length: 512 + 128,
            output_length: 1,
            hash_ids: vec![7, 9],
        };
        assert_eq!(block_words(&request, 32), vec![32, 8]);
        let full = block_text(9, 32);
        let part = block_text(9, 8);
        assert!(full.starts_with(&part));
        assert_eq!(
            prompt(&request, 32),
            format!("{} {}", block_text(7, 32), part)
        );
    }

    #[test]
    fn scaled_times_keep_the_traces_order_and_ratios() {
        let trace = load();
        let start = 1_000;
        let window = window(&trace, start, 200, 4);
        assert_eq!(window.items.len(), 200);
        assert_eq!(window.items[0].key, "t1000");
        let ms = |n: usize| trace[start + n].timestamp_ms as f64 - trace[start].timestamp_ms as f64;
        assert_eq!(
            window.duration,
            (trace[start + 200].timestamp_ms - trace[start].timestamp_ms) as f64 / 1e3
        );
        let scale = 0.37;
        let times = window.times(scale);
        assert_eq!(times[0], 0.0);
        assert!(times.windows(2).all(|w| w[0] <= w[1]));
        for (n, t) in times.iter().enumerate() {
            assert!((t - ms(n) / 1e3 * scale).abs() < 1e-9, "request {n}: {t}");
        }
        let (a, b) = (times[50] / times[199], ms(50) / ms(199));
        assert!((a - b).abs() < 1e-12);
    }
}
