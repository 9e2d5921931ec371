//! Digest instead of deny: a message refused by an `on_deny = "digest"` rule is held, grouped
//! per recipient, rule and (with `digest_by`) attribute value, in the Postgres table
//! `digest_items`; once the recipient has room again one digest carrying every held request
//! goes out on the channel, consuming one send.
//!
//! The flusher ([`flush_until_stopped`], one per worker session) takes each group under a
//! Postgres advisory lock, so two workers never take the same one, and asks the limiter about
//! one synthetic request whose id ([`digest_id`]) is made of the group and its oldest item, so
//! asking again after a crash is the same request (the limiter admits an id once). Once the
//! limiter admits it, the items are marked with that id in the same transaction: from then on
//! they are that digest's. Sending it leases it to one worker ([`SEND_LEASE`], committed before
//! the publish, so a lost Postgres session does not free it), publishes with a publisher
//! confirm, writes the dispatch mark, then deletes the items. A crash between the publish and
//! the delete leaves marked items whose dispatch mark says the digest went: they are only
//! deleted. Exactly once, across crashes and workers, as far as a dispatch mark reaches; a
//! digest is sent twice only when both its dispatch mark and its delete fail after the publish.
//!
//! A group the limiter refuses is left until the instant it names (`flush_after`), so groups
//! without room cannot crowd the others out of a flush; one digest or group that fails is
//! logged and left for the next flush, never stopping the others.
//!
//! Items past their deadline ([`crate::decide::deadline::passed`] at flush time) are dropped from the
//! digest and recorded as denials with reason `expired` under the digest rule.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::value::RawValue;
use sha2::{Digest, Sha256};
use sqlx::{Postgres, Transaction};
use tokio::sync::watch;

use super::steps::{ActError, Steps};
use crate::base::clock::Clock;
use crate::base::failpoint::{self, Failpoint};
use crate::decide::deadline::{self, Receipt};
use crate::decide::decision;
use crate::decide::limiter::Limiter;
use crate::intake::broker;
use crate::intake::publisher::Publisher;
use crate::record::denials::DenialRow;
use crate::request::message::{SendRequest, MAX_AMQP_SHORT_BYTES};
use crate::rules::policy::Rule;
use crate::rules::reload::LiveRules;

/// The header carrying how many requests a digest holds, so a sender can tell a digest from a
/// single message without reading the body.
pub const COUNT_HEADER: &str = "x-sendquota-digest-count";

/// Most requests in one digest: a bigger group goes out over several digests (each one send),
/// so a digest body stays far below what a broker and a sender take.
pub const MAX_ITEMS: i64 = 500;

/// Most groups and pending digests one flush takes up: the rest wait for the next one.
const GROUPS_PER_FLUSH: i64 = 200;

/// How long a worker sending a digest keeps the others off it: far longer than a publish takes
/// (it is given up after half of it), so a digest is published by one worker at a time even
/// when that worker's Postgres session is lost meanwhile; a digest whose worker crashed is
/// sent by another once it runs out.
pub const SEND_LEASE: Duration = Duration::from_secs(60);

/// One held request as the flusher reads it.
#[derive(Debug, sqlx::FromRow)]
struct Item {
    id: i64,
    recipient: String,
    rule: String,
    group_key: String,
    channel: String,
    message_id: String,
    message_text: String,
    expires_at: Option<DateTime<Utc>>,
    held_at: DateTime<Utc>,
    held_order: i64,
}

impl Item {
    /// Where the item stands among its group's: the order they were held in (decided in,
    /// per recipient), which the row id, taken when the hold commits, is not.
    fn held_rank(&self) -> (DateTime<Utc>, i64, i64) {
        (self.held_at, self.held_order, self.id)
    }
}

/// The digest as published: `{"digest": {...}}`, documented in the README.
#[derive(Serialize)]
struct Body<'a> {
    digest: BodyFields<'a>,
}

