//! The open-bookings count, capped exactly (`router.max_open_bookings`).
//!
//! One atomic that every booking and every release writes. Per-thread allowances (a
//! thread opening bookings from units it took from the shared count in chunks, so that
//! line is written once per chunk) replaced it for a while: on this project's two cores
//! they made no difference that could be told from the noise in twenty interleaved runs
//! (docs/performance.md), so the simple count is back. Were the router to book on many
//! cores, this line is the one every booking writes: measure there before adding
//! allowances again.

use crossbeam_utils::CachePadded;
use std::sync::atomic::{AtomicUsize, Ordering};

#[derive(Debug, Default)]
pub struct OpenCount {
    /// Bookings open; never raised past the cap a booking is given.
    open: CachePadded<AtomicUsize>,
}

impl OpenCount {
    /// Counts one booking in, unless `max` bookings are open; then `Err` with how many
    /// are. A reload that lowers the cap binds the next booking.
    pub fn open(&self, max: usize) -> Result<(), usize> {
        self.open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .map(|_| ())
    }

    /// Counts one booking out (released, or refused after [`Self::open`]).
    pub fn close(&self) {
        self.close_many(1);
    }

    /// Counts `n` bookings out at once (expired, or dropped with their worker).
    pub fn close_many(&self, n: usize) {
        if n > 0 {
            self.open.fetch_sub(n, Ordering::AcqRel);
        }
    }

    /// Bookings open.
    pub fn get(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Barrier;
    use std::thread;

    /// Many threads opening at once never get past the cap, and get exactly to it.
    #[test]
    fn threads_opening_at_once_reach_the_cap_exactly_and_never_pass_it() {
        for max in [1, 7, 16, 53, 1000] {
            let count = OpenCount::default();
            let threads = 8;
            let barrier = Barrier::new(threads);
            let opened: usize = thread::scope(|s| {
                let handles: Vec<_> = (0..threads)
                    .map(|_| {
                        s.spawn(|| {
                            barrier.wait();
                            let mut mine = 0;
                            // Each tries for more than the cap; refusals end it.
                            while mine <= max && count.open(max).is_ok() {
                                mine += 1;
                            }
                            mine
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).sum()
            });
            assert_eq!(opened, max, "cap {max}");
            assert_eq!(count.get(), max);
            assert_eq!(count.open(max), Err(max));
        }
    }

    /// Releases on other threads keep the count exact: the whole cap can be opened
    /// again.
    #[test]
    fn units_released_on_other_threads_are_counted_and_can_be_opened_again() {
        let max = 100;
        let count = OpenCount::default();
        for _ in 0..max {
            count.open(max).expect("under the cap");
        }
        assert_eq!(count.open(max), Err(max));
        thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..max / 4 {
                        count.close();
                    }
                });
            }
        });
        assert_eq!(count.get(), 0);
        for _ in 0..max {
            count.open(max).expect("the released units are free again");
        }
        assert_eq!(count.get(), max);
        assert_eq!(count.open(max), Err(max));
        count.close_many(max);
        assert_eq!(count.get(), 0);
    }

    /// Threads opening, closing and closing in bulk at once never hold more than the
    /// cap open, and the count is exact once they stop.
    #[test]
    fn mixed_opens_and_closes_on_many_threads_never_pass_the_cap() {
        let max = 40;
        let count = OpenCount::default();
        let live = AtomicUsize::new(0);
        let most = AtomicUsize::new(0);
        thread::scope(|s| {
            for t in 0..6 {
                let (count, live, most) = (&count, &live, &most);
                s.spawn(move || {
                    let mut held = 0usize;
                    for i in 0..20_000usize {
                        if (i + t) % 3 != 0 && count.open(max).is_ok() {
                            held += 1;
                            let now = live.fetch_add(1, Ordering::AcqRel) + 1;
                            most.fetch_max(now, Ordering::AcqRel);
                        } else if held > 0 && i % 7 == 0 {
                            // A bulk close, as an expiry sweep does.
                            let n = held.min(3);
                            live.fetch_sub(n, Ordering::AcqRel);
                            count.close_many(n);
                            held -= n;
                        } else if held > 0 {
                            live.fetch_sub(1, Ordering::AcqRel);
                            count.close();
                            held -= 1;
                        }
                    }
                    live.fetch_sub(held, Ordering::AcqRel);
                    count.close_many(held);
                });
            }
        });
        let most = most.load(Ordering::Acquire);
        assert!(most <= max, "{most} open at once, cap {max}");
        assert!(most > max / 2, "the threads reached only {most} of {max}");
        assert_eq!(count.get(), 0);
    }

    /// A lowered cap binds the next booking at once.
    #[test]
    fn a_lowered_cap_binds_the_next_booking() {
        let count = OpenCount::default();
        for _ in 0..10 {
            count.open(1000).expect("under the cap");
        }
        assert_eq!(count.open(5), Err(10));
        assert_eq!(count.open(10), Err(10));
        assert_eq!(count.open(11), Ok(()));
        assert_eq!(count.get(), 11);
    }
}
