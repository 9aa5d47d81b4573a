//! Seeded workloads for the routing benches (`quality`, `fleet`): the same
//! requests at the same times for every system, sent as streaming chats, each
//! answer's time to first token, end-to-end time and the prompt tokens the
//! engine reports it reused.
//!
//! Prompts are made of common English words (about one token each), drawn by a
//! seed per prefix, so that a router keying on text (`smg`) and one keying on
//! tokens see the same prefixes.

use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// The model name requests carry.
pub const MODEL: &str = crate::llamacpp::MODEL_NAME;

/// Tokens a request generates.
pub const OUTPUT_TOKENS: u64 = 12;

/// A small deterministic generator (splitmix64), so every system gets the same
/// requests at the same times.
pub struct Rng(pub u64);

impl Rng {
    pub fn draw(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1].
    pub fn unit(&mut self) -> f64 {
        ((self.draw() >> 11) as f64 + 1.0) / (1u64 << 53) as f64
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.draw() % n as u64) as usize
    }
}

/// Common English words, each one token with its leading space in Qwen3's
/// vocabulary (so a text's word count is about its token count).
const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by",
    "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an",
    "had", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has", "there",
    "been", "if", "more", "when", "will", "would", "who", "so", "no", "she", "other", "its", "may",
    "these", "what", "them", "than", "some", "him", "time", "into", "only", "do", "out", "first",
    "any", "my", "new", "now", "such", "like", "our", "over", "man", "me", "even", "most", "made",
    "after", "also", "did", "many", "before", "must", "through", "years", "where", "much", "your",
    "way", "well", "down", "should", "because", "each", "just", "those", "people", "how", "too",
    "little", "state", "good", "very", "make", "world", "still", "own", "see", "men", "work",
    "long", "get", "here", "between", "both", "life", "being", "under", "never", "day", "same",
    "another", "know", "while", "last", "might", "great", "old", "year", "off", "come", "since",
    "against", "go", "came", "right", "used", "take", "three", "place", "small", "found", "part",
    "house", "water", "light", "number", "point", "hand", "high", "large", "name", "home", "order",
    "city", "power", "line", "country", "school", "market", "table", "river", "music", "paper",
    "money", "story", "road", "field", "heart", "voice", "island", "engine", "garden", "window",
    "letter", "winter", "summer", "morning", "evening", "friend", "family", "question", "answer",
];

/// `words` words drawn from [`WORDS`] by `seed`, in sentences.
pub fn text(seed: u64, words: usize) -> String {
    let mut rng = Rng(seed.wrapping_mul(0x2545_F491_4F6C_DD1D) ^ 0x5851_F42D_4C95_7F2D);
    let mut out = String::with_capacity(words * 7);
    for i in 0..words {
        if i > 0 {
            out.push(' ');
        }
        out.push_str(WORDS[rng.below(WORDS.len())]);
        if i % 12 == 11 {
            out.push('.');
        }
    }
    out
}

