//! Loading plugin `.so` files (docs/architecture.md, "Plugins: from a file to a
//! policy", walks through the checks below).
//!
//! The order of the checks is the point: everything that can be decided from
//! the file's bytes (who wrote it, its pinned hash, whether it is a whole ELF
//! shared object) is decided before `dlopen` runs any of its code, because a
//! bad file can kill the process inside `dlopen` rather than fail it. Then the
//! private copy is opened with `RTLD_NOW | RTLD_LOCAL` (unresolved symbols fail
//! here, with the linker's own message, instead of at the first call), and
//! this file's own root module is read: the one `kvhint_plugin_root_v2__<crate>`
//! symbol in its dynamic symbol table, opened with `RawLibrary::load_at`, read
//! as an `AbiHeaderRef` and upgraded to a `LibHeader`, whose
//! `init_root_module` checks the module's layout. (`abi_stable`'s
//! `load_from_*` helpers look for one fixed symbol name and cache one module
//! per type: they would hand back the first plugin for every file.)
//!
//! Before any of that, the file is checked without reading it whole: its size
//! against `plugins.max_file_bytes` (from `fstat`, so a 100 GiB sparse file is
//! refused unread), then its first bytes for the ELF magic and class. Its
//! sha256 is computed while streaming, and the structural ELF check reads only
//! the private copy's headers. And because `dlopen` runs a library's
//! constructors, the private copy is first opened by a child process (the
//! router re-executing itself, see [`probe`]); only a file the probe survived
//! is opened in the router.
//!
//! Libraries are never unloaded: Rust thread-local destructors registered by a
//! plugin would run into unmapped code after `dlclose`. Replaced builds stay
//! mapped; [`Loader::libraries_mapped`] counts them and `max_libraries` caps them.

mod cache;
pub mod elf;
pub mod probe;
use crate::trust;

pub use cache::{default_cache_dir, CacheMode};
pub use probe::ProbeMode;

