//! An immutable snapshot of everything a reload replaces: the config, the
//! registry with its plugins, and each role's constructed selection and hint
//! policies. A booking loads one snapshot and finishes on it.
//!
//! Building one is where the config meets the plugins, so the rules that need
//! both are enforced here, and every violation is reported against the config
//! location it comes from:
//! - R2: hint types exist, their parameters deserialize (the plugin's own
//!   message, pointed at the offending key), constructors succeed.
//! - R3: a role without `hints` runs the defaults for its selection policy,
//!   then those for any selection policy (see [`Registry::defaults_for`]);
//!   `hints: []` runs none.
//! - R4: hints run only on the KV path. Under `--router-mode round-robin` or
//!   `random`, or under a selection policy that is not KV-aware, a non-empty
//!   `hints` list is an error and defaults do not run.
//! - R5: a role whose selection policy commits KV copies must resolve to exactly
//!   one hint policy that declares `Commitments::KV_COPY`.

use crate::catalog;
use crate::config::auth::Tokens;
use crate::config::{
    Config, ConfigError, ConfigErrors, HintItem, Location, Role, RoleConfig, RouterMode,
};
use crate::domain::BookingLimits;
use crate::hints::{HintLimits, HintPolicyInstance, HintStage, PolicyStatsRegistry};
use crate::loader::Loader;
use crate::registry::{ConstructedPolicy, ConstructedSelection, Registry, RegistryError};
use crate::selection::{SelectionStage, FALLBACK_TYPE};
use kvhint_plugin_api::abi::FfiRouterSettings;
use kvhint_plugin_api::policy::Commitments;
use std::path::PathBuf;
use std::sync::Arc;

/// Where a role's hint policies came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HintsFrom {
    /// The role's `hints` list.
    Listed,
    /// The role has no `hints`: the registered defaults.
    Defaults,
    /// `hints: []`.
    ExplicitlyNone,
    /// Not on the KV path: no hints run.
    NotKvPath,
}

/// One role, ready to book.
pub struct RoleRuntime {
    pub role: Role,
    /// The configured selection-policy type.
    pub selection_type: String,
    pub selection_parameters: serde_json::Value,
    /// What books this role: the configured policy, or the router mode's own
    /// under a non-KV `--router-mode`.
    booking_selection: SelectionStage,
    pub booking_selection_type: String,
    pub commits_kv_copies: bool,
    /// KV router mode and a KV-aware selection policy: the KV index is
    /// consulted and hints may run (rule R4).
    pub on_kv_path: bool,
    pub hints: HintStage,
    pub hints_from: HintsFrom,
    /// What one booking may ask (`router.max_prompt_tokens` and the like).
    pub limits: BookingLimits,
}

impl RoleRuntime {
    /// The policy that books this role.
    pub fn booking_selection(&self) -> &SelectionStage {
        &self.booking_selection
    }
}

/// A plugin file in the snapshot.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct PluginSummary {
    pub path: PathBuf,
    pub sha256: String,
    pub name: String,
    pub version: String,
    pub api_version: String,
    pub hint_types: Vec<String>,
    pub selection_types: Vec<String>,
}

pub struct Snapshot {
    pub generation: u64,
    pub config_file: PathBuf,
    pub mode: RouterMode,
    pub block_size: usize,
    pub limits: BookingLimits,
    /// `router.booking_ttl` in seconds (0: bookings never expire).
    pub booking_ttl_s: u64,
    /// The API's tokens, read from `auth`'s files; `None` without `auth`.
    pub tokens: Option<Arc<Tokens>>,
    pub roles: Vec<RoleRuntime>,
    pub registry: Registry,
    pub plugins: Vec<PluginSummary>,
    /// The models the gateway serves, with their tokenizers (`models:`).
    pub models: Arc<crate::models::Models>,
    /// How the gateway forwards (`gateway:`).
    pub gateway: crate::config::GatewayConfig,
}

impl Snapshot {
    pub fn role(&self, role: Role) -> Option<&RoleRuntime> {
        self.roles.iter().find(|r| r.role == role)
    }

    /// The selection-policy type that books `role` ("" if not configured).
    pub fn selection_type(&self, role: Role) -> &str {
        self.role(role)
            .map(|r| r.booking_selection_type.as_str())
            .unwrap_or("")
    }
}

