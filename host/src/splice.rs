//! A client's JSON object, edited in place: fields replaced, added or removed by
//! their byte ranges, everything else passed to the engine exactly as the client
//! wrote it. Re-serialising would reorder keys, rewrite numbers (`1e3`, `0.10`)
//! and escapes, and drop what a typed model does not know; the engine must see
//! the client's request, with only the router's fields changed; and a chat
//! template must see the client's keys in the client's order. A leaf: it imports
//! nothing of the crate.

use serde::de::{Deserializer, IgnoredAny, MapAccess, Visitor};
use serde_json::value::RawValue;
use std::borrow::Cow;
use std::collections::HashSet;
use std::fmt;
use std::ops::Range;
use std::sync::Arc;

/// Why a body is not one the gateway can forward (a client error: 400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BodyError {
    #[error("the body is not valid JSON: {0}")]
    Json(String),
    #[error("the body is a JSON {0}; it must be an object, like {{\"model\": …}}")]
    NotObject(&'static str),
    #[error("the body has the field `{0}` twice; engines and this router could read different ones, so it is refused")]
    Duplicate(String),
    #[error("the object has more than {MAX_FIELDS} fields; an OpenAI request or message has a few dozen at most")]
    TooManyFields,
    #[error("the body nests objects and arrays more than {MAX_DEPTH} deep; a request, tool schemas included, needs a few levels")]
    TooDeep,
}

/// The deepest nesting of objects and arrays a body may have (serde_json's
/// own limit for what it decodes; the raw fields passed on are held to it too).
pub const MAX_DEPTH: usize = 128;

/// The most fields one object may have. A request has a few dozen; a bound
/// keeps a body made of keys from costing memory and time for nothing.
pub const MAX_FIELDS: usize = 1_024;

/// A top-level field: the key as decoded, the value's byte range in the text,
/// and the field's whole range from the key's opening quote to the value's end.
type Field = (String, Range<usize>, Range<usize>);

/// The top-level fields of a JSON object body, each with where its value lies.
#[derive(Debug)]
pub struct Body<'a> {
    text: &'a str,
    /// Borrowed from a [`ParsedBody`], or parsed here.
    fields: Cow<'a, [Field]>,
}

/// A body parsed once and kept with its text. The request path books on the
/// booking threads, and books again on a retry: each booking reads and splices
/// [`ParsedBody::body`] without parsing the text again.
#[derive(Debug)]
pub struct ParsedBody {
    text: Arc<str>,
    fields: Vec<Field>,
}

impl ParsedBody {
    pub fn parse(text: Arc<str>) -> Result<Self, BodyError> {
        let fields = Body::parse(&text)?.fields.into_owned();
        Ok(Self { text, fields })
    }

    /// The text as the client sent it.
    pub fn text(&self) -> &str {
        &self.text
    }

    pub fn body(&self) -> Body<'_> {
        Body {
            text: &self.text,
            fields: Cow::Borrowed(&self.fields),
        }
    }
}

