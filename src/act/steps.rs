//! One step per outcome, making it durable: a dispatch (published, then marked), a denial row,
//! a delay, an expiry, an unchecked dispatch, a hold for a digest, a wait for a copy in
//! flight, the invalid queue and the quarantine. Shared by the pipeline (a delivery's outcome)
//! and the digest flusher (a digest's), and each taking only the effects it needs: the
//! session's publisher, the dispatch marks, the denial writer, the held items.

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use lapin::message::Delivery;
use lapin::BasicProperties;
use metrics::Histogram;

use super::held::Held;
use crate::base::failpoint::{self, Failpoint};
use crate::base::telemetry;
use crate::base::traces::{self, MessageTrace};
use crate::decide::claim::Claim;
use crate::decide::deadline::{self, Receipt};
use crate::decide::dedup::DispatchMarks;
use crate::decide::limiter::LimiterError;
use crate::decide::outcome::{Failure, Handled, Verdict};
use crate::intake::broker::{self, BrokerError, Names};
use crate::intake::publisher::Publisher;
use crate::record::denials::{DenialError, DenialRow, DenialWriter};
use crate::request::message::{InvalidMessage, SendRequest};
use crate::rules::policy::Rule;

/// A failure that leaves a message unacked (retried) or a digest held (flushed again): the one
/// error of the pipeline and the digest flusher.
#[derive(Debug, thiserror::Error)]
pub enum ActError {
    /// Redis failed during the decision.
    #[error(transparent)]
    Limiter(#[from] LimiterError),
    /// Redis failed reading or writing a dispatch mark.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// Postgres failed writing a denial.
    #[error(transparent)]
    Denials(#[from] DenialError),
    /// RabbitMQ failed a publish.
    #[error(transparent)]
    Broker(#[from] BrokerError),
    /// Postgres failed holding a message for a digest, or reading or changing held ones.
    #[error("postgres (digests): {0}")]
    Held(#[from] sqlx::Error),
    /// A digest body could not be written as JSON.
    #[error("digest body: {0}")]
    Body(#[from] serde_json::Error),
    /// The broker neither took nor refused a digest in time: it may still take it, so it is
    /// left leased (see [`super::digest::SEND_LEASE`]).
    #[error("rabbitmq: the digest's publish was not confirmed within {0:?}")]
    PublishTimeout(Duration),
}

impl ActError {
    /// How the attempt failed: a refusal of this message's own data (Postgres refused its
    /// denial row, the broker its body's size), or a service being away, which retrying
    /// outlasts.
    pub fn failure(&self) -> Failure {
        match self {
            ActError::Denials(DenialError::Refused { .. }) => Failure::Refused,
            ActError::Broker(e) if e.refuses_the_message() => Failure::Refused,
            _ => Failure::Transient,
        }
    }
}

/// The reason of an unchecked row, before the error that made Redis unavailable.
pub const UNCHECKED_REASON: &str = "unchecked: redis unavailable";

/// The effects an outcome is made durable through, shared by every in-flight message and the
/// digest flusher.
pub struct Steps {
    /// Dispatch marks in Redis.
    pub marks: DispatchMarks,
    /// The denial history, written in batches.
    pub denials: DenialWriter,
    /// Messages held by digest rules.
    pub held: Held,
    /// Exchange and queue names.
    pub names: Names,
    /// A deliberate fault for crash tests; `None` in production.
    pub failpoint: Option<Failpoint>,
    /// [`telemetry::DISPATCH_SECONDS`].
    pub dispatch_seconds: Histogram,
    /// [`telemetry::DENIAL_WRITE_SECONDS`].
    pub denial_write_seconds: Histogram,
}

/// A decoded delivery on its way to an outcome, with what republishing it needs.
pub struct Delivered<'a> {
    /// The session's publisher.
    pub publisher: &'a Publisher,
    /// The request.
    pub message: &'a SendRequest,
    /// The body as published: what goes on, unchanged.
    pub body: &'a [u8],
    /// The delivery's properties: what the producer sent is carried onto every publish.
    pub properties: &'a BasicProperties,
    /// The decision instant.
    pub now: DateTime<Utc>,
    /// Its [`Held::order`], taken in its recipient's turn: a hold keeps the decision order.
    pub order: i64,
    /// When the worker first received the message, the deadline set so far and the denial it
    /// replays, carried on whenever it is republished.
    pub receipt: Receipt,
    /// Its `receive` span when spans are exported.
    pub trace: Option<&'a MessageTrace>,
}

impl<'a> Delivered<'a> {
    /// `delivery`, whose body decoded to `message`, decided at `now` as the `order`-th of this
    /// process ([`Held::order`]): its receipt read from its headers here, once.
    pub fn of(
        publisher: &'a Publisher,
        message: &'a SendRequest,
        delivery: &'a Delivery,
        (now, order): (DateTime<Utc>, i64),
        trace: Option<&'a MessageTrace>,
    ) -> Delivered<'a> {
        Delivered {
            publisher,
            message,
            body: &delivery.data,
            properties: &delivery.properties,
            now,
            order,
            receipt: broker::receipt(&delivery.properties, now),
            trace,
        }
    }

    /// The denial row of this message, to which a step adds its refusal's fields.
    fn row(&self) -> DenialRow {
        DenialRow {
            replay_of: self.receipt.replay_of,
            ..DenialRow::for_message(self.message, self.now)
        }
    }

    /// The row of `verdict`'s refusal: its rule, kind, reason and `retry_after`.
    fn refused_by(&self, verdict: &Verdict) -> DenialRow {
        DenialRow {
            rule: verdict.rule.clone(),
            kind: verdict.kind.to_owned(),
            reason: verdict.reason.clone(),
            retry_after: verdict.retry_after,
            ..self.row()
        }
    }

    /// Republishes the body to `queue` through `exchange` with `headers`, its id and `receipt`
    /// kept.
    async fn republish(
        &self,
        exchange: &str,
        queue: &str,
        headers: &[(&'static str, String)],
        receipt: &Receipt,
    ) -> Result<(), BrokerError> {
        let mut headers = headers.to_vec();
        headers.extend(broker::receipt_headers(receipt));
        let props = broker::json_properties(Some(&self.message.id), &headers);
        let props = broker::carry(self.properties, props);
        self.publisher
            .publish(exchange, queue, self.body, props)
            .await
    }
}

impl Steps {
    /// Writes `row` (its batch committed), in a span under `trace`.
    pub async fn record(
        &self,
        row: DenialRow,
        trace: Option<&MessageTrace>,
    ) -> Result<(), DenialError> {
        let started = Instant::now();
        let mut span = traces::record_denial(trace, &row.rule, &row.reason, row.shadow);
        let written = self.denials.write(row).await;
        span.result(written)?;
        drop(span);
        self.denial_write_seconds
            .record(started.elapsed().as_secs_f64());
        Ok(())
    }

    /// Records the denial by `rule`, with the deadline the message is held to (so `replay`
    /// skips it once passed), and `retry_after` (the instant every refusing rule admits it).
    pub async fn deny(
        &self,
        d: &Delivered<'_>,
        rule: Verdict,
        retry_after: Option<DateTime<Utc>>,
        deadline: Option<DateTime<Utc>>,
    ) -> Result<Handled, ActError> {
        let row = DenialRow {
            retry_after,
            expires_at: deadline,
            ..d.refused_by(&rule)
        };
        self.record(row, d.trace).await?;
        Ok(Handled::Denied { rule: rule.rule })
    }

    /// Records `row`'s message, past its deadline (or that its `rule` would hold past it), as
    /// a denial with reason `expired` under `rule` and `kind` ([`deadline::DEADLINE_RULE`] when
    /// no rule held it); it is never sent. The pipeline's expiry and the digest flusher's.
    pub async fn expire(
        &self,
        row: DenialRow,
        rule: &str,
        kind: &str,
        deadline: Option<DateTime<Utc>>,
        trace: Option<&MessageTrace>,
    ) -> Result<Handled, ActError> {
        let row = DenialRow {
            rule: rule.to_owned(),
            kind: kind.to_owned(),
            reason: deadline::EXPIRED_REASON.to_owned(),
            retry_after: None,
            expires_at: deadline,
            ..row
        };
        self.record(row, trace).await?;
        Ok(Handled::Expired {
            rule: rule.to_owned(),
        })
    }

    /// [`Steps::expire`] for a delivery: under the delay rule that would hold it past
    /// `deadline`, or none.
    pub async fn expire_delivery(
        &self,
        d: &Delivered<'_>,
        rule: Option<&Verdict>,
        deadline: DateTime<Utc>,
    ) -> Result<Handled, ActError> {
        let (name, kind) = rule.map_or((deadline::DEADLINE_RULE, deadline::DEADLINE_RULE), |v| {
            (v.rule.as_str(), v.kind)
        });
        self.expire(d.row(), name, kind, Some(deadline), d.trace)
            .await
    }

    /// Publishes a message to the senders through the dispatch exchange (its routing key
    /// `channel`, its id `message_id`) and waits for the confirm: a delivery's or a digest's.
    pub async fn publish_dispatch(
        &self,
        publisher: &Publisher,
        channel: &str,
        body: &[u8],
        props: BasicProperties,
    ) -> Result<(), BrokerError> {
        publisher
            .publish(&self.names.dispatch, channel, body, props)
            .await
    }

    /// Publishes a delivery to the dispatch exchange in a `dispatch` span whose context
    /// replaces the producer's `traceparent` when spans are exported.
    async fn dispatch_delivery(&self, d: &Delivered<'_>) -> Result<(), BrokerError> {
        let message = d.message;
        let mut span = traces::dispatch(d.trace, &self.names.dispatch, &message.channel);
        let props = span.propagated(broker::json_properties(Some(&message.id), &[]));
        let props = broker::carry(d.properties, props);
        let published = self
            .publish_dispatch(d.publisher, &message.channel, d.body, props)
            .await;
        span.result(published)
    }

    /// Dispatches an admitted message: records the refusals of shadow rules, publishes it,
    /// then writes its dispatch mark. `claim` is kept alive meanwhile by `renew` (a publish
    /// can wait out a broker alarm, longer than one lease).
    pub async fn dispatch<R, F>(
        &self,
        d: &Delivered<'_>,
        claim: &Claim,
        renew: R,
        shadow_refusals: Vec<Verdict>,
        deadline: Option<DateTime<Utc>>,
    ) -> Result<Handled, ActError>
    where
        R: FnMut() -> F,
        F: std::future::Future<Output = bool>,
    {
        let message = d.message;
        let work = async {
            for verdict in &shadow_refusals {
                let row = DenialRow {
                    shadow: true,
                    expires_at: deadline,
                    ..d.refused_by(verdict)
                };
                self.record(row, d.trace).await?;
            }
            // An allowed outcome of a committing decision: the limiter has committed it.
            if failpoint::armed(self.failpoint, Failpoint::HangAfterAdmit) {
                tracing::warn!(message_id = %message.id, "failpoint hang-after-admit reached");
                std::future::pending::<()>().await;
            }
            let started = Instant::now();
            self.dispatch_delivery(d).await?;
            self.dispatch_seconds
                .record(started.elapsed().as_secs_f64());
            self.marks.mark_dispatched(message, d.now).await?;
            Ok::<_, ActError>(())
        };
        {
            let work = std::pin::pin!(work);
            claim.held_while(renew, work).await?;
        }
        Ok(Handled::Dispatched {
            shadow: shadow_refusals.into_iter().map(|v| v.rule).collect(),
        })
    }

    /// Fails open: Redis could not decide the message (`error`) and every rule matching it has
    /// `on_unavailable = "allow"`, so it is published to the dispatch exchange, then recorded
    /// as a row marked unchecked under `rule` (the first of them). Nothing is read from or
    /// written to Redis: no quota is taken, no dispatch mark written and the claim is left to
    /// its lease, so a copy of the message decided later may go out again.
    ///
    /// The row is written once the broker has the message: a row written before a publish
    /// that failed would stand for a dispatch that never happened, and take the place of the
    /// denial the message meets once Redis is back (one row per message and rule), which then
    /// could never be replayed. A row that cannot be written after the publish is logged and
    /// counted, and the message is not sent again for it.
    pub async fn unchecked(
        &self,
        d: &Delivered<'_>,
        rule: &Rule,
        error: &LimiterError,
    ) -> Result<Handled, ActError> {
        let message = d.message;
        let row = DenialRow {
            rule: rule.name.clone(),
            kind: rule.kind.name().to_owned(),
            reason: format!(
                "{UNCHECKED_REASON} ({})",
                crate::request::message::one_line(&error.to_string())
            ),
            unchecked: true,
            expires_at: d.receipt.deadline(message),
            ..d.row()
        };
        self.dispatch_delivery(d).await?;
        metrics::counter!(telemetry::UNCHECKED).increment(1);
        if let Err(e) = self.record(row, d.trace).await {
            tracing::error!(message_id = %message.id, rule = %rule.name, error = %e,
                "dispatched unchecked, but its unchecked row was not written");
        }
        tracing::warn!(message_id = %message.id, rule = %rule.name, %error,
            "redis unavailable: message dispatched unchecked");
        Ok(Handled::Unchecked {
            rule: rule.name.clone(),
        })
    }

    /// Parks a message only `delay` rules refused in the delay queue that returns it about
    /// `until`, with its `deadline` (which it does not reach before `until`: see
    /// [`deadline::enforce`]) for when it comes back.
    pub async fn delay(
        &self,
        d: &Delivered<'_>,
        until: DateTime<Utc>,
        rule: String,
        deadline: Option<DateTime<Utc>>,
    ) -> Result<Handled, ActError> {
        let queue = self.names.delay_queue(broker::delay_tier(d.now, until));
        let delayed_until = (broker::DELAYED_UNTIL_HEADER, until.to_rfc3339());
        let held = Receipt {
            held_until: deadline,
            ..d.receipt
        };
        d.republish("", &queue, &[delayed_until], &held).await?;
        metrics::counter!(telemetry::DELAYED).increment(1);
        Ok(Handled::Delayed { until, rule })
    }

    /// Another delivery of the message's id is in flight: through the shortest delay queue
    /// back to be decided again once that one is done.
    pub async fn wait_in_flight(&self, d: &Delivered<'_>) -> Result<Handled, ActError> {
        let queue = self.names.delay_queue(broker::DELAY_TIERS_MS[0]);
        d.republish("", &queue, &[], &d.receipt).await?;
        Ok(Handled::InFlight)
    }

    /// Holds a message the digest rule `rule` refused, in its group, with the deadline past
    /// which it is dropped from the digest.
    pub async fn hold(
        &self,
        d: &Delivered<'_>,
        rule: &Verdict,
        group: &str,
        deadline: Option<DateTime<Utc>>,
    ) -> Result<Handled, ActError> {
        self.held
            .hold(d.message, &rule.rule, group, deadline, d.now, d.order)
            .await?;
        Ok(Handled::Digested {
            rule: rule.rule.clone(),
        })
    }

    /// Routes a body that is not a valid request to the invalid queue, with why.
    pub async fn invalid(
        &self,
        publisher: &Publisher,
        body: &[u8],
        properties: &BasicProperties,
        invalid: &InvalidMessage,
    ) -> Result<Handled, ActError> {
        let reason = invalid.to_string();
        let id = properties.message_id().as_ref().map(|s| s.as_str());
        let props = broker::json_properties(id, &[(broker::REASON_HEADER, reason.clone())]);
        publisher
            .publish(
                "",
                &self.names.invalid,
                body,
                broker::carry(properties, props),
            )
            .await?;
        metrics::counter!(telemetry::INVALID).increment(1);
        Ok(Handled::Invalid { reason })
    }

    /// Publishes a message a service refuses for good to the quarantine queue, with `poison`
    /// in its headers (the caller has given back what it took).
    pub async fn quarantine(
        &self,
        publisher: &Publisher,
        id: Option<&str>,
        body: &[u8],
        properties: &BasicProperties,
        poison: &Poison,
    ) -> Result<(), ActError> {
        let mut headers = vec![
            (broker::QUARANTINE_REASON_HEADER, poison.reason.clone()),
            (
                broker::QUARANTINE_ATTEMPTS_HEADER,
                poison.attempts.to_string(),
            ),
            (
                broker::QUARANTINE_FIRST_ERROR_HEADER,
                poison.first_error.clone(),
            ),
            (broker::QUARANTINE_LAST_ERROR_HEADER, poison.reason.clone()),
        ];
        headers.extend(broker::replay_header(properties));
        let props = broker::carry(properties, broker::json_properties(id, &headers));
        publisher
            .publish("", &self.names.quarantine, body, props)
            .await?;
        metrics::counter!(telemetry::QUARANTINED).increment(1);
        tracing::error!(message_id = ?id, reason = %poison.reason, attempts = poison.attempts,
            queue = %self.names.quarantine, "message quarantined");
        Ok(())
    }

    /// Publishes a delivery that keeps failing to the delay queue of about `wait` (its headers
    /// kept), from which it returns to the requests queue to be decided afresh.
    pub async fn yield_slot(
        &self,
        publisher: &Publisher,
        body: &[u8],
        properties: &BasicProperties,
        wait: Duration,
    ) -> Result<(), ActError> {
        let id = properties.message_id().as_ref().map(|s| s.as_str());
        let mut headers: Vec<_> = broker::replay_header(properties).into_iter().collect();
        headers.extend(broker::carried_receipt(properties));
        let wait_ms = i64::try_from(wait.as_millis()).unwrap_or(i64::MAX);
        let queue = self.names.delay_queue(broker::delay_tier_for(wait_ms));
        let props = broker::carry(properties, broker::json_properties(id, &headers));
        publisher.publish("", &queue, body, props).await?;
        metrics::counter!(telemetry::SLOTS_YIELDED).increment(1);
        tracing::warn!(message_id = ?id, queue = %queue, "message kept failing; it yields its slot");
        Ok(())
    }
}

/// Why a message is quarantined, for its headers.
#[derive(Debug, Clone)]
pub struct Poison {
    /// The failure that made it poison (the last one).
    pub reason: String,
    /// Attempts at the message, failed ones included.
    pub attempts: u32,
    /// Its first failure.
    pub first_error: String,
}
