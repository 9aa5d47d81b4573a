//! The documentation stays true where a machine can check it. In `README.md`,
//! `BENCHMARKS.md` and `docs/*.md`:
//!
//! - every test a doc names exists: `target::test_name`, `` `target`: `test_name` ``,
//!   and any bare name shaped like a test's (six words or more in snake case)
//!   must be a function in the workspace;
//! - every `cargo …` command names packages, test, bench and binary targets that
//!   exist, and a test filter after `--` matches a test of its target;
//! - every `kvhint …` command names a subcommand the binary has;
//! - every repository path a doc names (in inline code, or as a link) exists;
//! - `.ci/run` runs exactly the README's test command;
//! - the guide's selection-policy quick path runs as written
//!   (`the_selection_quick_path_runs_as_written`): its whole `lib.rs` built into a
//!   `.so` with its own tests passing, a router started on its first config, the
//!   `.so` dropped in, and each `kvhint` and `curl` output it shows (the second
//!   config's check, the reload, the bookings the policy placed) matching what
//!   the command prints.
//!
//! The reference checks read the files and `cargo metadata`; they build nothing.
//! Each is a function over a document's text, so `each_check_catches_a_planted_bad_reference`
//! shows that each one fails on a bad reference.

use kvhint_e2e::workspace_root;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

/// A target of a workspace package: its kind (`test`, `bench`, `bin`, …) and the
/// function names its source file defines.
struct Target {
    kind: String,
    fns: BTreeSet<String>,
}

/// What the documents are checked against.
struct Workspace {
    root: PathBuf,
    /// Package name → target name → target.
    packages: BTreeMap<String, BTreeMap<String, Target>>,
    /// Every function name defined in the workspace's Rust sources.
    fns: BTreeSet<String>,
    /// The `kvhint` binary's subcommands.
    subcommands: BTreeSet<String>,
}

