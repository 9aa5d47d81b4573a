//! The config file: plugin sources, router settings, and `worker_selection` in
//! the shape README's "Configuration" gives (a role's policy as a bare name or
//! `{type, parameters?, hints?}`).
//!
//! Decoding is strict — an unknown key anywhere is an error — and collects every
//! error with its file, YAML path, line and column. This module checks shape
//! only; what needs the plugins (hint types, parameters, the R3–R5 rules) is
//! checked when a snapshot is built from the config (see `snapshot`), and
//! reported against the locations kept here.
//!
//! This file is the walker of the top-level sections; the typed config it fills
//! in is `model`, and each larger section has its own walker (`auth`, `gateway`,
//! `kv_events`, `endpoint_picker`); `yaml` holds what they share, and `fleet` what
//! a `workers:` entry and a `kv_events.sources` entry share.

pub mod auth;
pub mod disaggregation;
mod endpoint_picker;
mod fleet;
mod gateway;
mod kv_events;
mod replication;
mod types;
pub(crate) mod yaml;

pub use crate::domain::{Role, RouterMode};
pub use auth::AuthConfig;
pub use endpoint_picker::EndpointPickerConfig;
pub use gateway::{
    ConfiguredWorker, ContentFormat, ContentFormatOption, GatewayConfig, HealthConfig, ModelConfig,
    TlsCa, TracingConfig,
};
pub use kv_events::{ConfiguredSource, KvEventsConfig, DEFAULT_MAX_SOURCES};
use marked_yaml::{LoaderOptions, Node};
pub use replication::{NatsAuth, ReplicationConfig};
use std::path::{Path, PathBuf};
pub use types::*;
use yaml::{join, key_location, location, node_location, Walker};

/// Reads and parses a config file.
pub fn load(file: &Path) -> Result<Config, ConfigErrors> {
    match load_lenient(file) {
        (Some(config), errors) if errors.is_empty() => Ok(config),
        (_, errors) => Err(ConfigErrors(errors)),
    }
}

/// Reads and parses as much of a config file as it can (see [`parse_lenient`]).
pub fn load_lenient(file: &Path) -> (Option<Config>, Vec<ConfigError>) {
    match read_config(file) {
        Ok(text) => parse_lenient(file, &text),
        Err(message) => (None, vec![ConfigError::new(file, None, message)]),
    }
}

/// The largest config file read. A config is a few kilobytes; the cap bounds
/// what a wrong `--config` path can make start-up or a reload read.
pub const MAX_CONFIG_BYTES: u64 = 4 << 20;

