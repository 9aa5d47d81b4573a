//! Registration: a plugin's entry point fills a [`HintRegistry`] with named
//! providers, each of which turns a role's `parameters` into a policy: hint
//! policies with [`HintRegistry::register_hint_policy`], selection policies
//! with [`HintRegistry::register_selection_policy`].

use crate::policy::{HintError, HintPolicy};
use crate::selection::SelectionPolicy;
use serde::de::DeserializeOwned;
use std::fmt;
use std::sync::Arc;

/// Turns a role's `parameters` into a policy. Usually a closure:
/// `Arc::new(|parameters| { ... })`.
pub type HintPolicyProvider =
    dyn Fn(&Parameters) -> Result<HintPolicyConstructor, HintError> + Send + Sync;

/// A constructed policy, as a provider hands it to the router.
pub struct HintPolicyConstructor {
    pub(crate) policy: Arc<dyn HintPolicy>,
}

impl HintPolicyConstructor {
    /// One instance shared by every booking of every role that configured these
    /// parameters; it is called from many threads at once.
    pub fn shared(policy: impl HintPolicy) -> Self {
        Self {
            policy: Arc::new(policy),
        }
    }

    /// The policy itself, for tests of a provider.
    pub fn policy(&self) -> &dyn HintPolicy {
        &*self.policy
    }
}

/// Turns a role's selection `parameters` into a selection policy.
pub type SelectionPolicyProvider =
    dyn Fn(&Parameters) -> Result<SelectionPolicyConstructor, HintError> + Send + Sync;

/// A constructed selection policy, as a provider hands it to the router.
pub struct SelectionPolicyConstructor {
    pub(crate) policy: Arc<dyn SelectionPolicy>,
}

impl SelectionPolicyConstructor {
    /// One instance shared by every booking of the role; it is called from
    /// many threads at once.
    pub fn shared(policy: impl SelectionPolicy) -> Self {
        Self {
            policy: Arc::new(policy),
        }
    }

    /// The policy itself, for tests of a provider.
    pub fn policy(&self) -> &dyn SelectionPolicy {
        &*self.policy
    }
}

/// What the router tells a provider besides the parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RouterSettings {
    /// Tokens per KV block (`router.block_size`).
    pub block_size: usize,
    /// `router.seed`: seed any random choice with it, so a replay books alike.
    pub seed: u64,
}

/// Where a hint policy runs when a role does not list `hints`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum HintHost {
    /// Under every selection policy.
    AnyWorkerSelection,
    /// Under the named selection-policy type.
    WorkerSelection(String),
}

impl HintHost {
    pub fn worker_selection(name: impl Into<String>) -> Self {
        Self::WorkerSelection(name.into())
    }
}

impl fmt::Display for HintHost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::AnyWorkerSelection => f.write_str("any worker selection"),
            Self::WorkerSelection(name) => f.write_str(name),
        }
    }
}

/// A policy's `parameters` mapping (`{}` when the YAML has none), and the
/// router's settings.
#[derive(Debug, Clone, PartialEq)]
pub struct Parameters {
    value: serde_json::Value,
    router: RouterSettings,
}

impl Default for Parameters {
    fn default() -> Self {
        Self {
            value: serde_json::Value::Object(Default::default()),
            router: RouterSettings::default(),
        }
    }
}

impl Parameters {
    /// Parameters from a JSON object. Anything but an object is refused, as the
    /// config requires `parameters` to be a mapping.
    pub fn from_value(value: serde_json::Value) -> Result<Self, HintError> {
        if value.is_object() {
            Ok(Self {
                value,
                router: RouterSettings::default(),
            })
        } else {
            Err(HintError::bad_parameters(format!(
                "parameters must be a mapping, found {value}"
            )))
        }
    }

    /// Parameters from JSON text (how they cross the plugin boundary).
    pub fn from_json(text: &str) -> Result<Self, HintError> {
        let value = serde_json::from_str(text).map_err(|e| {
            HintError::bad_parameters(format!("parameters are not valid JSON: {e}"))
        })?;
        Self::from_value(value)
    }

    /// With the router's settings (the host sets them).
    #[doc(hidden)]
    pub fn with_router(mut self, router: RouterSettings) -> Self {
        self.router = router;
        self
    }

    /// The router's settings: block size and seed.
    pub fn router(&self) -> RouterSettings {
        self.router
    }

