//! The `kvhint` command line.

use anyhow::Context;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};
use kvhint::catalog::{self, PluginFile};
use kvhint::config::{self, Config, ConfigError, ConfigErrors, RouterMode};
use kvhint::loader::{Loader, LoaderOptions};
use kvhint::registry::Registry;
use kvhint::snapshot::{self, BuildOptions, Snapshot};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

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

/// `--router-mode`: the router modes, each described in `--help`.
#[derive(Clone, Copy, ValueEnum)]
enum Mode {
    /// KV-aware selection; the roles' hint policies run.
    Kv,
    /// Each role's workers in turn. Not KV-aware: no hints run, and a role
    /// that lists `hints` is refused.
    RoundRobin,
    /// A uniformly random worker, seeded by `router.seed`. Not KV-aware: no
    /// hints run, and a role that lists `hints` is refused.
    Random,
}

impl From<Mode> for RouterMode {
    fn from(mode: Mode) -> Self {
        match mode {
            Mode::Kv => RouterMode::Kv,
            Mode::RoundRobin => RouterMode::RoundRobin,
            Mode::Random => RouterMode::Random,
        }
    }
}

#[derive(Subcommand)]
enum Command {
    /// Run the router: the HTTP JSON API, reloading on plugin-directory
    /// changes, SIGHUP and POST /admin/reload.
    Serve {
        /// The YAML config file, a regular file (required). See the README's
        /// "Configuration".
        #[arg(long, value_name = "FILE")]
        config: PathBuf,
        /// The router mode, overriding the config's `router.mode` [default:
        /// the config's `router.mode`, else kv].
        #[arg(long, value_name = "MODE")]
        router_mode: Option<Mode>,
        /// Address (IP:PORT) to listen on; loopback unless you say otherwise.
        #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:8080")]
        listen: std::net::SocketAddr,
        /// Also reload when the config file changes [default: off: the plugins
        /// directory, SIGHUP and POST /admin/reload reload].
        #[arg(long)]
        watch_config: bool,
        /// Largest request body accepted, in bytes.
        #[arg(long, value_name = "BYTES", default_value_t = 8 << 20)]
        max_body_bytes: usize,
        /// Threads (0 to 1024) that run bookings (selection and hint policies), off the
        /// HTTP runtime's threads [default: the machine's cores]. 0 runs each
        /// booking on the runtime thread that received it, under
        /// `block_in_place` (less hand-off, but a thread per slow booking).
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(0..=1024))]
        booking_threads: Option<u16>,
        /// Serve a non-loopback --listen address although the config has no
        /// `auth` (refused otherwise): anyone who reaches the port can then
        /// register workers, book and reload [default: off].
        #[arg(long)]
        allow_unauthenticated: bool,
        /// Milliseconds a client has, from a request's first byte, to send its
        /// whole head (request line and headers); then the connection is closed.
        #[arg(long, default_value_t = 10_000, value_name = "MS", value_parser = clap::value_parser!(u64).range(1..))]
        header_timeout_ms: u64,
        /// Milliseconds a client has to send a request's whole body; then the
        /// request gets 408 `body_timeout`.
        #[arg(long, default_value_t = 30_000, value_name = "MS", value_parser = clap::value_parser!(u64).range(1..))]
        body_timeout_ms: u64,
        /// Milliseconds a connection may sit idle between requests (or a
        /// response wait for the client to read it) before it is closed.
        #[arg(long, default_value_t = 60_000, value_name = "MS", value_parser = clap::value_parser!(u64).range(1..))]
        idle_timeout_ms: u64,
        /// Connections served at once; more wait to be accepted. Lowered to
        /// what the open-files limit (`ulimit -n`) allows.
        #[arg(long, value_name = "N", default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..))]
        max_connections: u32,
    },
    /// Load the plugins, validate the config, construct every policy, and print
    /// each role's resolved selection and hint policies. Exit 1 with every
    /// error found.
    Check {
        /// The YAML config file, a regular file (required).
        #[arg(long, value_name = "FILE")]
        config: PathBuf,
        /// The router mode to check under, overriding the config's
        /// `router.mode` [default: the config's `router.mode`, else kv].
        #[arg(long, value_name = "MODE")]
        router_mode: Option<Mode>,
    },
    /// Book a JSONL trace offline: each booking with its hint as JSONL, then a
    /// summary line. Exit 1 if any line failed.
    Replay {
        /// The YAML config file, a regular file (required).
        #[arg(long, value_name = "FILE")]
        config: PathBuf,
        /// The JSONL trace to book (required): one record per line, a worker,
        /// a KV event, a request or a release; see docs/api.md, "Workers, KV
        /// events and the trace format".
        #[arg(long, value_name = "FILE")]
        trace: PathBuf,
        /// The router mode to book under, overriding the config's
        /// `router.mode` [default: the config's `router.mode`, else kv].
        #[arg(long, value_name = "MODE")]
        router_mode: Option<Mode>,
    },
    /// List each plugin file: its name, version, ABI, hint types with their
    /// commitments and default hosts — or why it was refused. Exit 1 if any was.
    Plugins {
        /// Take the plugin sources (and cache directory) from this config
        /// [default: none; give it, --plugins-dir or --file].
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
        /// A plugins directory: every `lib*.so` in it [default: the config's
        /// `plugins.directory`, if --config is given].
        #[arg(long, value_name = "DIR")]
        plugins_dir: Option<PathBuf>,
        /// A plugin file; repeat for more [default: none].
        #[arg(long = "file", value_name = "FILE")]
        files: Vec<PathBuf>,
        /// Where private copies of plugins are kept, overriding the config's
        /// `plugins.cache_dir` [default: a temporary directory removed on
        /// exit, so nothing else is written].
        #[arg(long, value_name = "DIR")]
        cache_dir: Option<PathBuf>,
    },
    /// Internal: open one private plugin copy in this child process and print
    /// what it is, so a library that crashes on load kills this process and
    /// not the router (the router runs it before opening any library).
    #[command(name = "__probe-plugin", hide = true)]
    ProbePlugin {
        file: PathBuf,
        /// The pipe to answer on (given by the router).
        #[arg(long, value_name = "FD")]
        answer_fd: Option<i32>,
        /// The pipe the probe's nonce comes on (given by the router).
        #[arg(long, value_name = "FD")]
        nonce_fd: Option<i32>,
    },
}

