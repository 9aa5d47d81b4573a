//! The ingestion path: one thread that applies KV events in batches.
//!
//! Every source of events (the HTTP endpoint, engine subscriptions) hands its
//! events to one bounded queue; the ingestion thread takes whatever has queued up — up to
//! [`MAX_BATCH`] events — applies them in order and publishes them to bookings at once.
//! Under a light stream a batch is one event and it is visible within microseconds;
//! under a heavy one, batching amortises the publish (one wait for the readers in flight
//! per batch). Bookings never wait for it: they read the published copy of the index.
//! A full queue refuses new events at once instead of growing without bound.
//!
//! The thread runs under the event path's scheduling policy ([`super::background`]):
//! by default it never preempts a booking when it wakes.

use super::background::{Follower, Scheduling};
use super::index::{ApplyStats, KvEvent};
use super::{Router, RouterError};
use crate::domain::{ThreadPolicy, WorkerKey};
use crossbeam_channel::{Receiver, Sender, TrySendError};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

/// Events applied and published together at most.
pub const MAX_BATCH: usize = 1024;

type Reply = tokio::sync::oneshot::Sender<Result<ApplyStats, RouterError>>;

/// Where a batch's results go: a channel its submitter owns and reuses.
pub type BatchReply = crossbeam_channel::Sender<Vec<Result<ApplyStats, RouterError>>>;

enum Job {
    One {
        worker: WorkerKey,
        event: KvEvent,
        reply: Option<Reply>,
    },
    /// An engine's batch: applied in order, its results handed back together.
    Batch {
        events: Vec<(WorkerKey, KvEvent)>,
        reply: BatchReply,
    },
    /// Nothing to apply: the thread wakes to take up a new scheduling policy.
    Wake,
}

impl Job {
    fn len(&self) -> usize {
        match self {
            Self::One { .. } => 1,
            Self::Batch { events, .. } => events.len(),
            Self::Wake => 0,
        }
    }
}

/// Counters of the ingestion path.
#[derive(Debug, Default)]
pub struct IngestStats {
    pub batches: AtomicU64,
    pub events: AtomicU64,
    pub refused_full: AtomicU64,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the KV-event queue is full ({capacity} entries waiting); the event was not applied — retry after a short wait")]
pub struct QueueFull {
    pub capacity: usize,
}

/// A handle to submit events; the thread stops when every handle is dropped.
#[derive(Clone)]
pub struct Ingest {
    queue: Sender<Job>,
    capacity: usize,
    pub stats: Arc<IngestStats>,
    /// The policy this thread and the engine subscriptions feeding it run under.
    scheduling: Arc<Scheduling>,
}

impl Ingest {
    /// Starts the ingestion thread for `router`, with a queue of `capacity` entries (an
    /// API event, or an engine batch).
    pub fn start(router: Arc<Router>, capacity: usize) -> std::io::Result<(Self, JoinHandle<()>)> {
        let (queue, jobs) = crossbeam_channel::bounded(capacity.max(1));
        let stats = Arc::new(IngestStats::default());
        let thread_stats = Arc::clone(&stats);
        let scheduling = Arc::new(Scheduling::default());
        let thread_scheduling = Arc::clone(&scheduling);
        let thread = std::thread::Builder::new()
            .name("kvhint-ingest".into())
            .spawn(move || run(&router, &jobs, &thread_stats, &thread_scheduling))?;
        Ok((
            Self {
                queue,
                capacity: capacity.max(1),
                stats,
                scheduling,
            },
            thread,
        ))
    }

    /// The event path's threads take `policy` up within their next wait: the
    /// ingestion thread is woken for it (unless its queue is full, when it is busy and
    /// takes it up at its next batch).
    pub fn set_thread_policy(&self, policy: ThreadPolicy) {
        if self.scheduling.set(policy) {
            let _ = self.queue.try_send(Job::Wake);
        }
    }

    /// What the event path's threads follow (the engine subscriptions too).
    pub fn scheduling(&self) -> &Scheduling {
        &self.scheduling
    }

