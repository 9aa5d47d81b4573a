//! `kvhint replay`: books a JSONL trace offline, through the same router and
//! snapshot code `serve` uses, and prints every booking with its hint.
//!
//! A bad line is reported with its line number and skipped, so one typo does
//! not hide the rest of a long trace; the exit status says whether any line
//! failed.

use crate::router::{Booking, Router};
use crate::snapshot::Snapshot;
use crate::wire::{BookingView, TraceRecord};
use serde::Serialize;
use std::collections::BTreeMap;
use std::io::{BufRead, Write};
use std::path::Path;

#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize)]
pub struct ReplaySummary {
    pub records: u64,
    pub workers: u64,
    pub kv_events: u64,
    pub bookings: u64,
    pub hints: u64,
    pub actions_by_type: BTreeMap<String, u64>,
    pub committed_copies: u64,
    pub dropped_actions: u64,
    /// Failed policy calls by policy name.
    pub policy_failures: BTreeMap<String, u64>,
    /// Bookings without a hint message, by reason.
    pub hints_skipped: BTreeMap<String, u64>,
    pub releases: u64,
    /// Lines that failed (malformed, or refused by the router).
    pub errors: u64,
}

impl ReplaySummary {
    fn count(&mut self, booking: &Booking, hint_sent: bool) {
        self.bookings += 1;
        if hint_sent {
            self.hints += 1;
        }
        for action_type in booking.action_types() {
            *self.actions_by_type.entry(action_type.clone()).or_default() += 1;
        }
        if booking.committed_copy.is_some() {
            self.committed_copies += 1;
        }
        self.dropped_actions += booking.dropped_actions as u64;
        for failure in &booking.policy_failures {
            *self
                .policy_failures
                .entry(failure.policy.clone())
                .or_default() += 1;
        }
        if let Some(skip) = booking.hint_skipped() {
            let reason = serde_json::to_value(skip)
                .ok()
                .and_then(|v| v.as_str().map(str::to_string))
                .unwrap_or_default();
            *self.hints_skipped.entry(reason).or_default() += 1;
        }
    }
}

/// Replays `trace` (read from `name` for messages): bookings as JSONL on `out`,
/// line errors on `err`.
pub fn replay(
    router: &Router,
    snapshot: &Snapshot,
    name: &Path,
    trace: impl BufRead,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> std::io::Result<ReplaySummary> {
    let mut summary = ReplaySummary::default();
    // Lines are read as bytes: a line that is not UTF-8 is a bad line, reported
    // and skipped like any other, not the end of the replay.
    let mut trace = trace;
    let mut bytes = Vec::new();
    for number in 0usize.. {
        bytes.clear();
        if trace.read_until(b'\n', &mut bytes)? == 0 {
            break;
        }
        let text = std::str::from_utf8(&bytes);
        let line = text.unwrap_or_default().trim_end_matches(['\n', '\r']);
        if text.is_ok() && (line.trim().is_empty() || line.trim_start().starts_with('#')) {
            continue;
        }
        summary.records += 1;
        let mut fail = |message: String| -> std::io::Result<()> {
            summary.errors += 1;
            // One error, one line: a message quoting the input (serde names an
            // unknown `type` as written) could carry a line break.
            let message = message.replace('\n', "\\n").replace('\r', "\\r");
            writeln!(err, "{}:{}: {message}", name.display(), number + 1)
        };
        if let Err(e) = text {
            fail(format!(
                "not UTF-8 text (an invalid byte at column {}); a trace is JSON lines in UTF-8",
                e.valid_up_to() + 1
            ))?;
            continue;
        }
        let record: TraceRecord = match serde_json::from_str(line) {
            Ok(record) => record,
            Err(e) => {
                fail(format!("not a trace record: {e}"))?;
                continue;
            }
        };
        match record {
            TraceRecord::Worker(registration) => match router.register_worker(registration) {
                Ok(_) => summary.workers += 1,
                Err(e) => fail(e.to_string())?,
            },
            TraceRecord::Deregister(worker) => {
                if let Err(e) = router.deregister_worker(worker.key()) {
                    fail(e.to_string())?;
                }
            }
            TraceRecord::KvEvent(body) => match router.apply_kv_event(body.key(), body.event) {
                Ok(_) => summary.kv_events += 1,
                Err(e) => fail(e.to_string())?,
            },
            TraceRecord::Request(body) => {
                let session = body.session_text();
                let request = body.request(session.as_deref());
                let booked = crate::router::configured_role(snapshot, request.role)
                    .and_then(|role| Ok((role, router.book(role, &request)?)));
                match booked {
                    Ok((role, booking)) => {
                        summary.count(&booking, booking.hint.message().is_some());
                        let view = BookingView::new(&booking, role);
                        let text = serde_json::to_string(&view).map_err(std::io::Error::other)?;
                        writeln!(out, "{text}")?;
                    }
                    Err(e) => fail(format!("request {:?}: {e}", body.request_id))?,
                }
            }
            TraceRecord::Release(body) => match router.release(&body.request_id) {
                Ok(_) => summary.releases += 1,
                Err(e) => fail(e.to_string())?,
            },
        }
    }
    Ok(summary)
}
