//! The `kvhint` command line.

use anyhow::Context;
use clap::{Parser, Subcommand};
use kvhint::catalog::{self, PluginFile};
use kvhint::loader::{Loader, LoaderOptions};
use kvhint::registry::Registry;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "kvhint",
    version,
    about = "KV-cache-aware request router with hint policies loaded as plugins"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List each plugin file: its name, version, ABI, hint types with their
    /// commitments and default hosts — or why it was refused. Exit 1 if any was.
    Plugins {
        /// A plugins directory (every `lib*.so` in it).
        #[arg(long)]
        plugins_dir: Option<PathBuf>,
        /// A plugin file (repeatable).
        #[arg(long = "file")]
        files: Vec<PathBuf>,
        /// Where private copies of plugins are kept.
        #[arg(long)]
        cache_dir: Option<PathBuf>,
    },
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KVHINT_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Plugins {
            plugins_dir,
            files,
            cache_dir,
        } => plugins(plugins_dir, files, cache_dir),
    }
}

fn plugins(
    plugins_dir: Option<PathBuf>,
    files: Vec<PathBuf>,
    cache_dir: Option<PathBuf>,
) -> anyhow::Result<ExitCode> {
    if plugins_dir.is_none() && files.is_empty() {
        anyhow::bail!("say which plugins to list: --plugins-dir DIR and/or --file FILE");
    }
    let mut options = LoaderOptions::default();
    if let Some(dir) = cache_dir {
        options.cache_dir = dir;
    }
    let loader = Loader::new(&options).map_err(anyhow::Error::msg)?;
    let explicit: Vec<PluginFile> = files
        .into_iter()
        .map(|path| PluginFile { path, sha256: None })
        .collect();
    let files = catalog::plugin_files(plugins_dir.as_deref(), &explicit, &|_| None)?;
    let mut registry = Registry::with_builtins()
        .map_err(|e| anyhow::anyhow!("the built-in hint policies failed to register: {e:?}"))
        .context("this is a bug in kvhint")?;
    let reports = catalog::load_into(&loader, &mut registry, &files);
    let mut refused = 0;
    if reports.is_empty() {
        println!("no plugin files (lib*.so) found");
    }
    for report in &reports {
        println!("{}", report.path.display());
        match &report.result {
            Ok(loaded) => {
                let info = &loaded.plugin.info;
                println!(
                    "  plugin {} {} (kvhint-plugin-api {}, ABI {}), sha256 {}",
                    info.name,
                    info.version,
                    info.api_version,
                    info.abi_version,
                    loaded.plugin.sha256
                );
                for name in &loaded.hint_types {
                    let Some(hint_type) = registry.get(name) else {
                        continue;
                    };
                    let commitments = match registry.construct(name, &serde_json::json!({})) {
                        Ok(policy) => policy.commitments.to_string(),
                        Err(e) => format!("unknown until configured ({e})"),
                    };
                    let hosts = if hint_type.default_hosts.is_empty() {
                        "none (runs only where a role lists it)".to_string()
                    } else {
                        hint_type
                            .default_hosts
                            .iter()
                            .map(|h| h.to_string())
                            .collect::<Vec<_>>()
                            .join(", ")
                    };
                    println!("  hint {name}: commitments {commitments}; default under: {hosts}");
                }
            }
            Err(errors) => {
                refused += 1;
                for error in errors {
                    println!("  refused: {error}");
                }
            }
        }
    }
    Ok(if refused == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
