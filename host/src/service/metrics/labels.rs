//! Counts by an open-ended label (a hint action's type, an API error's code) that a
//! booking thread adds to without a lock, and that cannot grow without bound.
//!
//! A fleet has a handful of action types, so the counts are an append-only list
//! searched from the start: a label seen before costs a few string compares and one
//! atomic add; a new one is appended (`boxcar`, which never moves an entry, so no
//! reader waits). Two threads seeing a new label at once may both append it; the
//! scrape sums the two. Plugins name action types, so past [`MAX_LABELS`] distinct
//! labels the rest are counted under [`OTHER`]: a plugin inventing names cannot grow
//! `/metrics` (or this list) without bound.
//!
//! Hand-written because it measured better than what it replaced: the `RwLock`ed
//! `HashMap` this was cost a booking 22–34 ns to count, this 8.6–8.8 ns (BENCHMARKS.md,
//! "Bookings", `metrics_booked_ns`). prometheus-client's `Family` is the same
//! `RwLock`ed map, so it would cost what the old one did.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Distinct labels counted apart; the rest share [`OTHER`].
pub const MAX_LABELS: usize = 64;

/// The label the counts past the first [`MAX_LABELS`] distinct labels go under.
pub const OTHER: &str = "other";

#[derive(Debug, Default)]
pub struct LabelCounts {
    seen: boxcar::Vec<(Box<str>, AtomicU64)>,
    /// Appends started (at most [`MAX_LABELS`] of them succeed).
    claimed: AtomicUsize,
    other: AtomicU64,
}

impl LabelCounts {
    /// Adds `by` to `label`'s count: no lock, no allocation once `label` was seen.
    pub fn add(&self, label: &str, by: u64) {
        for (_, (name, count)) in &self.seen {
            if **name == *label {
                count.fetch_add(by, Ordering::Relaxed);
                return;
            }
        }
        // Claim an entry first, so racing threads never append past the cap.
        if self.claimed.load(Ordering::Relaxed) < MAX_LABELS
            && self.claimed.fetch_add(1, Ordering::Relaxed) < MAX_LABELS
        {
            self.seen.push((label.into(), AtomicU64::new(by)));
        } else {
            self.other.fetch_add(by, Ordering::Relaxed);
        }
    }

    /// Every label's count, sorted by label, with [`OTHER`] among them if anything
    /// was counted past the cap (a label appended twice is summed once here).
    pub fn counts(&self) -> Vec<(String, u64)> {
        let mut counts: BTreeMap<&str, u64> = BTreeMap::new();
        for (_, (name, count)) in &self.seen {
            *counts.entry(name).or_default() += count.load(Ordering::Relaxed);
        }
        let other = self.other.load(Ordering::Relaxed);
        if other > 0 {
            *counts.entry(OTHER).or_default() += other;
        }
        counts
            .into_iter()
            .map(|(name, count)| (name.to_string(), count))
            .collect()
    }

    /// Labels held apart (duplicates of a race included): at most [`MAX_LABELS`].
    pub fn distinct(&self) -> usize {
        self.seen.count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn action_types_counted_from_several_threads_add_up_exactly() {
        let counts = LabelCounts::default();
        let types = ["kv.fetch", "kv.prefetch", "session.pin", "kv.evict"];
        std::thread::scope(|scope| {
            for thread in 0..4u64 {
                let counts = &counts;
                scope.spawn(move || {
                    for i in 0..10_000u64 {
                        // Each thread starts on another type, so first sightings race.
                        let t = types[((i + thread) % types.len() as u64) as usize];
                        counts.add(t, 1 + thread);
                    }
                });
            }
        });
        // 10,000 adds per thread, 2,500 of each type, of 1 + thread each:
        // 2,500 × (1 + 2 + 3 + 4) = 25,000 per type.
        let mut want: Vec<(String, u64)> = types.iter().map(|t| (t.to_string(), 25_000)).collect();
        want.sort();
        assert_eq!(counts.counts(), want);
        assert!(counts.distinct() >= 4 && counts.distinct() <= 16);
    }

    #[test]
    fn labels_invented_past_the_cap_are_counted_under_other_and_none_is_lost() {
        let counts = LabelCounts::default();
        std::thread::scope(|scope| {
            for thread in 0..4 {
                let counts = &counts;
                scope.spawn(move || {
                    for i in 0..1_000 {
                        counts.add(&format!("invented.{thread}.{i}"), 1);
                    }
                });
            }
        });
        let all = counts.counts();
        // 64 distinct types apart, everything else under `other`: nothing lost.
        assert_eq!(counts.distinct(), MAX_LABELS);
        assert_eq!(all.len(), MAX_LABELS + 1);
        assert_eq!(all.iter().map(|(_, n)| n).sum::<u64>(), 4_000);
        let other = all.iter().find(|(name, _)| name == OTHER);
        assert_eq!(other, Some(&(OTHER.to_string(), 4_000 - MAX_LABELS as u64)));
        // A type seen before the cap keeps its own count afterwards.
        let (first, before) = all[0].clone();
        counts.add(&first, 5);
        assert!(counts.counts().contains(&(first, before + 5)));
    }
}