/// The function names a Rust source defines (`fn name`).
fn fn_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("fn ") {
        let before = rest[..at].chars().last();
        rest = &rest[at + 3..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let name: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() {
            names.insert(name);
        }
    }
    names
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        if name == "target" || name.to_string_lossy().starts_with('.') {
            continue;
        }
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The `kvhint` subcommands, from `host/src/main.rs`'s `enum Command`: each
/// variant in kebab case, or the name its `#[command(name = …)]` gives.
fn subcommands(main_rs: &str) -> BTreeSet<String> {
    let start = main_rs
        .find("enum Command {")
        .expect("host/src/main.rs has `enum Command`");
    let mut names = BTreeSet::new();
    let mut renamed: Option<String> = None;
    for line in main_rs[start..].lines().skip(1) {
        if line.starts_with('}') {
            break;
        }
        if let Some(body) = line.strip_prefix("    #[command(") {
            if let Some(at) = body.find("name = \"") {
                let name = &body[at + 8..];
                renamed = name.split('"').next().map(str::to_string);
            }
            continue;
        }
        let Some(variant) = line.strip_prefix("    ") else {
            continue;
        };
        if !variant.starts_with(|c: char| c.is_ascii_uppercase()) {
            continue;
        }
        let ident: String = variant
            .chars()
            .take_while(|c| c.is_alphanumeric())
            .collect();
        let kebab = ident
            .chars()
            .enumerate()
            .fold(String::new(), |mut s, (i, c)| {
                if c.is_ascii_uppercase() && i > 0 {
                    s.push('-');
                }
                s.push(c.to_ascii_lowercase());
                s
            });
        names.insert(renamed.take().unwrap_or(kebab));
    }
    names
}

impl Workspace {
    fn load() -> Self {
        let root = workspace_root();
        let output = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
            .args([
                "metadata",
                "--no-deps",
                "--format-version",
                "1",
                "--offline",
            ])
            .current_dir(&root)
            .output()
            .expect("cargo metadata runs");
        assert!(
            output.status.success(),
            "cargo metadata: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let metadata: Value = serde_json::from_slice(&output.stdout).expect("cargo metadata JSON");
        let mut packages = BTreeMap::new();
        for package in metadata["packages"].as_array().expect("packages") {
            let mut targets = BTreeMap::new();
            for target in package["targets"].as_array().expect("targets") {
                let src = target["src_path"].as_str().unwrap_or_default();
                targets.insert(
                    target["name"].as_str().unwrap_or_default().to_string(),
                    Target {
                        kind: target["kind"][0].as_str().unwrap_or_default().to_string(),
                        fns: fn_names(&std::fs::read_to_string(src).unwrap_or_default()),
                    },
                );
            }
            packages.insert(
                package["name"].as_str().unwrap_or_default().to_string(),
                targets,
            );
        }
        let mut files = Vec::new();
        for dir in ["host", "plugin-api", "plugins", "tests"] {
            rust_files(&root.join(dir), &mut files);
        }
        let fns = files
            .iter()
            .flat_map(|f| fn_names(&std::fs::read_to_string(f).unwrap_or_default()))
            .collect();
        let main_rs = std::fs::read_to_string(root.join("host/src/main.rs")).unwrap();
        Self {
            subcommands: subcommands(&main_rs),
            root,
            packages,
            fns,
        }
    }

    /// The test targets of every package, by name (for `target::test`).
    fn test_target(&self, name: &str) -> Option<&Target> {
        self.packages
            .values()
            .filter_map(|targets| targets.get(name))
            .find(|t| t.kind == "test")
    }
}

/// A document: its path from the workspace root and its text.
struct Doc {
    path: String,
    text: String,
}

fn documents(root: &Path) -> Vec<Doc> {
    let mut paths = vec!["README.md".to_string(), "BENCHMARKS.md".to_string()];
    let mut in_docs: Vec<String> = std::fs::read_dir(root.join("docs"))
        .expect("docs/")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".md"))
        .map(|n| format!("docs/{n}"))
        .collect();
    in_docs.sort();
    paths.extend(in_docs);
    paths
        .into_iter()
        .map(|path| Doc {
            text: std::fs::read_to_string(root.join(&path)).unwrap(),
            path,
        })
        .collect()
}

/// A piece of a document to check, with its line number.
struct Piece {
    line: usize,
    text: String,
}

/// The lines inside fenced code blocks.
fn fenced_lines(text: &str) -> Vec<Piece> {
    let mut fenced = false;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if fenced {
            out.push(Piece {
                line: i + 1,
                text: line.to_string(),
            });
        }
    }
    out
}

/// The inline code spans outside fenced blocks (a span may cross a line break).
fn code_spans(text: &str) -> Vec<Piece> {
    let mut out = Vec::new();
    let mut fenced = false;
    let mut prose = String::new();
    let mut line_of = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            prose.push('\n');
            line_of.push(i + 1);
            continue;
        }
        if !fenced {
            for _ in line.chars() {
                line_of.push(i + 1);
            }
            prose.push_str(line);
        }
        prose.push('\n');
        line_of.push(i + 1);
    }
    let chars: Vec<char> = prose.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        if chars[i] != '`' {
            i += 1;
            continue;
        }
        // A run of backticks opens a span closed by a run of the same length.
        let ticks = chars[i..].iter().take_while(|c| **c == '`').count();
        let start = i + ticks;
        let mut j = start;
        let mut end = None;
        while j < chars.len() {
            if chars[j] == '`' {
                let run = chars[j..].iter().take_while(|c| **c == '`').count();
                if run == ticks {
                    end = Some(j);
                    break;
                }
                j += run;
            } else if chars[j] == '\n' && chars.get(j + 1) == Some(&'\n') {
                break; // a paragraph ends; an unclosed backtick is literal
            } else {
                j += 1;
            }
        }
        match end {
            Some(end) => {
                let text: String = chars[start..end].iter().collect();
                out.push(Piece {
                    line: line_of.get(start).copied().unwrap_or(0),
                    text: text.trim().replace('\n', " "),
                });
                i = end + ticks;
            }
            None => i = start,
        }
    }
    out
}

