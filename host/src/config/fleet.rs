//! What a `workers:` entry and a `kv_events.sources` entry share. Both list a
//! worker the router registers itself (every rank in `0..dp_size`), so both read
//! its membership here (`worker_id`, `dp_size`, `role`, `runtime_data`, with the
//! same checks and in the same order) and both refuse a worker listed twice the
//! same way; one parser, so the two lists cannot drift apart. What differs stays
//! with each list: where the engine serves HTTP (`gateway`), where it publishes
//! KV events (`kv_events`), how an entry is named in its errors and whether
//! `role` may be left out.

use super::yaml::{join, key_location, node_location, to_json, Walker};
use super::Location;
use crate::domain::Role;
use marked_yaml::types::MarkedMappingNode;
use marked_yaml::Node;

/// The keys every entry may have, before the ones its list adds.
const MEMBERSHIP_KEYS: [&str; 4] = ["worker_id", "dp_size", "role", "runtime_data"];

/// Which list an entry is in, as far as the shared part cares.
#[derive(Debug, Clone, Copy)]
pub(super) struct EntryKind {
    /// How a missing key names the entry: "a worker needs `…`", "a source needs `…`".
    pub noun: &'static str,
    /// `kv_events.sources` asks for `role`; `workers:` takes `aggregated` without it.
    pub role_required: bool,
}

/// One entry of either list: a mapping whose keys were checked.
pub(super) struct Entry<'n> {
    pub map: &'n MarkedMappingNode,
    pub path: &'n str,
    pub at: Location,
    kind: EntryKind,
}

/// An entry's membership; `None` where the entry was wrong (already reported).
pub(super) struct Membership {
    pub worker_id: Option<u64>,
    pub dp_size: Option<u32>,
    pub role: Option<Role>,
    pub runtime_data: Option<serde_json::Map<String, serde_json::Value>>,
}

impl<'n> Entry<'n> {
    /// The entry at `node`, which must be a mapping; a key that is neither a
    /// membership key nor one of `own_keys` is reported.
    pub fn open(
        walker: &mut Walker,
        node: &'n Node,
        path: &'n str,
        kind: EntryKind,
        own_keys: &[&str],
    ) -> Option<Self> {
        let at = node_location(path, node);
        let map = walker.mapping(node, path)?;
        walker.known_keys(map, path, &[&MEMBERSHIP_KEYS[..], own_keys].concat());
        Some(Self {
            map,
            path,
            at,
            kind,
        })
    }

    /// The node at `key`; its absence is reported as "a worker needs `key`: what".
    pub fn required(&self, walker: &mut Walker, key: &str, what: &str) -> Option<&'n Node> {
        let node = self.map.get_node(key);
        if node.is_none() {
            walker.error(
                self.at.clone(),
                format!("a {} needs `{key}`: {what}", self.kind.noun),
            );
        }
        node
    }

    /// `worker_id`, `dp_size` (1 without it), `role` and `runtime_data` (empty
    /// without it), read in that order so that their errors come in it.
    pub fn membership(&self, walker: &mut Walker) -> Membership {
        let (map, path) = (self.map, self.path);
        let worker_id = self
            .required(walker, "worker_id", "the worker id bookings name it by")
            .and_then(|n| walker.unsigned(n, &join(path, "worker_id"), 0, u64::MAX));
        let dp_size = match map.get_node("dp_size") {
            Some(n) => walker
                .unsigned(n, &join(path, "dp_size"), 1, 1024)
                .map(|n| n as u32),
            None => Some(1),
        };
        let role_at = join(path, "role");
        let role = if self.kind.role_required {
            self.required(walker, "role", "aggregated, prefill or decode")
                .and_then(|n| walker.one_of(n, &role_at, "role", Role::NAMES, Role::parse))
        } else {
            match map.get_node("role") {
                Some(n) => walker.one_of(n, &role_at, "role", Role::NAMES, Role::parse),
                None => Some(Role::Aggregated),
            }
        };
        let runtime_data = match map.get_node("runtime_data") {
            None => Some(serde_json::Map::new()),
            Some(n) => match to_json(n) {
                serde_json::Value::Object(m) => Some(m),
                _ => {
                    walker.error(
                        key_location(&join(path, "runtime_data"), map, "runtime_data"),
                        "`runtime_data` is a mapping (Dynamo's keys: router_hint, \
                         router_hint_worker_type, router_hint_source_control_endpoints)",
                    );
                    None
                }
            },
        };
        Membership {
            worker_id,
            dp_size,
            role,
            runtime_data,
        }
    }
}

/// A parsed entry, as the duplicate check sees it.
pub(super) trait Listed {
    fn worker_id(&self) -> u64;
    fn at(&self) -> &Location;
}

/// Each item of `list` (`workers`, `kv_events.sources`) parsed by `entry`, given
/// its path (`workers[2]`); an entry whose `worker_id` an earlier one has is
/// reported and dropped (each worker is listed once, `dp_size` giving its ranks).
pub(super) fn entries<'n, T: Listed>(
    walker: &mut Walker,
    items: impl Iterator<Item = &'n Node>,
    list: &str,
    mut entry: impl FnMut(&mut Walker, &'n Node, &str) -> Option<T>,
) -> Vec<T> {
    let mut out: Vec<T> = Vec::new();
    for (i, item) in items.enumerate() {
        let Some(parsed) = entry(walker, item, &format!("{list}[{i}]")) else {
            continue;
        };
        if let Some(other) = out.iter().find(|o| o.worker_id() == parsed.worker_id()) {
            walker.error(
                parsed.at().clone(),
                format!(
                    "worker_id {} is listed twice (first at line {}); list each worker once, \
                     with `dp_size` for its ranks",
                    parsed.worker_id(),
                    other.at().line
                ),
            );
            continue;
        }
        out.push(parsed);
    }
    out
}