use abi_stable::library::{AbiHeaderRef, LibHeader, RawLibrary, RootModule};
use kvhint_plugin_api::abi::PluginModRef;
use kvhint_plugin_api::abi::ROOT_SYMBOL_PREFIX;
use kvhint_plugin_api::{ABI_VERSION, API_VERSION};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::fmt;
use std::io::{Read, Seek};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A plugin file that was refused, and why.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{}", match kind {
    LoadErrorKind::Directory(_) => format!("plugins directory {}: {kind}", path.display()),
    _ => format!("plugin {}: {kind}", path.display()),
})]
pub struct LoadError {
    pub path: PathBuf,
    pub kind: LoadErrorKind,
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum LoadErrorKind {
    #[error("cannot read it: {0}")]
    Io(String),
    #[error("it cannot be listed: {0}; create it, or fix the path")]
    Directory(String),
    #[error("{0}")]
    Trust(#[from] trust::TrustError),
    #[error("{0}")]
    Elf(#[from] elf::ElfError),
    #[error("its sha256 is {found}, but the config pins {expected}; if this build is the one you mean to run, update the pin")]
    PinMismatch { expected: String, found: String },
    #[error("the config pins it twice with different sha256 values ({explicit} in plugins.files, {directory} in plugins.sha256); keep one pin")]
    ConflictingPins { explicit: String, directory: String },
    #[error("{0}")]
    Cache(String),
    #[error("the dynamic linker refused it: {0}; check that the libraries it links against are installed (`ldd` on the file) and that it was built for this system")]
    Dlopen(String),
    #[error("it is not a kvhint plugin: {0}; a plugin crate calls `kvhint_plugin_api::export_plugin!(register)` once in its lib.rs and is built with crate-type \"cdylib\"")]
    NoRootModule(String),
    #[error("it was built against kvhint-plugin-api {plugin}, but this router (kvhint-plugin-api {host}) loads only plugins built against {host} or a newer {series}.x; rebuild it against kvhint-plugin-api {host}: require that version in the plugin's Cargo.toml (or point its path dependency at this router's plugin-api), then `cargo build --release`")]
    IncompatibleApi {
        plugin: String,
        host: String,
        series: String,
    },
    #[error("its ABI does not match this router's: {0}; rebuild it against kvhint-plugin-api {API_VERSION}")]
    AbiMismatch(String),
    #[error("it speaks plugin ABI version {plugin}, this router speaks {ABI_VERSION}; rebuild it against kvhint-plugin-api {API_VERSION}")]
    AbiVersion { plugin: u32 },
    #[error("it was built with panic = \"abort\", so any panic in it would abort the router; remove `panic = \"abort\"` from its Cargo profile (the default, \"unwind\", lets the router contain panics) and rebuild")]
    PanicAbort,
    #[error("it is {size} bytes, more than `plugins.max_file_bytes` ({limit}); it was not read. A plugin is a few MB; if this file really is one, raise `plugins.max_file_bytes`")]
    TooLarge { size: u64, limit: u64 },
    #[error("opening it killed the probe process with {signal}{output}: its initialisation code (a constructor `dlopen` runs) aborts or crashes, so the router did not open it and keeps serving; fix the plugin (or remove the file), rebuild and drop it in again")]
    ProbeCrashed { signal: String, output: String },
    #[error("opening it in the probe process did not finish within {ms} ms, so the probe was killed and the router did not open it: its initialisation code (a constructor `dlopen` runs) hangs or is very slow; fix the plugin, or raise `plugins.probe_timeout_ms`")]
    ProbeTimeout { ms: u64 },
    #[error("{what}; the router did not open it")]
    ProbeFailed { what: String },
    #[error("{mapped} plugin libraries are already mapped (the cap is {cap}); libraries are never unloaded, so restart the router to reclaim replaced builds, or raise `plugins.max_libraries`")]
    TooManyLibraries { mapped: usize, cap: usize },
}

/// What a plugin says about itself in its root module.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginInfo {
    pub name: String,
    pub version: String,
    pub api_version: String,
    pub abi_version: u32,
}

/// A loaded plugin file.
#[derive(Clone)]
pub struct LoadedPlugin {
    /// The file the operator placed.
    pub path: PathBuf,
    /// The private copy that is mapped.
    pub cached_path: PathBuf,
    pub sha256: String,
    pub info: PluginInfo,
    pub module: PluginModRef,
}

impl fmt::Debug for LoadedPlugin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoadedPlugin")
            .field("path", &self.path)
            .field("cached_path", &self.cached_path)
            .field("sha256", &self.sha256)
            .field("info", &self.info)
            .finish()
    }
}

/// The default of `plugins.max_file_bytes`: 256 MiB.
pub const DEFAULT_MAX_FILE_BYTES: u64 = 256 << 20;
/// The default of `plugins.probe_timeout_ms`.
pub const DEFAULT_PROBE_TIMEOUT: Duration = Duration::from_secs(10);

/// Settings of the loader.
#[derive(Debug, Clone)]
pub struct LoaderOptions {
    pub cache_dir: PathBuf,
    /// Whether the copies go to `cache_dir` or to a temporary directory removed
    /// with the loader (`check`, `plugins` and `replay` write nothing else).
    pub cache_mode: CacheMode,
    /// How many distinct plugin libraries may be mapped over the process's life.
    pub max_libraries: usize,
    /// Larger files are refused from their size alone, unread.
    pub max_file_bytes: u64,
    /// How a library is opened in a child process before the router opens it.
    /// The default re-executes the running program; see [`ProbeMode`].
    pub probe: ProbeMode,
    /// How long the probe may take before it is killed and the file refused.
    pub probe_timeout: Duration,
}

impl LoaderOptions {
    /// The loader settings a config's `plugins:` section asks for. The probe
    /// is always on ([`ProbeMode::CurrentExe`]): the config cannot turn it off.
    pub fn from_config(plugins: &crate::config::PluginsConfig) -> Self {
        let mut options = Self {
            max_libraries: plugins.max_libraries,
            max_file_bytes: plugins.max_file_bytes,
            probe_timeout: Duration::from_millis(plugins.probe_timeout_ms),
            ..Default::default()
        };
        if let Some(dir) = &plugins.cache_dir {
            options.cache_dir = dir.clone();
        }
        options
    }
}

