//! The open-bookings count, capped exactly (`router.max_open_bookings`), without a
//! shared write per booking.
//!
//! As one atomic, the count was a cache line that every booking and every release
//! wrote, whatever worker it booked: with two threads booking, each add first took the
//! line from the other core. It was the one line that every booking wrote, which is
//! what would have bounded the router on many cores. (On this project's two cores,
//! leaving it unwritten moved the median two-thread scaling from 1.71 to 1.85 in one
//! set of seven runs; the allowances below made no difference that could be told from
//! the noise in twenty runs, taking turns with the build before. BENCHMARKS.md has
//! both.)
//!
//! So each thread holds an *allowance*: bookings it may open without asking the shared
//! count. The shared count (`taken`) counts the bookings open plus every allowance
//! held, and is never raised past the cap: a thread takes an allowance in chunks of
//! [`CHUNK`], only while a whole chunk fits under the cap. A booking spends one unit of
//! its thread's allowance; a release gives one back to the allowance of the thread it
//! runs on (a thread that books and releases in turn never touches the shared count),
//! and past [`SPARE_MAX`] gives a chunk back to the shared count. Near the cap, chunks
//! no longer fit: a booking then takes one unit at a time, and before refusing takes
//! back every thread's allowance. So the cap is never exceeded, and a booking is
//! refused only when the shared count, after every allowance is taken back, is at
//! the cap. That count includes units on their way between the shared count and a
//! thread's allowance: a thread between the two steps of taking a chunk (or giving
//! one back) holds up to [`CHUNK`] units that no one can take back for that moment,
//! so a booking racing it near the cap may be refused with up to that many per such
//! thread below the cap, and the `open` its refusal reports counts them. The steps
//! cannot be swapped: the shared count must never count low, or the cap could be
//! passed.
//!
//! A reload may lower the cap under allowances taken before: a thread spends its
//! allowance only while the shared count is within the cap it is given (a read of a
//! line that changes once per chunk, not a write).

use crossbeam_utils::CachePadded;
use std::sync::atomic::{AtomicUsize, Ordering};
use thread_local::ThreadLocal;

/// Units a thread takes from the shared count at once.
pub const CHUNK: usize = 16;
/// The most a thread keeps from its releases before giving units back.
pub const SPARE_MAX: usize = 2 * CHUNK;

#[derive(Debug, Default)]
pub struct OpenCount {
    /// Bookings open plus the allowances held; never raised past the cap.
    taken: CachePadded<AtomicUsize>,
    /// Each thread's allowance, on lines of its own. An exited thread's passes to the
    /// next new thread (`thread_local` reuses it), so no unit is ever lost.
    spare: ThreadLocal<CachePadded<AtomicUsize>>,
}

impl OpenCount {
    /// Counts one booking in, unless `max` bookings are open; then `Err` with how many
    /// are.
    pub fn open(&self, max: usize) -> Result<(), usize> {
        let mine = self.spare.get_or_default();
        // The thread's own units, while the count is within the cap: `taken` bounds
        // the bookings open, so one more from an allowance stays within it.
        if self.taken.load(Ordering::Acquire) <= max && take_unit(mine) {
            return Ok(());
        }
        // A chunk: this booking and the thread's next ones.
        if self
            .taken
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| {
                t.checked_add(CHUNK).filter(|&after| after <= max)
            })
            .is_ok()
        {
            mine.fetch_add(CHUNK - 1, Ordering::AcqRel);
            return Ok(());
        }
        // Near the cap: one unit, after taking back every allowance if need be.
        for reclaimed in [false, true] {
            if reclaimed {
                self.reclaim();
            }
            if self
                .taken
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| {
                    (t < max).then_some(t + 1)
                })
                .is_ok()
            {
                return Ok(());
            }
        }
        Err(self.get())
    }

    /// Counts one booking out (released, or refused after [`Self::open`]). A thread
    /// that only releases (an HTTP handler, while bookings run on the booking pool)
    /// gives its units back a chunk at a time, so it too writes the shared count once
    /// per [`CHUNK`] releases.
    pub fn close(&self) {
        let mine = self.spare.get_or_default();
        if mine.fetch_add(1, Ordering::AcqRel) + 1 > SPARE_MAX
            && mine
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |s| {
                    s.checked_sub(CHUNK)
                })
                .is_ok()
        {
            self.taken.fetch_sub(CHUNK, Ordering::AcqRel);
        }
    }

    /// Counts `n` bookings out at once (expired, or dropped with their worker).
    pub fn close_many(&self, n: usize) {
        if n > 0 {
            self.taken.fetch_sub(n, Ordering::AcqRel);
        }
    }

    /// Bookings open: the shared count less the allowances. Exact when no booking or
    /// release is in flight.
    pub fn get(&self) -> usize {
        let spare: usize = self.spare.iter().map(|s| s.load(Ordering::Acquire)).sum();
        self.taken.load(Ordering::Acquire).saturating_sub(spare)
    }

    /// Takes every thread's allowance back into the shared count.
    fn reclaim(&self) {
        for spare in self.spare.iter() {
            let units = spare.swap(0, Ordering::AcqRel);
            if units > 0 {
                self.taken.fetch_sub(units, Ordering::AcqRel);
            }
        }
    }
}

/// Spends one unit of a thread's allowance, if it has one.
#[inline]
fn take_unit(spare: &AtomicUsize) -> bool {
    spare
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |s| s.checked_sub(1))
        .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Barrier;
    use std::thread;

    /// Many threads opening at once never get past the cap, and get exactly to it:
    /// allowances held by the others are taken back before anyone is refused.
    #[test]
    fn threads_opening_at_once_reach_the_cap_exactly_and_never_pass_it() {
        for max in [1, 7, CHUNK, 3 * CHUNK + 5, 1000] {
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

    /// Releases on other threads keep the count exact, and the units they keep are
    /// taken back when the cap is near: the whole cap can be opened again.
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

    /// A thread that only releases writes the shared count once per chunk, and the
    /// count stays exact.
    #[test]
    fn a_thread_that_only_releases_gives_units_back_a_chunk_at_a_time() {
        let max = 1000;
        let count = OpenCount::default();
        for _ in 0..max {
            count.open(max).expect("under the cap");
        }
        let taken_before = count.taken.load(Ordering::Relaxed);
        thread::scope(|s| {
            s.spawn(|| {
                let mut writes = 0;
                for _ in 0..max {
                    let before = count.taken.load(Ordering::Relaxed);
                    count.close();
                    writes += usize::from(count.taken.load(Ordering::Relaxed) != before);
                }
                assert_eq!(writes, (max - SPARE_MAX).div_ceil(CHUNK));
            });
        });
        assert_eq!(count.get(), 0);
        assert!(count.taken.load(Ordering::Relaxed) <= taken_before - (max - SPARE_MAX - CHUNK));
    }

    /// A lowered cap binds at once, even for a thread holding an allowance taken under
    /// the old one.
    #[test]
    fn a_lowered_cap_binds_a_thread_that_holds_an_allowance() {
        let count = OpenCount::default();
        for _ in 0..10 {
            count.open(1000).expect("under the cap");
        }
        // The first open took a chunk: this thread holds CHUNK - 10 units.
        assert!(count.spare.iter().any(|s| s.load(Ordering::Relaxed) > 0));
        assert_eq!(count.open(5), Err(10));
        assert_eq!(count.open(10), Err(10));
        assert_eq!(count.open(11), Ok(()));
        assert_eq!(count.get(), 11);
    }
}
