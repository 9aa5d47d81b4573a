//! Test hooks: points inside a booking and inside a batch of KV events where a
//! test can act, so that it forces the interleavings the concurrency tests
//! otherwise reach by chance (`tests/concurrency.rs` has both kinds).
//!
//! Compiled in only with the `test-hooks` feature, which the end-to-end tests turn
//! on; without it [`pause`] is an empty inline function. With it, a booking pays
//! one relaxed load of a flag no one writes while no hook is set.

use crate::domain::WorkerKey;

/// Where a hook runs, on the thread doing the work, before it goes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pause {
    /// A batch of KV events has read the worker table and not yet queued its
    /// events to the index.
    EventsTableRead,
    /// A booking has chosen `worker` on the table it read and not yet reserved
    /// its load.
    Chosen { worker: WorkerKey },
    /// A booking has reserved its load on `worker` and not yet run its hint
    /// stage; `copy_source` is where the copy it committed comes from.
    Reserved {
        worker: WorkerKey,
        copy_source: Option<WorkerKey>,
    },
}

#[cfg(not(feature = "test-hooks"))]
#[inline(always)]
pub(crate) fn pause(_: Pause) {}

#[cfg(feature = "test-hooks")]
pub use on::{on_pause, HookGuard};

#[cfg(feature = "test-hooks")]
pub(crate) use on::pause;

#[cfg(feature = "test-hooks")]
mod on {
    use super::Pause;
    use std::cell::RefCell;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Hooks set on any thread: while none is, [`pause`] reads only this.
    static SET: AtomicUsize = AtomicUsize::new(0);

    type Hook = Box<dyn FnMut(Pause)>;

    thread_local! {
        static HOOK: RefCell<Option<Hook>> = const { RefCell::new(None) };
    }

    /// Runs `hook` at every [`Pause`] this thread reaches until the guard drops.
    /// The hook may call the router (deregister a worker, apply events): the
    /// pauses those calls reach meanwhile do not run it again.
    pub fn on_pause(hook: impl FnMut(Pause) + 'static) -> HookGuard {
        HOOK.with(|slot| *slot.borrow_mut() = Some(Box::new(hook)));
        SET.fetch_add(1, Ordering::Relaxed);
        HookGuard {
            _not_send: std::marker::PhantomData,
        }
    }

    /// Removes the thread's hook when dropped.
    pub struct HookGuard {
        _not_send: std::marker::PhantomData<*const ()>,
    }

    impl Drop for HookGuard {
        fn drop(&mut self) {
            HOOK.with(|slot| *slot.borrow_mut() = None);
            SET.fetch_sub(1, Ordering::Relaxed);
        }
    }

    #[inline]
    pub(crate) fn pause(at: Pause) {
        if SET.load(Ordering::Relaxed) == 0 {
            return;
        }
        // Out of its slot while it runs, so a pause it reaches is a no-op.
        let Some(mut hook) = HOOK.with(|slot| slot.borrow_mut().take()) else {
            return;
        };
        hook(at);
        HOOK.with(|slot| {
            let mut slot = slot.borrow_mut();
            if slot.is_none() {
                *slot = Some(hook);
            }
        });
    }
}