/// One request of a workload.
#[derive(Clone)]
pub struct Item {
    /// What its prefix is shared with: `g3` (a group's system prompt), `c2` (a
    /// chat), `u17` (nothing).
    pub key: String,
    /// The item it waits for: the chat's previous turn.
    pub after: Option<usize>,
    pub messages: Value,
    /// Words in its prompt, and how many of them a cache that kept everything
    /// earlier requests brought would hold.
    pub words: usize,
    pub reusable_words: usize,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Kind {
    Shared,
    MultiTurn,
    Unique,
    Mix,
}

impl Kind {
    pub fn parse(name: &str) -> Kind {
        match name {
            "shared" => Kind::Shared,
            "multiturn" => Kind::MultiTurn,
            "unique" => Kind::Unique,
            "mix" => Kind::Mix,
            other => panic!("unknown workload {other:?}: shared, multiturn, unique or mix"),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Kind::Shared => "shared",
            Kind::MultiTurn => "multiturn",
            Kind::Unique => "unique",
            Kind::Mix => "mix",
        }
    }
}

/// The sizes of a workload's parts (smaller in quick mode).
pub struct Sizes {
    pub groups: usize,
    pub per_group: usize,
    pub system_words: usize,
    pub question_words: usize,
    pub chats: usize,
    pub turns: usize,
    pub chat_system_words: usize,
    pub turn_words: usize,
    pub unique: usize,
    pub unique_words: usize,
}

fn shared(sizes: &Sizes, seed: u64, groups: usize, per_group: usize) -> Vec<Vec<Item>> {
    (0..groups)
        .map(|g| {
            let system = format!(
                "Reference {g}. {}",
                text(seed ^ (1000 + g as u64), sizes.system_words)
            );
            (0..per_group)
                .map(|i| {
                    let question = text(
                        seed ^ (100_000 + (g * 1000 + i) as u64),
                        sizes.question_words,
                    );
                    Item {
                        key: format!("g{g}"),
                        after: None,
                        messages: json!([
                            {"role": "system", "content": system},
                            {"role": "user", "content": question}
                        ]),
                        words: sizes.system_words + sizes.question_words,
                        reusable_words: if i == 0 { 0 } else { sizes.system_words },
                    }
                })
                .collect()
        })
        .collect()
}

fn chats(sizes: &Sizes, seed: u64, chats: usize, turns: usize) -> Vec<Vec<Item>> {
    (0..chats)
        .map(|c| {
            let mut messages = vec![json!({"role": "system", "content": format!(
                "Conversation {c}. {}",
                text(seed ^ (2000 + c as u64), sizes.chat_system_words)
            )})];
            let mut words = sizes.chat_system_words;
            let mut previous = 0;
            (0..turns)
                .map(|t| {
                    let half = sizes.turn_words / 2;
                    if t > 0 {
                        messages.push(json!({"role": "assistant", "content":
                            text(seed ^ (300_000 + (c * 100 + t) as u64), half)}));
                        words += half;
                    }
                    let asked = if t == 0 { sizes.turn_words } else { half };
                    messages.push(json!({"role": "user", "content":
                        text(seed ^ (400_000 + (c * 100 + t) as u64), asked)}));
                    words += asked;
                    let item = Item {
                        key: format!("c{c}"),
                        after: None,
                        messages: Value::Array(messages.clone()),
                        words,
                        reusable_words: previous,
                    };
                    previous = words;
                    item
                })
                .collect()
        })
        .collect()
}

fn uniques(sizes: &Sizes, seed: u64, n: usize) -> Vec<Vec<Item>> {
    (0..n)
        .map(|u| {
            vec![Item {
                key: format!("u{u}"),
                after: None,
                messages: json!([{"role": "user", "content": format!(
                    "Document {u}. {}",
                    text(seed ^ (500_000 + u as u64), sizes.unique_words)
                )}]),
                words: sizes.unique_words,
                reusable_words: 0,
            }]
        })
        .collect()
}

/// A workload's requests in sending order: its sequences (a group's requests, a
/// chat's turns) interleaved at random, each kept in its own order; a chat's turn
/// waits for the one before it.
pub fn workload(kind: Kind, sizes: &Sizes, seed: u64) -> Vec<Item> {
    let mut sequences = match kind {
        Kind::Shared => shared(sizes, seed, sizes.groups, sizes.per_group),
        Kind::MultiTurn => chats(sizes, seed, sizes.chats, sizes.turns),
        Kind::Unique => uniques(sizes, seed, sizes.unique),
        Kind::Mix => {
            let mut all = shared(sizes, seed, sizes.groups / 2, sizes.per_group * 4 / 5);
            all.extend(chats(
                sizes,
                seed,
                sizes.chats.div_ceil(3),
                sizes.turns * 3 / 4,
            ));
            all.extend(uniques(sizes, seed, sizes.unique / 3));
            all
        }
    };
    for sequence in &mut sequences {
        sequence.reverse();
    }
    let mut rng = Rng(seed ^ 0xA5A5);
    let mut out: Vec<Item> = Vec::new();
    let mut last_of: std::collections::HashMap<String, usize> = Default::default();
    loop {
        let open: Vec<usize> = (0..sequences.len())
            .filter(|&i| !sequences[i].is_empty())
            .collect();
        if open.is_empty() {
            break;
        }
        let pick = open[rng.below(open.len())];
        let Some(mut item) = sequences[pick].pop() else {
            break;
        };
        if item.key.starts_with('c') {
            item.after = last_of.get(&item.key).copied();
        }
        last_of.insert(item.key.clone(), out.len());
        out.push(item);
    }
    out
}

/// One request's outcome.
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    pub key: String,
    /// Seconds from the block's start.
    pub sent: f64,
    pub ended: f64,
    pub ttft: f64,
    pub e2e: f64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// What kvhint found cached on the worker it booked (its
    /// `x-kvhint-cached-tokens`), to compare with what the engine reused.
    pub predicted_tokens: Option<u64>,
    pub error: Option<String>,
}

