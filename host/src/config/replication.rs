//! `replication:`: several kvhint replicas sharing booking load over NATS core.
//!
//! Absent, a router books on its own load only. Present, it names the NATS server, the
//! fleet (the subject the replicas of one fleet share) and this replica's name, and
//! tunes the timers (`host/src/replication/` does the work).

use super::yaml::{location, Walker};
use marked_yaml::Node;
use std::fmt;
use std::path::{Path, PathBuf};

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
    /// How the replica proves itself to the NATS server, if it asks.
    pub auth: Option<NatsAuth>,
    /// `tls_ca_file`: the CA the NATS server's certificate is checked against;
    /// with it the connection must be TLS.
    pub tls_ca_file: Option<PathBuf>,
}

/// `user` with `password_file`, or `token_file`: read when the config is, so a
/// missing or unsafe file is a located error, never a replica that cannot join.
#[derive(Clone, PartialEq, Eq)]
pub enum NatsAuth {
    UserPassword { user: String, password: String },
    Token(String),
}

impl fmt::Debug for NatsAuth {
    // The secrets never reach a log or a `Debug` print.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NatsAuth::UserPassword { user, .. } => {
                write!(f, "UserPassword {{ user: {user:?}, password: <hidden> }}")
            }
            NatsAuth::Token(_) => f.write_str("Token(<hidden>)"),
        }
    }
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
            auth: None,
            tls_ca_file: None,
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

pub(super) fn replication(
    walker: &mut Walker,
    node: &Node,
    base: &Path,
) -> Option<ReplicationConfig> {
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
            "user",
            "password_file",
            "token_file",
            "tls_ca_file",
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
    out.auth = nats_auth(walker, map, base);
    if let Some(node) = map.get_node("tls_ca_file") {
        let path = "replication.tls_ca_file";
        if let Some(file) = walker.string(node, path).map(|f| base.join(f)) {
            match super::gateway::read_ca_file(&file) {
                Ok(_) => out.tls_ca_file = Some(file),
                Err(e) => walker.error(
                    location(path, node.span()),
                    format!("{}: {e}; point `tls_ca_file` at the PEM file of the CA that signed the NATS server's certificate", file.display()),
                ),
            }
        }
    }
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

/// `user` + `password_file`, or `token_file`, each file read as a token file
/// is (a private regular file; its first line).
fn nats_auth(
    walker: &mut Walker,
    map: &marked_yaml::types::MarkedMappingNode,
    base: &Path,
) -> Option<NatsAuth> {
    let secret = |walker: &mut Walker, key: &str, what: &str| -> Option<String> {
        let node = map.get_node(key)?;
        let path = format!("replication.{key}");
        let file = base.join(walker.string(node, &path)?);
        match crate::config::auth::read_secret_file(&file) {
            Ok(secret) => Some(secret),
            Err(e) => {
                walker.error(
                    location(&path, node.span()),
                    format!(
                        "{}: {}",
                        file.display(),
                        e.replace("the worker's API key", what)
                            .replace("the key", what)
                            .replace("one key", "one secret")
                    ),
                );
                None
            }
        }
    };
    let user = map
        .get_node("user")
        .and_then(|n| walker.string(n, "replication.user"));
    let password = secret(walker, "password_file", "the NATS password");
    let token = secret(walker, "token_file", "the NATS token");
    let at = |key: &str| {
        map.get_node(key)
            .map(|n| location(&format!("replication.{key}"), n.span()))
    };
    match (
        map.get_node("user").is_some(),
        map.get_node("password_file").is_some(),
        map.get_node("token_file").is_some(),
    ) {
        (true, _, true) | (_, true, true) => {
            if let Some(at) = at("token_file") {
                walker.error(at, "give either `user` with `password_file` or `token_file`, as the NATS server asks, not both");
            }
            None
        }
        (true, false, false) => {
            if let Some(at) = at("user") {
                walker.error(
                    at,
                    "`user` needs `password_file`: the file holding the NATS user's password",
                );
            }
            None
        }
        (false, true, false) => {
            if let Some(at) = at("password_file") {
                walker.error(
                    at,
                    "`password_file` needs `user`: the NATS user the password is for",
                );
            }
            None
        }
        _ => match (user, password, token) {
            (Some(user), Some(password), None) => Some(NatsAuth::UserPassword { user, password }),
            (None, None, Some(token)) => Some(NatsAuth::Token(token)),
            _ => None,
        },
    }
}
