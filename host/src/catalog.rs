//! Plugin files → a registry, with one report per file.
//!
//! This is the one place that turns the configured plugin sources (a directory
//! and explicitly listed files) into registered policy types. `kvhint plugins`,
//! `kvhint check` and every snapshot build use it, so what the listing says is
//! what the router does.

use crate::loader::{self, LoadError, LoadedPlugin, Loader};
use crate::registry::{Origin, PolicyKind, Registry};
use std::path::{Path, PathBuf};

pub use crate::config::PluginFile;

/// What happened to one file.
#[derive(Debug)]
pub struct FileReport {
    pub path: PathBuf,
    pub result: Result<LoadedFile, Vec<String>>,
}

#[derive(Debug)]
pub struct LoadedFile {
    pub plugin: LoadedPlugin,
    /// The hint types it registered, in its order.
    pub hint_types: Vec<String>,
    /// The selection types it registered, in its order.
    pub selection_types: Vec<String>,
}

/// The files to load: the directory's `lib*.so` sorted by name, then the
/// explicit files in the order given. A file named both ways is loaded once,
/// and keeps whichever sha256 pin it was given (two different pins are an
/// error).
pub fn plugin_files(
    directory: Option<&Path>,
    explicit: &[PluginFile],
    pins: &dyn Fn(&Path) -> Option<String>,
) -> Result<Vec<PluginFile>, LoadError> {
    let mut files: Vec<PluginFile> = match directory {
        Some(dir) => loader::discover(dir)?
            .into_iter()
            .map(|path| PluginFile {
                sha256: pins(&path),
                path,
            })
            .collect(),
        None => Vec::new(),
    };
    let same = |a: &Path, b: &Path| {
        a == b || matches!((a.canonicalize(), b.canonicalize()), (Ok(x), Ok(y)) if x == y)
    };
    for file in explicit {
        match files.iter_mut().find(|f| same(&f.path, &file.path)) {
            None => files.push(file.clone()),
            // Named both ways: loaded once, and an explicit pin still applies.
            Some(found) => match (&found.sha256, &file.sha256) {
                (_, None) => {}
                (None, Some(pin)) => found.sha256 = Some(pin.clone()),
                (Some(a), Some(b)) if a.eq_ignore_ascii_case(b) => {}
                (Some(a), Some(b)) => {
                    return Err(LoadError {
                        path: file.path.clone(),
                        kind: loader::LoadErrorKind::ConflictingPins {
                            explicit: b.clone(),
                            directory: a.clone(),
                        },
                    })
                }
            },
        }
    }
    Ok(files)
}

/// Loads each file and registers its hint types. A file that fails to load or
/// register changes nothing in `registry`; its report says why.
pub fn load_into(
    loader: &Loader,
    registry: &mut Registry,
    files: &[PluginFile],
) -> Vec<FileReport> {
    files
        .iter()
        .map(|file| FileReport {
            path: file.path.clone(),
            result: load_one(loader, registry, file),
        })
        .collect()
}

fn load_one(
    loader: &Loader,
    registry: &mut Registry,
    file: &PluginFile,
) -> Result<LoadedFile, Vec<String>> {
    let plugin = loader
        .load(&file.path, file.sha256.as_deref())
        .map_err(|e| vec![e.to_string()])?;
    let origin = Origin::Plugin {
        path: file.path.clone(),
        name: plugin.info.name.clone(),
        version: plugin.info.version.clone(),
    };
    let before: Vec<String> = registry.types().map(|t| t.name.clone()).collect();
    registry
        .add_module(origin, plugin.module)
        .map_err(|errors| errors.iter().map(|e| e.to_string()).collect::<Vec<_>>())?;
    let added = |kind: PolicyKind| {
        registry
            .types()
            .filter(|t| t.kind() == kind && !before.contains(&t.name))
            .map(|t| t.name.clone())
            .collect()
    };
    Ok(LoadedFile {
        hint_types: added(PolicyKind::Hint),
        selection_types: added(PolicyKind::Selection),
        plugin,
    })
}
