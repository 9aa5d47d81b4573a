//! What `kvhint check` and `kvhint plugins` print: a config as the router
//! understood it, and each plugin file as the loader found it.
//!
//! Apart from the CLI so that the text an operator reads is built by the library
//! (and can be tested without a process), while `main.rs` only parses arguments
//! and picks an exit code.

use crate::catalog::FileReport;
use crate::config::Config;
use crate::registry::{ConstructedSelection, Registry};
use crate::snapshot::{self, Snapshot};
use std::io::{self, Write};
use std::path::Path;

/// `writeln!` with the line's control characters escaped: file names, plugin
/// names and versions, and messages come from the plugins directory and the
/// plugins themselves, and a newline or an escape sequence in one must not
/// forge a line of the report or drive the operator's terminal.
macro_rules! line {
    ($out:expr, $($arg:tt)*) => {
        writeln!($out, "{}", crate::logging::escape_controls(&format!($($arg)*)))
    };
}

/// `kvhint check`'s report of a config that loaded: the router mode, each plugin,
/// each role's selection and hint policies, auth, models, workers and engine
/// event sources.
pub fn check(
    out: &mut impl Write,
    file: &Path,
    config: &Config,
    snapshot: &Snapshot,
) -> io::Result<()> {
    line!(
        out,
        "{}: ok (router mode {}, block size {})",
        file.display(),
        snapshot.mode,
        snapshot.block_size
    )?;
    for plugin in &snapshot.plugins {
        let mut types = Vec::new();
        if !plugin.hint_types.is_empty() {
            types.push(format!("hint types: {}", plugin.hint_types.join(", ")));
        }
        if !plugin.selection_types.is_empty() {
            types.push(format!(
                "selection types: {}",
                plugin.selection_types.join(", ")
            ));
        }
        if types.is_empty() {
            types.push("no policy types".into());
        }
        line!(
            out,
            "plugin {} {} from {} ({})",
            plugin.name,
            plugin.version,
            plugin.path.display(),
            types.join("; ")
        )?;
    }
    if config.default_selection {
        line!(
            out,
            "worker_selection: not in the config; every role is booked by `{}` with its defaults",
            crate::config::DEFAULT_SELECTION
        )?;
    }
    for role in &snapshot.roles {
        let commits = if role.commits_kv_copies {
            ", commits KV copies"
        } else {
            ""
        };
        let booked_by = if role.booking_selection_type != role.selection_type {
            format!(
                " (booked by `{}` under this router mode)",
                role.booking_selection_type
            )
        } else {
            String::new()
        };
        line!(
            out,
            "role {}: selection {} {}{commits}{booked_by}",
            role.role,
            role.selection_type,
            role.selection_parameters
        )?;
        if let crate::registry::Origin::Plugin { .. } = &*role.booking_selection().origin {
            line!(
                out,
                "  selection policy from {}",
                role.booking_selection().origin
            )?;
        }
        let from = match role.hints_from {
            snapshot::HintsFrom::Listed => "listed",
            snapshot::HintsFrom::Defaults => "defaults for its selection policy",
            snapshot::HintsFrom::ExplicitlyNone => "`hints: []`",
            snapshot::HintsFrom::NotKvPath => "not on the KV path",
        };
        let policies = role.hints.policies();
        if policies.is_empty() {
            line!(out, "  hints ({from}): none")?;
        } else {
            line!(out, "  hints ({from}):")?;
        }
        for (i, policy) in policies.iter().enumerate() {
            line!(
                out,
                "    {}. {} (type {}, {}, commitments {})",
                i + 1,
                policy.name,
                policy.type_name,
                policy.origin,
                policy.commitments
            )?;
        }
    }
    match &snapshot.tokens {
        Some(tokens) => {
            let classes: Vec<String> = crate::config::auth::Caller::ALL
                .iter()
                .map(|&caller| match tokens.count(caller) {
                    0 => format!("{caller} (admin token only)"),
                    1 => format!("{caller} 1 token"),
                    n => format!("{caller} {n} tokens"),
                })
                .collect();
            line!(out, "auth: {}", classes.join(", "))?;
        }
        None => line!(
            out,
            "auth: none (serve refuses a non-loopback --listen without --allow-unauthenticated)"
        )?,
    }
    for model in &config.models {
        let cache = match snapshot
            .models
            .get(&model.name)
            .map(|m| m.tokenizer.piece_cache())
        {
            Some(Ok(_)) => format!("tokenizer cache {} MiB", config.gateway.tokenizer_cache_mib),
            Some(Err(why)) => format!("no tokenizer cache: {why}"),
            None => "not loaded".into(),
        };
        // Which library encodes the model's prompts, and why not the fast one
        // when it fell back (a model loaded is a model with an encoder).
        let encoder = match snapshot
            .models
            .get(&model.name)
            .map(|m| m.tokenizer.encoder())
        {
            Some((name, None)) => format!(", encoder {name}"),
            Some((name, Some(why))) => format!(", encoder {name} ({why})"),
            None => String::new(),
        };
        // The content format its chat template gets, and where it came from.
        let encoder = match snapshot.models.get(&model.name) {
            Some(m) => {
                let (format, origin) = m.tokenizer.content_format();
                format!("{encoder}, content format {} ({origin})", format.as_str())
            }
            None => encoder,
        };
        line!(
            out,
            "model {}: role {}, tokenizer {}{}, {cache}{encoder}",
            model.name,
            model.role,
            model.tokenizer.display(),
            model
                .lora
                .as_deref()
                .map(|l| format!(", lora {l}"))
                .unwrap_or_default()
        )?;
    }
    for worker in &config.workers {
        line!(
            out,
            "worker {} ({}, {} rank{}): {} at {}, models {}, kv events {}{}",
            worker.worker_id,
            worker.role,
            worker.dp_size,
            if worker.dp_size == 1 { "" } else { "s" },
            worker.engine,
            worker.http_endpoint,
            worker.models.join(", "),
            match &worker.kv_events {
                None => "none".to_string(),
                Some(crate::domain::event_source::KvEvents::Approximate) =>
                    "approximate".to_string(),
                Some(crate::domain::event_source::KvEvents::Source(source)) =>
                    source.endpoint.clone(),
            },
            // The file, never the key.
            worker
                .api_key_file
                .as_ref()
                .map(|f| format!(", api key from {}", f.display()))
                .unwrap_or_default()
        )?;
    }
    let kv_events = &config.kv_events;
    if !kv_events.sources.is_empty() {
        line!(
            out,
            "kv_events: media {}, {} source{}",
            kv_events.media.join(", "),
            kv_events.sources.len(),
            if kv_events.sources.len() == 1 {
                ""
            } else {
                "s"
            }
        )?;
        for source in &kv_events.sources {
            line!(
                out,
                "  worker {} ({}, {} rank{}): {} {}{}",
                source.worker_id,
                source.role,
                source.dp_size,
                if source.dp_size == 1 { "" } else { "s" },
                if source.source.bind {
                    "bind"
                } else {
                    "connect"
                },
                source.source.endpoint,
                source
                    .source
                    .replay_endpoint
                    .as_deref()
                    .map(|r| format!(", replay {r}"))
                    .unwrap_or_default()
            )?;
        }
    }
    Ok(())
}

