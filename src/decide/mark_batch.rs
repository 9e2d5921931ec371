//! Dispatch marks of many messages written together: the marks of messages confirmed close
//! together go to Redis as one pipeline (one per slot on a cluster, where a pipeline cannot
//! cross slots and each recipient's keys hash to its own), instead of one request each.
//!
//! A message's task hands its mark to [`MarkBatch`] and waits for its own answer; nothing is
//! held back to fill a batch: the writer takes whatever marks are waiting when it wakes, and
//! more than one batch may be in flight, so a mark waits at most for the writes already under
//! way to leave room. Each mark's replies are read on their own: a mark the server refused
//! (or a batch that failed as a whole) is answered `false`, and that message then writes its
//! mark alone with the retries of `DispatchMarks::mark_dispatched` ([`crate::decide::dedup`]),
//! so one bad mark never fails the others and no message is acked before its mark is written.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use futures_util::stream::{FuturesUnordered, StreamExt};
use redis::Value;
use tokio::sync::{mpsc, oneshot};

use crate::base::store::RedisConn;
use crate::decide::keys;

/// One mark in this many also drops the expired marks of its recipient's set. Expired marks
/// are harmless where they stay (readers compare a mark's expiry with their now, and the set
/// expires whole after its newest mark), so they are only removed to bound the set of a
/// recipient who keeps receiving messages: dropping them on every mark cost Redis a third
/// command per dispatch.
pub const PRUNE_EVERY: u64 = 8;

/// The commands of a mark, shared by a mark written alone
/// ([`crate::decide::dedup::DispatchMarks::mark`]) and the batches here.
#[derive(Clone)]
pub(crate) struct MarkCommands {
    pub namespace: String,
    /// How long a mark is kept, ms.
    pub ttl_ms: i64,
    /// Marks written so far, for [`PRUNE_EVERY`].
    pub written: Arc<AtomicU64>,
}

impl MarkCommands {
    /// Adds to `pipe` the commands of one mark of `message_id` under the recipient hash tag
    /// `tag` at `now_ms`; returns how many (their replies follow in that order). The mark
    /// supersedes the delivery's in-flight claim (any copy is a duplicate now); the set lives
    /// as long as its newest mark.
    pub fn add(
        &self,
        pipe: &mut redis::Pipeline,
        tag: &str,
        message_id: &str,
        now_ms: i64,
    ) -> usize {
        let key = keys::sent_key(&self.namespace, tag);
        pipe.zadd(&key, message_id, now_ms.saturating_add(self.ttl_ms))
            .del(keys::claim_key(&self.namespace, tag, message_id));
        let prune = self
            .written
            .fetch_add(1, Ordering::Relaxed)
            .is_multiple_of(PRUNE_EVERY);
        if prune {
            pipe.zrembyscore(&key, "-inf", now_ms);
        }
        pipe.pexpire(&key, self.ttl_ms);
        3 + usize::from(prune)
    }
}

/// Most marks in one pipeline: past it a batch is split, so one reply stays a few kilobytes.
const MAX_BATCH: usize = 512;

/// Batches written at once. More than one, so a mark that arrives while a batch is on the wire
/// does not wait for its reply; few, so that under load marks gather into larger batches.
const MAX_IN_FLIGHT: usize = 4;

/// One message's mark waiting to be written, and where its outcome goes.
pub(crate) struct PendingMark {
    /// The recipient's hash tag ([`crate::decide::keys::scope_tag`]).
    pub tag: String,
    pub message_id: String,
    pub now_ms: i64,
    /// `true` once the mark is written; `false` (or dropped) when the message must write it
    /// alone.
    pub done: oneshot::Sender<bool>,
}

/// The sending side of the batch writer: cheap to clone, one per `DispatchMarks` clone. The
/// writer task ends when the last one is dropped, after finishing the batches in flight.
#[derive(Clone)]
pub(crate) struct MarkBatch {
    pending: mpsc::UnboundedSender<PendingMark>,
}

impl MarkBatch {
    /// Starts the writer task, writing `commands` on `conn`, on the current runtime.
    pub fn spawn(conn: RedisConn, commands: MarkCommands) -> MarkBatch {
        let (pending, taken) = mpsc::unbounded_channel();
        tokio::spawn(write_batches(conn, commands, taken));
        MarkBatch { pending }
    }

    /// Writes one mark with the others waiting. `true` once it is written; `false` when the
    /// caller must write it alone (the server refused it, the batch failed, or the writer is
    /// gone).
    pub async fn mark(&self, tag: String, message_id: String, now_ms: i64) -> bool {
        let (done, answer) = oneshot::channel();
        let mark = PendingMark {
            tag,
            message_id,
            now_ms,
            done,
        };
        if self.pending.send(mark).is_err() {
            return false;
        }
        answer.await.unwrap_or(false)
    }
}

