//! The config as the router uses it: typed, with where each part was written
//! (file, line, column) kept for the errors found later, when a snapshot is built.
//!
//! Apart from the YAML walker (`super`) that fills it in, so a reader looking for
//! what a setting means finds the types here, and one looking for how a mistake
//! is reported finds the walker.

use super::{
    AuthConfig, ConfiguredWorker, EndpointPickerConfig, GatewayConfig, KvEventsConfig, ModelConfig,
    ReplicationConfig, Role, RouterMode,
};
use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

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

impl ConfigErrors {
    /// Sorts the errors in file order: by file, then line, then column. Errors
    /// without a position in the file (a plugin file that cannot be read, say)
    /// come after the located ones of their file, in the order they were found.
    /// Parsing walks the sections in a fixed order and the rule checks run after
    /// it, so the order they are found in is not the file's.
    pub fn sort_in_file_order(&mut self) {
        self.0.sort_by(|a, b| {
            let key = |e: &ConfigError| {
                let (line, column) = match &e.at {
                    Some(at) if at.line > 0 => (at.line, at.column),
                    _ => (usize::MAX, usize::MAX),
                };
                (e.file.clone(), line, column)
            };
            key(a).cmp(&key(b))
        });
    }
}

/// A `parameters` mapping with where it and each of its keys are.
#[derive(Debug, Clone, PartialEq)]
pub struct Parameters {
    pub value: serde_json::Value,
    pub at: Location,
    pub(super) keys: Vec<(String, Location)>,
}

impl Parameters {
    /// Where to point an error about these parameters: at the key an "unknown
    /// field `x`" or "invalid value … for `x`" message names, else at the mapping.
    pub fn locate(&self, message: &str) -> Location {
        self.locator().locate(message)
    }

    /// A [`Locator`] for many messages: the keys indexed once, so locating a
    /// plugin's one-line-per-problem report is linear in it, not in its lines
    /// times the keys (10,000 unknown keys took 11 s when each line scanned
    /// every key).
    pub fn locator(&self) -> Locator<'_> {
        Locator {
            keys: self.keys.iter().map(|(k, at)| (k.as_str(), at)).collect(),
            at: &self.at,
        }
    }
}

/// Points messages at the `parameters` key they name (see [`Parameters::locator`]).
pub struct Locator<'a> {
    keys: std::collections::HashMap<&'a str, &'a Location>,
    at: &'a Location,
}

impl Locator<'_> {
    /// The key `message` names first in backquotes (serde names the culprit
    /// first: "unknown field `a`, expected `b` or `c`"), else the mapping.
    pub fn locate(&self, message: &str) -> Location {
        message
            .split('`')
            .skip(1)
            .step_by(2)
            .find_map(|quoted| self.keys.get(quoted))
            .map_or_else(|| self.at.clone(), |at| (*at).clone())
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
    /// A hint-policy call longer than this many microseconds is over budget (0: none).
    pub policy_budget_us: u64,
    /// Calls in a row over budget after which a policy is quarantined.
    pub quarantine_after_overruns: u64,
    /// Seed of the `random` selection policy, for reproducible replays.
    pub seed: u64,
    /// `max_prompt_tokens`, `max_request_id_bytes`, `max_open_bookings`: what
    /// one booking may ask of the router.
    pub limits: crate::domain::BookingLimits,
    /// Seconds after which a booking never released is released by the router
    /// (0: never), so a client that crashed cannot hold load for good.
    pub booking_ttl_s: u64,
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            mode: RouterMode::Kv,
            block_size: 16,
            quarantine_after_panics: 3,
            policy_budget_us: 10_000,
            quarantine_after_overruns: 20,
            seed: 0,
            limits: crate::domain::BookingLimits::default(),
            booking_ttl_s: 600,
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
    /// `auth:`, if the API asks callers for tokens.
    pub auth: Option<AuthConfig>,
    pub worker_selection: Vec<RoleConfig>,
    /// The config has no `worker_selection`: every role is booked by the
    /// default selection policy.
    pub default_selection: bool,
    /// `models:`: what the gateway serves, with each model's tokenizer.
    pub models: Vec<ModelConfig>,
    /// `workers:`: engines the router registers itself and forwards to.
    pub workers: Vec<ConfiguredWorker>,
    /// `gateway:`: how requests are forwarded.
    pub gateway: GatewayConfig,
    /// `endpoint_picker:`: the ext_proc listener for Envoy, if any.
    pub endpoint_picker: Option<EndpointPickerConfig>,
    /// `replication:`, if this router shares load with other replicas.
    pub replication: Option<ReplicationConfig>,
}

impl Config {
    pub fn role(&self, role: Role) -> Option<&RoleConfig> {
        self.worker_selection.iter().find(|r| r.role == role)
    }
}
