//! The booking pool: bookings run on threads of their own, never on the async runtime's
//! workers.
//!
//! A booking is CPU work (hashing, the index walk, selection) plus the hint policies,
//! which are plugin code the router does not control: a slow or blocking policy on a
//! runtime worker would stall every connection that worker serves. So the handler hands
//! the booking to a fixed pool and awaits the answer; the runtime keeps accepting,
//! reading and writing. The queue is bounded: when it is full the booking is refused at
//! once (`overloaded`: 503 at the booking API, 429 at the OpenAI doors, as
//! `gateway::error::OVERLOADED` says) rather than queued without limit.

use crossbeam_channel::{Sender, TrySendError};
use std::thread::JoinHandle;

type Job = Box<dyn FnOnce() + Send + 'static>;

pub struct BookingPool {
    /// `None`: no pool; bookings run on the runtime's thread under `block_in_place`.
    jobs: Option<Sender<Job>>,
    threads: usize,
    _workers: Vec<JoinHandle<()>>,
}

/// The pool's queue is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Overloaded;

impl BookingPool {
    /// `threads` booking threads with `queue` waiting jobs at most. With 0 threads,
    /// a booking runs on the HTTP runtime's thread that received it, inside
    /// `tokio::task::block_in_place`: the runtime hands that thread's other tasks to
    /// another worker while the booking runs, so it still parks no worker that
    /// others wait on.
    pub fn new(threads: usize, queue: usize) -> std::io::Result<Self> {
        if threads == 0 {
            return Ok(Self {
                jobs: None,
                threads: 0,
                _workers: Vec::new(),
            });
        }
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
            jobs: Some(jobs),
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
        let Some(jobs) = &self.jobs else {
            return Ok(tokio::task::block_in_place(f));
        };
        let (reply, result) = tokio::sync::oneshot::channel();
        let job: Job = Box::new(move || {
            // The request that queued it is gone (its client disconnected, its
            // future was dropped): nobody would read the answer, so the
            // booking and its hint policies do not run.
            if reply.is_closed() {
                return;
            }
            let _ = reply.send(f());
        });
        match jobs.try_send(job) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => return Err(Overloaded),
        }
        // A job that panicked drops its sender; report that as overload rather than
        // hanging the request (the router itself does not panic on user input).
        result.await.map_err(|_| Overloaded)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{mpsc, Arc};
    use std::time::Duration;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_queued_booking_whose_request_is_gone_is_dropped_not_run() {
        let pool = Arc::new(BookingPool::new(1, 8).unwrap());
        // Hold the only booking thread until told.
        let (held_tx, held_rx) = mpsc::channel::<()>();
        let (release_tx, release_rx) = mpsc::channel::<()>();
        let holder = tokio::spawn({
            let pool = Arc::clone(&pool);
            async move {
                pool.run(move || {
                    let _ = held_tx.send(());
                    let _ = release_rx.recv();
                })
                .await
            }
        });
        tokio::task::spawn_blocking(move || held_rx.recv())
            .await
            .unwrap()
            .unwrap();
        // Queue a booking (one poll sends it), then drop its request's future,
        // as a disconnected client's is.
        let ran = Arc::new(AtomicUsize::new(0));
        let mut queued = Box::pin(pool.run({
            let ran = Arc::clone(&ran);
            move || ran.fetch_add(1, Ordering::SeqCst)
        }));
        assert!(tokio::time::timeout(Duration::ZERO, &mut queued)
            .await
            .is_err());
        drop(queued);
        release_tx.send(()).unwrap();
        holder.await.unwrap().unwrap();
        // Jobs run in order on the one thread: this one comes after the
        // abandoned one was taken off the queue.
        assert_eq!(pool.run(|| 7).await.unwrap(), 7);
        assert_eq!(ran.load(Ordering::SeqCst), 0, "the abandoned booking ran");
    }
}
