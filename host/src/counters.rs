//! Counters that every booking adds to, kept per thread.
//!
//! Each booking counts a call of its selection policy and of each hint policy, and
//! times them into latency histograms. As plain shared atomics those counters were
//! cache lines that every booking thread wrote: with two threads booking, each add
//! had to take the line from the other core first. On a VM whose two vCPUs the host
//! placed apart, a line took 200–1,000 ns to move. Those lines (four to six per
//! booking, with one policy of each kind) were most of the shared writes that pulled
//! two threads' bookings/s from about 1.9× one thread's down to 1.5–1.65× there
//! (BENCHMARKS.md has the runs). Here each
//! thread adds to a copy of its own, on lines of its own ([`CachePadded`]), and a
//! read (a metrics scrape, a test) sums the copies: an add never waits for another
//! core, and a read costs one pass over the threads that ever counted.
//!
//! A thread's copy outlives the thread: `thread_local` hands an exited thread's copy,
//! counts and all, to the next new thread, so totals never go down.

use crossbeam_utils::CachePadded;
use std::sync::atomic::{AtomicU64, Ordering};
use thread_local::ThreadLocal;

/// A monotonic count, added to per thread and summed when read.
#[derive(Debug, Default)]
pub struct Counter {
    per_thread: ThreadLocal<CachePadded<AtomicU64>>,
}

impl Counter {
    #[inline]
    pub fn add(&self, n: u64) {
        // Only this thread writes its copy; the add is atomic so that a read on
        // another thread sees whole values.
        self.per_thread
            .get_or_default()
            .fetch_add(n, Ordering::Relaxed);
    }

    /// The total over every thread.
    pub fn get(&self) -> u64 {
        self.per_thread
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .sum()
    }
}

/// Upper bounds (in microseconds) of the policy-latency histogram buckets.
pub const LATENCY_BUCKETS_US: [f64; 12] = [
    0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 5000.0,
];

/// One thread's histogram counts.
#[derive(Debug, Default)]
struct Buckets {
    /// Counts per bucket of [`LATENCY_BUCKETS_US`], plus one for +Inf.
    counts: [AtomicU64; LATENCY_BUCKETS_US.len() + 1],
    sum_nanos: AtomicU64,
}

/// A latency histogram: two adds to the calling thread's own lines per observation,
/// so timing a policy costs the booking path no lock and no shared write.
#[derive(Debug, Default)]
pub struct LatencyHistogram {
    per_thread: ThreadLocal<CachePadded<Buckets>>,
}

impl LatencyHistogram {
    pub fn observe(&self, nanos: u64) {
        let micros = nanos as f64 / 1000.0;
        let bucket = LATENCY_BUCKETS_US
            .iter()
            .position(|&bound| micros <= bound)
            .unwrap_or(LATENCY_BUCKETS_US.len());
        let mine = self.per_thread.get_or_default();
        mine.counts[bucket].fetch_add(1, Ordering::Relaxed);
        mine.sum_nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    /// Cumulative counts per bucket (the last is +Inf, i.e. the total count).
    pub fn cumulative(&self) -> Vec<u64> {
        let mut counts = [0u64; LATENCY_BUCKETS_US.len() + 1];
        for mine in self.per_thread.iter() {
            for (total, count) in counts.iter_mut().zip(&mine.counts) {
                *total += count.load(Ordering::Relaxed);
            }
        }
        let mut total = 0;
        counts
            .iter()
            .map(|c| {
                total += c;
                total
            })
            .collect()
    }

    /// Total time observed, in nanoseconds.
    pub fn sum_nanos(&self) -> u64 {
        self.per_thread
            .iter()
            .map(|b| b.sum_nanos.load(Ordering::Relaxed))
            .sum()
    }

    pub fn sum_seconds(&self) -> f64 {
        self.sum_nanos() as f64 / 1e9
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_from_many_threads_add_up_and_survive_the_threads() {
        let calls = Counter::default();
        let latency = LatencyHistogram::default();
        std::thread::scope(|s| {
            for t in 0..8u64 {
                let (calls, latency) = (&calls, &latency);
                s.spawn(move || {
                    for i in 0..1000u64 {
                        calls.add(1);
                        // 0.3 µs, 3 µs and 7 ms: the first, fourth and +Inf buckets.
                        latency.observe([300, 3_000, 7_000_000][((t + i) % 3) as usize]);
                    }
                });
            }
        });
        // Every thread has exited; their counts stay.
        assert_eq!(calls.get(), 8000);
        let cumulative = latency.cumulative();
        assert_eq!(cumulative.len(), LATENCY_BUCKETS_US.len() + 1);
        assert_eq!(*cumulative.last().unwrap(), 8000);
        assert_eq!(cumulative[0], 2667, "0.3 µs: the first bucket");
        assert_eq!(cumulative[2], 2667, "nothing between 0.5 and 2 µs");
        assert_eq!(cumulative[3], 2667 + 2667, "3 µs: the 5 µs bucket");
        assert_eq!(cumulative[11], 2667 + 2667, "7 ms is over every bound");
        assert_eq!(
            latency.sum_nanos(),
            2667 * 300 + 2667 * 3_000 + 2666 * 7_000_000
        );
        // A new thread after the others exited adds on to the totals.
        std::thread::spawn(move || {
            calls.add(5);
            assert_eq!(calls.get(), 8005);
        })
        .join()
        .unwrap();
    }
}