/// Reads the config file, which must be a regular file. It is opened without
/// blocking (`O_NONBLOCK`) and checked on the open descriptor before anything is
/// read: a FIFO would otherwise block `check`, start-up and, under the reload
/// lock, every later reload, until something wrote to it. For a regular file
/// `O_NONBLOCK` changes nothing, so no read here ever waits on another process.
fn read_config(file: &Path) -> Result<String, String> {
    use std::io::Read;
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    let what_to_do = "point --config at a regular YAML file";
    let handle = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(file)
        .map_err(|e| format!("cannot open the config file: {e}; {what_to_do}"))?;
    let metadata = handle
        .metadata()
        .map_err(|e| format!("cannot read the config file: {e}; {what_to_do}"))?;
    let kind = metadata.file_type();
    if !kind.is_file() {
        let is = if kind.is_fifo() {
            "a FIFO (named pipe)"
        } else if kind.is_dir() {
            "a directory"
        } else if kind.is_socket() {
            "a socket"
        } else if kind.is_char_device() || kind.is_block_device() {
            "a device"
        } else {
            "not a regular file"
        };
        return Err(format!(
            "the config file is {is}, not a regular file; kvhint reads its config only from a regular file (a pipe or a device could block start-up and every reload): {what_to_do}, e.g. write the YAML to a file and pass that"
        ));
    }
    if metadata.len() > MAX_CONFIG_BYTES {
        return Err(format!(
            "the config file is {} bytes, more than the {MAX_CONFIG_BYTES} a config may have; {what_to_do}",
            metadata.len()
        ));
    }
    let mut bytes = Vec::new();
    handle
        .take(MAX_CONFIG_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read the config file: {e}; {what_to_do}"))?;
    if bytes.len() as u64 > MAX_CONFIG_BYTES {
        return Err(format!(
            "the config file grew past the {MAX_CONFIG_BYTES} bytes a config may have while it was read; {what_to_do}"
        ));
    }
    String::from_utf8(bytes).map_err(|e| {
        let at = e.utf8_error().valid_up_to();
        let line = 1 + e.as_bytes()[..at].iter().filter(|&&b| b == b'\n').count();
        format!(
            "the config file is not UTF-8 text (an invalid byte on line {line}); save it as UTF-8"
        )
    })
}

/// Parses config text; `file` is for messages and for resolving relative paths.
pub fn parse(file: &Path, text: &str) -> Result<Config, ConfigErrors> {
    let (config, errors) = parse_lenient(file, text);
    match config {
        Some(config) if errors.is_empty() => Ok(config),
        _ => Err(ConfigErrors(errors)),
    }
}

/// Parses as much as it can: the config (with broken parts left out) and every
/// error. `kvhint check` uses this to go on and report plugin and rule errors too.
pub fn parse_lenient(file: &Path, text: &str) -> (Option<Config>, Vec<ConfigError>) {
    // `prevent_coercion` marks only quoted scalars as not coercible, so `"1"`
    // stays a string and a plain `1` is a number.
    let options = LoaderOptions::default()
        .error_on_duplicate_keys(true)
        .prevent_coercion(true);
    let text = yaml::strip_bom(text);
    // One pass over the text: where its lines are, for every error's position,
    // and any character YAML forbids. yaml-rust takes a NUL for the end of the
    // input, so one in a comment would drop every key after it (an `auth:`
    // section among them) without a word: such a text is refused whole.
    let index = yaml::TextIndex::new(text);
    if index.forbidden_count > 0 {
        return (None, forbidden_characters(file, &index));
    }
    let root = match marked_yaml::parse_yaml_with_options(0, text, options) {
        Ok(root) => root,
        Err(e) => return (None, vec![yaml_error(file, text, &index, &e)]),
    };
    let mut walker = Walker::new(file);
    // marked-yaml reads only the first document: anything after it is refused,
    // not ignored.
    match yaml::trailing(text, &index) {
        None => {}
        Some(yaml::Trailing::Document(line, column)) => walker.errors.push(ConfigError::new(
            file,
            Some(Location { path: String::new(), line, column }),
            "a second YAML document starts here (after a `---` or `...` line); a config is one document: remove that line and merge what follows into the document above, or delete what follows",
        )),
        Some(yaml::Trailing::Invalid(line, column, why)) => walker.errors.push(ConfigError::new(
            file,
            Some(Location { path: String::new(), line, column }),
            format!("invalid YAML after the first document: {why}; a config is one document: delete what follows it"),
        )),
    }
    let base = file.parent().unwrap_or(Path::new("."));
    let mut config = Config {
        file: file.to_path_buf(),
        plugins: PluginsConfig::default(),
        router: RouterConfig::default(),
        kv_events: KvEventsConfig::default(),
        auth: None,
        worker_selection: Vec::new(),
        default_selection: false,
        models: Vec::new(),
        workers: Vec::new(),
        gateway: GatewayConfig::default(),
        replication: None,
        endpoint_picker: None,
    };
    if let Some(map) = walker.mapping(&root, "") {
        walker.known_keys(
            map,
            "",
            &[
                "plugins",
                "router",
                "kv_events",
                "auth",
                "worker_selection",
                "models",
                "workers",
                "gateway",
                "replication",
                "endpoint_picker",
            ],
        );
        if let Some(node) = map.get_node("models") {
            config.models = gateway::models(&mut walker, node, base);
        }
        if let Some(node) = map.get_node("workers") {
            config.workers = gateway::workers(&mut walker, node, base);
        }
        if let Some(node) = map.get_node("gateway") {
            config.gateway = gateway::gateway(&mut walker, node, base);
        }
        if let Some(node) = map.get_node("workers") {
            if config.workers.len() as u64 > config.gateway.max_workers {
                walker.error(
                    yaml::node_location("workers", node),
                    format!(
                        "{} workers, more than gateway.max_workers ({}); raise it, or list fewer",
                        config.workers.len(),
                        config.gateway.max_workers
                    ),
                );
            }
        }
        if let Some(node) = map.get_node("endpoint_picker") {
            config.endpoint_picker = endpoint_picker::endpoint_picker(&mut walker, node);
        }
        if let Some(node) = map.get_node("plugins") {
            config.plugins = plugins(&mut walker, node, base);
        }
        if let Some(node) = map.get_node("router") {
            config.router = router(&mut walker, node);
        }
        if let Some(node) = map.get_node("kv_events") {
            config.kv_events = kv_events::kv_events(&mut walker, node);
        }
        if let Some(node) = map.get_node("replication") {
            config.replication = replication::replication(&mut walker, node, base);
        }
        if let Some(node) = map.get_node("auth") {
            config.auth = auth::auth(&mut walker, node, base);
        }
        config.worker_selection = match map.get_node("worker_selection") {
            Some(node) => worker_selection(&mut walker, node),
            None => {
                config.default_selection = true;
                default_roles(node_location("worker_selection", &root))
            }
        };
        disaggregation::check(
            &mut walker,
            &config.models,
            &config.workers,
            &config.worker_selection,
            config.default_selection,
        );
    }
    let mut errors = ConfigErrors(walker.errors);
    for at in errors.0.iter_mut().filter_map(|e| e.at.as_mut()) {
        if at.line > 0 {
            (at.line, at.column) = index.within(at.line, at.column);
        }
    }
    errors.sort_in_file_order();
    (Some(config), errors.0)
}

/// One error for each character YAML forbids (the first few of them), at its line
/// and column.
fn forbidden_characters(file: &Path, index: &yaml::TextIndex) -> Vec<ConfigError> {
    let mut errors: Vec<ConfigError> = index
        .forbidden
        .iter()
        .map(|&(line, column, c)| {
            ConfigError::new(
                file,
                Some(Location { path: String::new(), line, column }),
                format!(
                    "the control character {} is not allowed in YAML, not even in a comment or a quoted string, and nothing after it would be read; delete it (in a double-quoted string, write it as the escape `\\u{:04X}`)",
                    yaml::describe(c),
                    c as u32
                ),
            )
        })
        .collect();
    let unreported = index.forbidden_count - index.forbidden.len();
    if unreported > 0 {
        errors.push(ConfigError::new(
            file,
            None,
            format!("and {unreported} more control characters YAML does not allow; delete them all (`grep -naP '[\\x00-\\x08\\x0b\\x0c\\x0e-\\x1f\\x7f]' FILE` shows the lines)"),
        ));
    }
    errors
}

fn yaml_error(
    file: &Path,
    text: &str,
    index: &yaml::TextIndex,
    error: &marked_yaml::LoadError,
) -> ConfigError {
    use marked_yaml::LoadError as E;
    let (marker, message) = match error {
        E::TopLevelMustBeMapping(m) => (Some(*m), "the file must be a YAML mapping".to_string()),
        E::DuplicateKey(inner) => {
            let start = inner.key.span().start().copied();
            let previous = inner
                .prev_key
                .span()
                .start()
                .map(|m| format!(" (first at line {}, column {})", m.line(), m.column()))
                .unwrap_or_default();
            (
                start,
                format!("duplicate key `{}`{previous}", inner.key.as_str()),
            )
        }
        // The position is the message's prefix; yaml-rust's own rendering of it
        // would repeat it (and count past the end of the text).
        E::ScanError(m, e) => {
            // An unclosed `[` or `{` is noticed only where the text ends; say where
            // it was opened, which is where the fix goes.
            let opened = yaml::unclosed_flow(text)
                .filter(|_| e.info().contains("flow"))
                .map(|(line, column, bracket)| {
                    let (kind, close) = if bracket == '[' {
                        ("sequence", ']')
                    } else {
                        ("mapping", '}')
                    };
                    format!(
                        "; the flow {kind} opened by the `{bracket}` at line {line}, column {column} is never closed: add its `{close}` (or write the items as a block list, one `- item` a line)"
                    )
                })
                .unwrap_or_default();
            (Some(*m), format!("invalid YAML: {}{opened}", e.info()))
        }
        E::TopLevelMustBeSequence(m) => (Some(*m), "the file must be a YAML mapping".to_string()),
        E::UnexpectedAnchor(m) => (
            Some(*m),
            "YAML anchors and aliases (`&name`, `*name`) are not supported in a config; write the value out in full".to_string(),
        ),
        E::UnexpectedTag(m) => (
            Some(*m),
            "YAML tags (`!name`, `!!type`) are not supported in a config; remove the tag (quote a value to make it a string)".to_string(),
        ),
        E::MappingKeyMustBeScalar(m) => (
            Some(*m),
            "a mapping key must be a plain value, not a list or mapping; write the key as text".to_string(),
        ),
    };
    ConfigError::new(
        file,
        marker.map(|m| {
            let (line, column) = index.within(m.line(), m.column());
            Location {
                path: String::new(),
                line,
                column,
            }
        }),
        message,
    )
}

fn resolve(base: &Path, path: &str) -> PathBuf {
    let path = Path::new(path);
    if path.is_absolute() {
        path.to_path_buf()
    } else {
        base.join(path)
    }
}

fn is_sha256(text: &str) -> bool {
    text.len() == 64 && text.bytes().all(|b| b.is_ascii_hexdigit())
}

fn plugins(walker: &mut Walker, node: &Node, base: &Path) -> PluginsConfig {
    let mut out = PluginsConfig::default();
    let Some(map) = walker.mapping(node, "plugins") else {
        return out;
    };
    walker.known_keys(
        map,
        "plugins",
        &[
            "directory",
            "files",
            "sha256",
            "cache_dir",
            "max_libraries",
            "max_file_bytes",
            "probe_timeout_ms",
        ],
    );
    if let Some(node) = map.get_node("directory") {
        if let Some(dir) = walker.string(node, "plugins.directory") {
            out.directory = Some(resolve(base, &dir));
            out.directory_at = Some(location("plugins.directory", node.span()));
        }
    }
    if let Some(node) = map.get_node("files") {
        match node {
            Node::Sequence(items) => {
                for (i, item) in items.iter().enumerate() {
                    let path = format!("plugins.files[{i}]");
                    match item {
                        Node::Scalar(_) => {
                            if let Some(file) = walker.string(item, &path) {
                                out.files.push(PluginFile {
                                    path: resolve(base, &file),
                                    sha256: None,
                                });
                            }
                        }
                        _ => {
                            let Some(entry) = walker.mapping(item, &path) else {
                                continue;
                            };
                            walker.known_keys(entry, &path, &["path", "sha256"]);
                            let file = match entry.get_node("path") {
                                Some(node) => walker.string(node, &join(&path, "path")),
                                None => {
                                    walker.error(
                                        node_location(&path, item),
                                        "a plugin file needs `path`",
                                    );
                                    None
                                }
                            };
                            let sha = entry.get_node("sha256").and_then(|node| {
                                let sha_path = join(&path, "sha256");
                                let sha = walker.string(node, &sha_path)?;
                                if is_sha256(&sha) {
                                    Some(sha.to_ascii_lowercase())
                                } else {
                                    walker.error(
                                        location(&sha_path, node.span()),
                                        "expected 64 hex digits (the output of `sha256sum`)",
                                    );
                                    None
                                }
                            });
                            if let Some(file) = file {
                                out.files.push(PluginFile {
                                    path: resolve(base, &file),
                                    sha256: sha,
                                });
                            }
                        }
                    }
                }
            }
            other => walker.error(
                location("plugins.files", other.span()),
                "`files` must be a list of paths or of {path, sha256} mappings",
            ),
        }
    }
    if let Some(node) = map.get_node("sha256") {
        if let Some(pins) = walker.mapping(node, "plugins.sha256") {
            for (name, value) in pins.iter() {
                let path = format!("plugins.sha256.{}", name.as_str());
                if let Some(sha) = walker.string(value, &path) {
                    if is_sha256(&sha) {
                        out.sha256
                            .insert(name.as_str().to_string(), sha.to_ascii_lowercase());
                    } else {
                        walker.error(
                            location(&path, value.span()),
                            "expected 64 hex digits (the output of `sha256sum`)",
                        );
                    }
                }
            }
        }
    }
    if let Some(node) = map.get_node("cache_dir") {
        if let Some(dir) = walker.string(node, "plugins.cache_dir") {
            out.cache_dir = Some(resolve(base, &dir));
        }
    }
    if let Some(node) = map.get_node("max_libraries") {
        if let Some(n) = walker.unsigned(node, "plugins.max_libraries", 1, 1 << 16) {
            out.max_libraries = n as usize;
        }
    }
    if let Some(node) = map.get_node("max_file_bytes") {
        // At least an ELF header; at most 64 GiB.
        if let Some(n) = walker.unsigned(node, "plugins.max_file_bytes", 64, 64 << 30) {
            out.max_file_bytes = n;
        }
    }
    if let Some(node) = map.get_node("probe_timeout_ms") {
        if let Some(n) = walker.unsigned(node, "plugins.probe_timeout_ms", 1, 600_000) {
            out.probe_timeout_ms = n;
        }
    }
    if out.directory.is_none() && !out.sha256.is_empty() {
        // Pins by file name apply to the directory's files; without one they pin nothing.
        walker.error(
            location("plugins.sha256", map.span()),
            "sha256 pins by file name apply to `plugins.directory`, which is not set; pin explicit files with `files: [{path, sha256}]`",
        );
    }
    out
}

/// A duration in whole seconds: a number (seconds) or a number with a unit
/// (`90s`, `10m`, `2h`); at most `max` seconds.
fn duration_s(walker: &mut Walker, node: &Node, path: &str, max: u64) -> Option<u64> {
    let expected = "a duration: whole seconds (`600`) or a number with a unit (`90s`, `10m`, `2h`); 0 turns it off";
    let Node::Scalar(scalar) = node else {
        walker.error(node_location(path, node), format!("expected {expected}"));
        return None;
    };
    let text = scalar.as_str().trim();
    let (digits, unit) = match text.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => text.split_at(i),
        None => (text, "s"),
    };
    let scale = match unit.trim() {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        _ => 0,
    };
    match digits
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(scale))
    {
        Some(seconds) if scale > 0 && seconds <= max => Some(seconds),
        Some(_) if scale > 0 => {
            walker.error(
                location(path, scalar.span()),
                format!("`{text}` is longer than the most this accepts, {max} seconds"),
            );
            None
        }
        _ => {
            walker.error(
                location(path, scalar.span()),
                format!("expected {expected}, found `{text}`"),
            );
            None
        }
    }
}