/// Settings a running router keeps until it restarts: the KV index is keyed
/// by the block size, the watch is on the plugins directory, and the loader's
/// cache, cap, file-size limit and probe timeout are the process's. A reload
/// that changes one is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FixedSettings {
    pub block_size: usize,
    pub plugins_directory: Option<PathBuf>,
    pub cache_dir: Option<PathBuf>,
    pub max_libraries: usize,
    pub max_file_bytes: u64,
    pub probe_timeout_ms: u64,
    /// `kv_events.max_sources`: the connection budget is set from it at start.
    pub max_sources: u64,
}

impl FixedSettings {
    pub fn of(config: &Config) -> Self {
        Self {
            block_size: config.router.block_size,
            plugins_directory: config.plugins.directory.clone(),
            cache_dir: config.plugins.cache_dir.clone(),
            max_libraries: config.plugins.max_libraries,
            max_file_bytes: config.plugins.max_file_bytes,
            probe_timeout_ms: config.plugins.probe_timeout_ms,
            max_sources: config.kv_events.max_sources,
        }
    }
}

pub struct BuildOptions<'a> {
    pub loader: &'a Loader,
    /// `--router-mode`, overriding `router.mode`.
    pub mode: Option<RouterMode>,
    pub generation: u64,
    /// What the running router cannot change, if one runs.
    pub fixed: Option<&'a FixedSettings>,
    /// Counters that outlive this snapshot (a serving router's); `None` gives
    /// each policy counters of its own.
    pub policy_stats: Option<&'a PolicyStatsRegistry>,
    /// Tokenizers loaded for earlier snapshots (a serving router's), reused while
    /// their files are unchanged; `None` loads every one.
    pub tokenizers: Option<&'a crate::models::TokenizerCache>,
}

struct Builder<'a> {
    config: &'a Config,
    errors: Vec<ConfigError>,
}

impl Builder<'_> {
    fn error(&mut self, at: &Location, message: impl Into<String>) {
        self.errors.push(ConfigError::new(
            &self.config.file,
            Some(at.clone()),
            message,
        ));
    }
}

/// Builds and validates a snapshot. Every error found is returned, not just the
/// first; on error nothing is kept (the caller keeps its old snapshot).
pub fn build(config: &Config, options: &BuildOptions<'_>) -> Result<Snapshot, ConfigErrors> {
    let mut builder = Builder {
        config,
        errors: Vec::new(),
    };
    let mode = options.mode.unwrap_or(config.router.mode);
    if let Some(running) = options.fixed {
        let wanted = FixedSettings::of(config);
        let show = |p: &Option<PathBuf>| {
            p.as_deref()
                .map(|p| p.display().to_string())
                .unwrap_or_else(|| "(none)".into())
        };
        let mut refuse = |path: &str, what: String| {
            builder.error(
                &Location {
                    path: path.into(),
                    ..Location::default()
                },
                format!("{what}; changing it needs a restart"),
            )
        };
        if running.block_size != wanted.block_size {
            refuse(
                "router.block_size",
                format!(
                    "the running router's KV index uses block size {}, the config now says {}",
                    running.block_size, wanted.block_size
                ),
            );
        }
        if running.plugins_directory != wanted.plugins_directory {
            refuse(
                "plugins.directory",
                format!(
                    "the running router watches {}, the config now names {}",
                    show(&running.plugins_directory),
                    show(&wanted.plugins_directory)
                ),
            );
        }
        if running.cache_dir != wanted.cache_dir {
            refuse(
                "plugins.cache_dir",
                format!(
                    "the running router's plugin cache is {}, the config now names {}",
                    show(&running.cache_dir),
                    show(&wanted.cache_dir)
                ),
            );
        }
        for (path, running, wanted, unit) in [
            (
                "plugins.max_file_bytes",
                running.max_file_bytes,
                wanted.max_file_bytes,
                "bytes",
            ),
            (
                "plugins.probe_timeout_ms",
                running.probe_timeout_ms,
                wanted.probe_timeout_ms,
                "ms",
            ),
        ] {
            if running != wanted {
                refuse(
                    path,
                    format!(
                        "the running router's loader uses {running} {unit}, the config now says {wanted}"
                    ),
                );
            }
        }
        if running.max_sources != wanted.max_sources {
            refuse(
                "kv_events.max_sources",
                format!(
                    "the running router keeps at most {} KV-event sources (its connection budget leaves their descriptors free), the config now says {}",
                    running.max_sources, wanted.max_sources
                ),
            );
        }
        if running.max_libraries != wanted.max_libraries {
            refuse(
                "plugins.max_libraries",
                format!(
                    "the running router caps mapped libraries at {}, the config now says {}",
                    running.max_libraries, wanted.max_libraries
                ),
            );
        }
    }
    let tokens = match &config.auth {
        Some(auth) => match Tokens::load(&config.file, auth) {
            Ok(tokens) => Some(Arc::new(tokens)),
            Err(errors) => {
                builder.errors.extend(errors);
                None
            }
        },
        None => None,
    };
    let models = match crate::models::Models::load(
        &config.file,
        &config.models,
        options.tokenizers,
        config.gateway.tokenizer_cache_mib << 20,
    ) {
        Ok(models) => models,
        Err(errors) => {
            builder.errors.extend(errors);
            crate::models::Models::default()
        }
    };
    for model in &config.models {
        if !config.worker_selection.iter().any(|r| r.role == model.role) {
            let mut at = model.at.clone();
            at.path = format!("{}.role", at.path);
            builder.error(
                &at,
                format!(
                    "model {} is booked under role {}, which `worker_selection` does not configure: add `worker_selection.{}` or set this model's `role`",
                    model.name, model.role, model.role
                ),
            );
        }
    }
    let (registry, plugins) = load_plugins(&mut builder, options.loader);
    let limits = HintLimits {
        quarantine_after_panics: config.router.quarantine_after_panics,
        budget_ns: config.router.policy_budget_us.saturating_mul(1_000),
        quarantine_after_overruns: config.router.quarantine_after_overruns,
        ..HintLimits::default()
    };
    let settings = FfiRouterSettings {
        block_size: u32::try_from(config.router.block_size).unwrap_or(u32::MAX),
        seed: config.router.seed,
    };
    let context = RoleContext {
        mode,
        registry: &registry,
        limits,
        settings,
        policy_stats: options.policy_stats,
        booking_limits: config.router.limits,
    };
    let mut roles = Vec::new();
    for role in &config.worker_selection {
        if let Some(runtime) = build_role(&mut builder, role, &context) {
            roles.push(runtime);
        }
    }
    if !builder.errors.is_empty() {
        return Err(ConfigErrors(builder.errors));
    }
    Ok(Snapshot {
        generation: options.generation,
        config_file: config.file.clone(),
        mode,
        block_size: config.router.block_size,
        limits: config.router.limits,
        booking_ttl_s: config.router.booking_ttl_s,
        tokens,
        roles,
        registry,
        plugins,
        models: Arc::new(models),
        gateway: config.gateway.clone(),
    })
}

