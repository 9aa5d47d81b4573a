//! The policy registry: every hint- and selection-policy type the router
//! knows, where it came from, and how to construct it.
//!
//! Built-ins and plugins take the same path (rule R12): a linked-in crate hands
//! over its root module directly, a `.so` hands over the one the loader read, and
//! [`Registry::add_module`] calls the module's registration function across the
//! ABI either way. So a policy behaves the same linked in or loaded, and the
//! static-vs-dynamic benchmark compares only how the code got into the process.
//!
//! Hint and selection types share one namespace, so a name means one thing in
//! a config and an error can say "`kv_fetch` is a hint policy" when a role puts
//! it where a selection policy belongs.

use kvhint_plugin_api::abi::{
    error_code, host_kind, policy_kind, selection_flags, FfiError, FfiHintPolicyBox,
    FfiHintProviderBox, FfiRouterSettings, FfiSelectionPolicyBox, FfiSelectionProviderBox,
    PluginModRef,
};
use kvhint_plugin_api::policy::Commitments;
use kvhint_plugin_api::registry::{valid_name, HintHost};
use std::collections::HashMap;
use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;

/// What a plugin's error code means to the router. An unknown code (a newer
/// plugin-api's) is read as a plain failure, never as undefined behaviour.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    Failed,
    BadParameters,
    Panicked,
    Malformed,
}

impl ErrorKind {
    pub fn of(error: &FfiError) -> Self {
        match error.code {
            error_code::BAD_PARAMETERS => Self::BadParameters,
            error_code::PANICKED => Self::Panicked,
            error_code::MALFORMED => Self::Malformed,
            _ => Self::Failed,
        }
    }
}

/// Which kind of policy a type is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyKind {
    Hint,
    Selection,
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Hint => "hint policy",
            Self::Selection => "selection policy",
        })
    }
}

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
    #[error("{kind} type {name:?} is registered twice: by {first} and by {second}; {fix}")]
    Duplicate {
        kind: PolicyKind,
        name: String,
        first: String,
        second: String,
        fix: &'static str,
    },
    #[error(
        "{origin}: its registration function failed: {message}; fix the plugin and rebuild it"
    )]
    RegistrationFailed { origin: String, message: String },
    #[error("{origin} registers an invalid policy type {name:?}; use 1-64 characters from a-z, A-Z, 0-9, '_', '-', '.'")]
    InvalidName { origin: String, name: String },
    #[error("{origin} registers {name:?} as a policy of kind {kind}, which this router does not know (it knows hint and selection policies); upgrade the router, or rebuild the plugin against this router's kvhint-plugin-api")]
    UnknownKind {
        origin: String,
        name: String,
        kind: u32,
    },
    #[error("unknown {kind} type {name:?}; known types: {known}; put the plugin that provides it in the plugins directory, or fix the spelling")]
    UnknownType {
        kind: PolicyKind,
        name: String,
        known: String,
    },
    #[error("{name:?} ({origin}) is a {found}, not a {wanted}; known {wanted} types: {known}")]
    WrongKind {
        name: String,
        origin: String,
        found: PolicyKind,
        wanted: PolicyKind,
        known: String,
    },
    #[error("bad parameters for {kind} {name:?} ({origin}): {message}")]
    BadParameters {
        kind: PolicyKind,
        name: String,
        origin: String,
        message: String,
    },
    #[error("{kind} {name:?} ({origin}) failed to construct: {message}")]
    ConstructFailed {
        kind: PolicyKind,
        name: String,
        origin: String,
        message: String,
    },
}

/// What a registered type builds.
enum Provider {
    Hint {
        provider: FfiHintProviderBox,
        default_hosts: Vec<HintHost>,
    },
    Selection(FfiSelectionProviderBox),
}

/// A registered policy type.
pub struct PolicyType {
    pub name: String,
    pub origin: Arc<Origin>,
    provider: Provider,
}

impl fmt::Debug for PolicyType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PolicyType")
            .field("name", &self.name)
            .field("kind", &self.kind())
            .field("origin", &self.origin)
            .field("default_hosts", &self.default_hosts())
            .finish()
    }
}

impl PolicyType {
    pub fn kind(&self) -> PolicyKind {
        match self.provider {
            Provider::Hint { .. } => PolicyKind::Hint,
            Provider::Selection(_) => PolicyKind::Selection,
        }
    }

