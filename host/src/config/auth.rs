//! `auth:`: where the API's bearer tokens are, and reading them.
//!
//! Tokens live in files, never in the config or on the command line (argv is
//! readable by every user of the machine, and configs get pasted into tickets).
//! A token file holds one token per line, so a token can be rotated by adding the
//! new one, reloading, moving callers over, then removing the old one. The files
//! are read with the rest of the config, by `check` and on every reload, and a
//! file that is missing, unsafe or empty fails that load like any config error.
//!
//! Only SHA-256 digests of the tokens are kept, and a presented token is compared
//! digest to digest in constant time, so neither a token's bytes nor its length
//! can be learnt from how long a refusal takes.

use super::yaml::{location, node_location, Walker};
use super::{ConfigError, Location};
use marked_yaml::Node;
use sha2::{Digest, Sha256};
use std::fmt;
use std::io::Read;
use std::path::{Path, PathBuf};

/// Who may call an endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Caller {
    /// `/admin/*` and deregistering workers; an admin token is taken everywhere.
    Admin,
    /// Registering workers and posting KV events.
    Worker,
    /// Booking and releasing.
    Client,
}

impl Caller {
    pub const ALL: [Caller; 3] = [Caller::Admin, Caller::Worker, Caller::Client];

    pub fn as_str(self) -> &'static str {
        match self {
            Caller::Admin => "admin",
            Caller::Worker => "worker",
            Caller::Client => "client",
        }
    }

    /// The config key naming this caller's token file.
    pub fn key(self) -> &'static str {
        match self {
            Caller::Admin => "admin_token_file",
            Caller::Worker => "worker_token_file",
            Caller::Client => "client_token_file",
        }
    }
}

impl fmt::Display for Caller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One `auth.<caller>_token_file`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenFile {
    pub path: PathBuf,
    pub at: Location,
}

/// `auth:`. `admin_token_file` is required; a caller without a file of its own
/// is let in with an admin token only.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuthConfig {
    pub admin: TokenFile,
    pub worker: Option<TokenFile>,
    pub client: Option<TokenFile>,
}

impl AuthConfig {
    pub fn file(&self, caller: Caller) -> Option<&TokenFile> {
        match caller {
            Caller::Admin => Some(&self.admin),
            Caller::Worker => self.worker.as_ref(),
            Caller::Client => self.client.as_ref(),
        }
    }
}

/// Shortest token accepted, in bytes: 16 random hex digits are 64 bits.
pub const MIN_TOKEN_BYTES: usize = 16;
/// A token file larger than this is not a token file.
const MAX_TOKEN_FILE_BYTES: u64 = 64 << 10;

pub(super) fn auth(walker: &mut Walker, node: &Node, base: &Path) -> Option<AuthConfig> {
    let map = walker.mapping(node, "auth")?;
    let keys: Vec<&str> = Caller::ALL.iter().map(|c| c.key()).collect();
    walker.known_keys(map, "auth", &keys);
    let mut file = |caller: Caller| -> Option<TokenFile> {
        let path = format!("auth.{}", caller.key());
        let node = map.get_node(caller.key())?;
        let text = walker.string(node, &path)?;
        Some(TokenFile {
            path: super::resolve(base, &text),
            at: location(&path, node.span()),
        })
    };
    let admin = file(Caller::Admin);
    let worker = file(Caller::Worker);
    let client = file(Caller::Client);
    match admin {
        Some(admin) => Some(AuthConfig {
            admin,
            worker,
            client,
        }),
        None => {
            walker.error(
                node_location("auth", node),
                "`auth` needs `admin_token_file`: the token that may reload, read status and deregister workers (it is also taken wherever a worker or client token is)",
            );
            None
        }
    }
}

/// The tokens the API takes, as digests, by caller.
#[derive(Clone, Default)]
pub struct Tokens {
    digests: Vec<(Caller, [u8; 32])>,
}

impl fmt::Debug for Tokens {
    // Never the digests: a log line with them would help an offline guess.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokens")
            .field("count", &self.digests.len())
            .finish()
    }
}

impl Tokens {
    /// Whether `presented` is a token `caller` may use: one of its own, or an
    /// admin token. Every digest is compared, matched or not.
    pub fn admits(&self, caller: Caller, presented: &[u8]) -> bool {
        let digest: [u8; 32] = Sha256::digest(presented).into();
        let mut admitted = false;
        for (owner, known) in &self.digests {
            let equal = constant_time_eq::constant_time_eq_32(known, &digest);
            admitted |= equal && (*owner == caller || *owner == Caller::Admin);
        }
        admitted
    }

