//! A strict reader over a YAML tree that keeps every node's position.
//!
//! serde stops at the first error and `serde_yaml::Value` forgets where a node
//! was; an operator fixing a config wants every mistake at once, each with its
//! line and column (as `nginx -t` reports). So the config is parsed with
//! `marked-yaml`, which keeps a span on every node, and this walker checks
//! shapes and keys while collecting errors. Typed leaves (policy parameters)
//! still go through serde, after conversion with [`to_json`].

use super::{ConfigError, Location};
use marked_yaml::types::{MarkedMappingNode, MarkedScalarNode};
use marked_yaml::{Node, Span};
use std::path::Path;

pub(crate) struct Walker<'a> {
    pub file: &'a Path,
    pub errors: Vec<ConfigError>,
}

pub(crate) fn location(path: &str, span: &Span) -> Location {
    let (line, column) = span
        .start()
        .map(|m| (m.line(), m.column()))
        .unwrap_or((0, 0));
    Location {
        path: path.to_string(),
        line,
        column,
    }
}

/// Where a node starts, as a reader would point at it. yaml-rust marks a block
/// mapping at its first `:`, so a mapping is located by its first key instead.
pub(crate) fn node_location(path: &str, node: &Node) -> Location {
    match node {
        Node::Mapping(map) => match map.keys().next() {
            Some(key) => location(path, key.span()),
            None => location(path, map.span()),
        },
        other => location(path, other.span()),
    }
}

/// Where `key` is written in `map`.
pub(crate) fn key_location(path: &str, map: &MarkedMappingNode, key: &str) -> Location {
    match map.keys().find(|k| k.as_str() == key) {
        Some(k) => location(path, k.span()),
        None => location(path, map.span()),
    }
}

fn kind(node: &Node) -> &'static str {
    match node {
        Node::Scalar(s) if s.may_coerce() && is_null(s) => "nothing (null)",
        Node::Scalar(_) => "a scalar",
        Node::Mapping(_) => "a mapping",
        Node::Sequence(_) => "a sequence",
    }
}

fn is_null(scalar: &MarkedScalarNode) -> bool {
    matches!(scalar.as_str(), "" | "~" | "null" | "Null" | "NULL")
}

impl<'a> Walker<'a> {
    pub fn new(file: &'a Path) -> Self {
        Self {
            file,
            errors: Vec::new(),
        }
    }

    pub fn error(&mut self, at: Location, message: impl Into<String>) {
        self.errors.push(ConfigError {
            file: self.file.to_path_buf(),
            at: Some(at),
            message: message.into(),
        });
    }

    pub fn mapping<'n>(&mut self, node: &'n Node, path: &str) -> Option<&'n MarkedMappingNode> {
        match node {
            Node::Mapping(map) => Some(map),
            other => {
                self.error(
                    node_location(path, other),
                    format!("expected a mapping, found {}", kind(other)),
                );
                None
            }
        }
    }

    /// Reports keys of `map` that are not in `allowed`.
    pub fn known_keys(&mut self, map: &MarkedMappingNode, path: &str, allowed: &[&str]) {
        for key in map.keys() {
            if !allowed.contains(&key.as_str()) {
                let key_path = join(path, key.as_str());
                let hint = suggestion(key.as_str(), allowed)
                    .map(|s| format!(" (did you mean `{s}`?)"))
                    .unwrap_or_default();
                self.error(
                    location(&key_path, key.span()),
                    format!(
                        "unknown key `{}`{hint}; expected one of: {}",
                        key.as_str(),
                        allowed.join(", ")
                    ),
                );
            }
        }
    }

    pub fn string(&mut self, node: &Node, path: &str) -> Option<String> {
        match node {
            Node::Scalar(s) if !(s.may_coerce() && is_null(s)) => Some(s.as_str().to_string()),
            other => {
                self.error(
                    location(path, other.span()),
                    format!("expected a string, found {}", kind(other)),
                );
                None
            }
        }
    }

    /// A string naming one of `names`, as `parse` reads it: `what` names the kind in
    /// the error (`unknown router mode `x`; expected one of: kv, …`).
    pub fn one_of<T>(
        &mut self,
        node: &Node,
        path: &str,
        what: &str,
        names: &[&str],
        parse: impl FnOnce(&str) -> Option<T>,
    ) -> Option<T> {
        let text = self.string(node, path)?;
        let value = parse(&text);
        if value.is_none() {
            self.error(
                location(path, node.span()),
                format!(
                    "unknown {what} `{text}`; expected one of: {}",
                    names.join(", ")
                ),
            );
        }
        value
    }

    /// A whole number in `min..=max`.
    pub fn unsigned(&mut self, node: &Node, path: &str, min: u64, max: u64) -> Option<u64> {
        let range = if max == u64::MAX {
            format!("a whole number ≥ {min}")
        } else {
            format!("a whole number from {min} to {max}")
        };
        match node {
            Node::Scalar(s) => match s.as_u64() {
                Some(v) if (min..=max).contains(&v) => Some(v),
                _ if !s.may_coerce() && s.as_str().parse::<u64>().is_ok() => {
                    self.error(
                        location(path, s.span()),
                        format!(
                            "expected {range}, found the string \"{}\"; write the number without quotes",
                            s.as_str()
                        ),
                    );
                    None
                }
                _ => {
                    self.error(
                        location(path, s.span()),
                        format!("expected {range}, found `{}`", s.as_str()),
                    );
                    None
                }
            },
            other => {
                self.error(
                    node_location(path, other),
                    format!("expected {range}, found {}", kind(other)),
                );
                None
            }
        }
    }

    /// A `parameters` value: a mapping (or absent / null, meaning `{}`).
    pub fn parameters(&mut self, node: Option<&Node>, path: &str) -> serde_json::Value {
        match node {
            None => serde_json::Value::Object(Default::default()),
            Some(Node::Mapping(map)) => to_json(&Node::Mapping(map.clone())),
            Some(other) => {
                self.error(
                    node_location(path, other),
                    format!(
                        "`parameters` must be a mapping, found {}; write `parameters: {{}}` or leave the key out",
                        kind(other)
                    ),
                );
                serde_json::Value::Object(Default::default())
            }
        }
    }
}