    /// Queues one event; the receiver gets its result once it is visible to bookings.
    pub fn submit(
        &self,
        worker: WorkerKey,
        event: KvEvent,
    ) -> Result<tokio::sync::oneshot::Receiver<Result<ApplyStats, RouterError>>, QueueFull> {
        let (reply, result) = tokio::sync::oneshot::channel();
        self.send(Job::One {
            worker,
            event,
            reply: Some(reply),
        })
        .map_err(|(full, _)| full)?;
        Ok(result)
    }

    /// Queues one event whose result nobody waits for.
    pub fn submit_detached(&self, worker: WorkerKey, event: KvEvent) -> Result<(), QueueFull> {
        self.send(Job::One {
            worker,
            event,
            reply: None,
        })
        .map_err(|(full, _)| full)
    }

    /// Queues an engine batch; its results (one per event, in order) arrive on `reply`
    /// once the batch is visible to bookings. The batch takes one place in the queue.
    /// A full queue hands the events back.
    pub fn submit_batch(
        &self,
        events: Vec<(WorkerKey, KvEvent)>,
        reply: BatchReply,
    ) -> Result<(), (QueueFull, Vec<(WorkerKey, KvEvent)>)> {
        self.send(Job::Batch { events, reply })
            .map_err(|(full, job)| match job {
                Job::Batch { events, .. } => (full, events),
                Job::One { worker, event, .. } => (full, vec![(worker, event)]),
                Job::Wake => (full, Vec::new()),
            })
    }

    #[allow(clippy::result_large_err)] // the job comes back only when the queue is full
    fn send(&self, job: Job) -> Result<(), (QueueFull, Job)> {
        match self.queue.try_send(job) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(job) | TrySendError::Disconnected(job)) => {
                self.stats.refused_full.fetch_add(1, Ordering::Relaxed);
                Err((
                    QueueFull {
                        capacity: self.capacity,
                    },
                    job,
                ))
            }
        }
    }
}

fn run(router: &Router, jobs: &Receiver<Job>, stats: &IngestStats, scheduling: &Scheduling) {
    let mut batch: Vec<Job> = Vec::with_capacity(MAX_BATCH);
    let mut follower = Follower::default();
    follower.follow(scheduling);
    while let Ok(first) = jobs.recv() {
        follower.follow(scheduling);
        let mut events = first.len();
        batch.push(first);
        while events < MAX_BATCH {
            match jobs.try_recv() {
                Ok(job) => {
                    events += job.len();
                    batch.push(job);
                }
                Err(_) => break,
            }
        }
        let mut all: Vec<(WorkerKey, KvEvent)> = Vec::with_capacity(events);
        let mut replies = Vec::with_capacity(batch.len());
        for job in batch.drain(..) {
            match job {
                Job::One {
                    worker,
                    event,
                    reply,
                } => {
                    all.push((worker, event));
                    replies.push((1, Pending::One(reply)));
                }
                Job::Batch { events, reply } => {
                    replies.push((events.len(), Pending::Batch(reply)));
                    all.extend(events);
                }
                Job::Wake => {}
            }
        }
        if all.is_empty() && replies.is_empty() {
            // Only wakes: nothing to publish.
            continue;
        }
        let mut results = router.apply_kv_events(all).into_iter();
        stats.batches.fetch_add(1, Ordering::Relaxed);
        stats.events.fetch_add(events as u64, Ordering::Relaxed);
        for (count, reply) in replies {
            match reply {
                Pending::One(reply) => {
                    let result = results.next().unwrap_or(Ok(ApplyStats::default()));
                    if let Some(reply) = reply {
                        // The caller may have gone (its connection closed): nothing to do.
                        let _ = reply.send(result);
                    }
                }
                Pending::Batch(reply) => {
                    let _ = reply.send(results.by_ref().take(count).collect());
                }
            }
        }
    }
}

enum Pending {
    One(Option<Reply>),
    Batch(BatchReply),
}
