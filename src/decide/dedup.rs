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

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::base::store::RedisConn;
use crate::decide::keys::{self, recipient_sent_key, sent_key};
use crate::request::message::SendRequest;
use crate::rules::policy::ScopeValue;

/// Attempts at a dispatch mark, and the waits between them (doubling from the first to the
/// largest): about 13 s in all, longer than a Redis restart or failover takes.
const MARK_ATTEMPTS: u32 = 12;
const MARK_RETRY_FIRST: Duration = Duration::from_millis(50);
const MARK_RETRY_MAX: Duration = Duration::from_secs(2);

/// One mark in this many also drops the expired marks of its recipient's set. Expired marks
/// are harmless where they stay (readers compare a mark's expiry with their now, and the set
/// expires whole after its newest mark), so they are only removed to bound the set of a
/// recipient who keeps receiving messages: dropping them on every mark cost Redis a third
/// command per dispatch.
pub const PRUNE_EVERY: u64 = 8;

/// Writes dispatch marks, each kept for a configured time.
#[derive(Clone)]
pub struct DispatchMarks {
    conn: RedisConn,
    namespace: String,
    ttl_ms: i64,
    written: Arc<AtomicU64>,
}

impl DispatchMarks {
    /// Marks kept under `namespace` for `ttl_secs`.
    pub fn new(conn: RedisConn, namespace: &str, ttl_secs: u64) -> DispatchMarks {
        DispatchMarks {
            conn,
            namespace: namespace.to_owned(),
            ttl_ms: i64::try_from(ttl_secs.saturating_mul(1000)).unwrap_or(i64::MAX),
            written: Arc::new(AtomicU64::new(0)),
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
        is_marked(&self.conn, &self.namespace, message, now).await
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
        let tag = keys::scope_tag(&ScopeValue::Recipient(recipient));
        let key = sent_key(&self.namespace, &tag);
        let now_ms = now.timestamp_millis();
        // One round trip; not atomic, and need not be: each command is right on its own. The
        // mark supersedes the delivery's in-flight claim (any copy is a duplicate now). The
        // replies are read into `()`, which takes them all, rather than marked `ignore()`: a
        // pipeline keeps its ignored commands in a hash set, a hashed insert per command.
        let mut pipe = redis::pipe();
        pipe.zadd(&key, message_id, now_ms.saturating_add(self.ttl_ms))
            .hdel(keys::claims_key(&self.namespace, &tag), message_id);
        if self
            .written
            .fetch_add(1, Ordering::Relaxed)
            .is_multiple_of(PRUNE_EVERY)
        {
            pipe.zrembyscore(&key, "-inf", now_ms);
        }
        pipe.pexpire(&key, self.ttl_ms);
        let Some(wait) = self.conn.replica_wait() else {
            return pipe.exec_async(&mut self.conn.clone()).await;
        };
        wait.append_to(&mut pipe);
        let replies: Vec<redis::Value> = pipe.query_async(&mut self.conn.clone()).await?;
        let acknowledged = replies.last().and_then(|v| match v {
            redis::Value::Int(n) => Some(*n),
            _ => None,
        });
        wait.check(acknowledged.unwrap_or(0));
        Ok(())
    }
    /// Writes the dispatch mark of a message the broker has confirmed. A failed write (Redis
    /// restarting, say) is retried here rather than by handling the message again: the quota
    /// already holds the id, so handling it again would dispatch it a second time. Gives up
    /// after about 13 s; the message then goes back to the queue and may be dispatched again,
    /// as after a crash in the same window.
    pub async fn mark_dispatched(
        &self,
        message: &SendRequest,
        now: DateTime<Utc>,
    ) -> redis::RedisResult<()> {
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