/// `serve` is a daemon whose reloads an operator wants to see; the other
/// commands print their results and log only problems.
fn default_log_level() -> &'static str {
    if std::env::args().nth(1).as_deref() == Some("serve") {
        "info"
    } else {
        "warn"
    }
}

/// The first code of this process that runs: SIGHUP is ignored from here until
/// `serve` installs its handler (the other commands restore the default in
/// `main`). An entry in `.preinit_array` runs once the dynamic loader has mapped
/// and relocated the program, before any library's initialisers (libstdc++'s,
/// the Rust runtime's) and `main`: a hangup sent between `exec` and `main` used
/// to end a starting `serve`. What is left is the dynamic loader's own work before
/// any code of this program can run (see docs/architecture.md, "SIGHUP at start-up").
extern "C" fn ignore_hangups_at_start() {
    ignore_hangups(true);
}

#[used]
#[link_section = ".preinit_array"]
static IGNORE_HANGUPS_AT_START: extern "C" fn() = ignore_hangups_at_start;

/// Sets what a SIGHUP does until a handler exists: ignored, or the default
/// (the process ends).
fn ignore_hangups(ignore: bool) {
    let action = if ignore { libc::SIG_IGN } else { libc::SIG_DFL };
    // SAFETY: setting a signal's disposition to SIG_IGN or SIG_DFL installs no
    // code and touches no memory of this process.
    unsafe {
        libc::signal(libc::SIGHUP, action);
    }
}

