//! How the event path's threads are scheduled: as background work beside bookings.
//!
//! When booking threads keep every core busy, each wakeup of another thread preempts a
//! booking in flight: Linux gives a thread that wakes the core at once if it has had
//! less of the CPU than the one running. Over a fleet, engine batches arrive thousands
//! of times a second, each waking its source's thread and then the ingestion thread.
//! The booking it lands on waits tens of microseconds (the wakeup, and whatever the
//! thread then does), and one booking in a hundred delayed like that is the p99. The
//! `concurrency` bench shows it with a control thread that wakes on the event stream's
//! schedule and applies nothing: the p99 moves as much as under the real stream.
//!
//! `SCHED_BATCH` keeps a thread's share of the CPU and takes away only that wakeup
//! preemption. On a core with time to spare the thread runs at once; with every core
//! busy it runs when the scheduler next preempts (at its tick, every few
//! milliseconds), and takes what queued meanwhile in one batch. So, under full load
//! only, events become visible milliseconds later instead of microseconds (the bench
//! measured 1.8–2 ms at the median and 11–15 ms at worst, where `normal` gave
//! 0.07 ms and 5–13 ms), and bookings keep their p99. `kv_events.thread_policy: normal`
//! restores the default.
//!
//! The setting is shared ([`Scheduling`]). Each thread of the event path follows it
//! ([`Follower`]) in its loops, for the cost of an atomic load, so a reload reaches
//! every thread within its next wait. libzmq's own I/O thread is not one of them: it
//! is started with the router, under the process's policy (see `engine_events`), and
//! wakes for each engine message under it. Elsewhere than Linux this changes nothing.

use crate::domain::ThreadPolicy;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};

/// The policy the event path's threads should run under.
#[derive(Debug)]
pub struct Scheduling {
    policy: AtomicU8,
    /// Times a thread could not take the policy up.
    refusals: AtomicU64,
}

impl Default for Scheduling {
    fn default() -> Self {
        Self::new(ThreadPolicy::default())
    }
}

impl Scheduling {
    pub fn new(policy: ThreadPolicy) -> Self {
        Self {
            policy: AtomicU8::new(encode(policy)),
            refusals: AtomicU64::new(0),
        }
    }

    /// Each thread takes it up within its next wait; returns whether it changed.
    pub fn set(&self, policy: ThreadPolicy) -> bool {
        self.policy.swap(encode(policy), Ordering::Relaxed) != encode(policy)
    }

    pub fn get(&self) -> ThreadPolicy {
        match self.policy.load(Ordering::Relaxed) {
            0 => ThreadPolicy::Batch,
            _ => ThreadPolicy::Normal,
        }
    }

    /// Times a thread could not take the policy up (the system refused the call).
    pub fn refusals(&self) -> u64 {
        self.refusals.load(Ordering::Relaxed)
    }
}

fn encode(policy: ThreadPolicy) -> u8 {
    match policy {
        ThreadPolicy::Batch => 0,
        ThreadPolicy::Normal => 1,
    }
}

/// Set once the first refusal has been logged: one warning per process, not one per
/// thread and per change.
static WARNED: AtomicBool = AtomicBool::new(false);

/// One thread's view of the policy it runs under: it changes the thread's policy only
/// when the shared setting changed, and tries a policy the system refused once only.
#[derive(Debug, Default)]
pub struct Follower {
    applied: Option<ThreadPolicy>,
    refused: Option<ThreadPolicy>,
}

impl Follower {
    /// Puts the calling thread under `scheduling`'s policy if it is not already.
    pub fn follow(&mut self, scheduling: &Scheduling) {
        self.follow_with(scheduling, set_current_thread);
    }

    fn follow_with(
        &mut self,
        scheduling: &Scheduling,
        set: impl FnOnce(ThreadPolicy) -> std::io::Result<()>,
    ) {
        let wanted = scheduling.get();
        if self.applied == Some(wanted) || self.refused == Some(wanted) {
            return;
        }
        match set(wanted) {
            Ok(()) => {
                self.applied = Some(wanted);
                self.refused = None;
            }
            Err(e) => {
                self.refused = Some(wanted);
                scheduling.refusals.fetch_add(1, Ordering::Relaxed);
                if !WARNED.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        thread = std::thread::current().name().unwrap_or("unnamed"),
                        policy = wanted.as_str(),
                        "could not set an event thread's scheduling policy ({e}); the \
                         event path's threads keep the policy they have, so under a heavy \
                         event stream bookings may see a higher p99 (counted as \
                         thread_policy_refusals in /admin/status; this warning is logged \
                         once). A seccomp profile that denies sched_setscheduler is the \
                         usual cause: allow it, or set kv_events.thread_policy: normal, \
                         which needs no call for threads already under the default policy"
                    );
                }
            }
        }
    }
}

