//! The duplicate check: which message ids have been dispatched, so a redelivery is not sent
//! twice. This module owns the marks: their key, reading one, writing one and retrying a
//! failed write. The decision script reads them too, in the same call as the quota (the
//! limiter passes it [`keys::sent_key`]).
//!
//! The mark is written after the broker confirmed the dispatch and before the request is acked.
//! A crash between those two steps is the one window in which a message can be dispatched twice
//! (the quota is still not consumed twice: the limiter recognises the id).
//!
//! Marks live in one sorted set per recipient ([`keys::sent_key`]): member = message id,
//! score = when the mark expires. Sharing the recipient's hash tag lets the decision script of
//! the recipient scope read the mark in the same call that checks the quota, so a decision is
//! one round trip; and the deny cache can read every mark of a recipient at once, which keeps
//! its answers exact for redeliveries of dispatched messages.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::base::store::RedisConn;
use crate::decide::keys::{self, recipient_sent_key};
use crate::decide::mark_batch::{MarkBatch, MarkCommands};
use crate::request::message::SendRequest;
use crate::rules::policy::ScopeValue;

/// Attempts at a dispatch mark, and the waits between them (doubling from the first to the
/// largest): about 13 s in all, longer than a Redis restart or failover takes.
const MARK_ATTEMPTS: u32 = 12;
const MARK_RETRY_FIRST: Duration = Duration::from_millis(50);
const MARK_RETRY_MAX: Duration = Duration::from_secs(2);

pub use crate::decide::mark_batch::PRUNE_EVERY;

/// Writes dispatch marks, each kept for a configured time.
#[derive(Clone)]
pub struct DispatchMarks {
    conn: RedisConn,
    commands: MarkCommands,
    /// Set by [`DispatchMarks::batched`]: confirmed messages' marks go through it together.
    batch: Option<MarkBatch>,
}

impl DispatchMarks {
    /// Marks kept under `namespace` for `ttl_secs`.
    pub fn new(conn: RedisConn, namespace: &str, ttl_secs: u64) -> DispatchMarks {
        DispatchMarks {
            conn,
            commands: MarkCommands {
                namespace: namespace.to_owned(),
                ttl_ms: i64::try_from(ttl_secs.saturating_mul(1000)).unwrap_or(i64::MAX),
                written: Arc::new(AtomicU64::new(0)),
            },
            batch: None,
        }
    }

    /// These marks, with [`DispatchMarks::mark_dispatched`] writing the marks of messages
    /// confirmed close together as one pipeline (per slot on a cluster) rather than one
    /// request each ([`crate::decide::mark_batch`]). Starts the batch writer on the current
    /// runtime; it ends when the last clone is dropped.
    pub fn batched(self) -> DispatchMarks {
        let batch = MarkBatch::spawn(self.conn.clone(), self.commands.clone());
        DispatchMarks {
            batch: Some(batch),
            ..self
        }
    }

    /// Whether `message` holds an unexpired dispatch mark at `now` ([`is_marked`]): for a
    /// message decided without a script call (past its deadline), whose copy may have been
    /// sent before.
    pub async fn is_marked(
        &self,
        message: &SendRequest,
        now: DateTime<Utc>,
    ) -> redis::RedisResult<bool> {
        is_marked(&self.conn, &self.commands.namespace, message, now).await
    }

    /// Records that `message_id`, for `recipient`, was dispatched at `now`, and drops its
    /// in-flight claim ([`crate::decide::claim`]); the set lives as long as its newest mark. Every
    /// [`PRUNE_EVERY`]th mark also drops expired marks.
    pub async fn mark(
        &self,
        recipient: &str,
        message_id: &str,
        now: DateTime<Utc>,
    ) -> redis::RedisResult<()> {
        // One round trip; not atomic, and need not be: each command is right on its own. The
        // replies are read into `()`, which takes them all, rather than marked `ignore()`: a
        // pipeline keeps its ignored commands in a hash set, a hashed insert per command.
        let mut pipe = redis::pipe();
        self.add_mark(&mut pipe, recipient, message_id, now);
        let Some(wait) = self.conn.replica_wait() else {
            return pipe.exec_async(&mut self.conn.clone()).await;
        };
        wait.append_to(&mut pipe);
        let replies: Vec<redis::Value> = pipe.query_async(&mut self.conn.clone()).await?;
        wait.check_reply(replies.last());
        Ok(())
    }

    /// Adds to `pipe` the commands of the mark of `message_id` for `recipient` at `now`, as
    /// [`DispatchMarks::mark`] and the batch send them; how many (their replies follow in that
    /// order). For the benches' floors, which pipeline the worker's own marks.
    pub fn add_mark(
        &self,
        pipe: &mut redis::Pipeline,
        recipient: &str,
        message_id: &str,
        now: DateTime<Utc>,
    ) -> usize {
        let tag = keys::scope_tag(&ScopeValue::Recipient(recipient));
        self.commands
            .add(pipe, &tag, message_id, now.timestamp_millis())
    }

    /// Writes the dispatch mark of a message the broker has confirmed. A failed write (Redis
    /// restarting, say) is retried here rather than by handling the message again: the quota
    /// already holds the id, so handling it again would dispatch it a second time. Gives up
    /// after about 13 s; the message then goes back to the queue and may be dispatched again,
    /// as after a crash in the same window. When batched, the mark first goes with the others
    /// confirmed meanwhile; only a mark that batch did not write takes the retries here.
    pub async fn mark_dispatched(
        &self,
        message: &SendRequest,
        now: DateTime<Utc>,
    ) -> redis::RedisResult<()> {
        if let Some(batch) = &self.batch {
            let tag = keys::scope_tag(&ScopeValue::Recipient(&message.recipient));
            if batch
                .mark(tag, message.id.clone(), now.timestamp_millis())
                .await
            {
                return Ok(());
            }
        }
        let mut wait = MARK_RETRY_FIRST;
        for _ in 1..MARK_ATTEMPTS {
            match self.mark(&message.recipient, &message.id, now).await {
                Ok(()) => return Ok(()),
                Err(e) => {
                    tracing::warn!(message_id = %message.id, error = %e,
                        retry_in_ms = wait.as_millis() as u64, "dispatch mark not written");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(MARK_RETRY_MAX);
                }
            }
        }
        self.mark(&message.recipient, &message.id, now).await
    }
}

/// Whether `message` holds an unexpired dispatch mark at `now`, read on its own: for
/// committing decisions without a recipient-scope rule, whose script calls cannot reach the
/// marks.
pub async fn is_marked(
    conn: &RedisConn,
    namespace: &str,
    message: &SendRequest,
    now: DateTime<Utc>,
) -> redis::RedisResult<bool> {
    let expires: Option<i64> = redis::cmd("ZSCORE")
        .arg(recipient_sent_key(namespace, &message.recipient))
        .arg(&message.id)
        .query_async(&mut conn.clone())
        .await?;
    Ok(expires.is_some_and(|ms| ms > now.timestamp_millis()))
}
