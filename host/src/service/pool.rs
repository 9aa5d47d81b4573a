//! The booking pool: bookings run on threads of their own, never on the async runtime's
//! workers.
//!
//! A booking is CPU work (hashing, the index walk, selection) plus the hint policies,
//! which are plugin code the router does not control: a slow or blocking policy on a
//! runtime worker would stall every connection that worker serves. So the handler hands
//! the booking to a fixed pool and awaits the answer; the runtime keeps accepting,
//! reading and writing. The queue is bounded: when it is full the booking is refused at
//! once (503 `overloaded`) rather than queued without limit.

use crossbeam_channel::{Sender, TrySendError};
use std::thread::JoinHandle;

type Job = Box<dyn FnOnce() + Send + 'static>;

pub struct BookingPool {
    jobs: Sender<Job>,
    threads: usize,
    _workers: Vec<JoinHandle<()>>,
}

/// The pool's queue is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Overloaded;

impl BookingPool {
    /// `threads` booking threads (at least one) with `queue` waiting jobs at most.
    pub fn new(threads: usize, queue: usize) -> std::io::Result<Self> {
        let threads = threads.max(1);
        let (jobs, receiver) = crossbeam_channel::bounded::<Job>(queue.max(1));
        let mut workers = Vec::with_capacity(threads);
        for i in 0..threads {
            let receiver = receiver.clone();
            workers.push(
                std::thread::Builder::new()
                    .name(format!("kvhint-book-{i}"))
                    .spawn(move || {
                        while let Ok(job) = receiver.recv() {
                            job();
                        }
                    })?,
            );
        }
        Ok(Self {
            jobs,
            threads,
            _workers: workers,
        })
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `f` on a booking thread and returns its result.
    pub async fn run<R: Send + 'static>(
        &self,
        f: impl FnOnce() -> R + Send + 'static,
    ) -> Result<R, Overloaded> {
        let (reply, result) = tokio::sync::oneshot::channel();
        let job: Job = Box::new(move || {
            let _ = reply.send(f());
        });
        match self.jobs.try_send(job) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => return Err(Overloaded),
        }
        // A job that panicked drops its sender; report that as overload rather than
        // hanging the request (the router itself does not panic on user input).
        result.await.map_err(|_| Overloaded)
    }
}