/// Puts the calling thread under `policy` (threads it starts later inherit it).
/// `normal` on a thread already under it makes no call.
pub fn set_current_thread(policy: ThreadPolicy) -> std::io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        let policy = match policy {
            ThreadPolicy::Batch => libc::SCHED_BATCH,
            ThreadPolicy::Normal => {
                // SAFETY: pid 0 names the calling thread; the call reads nothing else.
                if unsafe { libc::syscall(libc::SYS_sched_getscheduler, 0) }
                    == libc::c_long::from(libc::SCHED_OTHER)
                {
                    return Ok(());
                }
                libc::SCHED_OTHER
            }
        };
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: pid 0 names the calling thread, and `param` is a valid `sched_param`
        // that outlives the call (priority 0, as both policies require). The system
        // call itself, not libc's wrapper: some C libraries stub the wrapper out.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_sched_setscheduler,
                0,
                policy,
                &param as *const libc::sched_param,
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = policy;
        Ok(())
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    fn current() -> i32 {
        // SAFETY: pid 0 names the calling thread.
        unsafe { libc::sched_getscheduler(0) }
    }

    #[test]
    fn a_follower_moves_its_thread_when_the_setting_changes_and_only_then() {
        std::thread::spawn(|| {
            set_current_thread(ThreadPolicy::Normal).unwrap();
            let scheduling = Scheduling::default();
            let mut follower = Follower::default();
            assert_eq!(current(), libc::SCHED_OTHER);
            follower.follow(&scheduling);
            assert_eq!(current(), libc::SCHED_BATCH);
            // Moved behind the follower's back: it does not look again until the
            // setting changes (a follow is an atomic load, not a system call).
            set_current_thread(ThreadPolicy::Normal).unwrap();
            follower.follow(&scheduling);
            assert_eq!(current(), libc::SCHED_OTHER);
            assert!(scheduling.set(ThreadPolicy::Normal));
            assert!(!scheduling.set(ThreadPolicy::Normal), "no change");
            set_current_thread(ThreadPolicy::Batch).unwrap();
            follower.follow(&scheduling);
            assert_eq!(current(), libc::SCHED_OTHER);
            scheduling.set(ThreadPolicy::Batch);
            follower.follow(&scheduling);
            assert_eq!(current(), libc::SCHED_BATCH);
            assert_eq!(scheduling.refusals(), 0);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_refused_policy_is_counted_and_tried_again_only_after_a_change() {
        let scheduling = Scheduling::default();
        let mut follower = Follower::default();
        let mut calls = Vec::new();
        let refuse = |follower: &mut Follower, calls: &mut Vec<ThreadPolicy>| {
            follower.follow_with(&scheduling, |p| {
                calls.push(p);
                Err(std::io::Error::from_raw_os_error(libc::EPERM))
            })
        };
        refuse(&mut follower, &mut calls);
        refuse(&mut follower, &mut calls);
        assert_eq!(calls, [ThreadPolicy::Batch], "a refusal is not retried");
        assert_eq!(scheduling.refusals(), 1);
        scheduling.set(ThreadPolicy::Normal);
        refuse(&mut follower, &mut calls);
        assert_eq!(calls, [ThreadPolicy::Batch, ThreadPolicy::Normal]);
        assert_eq!(scheduling.refusals(), 2);
        // Granted at last: applied, and not asked again.
        scheduling.set(ThreadPolicy::Batch);
        follower.follow_with(&scheduling, |p| {
            calls.push(p);
            Ok(())
        });
        follower.follow_with(&scheduling, |_| unreachable!("already applied"));
        assert_eq!(calls.last(), Some(&ThreadPolicy::Batch));
        assert_eq!(scheduling.refusals(), 2);
    }
}
