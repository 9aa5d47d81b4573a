//! The engine-format hint message (rule R10): the envelope vLLM, SGLang and
//! Dynamo converge on.
//!
//! ```json
//! {"protocol_version":"0.1","message_id":"req-1","actions":[
//!   {"action_id":"a1","action_type":"kv.fetch","action_version":"1.0",
//!    "payload":{"source_control_endpoint":"tcp://10.0.0.7:23280","block_hashes":[11,22]}}]}
//! ```
//!
//! Payloads arrive from plugins as JSON text and are embedded as they are
//! (`RawValue`): validated once, never decoded into a tree and encoded again,
//! and an action type the router does not know passes through untouched.

use serde::{Serialize, Serializer};
use serde_json::value::RawValue;

pub const PROTOCOL_VERSION: &str = "0.1";

/// The hard cap on actions in one message (rule R7).
pub const MAX_ACTIONS: usize = 32;

#[derive(Serialize)]
pub(crate) struct Envelope<'a> {
    pub protocol_version: &'static str,
    pub message_id: &'a str,
    pub actions: &'a [EnvelopeAction<'a>],
}

#[derive(Serialize)]
pub(crate) struct EnvelopeAction<'a> {
    pub action_id: ActionId,
    pub action_type: &'a str,
    pub action_version: &'a str,
    pub payload: &'a RawValue,
}

/// `a1`, `a2`, … numbered by the host in policy order.
#[derive(Clone, Copy)]
pub(crate) struct ActionId(pub usize);

impl Serialize for ActionId {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(&format_args!("a{}", self.0))
    }
}

/// Why an action a plugin returned is not sent.
pub(crate) fn malformed(action_type: &str, action_version: &str, payload: &str) -> Option<String> {
    if action_type.is_empty() {
        return Some("an action has an empty action_type".into());
    }
    if action_version.is_empty() {
        return Some(format!(
            "action {action_type:?} has an empty action_version"
        ));
    }
    match serde_json::from_str::<&RawValue>(payload) {
        Err(e) => Some(format!(
            "action {action_type:?} has a payload that is not JSON: {e}"
        )),
        Ok(raw) if !raw.get().trim_start().starts_with('{') => Some(format!(
            "action {action_type:?} has a payload that is not a JSON object: {}",
            truncate(raw.get(), 80)
        )),
        Ok(_) => None,
    }
}

fn truncate(text: &str, max: usize) -> &str {
    match text.char_indices().nth(max) {
        Some((i, _)) => &text[..i],
        None => text,
    }
}
