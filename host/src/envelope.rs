//! The engine-format hint message (rule R10): the envelope vLLM, SGLang and
//! Dynamo converge on.
//!
//! ```json
//! {"protocol_version":"0.1","message_id":"req-1","actions":[
//!   {"action_id":"a1","action_type":"kv.fetch","action_version":"1.0",
//!    "payload":{"source_control_endpoint":"tcp://10.0.0.7:23280","block_hashes":[11,22]}}]}
//! ```
//!
//! Payloads arrive from plugins as JSON text, made and checked inside the
//! plugin by the plugin-api adapter (serde_json, from a `Value`), and are
//! copied into the envelope as they are: not parsed or encoded again on the
//! booking path, with one exception ([`signed_fetch_hashes`]): a `kv.fetch` from
//! an engine whose hashes are signed 64-bit integers (SGLang) is rewritten so it
//! names them as the engine published them, since policies see every engine hash
//! as a u64. An action type the router does not know passes through untouched.

use kvhint_plugin_api::abi::FfiAction;

pub const PROTOCOL_VERSION: &str = "0.1";

/// The hard cap on actions in one message (rule R7).
pub const MAX_ACTIONS: usize = 32;

/// Why an action is not sent, checked cheaply. The plugin-side adapter already
/// checked that the payload is a JSON object it serialized itself; this only
/// catches the obvious mistakes of a plugin that implements the raw ABI trait
/// by hand, without reading the payload through. The whole message is
/// validated once, as JSON, when the hint stage returns it (`hints::HintStage::run_booking`).
pub(crate) fn malformed(action: &FfiAction) -> Option<String> {
    let action_type = action.action_type.as_str();
    if action_type.is_empty() {
        return Some("an action has an empty action_type".into());
    }
    if action.action_version.as_str().is_empty() {
        return Some(format!(
            "action {action_type:?} has an empty action_version"
        ));
    }
    let payload = action.payload_json.as_str().trim();
    if !(payload.starts_with('{') && payload.ends_with('}')) {
        return Some(format!(
            "action {action_type:?} has a payload that is not a JSON object"
        ));
    }
    None
}

/// Lets serde_json's string escaping write into a `String`. Its writes are
/// whole escaped pieces, each valid UTF-8, so checking them costs little; the
/// large payloads are pushed as `&str` and never re-validated.
struct StringWriter<'a>(&'a mut String);

impl std::io::Write for StringWriter<'_> {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        let text = std::str::from_utf8(bytes).map_err(std::io::Error::other)?;
        self.0.push_str(text);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// `message` with the `block_hashes` of each `kv.fetch` whose
/// `source_control_endpoint` names a signed source (`is_signed`) written as signed 64-bit
/// integers (the same bits: a value above `i64::MAX` becomes its negative twin), or
/// `None` if nothing changed.
pub fn signed_fetch_hashes(
    message: &serde_json::value::RawValue,
    is_signed: impl Fn(&str) -> bool,
) -> Option<Box<serde_json::value::RawValue>> {
    let mut value: serde_json::Value = serde_json::from_str(message.get()).ok()?;
    let mut changed = false;
    for action in value.get_mut("actions")?.as_array_mut()? {
        if action.get("action_type").and_then(|t| t.as_str()) != Some("kv.fetch") {
            continue;
        }
        let Some(payload) = action.get_mut("payload") else {
            continue;
        };
        let from_signed = payload
            .get("source_control_endpoint")
            .and_then(|e| e.as_str())
            .is_some_and(&is_signed);
        if !from_signed {
            continue;
        }
        let Some(hashes) = payload
            .get_mut("block_hashes")
            .and_then(|h| h.as_array_mut())
        else {
            continue;
        };
        for hash in hashes {
            if let Some(unsigned) = hash.as_u64().filter(|u| *u > i64::MAX as u64) {
                *hash = serde_json::Value::from(unsigned as i64);
                changed = true;
            }
        }
    }
    if !changed {
        return None;
    }
    serde_json::value::to_raw_value(&value).ok()
}