pub(crate) fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

/// The closest allowed key, for typos.
fn suggestion<'k>(key: &str, allowed: &[&'k str]) -> Option<&'k str> {
    allowed
        .iter()
        .map(|candidate| (strsim::levenshtein(key, candidate), *candidate))
        .filter(|(d, _)| *d <= 2)
        .min()
        .map(|(_, c)| c)
}

/// Converts a YAML node to JSON with the YAML 1.2 core schema's scalar typing:
/// unquoted `null`/`~`/empty, `true`/`false`, integers and floats are typed;
/// anything quoted stays a string.
pub(crate) fn to_json(node: &Node) -> serde_json::Value {
    use serde_json::Value;
    match node {
        Node::Scalar(s) => {
            if !s.may_coerce() {
                return Value::String(s.as_str().to_string());
            }
            if is_null(s) {
                Value::Null
            } else if let Some(b) = s.as_bool() {
                Value::Bool(b)
            } else if let Some(i) = s.as_i64() {
                Value::from(i)
            } else if let Some(u) = s.as_u64() {
                Value::from(u)
            } else if let Some(f) = s
                .as_f64()
                .filter(|f| f.is_finite() && looks_numeric(s.as_str()))
            {
                Value::from(f)
            } else {
                Value::String(s.as_str().to_string())
            }
        }
        Node::Sequence(seq) => Value::Array(seq.iter().map(to_json).collect()),
        Node::Mapping(map) => Value::Object(
            map.iter()
                .map(|(k, v)| (k.as_str().to_string(), to_json(v)))
                .collect(),
        ),
    }
}

/// The text without a leading UTF-8 byte-order mark. Editors on Windows write
/// one, and yaml-rust would read it as part of the first key (an "unknown key
/// `\u{feff}worker_selection`"). Lines and columns are counted after it, as
/// editors show them.
pub(crate) fn strip_bom(text: &str) -> &str {
    text.strip_prefix('\u{feff}').unwrap_or(text)
}

/// What the locating of errors needs to know about the text, found in one pass
/// over it: how many lines it has and how long the last one is (so a parser
/// position can be clamped to the text), and where any character YAML forbids
/// is. Built once per parse, whatever the number of errors: a config with
/// 100,000 unknown keys is scanned once, not once per error.
#[derive(Debug, Clone)]
pub(crate) struct TextIndex {
    /// Lines, as YAML breaks them (`\n`, `\r\n`, a lone `\r`).
    lines: usize,
    /// Characters on the last line.
    last_line_chars: usize,
    /// The characters YAML does not allow, with their line and column (1-based),
    /// the first [`MAX_FORBIDDEN_REPORTED`] of them.
    pub forbidden: Vec<(usize, usize, char)>,
    /// How many forbidden characters there are in all.
    pub forbidden_count: usize,
}

/// How many forbidden characters are reported one by one.
pub(crate) const MAX_FORBIDDEN_REPORTED: usize = 10;