fn router(walker: &mut Walker, node: &Node) -> RouterConfig {
    let mut out = RouterConfig::default();
    let Some(map) = walker.mapping(node, "router") else {
        return out;
    };
    walker.known_keys(
        map,
        "router",
        &[
            "mode",
            "block_size",
            "quarantine_after_panics",
            "policy_budget_us",
            "quarantine_after_overruns",
            "seed",
            "max_prompt_tokens",
            "max_request_id_bytes",
            "max_open_bookings",
            "booking_ttl",
        ],
    );
    if let Some(node) = map.get_node("mode") {
        if let Some(mode) = walker.one_of(
            node,
            "router.mode",
            "router mode",
            RouterMode::NAMES,
            RouterMode::parse,
        ) {
            out.mode = mode;
        }
    }
    if let Some(node) = map.get_node("block_size") {
        if let Some(n) = walker.unsigned(node, "router.block_size", 1, 1 << 20) {
            out.block_size = n as usize;
        }
    }
    if let Some(node) = map.get_node("policy_budget_us") {
        if let Some(n) = walker.unsigned(node, "router.policy_budget_us", 0, 60_000_000) {
            out.policy_budget_us = n;
        }
    }
    if let Some(node) = map.get_node("quarantine_after_overruns") {
        if let Some(n) = walker.unsigned(node, "router.quarantine_after_overruns", 1, u64::MAX) {
            out.quarantine_after_overruns = n;
        }
    }
    if let Some(node) = map.get_node("quarantine_after_panics") {
        if let Some(n) = walker.unsigned(node, "router.quarantine_after_panics", 1, u64::MAX) {
            out.quarantine_after_panics = n;
        }
    }
    if let Some(node) = map.get_node("max_prompt_tokens") {
        if let Some(n) = walker.unsigned(node, "router.max_prompt_tokens", 1, 1 << 24) {
            out.limits.max_prompt_tokens = n as usize;
        }
    }
    if let Some(node) = map.get_node("max_request_id_bytes") {
        if let Some(n) = walker.unsigned(node, "router.max_request_id_bytes", 1, 1 << 16) {
            out.limits.max_request_id_bytes = n as usize;
        }
    }
    if let Some(node) = map.get_node("max_open_bookings") {
        if let Some(n) = walker.unsigned(node, "router.max_open_bookings", 1, 1 << 26) {
            out.limits.max_open_bookings = n as usize;
        }
    }
    if let Some(node) = map.get_node("booking_ttl") {
        if let Some(seconds) = duration_s(walker, node, "router.booking_ttl", 365 * 24 * 3600) {
            out.booking_ttl_s = seconds;
        }
    }
    if let Some(node) = map.get_node("seed") {
        if let Some(n) = walker.unsigned(node, "router.seed", 0, u64::MAX) {
            out.seed = n;
        }
    }
    out
}