#[derive(Serialize)]
struct BodyFields<'a> {
    id: &'a str,
    rule: &'a str,
    recipient: &'a str,
    channel: &'a str,
    /// The `digest_by` value the group is of; `null` without one.
    group: Option<&'a str>,
    count: usize,
    messages: Vec<&'a RawValue>,
}

/// What one flush did, for tests and logs.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Flushed {
    /// Digests published.
    pub sent: usize,
    /// Items dropped past their deadline.
    pub expired: usize,
    /// Digests and groups that failed, left for the next flush.
    pub failed: usize,
}

impl Flushed {
    /// Counts and logs the failure `error` of the digest or group named by `what` and `name`.
    fn failed(&mut self, error: &ActError, what: &str, name: &str) {
        self.failed += 1;
        tracing::warn!(%error, name, "{what}; tried again at the next flush");
    }
}

/// The group `message` is held in under `rule`: its value of the rule's `digest_by`, or ''
/// (the recipient and rule alone) when the rule has none or the message lacks it.
pub fn group_of<'m>(rule: &Rule, message: &'m SendRequest) -> &'m str {
    rule.digest_by
        .as_deref()
        .and_then(|key| message.attributes.get(key))
        .unwrap_or("")
}

/// The id of the digest of `rule`'s group `group` to `recipient` whose oldest held item is
/// `first_item`: the same on every attempt at that digest, so the limiter admits it once and
/// its dispatch mark tells a retry it went. It is also the digest's AMQP `message_id`, an
/// AMQP short string (at most 255 bytes, or the broker client leaves it off and a consumer
/// cannot drop a copy): readable (`digest:<rule>:<recipient>:<group>:<n>`) when that fits,
/// else `digest:<SHA-256 of rule, recipient and group in lowercase hex>:<n>` (92 bytes at
/// most), which is as fixed per group as the readable form.
pub fn digest_id(rule: &str, recipient: &str, group: &str, first_item: i64) -> String {
    let plain = format!("digest:{rule}:{recipient}:{group}:{first_item}");
    if plain.len() <= MAX_AMQP_SHORT_BYTES {
        return plain;
    }
    let hash: String = Sha256::digest([rule, recipient, group].join("\u{1f}").as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("digest:{hash}:{first_item}")
}

/// Flushes every `flusher.interval` until `stop`, publishing through `publisher`. A failed
/// flush is logged and tried again at the next interval: the items stay held.
pub async fn flush_until_stopped(
    flusher: Arc<Flusher>,
    publisher: Publisher,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(flusher.interval) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        match flusher.flush(&publisher).await {
            Ok(flushed) if flushed != Flushed::default() => {
                tracing::info!(
                    sent = flushed.sent,
                    expired = flushed.expired,
                    failed = flushed.failed,
                    "digests flushed"
                )
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "digest flush failed; retried next interval"),
        }
    }
}

/// What a flush needs: the rules and the limiter to decide a digest as one message, the act
/// steps that make its outcome durable (the same as a delivery's), the clock, and how often
/// it runs.
pub struct Flusher {
    /// The act steps: dispatch marks, denial rows, the held items, the dispatch exchange.
    pub steps: Arc<Steps>,
    /// Quota state in Redis.
    pub limiter: Limiter,
    /// The running rules: each group is decided under one snapshot.
    pub rules: LiveRules,
    /// The worker's clock.
    pub clock: Arc<dyn Clock>,
    /// Largest accepted body, to read held requests back.
    pub max_body_bytes: usize,
    /// Largest digest body, in bytes (`worker.max_digest_bytes`): below what the broker
    /// accepts, which refuses a larger one and closes the channel every dispatch shares.
    pub max_digest_bytes: usize,
    /// How often a flush runs.
    pub interval: Duration,
}

