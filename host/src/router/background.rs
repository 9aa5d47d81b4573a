//! How the event path's threads are scheduled: as background work beside bookings.
//!
//! When booking threads keep every core busy, each wakeup of another thread preempts a
//! booking in flight: Linux runs a thread that wakes at once if it has had less of the
//! CPU than the one running. Over a fleet, engine batches arrive thousands of times a
//! second, each waking its source's thread and then the ingestion thread. A wakeup
//! costs 20–40 µs on a VM, and one booking in a hundred delayed by that much is the
//! p99. The `concurrency` bench shows it with a control thread that wakes on the event
//! stream's schedule and applies nothing: the p99 moves as much as under the real
//! stream.
//!
//! `SCHED_BATCH` keeps a thread's share of the CPU and takes away only that wakeup
//! preemption. On an idle core the thread runs at once; with every core busy it runs
//! at the next scheduler tick (milliseconds at most), and takes what queued meanwhile
//! in one batch. So events stay well inside the 10 ms publish → booking target, and
//! bookings keep their p99. `kv_events.thread_policy: normal` restores the default.
//!
//! The setting is shared ([`Scheduling`]). Each thread of the event path follows it
//! ([`Follower`]) at the top of its loop, for the cost of an atomic load, so a reload
//! applies at each thread's next batch. Elsewhere than Linux it changes nothing.

use crate::domain::ThreadPolicy;
use std::sync::atomic::{AtomicU8, Ordering};

/// The policy the event path's threads should run under.
#[derive(Debug)]
pub struct Scheduling {
    policy: AtomicU8,
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
        }
    }

    /// Each thread takes it up at its next batch.
    pub fn set(&self, policy: ThreadPolicy) {
        self.policy.store(encode(policy), Ordering::Relaxed);
    }

    pub fn get(&self) -> ThreadPolicy {
        match self.policy.load(Ordering::Relaxed) {
            0 => ThreadPolicy::Batch,
            _ => ThreadPolicy::Normal,
        }
    }
}

fn encode(policy: ThreadPolicy) -> u8 {
    match policy {
        ThreadPolicy::Batch => 0,
        ThreadPolicy::Normal => 1,
    }
}

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
        let wanted = scheduling.get();
        if self.applied == Some(wanted) || self.refused == Some(wanted) {
            return;
        }
        match set_current_thread(wanted) {
            Ok(()) => {
                self.applied = Some(wanted);
                self.refused = None;
            }
            Err(e) => {
                self.refused = Some(wanted);
                tracing::warn!(
                    thread = std::thread::current().name().unwrap_or("unnamed"),
                    policy = wanted.as_str(),
                    "could not set the thread's scheduling policy ({e}); it keeps the one it \
                     has, so under a heavy event stream bookings may see a higher p99. A \
                     seccomp profile that denies sched_setscheduler is the usual cause; \
                     allow it, or set kv_events.thread_policy: normal to stop trying"
                );
            }
        }
    }
}

/// Puts the calling thread under `policy`.
pub fn set_current_thread(policy: ThreadPolicy) -> std::io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        let policy = match policy {
            ThreadPolicy::Batch => libc::SCHED_BATCH,
            ThreadPolicy::Normal => libc::SCHED_OTHER,
        };
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: pid 0 names the calling thread, and `param` is a valid `sched_param`
        // that outlives the call (priority 0, as both policies require).
        let rc = unsafe { libc::sched_setscheduler(0, policy, &param) };
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
            scheduling.set(ThreadPolicy::Normal);
            set_current_thread(ThreadPolicy::Batch).unwrap();
            follower.follow(&scheduling);
            assert_eq!(current(), libc::SCHED_OTHER);
            scheduling.set(ThreadPolicy::Batch);
            follower.follow(&scheduling);
            assert_eq!(current(), libc::SCHED_BATCH);
        })
        .join()
        .unwrap();
    }
}