/// Markdown link targets outside fenced blocks: `](target)`.
fn links(text: &str) -> Vec<Piece> {
    let mut out = Vec::new();
    let mut fenced = false;
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        let mut rest = line;
        while let Some(at) = rest.find("](") {
            rest = &rest[at + 2..];
            if let Some(end) = rest.find(')') {
                out.push(Piece {
                    line: i + 1,
                    text: rest[..end].to_string(),
                });
                rest = &rest[end..];
            }
        }
    }
    out
}

fn is_snake_ident(s: &str) -> bool {
    !s.is_empty()
        && s.starts_with(|c: char| c.is_ascii_lowercase())
        && s.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

/// Test names: `target::name`, `target`: `name`, and bare test-shaped names.
fn check_test_names(ws: &Workspace, doc: &Doc) -> Vec<String> {
    let mut problems = Vec::new();
    let spans = code_spans(&doc.text);
    let mut named_after_target = BTreeSet::new();
    for (k, span) in spans.iter().enumerate() {
        let text = span.text.as_str();
        if named_after_target.contains(&k) {
            continue;
        }
        if let Some((target, name)) = text.split_once("::") {
            if let (Some(target_fns), true) = (ws.test_target(target), is_snake_ident(name)) {
                if !target_fns.fns.contains(name) {
                    problems.push(format!(
                        "{}:{}: `{text}`: test target `{target}` has no test `{name}`",
                        doc.path, span.line
                    ));
                }
                continue;
            }
        }
        // `target`: `name` (the name right after a test target and a colon).
        if let Some(target) = ws.test_target(text) {
            if let Some(next) = spans.get(k + 1) {
                if next.line == span.line && is_snake_ident(&next.text) && next.text.contains('_') {
                    let line = doc.text.lines().nth(span.line - 1).unwrap_or_default();
                    let colon = format!("`{text}`: `{}`", next.text);
                    if line.contains(&colon) {
                        named_after_target.insert(k + 1);
                        if !target.fns.contains(&next.text) {
                            problems.push(format!(
                                "{}:{}: `{text}` has no test `{}`",
                                doc.path, span.line, next.text
                            ));
                        }
                    }
                }
            }
        }
        if is_snake_ident(text)
            && text.matches('_').count() >= 5
            && !text.starts_with("kvhint_")
            && !ws.fns.contains(text)
        {
            problems.push(format!(
                "{}:{}: `{text}` looks like a test name, and no function in the workspace has it",
                doc.path, span.line
            ));
        }
    }
    problems
}

/// A token that stands for something the reader fills in, or a pattern.
fn is_placeholder(token: &str) -> bool {
    token.chars().any(|c| "<>*{}…$|[]".contains(c))
        || (token.chars().any(|c| c.is_ascii_uppercase())
            && !token.chars().any(|c| c.is_ascii_lowercase()))
}

/// Every `cargo …` and `kvhint …` command, in code spans and fenced blocks.
fn commands(doc: &Doc) -> Vec<Piece> {
    let mut out = Vec::new();
    for piece in code_spans(&doc.text)
        .into_iter()
        .chain(fenced_lines(&doc.text))
    {
        let text = piece.text.trim_start_matches("$ ");
        // A line may chain commands (`cargo build … && ./target/debug/kvhint …`).
        for part in text.split("&&").flat_map(|p| p.split(';')) {
            let words: Vec<&str> = part.split_whitespace().collect();
            // Skip environment assignments (`BOOKING_CASES=… cargo bench`).
            let start = words
                .iter()
                .position(|w| !w.contains('=') || w.starts_with('-'))
                .unwrap_or(words.len());
            let words = &words[start..];
            let Some(first) = words.first() else {
                continue;
            };
            if *first == "cargo" || *first == "kvhint" || first.ends_with("/kvhint") {
                out.push(Piece {
                    line: piece.line,
                    text: words.join(" "),
                });
            }
        }
    }
    out
}

fn check_commands(ws: &Workspace, doc: &Doc) -> Vec<String> {
    let mut problems = Vec::new();
    for command in commands(doc) {
        let words: Vec<&str> = command.text.split_whitespace().collect();
        let mut problem = |what: String| {
            problems.push(format!(
                "{}:{}: `{}`: {what}",
                doc.path, command.line, command.text
            ))
        };
        if words[0] != "cargo" {
            // kvhint SUBCOMMAND …
            // A word, not a flag or the version line `kvhint --version` prints.
            if let Some(sub) = words.get(1).filter(|sub| {
                sub.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
                    && !is_placeholder(sub)
            }) {
                if !ws.subcommands.contains(*sub) {
                    problem(format!(
                        "kvhint has no subcommand `{sub}` (it has {:?})",
                        ws.subcommands
                    ));
                }
            }
            for word in &words[1..] {
                if word.starts_with("examples/") && !ws.root.join(word).exists() {
                    problem(format!("`{word}` does not exist"));
                }
            }
            continue;
        }
        let Some(sub) = words.get(1) else { continue };
        if !["test", "bench", "build", "run", "clippy", "check"].contains(sub) {
            continue;
        }
        let until_dashes = words.iter().position(|w| *w == "--").unwrap_or(words.len());
        let mut packages = Vec::new();
        let mut targets: Vec<(&str, &str)> = Vec::new();
        let mut i = 2;
        while i < until_dashes {
            let flag = words[i];
            let value = words.get(i + 1).copied().filter(|_| i + 1 < until_dashes);
            match (flag, value) {
                ("-p" | "--package", Some(v)) => {
                    packages.push(v);
                    i += 1;
                }
                ("--test", Some(v)) => {
                    targets.push(("test", v));
                    i += 1;
                }
                ("--bench", Some(v)) => {
                    targets.push(("bench", v));
                    i += 1;
                }
                ("--bin", Some(v)) => {
                    targets.push(("bin", v));
                    i += 1;
                }
                _ => {}
            }
            i += 1;
        }
        packages.retain(|p| !is_placeholder(p));
        for package in &packages {
            if !ws.packages.contains_key(*package) {
                problem(format!("no workspace package `{package}`"));
            }
        }
        let in_packages: Vec<&BTreeMap<String, Target>> = if packages.is_empty() {
            ws.packages.values().collect()
        } else {
            packages
                .iter()
                .filter_map(|p| ws.packages.get(*p))
                .collect()
        };
        for (kind, name) in &targets {
            if is_placeholder(name) {
                continue;
            }
            let found: Vec<&Target> = in_packages
                .iter()
                .filter_map(|t| t.get(*name))
                .filter(|t| t.kind == *kind)
                .collect();
            if found.is_empty() {
                problem(format!("no {kind} target `{name}`"));
                continue;
            }
            // A test filter after `--` must match a test of the target.
            if *kind == "test" {
                for filter in words[until_dashes..]
                    .iter()
                    .skip(1)
                    .filter(|w| !w.starts_with('-') && !is_placeholder(w))
                {
                    if !found
                        .iter()
                        .any(|t| t.fns.iter().any(|f| f.contains(*filter)))
                    {
                        problem(format!("no test of `{name}` matches the filter `{filter}`"));
                    }
                }
            }
        }
    }
    problems
}

/// The top-level entries a repository path may start with.
fn repo_roots(root: &Path) -> BTreeSet<String> {
    std::fs::read_dir(root)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n != "target" && n != ".git")
        .collect()
}