/// Sends `messages` as a streaming chat to `url` and reads the answer.
pub fn chat(agent: &ureq::Agent, url: &str, messages: &Value) -> Outcome {
    let body = json!({
        "model": MODEL, "messages": messages, "stream": true,
        "max_tokens": OUTPUT_TOKENS, "temperature": 0,
        "stream_options": {"include_usage": true},
    });
    let started = Instant::now();
    let mut outcome = Outcome::default();
    let response = agent
        .post(&format!("{url}/v1/chat/completions"))
        .header("content-type", "application/json")
        .send(body.to_string());
    let mut response = match response {
        Ok(r) => r,
        Err(e) => {
            outcome.error = Some(e.to_string());
            return outcome;
        }
    };
    let status = response.status().as_u16();
    if status != 200 {
        let text = response.body_mut().read_to_string().unwrap_or_default();
        outcome.error = Some(format!("{status}: {text}"));
        outcome.e2e = started.elapsed().as_secs_f64();
        return outcome;
    }
    outcome.predicted_tokens = response
        .headers()
        .get("x-kvhint-cached-tokens")
        .and_then(|v| v.to_str().ok()?.parse().ok());
    let reader = BufReader::new(response.body_mut().as_reader());
    let mut first = None;
    for line in reader.lines() {
        let line = match line {
            Ok(line) => line,
            Err(e) => {
                outcome.error = Some(format!("reading the stream: {e}"));
                break;
            }
        };
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        first.get_or_insert_with(|| started.elapsed().as_secs_f64());
        if data.trim() == "[DONE]" {
            continue;
        }
        let Ok(event) = serde_json::from_str::<Value>(data) else {
            continue;
        };
        if let Some(usage) = event.get("usage").filter(|u| !u.is_null()) {
            outcome.prompt_tokens = usage["prompt_tokens"].as_u64().unwrap_or(0);
            outcome.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or(0);
        } else if let Some(timings) = event.get("timings") {
            // llama.cpp's own figures, when no usage comes.
            if outcome.prompt_tokens == 0 {
                let cached = timings["cache_n"].as_u64().unwrap_or(0);
                outcome.cached_tokens = cached;
                outcome.prompt_tokens = cached + timings["prompt_n"].as_u64().unwrap_or(0);
            }
        }
    }
    outcome.e2e = started.elapsed().as_secs_f64();
    outcome.ttft = first.unwrap_or(outcome.e2e);
    if first.is_none() && outcome.error.is_none() {
        outcome.error = Some("no SSE event".into());
    }
    outcome
}

/// A client for the benches' requests: long deadlines (a saturated fleet
/// answers slowly), statuses as answers.
pub fn client() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(300)))
        .build()
        .new_agent()
}

/// Sends `items` on an open-loop Poisson schedule of `rate` requests/s drawn
/// from `seed` (the same times for every system, [`poisson`]), each to
/// `url_of(n)`; a chat's turn waits for the one before it. Returns every
/// outcome, in `items`' order.
pub fn run(
    items: &[Item],
    rate: f64,
    seed: u64,
    url_of: Arc<dyn Fn(usize) -> String + Send + Sync>,
) -> Vec<Outcome> {
    run_at(items, &poisson(items.len(), rate, seed), url_of)
}

/// `count` arrival times (seconds from the start) of an open-loop Poisson
/// schedule of `rate` requests/s drawn from `seed`.
pub fn poisson(count: usize, rate: f64, seed: u64) -> Vec<f64> {
    let mut rng = Rng(seed ^ 0x00C0_FFEE);
    let mut at = 0.0;
    (0..count)
        .map(|_| {
            at += -rng.unit().ln() / rate;
            at
        })
        .collect()
}

/// Sends `items[n]` at `times[n]` (seconds from the start, in order, open loop)
/// to `url_of(n)`; a chat's turn also waits for the one before it. Returns
/// every outcome, in `items`' order.
pub fn run_at(
    items: &[Item],
    times: &[f64],
    url_of: Arc<dyn Fn(usize) -> String + Send + Sync>,
) -> Vec<Outcome> {
    assert_eq!(items.len(), times.len(), "a time for every request");
    let done: Vec<Arc<(Mutex<bool>, Condvar)>> = items
        .iter()
        .map(|_| Arc::new((Mutex::new(false), Condvar::new())))
        .collect();
    let start = Instant::now();
    let mut threads = Vec::new();
    for (n, item) in items.iter().enumerate() {
        let due = Duration::from_secs_f64(times[n]);
        if let Some(wait) = due.checked_sub(start.elapsed()) {
            std::thread::sleep(wait);
        }
        let item = item.clone();
        let url_of = Arc::clone(&url_of);
        let mine = Arc::clone(&done[n]);
        let after = item.after.map(|i| Arc::clone(&done[i]));
        threads.push(std::thread::spawn(move || {
            if let Some(after) = after {
                let (lock, signal) = &*after;
                let mut finished = lock.lock().unwrap_or_else(|e| e.into_inner());
                while !*finished {
                    finished = signal.wait(finished).unwrap_or_else(|e| e.into_inner());
                }
            }
            let sent = start.elapsed().as_secs_f64();
            let mut outcome = chat(&client(), &url_of(n), &item.messages);
            outcome.key = item.key;
            outcome.sent = sent;
            outcome.ended = start.elapsed().as_secs_f64();
            let (lock, signal) = &*mine;
            *lock.lock().unwrap_or_else(|e| e.into_inner()) = true;
            signal.notify_all();
            outcome
        }));
    }
    threads
        .into_iter()
        .map(|t| t.join().unwrap_or_default())
        .collect()
}

/// A system under test in one block: where a request goes.
pub enum Front {
    /// The client alternates between the workers (round robin, nothing between).
    Straight(Vec<String>),
    Kvhint(crate::Server),
    Peer(crate::peers::Peer),
}

impl Front {
    /// Where the `n`th request goes.
    pub fn url(&self, n: usize) -> String {
        match self {
            Front::Straight(urls) => urls[n % urls.len()].clone(),
            Front::Kvhint(server) => server.base.clone(),
            Front::Peer(peer) => peer.url.clone(),
        }
    }
}
