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

/// `user` with `password_file`, `token_file`, `nkey_file` or `credentials_file`:
/// read when the config is, so a missing, unsafe or malformed file is a located
/// error, never a replica that cannot join.
#[derive(Clone, PartialEq, Eq)]
pub enum NatsAuth {
    UserPassword {
        user: String,
        password: String,
    },
    Token(String),
    /// A user's NKey seed (`SU…`): the client signs the server's nonce with it.
    NKey(String),
    /// A `.creds` file's text: the user's JWT and the seed that signs the nonce.
    Credentials(String),
}

impl fmt::Debug for NatsAuth {
    // The secrets never reach a log or a `Debug` print.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NatsAuth::UserPassword { user, .. } => {
                write!(f, "UserPassword {{ user: {user:?}, password: <hidden> }}")
            }
            NatsAuth::Token(_) => f.write_str("Token(<hidden>)"),
            NatsAuth::NKey(_) => f.write_str("NKey(<hidden>)"),
            NatsAuth::Credentials(_) => f.write_str("Credentials(<hidden>)"),
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
            "nkey_file",
            "credentials_file",
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

/// The longest `.creds` file read: a user JWT with its permissions and the seed
/// fit in a few KiB; a file far larger is not one.
const MAX_CREDS_FILE_BYTES: u64 = 64 << 10;

/// The credential kinds, each as the keys that give it, in the order a
/// conflict is reported.
const CREDENTIAL_KINDS: [&[&str]; 4] = [
    &["user", "password_file"],
    &["token_file"],
    &["nkey_file"],
    &["credentials_file"],
];

/// `user` + `password_file`, `token_file`, `nkey_file` or `credentials_file`:
/// one kind at most, each file read as a token file is (a private regular file
/// in directories no other user can write; its first line, but for a `.creds`
/// file, which is read whole).
fn nats_auth(
    walker: &mut Walker,
    map: &marked_yaml::types::MarkedMappingNode,
    base: &Path,
) -> Option<NatsAuth> {
    // Each file's secret, or a located error saying what the file must hold;
    // `check` looks at the secret once read (an NKey seed's kind).
    let secret = |walker: &mut Walker,
                  key: &str,
                  what: &str,
                  check: &dyn Fn(&str) -> Result<(), String>|
     -> Option<String> {
        let node = map.get_node(key)?;
        let path = format!("replication.{key}");
        let file = base.join(walker.string(node, &path)?);
        let read = crate::config::auth::read_secret_file(&file)
            .map_err(|e| {
                e.replace("the worker's API key", what)
                    .replace("the key", what)
                    .replace("one key", "one secret")
            })
            .and_then(|secret| check(&secret).map(|()| secret));
        match read {
            Ok(secret) => Some(secret),
            Err(e) => {
                walker.error(
                    location(&path, node.span()),
                    format!("{}: {e}", file.display()),
                );
                None
            }
        }
    };
    let at = |key: &str| {
        map.get_node(key)
            .map(|n| location(&format!("replication.{key}"), n.span()))
    };
    let user = map
        .get_node("user")
        .and_then(|n| walker.string(n, "replication.user"));
    let any = |_: &str| Ok(());
    let password = secret(walker, "password_file", "the NATS password", &any);
    let token = secret(walker, "token_file", "the NATS token", &any);
    let nkey = secret(
        walker,
        "nkey_file",
        "the NATS user's NKey seed (SU…)",
        &check_user_seed,
    );
    let credentials = map.get_node("credentials_file").and_then(|node| {
        let path = "replication.credentials_file";
        let file = base.join(walker.string(node, path)?);
        match read_credentials_file(&file) {
            Ok(text) => Some(text),
            Err(why) => {
                walker.error(
                    location(path, node.span()),
                    format!("{}: {why}", file.display()),
                );
                None
            }
        }
    });
    // One kind at a time: the server asks for one, and which one a replica
    // offered would otherwise depend on the client library's order. Each kind
    // after the first is located at its (first) key.
    let given: Vec<&str> = CREDENTIAL_KINDS
        .iter()
        .filter_map(|keys| keys.iter().copied().find(|k| map.get_node(k).is_some()))
        .collect();
    if given.len() > 1 {
        for key in &given[1..] {
            if let Some(at) = at(key) {
                walker.error(
                    at,
                    "give one kind of NATS credentials, the one the NATS server asks for: \
                     `user` with `password_file`, `token_file`, `nkey_file` or \
                     `credentials_file`, not several",
                );
            }
        }
        return None;
    }
    match (
        map.get_node("user").is_some(),
        map.get_node("password_file").is_some(),
    ) {
        (true, false) => {
            if let Some(at) = at("user") {
                walker.error(
                    at,
                    "`user` needs `password_file`: the file holding the NATS user's password",
                );
            }
            None
        }
        (false, true) => {
            if let Some(at) = at("password_file") {
                walker.error(
                    at,
                    "`password_file` needs `user`: the NATS user the password is for",
                );
            }
            None
        }
        _ => match (user, password, token, nkey, credentials) {
            (Some(user), Some(password), None, None, None) => {
                Some(NatsAuth::UserPassword { user, password })
            }
            (None, None, Some(token), None, None) => Some(NatsAuth::Token(token)),
            (None, None, None, Some(seed), None) => Some(NatsAuth::NKey(seed)),
            (None, None, None, None, Some(creds)) => Some(NatsAuth::Credentials(creds)),
            _ => None,
        },
    }
}

