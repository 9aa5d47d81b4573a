//! The one way a test waits for something another thread or process does: poll
//! a check until it holds, within a bound, and fail naming what was awaited
//! (and whatever the caller adds: a log, a status) instead of hanging the run.
//! Never a timing assertion: the bound only stops a wait that would not end.
//!
//! ```no_run
//! # use std::time::Duration;
//! # fn open_bookings() -> u64 { 0 }
//! // A value once it exists …
//! let n = kvhint_e2e::wait::until("no open booking", Duration::from_secs(20), || {
//!     (open_bookings() == 0).then_some(())
//! });
//! // … or with a report on failure and a slower poll.
//! kvhint_e2e::wait::Waiting::new("the publisher to join", Duration::from_secs(30))
//!     .every(Duration::from_millis(50))
//!     .report(|| "its status: …".to_string())
//!     .until(|| Some(()));
//! ```

use std::time::{Duration, Instant};

/// How often a check is polled unless [`Waiting::every`] says otherwise.
pub const POLL: Duration = Duration::from_millis(20);

/// Polls `check` every [`POLL`] until it returns `Some`, for at most `bound`;
/// fails the test with "timed out after … waiting for `what`" otherwise.
pub fn until<T>(what: &str, bound: Duration, check: impl FnMut() -> Option<T>) -> T {
    Waiting::new(what, bound).until(check)
}

/// Like [`until`], for a check that says what it saw instead (`Err`): the
/// failure shows the last of it.
pub fn until_ok<T, E: std::fmt::Display>(
    what: &str,
    bound: Duration,
    check: impl FnMut() -> Result<T, E>,
) -> T {
    Waiting::new(what, bound).until_ok(check)
}

/// [`until`] for a check that is a plain condition.
pub fn until_true(what: &str, bound: Duration, mut check: impl FnMut() -> bool) {
    until(what, bound, || check().then_some(()))
}

/// A wait being set up: what it is for, its bound, its poll interval, and what
/// to print with the failure.
#[must_use = "a wait does nothing until `until` is called"]
pub struct Waiting<'a> {
    what: &'a str,
    bound: Duration,
    every: Duration,
    report: Option<Box<dyn FnOnce() -> String + 'a>>,
}

impl<'a> Waiting<'a> {
    pub fn new(what: &'a str, bound: Duration) -> Waiting<'a> {
        Waiting {
            what,
            bound,
            every: POLL,
            report: None,
        }
    }

    /// Polls every `every` instead of [`POLL`] (a check that sends something
    /// each time, say).
    pub fn every(mut self, every: Duration) -> Self {
        self.every = every;
        self
    }

    /// What the failure message adds after the line naming the wait (a log, a
    /// status), computed only if the wait fails.
    pub fn report(mut self, report: impl FnOnce() -> String + 'a) -> Self {
        self.report = Some(Box::new(report));
        self
    }

    /// Polls `check` until it returns `Some`, at least once and until the
    /// bound has passed; fails the test otherwise.
    pub fn until<T>(self, mut check: impl FnMut() -> Option<T>) -> T {
        self.until_ok(|| check().ok_or(""))
    }

    /// Polls `check` until it returns `Ok`, at least once and until the bound
    /// has passed; fails the test otherwise, with the last `Err` (what was
    /// seen instead: a view, a status).
    pub fn until_ok<T, E: std::fmt::Display>(self, mut check: impl FnMut() -> Result<T, E>) -> T {
        let started = Instant::now();
        let mut checks = 0u64;
        let last = loop {
            checks += 1;
            let seen = match check() {
                Ok(value) => return value,
                Err(seen) => seen,
            };
            match self.bound.checked_sub(started.elapsed()) {
                Some(left) if !left.is_zero() => std::thread::sleep(self.every.min(left)),
                _ => break seen,
            }
        };
        let report = self.report.map(|r| r()).unwrap_or_default();
        panic!(
            "timed out after {:?} ({checks} checks) waiting for {}\n{last}\n{report}",
            self.bound, self.what
        );
    }
}
