//! The config file: plugin sources, router settings, and `worker_selection`
//! exactly as the spec writes it, so the spec's YAML pastes in unchanged.
//!
//! Decoding is strict — an unknown key anywhere is an error — and collects every
//! error with its file, YAML path, line and column. This module checks shape
//! only; what needs the plugins (hint types, parameters, the R3–R5 rules) is
//! checked when a snapshot is built from the config (see `snapshot`), and
//! reported against the locations kept here.

mod kv_events;
mod yaml;

pub use kv_events::{ConfiguredSource, KvEventsConfig};
use marked_yaml::{LoaderOptions, Node};
use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use yaml::{join, key_location, location, node_location, Walker};

/// A plugin file to load, with an optional sha256 pin.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginFile {
    pub path: PathBuf,
    pub sha256: Option<String>,
}

/// A position in the config: the YAML path and where it starts (1-based; 0 if
/// unknown).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Location {
    pub path: String,
    pub line: usize,
    pub column: usize,
}

/// One thing wrong with the config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub file: PathBuf,
    pub at: Option<Location>,
    pub message: String,
}

impl ConfigError {
    pub fn new(file: &Path, at: Option<Location>, message: impl Into<String>) -> Self {
        Self {
            file: file.to_path_buf(),
            at,
            message: message.into(),
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.at {
            Some(at) if at.line > 0 && at.path.is_empty() => write!(
                f,
                "{}:{}:{}: {}",
                self.file.display(),
                at.line,
                at.column,
                self.message
            ),
            Some(at) if at.line > 0 => write!(
                f,
                "{}:{}:{}: {}: {}",
                self.file.display(),
                at.line,
                at.column,
                at.path,
                self.message
            ),
            Some(at) if !at.path.is_empty() => {
                write!(f, "{}: {}: {}", self.file.display(), at.path, self.message)
            }
            _ => write!(f, "{}: {}", self.file.display(), self.message),
        }
    }
}

impl std::error::Error for ConfigError {}

/// Every error found, in file order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, error) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{error}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

pub use crate::domain::{Role, RouterMode};

/// A `parameters` mapping with where it and each of its keys are.
#[derive(Debug, Clone, PartialEq)]
pub struct Parameters {
    pub value: serde_json::Value,
    pub at: Location,
    keys: Vec<(String, Location)>,
}

impl Parameters {
    /// Where to point an error about these parameters: at the key an "unknown
    /// field `x`" or "invalid value … for `x`" message names, else at the mapping.
    pub fn locate(&self, message: &str) -> Location {
        // serde names the culprit first ("unknown field `a`, expected `b` or
        // `c`"), so the key mentioned earliest is the one to point at.
        self.keys
            .iter()
            .filter_map(|(key, at)| message.find(&format!("`{key}`")).map(|i| (i, at)))
            .min_by_key(|(i, _)| *i)
            .map(|(_, at)| at.clone())
            .unwrap_or_else(|| self.at.clone())
    }
}

/// `worker_selection.<role>` with its type and parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct SelectionConfig {
    pub type_name: String,
    pub type_at: Location,
    pub parameters: Parameters,
}

/// One item of a role's `hints`.
#[derive(Debug, Clone, PartialEq)]
pub struct HintItem {
    pub type_name: String,
    /// `name`, or the type when the item has none.
    pub name: String,
    pub name_given: bool,
    pub at: Location,
    pub parameters: Parameters,
}

/// One role of `worker_selection`.
#[derive(Debug, Clone, PartialEq)]
pub struct RoleConfig {
    pub role: Role,
    pub at: Location,
    pub selection: SelectionConfig,
    /// `None` when the role has no `hints` key (defaults apply, rule R3);
    /// `Some(vec![])` for `hints: []` (none run).
    pub hints: Option<Vec<HintItem>>,
    pub hints_at: Option<Location>,
}

/// `plugins:`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginsConfig {
    /// Every `lib*.so` in it is loaded (resolved against the config's directory).
    pub directory: Option<PathBuf>,
    pub directory_at: Option<Location>,
    /// Explicit files, each with an optional sha256 pin.
    pub files: Vec<PluginFile>,
    /// sha256 pins for files in `directory`, by file name.
    pub sha256: BTreeMap<String, String>,
    pub cache_dir: Option<PathBuf>,
    pub max_libraries: usize,
    /// Plugin files larger than this are refused from their size, unread.
    pub max_file_bytes: u64,
    /// How long the probe process may take to open a library.
    pub probe_timeout_ms: u64,
}

impl Default for PluginsConfig {
    fn default() -> Self {
        Self {
            directory: None,
            directory_at: None,
            files: Vec::new(),
            sha256: BTreeMap::new(),
            cache_dir: None,
            max_libraries: 64,
            max_file_bytes: 256 << 20,
            probe_timeout_ms: 10_000,
        }
    }
}