impl Flusher {
    /// Sends the digests admitted before and not yet sent (a crash, or another worker
    /// stopping mid-way), then takes up every group with held items: drops and records the
    /// expired ones, and sends a digest of the rest when the limiter admits it.
    pub async fn flush(&self, publisher: &Publisher) -> Result<Flushed, ActError> {
        let pool = self.steps.held.pool();
        let mut flushed = Flushed::default();
        let pending: Vec<String> = sqlx::query_scalar(
            "SELECT digest_id FROM digest_items WHERE digest_id IS NOT NULL \
             GROUP BY digest_id ORDER BY min(id) LIMIT $1",
        )
        .bind(GROUPS_PER_FLUSH)
        .fetch_all(pool)
        .await?;
        // One digest or group that fails (a channel no queue is bound to, a rule's Redis
        // call) is logged and left for the next flush: the others go out meanwhile.
        for id in pending {
            match self.send(publisher, &id).await {
                Ok(sent) => flushed.sent += usize::from(sent),
                Err(e) => flushed.failed(&e, "digest not sent", &id),
            }
        }
        // A group is looked at once each of its items may be: an item held since the rules
        // last refused its group's digest does not bring the group back before then.
        let groups: Vec<(String, String, String)> = sqlx::query_as(
            "SELECT recipient, rule, group_key FROM digest_items WHERE digest_id IS NULL \
             GROUP BY 1, 2, 3 HAVING bool_and(flush_after IS NULL OR flush_after <= $2) \
             ORDER BY min(id) LIMIT $1",
        )
        .bind(GROUPS_PER_FLUSH)
        .bind(self.clock.now())
        .fetch_all(pool)
        .await?;
        for (recipient, rule, group) in groups {
            let took = match self.take_group(&recipient, &rule, &group).await {
                Ok(took) => took,
                Err(e) => {
                    flushed.failed(&e, "digest group not taken up", &recipient);
                    continue;
                }
            };
            flushed.expired += took.expired;
            if let Some(id) = took.admitted {
                match self.send(publisher, &id).await {
                    Ok(sent) => flushed.sent += usize::from(sent),
                    Err(e) => flushed.failed(&e, "digest not sent", &id),
                }
            }
        }
        Ok(flushed)
    }

    /// Under the group's lock (skipped when another worker holds it): records and drops its
    /// expired items, and asks the limiter for one send of a digest of the others; admitted,
    /// the items are that digest's, whose id is returned.
    async fn take_group(
        &self,
        recipient: &str,
        rule_name: &str,
        group: &str,
    ) -> Result<Took, ActError> {
        let pool = self.steps.held.pool();
        let mut tx = pool.begin().await?;
        if !try_lock(&mut tx, &["group", recipient, rule_name, group]).await? {
            return Ok(Took::default());
        }
        let items = held_items(&mut tx, recipient, rule_name, group).await?;
        // Named by the oldest item read, expired or not: a digest the limiter admitted whose
        // items were not bound to it (Postgres failed in between) keeps its name when that
        // item expires meanwhile, so asking again is the same request, not a second send.
        let Some(oldest) = items.first().map(|i| i.id) else {
            return Ok(Took::default());
        };
        let id = digest_id(rule_name, recipient, group, oldest);
        let now = self.clock.now();
        let rules = self.rules.current();
        let (expired, live): (Vec<Item>, Vec<Item>) = items
            .into_iter()
            .partition(|i| deadline::passed(i.expires_at, now));
        let rule = rules.policy.rule(rule_name);
        self.drop_expired(&mut tx, &expired, rule, now).await?;
        let mut took = Took {
            expired: expired.len(),
            admitted: None,
        };
        let Some(request) = self.request(&live, &id) else {
            tx.commit().await?;
            return Ok(took);
        };
        let evaluation = self
            .limiter
            .evaluate(&rules.policy, &request, now, true)
            .await?;
        let ids: Vec<i64> = live.iter().map(|i| i.id).collect();
        // The oldest items whose digest stays within the byte bound; the others wait for the
        // group's next digest (another send).
        let fit = fitting(&id, &live, self.max_digest_bytes);
        // Dispatched: it went out before and its items were held again since (a copy); they
        // are sent with it, which the dispatch mark stops from going twice.
        if evaluation.committed() || evaluation.dispatched() {
            if failpoint::fails_after_decision(self.steps.failpoint, recipient) {
                let gone = failpoint::gone("fail-after-decision");
                return Err(ActError::Held(sqlx::Error::Io(gone)));
            }
            bind_to_digest(&mut tx, &id, &ids[..fit]).await?;
            took.admitted = Some(id);
        } else {
            let receipt = Receipt::new(now);
            let room = decision::decide(&rules.policy, &request, &receipt, evaluation.verdicts())
                .outcome
                .retry_after()
                .filter(|at| *at > now);
            flush_after(&mut tx, room, &ids).await?;
        }
        tx.commit().await?;
        Ok(took)
    }

