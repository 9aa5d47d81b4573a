//! `replication:`: several kvhint replicas sharing booking load over NATS core.
//!
//! Absent, a router books on its own load only. Present, it names the NATS server, the
//! fleet (the subject the replicas of one fleet share) and this replica's name, and
//! tunes the timers (`host/src/replication/` does the work).

use super::yaml::{location, Walker};
use marked_yaml::Node;

/// `replication:`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicationConfig {
    /// `nats://host:port` of the NATS server (or a comma-separated list of them).
    pub nats_url: String,
    /// The fleet: replicas with the same fleet share load (the NATS subject's last part).
    pub fleet: String,
    /// This replica's name, unique in the fleet; the host name if absent.
    pub name: Option<String>,
    /// How often changed load is published (coalesced between ticks).
    pub publish_interval_ms: u64,
    /// How often a full digest (which doubles as the heartbeat) is published.
    pub digest_interval_ms: u64,
    /// A peer silent this long is dropped from the sums.
    pub peer_timeout_ms: u64,
    /// How long a joiner waits for its peers' state at most before it is ready.
    pub sync_timeout_ms: u64,
}

impl ReplicationConfig {
    pub const DEFAULT_PUBLISH_INTERVAL_MS: u64 = 1;
    pub const DEFAULT_DIGEST_INTERVAL_MS: u64 = 1_000;
    pub const DEFAULT_PEER_TIMEOUT_MS: u64 = 3_000;
    pub const DEFAULT_SYNC_TIMEOUT_MS: u64 = 500;

    /// A config with the default timers.
    pub fn new(nats_url: impl Into<String>, fleet: impl Into<String>) -> Self {
        Self {
            nats_url: nats_url.into(),
            fleet: fleet.into(),
            name: None,
            publish_interval_ms: Self::DEFAULT_PUBLISH_INTERVAL_MS,
            digest_interval_ms: Self::DEFAULT_DIGEST_INTERVAL_MS,
            peer_timeout_ms: Self::DEFAULT_PEER_TIMEOUT_MS,
            sync_timeout_ms: Self::DEFAULT_SYNC_TIMEOUT_MS,
        }
    }
}

/// A fleet or replica name: it becomes part of a NATS subject, so no dots,
/// wildcards or white space.
fn valid_token(text: &str) -> bool {
    !text.is_empty()
        && text.len() <= 128
        && text
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

pub(super) fn replication(walker: &mut Walker, node: &Node) -> Option<ReplicationConfig> {
    let map = walker.mapping(node, "replication")?;
    walker.known_keys(
        map,
        "replication",
        &[
            "nats_url",
            "fleet",
            "name",
            "publish_interval_ms",
            "digest_interval_ms",
            "peer_timeout_ms",
            "sync_timeout_ms",
        ],
    );
    let mut errors = false;
    let text = |walker: &mut Walker, key: &str, token: bool| -> Option<String> {
        let path = format!("replication.{key}");
        let node = map.get_node(key)?;
        let value = walker.string(node, &path)?;
        if token && !valid_token(&value) {
            walker.error(
                location(&path, node.span()),
                format!(
                    "`{key}` is `{value}`; it becomes part of a NATS subject: use 1 to 128 \
                     letters, digits, `-` or `_` (no dots, spaces or wildcards)"
                ),
            );
            return None;
        }
        if !token
            && !value
                .split(',')
                .all(|u| u.trim().starts_with("nats://") || u.trim().starts_with("tls://"))
        {
            walker.error(
                location(&path, node.span()),
                format!(
                    "`nats_url` is `{value}`; write the NATS server as nats://HOST:PORT \
                     (several separated by commas)"
                ),
            );
            return None;
        }
        Some(value)
    };
    let nats_url = text(walker, "nats_url", false);
    let fleet = text(walker, "fleet", true);
    let name = text(walker, "name", true);
    for (key, value) in [("nats_url", &nats_url), ("fleet", &fleet)] {
        if value.is_none() && map.get_node(key).is_none() {
            walker.error(
                location("replication", node.span()),
                format!(
                    "`replication.{key}` is missing: replication needs `nats_url` (the NATS \
                     server, nats://HOST:PORT) and `fleet` (the name the replicas share)"
                ),
            );
        }
        errors |= value.is_none();
    }
    let mut out = ReplicationConfig::new(nats_url.unwrap_or_default(), fleet.unwrap_or_default());
    out.name = name;
    let mut timer = |walker: &mut Walker, key: &str, min: u64, max: u64, into: &mut u64| {
        if let Some(node) = map.get_node(key) {
            match walker.unsigned(node, &format!("replication.{key}"), min, max) {
                Some(n) => *into = n,
                None => errors = true,
            }
        }
    };
    timer(
        walker,
        "publish_interval_ms",
        1,
        1_000,
        &mut out.publish_interval_ms,
    );
    timer(
        walker,
        "digest_interval_ms",
        10,
        60_000,
        &mut out.digest_interval_ms,
    );
    timer(
        walker,
        "peer_timeout_ms",
        100,
        600_000,
        &mut out.peer_timeout_ms,
    );
    timer(
        walker,
        "sync_timeout_ms",
        0,
        60_000,
        &mut out.sync_timeout_ms,
    );
    if !errors && out.peer_timeout_ms <= out.digest_interval_ms {
        if let Some(node) = map.get_node("peer_timeout_ms") {
            walker.error(
                location("replication.peer_timeout_ms", node.span()),
                format!(
                    "`peer_timeout_ms` ({}) must be longer than `digest_interval_ms` ({}), the \
                     heartbeat: a peer would be dropped between two heartbeats. Use at least \
                     three heartbeats",
                    out.peer_timeout_ms, out.digest_interval_ms
                ),
            );
        } else {
            walker.error(
                location("replication.digest_interval_ms", node.span()),
                format!(
                    "`digest_interval_ms` ({}) must be shorter than `peer_timeout_ms` ({}): \
                     the digest is the heartbeat",
                    out.digest_interval_ms, out.peer_timeout_ms
                ),
            );
        }
    }
    Some(out)
}