impl PluginsConfig {
    /// The pin for a file found in the directory, if any.
    pub fn pin_for(&self, path: &Path) -> Option<String> {
        let name = path.file_name()?.to_str()?;
        self.sha256.get(name).cloned()
    }
}

/// `router:`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouterConfig {
    pub mode: RouterMode,
    pub block_size: usize,
    pub quarantine_after_panics: u64,
    /// Seed of the `random` selection policy, for reproducible replays.
    pub seed: u64,
    /// Longest prompt a booking accepts, in tokens: bounds the memory one
    /// request can make the KV-index lookup use.
    pub max_prompt_tokens: usize,
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            mode: RouterMode::Kv,
            block_size: 16,
            quarantine_after_panics: 3,
            seed: 0,
            max_prompt_tokens: 262_144,
        }
    }
}

/// A parsed config file.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub file: PathBuf,
    pub plugins: PluginsConfig,
    pub router: RouterConfig,
    pub kv_events: KvEventsConfig,
    pub worker_selection: Vec<RoleConfig>,
}

impl Config {
    pub fn role(&self, role: Role) -> Option<&RoleConfig> {
        self.worker_selection.iter().find(|r| r.role == role)
    }
}

/// Reads and parses a config file.
pub fn load(file: &Path) -> Result<Config, ConfigErrors> {
    match load_lenient(file) {
        (Some(config), errors) if errors.is_empty() => Ok(config),
        (_, errors) => Err(ConfigErrors(errors)),
    }
}

/// Reads and parses as much of a config file as it can (see [`parse_lenient`]).
pub fn load_lenient(file: &Path) -> (Option<Config>, Vec<ConfigError>) {
    match std::fs::read_to_string(file) {
        Ok(text) => parse_lenient(file, &text),
        Err(e) => (
            None,
            vec![ConfigError::new(
                file,
                None,
                format!("cannot read the config file: {e}"),
            )],
        ),
    }
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
    let root = match marked_yaml::parse_yaml_with_options(0, text, options) {
        Ok(root) => root,
        Err(e) => return (None, vec![yaml_error(file, &e)]),
    };
    let mut walker = Walker::new(file);
    let base = file.parent().unwrap_or(Path::new("."));
    let mut config = Config {
        file: file.to_path_buf(),
        plugins: PluginsConfig::default(),
        router: RouterConfig::default(),
        kv_events: KvEventsConfig::default(),
        worker_selection: Vec::new(),
    };
    if let Some(map) = walker.mapping(&root, "") {
        walker.known_keys(
            map,
            "",
            &["plugins", "router", "kv_events", "worker_selection"],
        );
        if let Some(node) = map.get_node("plugins") {
            config.plugins = plugins(&mut walker, node, base);
        }
        if let Some(node) = map.get_node("router") {
            config.router = router(&mut walker, node);
        }
        if let Some(node) = map.get_node("kv_events") {
            config.kv_events = kv_events::kv_events(&mut walker, node);
        }
        match map.get_node("worker_selection") {
            Some(node) => config.worker_selection = worker_selection(&mut walker, node),
            None => walker.error(
                node_location("worker_selection", &root),
                "`worker_selection` is missing: configure at least one role (aggregated, prefill or decode)",
            ),
        }
    }
    (Some(config), walker.errors)
}

fn yaml_error(file: &Path, error: &marked_yaml::LoadError) -> ConfigError {
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
        E::ScanError(m, e) => (Some(*m), format!("invalid YAML: {e}")),
        other => (None, format!("invalid YAML: {other}")),
    };
    ConfigError::new(
        file,
        marker.map(|m| Location {
            path: String::new(),
            line: m.line(),
            column: m.column(),
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
            "seed",
            "max_prompt_tokens",
        ],
    );
    if let Some(node) = map.get_node("mode") {
        if let Some(mode) = walker.string(node, "router.mode") {
            match RouterMode::parse(&mode) {
                Some(mode) => out.mode = mode,
                None => walker.error(
                    location("router.mode", node.span()),
                    format!(
                        "unknown router mode `{mode}`; expected one of: {}",
                        RouterMode::NAMES.join(", ")
                    ),
                ),
            }
        }
    }
    if let Some(node) = map.get_node("block_size") {
        if let Some(n) = walker.unsigned(node, "router.block_size", 1, 1 << 20) {
            out.block_size = n as usize;
        }
    }
    if let Some(node) = map.get_node("quarantine_after_panics") {
        if let Some(n) = walker.unsigned(node, "router.quarantine_after_panics", 1, u64::MAX) {
            out.quarantine_after_panics = n;
        }
    }
    if let Some(node) = map.get_node("max_prompt_tokens") {
        if let Some(n) = walker.unsigned(node, "router.max_prompt_tokens", 1, 1 << 24) {
            out.max_prompt_tokens = n as usize;
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
