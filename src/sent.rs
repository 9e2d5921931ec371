//! Which message ids have been dispatched, so a redelivery is not sent twice. This module
//! writes the marks; the limiter reads them as part of a committing decision.
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

use chrono::{DateTime, Utc};

use crate::limiter::keys;
use crate::store::RedisConn;

/// One mark in this many also drops the expired marks of its recipient's set. Expired marks
/// are harmless where they stay (readers compare a mark's expiry with their now, and the set
/// expires whole after its newest mark), so they are only removed to bound the set of a
/// recipient who keeps receiving messages: dropping them on every mark cost Redis a third
/// command per dispatch.
pub const PRUNE_EVERY: u64 = 8;

/// Writes dispatch marks, each kept for a configured time.
#[derive(Clone)]
pub struct SentMarks {
    conn: RedisConn,
    namespace: String,
    ttl_ms: i64,
    written: Arc<AtomicU64>,
}

impl SentMarks {
    /// Marks kept under `namespace` for `ttl_secs`.
    pub fn new(conn: RedisConn, namespace: &str, ttl_secs: u64) -> SentMarks {
        SentMarks {
            conn,
            namespace: namespace.to_owned(),
            ttl_ms: i64::try_from(ttl_secs.saturating_mul(1000)).unwrap_or(i64::MAX),
            written: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Records that `message_id`, for `recipient`, was dispatched at `now`, and drops its
    /// in-flight claim ([`crate::claim`]); the set lives as long as its newest mark. Every
    /// [`PRUNE_EVERY`]th mark also drops expired marks.
    pub async fn mark(
        &self,
        recipient: &str,
        message_id: &str,
        now: DateTime<Utc>,
    ) -> redis::RedisResult<()> {
        let tag = keys::scope_tag(&crate::policy::ScopeValue::Recipient(recipient));
        let key = keys::sent_key(&self.namespace, &tag);
        let now_ms = now.timestamp_millis();
        // One round trip; not atomic, and need not be: each command is right on its own. The
        // mark supersedes the delivery's in-flight claim (any copy is a duplicate now).
        let mut pipe = redis::pipe();
        pipe.zadd(&key, message_id, now_ms.saturating_add(self.ttl_ms))
            .ignore()
            .hdel(keys::claims_key(&self.namespace, &tag), message_id)
            .ignore();
        if self
            .written
            .fetch_add(1, Ordering::Relaxed)
            .is_multiple_of(PRUNE_EVERY)
        {
            pipe.zrembyscore(&key, "-inf", now_ms).ignore();
        }
        pipe.pexpire(&key, self.ttl_ms)
            .ignore()
            .exec_async(&mut self.conn.clone())
            .await
    }
}
