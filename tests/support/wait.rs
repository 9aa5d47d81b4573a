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
        let (what, bound, report) = (self.what, self.bound, self.report);
        match poll(bound, self.every, || {
            Ok::<_, std::convert::Infallible>(check())
        }) {
            Ok(value) => value,
            Err(Stop::Failed(never)) => match never {},
            Err(Stop::TimedOut { checks, last }) => {
                let report = report.map(|r| r()).unwrap_or_default();
                panic!(
                    "timed out after {bound:?} ({checks} checks) waiting for {what}\n{last}\n{report}"
                );
            }
        }
    }

    /// For code that reports failures instead of panicking (a benchmark's
    /// section): polls `check` until it returns `Ok(Some(_))`; an `Err` from
    /// `check` ends the wait with that error, and the bound with "timed out
    /// after … waiting for `what`" (and the report, if any).
    pub fn try_until<T>(
        self,
        mut check: impl FnMut() -> Result<Option<T>, String>,
    ) -> Result<T, String> {
        let (what, bound, report) = (self.what, self.bound, self.report);
        let step = || match check() {
            Ok(Some(value)) => Ok(Ok(value)),
            Ok(None) => Ok(Err("")),
            Err(e) => Err(e),
        };
        match poll(bound, self.every, step) {
            Ok(value) => Ok(value),
            Err(Stop::Failed(e)) => Err(e),
            Err(Stop::TimedOut { checks, .. }) => {
                let report = report.map(|r| r()).unwrap_or_default();
                Err(format!(
                    "timed out after {bound:?} ({checks} checks) waiting for {what}{}{report}",
                    if report.is_empty() { "" } else { "\n" }
                ))
            }
        }
    }
}

/// Why [`poll`] stopped without a value.
enum Stop<F, L> {
    /// `step` failed outright.
    Failed(F),
    /// The bound passed; `last` is what the last check saw instead.
    TimedOut { checks: u64, last: L },
}

/// The loop itself: `step` at least once, then every `every` until the bound
/// has passed (a last look at the bound itself).
fn poll<T, L, F>(
    bound: Duration,
    every: Duration,
    mut step: impl FnMut() -> Result<Result<T, L>, F>,
) -> Result<T, Stop<F, L>> {
    let started = Instant::now();
    let mut checks = 0u64;
    loop {
        checks += 1;
        let last = match step() {
            Ok(Ok(value)) => return Ok(value),
            Ok(Err(last)) => last,
            Err(failed) => return Err(Stop::Failed(failed)),
        };
        match bound.checked_sub(started.elapsed()) {
            Some(left) if !left.is_zero() => std::thread::sleep(every.min(left)),
            _ => return Err(Stop::TimedOut { checks, last }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHORT: Duration = Duration::from_millis(30);

    fn panic_text(f: impl FnOnce() + std::panic::UnwindSafe) -> String {
        let payload = std::panic::catch_unwind(f).expect_err("the wait should fail");
        payload
            .downcast_ref::<String>()
            .cloned()
            .unwrap_or_default()
    }

    #[test]
    fn a_check_that_comes_true_gives_its_value() {
        let mut n = 0;
        let value = until("the third check", Duration::from_secs(10), || {
            n += 1;
            (n == 3).then_some(n * 10)
        });
        assert_eq!((value, n), (30, 3));
    }

    #[test]
    fn a_wait_that_times_out_names_what_it_waited_for_the_last_sight_and_the_report() {
        let text = panic_text(|| {
            Waiting::new("the moon", SHORT)
                .report(|| "the sky was cloudy".into())
                .until_ok(|| Err::<(), _>("no moon"))
        });
        assert!(text.starts_with("timed out after 30ms ("), "{text}");
        assert!(
            text.ends_with("checks) waiting for the moon\nno moon\nthe sky was cloudy"),
            "{text}"
        );
    }

    #[test]
    fn try_until_returns_the_timeout_and_the_checks_own_error_instead_of_panicking() {
        let timed_out = Waiting::new("nothing", SHORT).try_until(|| Ok(None::<()>));
        let error = timed_out.expect_err("times out");
        assert!(error.starts_with("timed out after 30ms ("), "{error}");
        assert!(error.ends_with("checks) waiting for nothing"), "{error}");
        let failed = Waiting::new("nothing", Duration::from_secs(10))
            .try_until(|| Err::<Option<()>, _>("the server is gone".to_string()));
        assert_eq!(failed, Err("the server is gone".to_string()));
    }

    #[test]
    fn the_check_runs_at_least_once_even_with_no_time() {
        assert_eq!(until("at once", Duration::ZERO, || Some(7)), 7);
    }
}