impl Default for LoaderOptions {
    fn default() -> Self {
        Self {
            cache_dir: default_cache_dir(),
            cache_mode: CacheMode::Persistent,
            max_libraries: 64,
            max_file_bytes: DEFAULT_MAX_FILE_BYTES,
            probe: ProbeMode::CurrentExe,
            probe_timeout: DEFAULT_PROBE_TIMEOUT,
        }
    }
}

/// What dlopening one library gave: its module, or why it was refused.
type Opened = Result<(PluginModRef, PluginInfo), LoadErrorKind>;

/// Loads plugin files; one per process, shared by every reload.
pub struct Loader {
    cache: cache::PluginCache,
    max_libraries: usize,
    max_file_bytes: u64,
    probe: ProbeMode,
    probe_timeout: Duration,
    /// Every library dlopened so far, by content hash: its module, or why it
    /// was refused after dlopen (it stays mapped either way, and is not opened
    /// again), and the private copy it was opened from.
    mapped: Mutex<HashMap<String, (Opened, PathBuf)>>,
    /// Libraries the probe refused for good, by content hash, so a reload does
    /// not probe them again (see [`probe::is_lasting`]: a timeout or a missing
    /// dependency is tried again).
    refused_by_probe: Mutex<HashMap<String, LoadErrorKind>>,
    /// Held for a whole load: loads run one at a time.
    loading: Mutex<()>,
}

impl fmt::Debug for Loader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Loader")
            .field("cache", &self.cache)
            .field("max_libraries", &self.max_libraries)
            .field("mapped", &self.libraries_mapped())
            .finish()
    }
}

/// The plugin files in `dir`: `lib*.so`, sorted by name. Dotfiles and `*.tmp`
/// are skipped: that is the drop-in protocol (write under a temporary name, then
/// rename), so a half-written file is never seen.
pub fn discover(dir: &Path) -> Result<Vec<PathBuf>, LoadError> {
    let entries = std::fs::read_dir(dir).map_err(|e| LoadError {
        path: dir.to_path_buf(),
        kind: LoadErrorKind::Directory(e.to_string()),
    })?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(|entry| entry.ok())
        .map(|entry| entry.path())
        .filter(|path| path.is_file() && is_plugin_file_name(path))
        .collect();
    files.sort();
    Ok(files)
}

/// Whether a file name is one the loader picks up from a plugins directory.
pub fn is_plugin_file_name(path: &Path) -> bool {
    let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
        return false;
    };
    !name.starts_with('.')
        && !name.ends_with(".tmp")
        && name.starts_with("lib")
        && name.ends_with(".so")
}

/// `major.minor.patch` of a version string, ignoring pre-release and build parts.
fn parse_version(text: &str) -> Option<(u64, u64, u64)> {
    let core = text.split(['-', '+']).next()?;
    let mut parts = core.split('.').map(|p| p.parse::<u64>().ok());
    let version = (parts.next()??, parts.next()??, parts.next()??);
    parts.next().is_none().then_some(version)
}

/// The compatibility rule (plugin-api README): same major — for `0.x`, the same
/// minor — and not older than the host's own plugin-api.
pub fn api_compatible(plugin: &str, host: &str) -> bool {
    match (parse_version(plugin), parse_version(host)) {
        (Some(p), Some(h)) => {
            let same_series = if h.0 == 0 {
                p.0 == 0 && p.1 == h.1
            } else {
                p.0 == h.0
            };
            same_series && p >= h
        }
        _ => false,
    }
}

fn api_series(host: &str) -> String {
    match parse_version(host) {
        Some((0, minor, _)) => format!("0.{minor}"),
        Some((major, _, _)) => major.to_string(),
        None => host.to_string(),
    }
}

/// The error chain of `e`, joined, so no cause is lost.
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