    /// Records each of the `expired` items as a denial with reason `expired`, then deletes
    /// them in `tx`.
    async fn drop_expired(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        expired: &[Item],
        rule: Option<&Rule>,
        now: DateTime<Utc>,
    ) -> Result<(), ActError> {
        for item in expired {
            self.record_expired(item, rule, now).await?;
        }
        let expired_ids: Vec<i64> = expired.iter().map(|i| i.id).collect();
        sqlx::query("DELETE FROM digest_items WHERE id = ANY($1)")
            .bind(&expired_ids)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }

    /// Sends the admitted digest `id` unless its dispatch mark says it went, marks it and each
    /// of its messages dispatched (a copy of one delivered later is a duplicate), and deletes
    /// its items; false when another worker is sending it or has sent it.
    ///
    /// The digest is first leased ([`SEND_LEASE`], committed, on Postgres's clock): a lock
    /// held across the publish would be released by a lost Postgres session while the publish
    /// goes on, and another worker would send the digest too. Once the broker has it, the
    /// marks and the delete are each tried on their own: either tells a later attempt it went.
    async fn send(&self, publisher: &Publisher, id: &str) -> Result<bool, ActError> {
        let Some(mut items) = self.lease(id).await? else {
            return Ok(false);
        };
        // Left held (and logged) should none read back: deleting them would lose them.
        let Some(request) = self.request(&items, id) else {
            return Ok(false);
        };
        let now = self.clock.now();
        let marks = &self.steps.marks;
        let published = match marks.is_marked(&request, now).await {
            Ok(marked) => !marked,
            Err(e) => {
                self.release(id).await;
                return Err(e.into());
            }
        };
        if published {
            // Bound before the byte bound was (or while it was larger, or before the broker
            // refused a body below it): the items past it go back to their group for its next
            // digest, so the broker never refuses this one.
            let bound = publisher.max_body().map_or(self.max_digest_bytes, |limit| {
                limit.min(self.max_digest_bytes)
            });
            let fit = fitting(id, &items, bound);
            if fit < items.len() {
                if let Err(e) = self.unbind(&items[fit..]).await {
                    self.release(id).await;
                    return Err(e.into());
                }
                items.truncate(fit);
            }
            if failpoint::armed(self.steps.failpoint, Failpoint::SlowIds)
                && request.recipient.starts_with("slow-")
            {
                tokio::time::sleep(failpoint::SLOW_IDS_HOLD).await;
            }
            match tokio::time::timeout(SEND_LEASE / 2, self.publish(publisher, id, &items)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    // Not taken by the broker: the next flush may try at once.
                    self.release(id).await;
                    return Err(e);
                }
                // The broker may still take it: the lease keeps the others off meanwhile.
                Err(_) => return Err(ActError::PublishTimeout(SEND_LEASE / 2)),
            }
            if let Err(e) = self.mark_sent(&request, now).await {
                tracing::warn!(digest = id, error = %e,
                    "digest sent, its dispatch mark not written; its items are deleted");
            }
        }
        for item in &items {
            if let Err(e) = marks.mark(&item.recipient, &item.message_id, now).await {
                tracing::warn!(digest = id, message_id = %item.message_id, error = %e,
                    "dispatch mark of a message sent in a digest not written");
            }
        }
        sqlx::query("DELETE FROM digest_items WHERE digest_id = $1")
            .bind(id)
            .execute(self.steps.held.pool())
            .await?;
        Ok(published)
    }

    /// The items of digest `id`, leased to this worker for [`SEND_LEASE`]; `None` when
    /// another worker holds the digest or its lease, or it has no items left.
    async fn lease(&self, id: &str) -> Result<Option<Vec<Item>>, ActError> {
        let mut tx = self.steps.held.pool().begin().await?;
        if !try_lock(&mut tx, &["digest", id]).await? {
            return Ok(None);
        }
        let mut items: Vec<Item> = sqlx::query_as(
            "UPDATE digest_items SET sending_until = clock_timestamp() + make_interval(secs => $2) \
             WHERE digest_id = $1 AND NOT EXISTS (SELECT 1 FROM digest_items \
             WHERE digest_id = $1 AND sending_until > clock_timestamp()) \
             RETURNING id, recipient, rule, group_key, channel, message_id, message_text, \
             expires_at, held_at, held_order",
        )
        .bind(id)
        .bind(SEND_LEASE.as_secs_f64())
        .fetch_all(&mut *tx)
        .await?;
        tx.commit().await?;
        items.sort_unstable_by_key(Item::held_rank);
        Ok(Some(items).filter(|items| !items.is_empty()))
    }

    /// Returns `items` of a digest not yet published to their group, held as before.
    async fn unbind(&self, items: &[Item]) -> Result<(), sqlx::Error> {
        let ids: Vec<i64> = items.iter().map(|i| i.id).collect();
        sqlx::query(
            "UPDATE digest_items SET digest_id = NULL, sending_until = NULL WHERE id = ANY($1)",
        )
        .bind(&ids)
        .execute(self.steps.held.pool())
        .await?;
        Ok(())
    }

    /// Ends this worker's lease of digest `id` early, its publish having failed; a failure
    /// is logged (the lease then runs out).
    async fn release(&self, id: &str) {
        let released =
            sqlx::query("UPDATE digest_items SET sending_until = NULL WHERE digest_id = $1")
                .bind(id)
                .execute(self.steps.held.pool())
                .await;
        if let Err(e) = released {
            tracing::warn!(digest = id, error = %e, "digest lease not released; it runs out");
        }
    }

    /// Writes the dispatch mark of the digest `request` sent at `now`.
    async fn mark_sent(
        &self,
        request: &SendRequest,
        now: DateTime<Utc>,
    ) -> Result<(), redis::RedisError> {
        if failpoint::fails_after_decision(self.steps.failpoint, &request.recipient) {
            return Err(failpoint::gone("fail-after-decision").into());
        }
        self.steps.marks.mark_dispatched(request, now).await
    }

    /// Publishes the digest `id` of `items` (one group's, at least one) on their channel.
    async fn publish(
        &self,
        publisher: &Publisher,
        id: &str,
        items: &[Item],
    ) -> Result<(), ActError> {
        let first = &items[0];
        let messages = items
            .iter()
            .filter_map(|i| serde_json::from_str::<&RawValue>(&i.message_text).ok())
            .collect::<Vec<_>>();
        let body = Body::new(id, first, messages.len(), messages);
        let count = body.digest.count.to_string();
        let body = serde_json::to_vec(&body)?;
        let props = broker::json_properties(Some(id), &[(COUNT_HEADER, count)]);
        self.steps
            .publish_dispatch(publisher, &first.channel, &body, props)
            .await?;
        Ok(())
    }

    /// The request a digest of `items` (one group's) is decided as: the first of them that
    /// reads back as a request (its channel, category, zone, attributes and priority meet the
    /// same rules), under the digest's id, costing one send, without a payload or deadline.
    /// One that does not read back (logged; a held item written by the worker always does)
    /// goes out in the digest as it is, and holds no group back. `None` when none reads back.
    fn request(&self, items: &[Item], id: &str) -> Option<SendRequest> {
        items.iter().find_map(|item| {
            let max = self.max_body_bytes.max(item.message_text.len());
            match SendRequest::decode(item.message_text.as_bytes(), max) {
                Ok(held) => Some(SendRequest {
                    id: id.to_owned(),
                    cost: 1,
                    payload: None,
                    expires_at: None,
                    ..held
                }),
                Err(e) => {
                    tracing::error!(item = item.id, error = %e, "held digest item is not a request");
                    None
                }
            }
        })
    }

    /// Records `item`, past its deadline at `now`, as a denial with reason `expired` under
    /// its digest rule (`rule`, when the running rules still have it).
    async fn record_expired(
        &self,
        item: &Item,
        rule: Option<&Rule>,
        now: DateTime<Utc>,
    ) -> Result<(), ActError> {
        let max = self.max_body_bytes.max(item.message_text.len());
        let message = match SendRequest::decode(item.message_text.as_bytes(), max) {
            Ok(message) => message,
            Err(e) => {
                tracing::error!(item = item.id, error = %e, "held digest item is not a request");
                return Ok(());
            }
        };
        let kind = rule.map_or(deadline::DEADLINE_RULE, |r| r.kind.name());
        let row = DenialRow::for_message(&message, now);
        self.steps
            .expire(row, &item.rule, kind, item.expires_at, None)
            .await?;
        Ok(())
    }
}