impl<'a> Body<'a> {
    pub fn parse(text: &'a str) -> Result<Body<'a>, BodyError> {
        let trimmed = text.trim_start();
        match trimmed.as_bytes().first() {
            Some(b'{') => {}
            Some(b'[') => return Err(BodyError::NotObject("array")),
            Some(b'"') => return Err(BodyError::NotObject("string")),
            None => return Err(BodyError::Json("the body is empty".into())),
            _ => {
                // Let serde name what is wrong (a number, `true`, garbage).
                if let Err(e) = serde_json::from_str::<&RawValue>(text) {
                    return Err(BodyError::Json(e.to_string()));
                }
                return Err(BodyError::NotObject("scalar"));
            }
        }
        if nests_deeper_than(text, MAX_DEPTH) {
            return Err(BodyError::TooDeep);
        }
        let mut de = serde_json::Deserializer::from_str(text);
        let (raw, overflow): (Vec<(String, &'a RawValue)>, bool) = de
            .deserialize_map(FieldsVisitor)
            .map_err(|e| BodyError::Json(e.to_string()))?;
        de.end().map_err(|e| BodyError::Json(e.to_string()))?;
        if overflow {
            return Err(BodyError::TooManyFields);
        }
        // A set, not a scan of the fields before each: that was quadratic in
        // the number of keys, a CPU weapon in a body made of keys.
        let mut seen: HashSet<&str> = HashSet::with_capacity(raw.len());
        if let Some((key, _)) = raw.iter().find(|(key, _)| !seen.insert(key.as_str())) {
            return Err(BodyError::Duplicate(key.clone()));
        }
        let base = text.as_ptr() as usize;
        let mut fields: Vec<Field> = Vec::with_capacity(raw.len());
        let mut search_from = 0;
        for (key, value) in raw {
            let start = value.get().as_ptr() as usize - base;
            let end = start + value.get().len();
            // The key's opening quote: the last `"` that starts a string before the
            // colon before this value. Keys are strings; scan back over `:` and
            // whitespace, then over the key string.
            let key_start = key_start(text, search_from, start);
            fields.push((key, start..end, key_start..end));
            search_from = end;
        }
        Ok(Body {
            text,
            fields: Cow::Owned(fields),
        })
    }

    /// A field's raw JSON value.
    pub fn raw(&self, key: &str) -> Option<&'a str> {
        self.fields
            .iter()
            .find(|(k, _, _)| k == key)
            .map(|(_, range, _)| &self.text[range.clone()])
    }

    /// A field decoded, or `None` if absent or null; an error names the field.
    pub fn get<T: serde::de::DeserializeOwned>(&self, key: &str) -> Result<Option<T>, String> {
        match self.raw(key) {
            None | Some("null") => Ok(None),
            Some(raw) => serde_json::from_str(raw)
                .map(Some)
                .map_err(|e| format!("`{key}`: {e}")),
        }
    }

    /// Each field's key and raw value, in the body's order.
    pub fn fields(&self) -> impl Iterator<Item = (&str, &'a str)> + '_ {
        self.fields
            .iter()
            .map(|(k, range, _)| (k.as_str(), &self.text[range.clone()]))
    }

    pub fn has(&self, key: &str) -> bool {
        self.raw(key).is_some()
    }

    pub fn text(&self) -> &'a str {
        self.text
    }

    /// The body with `edits` made: a replaced field keeps its place, an added one
    /// goes last, a removed one goes with its comma. Nothing else changes: the
    /// whitespace and separators between kept fields are the client's own.
    pub fn edited(&self, edits: &Edits) -> Vec<u8> {
        let text = self.text;
        let open = text.find('{').map_or(0, |i| i + 1);
        let last_end = self.fields.last().map_or(open, |(_, value, _)| value.end);
        let close = text[last_end..]
            .find('}')
            .map_or(text.len(), |i| last_end + i);
        let mut out = String::with_capacity(text.len() + edits.added_len());
        out.push_str(&text[..open]);
        let mut previous_end = open;
        let mut previous_kept = true;
        let mut wrote = false;
        for (key, value, field) in self.fields.iter() {
            let gap = &text[previous_end..field.start];
            previous_end = value.end;
            let edit = edits.action(key);
            if edit == Some(&Edit::Remove) {
                previous_kept = false;
                continue;
            }
            if !wrote {
                // Before the first field written: the whitespace after `{`.
                out.push_str(&text[open..open + leading_space(&text[open..])]);
            } else if previous_kept {
                out.push_str(gap);
            } else {
                out.push(',');
            }
            match edit {
                Some(Edit::Set(raw)) => {
                    out.push_str(&text[field.start..value.start]);
                    out.push_str(raw);
                }
                _ => out.push_str(&text[field.start..value.end]),
            }
            wrote = true;
            previous_kept = true;
        }
        for (key, edit) in &edits.edits {
            if let Edit::Set(raw) = edit {
                if !self.has(key) {
                    if wrote {
                        out.push(',');
                    }
                    out.push_str(&serde_json::to_string(key).unwrap_or_default());
                    out.push(':');
                    out.push_str(raw);
                    wrote = true;
                }
            }
        }
        // After the last field: whitespace, then `}` and what follows it.
        let tail = &text[last_end..close];
        out.extend(tail.chars().filter(|c| c.is_whitespace()));
        out.push_str(&text[close..]);
        out.into_bytes()
    }
}

/// Whether `text` nests objects and arrays deeper than `max` (brackets inside
/// strings do not count); one pass.
fn nests_deeper_than(text: &str, max: usize) -> bool {
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    for &b in text.as_bytes() {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'{' | b'[' => {
                depth += 1;
                if depth > max {
                    return true;
                }
            }
            b'}' | b']' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    false
}

/// How many bytes of whitespace `text` starts with.
fn leading_space(text: &str) -> usize {
    text.len() - text.trim_start().len()
}

/// Where the key whose value starts at `value_start` begins (its opening quote).
fn key_start(text: &str, from: usize, value_start: usize) -> usize {
    let bytes = text.as_bytes();
    let mut i = value_start;
    // Back over whitespace and the colon.
    while i > from && (bytes[i - 1].is_ascii_whitespace() || bytes[i - 1] == b':') {
        i -= 1;
    }
    // Now just past the key's closing quote; find its opening quote, skipping
    // escaped quotes.
    if i == 0 {
        return 0;
    }
    let mut j = i - 1; // the closing quote
    while j > from {
        j -= 1;
        if bytes[j] == b'"' {
            let mut backslashes = 0;
            let mut k = j;
            while k > from && bytes[k - 1] == b'\\' {
                backslashes += 1;
                k -= 1;
            }
            if backslashes % 2 == 0 {
                return j;
            }
        }
    }
    from
}

struct FieldsVisitor;

impl<'de> Visitor<'de> for FieldsVisitor {
    /// The fields, and whether there were more than [`MAX_FIELDS`] (the rest
    /// are read to the object's end, for its syntax, and not kept).
    type Value = (Vec<(String, &'de RawValue)>, bool);

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut out = Vec::new();
        let mut overflow = false;
        while out.len() < MAX_FIELDS {
            let Some(key) = map.next_key::<String>()? else {
                return Ok((out, false));
            };
            let value: &'de RawValue = map.next_value()?;
            out.push((key, value));
        }
        while map.next_key::<IgnoredAny>()?.is_some() {
            map.next_value::<IgnoredAny>()?;
            overflow = true;
        }
        Ok((out, overflow))
    }
}

/// One change to a field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Edit {
    /// Replace (or add) the field with this raw JSON.
    Set(String),
    Remove,
}

/// Changes to make to a body, by key.
#[derive(Debug, Clone, Default)]
pub struct Edits {
    edits: Vec<(String, Edit)>,
}

impl Edits {
    /// Sets `key` to `raw` (JSON text the caller wrote, such as a serialised id list).
    pub fn set(&mut self, key: &str, raw: String) -> &mut Self {
        self.edits.retain(|(k, _)| k != key);
        self.edits.push((key.to_string(), Edit::Set(raw)));
        self
    }

    pub fn remove(&mut self, key: &str) -> &mut Self {
        self.edits.retain(|(k, _)| k != key);
        self.edits.push((key.to_string(), Edit::Remove));
        self
    }

    pub fn is_empty(&self) -> bool {
        self.edits.is_empty()
    }

    fn action(&self, key: &str) -> Option<&Edit> {
        self.edits.iter().find(|(k, _)| k == key).map(|(_, e)| e)
    }

    fn added_len(&self) -> usize {
        self.edits
            .iter()
            .map(|(k, e)| match e {
                Edit::Set(raw) => k.len() + raw.len() + 4,
                Edit::Remove => 0,
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn edit(text: &str, f: impl FnOnce(&mut Edits)) -> String {
        let body = Body::parse(text).expect("a body");
        let mut edits = Edits::default();
        f(&mut edits);
        String::from_utf8(body.edited(&edits)).expect("utf-8")
    }

    #[test]
    fn untouched_fields_keep_their_bytes_and_order() {
        let text = r#"{ "z": 1e3, "model" : "m",  "prompt":"a\"b", "n": 0.10 }"#;
        assert_eq!(edit(text, |_| {}), text);
        assert_eq!(
            edit(text, |e| {
                e.set("prompt", "[1,2,3]".into());
            }),
            r#"{ "z": 1e3, "model" : "m",  "prompt":[1,2,3], "n": 0.10 }"#
        );
    }

    #[test]
    fn added_fields_go_last_and_removed_ones_take_their_comma() {
        let text = r#"{"model":"m","text":"hi","stream":true}"#;
        assert_eq!(
            edit(text, |e| {
                e.remove("text").set("input_ids", "[1]".into());
            }),
            r#"{"model":"m","stream":true,"input_ids":[1]}"#
        );
        assert_eq!(
            edit(text, |e| {
                e.remove("model");
            }),
            r#"{"text":"hi","stream":true}"#
        );
        assert_eq!(
            edit(text, |e| {
                e.remove("stream");
            }),
            r#"{"model":"m","text":"hi"}"#
        );
        assert_eq!(
            edit("{}", |e| {
                e.set("a", "1".into()).set("b", "2".into());
            }),
            r#"{"a":1,"b":2}"#
        );
        assert_eq!(
            edit(r#"{"a":1}"#, |e| {
                e.remove("a").set("b", "2".into());
            }),
            r#"{"b":2}"#
        );
        for text in [
            r#"{"model":"m","text":"hi","stream":true}"#,
            r#"{ "a" : [1, {"b": "}"}] , "c":"\\\"" }"#,
        ] {
            let body = Body::parse(text).unwrap();
            for (key, _, _) in body.fields.iter() {
                let out = edit(text, |e| {
                    e.remove(key);
                });
                let value: serde_json::Value = serde_json::from_str(&out).expect(&out);
                assert!(value.get(key.as_str()).is_none(), "{out}");
            }
        }
    }

    #[test]
    fn a_body_made_of_keys_is_refused_past_the_field_cap_in_one_pass() {
        let keys = |n: usize| -> String {
            let fields: Vec<String> = (0..n).map(|i| format!("\"k{i}\":{i}")).collect();
            format!("{{{}}}", fields.join(","))
        };
        // At the cap: every field kept, in order.
        let text = keys(MAX_FIELDS);
        let body = Body::parse(&text).unwrap();
        assert_eq!(body.fields().count(), MAX_FIELDS);
        assert_eq!(body.raw(&format!("k{}", MAX_FIELDS - 1)), Some("1023"));
        // 200,000 keys: refused by the cap, after one pass over the body (the
        // scan each key made of the keys before it took minutes on a body
        // like this one); the rest of the object is still checked for syntax.
        assert_eq!(
            Body::parse(&keys(200_000)).unwrap_err(),
            BodyError::TooManyFields
        );
        assert!(matches!(
            Body::parse(&format!("{},}}", &keys(2_000)[..keys(2_000).len() - 1])).unwrap_err(),
            BodyError::Json(_)
        ));
        // Nesting: to the limit, accepted; past it, refused; brackets inside
        // strings do not count.
        let nested = |n: usize| format!("{{\"x\":{}{}}}", "[".repeat(n - 1), "]".repeat(n - 1));
        assert!(Body::parse(&nested(MAX_DEPTH)).is_ok());
        assert_eq!(
            Body::parse(&nested(MAX_DEPTH + 1)).unwrap_err(),
            BodyError::TooDeep
        );
        assert_eq!(
            Body::parse(&nested(1_000_000)).unwrap_err(),
            BodyError::TooDeep
        );
        let quoted = format!("{{\"x\":\"{}\\\"{}\"}}", "[".repeat(500), "{".repeat(500));
        assert!(Body::parse(&quoted).is_ok(), "{quoted}");
        // A duplicate among many distinct keys is still found.
        let text = format!("{},\"k5\":0}}", &keys(1_000)[..keys(1_000).len() - 1]);
        assert_eq!(
            Body::parse(&text).unwrap_err(),
            BodyError::Duplicate("k5".into())
        );
    }

    #[test]
    fn a_duplicate_field_is_refused() {
        assert_eq!(
            Body::parse(r#"{"prompt":"a","prompt":"b"}"#).unwrap_err(),
            BodyError::Duplicate("prompt".into())
        );
    }

    #[test]
    fn bodies_that_are_not_objects_say_what_they_are() {
        assert_eq!(
            Body::parse("[1]").unwrap_err(),
            BodyError::NotObject("array")
        );
        assert!(matches!(Body::parse("{").unwrap_err(), BodyError::Json(_)));
        assert!(matches!(
            Body::parse(r#"{"a":1} x"#).unwrap_err(),
            BodyError::Json(_)
        ));
    }
}