    /// Where a hint type runs by default (none for a selection type).
    pub fn default_hosts(&self) -> &[HintHost] {
        match &self.provider {
            Provider::Hint { default_hosts, .. } => default_hosts,
            Provider::Selection(_) => &[],
        }
    }
}

/// A hint policy built from a type and its parameters, ready to be called.
pub struct ConstructedPolicy {
    pub type_name: String,
    pub origin: Arc<Origin>,
    pub commitments: Commitments,
    pub policy: FfiHintPolicyBox,
}

/// A selection policy built from a type and its parameters.
pub struct ConstructedSelection {
    pub type_name: String,
    pub origin: Arc<Origin>,
    /// [`selection_flags`] as it declared them.
    pub flags: u32,
    pub policy: FfiSelectionPolicyBox,
}

impl ConstructedSelection {
    pub fn kv_aware(&self) -> bool {
        self.flags & selection_flags::KV_AWARE != 0
    }
    pub fn commits_kv_copies(&self) -> bool {
        self.flags & selection_flags::COMMITS_KV_COPIES != 0
    }
    pub fn wants_peer_copies(&self) -> bool {
        self.flags & selection_flags::WANTS_PEER_COPIES != 0
    }
}

/// All known types, in registration order (which default resolution uses).
#[derive(Debug, Default)]
pub struct Registry {
    types: Vec<PolicyType>,
    index: HashMap<String, usize>,
}

impl Registry {
    pub fn new() -> Self {
        Self::default()
    }