impl<'a> Body<'a> {
    /// The digest `id` of `first`'s group, saying it holds `count` requests, `messages`.
    fn new(id: &'a str, first: &'a Item, count: usize, messages: Vec<&'a RawValue>) -> Body<'a> {
        Body {
            digest: BodyFields {
                id,
                rule: &first.rule,
                recipient: &first.recipient,
                channel: &first.channel,
                group: Some(first.group_key.as_str()).filter(|g| !g.is_empty()),
                count,
                messages,
            },
        }
    }
}

/// How many of `items` (one group's, oldest first) the digest `id` carries so that its body
/// stays within `max_bytes`: at least one, so a request larger than the bound alone still
/// goes out, as a digest of one. Counted from above (each item's stored text whole, the count
/// as if all were in), so the body published is never larger than counted.
fn fitting(id: &str, items: &[Item], max_bytes: usize) -> usize {
    let Some(first) = items.first() else {
        return 0;
    };
    // The body without messages (`"messages":[]`); each message adds its text and a comma.
    let mut size =
        serde_json::to_vec(&Body::new(id, first, items.len(), Vec::new())).map_or(0, |b| b.len());
    for (n, item) in items.iter().enumerate() {
        size += item.message_text.len() + usize::from(n > 0);
        if n > 0 && size > max_bytes {
            return n;
        }
    }
    items.len()
}

/// What taking up a group came to.
#[derive(Debug, Default)]
struct Took {
    expired: usize,
    /// The digest the limiter admitted, to be sent.
    admitted: Option<String>,
}

/// A group's held items not yet bound to a digest, oldest first, at most [`MAX_ITEMS`].
async fn held_items(
    tx: &mut Transaction<'_, Postgres>,
    recipient: &str,
    rule: &str,
    group: &str,
) -> Result<Vec<Item>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, recipient, rule, group_key, channel, message_id, message_text, \
         expires_at, held_at, held_order FROM digest_items WHERE recipient = $1 \
         AND rule = $2 AND group_key = $3 AND digest_id IS NULL \
         ORDER BY held_at, held_order, id LIMIT $4",
    )
    .bind(recipient)
    .bind(rule)
    .bind(group)
    .bind(MAX_ITEMS)
    .fetch_all(&mut **tx)
    .await
}