fn parameters(
    walker: &mut Walker,
    map: &marked_yaml::types::MarkedMappingNode,
    path: &str,
) -> Parameters {
    let params_path = join(path, "parameters");
    let node = map.get_node("parameters");
    let at = node
        .map(|_| key_location(&params_path, map, "parameters"))
        .unwrap_or_else(|| node_location(path, &Node::Mapping(map.clone())));
    let keys = node
        .and_then(|n| n.as_mapping())
        .map(|m| {
            m.keys()
                .map(|k| {
                    (
                        k.as_str().to_string(),
                        location(&join(&params_path, k.as_str()), k.span()),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    Parameters {
        value: walker.parameters(node, &params_path),
        at,
        keys,
    }
}

/// The selection policy every role gets when the config has no
/// `worker_selection`: the one the routing-quality bench measured best on every
/// workload (`BENCHMARKS.md`), with its default parameters and hints.
pub const DEFAULT_SELECTION: &str = "cache-aware";

/// Every role, booked by [`DEFAULT_SELECTION`] (a config without
/// `worker_selection`); `at`: where the section would be.
fn default_roles(at: Location) -> Vec<RoleConfig> {
    Role::ALL
        .iter()
        .map(|&role| RoleConfig {
            role,
            at: at.clone(),
            selection: SelectionConfig {
                type_name: DEFAULT_SELECTION.to_string(),
                type_at: at.clone(),
                parameters: Parameters {
                    value: serde_json::Value::Object(Default::default()),
                    at: at.clone(),
                    keys: Vec::new(),
                },
            },
            hints: None,
            hints_at: None,
        })
        .collect()
}

fn worker_selection(walker: &mut Walker, node: &Node) -> Vec<RoleConfig> {
    let mut roles = Vec::new();
    let Some(map) = walker.mapping(node, "worker_selection") else {
        return roles;
    };
    if map.is_empty() {
        walker.error(
            location("worker_selection", map.span()),
            "`worker_selection` is empty: configure at least one role (aggregated, prefill or decode)",
        );
    }
    for (key, value) in map.iter() {
        let path = join("worker_selection", key.as_str());
        let Some(role) = Role::parse(key.as_str()) else {
            walker.error(
                location(&path, key.span()),
                format!(
                    "unknown role `{}`; expected one of: {}",
                    key.as_str(),
                    Role::NAMES.join(", ")
                ),
            );
            continue;
        };
        if let Some(config) = role_config(walker, role, value, &path) {
            roles.push(config);
        }
    }
    roles
}

fn role_config(walker: &mut Walker, role: Role, node: &Node, path: &str) -> Option<RoleConfig> {
    let at = node_location(path, node);
    // A bare string is the selection-policy type with no parameters or hints.
    if let Node::Scalar(_) = node {
        let type_name = walker.string(node, path)?;
        return Some(RoleConfig {
            role,
            at: at.clone(),
            selection: SelectionConfig {
                type_name,
                type_at: at.clone(),
                parameters: Parameters {
                    value: serde_json::Value::Object(Default::default()),
                    at,
                    keys: Vec::new(),
                },
            },
            hints: None,
            hints_at: None,
        });
    }
    let map = walker.mapping(node, path)?;
    walker.known_keys(map, path, &["type", "parameters", "hints"]);
    let errors_before = walker.errors.len();
    let type_name = match map.get_node("type") {
        Some(node) => walker.string(node, &join(path, "type")),
        None => {
            walker.error(
                at.clone(),
                "a role needs `type`: the selection policy (e.g. `dynamo-default-cost-fn` or `kvcr`)",
            );
            None
        }
    };
    let type_at = map
        .get_node("type")
        .map(|n| location(&join(path, "type"), n.span()))
        .unwrap_or_else(|| at.clone());
    let parameters = parameters(walker, map, path);
    let hints_path = join(path, "hints");
    let hints_at = map
        .get_node("hints")
        .map(|_| key_location(&hints_path, map, "hints"));
    let hints = map
        .get_node("hints")
        .map(|node| hint_items(walker, node, &hints_path));
    if walker.errors.len() > errors_before {
        return None;
    }
    Some(RoleConfig {
        role,
        at,
        selection: SelectionConfig {
            type_name: type_name?,
            type_at,
            parameters,
        },
        hints,
        hints_at,
    })
}

fn hint_items(walker: &mut Walker, node: &Node, path: &str) -> Vec<HintItem> {
    let Node::Sequence(items) = node else {
        walker.error(
            location(path, node.span()),
            "`hints` must be a list of {type, name?, parameters?} items (or [] for none)",
        );
        return Vec::new();
    };
    let mut out: Vec<HintItem> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let item_path = format!("{path}[{i}]");
        let Some(map) = walker.mapping(item, &item_path) else {
            continue;
        };
        walker.known_keys(map, &item_path, &["type", "name", "parameters"]);
        let at = node_location(&item_path, item);
        let type_name = match map.get_node("type") {
            Some(node) => walker.string(node, &join(&item_path, "type")),
            None => {
                walker.error(at.clone(), "a hint needs `type`: the hint policy to run");
                None
            }
        };
        let name = map.get_node("name").and_then(|node| {
            let name_path = join(&item_path, "name");
            let name = walker.string(node, &name_path)?;
            if kvhint_plugin_api::registry::valid_name(&name) {
                Some(name)
            } else {
                walker.error(
                    location(&name_path, node.span()),
                    format!("hint name {name:?} is invalid: use 1-64 characters from a-z, A-Z, 0-9, '_', '-', '.'"),
                );
                None
            }
        });
        let parameters = parameters(walker, map, &item_path);
        let Some(type_name) = type_name else { continue };
        let name_given = name.is_some();
        let name = name.unwrap_or_else(|| type_name.clone());
        if let Some(first) = out.iter().find(|h| h.name == name) {
            let message = if !name_given && !first.name_given {
                format!(
                    "this role lists hint type `{type_name}` twice ({} and here); give each a distinct `name`",
                    first.at.path
                )
            } else {
                format!(
                    "duplicate hint name `{name}` in this role (first at {}); names must be unique within a role",
                    first.at.path
                )
            };
            walker.error(at, message);
            continue;
        }
        out.push(HintItem {
            type_name,
            name,
            name_given,
            at,
            parameters,
        });
    }
    out
}