/// `kvhint plugins`' report of each plugin file: what it registered, with each
/// type's commitments and defaults, or why it was refused. Returns how many were
/// refused.
pub fn plugins(
    out: &mut impl Write,
    registry: &Registry,
    reports: &[FileReport],
) -> io::Result<usize> {
    let mut refused = 0;
    if reports.is_empty() {
        line!(out, "no plugin files (lib*.so) found")?;
    }
    for report in reports {
        line!(out, "{}", report.path.display())?;
        match &report.result {
            Ok(loaded) => {
                let info = &loaded.plugin.info;
                line!(
                    out,
                    "  plugin {} {} (kvhint-plugin-api {}, ABI {}), sha256 {}",
                    info.name,
                    info.version,
                    info.api_version,
                    info.abi_version,
                    loaded.plugin.sha256
                )?;
                for name in &loaded.hint_types {
                    let Some(hint_type) = registry.get(name) else {
                        continue;
                    };
                    let commitments = match registry.construct(name, &serde_json::json!({})) {
                        Ok(policy) => policy.commitments.to_string(),
                        Err(e) => format!("unknown until configured ({e})"),
                    };
                    let hosts = if hint_type.default_hosts().is_empty() {
                        "none (runs only where a role lists it)".to_string()
                    } else {
                        hint_type
                            .default_hosts()
                            .iter()
                            .map(|h| h.to_string())
                            .collect::<Vec<_>>()
                            .join(", ")
                    };
                    line!(
                        out,
                        "  hint {name}: commitments {commitments}; default under: {hosts}"
                    )?;
                }
                for name in &loaded.selection_types {
                    let declared = match registry.construct_selection(
                        name,
                        &serde_json::json!({}),
                        &Default::default(),
                    ) {
                        Ok(policy) => selection_declarations(&policy),
                        Err(e) => format!("unknown until configured ({e})"),
                    };
                    line!(out, "  selection {name}: {declared}")?;
                }
            }
            Err(errors) => {
                refused += 1;
                for error in errors {
                    line!(out, "  refused: {error}")?;
                }
            }
        }
    }
    Ok(refused)
}

/// What a constructed selection policy declared, for `plugins`.
fn selection_declarations(policy: &ConstructedSelection) -> String {
    let mut said = vec![if policy.kv_aware() {
        "KV-aware"
    } else {
        "not KV-aware (no hints under it)"
    }];
    if policy.commits_kv_copies() {
        said.push("commits KV copies with these parameters");
    }
    said.join(", ")
}
