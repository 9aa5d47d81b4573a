//! The router crate's layering (issue 26, item 4; feeds and doors apart, issue 46,
//! item 5), checked so the architecture the docs describe cannot drift from the code
//! again.
//!
//! `host/src`'s top-level modules are grouped into layers, listed below in order
//! (docs/architecture.md's "The router core, layer by layer" states the same order). A module may name (`use crate::…`, a `crate::…` path, or a `super::…` path
//! that reaches the crate root) only modules of its own layer or of earlier ones, and
//! the modules of one layer must not name each other in a cycle. `domain` names
//! nothing else in the crate.
//!
//! The check reads the source as text rather than asking the compiler: it needs no
//! build, runs in milliseconds, and an import in a comment is not an import (comments
//! are stripped first). A new top-level module fails the check until it is given a
//! layer here, which is the point: its place is decided, not accidental.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The layers, earliest first, each with its top-level modules.
const LAYERS: &[(&str, &[&str])] = &[
    // The words every layer shares, and leaf utilities with no knowledge of the router.
    (
        "domain",
        &["domain", "counters", "splice", "trust", "logging"],
    ),
    // The YAML file → a typed config (knows no loader).
    ("config", &["config"]),
    // What the config names, loaded: plugin files (checked, probed, opened,
    // registered) and the served models' tokenizers and templates.
    (
        "plugins",
        &["plugin_log", "loader", "registry", "catalog", "models"],
    ),
    // The policies a booking runs: selection, the hint stage, the envelope, and the
    // snapshot that holds them per role.
    (
        "policies",
        &[
            "policy_common",
            "selection",
            "hints",
            "envelope",
            "snapshot",
        ],
    ),
    // The data plane: KV index, workers, load, bookings.
    ("router", &["router"]),
    // What feeds the router: engines' KV events, its workers coming and going (the
    // fleet: registrations and the config's lists, each with its subscription), the
    // other replicas' load, and the request path to the workers (booking, adapters,
    // forwarding, health).
    (
        "feeds",
        &["engine_events", "fleet", "replication", "gateway"],
    ),
    // The doors: what the world calls (the HTTP service and the endpoint picker,
    // the API's wire shapes, `check`'s and `plugins`' report, the offline replay,
    // and `testing`, the internals the end-to-end tests reach). A door may import
    // a feed; a feed never imports a door (issue 46, item 5).
    ("doors", &["service", "wire", "report", "replay", "testing"]),
];

/// A module may not name itself up the layers: where one does.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Import {
    file: PathBuf,
    line: usize,
    from: String,
    to: String,
}

fn layer_of(module: &str) -> Option<usize> {
    LAYERS
        .iter()
        .position(|(_, modules)| modules.contains(&module))
}

/// The module path of a source file under `src` (`router/index/mod.rs` →
/// `["router", "index"]`); empty for `lib.rs` and `main.rs`.
fn module_path(src: &Path, file: &Path) -> Vec<String> {
    let relative = file.strip_prefix(src).unwrap_or(file);
    let mut parts: Vec<String> = relative
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    if let Some(last) = parts.pop() {
        let stem = last.trim_end_matches(".rs");
        if !matches!(stem, "mod" | "lib" | "main") {
            parts.push(stem.to_string());
        }
    }
    parts
}