/// Paths in code spans (from the workspace root, or from `host/src` as the
/// architecture's module paths are written) and in links (from the document).
fn check_paths(ws: &Workspace, doc: &Doc) -> Vec<String> {
    let roots = repo_roots(&ws.root);
    let host_src = repo_roots(&ws.root.join("host/src"));
    let mut problems = Vec::new();
    for span in code_spans(&doc.text) {
        let text = span.text.trim_end_matches([',', '.', ':']);
        if text.contains(' ') || is_placeholder(text) || text.starts_with('/') {
            continue;
        }
        let path = text.split('#').next().unwrap_or_default();
        let path = path.split(':').next().unwrap_or_default();
        let first = path.split('/').next().unwrap_or_default();
        let looks_like_a_file = path.contains('/')
            || [".rs", ".md", ".toml", ".yaml", ".jsonl", ".py", ".txt"]
                .iter()
                .any(|e| path.ends_with(e));
        if !looks_like_a_file {
            continue;
        }
        if roots.contains(first) {
            if !ws.root.join(path).exists() {
                problems.push(format!(
                    "{}:{}: `{text}` does not exist",
                    doc.path, span.line
                ));
            }
        } else if host_src.contains(first) && path.contains('/') {
            let in_host = ws.root.join("host/src").join(path);
            if !in_host.exists() && !ws.root.join(path).exists() {
                problems.push(format!(
                    "{}:{}: `{text}` does not exist (from the root or host/src)",
                    doc.path, span.line
                ));
            }
        }
    }
    let dir = Path::new(&doc.path).parent().unwrap_or(Path::new(""));
    for link in links(&doc.text) {
        let target = link.text.split('#').next().unwrap_or_default();
        if target.is_empty() || target.contains("://") || target.starts_with("mailto:") {
            continue;
        }
        if !ws.root.join(dir).join(target).exists() {
            problems.push(format!(
                "{}:{}: the link `{}` leads nowhere",
                doc.path, link.line, link.text
            ));
        }
    }
    problems
}