fn main() -> ExitCode {
    // First of all: SIGHUP's default action ends the process, and `serve`'s
    // handler exists only once the async runtime runs. A hangup before then
    // arrives before the config is first read, so start-up's own read already
    // sees whatever the operator changed: it is ignored, not queued. tokio's
    // handler replaces this disposition; the other commands get the default
    // back once their arguments are parsed.
    ignore_hangups(true);
    kvhint::logging::init(default_log_level());
    // Plugin authors need the router's plugin-api version to follow the
    // compatibility rule, so `--version` says it.
    let version: &'static str = Box::leak(
        format!(
            "{} (loads plugins built against kvhint-plugin-api {} or a newer patch of it; plugin ABI {})",
            env!("CARGO_PKG_VERSION"),
            kvhint_plugin_api::API_VERSION,
            kvhint_plugin_api::ABI_VERSION
        )
        .into_boxed_str(),
    );
    let cli = match Cli::from_arg_matches(&Cli::command().version(version).get_matches()) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    if !matches!(cli.command, Command::Serve { .. }) {
        ignore_hangups(false);
    }
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!(
                "error: {}",
                kvhint::logging::escape_controls(&format!("{e:#}"))
            );
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Serve {
            config,
            router_mode,
            listen,
            watch_config,
            max_body_bytes,
            booking_threads,
            allow_unauthenticated,
            header_timeout_ms,
            body_timeout_ms,
            idle_timeout_ms,
            max_connections,
        } => serve(kvhint::service::ServeOptions {
            config,
            mode: router_mode.map(RouterMode::from),
            listen,
            watch_config,
            max_body_bytes,
            booking_threads: booking_threads.map(usize::from),
            connections: kvhint::service::listener::ConnectionLimits {
                header_timeout: std::time::Duration::from_millis(header_timeout_ms),
                body_timeout: std::time::Duration::from_millis(body_timeout_ms),
                idle_timeout: std::time::Duration::from_millis(idle_timeout_ms),
                max_connections: max_connections as usize,
            },
            allow_unauthenticated,
        }),
        Command::Check {
            config,
            router_mode,
        } => check(&config, router_mode.map(RouterMode::from)),
        Command::Replay {
            config,
            trace,
            router_mode,
        } => replay(&config, &trace, router_mode.map(RouterMode::from)),
        Command::Plugins {
            config,
            plugins_dir,
            files,
            cache_dir,
        } => plugins(config, plugins_dir, files, cache_dir),
        Command::ProbePlugin {
            file,
            answer_fd,
            nonce_fd,
        } => {
            let code = kvhint::loader::probe::child(&file, answer_fd, nonce_fd);
            Ok(ExitCode::from(u8::try_from(code).unwrap_or(1)))
        }
    }
}

/// The loader for a config: its cache directory and library cap. The offline
/// commands check the configured cache directory but keep their copies in a
/// temporary one, removed on exit: they write nothing else.
fn loader_for(config: &Config) -> Result<Loader, ConfigError> {
    let options = LoaderOptions {
        cache_mode: kvhint::loader::CacheMode::Temporary,
        ..LoaderOptions::from_config(&config.plugins)
    };
    Loader::new(&options).map_err(|e| ConfigError::new(&config.file, None, e))
}

/// Parses the config and builds a snapshot, collecting every error from both.
fn load_snapshot(
    file: &Path,
    mode: Option<RouterMode>,
) -> Result<(Config, Loader, Snapshot), ConfigErrors> {
    let (config, errors) = config::load_lenient(file);
    let Some(config) = config else {
        return Err(ConfigErrors(errors));
    };
    let mut errors = ConfigErrors(errors);
    let failed = |mut errors: ConfigErrors| {
        errors.sort_in_file_order();
        Err(errors)
    };
    let loader = match loader_for(&config) {
        Ok(loader) => loader,
        Err(e) => {
            errors.0.push(e);
            return failed(errors);
        }
    };
    let options = BuildOptions {
        loader: &loader,
        mode,
        generation: 1,
        fixed: None,
        policy_stats: None,
        tokenizers: None,
    };
    match snapshot::build(&config, &options) {
        Ok(snapshot) if errors.0.is_empty() => Ok((config, loader, snapshot)),
        Ok(_) => failed(errors),
        Err(more) => {
            errors.0.extend(more.0);
            failed(errors)
        }
    }
}

fn serve(options: kvhint::service::ServeOptions) -> anyhow::Result<ExitCode> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async {
        // First, before loading anything: SIGHUP has been ignored since
        // `main` began; from here on a hangup reloads.
        let hangups = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
            .context("cannot listen for SIGHUP")?;
        // Start-up validates exactly as `check` does, and refuses to serve a
        // config with any error.
        let app = match kvhint::service::build_app(&options) {
            Ok(app) => app,
            Err(errors) => return Ok(report_errors(&errors)),
        };
        kvhint::service::serve(options, Arc::clone(&app), hangups).await?;
        if let Some(tracing) = &app.gateway.tracing {
            // The last batch of spans, before the exporter's runtime stops.
            tracing.shutdown();
        }
        Ok(ExitCode::SUCCESS)
    })
}