impl Loader {
    pub fn new(options: &LoaderOptions) -> Result<Self, String> {
        Ok(Self {
            cache: cache::PluginCache::open(&options.cache_dir, options.cache_mode)?,
            max_libraries: options.max_libraries,
            max_file_bytes: options.max_file_bytes,
            probe: options.probe.clone(),
            probe_timeout: options.probe_timeout,
            mapped: Mutex::new(HashMap::new()),
            refused_by_probe: Mutex::new(HashMap::new()),
            loading: Mutex::new(()),
        })
    }

    pub fn cache_dir(&self) -> &Path {
        self.cache.dir()
    }

    /// How many distinct plugin libraries are mapped: current and replaced
    /// builds, and builds refused after dlopen (they stay mapped too).
    pub fn libraries_mapped(&self) -> usize {
        self.mapped.lock().len()
    }

    /// Loads one plugin file. `pin` is an optional expected sha256 (hex).
    pub fn load(&self, path: &Path, pin: Option<&str>) -> Result<LoadedPlugin, LoadError> {
        let fail = |kind: LoadErrorKind| LoadError {
            path: path.to_path_buf(),
            kind,
        };
        // Open once: every check below is of this open file, so a rename
        // between the checks and the read cannot swap in unchecked bytes.
        // O_NONBLOCK: a FIFO put in place of a plugin must not hang the loader.
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(path)
            .map_err(|e| fail(LoadErrorKind::Io(e.to_string())))?;
        let opened = file
            .metadata()
            .map_err(|e| fail(LoadErrorKind::Io(e.to_string())))?;
        if !opened.is_file() {
            return Err(fail(LoadErrorKind::Io(
                "it is not a regular file".to_string(),
            )));
        }
        trust::check_plugin_file(path, &opened).map_err(|e| fail(e.into()))?;
        // The size from fstat, before a byte is read: a sparse 100 GiB file
        // costs nothing to refuse.
        let io = |e: std::io::Error| fail(LoadErrorKind::Io(e.to_string()));
        if opened.len() > self.max_file_bytes {
            return Err(fail(LoadErrorKind::TooLarge {
                size: opened.len(),
                limit: self.max_file_bytes,
            }));
        }
        // Then the first bytes: a file that is not a 64-bit ELF file is refused
        // before the rest is read.
        let mut first = [0u8; elf::HEADER_BYTES];
        let got = read_up_to(&mut file, &mut first).map_err(io)?;
        elf::check_header(&first[..got]).map_err(|e| fail(e.into()))?;
        file.rewind().map_err(io)?;
        // The hash, streamed (never the whole file in memory).
        let (_, sha256) =
            cache::copy_hashing(&mut file, std::io::sink(), self.max_file_bytes).map_err(io)?;
        if let Some(expected) = pin {
            if !expected.eq_ignore_ascii_case(&sha256) {
                return Err(fail(LoadErrorKind::PinMismatch {
                    expected: expected.to_string(),
                    found: sha256,
                }));
            }
        }

        let stem = path
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or("plugin");
        // One load at a time; `mapped` itself is locked only briefly, so the
        // status and metrics never wait for a probe.
        let _loading = self.loading.lock();
        if let Some(kind) = self.refused_by_probe.lock().get(&sha256) {
            return Err(fail(kind.clone()));
        }
        let mapped = self.mapped.lock();
        if let Some((known, cached_path)) = mapped.get(&sha256) {
            // Same content as a library already mapped: nothing to do.
            let (module, info) = known.as_ref().map_err(|kind| fail(kind.clone()))?;
            return Ok(LoadedPlugin {
                path: path.to_path_buf(),
                cached_path: cached_path.clone(),
                sha256,
                info: info.clone(),
                module: *module,
            });
        }
        if mapped.len() >= self.max_libraries {
            return Err(fail(LoadErrorKind::TooManyLibraries {
                mapped: mapped.len(),
                cap: self.max_libraries,
            }));
        }
        drop(mapped);
        // The private copy, streamed again, checked to be the same bytes, and
        // its ELF structure checked from its headers before it gets its name.
        file.rewind().map_err(io)?;
        let cached_path = self
            .cache
            .store(
                stem,
                &sha256,
                &mut file,
                self.max_file_bytes,
                |copy, len| elf::check_file(copy, len).map_err(LoadErrorKind::from),
            )
            .map_err(fail)?;
        // A library whose initialisation kills or hangs the process kills or
        // hangs the probe instead.
        let probe_started = std::time::Instant::now();
        if let Some(Err(kind)) = probe::run(&self.probe, &cached_path, &sha256, self.probe_timeout)
        {
            if probe::is_lasting(&kind) {
                self.refused_by_probe
                    .lock()
                    .insert(sha256.clone(), kind.clone());
            }
            self.prune();
            return Err(fail(kind));
        }
        let probe_ms = probe_started.elapsed().as_secs_f64() * 1e3;
        dlopen(&cached_path).map_err(fail)?;
        // From here the library is mapped for good, whatever the checks say.
        let opened = read_root_module(&cached_path);
        self.mapped
            .lock()
            .insert(sha256.clone(), (opened.clone(), cached_path.clone()));
        self.prune();
        let (module, info) = opened.map_err(fail)?;
        tracing::info!(
            plugin = %info.name,
            version = %info.version,
            file = %path.display(),
            sha256 = %sha256,
            probe_ms = format!("{probe_ms:.1}"),
            "loaded plugin"
        );
        Ok(LoadedPlugin {
            path: path.to_path_buf(),
            cached_path,
            sha256,
            info,
            module,
        })
    }

