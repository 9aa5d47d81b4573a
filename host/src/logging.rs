//! The router's log: `tracing` events on stderr, filtered by `KVHINT_LOG`, with
//! every field value escaped.
//!
//! Request ids, worker endpoints, plugin messages and config paths reach the log
//! from callers and from plugins. A value with a newline in it would start a
//! line of its own, one an attacker wrote (a request id of
//! `"x\n... ERROR kvhint: reload failed"` forges a log line), and an escape
//! sequence would drive the operator's terminal. So each value is written with
//! its control characters escaped (`\n`, `\r`, `\t`, `\u{1b}`): a log line is
//! always one event, and says only what printable text it holds.

use std::fmt::Write as _;
use tracing_subscriber::field::MakeExt;

/// An error with its causes, `: `-joined: the top level of a library's error
/// often says only "client error" or "template error", the cause says what.
pub fn with_causes(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// `text` with every control character written as an escape.
pub fn escape_controls(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.chars().any(char::is_control) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c.is_control() => {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
            c => out.push(c),
        }
    }
    std::borrow::Cow::Owned(out)
}

/// Installs the log: stderr, `KVHINT_LOG` or `default_level`, escaped fields.
pub fn init(default_level: &str) {
    let fields = tracing_subscriber::fmt::format::debug_fn(|writer, field, value| {
        let text = format!("{value:?}");
        let text = escape_controls(&text);
        if field.name() == "message" {
            write!(writer, "{text}")
        } else {
            write!(writer, "{field}={text}")
        }
    })
    .delimited(" ");
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KVHINT_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level)),
        )
        .fmt_fields(fields)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

#[cfg(test)]
mod tests {
    use super::escape_controls;

    #[test]
    fn control_characters_are_escaped_and_the_rest_kept() {
        assert_eq!(escape_controls("req-1 ünïcode"), "req-1 ünïcode");
        assert_eq!(
            escape_controls("a\nb\rc\td\u{1b}[31m"),
            "a\\nb\\rc\\td\\u{1b}[31m"
        );
    }
}