/// Binds the items `ids` to the admitted digest `id`: they are its, whoever sends it.
async fn bind_to_digest(
    tx: &mut Transaction<'_, Postgres>,
    id: &str,
    ids: &[i64],
) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE digest_items SET digest_id = $1 WHERE id = ANY($2)")
        .bind(id)
        .bind(ids)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Sets when the items `ids` of a refused digest are taken up again: `room`, when the
/// decision says when the recipient has room.
async fn flush_after(
    tx: &mut Transaction<'_, Postgres>,
    room: Option<DateTime<Utc>>,
    ids: &[i64],
) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE digest_items SET flush_after = $1 WHERE id = ANY($2)")
        .bind(room)
        .bind(ids)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Takes the transaction-scoped advisory lock named by `parts`, unless another transaction
/// holds it (false). A lock on the name, not on rows: every worker taking up a group or a
/// digest takes the same one, whatever rows were held since.
async fn try_lock(tx: &mut Transaction<'_, Postgres>, parts: &[&str]) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("SELECT pg_try_advisory_xact_lock(hashtextextended($1, 0))")
        .bind(parts.join("\u{1f}"))
        .fetch_one(&mut **tx)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(id: i64, text_bytes: usize) -> Item {
        let text = serde_json::json!({"id": format!("m-{id}"), "pad": "x".repeat(text_bytes)});
        Item {
            id,
            recipient: "u1".into(),
            rule: "daily".into(),
            group_key: String::new(),
            channel: "email".into(),
            message_id: format!("m-{id}"),
            message_text: text.to_string(),
            expires_at: None,
            held_at: DateTime::UNIX_EPOCH,
            held_order: id,
        }
    }

    /// The body a digest of `items` is published with.
    fn body_len(id: &str, items: &[Item]) -> usize {
        let messages = items
            .iter()
            .map(|i| serde_json::from_str::<&RawValue>(&i.message_text).expect("JSON"))
            .collect::<Vec<_>>();
        let body = Body::new(id, &items[0], messages.len(), messages);
        serde_json::to_vec(&body).expect("serializes").len()
    }

    #[test]
    fn a_digest_takes_the_oldest_items_whose_body_stays_within_the_bound() {
        let items: Vec<Item> = (1..=10).map(|n| item(n, 100 * n as usize)).collect();
        for max in [1_024, 2_000, 3_333, 5_000, 100_000] {
            let fit = fitting("digest:daily:u1::1", &items, max);
            assert!(fit >= 1);
            assert!(
                body_len("digest:daily:u1::1", &items[..fit]) <= max,
                "{max}: {fit}"
            );
            if fit < items.len() {
                assert!(
                    body_len("digest:daily:u1::1", &items[..=fit]) > max,
                    "{max}: {fit}"
                );
            }
        }
    }

    #[test]
    fn an_item_larger_than_the_bound_goes_alone() {
        let items = [item(1, 5_000), item(2, 10)];
        assert_eq!(fitting("d", &items, 1_024), 1);
        assert_eq!(fitting("d", &items[..0], 1_024), 0);
    }

    #[test]
    fn a_digest_id_names_its_group_and_first_item() {
        assert_eq!(
            digest_id("daily", "u1", "spring", 42),
            "digest:daily:u1:spring:42"
        );
        assert_ne!(
            digest_id("daily", "u1", "", 42),
            digest_id("daily", "u1", "", 43)
        );
    }

    #[test]
    fn a_digest_id_too_long_for_an_amqp_short_string_names_its_group_by_a_hash() {
        let long = "r".repeat(256);
        let id = digest_id("daily", &long, "", 7);
        assert_eq!(id.len(), "digest:".len() + 64 + ":7".len());
        assert!(id.starts_with("digest:") && id.ends_with(":7"), "{id}");
        assert_eq!(
            id,
            digest_id("daily", &long, "", 7),
            "the same on every attempt"
        );
        assert_ne!(id, digest_id("daily", &long, "", 8));
        assert_ne!(id, digest_id("daily", &long, "a", 7));
        // The parts are kept apart: moving a character from one to the next is another group.
        assert_ne!(
            digest_id("daily", &long, "x", 7),
            digest_id("dailyr", &"r".repeat(255), "x", 7)
        );
        let fits = "r".repeat(200);
        assert_eq!(
            digest_id("daily", &fits, "", 7),
            format!("digest:daily:{fits}::7"),
            "readable while it fits"
        );
    }
}