    /// A registry holding the built-in policies: the selection policies
    /// (`dynamo-default-cost-fn`, `kvcr`, `round-robin`, `random`) and the hint
    /// policy `kv_fetch`, each from its own linked-in plugin crate.
    pub fn with_builtins() -> Result<Self, Vec<RegistryError>> {
        let mut registry = Self::new();
        registry.add_module(
            Origin::BuiltIn {
                crate_name: "kvhint-selection".into(),
            },
            kvhint_selection::kvhint_plugin_module(),
        )?;
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
        let mut incoming: Vec<PolicyType> = Vec::new();
        for registration in registrations {
            let name = registration.name.into_string();
            if !valid_name(&name) {
                errors.push(RegistryError::InvalidName {
                    origin: origin.to_string(),
                    name,
                });
                continue;
            }
            let provider = match (
                registration.kind,
                registration.hint_provider.into_option(),
                registration.selection_provider.into_option(),
            ) {
                (policy_kind::HINT, Some(provider), _) => Provider::Hint {
                    provider,
                    default_hosts: registration
                        .default_hosts
                        .into_iter()
                        .map(|host| match host.kind {
                            host_kind::ANY_WORKER_SELECTION => HintHost::AnyWorkerSelection,
                            // WORKER_SELECTION, and any kind this router does not
                            // know: only under the named selection policy, never
                            // anywhere the plugin did not name.
                            _ => HintHost::WorkerSelection(host.selection.into_string()),
                        })
                        .collect(),
                },
                (policy_kind::SELECTION, _, Some(provider)) => Provider::Selection(provider),
                (kind, _, _) => {
                    errors.push(RegistryError::UnknownKind {
                        origin: origin.to_string(),
                        name,
                        kind,
                    });
                    continue;
                }
            };
            let kind = match provider {
                Provider::Hint { .. } => PolicyKind::Hint,
                Provider::Selection(_) => PolicyKind::Selection,
            };
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
                    kind,
                    name,
                    first,
                    second: origin.to_string(),
                    fix,
                });
                continue;
            }
            incoming.push(PolicyType {
                name,
                origin: Arc::clone(&origin),
                provider,
            });
        }
        if !errors.is_empty() {
            return Err(errors);
        }
        let added = incoming.len();
        for policy_type in incoming {
            self.index
                .insert(policy_type.name.clone(), self.types.len());
            self.types.push(policy_type);
        }
        Ok(added)
    }

    pub fn get(&self, name: &str) -> Option<&PolicyType> {
        self.index.get(name).map(|&i| &self.types[i])
    }

    /// Every type, in registration order.
    pub fn types(&self) -> impl Iterator<Item = &PolicyType> {
        self.types.iter()
    }

    /// The hint types, in registration order.
    pub fn hint_types(&self) -> impl Iterator<Item = &PolicyType> {
        self.types.iter().filter(|t| t.kind() == PolicyKind::Hint)
    }

    /// The known names of one kind, sorted, for "unknown type" messages.
    pub fn known_names(&self, kind: PolicyKind) -> String {
        let mut names: Vec<&str> = self
            .types
            .iter()
            .filter(|t| t.kind() == kind)
            .map(|t| t.name.as_str())
            .collect();
        names.sort_unstable();
        if names.is_empty() {
            "(none)".to_string()
        } else {
            names.join(", ")
        }
    }

    /// The hint types that run by default under `selection_policy` (rule R3):
    /// first those registered for that selection policy, then those registered
    /// for any selection policy; within each group, in registration order
    /// (built-ins, then plugin files by file name, then each plugin's own order).
    pub fn defaults_for(&self, selection_policy: &str) -> Vec<&PolicyType> {
        let names = |t: &PolicyType| {
            t.default_hosts()
                .iter()
                .any(|h| matches!(h, HintHost::WorkerSelection(s) if s == selection_policy))
        };
        let specific = self.hint_types().filter(|t| names(t));
        let any = self
            .hint_types()
            .filter(|t| t.default_hosts().contains(&HintHost::AnyWorkerSelection) && !names(t));
        specific.chain(any).collect()
    }

    fn find(&self, name: &str, wanted: PolicyKind) -> Result<&PolicyType, RegistryError> {
        self.get(name).ok_or_else(|| RegistryError::UnknownType {
            kind: wanted,
            name: name.to_string(),
            known: self.known_names(wanted),
        })
    }

    fn wrong_kind(&self, policy_type: &PolicyType, wanted: PolicyKind) -> RegistryError {
        RegistryError::WrongKind {
            name: policy_type.name.clone(),
            origin: policy_type.origin.to_string(),
            found: policy_type.kind(),
            wanted,
            known: self.known_names(wanted),
        }
    }

    fn construct_error(policy_type: &PolicyType, error: FfiError) -> RegistryError {
        let message = error.message.into_string();
        let (kind, name, origin) = (
            policy_type.kind(),
            policy_type.name.clone(),
            policy_type.origin.to_string(),
        );
        match ErrorKind::of(&FfiError {
            code: error.code,
            message: Default::default(),
        }) {
            ErrorKind::BadParameters => RegistryError::BadParameters {
                kind,
                name,
                origin,
                message,
            },
            _ => RegistryError::ConstructFailed {
                kind,
                name,
                origin,
                message,
            },
        }
    }

    /// Constructs a hint policy of type `name` from its parameters (a JSON object).
    pub fn construct(
        &self,
        name: &str,
        parameters: &serde_json::Value,
    ) -> Result<ConstructedPolicy, RegistryError> {
        self.construct_with(name, parameters, &FfiRouterSettings::default())
    }

    /// [`Self::construct`] with the router's settings.
    pub fn construct_with(
        &self,
        name: &str,
        parameters: &serde_json::Value,
        settings: &FfiRouterSettings,
    ) -> Result<ConstructedPolicy, RegistryError> {
        let policy_type = self.find(name, PolicyKind::Hint)?;
        let Provider::Hint { provider, .. } = &policy_type.provider else {
            return Err(self.wrong_kind(policy_type, PolicyKind::Hint));
        };
        let text = parameters.to_string();
        match provider.construct(abi_stable::std_types::RStr::from_str(&text), settings) {
            abi_stable::std_types::RResult::ROk(constructed) => Ok(ConstructedPolicy {
                type_name: policy_type.name.clone(),
                origin: Arc::clone(&policy_type.origin),
                commitments: Commitments::from_bits(constructed.commitments),
                policy: constructed.policy,
            }),
            abi_stable::std_types::RResult::RErr(e) => Err(Self::construct_error(policy_type, e)),
        }
    }

    /// Constructs a selection policy of type `name` from its parameters.
    pub fn construct_selection(
        &self,
        name: &str,
        parameters: &serde_json::Value,
        settings: &FfiRouterSettings,
    ) -> Result<ConstructedSelection, RegistryError> {
        let policy_type = self.find(name, PolicyKind::Selection)?;
        let Provider::Selection(provider) = &policy_type.provider else {
            return Err(self.wrong_kind(policy_type, PolicyKind::Selection));
        };
        let text = parameters.to_string();
        match provider.construct(abi_stable::std_types::RStr::from_str(&text), settings) {
            abi_stable::std_types::RResult::ROk(constructed) => Ok(ConstructedSelection {
                type_name: policy_type.name.clone(),
                origin: Arc::clone(&policy_type.origin),
                flags: constructed.flags,
                policy: constructed.policy,
            }),
            abi_stable::std_types::RResult::RErr(e) => Err(Self::construct_error(policy_type, e)),
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
        let mut selection: Vec<_> = registry
            .types()
            .filter(|t| t.kind() == PolicyKind::Selection)
            .map(|t| t.name.as_str())
            .collect();
        selection.sort_unstable();
        assert_eq!(
            selection,
            [
                "cache-aware",
                "dynamo-default-cost-fn",
                "kvcr",
                "random",
                "round-robin"
            ]
        );
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
        let err = registry.construct("kvcr", &json!({})).err().unwrap();
        assert!(
            err.to_string()
                .contains("is a selection policy, not a hint policy"),
            "{err}"
        );
        let err = registry
            .construct_selection("kv_fetch", &json!({}), &FfiRouterSettings::default())
            .err()
            .unwrap();
        assert!(
            err.to_string()
                .contains("is a hint policy, not a selection policy"),
            "{err}"
        );
    }

    mod coded {
        //! A module registering by hand with codes this router does not know.
        use abi_stable::std_types::{ROption, RResult, RVec};
        use kvhint_plugin_api::abi::{FfiError, FfiHintHost, FfiLogSink, FfiRegistration};

        pub extern "C" fn register() -> RResult<RVec<FfiRegistration>, FfiError> {
            // kv_fetch's own provider, re-registered under other names and codes.
            let RResult::ROk(mut theirs) = (kv_fetch::kvhint_plugin_module().register())() else {
                return RResult::RErr(FfiError {
                    code: 1,
                    message: "kv_fetch did not register".into(),
                });
            };
            let Some(kv_fetch) = theirs.pop() else {
                return RResult::ROk(RVec::new());
            };
            let mut list = RVec::new();
            list.push(FfiRegistration {
                kind: kvhint_plugin_api::abi::policy_kind::HINT,
                name: "future_host_kind".into(),
                default_hosts: vec![FfiHintHost {
                    kind: 77,
                    selection: "kvcr".into(),
                }]
                .into(),
                hint_provider: kv_fetch.hint_provider,
                selection_provider: ROption::RNone,
            });
            RResult::ROk(list)
        }

        pub extern "C" fn unknown_kind() -> RResult<RVec<FfiRegistration>, FfiError> {
            let mut list = RVec::new();
            list.push(FfiRegistration {
                kind: 9,
                name: "future_kind".into(),
                default_hosts: RVec::new(),
                hint_provider: ROption::RNone,
                selection_provider: ROption::RNone,
            });
            RResult::ROk(list)
        }

        pub extern "C" fn no_sink(_: FfiLogSink) {}
    }

    #[test]
    fn unknown_codes_map_to_known_kinds() {
        // An error code from a newer plugin-api is a plain failure.
        let future = FfiError {
            code: 1234,
            message: "?".into(),
        };
        assert_eq!(ErrorKind::of(&future), ErrorKind::Failed);
        // A host kind from a newer plugin-api runs only under the named
        // selection policy, never under every one.
        let mut registry = Registry::new();
        let module = kvhint_plugin_api::export::root_module(
            "coded",
            "0.1.0",
            true,
            coded::register,
            coded::no_sink,
        );
        registry
            .add_module(
                Origin::BuiltIn {
                    crate_name: "coded".into(),
                },
                module,
            )
            .unwrap();
        let found = registry.get("future_host_kind").unwrap();
        assert_eq!(
            found.default_hosts(),
            [HintHost::WorkerSelection("kvcr".into())]
        );
        assert_eq!(registry.defaults_for("kvcr").len(), 1);
        assert!(registry.defaults_for("dynamo-default-cost-fn").is_empty());
        // A registration of a kind this router does not know is refused, named.
        let module = kvhint_plugin_api::export::root_module(
            "future",
            "0.1.0",
            true,
            coded::unknown_kind,
            coded::no_sink,
        );
        let errors = Registry::new()
            .add_module(
                Origin::BuiltIn {
                    crate_name: "future".into(),
                },
                module,
            )
            .unwrap_err();
        let text = errors[0].to_string();
        assert!(
            text.contains("\"future_kind\"") && text.contains("kind 9"),
            "{text}"
        );
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
        assert_eq!(
            registry.hint_types().count(),
            1,
            "a refused module adds nothing"
        );
    }
}
