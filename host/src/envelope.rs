//! The engine-format hint message (rule R10): the envelope vLLM, SGLang and
//! Dynamo converge on.
//!
//! ```json
//! {"protocol_version":"0.1","message_id":"req-1","actions":[
//!   {"action_id":"a1","action_type":"kv.fetch","action_version":"1.0",
//!    "payload":{"source_control_endpoint":"tcp://10.0.0.7:23280","block_hashes":[11,22]}}]}
//! ```
//!
//! The message is written by the router's own JSON writer as the policies
//! call in (`kvhint_plugin_api::writer`, driven by the hint stage), so it is
//! valid by construction and never parsed on the booking path, with one
//! exception ([`signed_fetch_hashes`]): a `kv.fetch` from an engine whose hashes
//! are signed 64-bit integers (SGLang) is rewritten so it names them as the
//! engine published them, since policies see every engine hash as a u64. An
//! action type the router does not know passes through untouched.

pub use kvhint_plugin_api::writer::PROTOCOL_VERSION;

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
}
