//! The messages `digest` rules hold, in the Postgres table `digest_items`: holding one (an
//! act step's effect) and listing them for operators. The flusher that sends them as digests
//! is [`super::digest`].

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;

use crate::request::message::SendRequest;

/// The held messages in Postgres.
#[derive(Debug, Clone)]
pub struct Held {
    pool: PgPool,
    /// The last [`Held::order`] given out.
    orders: Arc<AtomicI64>,
}

/// One group of held messages as `sendquota digests` lists it.
#[derive(Debug, Serialize, sqlx::FromRow)]
pub struct HeldGroup {
    /// The recipient.
    pub recipient: String,
    /// The digest rule holding them.
    pub rule: String,
    /// The `digest_by` value; `null` without one.
    pub group: Option<String>,
    /// How many messages are held.
    pub held: i64,
    /// When the oldest was held.
    pub oldest: DateTime<Utc>,
    /// The digest admitted for them and not yet sent (a worker stopped mid-way), if any.
    pub digest_id: Option<String>,
    /// Not looked at before this instant (the rules had no room for its digest).
    pub flush_after: Option<DateTime<Utc>>,
}

/// The groups of held messages, to `recipient` only when given, oldest first: what an
/// operator asks when a digest is awaited.
pub async fn held_groups(
    pool: &PgPool,
    recipient: Option<&str>,
) -> Result<Vec<HeldGroup>, sqlx::Error> {
    sqlx::query_as(
        "SELECT recipient, rule, NULLIF(group_key, '') AS \"group\", count(*) AS held, \
         min(held_at) AS oldest, max(digest_id) AS digest_id, max(flush_after) AS flush_after \
         FROM digest_items WHERE $1::TEXT IS NULL OR recipient = $1 \
         GROUP BY recipient, rule, group_key ORDER BY min(id)",
    )
    .bind(recipient)
    .fetch_all(pool)
    .await
}

impl Held {
    /// Held messages in `pool`'s `digest_items`.
    pub fn new(pool: PgPool) -> Held {
        Held {
            pool,
            orders: Arc::new(AtomicI64::new(0)),
        }
    }

    /// A number above every one this worker gave out before, taken by a message while it holds
    /// its recipient's turn: a hold keeps it, so a digest lists a recipient's messages in the
    /// order they were decided. Neither the decision instant (equal within a clock tick) nor
    /// the row id (taken as each hold commits, after the turn is left) keeps that order.
    pub fn order(&self) -> i64 {
        self.orders.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// The pool the table lives in, for the flusher's transactions.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Holds `message`, refused by the digest rule `rule` at `now`, for the rule's next digest
    /// to its recipient in `group` (see [`super::digest::group_of`]); `deadline` is the instant
    /// past which it is dropped from it; `order` is its [`Held::order`], taken in its turn
    /// at `now`. A copy of a message held already is held once.
    /// Durable when this returns: the delivery may be acked.
    pub async fn hold(
        &self,
        message: &SendRequest,
        rule: &str,
        group: &str,
        deadline: Option<DateTime<Utc>>,
        now: DateTime<Utc>,
        order: i64,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(
            "INSERT INTO digest_items (recipient, rule, group_key, channel, message_id, \
             message_text, expires_at, held_at, held_order) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) ON CONFLICT DO NOTHING",
        )
        .bind(&message.recipient)
        .bind(rule)
        .bind(group)
        .bind(&message.channel)
        .bind(&message.id)
        .bind(message.to_json_text())
        .bind(deadline)
        .bind(now)
        .bind(order)
        .execute(&self.pool)
        .await?;
        Ok(())
    }
}
