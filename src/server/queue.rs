//! The bounded FIFO between the HTTP handlers and the engine thread. A full queue turns a
//! request away at once with a 503 instead of letting waits grow without bound.

use super::error::ApiError;
use super::metrics::Metrics;
use super::worker::Job;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};

/// The sending side, shared by all handlers.
#[derive(Clone)]
pub struct JobQueue {
    tx: SyncSender<Job>,
    capacity: usize,
}

impl JobQueue {
    /// A queue holding at most `capacity` waiting jobs (at least 1), and its receiving end
    /// for the engine thread.
    pub fn new(capacity: usize) -> (Self, Receiver<Job>) {
        let capacity = capacity.max(1);
        let (tx, rx) = sync_channel(capacity);
        (Self { tx, capacity }, rx)
    }

    /// Queues `job`, or answers why it cannot wait (503: full, or the engine has stopped).
    pub fn submit(&self, job: Job, metrics: &Metrics) -> Result<(), ApiError> {
        // Count first so the engine can never take the job off before it was counted.
        metrics.enqueued();
        match self.tx.try_send(job) {
            Ok(()) => Ok(()),
            Err(e) => {
                metrics.unqueued();
                Err(match e {
                    TrySendError::Full(_) => ApiError::unavailable(format!(
                        "the request queue is full ({} waiting); retry shortly",
                        self.capacity
                    )),
                    TrySendError::Disconnected(_) => ApiError::shutting_down(
                        "the engine has stopped; the server is shutting down",
                    ),
                })
            }
        }
    }
}