/// The writer: whenever there is room for another batch, takes every mark waiting (up to
/// [`MAX_BATCH`]), groups them by slot on a cluster, and writes each group as one pipeline.
async fn write_batches(
    conn: RedisConn,
    commands: MarkCommands,
    mut taken: mpsc::UnboundedReceiver<PendingMark>,
) {
    let cluster = matches!(conn, RedisConn::Cluster(_));
    let mut batch = Vec::with_capacity(MAX_BATCH);
    let mut writes = FuturesUnordered::new();
    loop {
        tokio::select! {
            Some(()) = writes.next(), if !writes.is_empty() => {}
            n = taken.recv_many(&mut batch, MAX_BATCH), if writes.len() < MAX_IN_FLIGHT => {
                if n == 0 {
                    break;
                }
                for group in by_slot(cluster, std::mem::take(&mut batch)) {
                    writes.push(write(&conn, &commands, group));
                }
                batch.reserve(MAX_BATCH);
            }
        }
    }
    while writes.next().await.is_some() {}
}

/// The batch as one group on a single server; on a cluster one group per slot of the marks'
/// hash tags.
fn by_slot(cluster: bool, mut batch: Vec<PendingMark>) -> Vec<Vec<PendingMark>> {
    if !cluster || batch.len() < 2 {
        return vec![batch];
    }
    let slot = |m: &PendingMark| slot(m.tag.as_bytes());
    batch.sort_by_key(slot);
    let mut groups: Vec<Vec<PendingMark>> = Vec::new();
    for mark in batch {
        match groups.last_mut() {
            Some(group) if group.first().map(slot) == Some(slot(&mark)) => group.push(mark),
            _ => groups.push(vec![mark]),
        }
    }
    groups
}

/// Redis Cluster's slot of `key`: CRC16 (XMODEM) of its hash tag (the part between its first
/// `{` and the next `}`, when not empty) or of the whole key, modulo 16384. redis-rs computes
/// the same but does not export it.
fn slot(key: &[u8]) -> u16 {
    let hashed = key
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            let close = rest.iter().position(|&b| b == b'}')?;
            Some(&rest[..close]).filter(|tag| !tag.is_empty())
        })
        .unwrap_or(key);
    let mut crc: u16 = 0;
    for &byte in hashed {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc % 16384
}

/// Writes `group` as one pipeline and answers each mark: written when every one of its
/// commands was answered without an error.
async fn write(conn: &RedisConn, commands: &MarkCommands, group: Vec<PendingMark>) {
    let mut pipe = redis::pipe();
    // Each mark's commands, in order, so its replies can be found in the reply.
    let counts: Vec<usize> = group
        .iter()
        .map(|m| commands.add(&mut pipe, &m.tag, &m.message_id, m.now_ms))
        .collect();
    // The replicas `redis.wait_replicas` asks for, waited for once after the whole group.
    let wait = conn.replica_wait();
    if let Some(wait) = wait {
        wait.append_to(&mut pipe);
    }
    // A server error in one command stays in its place in the reply instead of failing all.
    pipe.ignore_errors();
    let replies = pipe.query_async::<Vec<Value>>(&mut conn.clone()).await;
    let mut replies = match replies {
        Ok(replies) => {
            if let Some(wait) = wait {
                wait.check_reply(replies.last());
            }
            replies.into_iter()
        }
        Err(e) => {
            tracing::warn!(error = %e, marks = group.len(),
                "dispatch marks not written together; each is written alone");
            Vec::new().into_iter()
        }
    };
    for (mark, count) in group.into_iter().zip(counts) {
        let mut written = true;
        for _ in 0..count {
            written &= matches!(replies.next(), Some(v) if !matches!(v, Value::ServerError(_)));
        }
        let _ = mark.done.send(written);
    }
}

#[cfg(test)]
mod tests {
    use super::slot;

    #[test]
    fn slots_are_redis_clusters() {
        // Values from CLUSTER KEYSLOT on Redis 7.
        assert_eq!(slot(b"foo"), 12182);
        assert_eq!(slot(b"bar"), 5061);
        // CRC16-CCITT (XMODEM) of "123456789" is 0x31C3, below 16384.
        assert_eq!(slot(b"123456789"), 0x31C3);
        assert_eq!(slot(b"x:{foo}:y"), 12182);
        // An empty tag does not count: the whole key is hashed.
        assert_eq!(slot(b"{}foo"), 9500);
        assert_ne!(slot(b"{}foo"), slot(b"foo"));
    }
}
