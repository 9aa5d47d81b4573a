//! Getting a source back in step after a loss: replaying what the engine still
//! buffers from its replay socket, or clearing the worker and rebuilding from the
//! events that follow.
//!
//! Apart from the socket loop (`super`), as Dynamo keeps its indexer's recovery
//! apart: the loop only classifies each message (next, gap, duplicate, restart)
//! and hands a loss here; what a recovery does, how often it retries and when it
//! settles for a clear are read in one place.

use super::*;

impl Thread<'_> {
    /// Clears every worker this source fed (its cache is no longer known). A clear the
    /// queue cannot take now goes in front of the next batch queued.
    pub(super) fn resync(&mut self) {
        self.stats().resyncs.fetch_add(1, Ordering::Relaxed);
        self.pending_clear = true;
        let _ = self.submit(Vec::new());
    }

    /// Runs `first` and whatever recovery it leads to, one at a time (never nested),
    /// backing off between rounds so a router that stays overloaded is not flooded
    /// with replays; after [`MAX_RECOVERY_ROUNDS`] it settles for a clear.
    pub(super) fn recover(&mut self, first: Recovery) {
        if !matches!(first, Recovery::History) {
            // A new loss: an orphan after it may rebuild once more.
            self.parent_rebuilt = false;
        }
        let mut next = Some(first);
        let mut round = 0u32;
        while let Some(recovery) = next.take() {
            if self.stopped() {
                return;
            }
            round += 1;
            if round > MAX_RECOVERY_ROUNDS {
                self.resync();
                return;
            }
            if round > 1 {
                self.pause(Duration::from_millis(10 << round.min(8)));
            }
            next = self.recover_once(recovery);
        }
    }

    /// One recovery; returns the next one it calls for (a replayed batch that could
    /// not be queued).
    fn recover_once(&mut self, recovery: Recovery) -> Option<Recovery> {
        let from = match recovery {
            Recovery::Clear => {
                self.resync();
                return None;
            }
            Recovery::Rebuild => {
                self.resync();
                0
            }
            Recovery::History => 0,
            Recovery::Gap { from } => from,
        };
        let Some(replay) = self.endpoints().replay.clone() else {
            if let Recovery::Gap { .. } = recovery {
                self.resync();
            }
            return None;
        };
        // Replaying (and up) only from live: a replay asked for while no publisher
        // has been heard (a source's history at start, say) leaves it connecting,
        // since nothing says the engine is there.
        let before = self.stats().state();
        let from_live = before == SourceState::Live;
        if from_live {
            self.stats().set_state(SourceState::Replaying);
        }
        self.stats().replays.fetch_add(1, Ordering::Relaxed);
        let fetched = self.fetch_replay(&replay, from);
        if from_live {
            self.stats().set_state(before);
        }
        let batches = match fetched {
            Ok(batches) => batches,
            Err(problem) => {
                self.stats().replay_failures.fetch_add(1, Ordering::Relaxed);
                if self.warnings.due(Warn::Recovery) {
                    tracing::warn!(
                        worker_id = self.sub.shared.worker.worker_id,
                        dp_rank = self.sub.shared.worker.dp_rank,
                        replay = %replay,
                        "KV-event replay failed ({problem}); clearing this worker's index \
                         entries, they are rebuilt from its next events"
                    );
                }
                if !matches!(recovery, Recovery::Rebuild | Recovery::History) {
                    self.resync();
                }
                return None;
            }
        };
        if let Recovery::Gap { from } = recovery {
            // An empty answer, or one that starts after the first batch missed: the
            // engine no longer has it.
            if batches.first().is_none_or(|(seq, _)| *seq > from) {
                self.stats().replay_short.fetch_add(1, Ordering::Relaxed);
                self.resync();
            }
        }
        self.cursor.replayed_from = batches.first().map(|(seq, _)| *seq);
        let mut orphans = false;
        for (seq, payload) in batches {
            if self.stopped() {
                return None;
            }
            if seq < from {
                continue;
            }
            match self.apply(seq, &payload) {
                Applied::Ok => {}
                Applied::UnknownParent => orphans = true,
                Applied::Malformed => self.pending_clear = true,
                Applied::Lost => return Some(Recovery::Gap { from: seq }),
            }
        }
        if orphans || matches!(recovery, Recovery::Rebuild) {
            // What the buffer could not rebuild stays unknown until stored again.
            self.parent_rebuilt = true;
        }
        None
    }

    /// Asks the replay socket for every batch from `from`: `[b"", seq]` out; replies
    /// `[b"", topic, seq, payload]` (or `[b"", seq, payload]` from vLLM before 0.26)
    /// until the end marker (`seq` all ones, in either form).
    fn fetch_replay(&mut self, replay: &str, from: u64) -> Result<Vec<(u64, Vec<u8>)>, String> {
        let dealer = self
            .sub
            .context
            .socket(zmq::DEALER)
            .map_err(|e| format!("cannot create a DEALER socket: {e}"))?;
        dealer
            .set_linger(0)
            .and_then(|()| dealer.set_maxmsgsize(MAX_MESSAGE_BYTES))
            .and_then(|()| dealer.set_ipv6(replay.contains('[')))
            .map_err(|e| format!("cannot configure the DEALER socket: {e}"))?;
        dealer
            .connect(replay)
            .map_err(|e| format!("cannot connect to {replay}: {e}"))?;
        dealer
            .send_multipart([&b""[..], &from.to_be_bytes()[..]], 0)
            .map_err(|e| format!("cannot send the replay request: {e}"))?;
        let deadline = Instant::now() + self.sub.options.replay_timeout;
        let mut batches = Vec::new();
        loop {
            if self.stopped() {
                return Err("the source was stopped".into());
            }
            self.follower.follow(self.sub.ingest.scheduling());
            // A replay may take seconds: the SUB socket's monitor is read meanwhile.
            self.read_monitor();
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(format!(
                    "no end marker within {:?} ({} batches received)",
                    self.sub.options.replay_timeout,
                    batches.len()
                ));
            }
            match dealer.poll(zmq::POLLIN, left.min(POLL).as_millis().max(1) as i64) {
                Ok(0) => continue,
                Ok(_) => {}
                Err(e) => return Err(format!("polling the DEALER socket failed: {e}")),
            }
            let frames = match dealer.recv_multipart(zmq::DONTWAIT) {
                Ok(frames) => frames,
                Err(zmq::Error::EAGAIN) => continue,
                Err(e) => return Err(format!("receiving a replay failed: {e}")),
            };
            let (seq, payload) = match frames.as_slice() {
                [empty, _topic, seq, payload] if empty.is_empty() => (seq, payload),
                [empty, seq, payload] if empty.is_empty() => (seq, payload),
                _ => {
                    self.stats().frame_errors.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
            };
            if seq.as_slice() == END_SEQ {
                return Ok(batches);
            }
            let Ok(seq) = <[u8; 8]>::try_from(seq.as_slice()).map(u64::from_be_bytes) else {
                self.stats().frame_errors.fetch_add(1, Ordering::Relaxed);
                continue;
            };
            if batches.len() >= self.sub.options.replay_max_batches {
                return Err(format!(
                    "the replay sent more than {} batches",
                    self.sub.options.replay_max_batches
                ));
            }
            batches.push((seq, payload.clone()));
        }
    }
}