fn load_plugins(builder: &mut Builder<'_>, loader: &Loader) -> (Registry, Vec<PluginSummary>) {
    let config = builder.config;
    let mut registry = match Registry::with_builtins() {
        Ok(registry) => registry,
        Err(errors) => {
            for e in errors {
                builder.error(&Location::default(), format!("built-in hint policies: {e}"));
            }
            Registry::new()
        }
    };
    let directory_at = config
        .plugins
        .directory_at
        .clone()
        .unwrap_or_else(|| Location {
            path: "plugins".into(),
            ..Location::default()
        });
    let files = match catalog::plugin_files(
        config.plugins.directory.as_deref(),
        &config.plugins.files,
        &|path| config.plugins.pin_for(path),
    ) {
        Ok(files) => files,
        Err(e) => {
            builder.error(&directory_at, e.to_string());
            return (registry, Vec::new());
        }
    };
    let mut plugins = Vec::new();
    for report in catalog::load_into(loader, &mut registry, &files) {
        let at = config
            .plugins
            .files
            .iter()
            .position(|f| f.path == report.path)
            .map(|i| Location {
                path: format!("plugins.files[{i}]"),
                ..Location::default()
            })
            .unwrap_or_else(|| directory_at.clone());
        match report.result {
            Ok(loaded) => plugins.push(PluginSummary {
                path: report.path,
                sha256: loaded.plugin.sha256,
                name: loaded.plugin.info.name,
                version: loaded.plugin.info.version,
                api_version: loaded.plugin.info.api_version,
                hint_types: loaded.hint_types,
                selection_types: loaded.selection_types,
            }),
            Err(errors) => {
                for e in errors {
                    builder.error(&at, e);
                }
            }
        }
    }
    (registry, plugins)
}

/// What every role of one snapshot is built with.
struct RoleContext<'a> {
    mode: RouterMode,
    registry: &'a Registry,
    limits: HintLimits,
    settings: FfiRouterSettings,
    policy_stats: Option<&'a PolicyStatsRegistry>,
    booking_limits: BookingLimits,
}

