//! `kv_events:`: which engine blocks count, how subscriptions are tuned, and the
//! sources of fleets that have no registration step.

use super::fleet;
use super::yaml::{join, key_location, location, Walker};
use super::Location;
use crate::domain::event_source::{Endpoints, KvEventSource};
use crate::domain::{Role, ThreadPolicy};
use marked_yaml::Node;

/// `kv_events:`.
#[derive(Debug, Clone, PartialEq)]
pub struct KvEventsConfig {
    /// Media whose blocks count as a worker's cache (`GPU` by default).
    pub media: Vec<String>,
    /// Messages a subscription's socket buffers before dropping (ZMQ_RCVHWM).
    pub receive_hwm: u64,
    /// How long one replay may take before the worker is resynchronised instead.
    pub replay_timeout_ms: u64,
    /// How the event path's threads are scheduled beside booking threads.
    pub thread_policy: ThreadPolicy,
    pub sources: Vec<ConfiguredSource>,
    /// The most sources (worker ranks with a subscription) the router keeps, from
    /// the config and registrations together; their descriptors are kept out of
    /// the connection budget. Fixed at start.
    pub max_sources: u64,
}

/// The default of `kv_events.max_sources`.
pub const DEFAULT_MAX_SOURCES: u64 = 64;

impl Default for KvEventsConfig {
    fn default() -> Self {
        Self {
            media: vec!["GPU".to_string()],
            receive_hwm: 100_000,
            replay_timeout_ms: 5_000,
            thread_policy: ThreadPolicy::default(),
            sources: Vec::new(),
            max_sources: DEFAULT_MAX_SOURCES,
        }
    }
}

/// `kv_events.sources[i]`: a worker the router registers itself (every rank in
/// `0..dp_size`) and subscribes to.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfiguredSource {
    pub worker_id: u64,
    pub dp_size: u32,
    pub role: Role,
    pub runtime_data: serde_json::Map<String, serde_json::Value>,
    pub source: KvEventSource,
    pub at: Location,
}

pub(super) fn kv_events(walker: &mut Walker, node: &Node) -> KvEventsConfig {
    let mut out = KvEventsConfig::default();
    let Some(map) = walker.mapping(node, "kv_events") else {
        return out;
    };
    walker.known_keys(
        map,
        "kv_events",
        &[
            "media",
            "receive_hwm",
            "replay_timeout_ms",
            "thread_policy",
            "sources",
            "max_sources",
        ],
    );
    if let Some(node) = map.get_node("max_sources") {
        if let Some(n) = walker.unsigned(node, "kv_events.max_sources", 1, 65_536) {
            out.max_sources = n;
        }
    }
    if let Some(node) = map.get_node("media") {
        match node.as_sequence() {
            Some(items) if !items.is_empty() => {
                let mut media = Vec::new();
                for (i, item) in items.iter().enumerate() {
                    if let Some(text) = walker.string(item, &format!("kv_events.media[{i}]")) {
                        media.push(text);
                    }
                }
                out.media = media;
            }
            _ => walker.error(
                location("kv_events.media", node.span()),
                "`media` is a non-empty list of storage media whose blocks count, \
                 like [GPU] (vLLM: GPU, CPU, STORAGE; SGLang: GPU, CPU_PINNED, DISK, EXTERNAL)",
            ),
        }
    }
    if let Some(node) = map.get_node("receive_hwm") {
        if let Some(n) = walker.unsigned(node, "kv_events.receive_hwm", 1, i32::MAX as u64) {
            out.receive_hwm = n;
        }
    }
    if let Some(node) = map.get_node("replay_timeout_ms") {
        if let Some(n) = walker.unsigned(node, "kv_events.replay_timeout_ms", 1, 600_000) {
            out.replay_timeout_ms = n;
        }
    }
    if let Some(node) = map.get_node("thread_policy") {
        if let Some(policy) = walker.one_of(
            node,
            "kv_events.thread_policy",
            "thread policy",
            ThreadPolicy::NAMES,
            ThreadPolicy::parse,
        ) {
            out.thread_policy = policy;
        }
    }
    if let Some(node) = map.get_node("sources") {
        match node.as_sequence() {
            Some(items) => {
                out.sources = fleet::entries(walker, items.iter(), "kv_events.sources", configured)
            }
            None => walker.error(
                location("kv_events.sources", node.span()),
                "`sources` is a list of engines to subscribe to, each with worker_id, role \
                 and endpoint",
            ),
        }
    }
    let ranks: u64 = out.sources.iter().map(|s| u64::from(s.dp_size)).sum();
    if ranks > out.max_sources {
        walker.error(
            key_location("kv_events.sources", map, "sources"),
            format!(
                "the sources list {ranks} worker ranks to subscribe to, more than \
                 `kv_events.max_sources` ({}); raise it (each source takes a few file \
                 descriptors from the connection budget), or list fewer",
                out.max_sources
            ),
        );
    }
    out
}

impl fleet::Listed for ConfiguredSource {
    fn worker_id(&self) -> u64 {
        self.worker_id
    }
    fn at(&self) -> &Location {
        &self.at
    }
}

fn configured(walker: &mut Walker, node: &Node, path: &str) -> Option<ConfiguredSource> {
    let kind = fleet::EntryKind {
        noun: "source",
        role_required: true,
    };
    let entry = fleet::Entry::open(
        walker,
        node,
        path,
        kind,
        &["endpoint", "replay_endpoint", "topic", "bind"],
    )?;
    let (map, at) = (entry.map, entry.at.clone());
    let errors_before = walker.errors.len();
    let required = |walker: &mut Walker, key: &str, what: &str| entry.required(walker, key, what);
    let fleet::Membership {
        worker_id,
        dp_size,
        role,
        runtime_data,
    } = entry.membership(walker);
    let endpoint = required(
        walker,
        "endpoint",
        "where the engine publishes, as in its --kv-events-config",
    )
    .and_then(|n| walker.string(n, &join(path, "endpoint")));
    let replay_endpoint = map
        .get_node("replay_endpoint")
        .and_then(|n| walker.string(n, &join(path, "replay_endpoint")));
    let topic = map
        .get_node("topic")
        .and_then(|n| walker.string(n, &join(path, "topic")))
        .unwrap_or_default();
    let bind = match map.get_node("bind") {
        None => Some(false),
        Some(n) => match n.as_scalar().map(|s| s.as_str()) {
            Some("true") => Some(true),
            Some("false") => Some(false),
            _ => {
                walker.error(
                    location(&join(path, "bind"), n.span()),
                    "`bind` is true (the engine connects to the router) or false (the \
                     router connects to the engine's bound publisher)",
                );
                None
            }
        },
    };
    if walker.errors.len() > errors_before {
        return None;
    }
    let source = KvEventSource {
        endpoint: endpoint?,
        replay_endpoint,
        topic,
        bind: bind?,
    };
    let dp_size = dp_size?;
    // Every rank's endpoints must resolve (a port plus the last rank may overflow).
    if let Err(error) = Endpoints::resolve(dp_size - 1, &source) {
        let key = error.field;
        let at = map
            .get_node(key)
            .map(|n| location(&join(path, key), n.span()))
            .unwrap_or(at);
        walker.error(at, error.problem);
        return None;
    }
    Some(ConfiguredSource {
        worker_id: worker_id?,
        dp_size,
        role: role?,
        runtime_data: runtime_data?,
        source,
        at,
    })
}
