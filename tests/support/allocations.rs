//! A global allocator that counts, for tests that assert on what a piece of code
//! allocates (never on how long it takes). A test binary installs it with
//! `#[global_allocator] static ALLOCATOR: Counting = Counting;` and measures with
//! [`counted`].

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Defers every call to the system allocator; while [`counted`] runs, it adds up
/// the calls that allocate (fresh or grown) and the bytes they ask for.
pub struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static CALLS: AtomicUsize = AtomicUsize::new(0);
static BYTES: AtomicUsize = AtomicUsize::new(0);

fn count(bytes: usize) {
    if COUNTING.load(Ordering::Relaxed) {
        CALLS.fetch_add(1, Ordering::Relaxed);
        BYTES.fetch_add(bytes, Ordering::Relaxed);
    }
}

// SAFETY: defers every call to the system allocator unchanged; it only adds to
// counters.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        // SAFETY: our caller upholds `GlobalAlloc::alloc`'s contract (a
        // non-zero-size `layout`); it is passed on to `System` unchanged.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: every block this allocator hands out came from `System`
        // (`alloc`, `realloc` above), so `ptr` is a `System` block of
        // `layout`, as our caller guarantees for this allocator.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(new_size);
        // SAFETY: as in `dealloc`, `ptr` is a `System` block of `layout`;
        // our caller guarantees `new_size`'s contract, passed on unchanged.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// What ran under [`counted`] allocated.
#[derive(Debug, Clone, Copy)]
pub struct Allocated {
    /// Calls that allocated or grew an allocation.
    pub calls: usize,
    /// Bytes those calls asked for (a grown allocation counts its new size).
    pub bytes: usize,
}

/// Runs `f`, counting what it allocates (on every thread: run nothing else
/// meanwhile). Counts only where [`Counting`] is the global allocator.
pub fn counted<R>(f: impl FnOnce() -> R) -> (R, Allocated) {
    CALLS.store(0, Ordering::Relaxed);
    BYTES.store(0, Ordering::Relaxed);
    COUNTING.store(true, Ordering::Relaxed);
    let result = f();
    COUNTING.store(false, Ordering::Relaxed);
    let allocated = Allocated {
        calls: CALLS.load(Ordering::Relaxed),
        bytes: BYTES.load(Ordering::Relaxed),
    };
    (result, allocated)
}