fn all_problems(ws: &Workspace, doc: &Doc) -> Vec<String> {
    let mut problems = check_test_names(ws, doc);
    problems.extend(check_commands(ws, doc));
    problems.extend(check_paths(ws, doc));
    problems
}

#[test]
fn every_test_command_and_file_the_docs_name_exists() {
    let ws = Workspace::load();
    let docs = documents(&ws.root);
    assert!(
        docs.len() >= 5,
        "README, BENCHMARKS and docs/: {}",
        docs.len()
    );
    let problems: Vec<String> = docs.iter().flat_map(|d| all_problems(&ws, d)).collect();
    assert!(
        problems.is_empty(),
        "{} stale references:\n{}",
        problems.len(),
        problems.join("\n")
    );
    // The checks saw what they are for: commands and paths in every document
    // that has them.
    let commands: usize = docs.iter().map(|d| commands(d).len()).sum();
    assert!(commands >= 20, "commands found: {commands}");
}

#[test]
fn each_check_catches_a_planted_bad_reference() {
    let ws = Workspace::load();
    let planted = Doc {
        path: "docs/planted.md".into(),
        text: [
            "A test: `rules::r1_no_such_rule_test`.",
            "A hole | `config_errors`: `a_case_that_config_errors_never_had` |",
            "A bare one: `r1_hint_policies_never_change_the_booked_worker_twice`.",
            "Run `cargo test -p kvhint-e2e --test no_such_test`.",
            "```sh",
            "cargo bench -p kvhint-e2e --bench no_such_bench",
            "cargo test -p no-such-package",
            "cargo test -p kvhint-e2e --test rules -- no_rule_matches_this_filter",
            "./target/debug/kvhint frobnicate --config examples/no-such.yaml",
            "```",
            "See `host/src/no_such_module.rs`, `router/no_such.rs` and [this](no-such.md).",
        ]
        .join("\n"),
    };
    let problems = all_problems(&ws, &planted);
    let expected = [
        "`rules::r1_no_such_rule_test`",
        "has no test `a_case_that_config_errors_never_had`",
        "`r1_hint_policies_never_change_the_booked_worker_twice` looks like a test name",
        "no test target `no_such_test`",
        "no bench target `no_such_bench`",
        "no workspace package `no-such-package`",
        "matches the filter `no_rule_matches_this_filter`",
        "no subcommand `frobnicate`",
        "`examples/no-such.yaml` does not exist",
        "`host/src/no_such_module.rs` does not exist",
        "`router/no_such.rs` does not exist",
        "the link `no-such.md` leads nowhere",
    ];
    for what in expected {
        assert!(
            problems.iter().any(|p| p.contains(what)),
            "not caught: {what}\nfound:\n{}",
            problems.join("\n")
        );
    }
    assert_eq!(problems.len(), expected.len(), "{}", problems.join("\n"));
    // And the real names pass the same checks.
    let real = Doc {
        path: "docs/real.md".into(),
        text: "`rules::r1_hint_policies_never_change_the_booked_worker`, `cargo test -p kvhint-e2e --test docs`, `host/src/router/mod.rs`, [readme](../README.md)".into(),
    };
    assert_eq!(all_problems(&ws, &real), Vec::<String>::new());
}