    /// How many tokens `caller` has of its own.
    pub fn count(&self, caller: Caller) -> usize {
        self.digests.iter().filter(|(c, _)| *c == caller).count()
    }

    /// Reads every token file `auth` names. Each problem is one error at the
    /// key that names the file; a token's text is never in a message.
    pub fn load(config_file: &Path, auth: &AuthConfig) -> Result<Tokens, Vec<ConfigError>> {
        let mut tokens = Tokens::default();
        let mut errors = Vec::new();
        let mut seen: Vec<([u8; 32], Caller)> = Vec::new();
        for caller in Caller::ALL {
            let Some(file) = auth.file(caller) else {
                continue;
            };
            let error = |message: String| {
                ConfigError::new(
                    config_file,
                    Some(file.at.clone()),
                    format!("{}: {message}", file.path.display()),
                )
            };
            match read_token_file(&file.path) {
                Ok(lines) => {
                    for (line, token) in lines {
                        if token.len() < MIN_TOKEN_BYTES {
                            errors.push(error(format!(
                                "line {line}: a token must be at least {MIN_TOKEN_BYTES} bytes; make one with `openssl rand -hex 32`"
                            )));
                            continue;
                        }
                        let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
                        if let Some((_, other)) = seen.iter().find(|(d, _)| *d == digest) {
                            if *other != caller {
                                errors.push(error(format!(
                                    "line {line}: this token is also in the {other} token file; each caller needs tokens of its own, or one could act as the other"
                                )));
                            }
                            continue;
                        }
                        seen.push((digest, caller));
                        tokens.digests.push((caller, digest));
                    }
                    if !tokens.digests.iter().any(|(c, _)| *c == caller) && errors.is_empty() {
                        errors.push(error(
                            "holds no token; write one per line (`openssl rand -hex 32 > FILE`)"
                                .to_string(),
                        ));
                    }
                }
                Err(message) => errors.push(error(message)),
            }
        }
        if errors.is_empty() {
            Ok(tokens)
        } else {
            Err(errors)
        }
    }
}

/// The one secret a private file holds (a worker's API key): its first token
/// line, read as a token file is (a regular file only its owner may read or
/// write, in directories no other user can write). The message never holds it.
pub(crate) fn read_secret_file(path: &Path) -> Result<String, String> {
    if std::fs::symlink_metadata(path).is_err() {
        return Err(format!(
            "there is no such file; write the worker's API key in it, readable by this user only: `(umask 077; cat > {})`",
            path.display()
        ));
    }
    let lines = read_token_file(path).map_err(|e| e.replace("token file", "key file"))?;
    match lines.as_slice() {
        [(_, key)] => Ok(key.clone()),
        [] => {
            Err("holds no key; write the key on one line (`(umask 077; echo KEY > FILE)`)".into())
        }
        _ => Err("holds more than one key; keep the worker's one key on one line".into()),
    }
}

/// How a private file is named in its messages, and how large it may be.
pub(super) struct PrivateFile<'a> {
    /// "token file", ".creds file".
    pub kind: &'a str,
    /// What a good one holds ("one token per line").
    pub holds: &'a str,
    /// The whole message when there is no such file (how to make one).
    pub missing: String,
    /// Why it must be private, said before the `chmod` ("" or "it holds …: ").
    pub why_private: &'a str,
    pub max_bytes: u64,
}

/// A secret file's text. Refuses what is not a private regular file in
/// directories no other user can write, without blocking on a FIFO and without
/// reading a huge file (token files, key files, NATS `.creds` files alike).
pub(super) fn read_private_file(path: &Path, spec: &PrivateFile<'_>) -> Result<String, String> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let PrivateFile {
        kind,
        holds,
        why_private,
        max_bytes,
        ..
    } = spec;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => spec.missing.clone(),
            _ => format!("cannot read the {kind}: {e}"),
        })?;
    let meta = file
        .metadata()
        .map_err(|e| format!("cannot read the {kind}: {e}"))?;
    if !meta.file_type().is_file() {
        return Err(format!("is not a regular file; a {kind} holds {holds}"));
    }
    let mode = meta.mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(format!(
            "may be read by other users (mode {mode:04o}); {why_private}run `chmod 600 {}`",
            path.display()
        ));
    }
    // Who could have written it: the owner, and every directory on its way (through
    // any symlinks), as the loader checks a plugin file. Another user who owns the
    // file, or can write a directory it sits in, would choose the secret.
    crate::trust::check_token_file(path, &meta).map_err(|e| e.to_string())?;
    if meta.len() > *max_bytes {
        return Err(format!(
            "is {} bytes, more than a {kind}'s {max_bytes}; it holds {holds}",
            meta.len()
        ));
    }
    let mut text = String::new();
    file.take(*max_bytes)
        .read_to_string(&mut text)
        .map_err(|e| format!("cannot read the {kind} as UTF-8 text: {e}"))?;
    Ok(text)
}

