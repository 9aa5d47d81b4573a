//! Registration: a plugin's entry point fills a [`HintRegistry`] with named
//! providers, each of which turns a role's `parameters` into a policy.

use crate::policy::{HintError, HintPolicy};
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

/// A hint item's `parameters` mapping (`{}` when the YAML has none).
#[derive(Debug, Clone, PartialEq)]
pub struct Parameters {
    value: serde_json::Value,
}

impl Default for Parameters {
    fn default() -> Self {
        Self {
            value: serde_json::Value::Object(Default::default()),
        }
    }
}

impl Parameters {
    /// Parameters from a JSON object. Anything but an object is refused, as the
    /// config requires `parameters` to be a mapping.
    pub fn from_value(value: serde_json::Value) -> Result<Self, HintError> {
        if value.is_object() {
            Ok(Self { value })
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

    /// Deserializes into the policy's own configuration type. Use
    /// `#[serde(deny_unknown_fields)]` on it so typos are reported.
    pub fn deserialize<T: DeserializeOwned>(&self) -> Result<T, HintError> {
        T::deserialize(&self.value).map_err(|e| HintError::bad_parameters(e.to_string()))
    }

    pub fn get(&self, key: &str) -> Option<&serde_json::Value> {
        self.value.get(key)
    }

    pub fn as_json(&self) -> &serde_json::Value {
        &self.value
    }
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
                "hint policy name {name:?} is invalid: use 1-64 characters from a-z, A-Z, 0-9, '_', '-', '.'"
            ),
            Self::Duplicate { name } => {
                write!(f, "hint policy {name:?} is registered twice in this plugin")
            }
        }
    }
}

impl std::error::Error for RegistryError {}

pub(crate) struct Registration {
    pub(crate) name: String,
    pub(crate) provider: Arc<HintPolicyProvider>,
    pub(crate) default_hosts: Vec<HintHost>,
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
            default_hosts: default_hosts.into_iter().collect(),
        });
        Ok(())
    }

    /// The registered names, in registration order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.iter().map(|entry| entry.name.as_str())
    }
}

/// Whether `name` is a valid hint-policy type (or instance) name: 1–64
/// characters from a-z, A-Z, 0-9, `_`, `-`, `.` (it becomes a metric label).
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
}