/// The README's two set-up commands, and `.ci/run` running exactly its test command.
#[test]
fn ci_runs_exactly_the_readmes_test_command() {
    let root = workspace_root();
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let set_up = &readme[readme.find("## Set up").expect("README has Set up")..];
    let block = &set_up[set_up.find("```sh\n").expect("Set up has a sh block") + 6..];
    let block = &block[..block.find("```").unwrap()];
    let commands: Vec<&str> = block
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    assert_eq!(
        commands,
        [
            "cargo build -p kvhint -p harness-prefetch && ./target/debug/kvhint replay --config examples/kvhint.yaml --trace examples/trace.jsonl",
            "cargo test --workspace",
        ],
        "the README's two set-up commands: the main job on the bundled example, and the whole test suite"
    );
    let ci = std::fs::read_to_string(root.join(".ci/run")).unwrap();
    let tests: Vec<&str> = ci
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("cargo test") && !l.contains("--benches"))
        .collect();
    assert_eq!(
        tests,
        [commands[1]],
        ".ci/run runs the README's test command"
    );
}

/// One `$ ` command of a console block (a heredoc's lines included) and the
/// lines shown after it.
struct Step {
    command: String,
    output: Vec<String>,
}

/// What the selection quick path holds, in document order: console steps, and
/// the files it shows in full (`toml`: the crate's `Cargo.toml`; `rust`: its
/// `src/lib.rs`).
enum Part {
    Steps(Vec<Step>),
    File { lang: String, text: String },
}

/// The parts between `<!-- selection-path:start -->` and `…:end -->` of
/// `docs/writing-a-plugin.md`.
fn selection_path(guide: &str) -> Vec<Part> {
    let start = guide
        .find("<!-- selection-path:start -->")
        .expect("the guide marks the selection quick path's start");
    let end = guide
        .find("<!-- selection-path:end -->")
        .expect("the guide marks the selection quick path's end");
    let mut parts = Vec::new();
    let mut fence: Option<String> = None;
    let mut body: Vec<&str> = Vec::new();
    for line in guide[start..end].lines() {
        match (&fence, line.strip_prefix("```")) {
            (None, Some(lang)) => fence = Some(lang.trim().to_string()),
            (Some(lang), Some(_)) => {
                match lang.as_str() {
                    "console" => parts.push(Part::Steps(console_steps(&body))),
                    "toml" | "rust" => parts.push(Part::File {
                        lang: lang.clone(),
                        text: body.iter().map(|l| format!("{l}\n")).collect(),
                    }),
                    _ => {}
                }
                fence = None;
                body.clear();
            }
            (Some(_), None) => body.push(line),
            (None, None) => {}
        }
    }
    parts
}