    /// Removes the cache's copies of libraries this process has not mapped
    /// (see the cache's docs: only when no other process uses the cache).
    fn prune(&self) {
        let keep: Vec<PathBuf> = self
            .mapped
            .lock()
            .values()
            .map(|(_, path)| path.clone())
            .collect();
        self.cache.prune(&keep);
    }
}

/// Reads into `buffer` until it is full or the file ends; returns how much.
fn read_up_to(file: &mut std::fs::File, buffer: &mut [u8]) -> std::io::Result<usize> {
    let mut got = 0;
    while got < buffer.len() {
        match file.read(&mut buffer[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

/// dlopen of the private copy, with `RTLD_NOW | RTLD_LOCAL`.
pub(crate) fn dlopen(cached: &Path) -> Result<(), LoadErrorKind> {
    use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};
    // SAFETY: running a library's initialisers is what loading a plugin means;
    // the file was checked as a whole ELF shared object owned by a trusted user.
    let library = unsafe { Library::open(Some(cached), RTLD_NOW | RTLD_LOCAL) }
        .map_err(|e| LoadErrorKind::Dlopen(chain(&e)))?;
    // Never unloaded (see the module docs); abi_stable opens it again, which
    // only bumps the reference count of this mapping.
    std::mem::forget(library);
    Ok(())
}

/// The `LibHeader` a dlopened library exports under `symbol`.
fn header_at(cached: &Path, symbol: &str) -> Result<&'static LibHeader, LoadErrorKind> {
    let library = RawLibrary::load_at(cached).map_err(|e| LoadErrorKind::Dlopen(chain(&e)))?;
    let mut name = symbol.as_bytes().to_vec();
    name.push(0);
    // SAFETY: the symbol is a `LibHeader` static (what `export_plugin!` and
    // `#[export_root_module]` emit, read as abi_stable's own loader reads it);
    // `upgrade` checks the header's own ABI before it is used as one.
    let header = unsafe {
        let header: AbiHeaderRef = *library
            .get::<AbiHeaderRef>(&name)
            .map_err(|e| LoadErrorKind::NoRootModule(chain(&e)))?;
        header.upgrade()
    }
    .map_err(|e| LoadErrorKind::AbiMismatch(chain(&e)))?;
    // Never unloaded (see the module docs).
    std::mem::forget(library);
    Ok(header)
}

/// The root module of a dlopened library, and the version and panic checks.
///
/// ABI 2 plugins export their root module under a name of their own
/// (`kvhint_plugin_root_v2__<crate>`), found in the file's dynamic symbols. A
/// file that exports only `abi_stable`'s fixed name was built against
/// plugin-api 0.1: its version strings say which, for the rebuild message.
pub(crate) fn read_root_module(cached: &Path) -> Opened {
    let file = std::fs::File::open(cached).map_err(|e| LoadErrorKind::Dlopen(chain(&e)))?;
    let mut roots = elf::dynamic_symbols_with_prefix(&file, ROOT_SYMBOL_PREFIX)?;
    let header = match roots.len() {
        1 => header_at(cached, &roots.remove(0))?,
        0 => {
            let old = elf::dynamic_symbols_with_prefix(
                &file,
                abi_stable::library::ROOT_MODULE_LOADER_NAME,
            )?;
            if old.is_empty() {
                return Err(LoadErrorKind::NoRootModule(format!(
                    "it exports no `{ROOT_SYMBOL_PREFIX}<crate>` symbol"
                )));
            }
            header_at(cached, abi_stable::library::ROOT_MODULE_LOADER_NAME)?
        }
        _ => {
            return Err(LoadErrorKind::NoRootModule(format!(
                "it exports {} root modules ({}); a plugin file holds one crate's `export_plugin!`",
                roots.len(),
                roots.join(", ")
            )))
        }
    };

    // The version strings are those of the plugin-api crate the plugin was built
    // with; checking them first gives the author the rebuild message instead of
    // a layout diff.
    let plugin_api = header.version_strings().version.as_str().to_string();
    let host_api = PluginModRef::VERSION_STRINGS.version.as_str().to_string();
    if !api_compatible(&plugin_api, &host_api) {
        return Err(LoadErrorKind::IncompatibleApi {
            plugin: plugin_api,
            series: api_series(&host_api),
            host: host_api,
        });
    }
    let module = header
        .init_root_module::<PluginModRef>()
        .map_err(|e| LoadErrorKind::AbiMismatch(chain(&e)))?;
    if module.abi_version() != ABI_VERSION {
        return Err(LoadErrorKind::AbiVersion {
            plugin: module.abi_version(),
        });
    }
    if !module.panic_unwind() {
        return Err(LoadErrorKind::PanicAbort);
    }
    // Before registration runs, so whatever the plugin logs from then on reaches
    // the router's log.
    (module.set_log_sink())(crate::plugin_log::sink());
    Ok((module, module_info(module)))
}

/// What a root module says about itself.
pub fn module_info(module: PluginModRef) -> PluginInfo {
    PluginInfo {
        name: module.name().as_str().to_string(),
        version: module.version().as_str().to_string(),
        api_version: module.api_version().as_str().to_string(),
        abi_version: module.abi_version(),
    }
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    use fmt::Write;
    bytes.iter().fold(String::with_capacity(64), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compatibility_rule() {
        assert!(api_compatible("0.1.0", "0.1.0"));
        assert!(api_compatible("0.1.4", "0.1.2"));
        assert!(!api_compatible("0.1.1", "0.1.2"), "older patch is refused");
        assert!(!api_compatible("0.2.0", "0.1.0"), "another 0.x is refused");
        assert!(!api_compatible("0.0.9", "0.1.0"));
        assert!(api_compatible("1.3.0", "1.2.0"));
        assert!(!api_compatible("1.1.0", "1.2.0"));
        assert!(!api_compatible("2.0.0", "1.2.0"));
        assert!(!api_compatible("garbage", "0.1.0"));
    }

    #[test]
    fn drop_in_names() {
        assert!(is_plugin_file_name(Path::new("/p/libkv_fetch.so")));
        assert!(!is_plugin_file_name(Path::new("/p/.libkv_fetch.so")));
        assert!(!is_plugin_file_name(Path::new("/p/libkv_fetch.so.tmp")));
        assert!(!is_plugin_file_name(Path::new("/p/kv_fetch.so")));
        assert!(!is_plugin_file_name(Path::new("/p/libkv_fetch.txt")));
    }
}
