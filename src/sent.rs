//! Which message ids have been dispatched, so a redelivery is not sent twice.
//!
//! The mark is written after the broker confirmed the dispatch and before the request is acked.
//! A crash between those two steps is the one window in which a message can be dispatched twice
//! (the quota is still not consumed twice: the limiter recognises the id).

use redis::AsyncCommands;

use crate::limiter::keys;
use crate::store::RedisConn;

/// Dispatch marks in Redis, one key per message id, expiring after a configured time.
#[derive(Clone)]
pub struct SentMarks {
    conn: RedisConn,
    namespace: String,
    ttl_secs: u64,
}

impl SentMarks {
    /// Marks kept under `namespace` for `ttl_secs`.
    pub fn new(conn: RedisConn, namespace: &str, ttl_secs: u64) -> SentMarks {
        SentMarks {
            conn,
            namespace: namespace.to_owned(),
            ttl_secs,
        }
    }

    /// Whether `message_id` was dispatched (within the mark's lifetime).
    pub async fn is_sent(&self, message_id: &str) -> redis::RedisResult<bool> {
        self.conn
            .clone()
            .exists(keys::sent_key(&self.namespace, message_id))
            .await
    }

    /// Records that `message_id` was dispatched.
    pub async fn mark(&self, message_id: &str) -> redis::RedisResult<()> {
        self.conn
            .clone()
            .set_ex(
                keys::sent_key(&self.namespace, message_id),
                1u8,
                self.ttl_secs,
            )
            .await
    }
}