fn console_steps(lines: &[&str]) -> Vec<Step> {
    let mut steps: Vec<Step> = Vec::new();
    let mut heredoc: Option<String> = None;
    for line in lines {
        if let Some(delimiter) = &heredoc {
            let step = steps.last_mut().expect("a heredoc follows its command");
            step.command.push('\n');
            step.command.push_str(line);
            if line == delimiter {
                heredoc = None;
            }
        } else if let Some(command) = line.strip_prefix("$ ") {
            if let Some(at) = command.find("<<'") {
                heredoc = command[at + 3..].split('\'').next().map(str::to_string);
            }
            steps.push(Step {
                command: command.to_string(),
                output: Vec::new(),
            });
        } else if let Some(step) = steps.last_mut() {
            step.output.push(line.to_string());
        }
    }
    steps
}

/// Each shown line against the actual one: as JSON when both are JSON, else as text.
fn same_output(shown: &[String], actual: &str) -> bool {
    let actual: Vec<&str> = actual.lines().collect();
    shown.len() == actual.len()
        && shown.iter().zip(&actual).all(|(s, a)| {
            match (
                serde_json::from_str::<Value>(s),
                serde_json::from_str::<Value>(a),
            ) {
                (Ok(s), Ok(a)) => s == a,
                _ => s.trim_end() == a.trim_end(),
            }
        })
}

