//! The hint-policy registry: every hint type the router knows, where it came
//! from, and how to construct it.
//!
//! Built-ins and plugins take the same path (rule R12): a linked-in crate hands
//! over its root module directly, a `.so` hands over the one the loader read, and
//! [`Registry::add_module`] calls the module's registration function across the
//! ABI either way. So a policy behaves the same linked in or loaded, and the
//! static-vs-dynamic benchmark compares only how the code got into the process.

use kvhint_plugin_api::abi::{
    FfiErrorKind, FfiHintHost, FfiHintPolicyBox, FfiHintProviderBox, PluginModRef,
};
use kvhint_plugin_api::policy::Commitments;
use kvhint_plugin_api::registry::{valid_name, HintHost};
use std::collections::HashMap;
use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;

/// Where a hint type was registered from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// Linked into the kvhint binary.
    BuiltIn { crate_name: String },
    /// Loaded from a `.so`.
    Plugin {
        path: PathBuf,
        name: String,
        version: String,
    },
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::BuiltIn { crate_name } => write!(f, "built-in {crate_name}"),
            Origin::Plugin {
                path,
                name,
                version,
            } => write!(f, "plugin {name} {version} ({})", path.display()),
        }
    }
}

#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum RegistryError {
    #[error("hint policy type {name:?} is registered twice: by {first} and by {second}; {fix}")]
    Duplicate {
        name: String,
        first: String,
        second: String,
        fix: &'static str,
    },
    #[error(
        "{origin}: its registration function failed: {message}; fix the plugin and rebuild it"
    )]
    RegistrationFailed { origin: String, message: String },
    #[error("{origin} registers an invalid hint policy type {name:?}; use 1-64 characters from a-z, A-Z, 0-9, '_', '-', '.'")]
    InvalidName { origin: String, name: String },
    #[error("unknown hint policy type {name:?}; known types: {known}; put the plugin that provides it in the plugins directory, or fix the spelling")]
    UnknownType { name: String, known: String },
    #[error("bad parameters for hint policy {name:?} ({origin}): {message}")]
    BadParameters {
        name: String,
        origin: String,
        message: String,
    },
    #[error("hint policy {name:?} ({origin}) failed to construct: {message}")]
    ConstructFailed {
        name: String,
        origin: String,
        message: String,
    },
}

/// A registered hint-policy type.
pub struct HintType {
    pub name: String,
    pub origin: Arc<Origin>,
    pub default_hosts: Vec<HintHost>,
    provider: FfiHintProviderBox,
}

impl fmt::Debug for HintType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HintType")
            .field("name", &self.name)
            .field("origin", &self.origin)
            .field("default_hosts", &self.default_hosts)
            .finish()
    }
}

/// A policy built from a type and its parameters, ready to be called.
pub struct ConstructedPolicy {
    pub type_name: String,
    pub origin: Arc<Origin>,
    pub commitments: Commitments,
    pub policy: FfiHintPolicyBox,
}

/// All known hint types, in registration order (which default resolution uses).
#[derive(Debug, Default)]
pub struct Registry {
    types: Vec<HintType>,
    index: HashMap<String, usize>,
}

impl Registry {
    pub fn new() -> Self {
        Self::default()
    }

    /// A registry holding the built-in hint policies (`kv_fetch`).
    pub fn with_builtins() -> Result<Self, Vec<RegistryError>> {
        let mut registry = Self::new();
        registry.add_module(
            Origin::BuiltIn {
                crate_name: "kv-fetch".into(),
            },
            kv_fetch::kvhint_plugin_module(),
        )?;
        Ok(registry)
    }

    /// Runs a module's registration function and adds what it registered. All or
    /// nothing: a module with any refused registration adds none, so a refused
    /// plugin leaves the registry exactly as it was.
    pub fn add_module(
        &mut self,
        origin: Origin,
        module: PluginModRef,
    ) -> Result<usize, Vec<RegistryError>> {
        let origin = Arc::new(origin);
        let registrations = match (module.register())() {
            abi_stable::std_types::RResult::ROk(list) => list,
            abi_stable::std_types::RResult::RErr(e) => {
                return Err(vec![RegistryError::RegistrationFailed {
                    origin: origin.to_string(),
                    message: e.message.into_string(),
                }])
            }
        };
        let mut errors = Vec::new();
        let mut incoming: Vec<HintType> = Vec::new();
        for registration in registrations {
            let name = registration.name.into_string();
            if !valid_name(&name) {
                errors.push(RegistryError::InvalidName {
                    origin: origin.to_string(),
                    name,
                });
                continue;
            }
            let clash = self
                .index
                .get(&name)
                .map(|&i| self.types[i].origin.to_string())
                .or_else(|| {
                    incoming
                        .iter()
                        .any(|t| t.name == name)
                        .then(|| origin.to_string())
                });
            if let Some(first) = clash {
                let fix = if first.starts_with("built-in") {
                    "built-in policies cannot be removed, so remove this plugin file (or rename the type in it)"
                } else {
                    "remove one of the two plugin files (or rename the type in one of them)"
                };
                errors.push(RegistryError::Duplicate {
                    name,
                    first,
                    second: origin.to_string(),
                    fix,
                });
                continue;
            }
            incoming.push(HintType {
                name,
                origin: Arc::clone(&origin),
                default_hosts: registration
                    .default_hosts
                    .into_iter()
                    .map(|host| match host {
                        FfiHintHost::AnyWorkerSelection => HintHost::AnyWorkerSelection,
                        FfiHintHost::WorkerSelection(name) => {
                            HintHost::WorkerSelection(name.into_string())
                        }
                    })
                    .collect(),
                provider: registration.provider,
            });
        }
        if !errors.is_empty() {
            return Err(errors);
        }
        let added = incoming.len();
        for hint_type in incoming {
            self.index.insert(hint_type.name.clone(), self.types.len());
            self.types.push(hint_type);
        }
        Ok(added)
    }

