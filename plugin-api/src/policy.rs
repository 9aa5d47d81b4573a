//! The hint-policy trait and the errors policies return.

use crate::actions::Actions;
use crate::context::HintContext;
use std::fmt;

/// A KV hint policy. The router calls [`build_hints`](HintPolicy::build_hints)
/// once per booking, after the worker is chosen, from many threads at once.
///
/// Plugins run inside the router's process, on the booking's thread: a policy
/// must not block (no I/O, no locks held long, no sleeping). Calls that keep
/// running over `router.policy_budget_us` get the policy quarantined until the
/// next reload.
pub trait HintPolicy: Send + Sync + 'static {
    /// Writes the actions for the booked worker, in the engine's format, with
    /// [`Actions::push`]. An error (or a panic) drops only this policy's
    /// actions for this booking, including any it already pushed.
    fn build_hints(
        &self,
        context: &HintContext<'_>,
        actions: &mut Actions<'_>,
    ) -> Result<(), HintError>;

    /// What this policy promises to send. A policy that sends the KV copy a
    /// selection policy committed to returns [`Commitments::KV_COPY`].
    fn commitments(&self) -> Commitments {
        Commitments::NONE
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

/// A `serde_json` error inside `build_hints` (a session context that does not
/// parse, a value that does not convert) is the policy failing on this booking.
/// Parameter errors come from [`Parameters::deserialize`](crate::registry::Parameters::deserialize),
/// which says so itself.
impl From<serde_json::Error> for HintError {
    fn from(error: serde_json::Error) -> Self {
        Self::new(error.to_string())
    }
}