/// One role's runtime: its selection policy, its hint policies, the rule that a
/// copy-committing selection has exactly one sender, and the stage bookings use.
/// Every problem is reported to `builder`; `None` if the role cannot run.
fn build_role(
    builder: &mut Builder<'_>,
    role: &RoleConfig,
    context: &RoleContext<'_>,
) -> Option<RoleRuntime> {
    let selection = role_selection(builder, role, context);
    // A selection policy that could not be built is already reported; judging
    // its hints as if it were KV-aware keeps that the only error about it.
    let selection_kv_aware = selection.as_ref().is_none_or(|s| s.kv_aware());
    let on_kv_path = context.mode.is_kv() && selection_kv_aware;
    let (instances, hints_from) = role_hints(builder, role, context, on_kv_path);
    let selection = selection?;
    let commits_kv_copies = on_kv_path && selection.commits_kv_copies();
    if commits_kv_copies {
        check_one_copy_sender(builder, role, context.registry, &instances);
    }
    let (booking_selection, booking_selection_type) =
        booking_stage(builder, role, context, selection)?;
    Some(RoleRuntime {
        role: role.role,
        selection_type: role.selection.type_name.clone(),
        selection_parameters: role.selection.parameters.value.clone(),
        booking_selection,
        booking_selection_type,
        commits_kv_copies,
        on_kv_path,
        hints: HintStage::new(instances, context.limits),
        hints_from,
        limits: context.booking_limits,
    })
}

/// The role's configured selection policy, built from its parameters.
fn role_selection(
    builder: &mut Builder<'_>,
    role: &RoleConfig,
    context: &RoleContext<'_>,
) -> Option<ConstructedSelection> {
    match context.registry.construct_selection(
        &role.selection.type_name,
        &role.selection.parameters.value,
        &context.settings,
    ) {
        Ok(policy) => Some(policy),
        Err(e @ RegistryError::BadParameters { .. }) => {
            report_parameters(builder, &role.selection.parameters, &e);
            None
        }
        Err(e) => {
            builder.error(&role.selection.type_at, e.to_string());
            None
        }
    }
}

/// The role's hint policies, in order, and where the list came from: the role's
/// own `hints`, the selection policy's defaults, or none off the KV path (where a
/// listed hint is an error).
fn role_hints(
    builder: &mut Builder<'_>,
    role: &RoleConfig,
    context: &RoleContext<'_>,
    on_kv_path: bool,
) -> (Vec<HintPolicyInstance>, HintsFrom) {
    let RoleContext {
        mode,
        registry,
        settings,
        policy_stats,
        ..
    } = *context;
    let selection_type = &role.selection.type_name;
    let (instances, hints_from) = match (&role.hints, on_kv_path) {
        (Some(items), false) if !items.is_empty() => {
            let why = if mode.is_kv() {
                format!("its selection policy `{selection_type}` is not KV-aware")
            } else {
                format!("the router mode is `{mode}`")
            };
            let at = role.hints_at.clone().unwrap_or_else(|| role.at.clone());
            builder.error(
                &at,
                format!(
                    "hints run only on the KV path, but {why}; remove `hints` from role {} (or use --router-mode kv with a KV-aware selection policy)",
                    role.role
                ),
            );
            (Vec::new(), HintsFrom::NotKvPath)
        }
        (_, false) => (Vec::new(), HintsFrom::NotKvPath),
        (Some(items), true) if items.is_empty() => (Vec::new(), HintsFrom::ExplicitlyNone),
        (Some(items), true) => (
            listed_hints(builder, items, registry, &settings),
            HintsFrom::Listed,
        ),
        (None, true) => (
            default_hints(builder, role, registry, &settings),
            HintsFrom::Defaults,
        ),
    };
    let instances = instances
        .into_iter()
        .map(|(name, constructed)| {
            let stats = policy_stats
                .map(|registry| registry.get(role.role.as_str(), &name))
                .unwrap_or_default();
            HintPolicyInstance::with_stats(name, constructed, stats)
        })
        .collect();
    (instances, hints_from)
}