/// Writes `text` as a JSON string (serde_json's own escaping).
fn push_json_string(out: &mut String, text: &str) -> std::io::Result<()> {
    serde::Serialize::serialize(text, &mut serde_json::Serializer::new(StringWriter(out)))
        .map_err(std::io::Error::other)
}

/// The engine-format message for `actions` (numbered by position: the first is
/// `a1`). Payloads are copied in as they came, never parsed again.
pub(crate) fn write(message_id: &str, actions: &[&FfiAction]) -> std::io::Result<String> {
    use std::fmt::Write;
    let payload_bytes: usize = actions.iter().map(|a| a.payload_json.len() + 96).sum();
    let mut out = String::with_capacity(64 + message_id.len() + payload_bytes);
    out.push_str("{\"protocol_version\":\"");
    out.push_str(PROTOCOL_VERSION);
    out.push_str("\",\"message_id\":");
    push_json_string(&mut out, message_id)?;
    out.push_str(",\"actions\":[");
    for (i, action) in actions.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        write!(out, "{{\"action_id\":\"a{}\",\"action_type\":", i + 1)
            .map_err(std::io::Error::other)?;
        push_json_string(&mut out, action.action_type.as_str())?;
        out.push_str(",\"action_version\":");
        push_json_string(&mut out, action.action_version.as_str())?;
        out.push_str(",\"payload\":");
        out.push_str(action.payload_json.as_str().trim());
        out.push('}');
    }
    out.push_str("]}");
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fetches_from_signed_engines_name_their_hashes_signed() {
        let message = serde_json::value::to_raw_value(&serde_json::json!({
            "protocol_version": "0.1", "message_id": "r", "actions": [
                {"action_id": "a1", "action_type": "kv.fetch", "action_version": "1.0",
                 "payload": {"source_control_endpoint": "tcp://s:1",
                             "block_hashes": [18446744073709551611u64, 7]}},
                {"action_id": "a2", "action_type": "kv.fetch", "action_version": "1.0",
                 "payload": {"source_control_endpoint": "tcp://u:1",
                             "block_hashes": [18446744073709551611u64]}}]}))
        .unwrap();
        let out = signed_fetch_hashes(&message, |e| e == "tcp://s:1").unwrap();
        let out: serde_json::Value = serde_json::from_str(out.get()).unwrap();
        assert_eq!(
            out["actions"][0]["payload"]["block_hashes"],
            serde_json::json!([-5, 7])
        );
        assert_eq!(
            out["actions"][1]["payload"]["block_hashes"],
            serde_json::json!([18446744073709551611u64]),
            "an unsigned engine's fetch is left alone"
        );
        assert!(signed_fetch_hashes(&message, |e| e == "tcp://other:1").is_none());
    }

    fn action(t: &str, v: &str, payload: &str) -> FfiAction {
        FfiAction {
            action_type: t.into(),
            action_version: v.into(),
            payload_json: payload.into(),
        }
    }

    #[test]
    fn envelope_is_valid_json_with_escaped_strings() {
        let a = action("kv.fetch", "1.0", r#"{"block_hashes":[11,22]}"#);
        let b = action("odd\"type\n", "1.0", "{}");
        let text = write("req \"1\"", &[&a, &b]).unwrap();
        let value: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(
            value,
            serde_json::json!({"protocol_version": "0.1", "message_id": "req \"1\"", "actions": [
                {"action_id": "a1", "action_type": "kv.fetch", "action_version": "1.0", "payload": {"block_hashes": [11, 22]}},
                {"action_id": "a2", "action_type": "odd\"type\n", "action_version": "1.0", "payload": {}},
            ]})
        );
    }

    #[test]
    fn cheap_checks_catch_what_a_raw_abi_plugin_could_send() {
        assert!(malformed(&action("", "1.0", "{}")).is_some());
        assert!(malformed(&action("t", "", "{}")).is_some());
        assert!(malformed(&action("t", "1.0", "[1]")).is_some());
        assert!(malformed(&action("t", "1.0", " {} ")).is_none());
    }
}
