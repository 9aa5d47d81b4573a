//! The hint-policy trait and what it returns.

use crate::context::HintContext;
use std::fmt;

/// A KV hint policy. The router calls [`build_hints`](HintPolicy::build_hints)
/// once per booking, after the worker is chosen, from many threads at once.
pub trait HintPolicy: Send + Sync + 'static {
    /// The actions for the booked worker, in the engine's format. An error (or a
    /// panic) drops only this policy's actions for this booking.
    fn build_hints(&self, context: &HintContext<'_>) -> Result<Vec<Action>, HintError>;

    /// What this policy promises to send. A policy that sends the KV copy a
    /// selection policy committed to returns [`Commitments::KV_COPY`].
    fn commitments(&self) -> Commitments {
        Commitments::NONE
    }
}

/// One engine-format KV action, e.g. `kv.fetch` version `1.0`. The router adds
/// the `action_id`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Action {
    pub action_type: String,
    pub action_version: String,
    /// Must be a JSON object; anything else is dropped as malformed.
    pub payload: Payload,
}

impl Action {
    /// An action whose payload is a `serde_json::Value` (usually `json!({...})`).
    pub fn new(
        action_type: impl Into<String>,
        action_version: impl Into<String>,
        payload: serde_json::Value,
    ) -> Self {
        Self {
            action_type: action_type.into(),
            action_version: action_version.into(),
            payload: Payload::from(payload),
        }
    }

    /// An action whose payload is serialized straight from any `Serialize`
    /// type (a struct with named fields, a map), without building a `Value`
    /// first — the fast path for large payloads such as thousands of block
    /// hashes.
    pub fn serialize<T: serde::Serialize + ?Sized>(
        action_type: impl Into<String>,
        action_version: impl Into<String>,
        payload: &T,
    ) -> Result<Self, HintError> {
        Ok(Self {
            action_type: action_type.into(),
            action_version: action_version.into(),
            payload: Payload::serialize(payload)?,
        })
    }
}

/// An action's payload, kept as the compact JSON text it travels as: it is
/// written once, in the plugin, and copied into the engine message as it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Payload(String);

impl Payload {
    pub fn serialize<T: serde::Serialize + ?Sized>(value: &T) -> Result<Self, HintError> {
        serde_json::to_string(value)
            .map(Self)
            .map_err(|e| HintError::new(format!("the payload does not serialize: {e}")))
    }

    /// The JSON text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether it is a JSON object (serde_json's compact output of an object
    /// starts with `{`, and of nothing else).
    pub fn is_object(&self) -> bool {
        self.0.starts_with('{')
    }

    /// The payload decoded into a `Value` (for tests and inspection).
    pub fn to_value(&self) -> serde_json::Value {
        serde_json::from_str(&self.0).unwrap_or(serde_json::Value::Null)
    }

    pub fn into_string(self) -> String {
        self.0
    }
}

impl From<serde_json::Value> for Payload {
    fn from(value: serde_json::Value) -> Self {
        // Serializing a Value cannot fail.
        Self(value.to_string())
    }
}

/// What a policy commits to send. A small bit set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Commitments(u32);

impl Commitments {
    pub const NONE: Self = Self(0);
    /// Sends the KV copy the selection policy committed the booking to.
    pub const KV_COPY: Self = Self(1);

    pub const fn bits(self) -> u32 {
        self.0
    }

    /// Keeps unknown bits, so a newer plugin's commitments survive the trip.
    pub const fn from_bits(bits: u32) -> Self {
        Self(bits)
    }

    pub const fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }

    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }
}

impl std::ops::BitOr for Commitments {
    type Output = Self;
    fn bitor(self, rhs: Self) -> Self {
        Self(self.0 | rhs.0)
    }
}

impl fmt::Display for Commitments {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_empty() {
            return f.write_str("none");
        }
        let mut names = Vec::new();
        if self.contains(Self::KV_COPY) {
            names.push("KV_COPY".to_string());
        }
        let unknown = self.0 & !Self::KV_COPY.0;
        if unknown != 0 {
            names.push(format!("0x{unknown:x}"));
        }
        f.write_str(&names.join("|"))
    }
}

/// What kind of failure a [`HintError`] reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HintErrorKind {
    /// The policy's parameters were wrong; the router reports it against the
    /// YAML location of the `parameters` mapping.
    BadParameters,
    /// Anything else.
    Failed,
}

/// The error a policy or provider returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HintError {
    kind: HintErrorKind,
    message: String,
}

impl HintError {
    pub fn new(message: impl Into<String>) -> Self {
        Self {
            kind: HintErrorKind::Failed,
            message: message.into(),
        }
    }

    pub fn bad_parameters(message: impl Into<String>) -> Self {
        Self {
            kind: HintErrorKind::BadParameters,
            message: message.into(),
        }
    }

    pub fn kind(&self) -> HintErrorKind {
        self.kind
    }

    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for HintError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for HintError {}

impl From<String> for HintError {
    fn from(message: String) -> Self {
        Self::new(message)
    }
}

impl From<&str> for HintError {
    fn from(message: &str) -> Self {
        Self::new(message)
    }
}

/// `serde_json` errors in a provider almost always come from its parameters.
impl From<serde_json::Error> for HintError {
    fn from(error: serde_json::Error) -> Self {
        Self::bad_parameters(error.to_string())
    }
}
