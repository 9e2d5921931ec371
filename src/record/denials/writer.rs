//! Batched denial writes: many messages' denials committed in one transaction.
//!
//! Writing one row per transaction caps a worker near a few thousand denials a second; a
//! batch of hundreds costs about the same round trips as one row. Each caller waits for its own
//! batch to commit before its message is acked, so batching changes throughput, not
//! guarantees: a batch that fails for the service's sake (Postgres down, a timeout) fails every
//! caller in it, and each retries its message; a batch Postgres refuses for a row's data is
//! written again one row at a time, so one bad row fails only its own message.

use std::time::Duration;

use tokio::sync::{mpsc, oneshot};

use super::{DenialError, DenialRow, DenialStore};

struct Job {
    row: DenialRow,
    done: oneshot::Sender<Result<bool, DenialError>>,
}

/// Handle to the batching task; cheap to clone.
#[derive(Clone)]
pub struct DenialWriter {
    jobs: mpsc::Sender<Job>,
}

impl DenialWriter {
    /// Starts the batching task: a batch is written when it holds `max_batch` rows or
    /// `max_wait` after its first row arrived, whichever comes first.
    pub fn spawn(store: DenialStore, max_batch: usize, max_wait: Duration) -> DenialWriter {
        let (jobs, rx) = mpsc::channel(max_batch.max(1) * 4);
        tokio::spawn(run(store, rx, max_batch.max(1), max_wait));
        DenialWriter { jobs }
    }

    /// Records one denial once its batch has committed; false when the same event was already
    /// recorded.
    pub async fn write(&self, row: DenialRow) -> Result<bool, DenialError> {
        let (done, result) = oneshot::channel();
        self.jobs
            .send(Job { row, done })
            .await
            .map_err(|_| DenialError::WriterStopped)?;
        result.await.map_err(|_| DenialError::WriterStopped)?
    }
}

async fn run(
    store: DenialStore,
    mut rx: mpsc::Receiver<Job>,
    max_batch: usize,
    max_wait: Duration,
) {
    let batches = metrics::counter!(crate::base::telemetry::DENIAL_BATCHES);
    let failures = metrics::counter!(crate::base::telemetry::DENIAL_WRITE_FAILURES);
    while let Some(first) = rx.recv().await {
        let deadline = tokio::time::Instant::now() + max_wait;
        let mut batch = vec![first];
        while batch.len() < max_batch {
            match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some(job)) => batch.push(job),
                Ok(None) | Err(_) => break,
            }
        }
        // The rows are lent from their jobs: the insert only reads them, so moving each out
        // (an unzip of rows and senders) would copy every row of every batch for nothing.
        let rows: Vec<&DenialRow> = batch.iter().map(|job| &job.row).collect();
        match store.insert_batch(&rows).await {
            Ok(recorded) => {
                batches.increment(1);
                for (job, new) in batch.into_iter().zip(recorded) {
                    let _ = job.done.send(Ok(new));
                }
            }
            Err(e) if e.data_refusal().is_some() => {
                // Some row's data was refused: each row alone, so only that one fails.
                for job in batch {
                    let alone = store.insert_batch(&[&job.row]).await.map(|r| r[0]);
                    if alone.is_err() {
                        failures.increment(1);
                    }
                    let result = alone.map_err(|e| {
                        e.data_refusal()
                            .unwrap_or_else(|| DenialError::Batch(e.to_string()))
                    });
                    let _ = job.done.send(result);
                }
                batches.increment(1);
            }
            Err(e) => {
                failures.increment(1);
                let message = e.to_string();
                for job in batch {
                    let _ = job.done.send(Err(DenialError::Batch(message.clone())));
                }
            }
        }
    }
}