    pub fn get(&self, name: &str) -> Option<&HintType> {
        self.index.get(name).map(|&i| &self.types[i])
    }

    /// Every type, in registration order.
    pub fn types(&self) -> impl Iterator<Item = &HintType> {
        self.types.iter()
    }

    /// The known type names, for "unknown type" messages.
    pub fn known_names(&self) -> String {
        let mut names: Vec<&str> = self.types.iter().map(|t| t.name.as_str()).collect();
        names.sort_unstable();
        if names.is_empty() {
            "(none)".to_string()
        } else {
            names.join(", ")
        }
    }

    /// The types that run by default under `selection_policy` (rule R3): first
    /// those registered for that selection policy, then those registered for any
    /// selection policy; within each group, in registration order (built-ins,
    /// then plugin files by file name, then each plugin's own order).
    pub fn defaults_for(&self, selection_policy: &str) -> Vec<&HintType> {
        let specific = self.types.iter().filter(|t| {
            t.default_hosts
                .iter()
                .any(|h| matches!(h, HintHost::WorkerSelection(s) if s == selection_policy))
        });
        let any = self.types.iter().filter(|t| {
            t.default_hosts.contains(&HintHost::AnyWorkerSelection)
                && !t
                    .default_hosts
                    .iter()
                    .any(|h| matches!(h, HintHost::WorkerSelection(s) if s == selection_policy))
        });
        specific.chain(any).collect()
    }

    /// Constructs a policy of type `name` from its parameters (a JSON object).
    pub fn construct(
        &self,
        name: &str,
        parameters: &serde_json::Value,
    ) -> Result<ConstructedPolicy, RegistryError> {
        let hint_type = self.get(name).ok_or_else(|| RegistryError::UnknownType {
            name: name.to_string(),
            known: self.known_names(),
        })?;
        let text = parameters.to_string();
        match hint_type
            .provider
            .construct(abi_stable::std_types::RStr::from_str(&text))
        {
            abi_stable::std_types::RResult::ROk(constructed) => Ok(ConstructedPolicy {
                type_name: hint_type.name.clone(),
                origin: Arc::clone(&hint_type.origin),
                commitments: Commitments::from_bits(constructed.commitments),
                policy: constructed.policy,
            }),
            abi_stable::std_types::RResult::RErr(e) => {
                let message = e.message.into_string();
                Err(match e.kind {
                    FfiErrorKind::BadParameters => RegistryError::BadParameters {
                        name: name.to_string(),
                        origin: hint_type.origin.to_string(),
                        message,
                    },
                    FfiErrorKind::Failed | FfiErrorKind::Panicked | FfiErrorKind::Malformed => {
                        RegistryError::ConstructFailed {
                            name: name.to_string(),
                            origin: hint_type.origin.to_string(),
                            message,
                        }
                    }
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn builtin_kv_fetch_is_registered_as_a_kvcr_default() {
        let registry = Registry::with_builtins().unwrap();
        let names: Vec<_> = registry
            .defaults_for("kvcr")
            .iter()
            .map(|t| t.name.as_str())
            .collect();
        assert_eq!(names, ["kv_fetch"]);
        assert!(registry.defaults_for("dynamo-default-cost-fn").is_empty());
    }

    #[test]
    fn construct_reports_commitments_and_bad_parameters() {
        let registry = Registry::with_builtins().unwrap();
        let policy = registry.construct("kv_fetch", &json!({})).unwrap();
        assert_eq!(policy.commitments, Commitments::KV_COPY);
        let err = registry
            .construct("kv_fetch", &json!({"min_additional_block": 2}))
            .err()
            .unwrap();
        let text = err.to_string();
        assert!(text.contains("min_additional_block"), "{text}");
        assert!(text.contains("built-in kv-fetch"), "{text}");
        assert!(matches!(err, RegistryError::BadParameters { .. }));
    }

    #[test]
    fn unknown_type_lists_known_ones() {
        let registry = Registry::with_builtins().unwrap();
        let err = registry.construct("kv_fecth", &json!({})).err().unwrap();
        assert!(err.to_string().contains("known types: kv_fetch"), "{err}");
    }

    #[test]
    fn same_module_twice_is_a_duplicate_naming_both_origins() {
        let mut registry = Registry::with_builtins().unwrap();
        let errors = registry
            .add_module(
                Origin::BuiltIn {
                    crate_name: "again".into(),
                },
                kv_fetch::kvhint_plugin_module(),
            )
            .unwrap_err();
        let text = errors[0].to_string();
        assert!(
            text.contains("built-in kv-fetch") && text.contains("built-in again"),
            "{text}"
        );
        assert_eq!(registry.types().count(), 1, "a refused module adds nothing");
    }
}
