//! Loading plugin `.so` files, per DESIGN §4.
//!
//! The order of the checks is the point: everything that can be decided from
//! the file's bytes (who wrote it, its pinned hash, whether it is a whole ELF
//! shared object) is decided before `dlopen` runs any of its code, because a
//! bad file can kill the process inside `dlopen` rather than fail it. Then the
//! private copy is opened with `RTLD_NOW | RTLD_LOCAL` (unresolved symbols fail
//! here, with the linker's own message, instead of at the first call), and
//! `abi_stable` reads this file's own root module (`lib_header_from_path` +
//! `init_root_module`; its `load_from_*` helpers cache one module per type and
//! would hand back the first plugin for every file).
//!
//! Libraries are never unloaded: Rust thread-local destructors registered by a
//! plugin would run into unmapped code after `dlclose`. Replaced builds stay
//! mapped; [`Loader::libraries_mapped`] counts them and `max_libraries` caps them.

mod cache;
pub mod elf;
pub mod trust;

pub use cache::default_cache_dir;

use abi_stable::library::{lib_header_from_path, LibraryError, RootModule};
use kvhint_plugin_api::abi::PluginModRef;
use kvhint_plugin_api::{ABI_VERSION, API_VERSION};
use parking_lot::Mutex;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::fmt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

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

/// Settings of the loader.
#[derive(Debug, Clone)]
pub struct LoaderOptions {
    pub cache_dir: PathBuf,
    /// How many distinct plugin libraries may be mapped over the process's life.
    pub max_libraries: usize,
}

impl LoaderOptions {
    /// The loader settings a config's `plugins:` section asks for.
    pub fn from_config(plugins: &crate::config::PluginsConfig) -> Self {
        let mut options = Self {
            max_libraries: plugins.max_libraries,
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
            max_libraries: 64,
        }
    }
}

/// What dlopening one library gave: its module, or why it was refused.
type Opened = Result<(PluginModRef, PluginInfo), LoadErrorKind>;

/// Loads plugin files; one per process, shared by every reload.
pub struct Loader {
    cache: cache::PluginCache,
    max_libraries: usize,
    /// Every library dlopened so far, by content hash: its module, or why it
    /// was refused after dlopen (it stays mapped either way, and is not opened
    /// again).
    mapped: Mutex<HashMap<String, Opened>>,
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
            cache: cache::PluginCache::open(&options.cache_dir)?,
            max_libraries: options.max_libraries,
            mapped: Mutex::new(HashMap::new()),
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
        let mut bytes = Vec::with_capacity(opened.len() as usize);
        std::io::Read::read_to_end(&mut file, &mut bytes)
            .map_err(|e| fail(LoadErrorKind::Io(e.to_string())))?;
        let sha256 = hex(&Sha256::digest(&bytes));
        if let Some(expected) = pin {
            if !expected.eq_ignore_ascii_case(&sha256) {
                return Err(fail(LoadErrorKind::PinMismatch {
                    expected: expected.to_string(),
                    found: sha256,
                }));
            }
        }
        elf::check_shared_object(&bytes).map_err(|e| fail(e.into()))?;

        let mut mapped = self.mapped.lock();
        let stem = path
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or("plugin");
        if let Some(known) = mapped.get(&sha256) {
            // Same content as a library already mapped: nothing to do.
            let (module, info) = known.as_ref().map_err(|kind| fail(kind.clone()))?;
            return Ok(LoadedPlugin {
                path: path.to_path_buf(),
                cached_path: self
                    .cache
                    .dir()
                    .join(format!("{stem}-{}.so", sha256.get(..16).unwrap_or(&sha256))),
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
        let cached_path = self
            .cache
            .store(stem, &sha256, &bytes)
            .map_err(|e| fail(LoadErrorKind::Cache(e)))?;
        dlopen(&cached_path).map_err(fail)?;
        // From here the library is mapped for good, whatever the checks say.
        let opened = read_root_module(&cached_path);
        mapped.insert(sha256.clone(), opened.clone());
        let (module, info) = opened.map_err(fail)?;
        tracing::info!(
            plugin = %info.name,
            version = %info.version,
            file = %path.display(),
            sha256 = %sha256,
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
}

/// dlopen of the private copy, with `RTLD_NOW | RTLD_LOCAL`.
fn dlopen(cached: &Path) -> Result<(), LoadErrorKind> {
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

/// The root module of a dlopened library, and the version and panic checks.
fn read_root_module(cached: &Path) -> Opened {
    let header = lib_header_from_path(cached).map_err(|e| match e {
        LibraryError::GetSymbolError { .. } => LoadErrorKind::NoRootModule(format!(
            "it does not export `{}`",
            abi_stable::library::ROOT_MODULE_LOADER_NAME
        )),
        LibraryError::OpenError { .. } => LoadErrorKind::Dlopen(chain(&e)),
        other => LoadErrorKind::AbiMismatch(chain(&other)),
    })?;

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
    // the router's log. `None` only for a root module without the field, which
    // `init_root_module` has already refused; then the plugin's logs would just
    // stay silent.
    if let Some(set_log_sink) = module.set_log_sink() {
        set_log_sink(crate::plugin_log::sink());
    }
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

fn hex(bytes: &[u8]) -> String {
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