/// The tokens in a file, with their line numbers: each line trimmed, blank lines
/// and `#` comments skipped; the file read as [`read_private_file`] reads one.
fn read_token_file(path: &Path) -> Result<Vec<(usize, String)>, String> {
    let text = read_private_file(
        path,
        &PrivateFile {
            kind: "token file",
            holds: "one token per line",
            missing: format!(
                "there is no such token file; make one with `(umask 077; openssl rand -hex 32 > {})`",
                path.display()
            ),
            why_private: "",
            max_bytes: MAX_TOKEN_FILE_BYTES,
        },
    )?;
    let mut tokens = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line_text = line.trim();
        if line_text.is_empty() || line_text.starts_with('#') {
            continue;
        }
        if line_text
            .chars()
            .any(|c| c.is_whitespace() || c.is_control())
        {
            return Err(format!(
                "line {}: a token is one word of printable characters",
                i + 1
            ));
        }
        tokens.push((i + 1, line_text.to_string()));
    }
    Ok(tokens)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn write(dir: &Path, name: &str, text: &str, mode: u32) -> TokenFile {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        TokenFile {
            path,
            at: Location::default(),
        }
    }

    #[test]
    fn an_admin_token_is_taken_everywhere_and_a_client_token_only_for_clients() {
        let dir = tempfile::tempdir().unwrap();
        let auth = AuthConfig {
            admin: write(dir.path(), "a", "# admin\nadmin-0123456789abcdef\n", 0o600),
            worker: None,
            client: write(
                dir.path(),
                "c",
                "client-0123456789abcdef\nclient-rotated-0123456789\n",
                0o600,
            )
            .into(),
        };
        let tokens = Tokens::load(Path::new("k.yaml"), &auth).unwrap();
        for caller in Caller::ALL {
            assert!(tokens.admits(caller, b"admin-0123456789abcdef"));
        }
        assert!(tokens.admits(Caller::Client, b"client-0123456789abcdef"));
        assert!(tokens.admits(Caller::Client, b"client-rotated-0123456789"));
        assert!(!tokens.admits(Caller::Worker, b"client-0123456789abcdef"));
        assert!(!tokens.admits(Caller::Admin, b"client-0123456789abcdef"));
        assert!(!tokens.admits(Caller::Client, b"client-0123456789abcde"));
        assert!(!tokens.admits(Caller::Client, b""));
    }

    #[test]
    fn unsafe_short_shared_and_empty_token_files_are_refused_without_their_text() {
        let dir = tempfile::tempdir().unwrap();
        let cases = [
            ("readable", "admin-0123456789abcdef\n", 0o644, "chmod 600"),
            ("short", "tiny\n", 0o600, "at least 16 bytes"),
            ("empty", "# nothing\n\n", 0o600, "holds no token"),
            ("spaced", "admin 0123456789abcdef\n", 0o600, "one word"),
        ];
        for (name, text, mode, expected) in cases {
            let auth = AuthConfig {
                admin: write(dir.path(), name, text, mode),
                worker: None,
                client: None,
            };
            let errors = Tokens::load(Path::new("k.yaml"), &auth).unwrap_err();
            let message = errors[0].to_string();
            assert!(message.contains(expected), "{name}: {message}");
            assert!(!message.contains("0123456789abcdef"), "{name}: {message}");
        }
        let auth = AuthConfig {
            admin: write(dir.path(), "a2", "same-0123456789abcdef\n", 0o600),
            worker: Some(write(dir.path(), "w2", "same-0123456789abcdef\n", 0o600)),
            client: None,
        };
        let errors = Tokens::load(Path::new("k.yaml"), &auth).unwrap_err();
        assert!(
            errors[0]
                .to_string()
                .contains("also in the admin token file"),
            "{}",
            errors[0]
        );
    }
}