/// Whether `seed` is a NATS user's NKey seed (`SU…`), which is what a server's
/// `authorization { users = [ { nkey: U… } ] }` checks a signature against.
/// The message never holds the seed.
fn check_user_seed(seed: &str) -> Result<(), String> {
    const MAKE: &str = "make one with `nsc generate nkey --user` or `nk -gen user`, and give \
                        the server its public key (U…)";
    if seed.starts_with('U') && nkeys::KeyPair::from_public_key(seed).is_ok() {
        return Err(format!(
            "holds a user's public key (U…), which the server keeps; the replica needs the \
             seed (SU…) it was made from: {MAKE}"
        ));
    }
    match nkeys::KeyPair::from_seed(seed) {
        Ok(pair) if matches!(pair.key_pair_type(), nkeys::KeyPairType::User) => Ok(()),
        Ok(pair) => Err(format!(
            "holds the seed of an NKey of type {:?}, not of a user (SU…): {MAKE}",
            pair.key_pair_type()
        )),
        Err(e) => Err(format!("is not an NKey seed ({e}): {MAKE}")),
    }
}

/// A NATS `.creds` file (the user's JWT and NKey seed, as `nsc generate creds`
/// writes it), read as a token file is: a private regular file in directories
/// no other user can write, not blocking on a FIFO, not read past
/// [`MAX_CREDS_FILE_BYTES`]; and parsed as the NATS client parses it, so a
/// mistake shows now rather than as a replica that cannot join. The message
/// never holds the file's text.
fn read_credentials_file(path: &Path) -> Result<String, String> {
    let text = super::auth::read_private_file(
        path,
        &super::auth::PrivateFile {
            kind: ".creds file",
            holds: "a user JWT and its seed",
            missing: format!(
                "there is no such file; write the NATS user's .creds file there (`nsc generate \
                 creds`), readable by this user only: `(umask 077; nsc generate creds -a ACCOUNT \
                 -n USER > {})`",
                path.display()
            ),
            why_private: "it holds the NATS user's seed: ",
            max_bytes: MAX_CREDS_FILE_BYTES,
        },
    )?;
    async_nats::ConnectOptions::new()
        .credentials(&text)
        .map_err(|e| {
            format!(
                "is not a NATS .creds file ({e}): it holds the user JWT between `-----BEGIN NATS \
                 USER JWT-----` and `------END NATS USER JWT------` lines and the seed (SU…) \
                 between `-----BEGIN USER NKEY SEED-----` and `------END USER NKEY SEED------`, \
                 as `nsc generate creds` writes it"
            )
        })?;
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The secrets of every kind stay out of a `Debug` print (a config dump,
    /// a log line that prints the config).
    #[test]
    fn no_nats_secret_is_in_a_debug_print() {
        for (auth, secret) in [
            (
                NatsAuth::UserPassword {
                    user: "kvhint".into(),
                    password: "pw-0123456789".into(),
                },
                "pw-0123456789",
            ),
            (NatsAuth::Token("tok-0123456789".into()), "tok-0123456789"),
            (
                NatsAuth::NKey("SUSEED0123456789".into()),
                "SUSEED0123456789",
            ),
            (
                NatsAuth::Credentials("-----BEGIN NATS USER JWT-----\neyJ0".into()),
                "eyJ0",
            ),
        ] {
            let shown = format!("{auth:?}");
            assert!(
                !shown.contains(secret) && shown.contains("<hidden>"),
                "{shown}"
            );
        }
    }

    /// A user's seed is taken; its public key, another kind's seed and a
    /// word that is no key are refused, none of them repeated in the message.
    #[test]
    fn only_a_user_seed_is_taken_for_nkey_file() {
        let user = nkeys::KeyPair::new_user();
        let seed = user.seed().unwrap_or_default();
        assert_eq!(check_user_seed(&seed), Ok(()));
        let account = nkeys::KeyPair::new_account().seed().unwrap_or_default();
        for (given, says) in [
            (user.public_key(), "public key"),
            (account.clone(), "type Account"),
            ("SUNOTAKEY".to_string(), "is not an NKey seed"),
        ] {
            let why = check_user_seed(&given).unwrap_err();
            assert!(why.contains(says) && !why.contains(&given[1..]), "{why}");
        }
    }
}