    /// Deserializes into the policy's own configuration type. Use
    /// `#[serde(deny_unknown_fields)]` on it so typos are reported.
    ///
    /// On failure the error lists every problem in the mapping, one per line,
    /// each naming its key (`` `min_blocks`: invalid type: string "x", expected
    /// usize ``), so the router can point at each in the YAML.
    pub fn deserialize<T: DeserializeOwned>(&self) -> Result<T, HintError> {
        let mut value = self.value.clone();
        let mut problems: Vec<String> = Vec::new();
        let mut removed: Vec<String> = Vec::new();
        // At most one retry per key: each round removes the key at fault.
        let rounds = value.as_object().map_or(0, |m| m.len()) + 1;
        for _ in 0..rounds {
            let error = match serde_path_to_error::deserialize::<_, T>(&value) {
                Ok(parsed) if problems.is_empty() => return Ok(parsed),
                Ok(_) => break,
                Err(error) => error,
            };
            let message = error.inner().to_string();
            let key = fault_key(&error.path().to_string(), &message);
            // An unknown field names the fields there are: every other key the
            // mapping has is unknown too. All of them are reported and removed
            // in this one round, so a mapping of many unknown keys costs one
            // pass, not one deserialization per key.
            if let (Some(first), Some(tail), Some(map)) = (
                key.as_deref(),
                unknown_field_tail(&message),
                value.as_object_mut(),
            ) {
                let known = expected_fields(tail);
                let unknown: Vec<String> = map
                    .keys()
                    .filter(|k| k.as_str() == first || !known.contains(&k.as_str()))
                    .cloned()
                    .collect();
                for k in unknown {
                    problems.push(format!("unknown field `{k}`{tail}"));
                    map.remove(&k);
                    removed.push(k);
                }
                continue;
            }
            // A key this loop removed is not missing: its own error is listed.
            let missing_removed = removed
                .iter()
                .any(|k| message.starts_with(&format!("missing field `{k}`")));
            if !missing_removed {
                problems.push(match &key {
                    Some(key) if !message.contains(&format!("`{key}`")) => {
                        format!("`{key}`: {message}")
                    }
                    _ => message,
                });
            }
            match key {
                Some(key) if !removed.contains(&key) => {
                    if let Some(map) = value.as_object_mut() {
                        map.remove(&key);
                    }
                    removed.push(key);
                }
                _ => break,
            }
        }
        Err(HintError::bad_parameters(problems.join("\n")))
    }

    pub fn get(&self, key: &str) -> Option<&serde_json::Value> {
        self.value.get(key)
    }

    pub fn as_json(&self) -> &serde_json::Value {
        &self.value
    }
}

/// What follows the field's name in serde's "unknown field `x`, expected …"
/// (from the comma on), if `message` is that error.
fn unknown_field_tail(message: &str) -> Option<&str> {
    let rest = message.strip_prefix("unknown field `")?;
    let close = rest.find('`')?;
    Some(&rest[close + 1..])
}

/// The field names serde lists after "expected" (each in backquotes); none
/// for "there are no fields".
fn expected_fields(tail: &str) -> Vec<&str> {
    tail.split('`').skip(1).step_by(2).collect()
}

/// The top-level key an error is about: the first segment of its path, or for
/// an unknown field (whose path is the mapping itself) the field it names.
fn fault_key(path: &str, message: &str) -> Option<String> {
    if path != "." && !path.is_empty() {
        let first = path.split(['.', '[']).next().unwrap_or(path);
        if !first.is_empty() {
            return Some(first.to_string());
        }
    }
    let rest = message.strip_prefix("unknown field `")?;
    rest.split('`').next().map(str::to_string)
}

/// A registration the registry refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegistryError {
    InvalidName { name: String },
    Duplicate { name: String },
}

impl fmt::Display for RegistryError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::InvalidName { name } => write!(
                f,
                "policy name {name:?} is invalid: use 1-64 characters from a-z, A-Z, 0-9, '_', '-', '.'"
            ),
            Self::Duplicate { name } => {
                write!(f, "policy {name:?} is registered twice in this plugin")
            }
        }
    }
}

impl std::error::Error for RegistryError {}

pub(crate) enum Provider {
    Hint {
        provider: Arc<HintPolicyProvider>,
        default_hosts: Vec<HintHost>,
    },
    Selection(Arc<SelectionPolicyProvider>),
}

pub(crate) struct Registration {
    pub(crate) name: String,
    pub(crate) provider: Provider,
}

/// What a plugin's registration function fills.
#[derive(Default)]
pub struct HintRegistry {
    pub(crate) entries: Vec<Registration>,
}

impl HintRegistry {
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers a hint-policy type. `default_hosts` lists the selection policies
    /// it runs under when a role does not list `hints`; empty means it runs only
    /// where a role lists it.
    pub fn register_hint_policy(
        &mut self,
        name: &str,
        provider: Arc<HintPolicyProvider>,
        default_hosts: impl IntoIterator<Item = HintHost>,
    ) -> Result<(), RegistryError> {
        self.add(
            name,
            Provider::Hint {
                provider,
                default_hosts: default_hosts.into_iter().collect(),
            },
        )
    }

    /// Registers a selection-policy type: a role names it as
    /// `worker_selection.<role>: <name>` (or `type: <name>` with `parameters`).
    /// Selection and hint types share one namespace per router.
    pub fn register_selection_policy(
        &mut self,
        name: &str,
        provider: Arc<SelectionPolicyProvider>,
    ) -> Result<(), RegistryError> {
        self.add(name, Provider::Selection(provider))
    }

    fn add(&mut self, name: &str, provider: Provider) -> Result<(), RegistryError> {
        if !valid_name(name) {
            return Err(RegistryError::InvalidName {
                name: name.to_string(),
            });
        }
        if self.entries.iter().any(|entry| entry.name == name) {
            return Err(RegistryError::Duplicate {
                name: name.to_string(),
            });
        }
        self.entries.push(Registration {
            name: name.to_string(),
            provider,
        });
        Ok(())
    }

    /// The registered names, in registration order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.iter().map(|entry| entry.name.as_str())
    }
}

/// Whether `name` is a valid policy type (or instance) name: 1–64
/// characters from a-z, A-Z, 0-9, `_`, `-`, `.` (it becomes a metric label).
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
}