/// The guide's selection-policy quick path, run as written: its `Cargo.toml`
/// and whole `lib.rs` become the crate its `cargo new` made, whose own tests
/// must pass and print the lines shown. A `kvhint serve` is started on the
/// section's first config; every other command (the build, the drop-in, the
/// second config, …) runs in `sh`, in order, with the
/// section's paths moved to a private directory and its address to the
/// router's, and every `kvhint` and `curl` output must match the one shown:
/// the check of the second config, the reload that applies it, and the
/// bookings placed by the new policy.
#[test]
fn the_selection_quick_path_runs_as_written() {
    let root = workspace_root();
    let guide = std::fs::read_to_string(root.join("docs/writing-a-plugin.md")).unwrap();
    let parts = selection_path(&guide);
    let steps: Vec<&Step> = parts
        .iter()
        .flat_map(|p| match p {
            Part::Steps(steps) => steps.iter().collect(),
            Part::File { .. } => Vec::new(),
        })
        .collect();
    let files: Vec<&str> = parts
        .iter()
        .filter_map(|p| match p {
            Part::File { lang, .. } => Some(lang.as_str()),
            Part::Steps(_) => None,
        })
        .collect();
    assert_eq!(
        files,
        ["toml", "rust"],
        "the whole Cargo.toml, then the whole lib.rs"
    );
    // It shows each piece the path needs.
    for piece in [
        "cargo test",
        "cargo build",
        "kvhint serve",
        "mv ",
        "kvhint check",
        "/admin/reload",
        "/book",
    ] {
        assert!(
            steps.iter().any(|s| s.command.contains(piece)),
            "the quick path has no `{piece}` step"
        );
    }
    let configs: Vec<&&Step> = steps
        .iter()
        .filter(|s| s.command.starts_with("cat > /tmp/sel/kvhint.yaml"))
        .collect();
    assert_eq!(configs.len(), 2, "the config before and after");
    assert!(
        !configs[0].command.contains("least_busy")
            && configs[1].command.contains("decode: least_busy")
    );
    assert!(steps.iter().any(|s| s.command.contains("/book")
        && s.output
            .iter()
            .all(|o| o.contains(r#""selection_policy":"least_busy""#))));

    let private = kvhint_e2e::private_dir();
    let base = private.path().join("sel");
    // Kept between runs, so only the first compiles the plugin-api's dependencies.
    let target = kvhint_e2e::target_dir().join("docs-selection-path");
    let moved = |text: &str| {
        text.replace("/tmp/sel-target", &target.display().to_string())
            .replace("/tmp/sel", &base.display().to_string())
            .replace("path/to/kvhint", &root.display().to_string())
    };
    let shown_paths = |text: &str| {
        text.replace(&target.display().to_string(), "/tmp/sel-target")
            .replace(&base.display().to_string(), "/tmp/sel")
    };
    let kvhint_dir = kvhint_e2e::build_dir();
    let cargo = PathBuf::from(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    let mut path =
        std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()).collect::<Vec<_>>();
    path.insert(0, kvhint_dir.to_path_buf());
    if let Some(dir) = cargo.parent().filter(|d| !d.as_os_str().is_empty()) {
        path.insert(1, dir.to_path_buf());
    }
    let path = std::env::join_paths(path).unwrap();
    let cwd_file = private.path().join("cwd");
    let mut cwd = private.path().to_path_buf();
    let mut server: Option<kvhint_e2e::Server> = None;
    let mut mismatches = Vec::new();

    for part in &parts {
        let steps = match part {
            Part::File { lang, text } => {
                if lang == "toml" {
                    std::fs::write(cwd.join("Cargo.toml"), moved(text)).unwrap();
                    // The workspace's versions, so the build needs nothing the
                    // workspace's did not fetch.
                    std::fs::copy(root.join("Cargo.lock"), cwd.join("Cargo.lock")).unwrap();
                } else {
                    std::fs::write(cwd.join("src/lib.rs"), text).unwrap();
                }
                continue;
            }
            Part::Steps(steps) => steps,
        };
        for step in steps {
            if let Some(rest) = step.command.strip_prefix("kvhint serve ") {
                let config = rest
                    .split_whitespace()
                    .skip_while(|w| *w != "--config")
                    .nth(1)
                    .expect("serve --config FILE");
                server = Some(kvhint_e2e::Server::start(
                    Path::new(&moved(config)),
                    &[],
                    private.path(),
                ));
                continue;
            }
            let mut command = moved(&step.command);
            if let Some(server) = &server {
                command = command.replace("127.0.0.1:8080", server.address());
            }
            let script = format!(
                "cd '{}' || exit 1\n{command}\nstatus=$?\npwd > '{}'\nexit $status\n",
                cwd.display(),
                cwd_file.display()
            );
            let is_cargo = step.command.starts_with("cargo ");
            // A `curl` that only reads may be shown after what it waits for
            // (the reload a rename starts): it is asked again until it matches.
            let retried = step.command.starts_with("curl ")
                && !step.command.contains(" -X ")
                && !step.command.contains(" -d ");
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
            loop {
                let output = Command::new("sh")
                    .arg("-c")
                    .arg(&script)
                    .env("PATH", &path)
                    .env("CARGO_TARGET_DIR", &target)
                    .env("CARGO_NET_OFFLINE", "true")
                    .output()
                    .unwrap();
                let stdout = String::from_utf8_lossy(&output.stdout);
                let stderr = String::from_utf8_lossy(&output.stderr);
                let log = || server.as_ref().map(|s| s.log()).unwrap_or_default();
                assert!(
                    output.status.success(),
                    "`{}` failed ({}):\n{stdout}\n{stderr}\nrouter log:\n{}",
                    step.command,
                    output.status,
                    log()
                );
                cwd = PathBuf::from(std::fs::read_to_string(&cwd_file).unwrap().trim());
                let actual = shown_paths(&stdout);
                if is_cargo {
                    // Compile lines are elided (`…`); the tests' lines are shown.
                    for line in step.output.iter().filter(|l| l.starts_with("test ")) {
                        assert!(
                            actual.lines().any(|a| a == line),
                            "`{}` did not print `{line}`:\n{stdout}\n{stderr}",
                            step.command
                        );
                    }
                } else if !same_output(&step.output, &actual) {
                    if retried && std::time::Instant::now() < deadline {
                        std::thread::sleep(std::time::Duration::from_millis(100));
                        continue;
                    }
                    mismatches.push(format!(
                        "`{}` printed\n{actual}\nand the guide shows\n{}\n(stderr: {stderr})",
                        step.command,
                        step.output.join("\n"),
                    ));
                }
                break;
            }
        }
    }
    let log = server.as_ref().map(|s| s.log()).unwrap_or_default();
    assert!(
        mismatches.is_empty(),
        "{}\nrouter log:\n{log}",
        mismatches.join("\n\n")
    );
    assert!(server.is_some(), "the quick path starts a router");
}