/// Prints every error, in file order, as `error: FILE:LINE:COLUMN: YAML.PATH:
/// MESSAGE` (the README's format), then how many there were.
fn report_errors(errors: &ConfigErrors) -> ExitCode {
    let mut errors = errors.clone();
    errors.sort_in_file_order();
    for error in &errors.0 {
        eprintln!(
            "error: {}",
            kvhint::logging::escape_controls(&error.to_string())
        );
    }
    let n = errors.0.len();
    eprintln!("{n} error{} found", if n == 1 { "" } else { "s" });
    ExitCode::FAILURE
}

fn check(file: &Path, mode: Option<RouterMode>) -> anyhow::Result<ExitCode> {
    let (config, _loader, snapshot) = match load_snapshot(file, mode) {
        Ok(loaded) => loaded,
        Err(errors) => return Ok(report_errors(&errors)),
    };
    kvhint::report::check(&mut std::io::stdout().lock(), file, &config, &snapshot)?;
    Ok(ExitCode::SUCCESS)
}

fn replay(file: &Path, trace: &Path, mode: Option<RouterMode>) -> anyhow::Result<ExitCode> {
    let (_config, _loader, snapshot) = match load_snapshot(file, mode) {
        Ok(loaded) => loaded,
        Err(errors) => return Ok(report_errors(&errors)),
    };
    let input = std::fs::File::open(trace)
        .with_context(|| format!("cannot open the trace {}", trace.display()))?;
    let router = kvhint::router::Router::new(snapshot.block_size);
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    let mut err = std::io::stderr();
    let summary = kvhint::replay::replay(
        &router,
        &snapshot,
        trace,
        std::io::BufReader::new(input),
        &mut out,
        &mut err,
    )?;
    use std::io::Write;
    writeln!(out, "{}", serde_json::json!({ "summary": summary }))?;
    out.flush()?;
    Ok(if summary.errors == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn plugins(
    config: Option<PathBuf>,
    plugins_dir: Option<PathBuf>,
    files: Vec<PathBuf>,
    cache_dir: Option<PathBuf>,
) -> anyhow::Result<ExitCode> {
    let explicit: Vec<PluginFile> = files
        .into_iter()
        .map(|path| PluginFile { path, sha256: None })
        .collect();
    // `--cache-dir D` is a cache to keep (created if missing); without it the
    // copies go to a temporary directory removed on exit.
    let cache_for = |mut options: LoaderOptions| -> anyhow::Result<Loader> {
        match &cache_dir {
            Some(dir) => {
                options.cache_dir = dir.clone();
                options.cache_mode = kvhint::loader::CacheMode::Persistent;
            }
            None => options.cache_mode = kvhint::loader::CacheMode::Temporary,
        }
        Loader::new(&options).map_err(anyhow::Error::msg)
    };
    let (loader, files) = match config {
        Some(file) => {
            let config = config::load(&file)?;
            let loader = cache_for(LoaderOptions::from_config(&config.plugins))
                .with_context(|| file.display().to_string())?;
            let mut all = config.plugins.files.clone();
            all.extend(explicit);
            let files = catalog::plugin_files(
                plugins_dir
                    .as_deref()
                    .or(config.plugins.directory.as_deref()),
                &all,
                &|path| config.plugins.pin_for(path),
            )?;
            (loader, files)
        }
        None => {
            if plugins_dir.is_none() && explicit.is_empty() {
                anyhow::bail!(
                    "say which plugins to list: --config FILE, --plugins-dir DIR and/or --file FILE"
                );
            }
            let loader = cache_for(LoaderOptions::default())?;
            let files = catalog::plugin_files(plugins_dir.as_deref(), &explicit, &|_| None)?;
            (loader, files)
        }
    };
    let mut registry = Registry::with_builtins()
        .map_err(|e| anyhow::anyhow!("the built-in policies failed to register: {e:?}"))
        .context("this is a bug in kvhint")?;
    let reports = catalog::load_into(&loader, &mut registry, &files);
    let refused = kvhint::report::plugins(&mut std::io::stdout().lock(), &registry, &reports)?;
    Ok(if refused == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