/// `text` with its comments blanked (`//` to the end of the line, `/* … */`), string
/// literals kept whole so a `//` inside one (`"tcp://…"`) is not taken for a comment.
/// Newlines are kept, so byte offsets still give the right line.
fn strip_comments(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        // A raw string (`r"…"`, `r#"…"#`): blanked to its closing quote and hashes.
        if bytes[i] == b'r' && (i == 0 || !is_ident(bytes[i - 1])) {
            let hashes = bytes[i + 1..].iter().take_while(|&&b| b == b'#').count();
            if bytes.get(i + 1 + hashes) == Some(&b'"') {
                let mut close = b"\"".to_vec();
                close.extend(std::iter::repeat_n(b'#', hashes));
                let body = i + 2 + hashes;
                let end = bytes[body..]
                    .windows(close.len())
                    .position(|w| w == close.as_slice())
                    .map_or(bytes.len(), |p| body + p + close.len());
                out.extend(
                    bytes[i..end]
                        .iter()
                        .map(|&b| if b == b'\n' { b'\n' } else { b' ' }),
                );
                i = end;
                continue;
            }
        }
        match bytes[i] {
            b'"' => {
                // A string literal, to its closing quote (escapes skipped).
                out.push(b'"');
                i += 1;
                while i < bytes.len() && bytes[i] != b'"' {
                    if bytes[i] == b'\\' && i + 1 < bytes.len() {
                        out.push(b' ');
                        i += 1;
                    }
                    out.push(if bytes[i] == b'\n' { b'\n' } else { b' ' });
                    i += 1;
                }
                if i < bytes.len() {
                    out.push(b'"');
                    i += 1;
                }
            }
            b'\'' if bytes.get(i + 1) == Some(&b'\\') => {
                // An escaped char literal ('\'', '\\'): blanked to its closing quote.
                let close = bytes
                    .get(i + 2..)
                    .unwrap_or(&[])
                    .iter()
                    .skip(1)
                    .position(|&b| b == b'\'')
                    .map_or(bytes.len(), |p| i + 3 + p + 1);
                out.extend(std::iter::repeat_n(b' ', close.min(bytes.len()) - i));
                i = close.min(bytes.len());
            }
            b'\'' if bytes.get(i + 2) == Some(&b'\'') => {
                // A char literal such as '"' (a lifetime has no closing quote).
                out.extend_from_slice(b"   ");
                i += 3;
            }
            b'/' if bytes.get(i + 1) == Some(&b'/') => {
                while i < bytes.len() && bytes[i] != b'\n' {
                    out.push(b' ');
                    i += 1;
                }
            }
            b'/' if bytes.get(i + 1) == Some(&b'*') => {
                let mut depth = 0usize;
                while i < bytes.len() {
                    if bytes[i..].starts_with(b"/*") {
                        depth += 1;
                        out.extend_from_slice(b"  ");
                        i += 2;
                    } else if bytes[i..].starts_with(b"*/") {
                        depth -= 1;
                        out.extend_from_slice(b"  ");
                        i += 2;
                        if depth == 0 {
                            break;
                        }
                    } else {
                        out.push(if bytes[i] == b'\n' { b'\n' } else { b' ' });
                        i += 1;
                    }
                }
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn is_ident(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// The identifier starting at `at` (after spaces).
fn ident_at(text: &[u8], mut at: usize) -> (String, usize) {
    while at < text.len() && text[at].is_ascii_whitespace() {
        at += 1;
    }
    let start = at;
    while at < text.len() && is_ident(text[at]) {
        at += 1;
    }
    (String::from_utf8_lossy(&text[start..at]).into_owned(), at)
}

/// The crate-root names a path starting at `at` refers to: one identifier, or for a
/// group (`{a::X, b}`) the first identifier of each item, with the offset of each.
fn root_names(text: &[u8], at: usize) -> Vec<(String, usize)> {
    let mut at = at;
    while at < text.len() && text[at].is_ascii_whitespace() {
        at += 1;
    }
    if text.get(at) != Some(&b'{') {
        let (name, _) = ident_at(text, at);
        return vec![(name, at)];
    }
    let mut names = Vec::new();
    let mut depth = 0usize;
    let mut item_start = true;
    while at < text.len() {
        match text[at] {
            b'{' => {
                depth += 1;
                item_start = depth == 1;
                at += 1;
            }
            b'}' => {
                depth -= 1;
                at += 1;
                if depth == 0 {
                    break;
                }
            }
            b',' => {
                item_start = depth == 1;
                at += 1;
            }
            b if b.is_ascii_whitespace() => at += 1,
            _ if item_start => {
                let (name, end) = ident_at(text, at);
                names.push((name, at));
                item_start = false;
                at = end.max(at + 1);
            }
            _ => at += 1,
        }
    }
    names
}

/// Every top-level module `file` (module `path` in the crate) names, with its line.
fn imports_of(text: &str, path: &[String]) -> Vec<(String, usize)> {
    let code = strip_comments(text);
    let bytes = code.as_bytes();
    let line_of = |offset: usize| bytes[..offset].iter().filter(|&&b| b == b'\n').count() + 1;
    let mut found = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let preceded = at > 0 && (is_ident(bytes[at - 1]) || bytes[at - 1] == b'$');
        if !preceded && bytes[at..].starts_with(b"crate::") {
            for (name, offset) in root_names(bytes, at + "crate::".len()) {
                found.push((name, line_of(offset)));
            }
            at += "crate::".len();
        } else if !preceded && bytes[at..].starts_with(b"super::") {
            // `super::super::…`: how far up it goes from this file's module.
            let mut ups = 0;
            let mut end = at;
            while bytes[end..].starts_with(b"super::") {
                ups += 1;
                end += "super::".len();
            }
            if ups == path.len() {
                for (name, offset) in root_names(bytes, end) {
                    found.push((name, line_of(offset)));
                }
            }
            at = end;
        } else {
            at += 1;
        }
    }
    found
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.expect("a directory entry").path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Every import in the crate under `src` that breaks the layering, and every
/// top-level module with no layer, as messages naming file and line.
fn violations(src: &Path) -> Vec<String> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    // The crate's top-level modules, whatever their layer (or none).
    let modules: BTreeSet<String> = files
        .iter()
        .filter_map(|file| module_path(src, file).into_iter().next())
        .collect();
    // Shown from the workspace root: `host/src/…`.
    let root = src.parent().and_then(Path::parent).unwrap_or(src);
    let mut problems = Vec::new();
    let mut same_layer: Vec<Import> = Vec::new();
    for file in &files {
        let path = module_path(src, file);
        let Some(from) = path.first() else {
            // lib.rs declares the modules; main.rs is the CLI, the last layer of all,
            // which reaches the library through `kvhint::`, never `crate::`.
            continue;
        };
        let shown = file.strip_prefix(root).unwrap_or(file);
        let Some(from_layer) = layer_of(from) else {
            problems.push(format!(
                "{}: module `{from}` has no layer: add it to LAYERS in tests/layers.rs (and to the layer list in the architecture docs)",
                shown.display()
            ));
            continue;
        };
        let text = std::fs::read_to_string(file)
            .unwrap_or_else(|e| panic!("reading {}: {e}", file.display()));
        for (to, line) in imports_of(&text, &path) {
            if &to == from || !modules.contains(&to) {
                continue; // Itself, or an item of the crate root rather than a module.
            }
            if from == "domain" {
                problems.push(format!(
                    "{}:{line}: `domain` imports `{to}`: domain names nothing else in the crate",
                    shown.display()
                ));
                continue;
            }
            let Some(to_layer) = layer_of(&to) else {
                continue; // Reported as a module with no layer.
            };
            if to_layer > from_layer {
                problems.push(format!(
                    "{}:{line}: `{from}` ({} layer) imports `{to}` ({} layer), a later layer: move what it needs down, or it up",
                    shown.display(),
                    LAYERS[from_layer].0,
                    LAYERS[to_layer].0
                ));
            } else if to_layer == from_layer {
                same_layer.push(Import {
                    file: shown.to_path_buf(),
                    line,
                    from: from.clone(),
                    to,
                });
            }
        }
    }
    problems.extend(cycles(&same_layer));
    problems
}

/// Cycles among modules of one layer, each named with one import on it.
fn cycles(imports: &[Import]) -> Vec<String> {
    let mut edges: BTreeMap<&str, BTreeMap<&str, &Import>> = BTreeMap::new();
    for import in imports {
        edges
            .entry(&import.from)
            .or_default()
            .entry(&import.to)
            .or_insert(import);
    }
    let reaches = |start: &str, goal: &str| {
        let mut seen = BTreeSet::new();
        let mut todo = vec![start];
        while let Some(at) = todo.pop() {
            if at == goal {
                return true;
            }
            if seen.insert(at) {
                todo.extend(edges.get(at).into_iter().flat_map(|e| e.keys().copied()));
            }
        }
        false
    };
    let mut problems = Vec::new();
    for (from, targets) in &edges {
        for (to, import) in targets {
            if reaches(to, from) {
                problems.push(format!(
                    "{}:{}: `{from}` imports `{to}`, which imports `{from}` back (directly or not): an import cycle; move what they share into a module of its own",
                    import.file.display(),
                    import.line
                ));
            }
        }
    }
    problems
}

/// A `host/src` in a temporary directory, for the checks' own tests to plant files
/// in (the directory lives as long as the returned guard).
fn planted_src() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let src = dir.path().join("host").join("src");
    (dir, src)
}

fn plant(src: &Path, path: &str, text: &str) {
    let path = src.join(path);
    std::fs::create_dir_all(path.parent().expect("a parent")).expect("creates");
    std::fs::write(path, text).expect("writes");
}

fn host_src() -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("host")
        .join("src");
    src.canonicalize()
        .unwrap_or_else(|e| panic!("{}: {e}", src.display()))
}

#[test]
fn host_modules_import_only_down_the_layers() {
    let problems = violations(&host_src());
    assert!(
        problems.is_empty(),
        "imports that break host/src's layering (tests/layers.rs says why):\n{}",
        problems.join("\n")
    );
}

/// The check itself: a planted import up the layers, one from `domain`, a cycle in a
/// layer and a module with no layer are each reported with file and line; imports
/// down the layers, in comments or strings, and a test module's `super::*` are not.
#[test]
fn the_check_catches_imports_up_the_layers() {
    let (_dir, src) = planted_src();
    let write = |path: &str, text: &str| plant(&src, path, text);
    write("lib.rs", "pub mod domain;\npub mod config;\n");
    write(
        "domain.rs",
        "//! Uses [`crate::router`] in a comment only.\nuse crate::config::Config;\nconst A: &str = \"crate::router\";\n",
    );
    write("config/mod.rs", "use crate::domain::Role;\nmod yaml;\n");
    write(
        "config/yaml.rs",
        "use super::super::{domain::Role,\n    snapshot::Snapshot};\n#[cfg(test)]\nmod tests { use super::*; }\n",
    );
    write("selection.rs", "use crate::hints::HintLimits;\n");
    write(
        "hints.rs",
        "fn f() -> crate::selection::Chosen { todo!() }\nconst URL: &str = \"tcp://x\"; use crate::router::Router;\n",
    );
    write("unlayered.rs", "use crate::domain::Role;\n");
    write("snapshot.rs", "");
    write("router.rs", "");
    let mut problems = violations(&src);
    problems.sort();
    let starts: Vec<&str> = problems
        .iter()
        .map(|p| p.split(": ").next().unwrap_or(""))
        .collect();
    assert_eq!(
        starts,
        [
            "host/src/config/yaml.rs:2",
            "host/src/domain.rs:2",
            "host/src/hints.rs:1",
            "host/src/hints.rs:2",
            "host/src/selection.rs:1",
            "host/src/unlayered.rs"
        ],
        "{problems:#?}"
    );
    assert!(problems[0].contains("`config` (config layer) imports `snapshot` (policies layer)"));
    assert!(problems[1].contains("`domain` imports `config`"));
    assert!(problems[2].contains("an import cycle"));
    assert!(problems[3].contains("imports `router` (router layer), a later layer"));
    assert!(problems[4].contains("an import cycle"));
    assert!(problems[5].contains("has no layer"));
}

/// Issue 46, item 5: the feeds (engine events, replication, the gateway's request
/// path) come before the doors (the service, the wire shapes, the report, the
/// replay). A door driving a feed is the direction of the layers; a file under
/// `gateway/` importing one under `service/` runs back up and is reported, in
/// either spelling of the path.
#[test]
fn a_gateway_file_importing_a_service_file_fails_the_check() {
    let (_dir, src) = planted_src();
    let write = |path: &str, text: &str| plant(&src, path, text);
    write(
        "lib.rs",
        "pub mod router;\npub mod gateway;\npub mod replication;\npub mod service;\n",
    );
    write("router.rs", "");
    write("replication.rs", "use crate::router::Router;\n");
    write(
        "gateway/mod.rs",
        "mod adapter;\nuse crate::{router::Router, replication::Load};\n",
    );
    write(
        "gateway/adapter.rs",
        "use crate::router::Router;\nuse crate::service::gateway::book_body;\nfn f(app: &super::super::service::App) {}\n",
    );
    write(
        "service/mod.rs",
        "mod gateway;\nuse crate::gateway::Gateway;\n",
    );
    write(
        "service/gateway.rs",
        "use crate::{gateway::dispatch, replication::Load, router::Router};\n",
    );
    let problems = violations(&src);
    let starts: Vec<&str> = problems
        .iter()
        .map(|p| p.split(": ").next().unwrap_or(""))
        .collect();
    assert_eq!(
        starts,
        [
            "host/src/gateway/adapter.rs:2",
            "host/src/gateway/adapter.rs:3"
        ],
        "{problems:#?}"
    );
    for problem in &problems {
        assert!(
            problem
                .contains("`gateway` (feeds layer) imports `service` (doors layer), a later layer"),
            "{problem}"
        );
    }
}

/// Item 3 of issue 26: the data plane names no ABI type, so the next ABI change
/// stops at the policy stages (`selection`, `hints`), which build the records from
/// the router's plain views.
#[test]
fn the_router_names_no_abi_type() {
    let router = host_src().join("router");
    let mut files = Vec::new();
    rust_files(&router, &mut files);
    let mut found = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file)
            .unwrap_or_else(|e| panic!("reading {}: {e}", file.display()));
        let code = strip_comments(&text);
        for (n, line) in code.lines().enumerate() {
            let ffi = line.match_indices("Ffi").any(|(at, _)| {
                (at == 0 || !is_ident(line.as_bytes()[at - 1]))
                    && line
                        .as_bytes()
                        .get(at + 3)
                        .is_some_and(u8::is_ascii_uppercase)
            });
            if ffi || line.contains("abi_stable") || line.contains("kvhint_plugin_api::abi") {
                let root = router
                    .parent()
                    .and_then(Path::parent)
                    .and_then(Path::parent);
                let shown = root.and_then(|r| file.strip_prefix(r).ok()).unwrap_or(file);
                found.push(format!("{}:{}: {}", shown.display(), n + 1, line.trim()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "the router names ABI types; describe it in plain views and let the stage build the record:\n{}",
        found.join("\n")
    );
}

/// Inside one top-level module (`service`, `gateway`), which of its files names
/// which: each import of a sibling submodule, through `super::…` or
/// `crate::<module>::…`, from the submodule a file belongs to (`metrics/gateway.rs`
/// belongs to `metrics`). The module's own `mod.rs` declares them all and is left
/// out; an item it re-exports (`super::App`) is not a submodule.
fn file_imports(src: &Path, module: &str) -> Vec<Import> {
    let mut files = Vec::new();
    rust_files(&src.join(module), &mut files);
    let subs: BTreeSet<String> = files
        .iter()
        .filter_map(|file| module_path(src, file).get(1).cloned())
        .collect();
    let root = src.parent().and_then(Path::parent).unwrap_or(src);
    let prefix = format!("crate::{module}::");
    let mut out = Vec::new();
    for file in &files {
        let path = module_path(src, file);
        let Some(from) = path.get(1) else { continue };
        let code = strip_comments(&std::fs::read_to_string(file).expect("reads"));
        let bytes = code.as_bytes();
        let line_of = |offset: usize| bytes[..offset].iter().filter(|&&b| b == b'\n').count() + 1;
        let mut at = 0;
        while at < bytes.len() {
            let preceded = at > 0 && is_ident(bytes[at - 1]);
            let start = if preceded {
                None
            } else if bytes[at..].starts_with(prefix.as_bytes()) {
                Some(at + prefix.len())
            } else if bytes[at..].starts_with(b"super::") {
                let mut ups = 0;
                let mut end = at;
                while bytes[end..].starts_with(b"super::") {
                    ups += 1;
                    end += "super::".len();
                }
                at = end;
                (ups == path.len() - 1).then_some(end)
            } else {
                None
            };
            let Some(start) = start else {
                at += 1;
                continue;
            };
            for (to, offset) in root_names(bytes, start) {
                if &to != from && subs.contains(&to) {
                    out.push(Import {
                        file: file.strip_prefix(root).unwrap_or(file).to_path_buf(),
                        line: line_of(offset),
                        from: from.clone(),
                        to,
                    });
                }
            }
            at = start;
        }
    }
    out
}

/// Issue 46, item 3: no loop among the service's files (the listener and the
/// metrics named each other; the error shapes and the front door's handlers did),
/// nor among the gateway's.
#[test]
fn the_service_and_gateway_files_name_each_other_in_no_loop() {
    for module in ["service", "gateway"] {
        let imports = file_imports(&host_src(), module);
        assert!(
            imports.iter().any(|i| i.from != i.to),
            "{module}: no import between its files was found; the check is reading nothing"
        );
        let problems = cycles(&imports);
        assert!(
            problems.is_empty(),
            "import loops among {module}/'s files:\n{}",
            problems.join("\n")
        );
    }
}

/// The check itself: a loop through three service files, in both spellings of a
/// sibling's path, is reported with file and line; an item of `mod.rs` and a
/// one-way import are not.
#[test]
fn a_loop_among_service_files_fails_the_check() {
    let (_dir, src) = planted_src();
    let write = |path: &str, text: &str| plant(&src, path, text);
    write(
        "service/mod.rs",
        "mod app;\nmod listener;\nmod metrics;\npub use app::App;\n",
    );
    write("service/app.rs", "use super::metrics::Metrics;\n");
    write("service/metrics/mod.rs", "mod service;\nuse super::App;\n");
    write(
        "service/metrics/service.rs",
        "// super::super::app is only named here.\nuse crate::service::listener::Phase;\n",
    );
    write("service/listener.rs", "\nfn f(_: &super::app::App) {}\n");
    let mut problems = cycles(&file_imports(&src, "service"));
    problems.sort();
    let starts: Vec<&str> = problems
        .iter()
        .map(|p| p.split(": ").next().unwrap_or(""))
        .collect();
    assert_eq!(
        starts,
        [
            "host/src/service/app.rs:1",
            "host/src/service/listener.rs:2",
            "host/src/service/metrics/service.rs:2"
        ],
        "{problems:#?}"
    );
    assert!(
        problems.iter().all(|p| p.contains("an import cycle")),
        "{problems:#?}"
    );
}
