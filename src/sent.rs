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

use chrono::{DateTime, Utc};

use crate::limiter::keys;
use crate::store::RedisConn;

/// Writes dispatch marks, each kept for a configured time.
#[derive(Clone)]
pub struct SentMarks {
    conn: RedisConn,
    namespace: String,
    ttl_ms: i64,
}

impl SentMarks {
    /// Marks kept under `namespace` for `ttl_secs`.
    pub fn new(conn: RedisConn, namespace: &str, ttl_secs: u64) -> SentMarks {
        SentMarks {
            conn,
            namespace: namespace.to_owned(),
            ttl_ms: i64::try_from(ttl_secs.saturating_mul(1000)).unwrap_or(i64::MAX),
        }
    }

    /// Records that `message_id`, for `recipient`, was dispatched at `now`. Expired marks of
    /// the recipient are dropped on the way, and the set lives as long as its newest mark.
    pub async fn mark(
        &self,
        recipient: &str,
        message_id: &str,
        now: DateTime<Utc>,
    ) -> redis::RedisResult<()> {
        let key = keys::recipient_sent_key(&self.namespace, recipient);
        let now_ms = now.timestamp_millis();
        // One round trip; not atomic, and need not be: each command is right on its own.
        redis::pipe()
            .zadd(&key, message_id, now_ms.saturating_add(self.ttl_ms))
            .ignore()
            .zrembyscore(&key, "-inf", now_ms)
            .ignore()
            .pexpire(&key, self.ttl_ms)
            .ignore()
            .exec_async(&mut self.conn.clone())
            .await
    }
}