/// A selection policy that commits KV copies needs exactly one hint policy that
/// sends them (declares `Commitments::KV_COPY`). Judged only when every hint
/// policy of the role was built: a missing one is already reported.
fn check_one_copy_sender(
    builder: &mut Builder<'_>,
    role: &RoleConfig,
    registry: &Registry,
    instances: &[HintPolicyInstance],
) {
    let selection_type = &role.selection.type_name;
    let expected = match &role.hints {
        Some(items) => items.len(),
        None => registry.defaults_for(selection_type).len(),
    };
    if instances.len() != expected {
        return;
    }
    let senders: Vec<&str> = instances
        .iter()
        .filter(|p| p.commitments.contains(Commitments::KV_COPY))
        .map(|p| p.name.as_str())
        .collect();
    if senders.len() == 1 {
        return;
    }
    let all: Vec<&str> = instances.iter().map(|p| p.name.as_str()).collect();
    let found = if senders.is_empty() {
        format!(
            "none of its hint policies declares it (resolved: [{}])",
            all.join(", ")
        )
    } else {
        format!("{} declare it: {}", senders.len(), senders.join(", "))
    };
    let why = if selection_type == "kvcr" {
        " (shared_cache_multiplier > 0)"
    } else {
        " (it declares commits_kv_copies with these parameters)"
    };
    builder.error(
        &role.at,
        format!(
            "role {}: selection policy `{selection_type}` commits KV copies{why}, so exactly one hint policy must send them (declare Commitments::KV_COPY, e.g. kv_fetch); {found}",
            role.role
        ),
    );
}

/// The stage bookings of the role go through: the configured policy in KV mode,
/// the mode's own policy otherwise, with the built-in default as the fallback for
/// a booking where the policy fails. Returns it with the booking policy's type.
fn booking_stage(
    builder: &mut Builder<'_>,
    role: &RoleConfig,
    context: &RoleContext<'_>,
    selection: ConstructedSelection,
) -> Option<(SelectionStage, String)> {
    let RoleContext {
        mode,
        registry,
        limits,
        settings,
        policy_stats,
        ..
    } = *context;
    let booking_selection = if mode.is_kv() {
        selection
    } else {
        registry
            .construct_selection(mode.as_str(), &serde_json::json!({}), &settings)
            .ok()?
    };
    let booking_selection_type = booking_selection.type_name.clone();
    // The default itself needs no fallback.
    let fallback = if booking_selection_type == FALLBACK_TYPE {
        None
    } else {
        match registry.construct_selection(FALLBACK_TYPE, &serde_json::json!({}), &settings) {
            Ok(fallback) => Some(fallback),
            Err(e) => {
                builder.error(
                    &role.at,
                    format!("the built-in fallback selection cannot be built: {e}"),
                );
                None
            }
        }
    };
    let selection_stats = policy_stats
        .map(|registry| registry.selection(role.role.as_str(), &booking_selection_type))
        .unwrap_or_default();
    let stage = SelectionStage::with_limits(booking_selection, fallback, selection_stats, limits);
    Some((stage, booking_selection_type))
}

fn listed_hints(
    builder: &mut Builder<'_>,
    items: &[HintItem],
    registry: &Registry,
    settings: &FfiRouterSettings,
) -> Vec<(String, ConstructedPolicy)> {
    let mut instances = Vec::new();
    for item in items {
        match registry.construct_with(&item.type_name, &item.parameters.value, settings) {
            Ok(constructed) => instances.push((item.name.clone(), constructed)),
            Err(e @ RegistryError::BadParameters { .. }) => {
                report_parameters(builder, &item.parameters, &e)
            }
            Err(e) => builder.error(&item.at, e.to_string()),
        }
    }
    instances
}

fn default_hints(
    builder: &mut Builder<'_>,
    role: &RoleConfig,
    registry: &Registry,
    settings: &FfiRouterSettings,
) -> Vec<(String, ConstructedPolicy)> {
    let mut instances = Vec::new();
    for hint_type in registry.defaults_for(&role.selection.type_name) {
        match registry.construct_with(&hint_type.name, &serde_json::json!({}), settings) {
            Ok(constructed) => instances.push((hint_type.name.clone(), constructed)),
            Err(e) => builder.error(
                &role.at,
                format!(
                    "role {} runs hint policy `{}` by default, but it cannot be built without parameters: {e}; list it under `hints` with its parameters (or `hints: []` to run none)",
                    role.role, hint_type.name
                ),
            ),
        }
    }
    instances
}

/// A provider's parameter errors, each pointed at the key it names: the
/// plugin-api reports every problem of one mapping, one per line.
fn report_parameters(
    builder: &mut Builder<'_>,
    parameters: &crate::config::Parameters,
    error: &RegistryError,
) {
    let RegistryError::BadParameters {
        kind,
        name,
        origin,
        message,
    } = error
    else {
        return builder.error(&parameters.at, error.to_string());
    };
    let locator = parameters.locator();
    for line in message.lines().filter(|l| !l.trim().is_empty()) {
        builder.error(
            &locator.locate(line),
            format!("bad parameters for {kind} {name:?} ({origin}): {line}"),
        );
    }
}
