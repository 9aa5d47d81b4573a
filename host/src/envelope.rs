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
//! valid by construction and never parsed on the booking path. Engine hashes go
//! out as their engine published them: hashes the hint stage lent a policy from an
//! engine that publishes signed 64-bit integers (SGLang) are written signed when the
//! policy passes them on (the writer knows the slices it lent; see
//! `kvhint_plugin_api::writer::SignedHashes`), so the host knows no action type's
//! payload fields. An action type the router does not know passes through untouched.

pub use kvhint_plugin_api::writer::PROTOCOL_VERSION;