thread_local! {
    static TEXT_SCANS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// How many times this thread has scanned a config text whole to locate errors
/// (each [`TextIndex::new`]). Tests count it to see that locating errors is one
/// pass, not one per error.
pub fn text_scans() -> usize {
    TEXT_SCANS.with(|n| n.get())
}

/// Whether YAML 1.2 (§5.1, `c-printable`) forbids `c` anywhere in a stream:
/// C0 controls other than tab, line feed and carriage return, DEL, C1 controls
/// other than NEL, and the non-characters U+FFFE and U+FFFF. yaml-rust reads a
/// NUL as the end of the input, so one in a comment would silently drop every
/// key after it (an `auth:` section among them).
pub(crate) fn is_forbidden(c: char) -> bool {
    matches!(c, '\u{0}'..='\u{8}' | '\u{b}' | '\u{c}' | '\u{e}'..='\u{1f}' | '\u{7f}'..='\u{84}' | '\u{86}'..='\u{9f}' | '\u{fffe}' | '\u{ffff}')
}

/// How a forbidden character is named in a message: `U+0000 (NUL)`.
pub(crate) fn describe(c: char) -> String {
    const C0: [&str; 32] = [
        "NUL", "SOH", "STX", "ETX", "EOT", "ENQ", "ACK", "BEL", "BS", "TAB", "LF", "VT", "FF",
        "CR", "SO", "SI", "DLE", "DC1", "DC2", "DC3", "DC4", "NAK", "SYN", "ETB", "CAN", "EM",
        "SUB", "ESC", "FS", "GS", "RS", "US",
    ];
    let code = c as u32;
    match C0.get(code as usize) {
        Some(name) => format!("U+{code:04X} ({name})"),
        None if code == 0x7f => format!("U+{code:04X} (DEL)"),
        None if code < 0xa0 => format!("U+{code:04X} (a C1 control character)"),
        None => format!("U+{code:04X} (a non-character)"),
    }
}

impl TextIndex {
    pub fn new(text: &str) -> Self {
        TEXT_SCANS.with(|n| n.set(n.get() + 1));
        let mut index = TextIndex {
            lines: 1,
            last_line_chars: 0,
            forbidden: Vec::new(),
            forbidden_count: 0,
        };
        let mut after_cr = false;
        for c in text.chars() {
            match c {
                '\n' if after_cr => {}
                '\n' | '\r' => {
                    index.lines += 1;
                    index.last_line_chars = 0;
                }
                _ => {
                    index.last_line_chars += 1;
                    if is_forbidden(c) {
                        index.forbidden_count += 1;
                        if index.forbidden.len() < MAX_FORBIDDEN_REPORTED {
                            index
                                .forbidden
                                .push((index.lines, index.last_line_chars, c));
                        }
                    }
                }
            }
            after_cr = c == '\r';
        }
        index
    }

    /// A parser position clamped to the text. At the end of a text without a
    /// final line break the scanner reports the start of a line that does not
    /// exist; an editor shows that place as the end of the last line.
    pub fn within(&self, line: usize, column: usize) -> (usize, usize) {
        if line <= self.lines {
            return (line, column.max(1));
        }
        (self.lines, self.last_line_chars + 1)
    }
}

/// [`TextIndex::within`] for one position (builds the index: for one error only).
#[cfg(test)]
pub(crate) fn within_text(text: &str, line: usize, column: usize) -> (usize, usize) {
    TextIndex::new(text).within(line, column)
}

/// Where the flow collection (`[` or `{`) open at a parse error was opened, if
/// one is: yaml-rust reports an unclosed `[` at the end of the file, far from
/// the mistake. Scans the tokens up to the error: `(line, column, bracket)`.
pub(crate) fn unclosed_flow(text: &str) -> Option<(usize, usize, char)> {
    use yaml_rust2::scanner::{Scanner, TokenType};
    let mut open: Vec<(usize, usize, char)> = Vec::new();
    let mut scanner = Scanner::new(text.chars());
    while let Ok(Some(token)) = scanner.next_token() {
        let at = (token.0.line(), token.0.col() + 1);
        match token.1 {
            TokenType::FlowSequenceStart => open.push((at.0, at.1, '[')),
            TokenType::FlowMappingStart => open.push((at.0, at.1, '{')),
            TokenType::FlowSequenceEnd | TokenType::FlowMappingEnd => {
                open.pop();
            }
            TokenType::StreamEnd => break,
            _ => {}
        }
    }
    open.pop()
}

/// What follows the first YAML document, if anything does: a second document
/// (after `---`, or after `...`), or text the parser cannot read. marked-yaml
/// reads the first document only and would silently ignore the rest, so a
/// `block_size: 0` after a `---` would pass `check` unseen.
#[derive(Debug)]
pub(crate) enum Trailing {
    /// A second document starts at this line and column (1-based).
    Document(usize, usize),
    /// The text after the first document is not YAML.
    Invalid(usize, usize, String),
}

/// Looks past the first document. Call it once the first document has parsed.
pub(crate) fn trailing(text: &str, index: &TextIndex) -> Option<Trailing> {
    use yaml_rust2::parser::{Event, MarkedEventReceiver, Parser};
    use yaml_rust2::scanner::Marker;
    #[derive(Default)]
    struct Documents {
        starts: Vec<Marker>,
    }
    impl MarkedEventReceiver for Documents {
        fn on_event(&mut self, event: Event, mark: Marker) {
            if event == Event::DocumentStart {
                self.starts.push(mark);
            }
        }
    }
    let mut documents = Documents::default();
    let result = Parser::new_from_str(text).load(&mut documents, true);
    if let Some(second) = documents.starts.get(1) {
        let (line, column) = index.within(second.line(), second.col() + 1);
        return Some(Trailing::Document(line, column));
    }
    match result {
        Ok(()) => None,
        Err(e) => {
            let (line, column) = index.within(e.marker().line(), e.marker().col() + 1);
            Some(Trailing::Invalid(line, column, e.info().to_string()))
        }
    }
}

/// Rust parses `inf` and `NaN` as floats; YAML does not.
fn looks_numeric(text: &str) -> bool {
    text.bytes()
        .all(|b| b.is_ascii_digit() || matches!(b, b'.' | b'-' | b'+' | b'e' | b'E'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scalars_are_typed_like_yaml_1_2() {
        let node = marked_yaml::parse_yaml_with_options(
            0,
            "a: 1\nb: \"1\"\nc: true\nd: 1.5\ne: ~\nf: inf\ng: [x, 2]\n",
            marked_yaml::LoaderOptions::default().prevent_coercion(true),
        )
        .unwrap();
        assert_eq!(
            to_json(&node),
            serde_json::json!({"a": 1, "b": "1", "c": true, "d": 1.5, "e": null, "f": "inf", "g": ["x", 2]})
        );
    }

    #[test]
    fn a_bom_is_stripped_and_only_a_leading_one() {
        assert_eq!(strip_bom("\u{feff}a: 1"), "a: 1");
        assert_eq!(strip_bom("a: \u{feff}"), "a: \u{feff}");
    }

    #[test]
    fn what_follows_the_first_document_is_found() {
        let trailing = |text: &str| trailing(text, &TextIndex::new(text));
        assert!(trailing("a: 1\n").is_none());
        assert!(trailing("---\na: 1\n...\n").is_none());
        let found = trailing("a: 1\n---\nb: 2\n");
        assert!(matches!(found, Some(Trailing::Document(2, 1))), "{found:?}");
        let found = trailing("a: 1\n...\nb: 2\n");
        assert!(matches!(found, Some(Trailing::Document(3, _))), "{found:?}");
        assert!(matches!(
            trailing("a: 1\n...\n[x\n"),
            Some(Trailing::Document(3, _) | Trailing::Invalid(3 | 4, _, _))
        ));
    }

    #[test]
    fn positions_past_the_end_are_clamped_to_the_last_line() {
        assert_eq!(within_text("a: 1\nb: [", 3, 1), (2, 5));
        assert_eq!(within_text("a: 1\n", 2, 1), (2, 1));
        assert_eq!(within_text("a\rb", 2, 2), (2, 2));
        assert_eq!(within_text("a\rb", 3, 1), (2, 2));
    }

    #[test]
    fn forbidden_characters_are_found_with_their_place_in_one_pass() {
        let before = text_scans();
        let index = TextIndex::new("a: 1\r\n# x\u{0}y\nb: \"\u{7}\"\tz\u{85}\n");
        assert_eq!(text_scans(), before + 1);
        assert_eq!(index.forbidden, vec![(2, 4, '\u{0}'), (3, 5, '\u{7}')]);
        assert_eq!(index.forbidden_count, 2);
        assert_eq!(describe('\u{0}'), "U+0000 (NUL)");
        assert_eq!(describe('\u{9b}'), "U+009B (a C1 control character)");
        assert!(!is_forbidden('\t') && !is_forbidden('\u{85}') && !is_forbidden('é'));
    }

    #[test]
    fn the_bracket_left_open_is_found() {
        assert_eq!(
            unclosed_flow("a:\n  hints: [kv_fetch\n"),
            Some((2, 10, '['))
        );
        assert_eq!(unclosed_flow("a: {b: [1], c: 2\n"), Some((1, 4, '{')));
        assert_eq!(unclosed_flow("a: [1]\n"), None);
    }

    #[test]
    fn typos_get_a_suggestion() {
        assert_eq!(suggestion("hint", &["hints", "type"]), Some("hints"));
        assert_eq!(suggestion("zzzzzz", &["hints", "type"]), None);
    }
}
