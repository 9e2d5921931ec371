//! One message, start to finish, minus the ack: decode -> policy -> decide -> outcome.
//!
//! [`Pipeline::handle`] returns only once the outcome is durable somewhere else (dispatched
//! with a publisher confirm, denial row committed, parked in a delay queue, or routed to the
//! invalid queue). The caller acks after that, and on an error retries the whole step: every
//! part of it is idempotent by message id, so a retry never consumes quota twice.

use std::sync::Arc;
use std::time::Instant;

use chrono::{DateTime, Utc};

use lapin::message::Delivery;
use lapin::BasicProperties;

use crate::broker::{self, BrokerError, Names, Publisher};
use crate::claim::Claim;
use crate::clock::Clock;
use crate::deadline::{self, Receipt};
use crate::decision::Verdict;
use crate::dedup::DispatchMarks;
use crate::denials::{DenialError, DenialRow, DenialWriter};
use crate::digest::{self, DigestError, Digests};
use crate::failpoint::{self, Failpoint};
use crate::limiter::{Evaluation, Limiter, LimiterError};
use crate::message::{InvalidMessage, SendRequest};
use crate::outcome::{Failure, Handled, Outcome, OutcomeName};
use crate::policy::Rule;
use crate::reload::LiveRules;
use crate::rollup::DecisionCounts;
use crate::sequence::Place;
use crate::telemetry;
use crate::traces::{self, MessageTrace, Traces};

/// A failure that leaves the message unacked, to be retried.
#[derive(Debug, thiserror::Error)]
pub enum HandleError {
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
    /// Postgres failed holding a message for a digest.
    #[error(transparent)]
    Digest(#[from] DigestError),
}

impl HandleError {
    /// How the attempt failed: a refusal of this message's own data (Postgres refused its
    /// denial row), or a service being away, which retrying outlasts.
    pub fn failure(&self) -> Failure {
        match self {
            HandleError::Denials(DenialError::Refused { .. }) => Failure::Refused,
            _ => Failure::Transient,
        }
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

/// Everything a message's decision needs, shared by all in-flight messages.
pub struct Pipeline {
    /// The running rules, with their metric handles: each decision takes one snapshot.
    pub rules: LiveRules,
    /// Quota state in Redis.
    pub limiter: Limiter,
    /// Dispatch marks in Redis.
    pub marks: DispatchMarks,
    /// The denial history, written in batches.
    pub denials: DenialWriter,
    /// The worker's clock.
    pub clock: Arc<dyn Clock>,
    /// Exchange and queue names.
    pub names: Names,
    /// Largest accepted body.
    pub max_body_bytes: usize,
    /// The lease of each delivery's in-flight claim, in ms.
    pub claim_lease_ms: u64,
    /// A deliberate stop for crash tests; `None` in production.
    pub failpoint: Option<Failpoint>,
    /// Messages held by digest rules, and how often the flusher sends them.
    pub digests: Digests,
    /// Span export; `None` (the default) when no OTLP endpoint is set: no span is made.
    pub traces: Option<Arc<Traces>>,
    /// Settled decisions counted for the per-minute rollup (written by its own task).
    pub rollup: Arc<DecisionCounts>,
}

impl Pipeline {
    /// Decides one delivery and makes its outcome durable, publishing through `publisher`.
    /// `request` is its body decoded (once, when it was taken from the channel: its recipient
    /// placed it in line), or why the body is not a request.
    /// `claim` is the delivery's in-flight claim: the same one for every attempt at it.
    /// `place` is its place in its recipient's line: it is decided after the messages to that
    /// recipient delivered before it, and leaves the line once decided (an invalid body at
    /// once), not once its outcome is durable.
    /// `trace` holds the delivery's `receive` span when spans are exported: the attempt's
    /// spans are its children.
    pub async fn handle(
        &self,
        publisher: &Publisher,
        request: &Result<SendRequest, InvalidMessage>,
        delivery: &Delivery,
        claim: &Claim,
        place: &mut Place,
        trace: Option<&MessageTrace>,
    ) -> Result<Handled, HandleError> {
        match request {
            Ok(message) => {
                self.decide(publisher, message, delivery, claim, place, trace)
                    .await
            }
            Err(invalid) => {
                place.leave();
                let (body, properties) = (&delivery.data, &delivery.properties);
                self.invalid(publisher, body, properties, invalid).await
            }
        }
    }

    /// Decides a decoded request in its turn and makes its outcome durable.
    async fn decide(
        &self,
        publisher: &Publisher,
        message: &SendRequest,
        delivery: &Delivery,
        claim: &Claim,
        place: &mut Place,
        trace: Option<&MessageTrace>,
    ) -> Result<Handled, HandleError> {
        place.turn().await;
        if failpoint::armed(self.failpoint, Failpoint::FailStuckIds)
            && message.id.starts_with("stuck-")
        {
            place.leave();
            let injected = std::io::Error::other("failpoint fail-stuck-ids");
            return Err(HandleError::Redis(injected.into()));
        }
        if failpoint::armed(self.failpoint, Failpoint::SlowIds) && message.id.starts_with("slow-") {
            tokio::time::sleep(failpoint::SLOW_IDS_HOLD).await;
        }
        // One snapshot for the whole decision: a reload meanwhile does not reach it.
        let rules = self.rules.current();
        let now = self.clock.now();
        let properties = &delivery.properties;
        let decoded = Decoded {
            publisher,
            message,
            body: &delivery.data,
            properties,
            now,
            replay_of: broker::header(properties, broker::REPLAY_OF_HEADER)
                .and_then(|v| v.parse::<i64>().ok()),
            metrics: &rules.metrics,
            receipt: Receipt::from_headers(properties, now),
            trace,
        };
        let receipt = &decoded.receipt;
        if let Some(Outcome::Expired { deadline, .. }) =
            deadline::before_decision(message, receipt, now)
        {
            // Past its deadline: no rule is asked, so no quota is taken and no claim held.
            place.leave();
            if self.marks.is_marked(message, now).await? {
                return Ok(Handled::Duplicate);
            }
            return self.expire(&decoded, None, deadline).await;
        }
        let started = Instant::now();
        let mut span = traces::decide(trace);
        let evaluation = self
            .limiter
            .evaluate_claimed(&rules.policy, message, now, claim)
            .await;
        // Decided, or failed: the next message to the recipient may be decided now. A failed
        // decision gives up its turn and is retried outside the line; keeping the turn would
        // hold every later message to the recipient, and the slots they wait in, until it
        // yields its slot (a minute by default).
        place.leave();
        let evaluation = match span.result(evaluation) {
            Ok(evaluation) => evaluation,
            Err(e) if e.is_unavailable() => match rules.policy.fails_open(message) {
                Some(rule) => {
                    drop(span);
                    return self.unchecked(&decoded, rule, &e).await;
                }
                None => return Err(e.into()),
            },
            Err(e) => return Err(e.into()),
        };
        rules
            .metrics
            .decision_seconds
            .record(started.elapsed().as_secs_f64());
        let verdicts = match &evaluation {
            Evaluation::Decided { verdicts, .. } => verdicts,
            Evaluation::Dispatched => {
                span.decided(OutcomeName::Duplicate.as_str(), None);
                return Ok(Handled::Duplicate);
            }
            Evaluation::InFlight { .. } => {
                span.decided(OutcomeName::InFlight.as_str(), None);
                drop(span);
                return self.wait_in_flight(&decoded).await;
            }
        };
        for v in verdicts {
            rules.metrics.verdict(&v.rule, v.allowed);
        }
        self.rollup.verdicts(now, verdicts);
        let deadline = receipt.deadline_after(message, &rules.policy, verdicts);
        let outcome = evaluation.outcome(&rules.policy, message, receipt);
        span.decided(
            outcome.name().as_str(),
            outcome.rule().map(|v| v.rule.as_str()),
        );
        drop(span);
        match outcome {
            Outcome::Allow { shadow_refusals } => {
                self.dispatch(&decoded, claim, shadow_refusals, deadline)
                    .await
            }
            Outcome::Deny { rule, retry_after } => {
                let refusal = Refusal {
                    retry_after,
                    expires_at: deadline,
                    ..Refusal::of(&rule)
                };
                self.record(&decoded, refusal).await?;
                Ok(Handled::Denied { rule: rule.rule })
            }
            Outcome::Delay { until, rule } => {
                self.delay(&decoded, until, rule.rule, deadline).await
            }
            Outcome::Expired { rule, deadline } => {
                self.expire(&decoded, rule.as_ref(), deadline).await
            }
            Outcome::Digest { rule } => {
                // The snapshot that decided has the rule; without it, the group is the plainest.
                let group = rules
                    .policy
                    .rule(&rule.rule)
                    .map_or("", |r| digest::group_of(r, message));
                self.digests
                    .hold(message, &rule.rule, group, deadline, now)
                    .await?;
                Ok(Handled::Digested { rule: rule.rule })
            }
        }
    }

    /// Records a message past its deadline, or that `rule` would hold past it, as a denial with
    /// reason `expired` (under [`deadline::DEADLINE_RULE`] when no rule held it); it is never
    /// sent.
    async fn expire(
        &self,
        decoded: &Decoded<'_>,
        rule: Option<&Verdict>,
        deadline: DateTime<Utc>,
    ) -> Result<Handled, HandleError> {
        let refusal = Refusal {
            rule: rule.map_or(deadline::DEADLINE_RULE, |v| &v.rule),
            kind: rule.map_or(deadline::DEADLINE_RULE, |v| v.kind),
            reason: deadline::EXPIRED_REASON,
            shadow: false,
            unchecked: false,
            retry_after: None,
            expires_at: Some(deadline),
        };
        let rule = refusal.rule.to_owned();
        self.record(decoded, refusal).await?;
        Ok(Handled::Expired { rule })
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
    async fn unchecked(
        &self,
        decoded: &Decoded<'_>,
        rule: &Rule,
        error: &LimiterError,
    ) -> Result<Handled, HandleError> {
        let message = decoded.message;
        let reason = format!(
            "{UNCHECKED_REASON} ({})",
            crate::message::one_line(&error.to_string())
        );
        let refusal = Refusal {
            rule: &rule.name,
            kind: rule.kind.name(),
            reason: &reason,
            shadow: false,
            unchecked: true,
            retry_after: None,
            expires_at: decoded.receipt.deadline(message),
        };
        decoded.publish_dispatch(&self.names.dispatch).await?;
        metrics::counter!(telemetry::UNCHECKED).increment(1);
        if let Err(e) = self.record(decoded, refusal).await {
            tracing::error!(message_id = %message.id, rule = %rule.name, error = %e,
                "dispatched unchecked, but its unchecked row was not written");
        }
        tracing::warn!(message_id = %message.id, rule = %rule.name, %error,
            "redis unavailable: message dispatched unchecked");
        Ok(Handled::Unchecked {
            rule: rule.name.clone(),
        })
    }

    /// Routes a body that is not a valid request to the invalid queue, with why.
    async fn invalid(
        &self,
        publisher: &Publisher,
        body: &[u8],
        properties: &BasicProperties,
        invalid: &InvalidMessage,
    ) -> Result<Handled, HandleError> {
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

    /// Another delivery of the message's id is in flight: through the shortest delay queue
    /// back to be decided again once that one is done.
    async fn wait_in_flight(&self, decoded: &Decoded<'_>) -> Result<Handled, HandleError> {
        let queue = self.names.delay_queue(broker::DELAY_TIERS_MS[0]);
        decoded.publish("", &queue, &[]).await?;
        Ok(Handled::InFlight)
    }

    /// Publishes an admitted message to the dispatch exchange after recording the refusals of
    /// shadow rules, then writes its dispatch mark. Its claim is kept alive meanwhile: a
    /// publish can wait out a broker alarm, longer than one lease.
    async fn dispatch(
        &self,
        decoded: &Decoded<'_>,
        claim: &Claim,
        shadow_refusals: Vec<Verdict>,
        deadline: Option<DateTime<Utc>>,
    ) -> Result<Handled, HandleError> {
        let message = decoded.message;
        let work = async {
            for verdict in &shadow_refusals {
                let refusal = Refusal {
                    shadow: true,
                    expires_at: deadline,
                    ..Refusal::of(verdict)
                };
                self.record(decoded, refusal).await?;
            }
            // An allowed outcome of a committing decision: the limiter has committed it.
            if failpoint::armed(self.failpoint, Failpoint::HangAfterAdmit) {
                tracing::warn!(message_id = %message.id, "failpoint hang-after-admit reached");
                std::future::pending::<()>().await;
            }
            let started = Instant::now();
            decoded.publish_dispatch(&self.names.dispatch).await?;
            decoded
                .metrics
                .dispatch_seconds
                .record(started.elapsed().as_secs_f64());
            self.marks.mark_dispatched(message, decoded.now).await?;
            Ok::<_, HandleError>(())
        };
        {
            let work = std::pin::pin!(work);
            claim
                .held_while(|| self.limiter.renew_claim(message, claim), work)
                .await?;
        }
        Ok(Handled::Dispatched {
            shadow: shadow_refusals.into_iter().map(|v| v.rule).collect(),
        })
    }

    /// Parks a message only `delay` rules refused in the delay queue that returns it about
    /// `until`, with its `deadline` (which it does not reach before `until`: see
    /// [`deadline::enforce`]) for when it comes back.
    async fn delay(
        &self,
        decoded: &Decoded<'_>,
        until: DateTime<Utc>,
        rule: String,
        deadline: Option<DateTime<Utc>>,
    ) -> Result<Handled, HandleError> {
        let queue = self
            .names
            .delay_queue(broker::delay_tier(decoded.now, until));
        let delayed_until = (broker::DELAYED_UNTIL_HEADER, until.to_rfc3339());
        let held = Receipt {
            held_until: deadline,
            ..decoded.receipt
        };
        decoded
            .publish_with("", &queue, &[delayed_until], &held)
            .await?;
        metrics::counter!(telemetry::DELAYED).increment(1);
        Ok(Handled::Delayed { until, rule })
    }

    /// Moves a message a service refuses for good to the quarantine queue, with `poison` in its
    /// headers, having first given back whatever it took: the quota of every rule (a shadow
    /// rule's denial row is written before the dispatch) and its in-flight claim. The caller
    /// acks it. `message` is the body as the worker decoded it on delivery (`None` when it is
    /// no request).
    ///
    /// The refund comes first because it can be repeated and a publish cannot: when either
    /// fails the delivery is retried whole, so a publish followed by a failed refund left a
    /// copy in the quarantine queue for every attempt. A refund followed by a failed publish
    /// leaves nothing: the retry decides the message again, taking and giving back its quota.
    pub async fn quarantine(
        &self,
        publisher: &Publisher,
        message: Option<&SendRequest>,
        body: &[u8],
        properties: &BasicProperties,
        claim: &Claim,
        poison: &Poison,
    ) -> Result<(), HandleError> {
        if let Some(message) = message {
            self.refund_poison(message, claim).await?;
        }
        let id = match message {
            Some(m) => Some(m.id.as_str()),
            None => properties.message_id().as_ref().map(|s| s.as_str()),
        };
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

    /// Gives back what a message about to be quarantined took: every rule's quota and its
    /// in-flight claim.
    async fn refund_poison(&self, message: &SendRequest, claim: &Claim) -> Result<(), HandleError> {
        if failpoint::armed(self.failpoint, Failpoint::FailQuarantineRefund)
            && message
                .recipient
                .starts_with(failpoint::FAILING_RECIPIENT_PREFIX)
        {
            return Err(HandleError::Redis(
                failpoint::gone("fail-quarantine-refund").into(),
            ));
        }
        let policy = &self.rules.current().policy;
        self.limiter
            .refund(policy, message, self.clock.now(), claim)
            .await?;
        Ok(())
    }

    /// Yields the slot of a delivery that keeps failing: publishes it to the delay queue of
    /// about `wait` (headers kept), from which it returns to the requests queue and is decided
    /// afresh, and releases its claim; the caller then acks it. It is retried about as often as
    /// it would have been in place, but other messages get the slot in between, so failures
    /// specific to some messages cannot hold every slot.
    pub async fn yield_slot(
        &self,
        publisher: &Publisher,
        message: Option<&SendRequest>,
        body: &[u8],
        properties: &BasicProperties,
        claim: &Claim,
        wait: std::time::Duration,
    ) -> Result<(), HandleError> {
        let id = properties.message_id().as_ref().map(|s| s.as_str());
        let mut headers: Vec<_> = broker::replay_header(properties).into_iter().collect();
        headers.extend(Receipt::carried(properties));
        let wait_ms = i64::try_from(wait.as_millis()).unwrap_or(i64::MAX);
        let queue = self.names.delay_queue(broker::delay_tier_for(wait_ms));
        let props = broker::carry(properties, broker::json_properties(id, &headers));
        publisher.publish("", &queue, body, props).await?;
        metrics::counter!(telemetry::SLOTS_YIELDED).increment(1);
        tracing::warn!(message_id = ?id, queue = %queue, "message kept failing; it yields its slot");
        self.abandon(message, claim).await;
        Ok(())
    }

    /// Drops the delivery's in-flight claim on its message, for a delivery given up without a
    /// dispatch (it goes back to the queue): its copies need not wait out the lease. Nothing
    /// to drop for a body that is no request (`None`).
    pub async fn abandon(&self, message: Option<&SendRequest>, claim: &Claim) {
        if let Some(message) = message {
            self.limiter.release_claim(message, claim).await;
        }
    }

    /// Writes the denial row of `refusal` (its batch committed).
    async fn record(&self, decoded: &Decoded<'_>, refusal: Refusal<'_>) -> Result<(), DenialError> {
        let started = Instant::now();
        let mut span =
            traces::record_denial(decoded.trace, refusal.rule, refusal.reason, refusal.shadow);
        let written = self
            .denials
            .write(DenialRow {
                rule: refusal.rule.to_owned(),
                kind: refusal.kind.to_owned(),
                reason: refusal.reason.to_owned(),
                shadow: refusal.shadow,
                unchecked: refusal.unchecked,
                retry_after: refusal.retry_after,
                replay_of: decoded.replay_of,
                expires_at: refusal.expires_at,
                ..DenialRow::for_message(decoded.message, decoded.now)
            })
            .await;
        span.result(written)?;
        drop(span);
        // The histogram is the same whatever the rules: any snapshot's handle records it.
        self.rules
            .current()
            .metrics
            .denial_write_seconds
            .record(started.elapsed().as_secs_f64());
        Ok(())
    }
}

/// The reason of an unchecked row, before the error that made Redis unavailable.
pub const UNCHECKED_REASON: &str = "unchecked: redis unavailable";

/// What a denial row records of a refusal: the rule's, an expiry's, or an unchecked
/// dispatch's.
struct Refusal<'a> {
    rule: &'a str,
    kind: &'a str,
    reason: &'a str,
    shadow: bool,
    /// A dispatch without a decision (see [`Pipeline::unchecked`]).
    unchecked: bool,
    retry_after: Option<DateTime<Utc>>,
    /// The message's deadline.
    expires_at: Option<DateTime<Utc>>,
}

impl<'a> Refusal<'a> {
    /// `verdict`'s refusal, not in shadow, with its own `retry_after` and no deadline.
    fn of(verdict: &'a Verdict) -> Refusal<'a> {
        Refusal {
            rule: &verdict.rule,
            kind: verdict.kind,
            reason: &verdict.reason,
            shadow: false,
            unchecked: false,
            retry_after: verdict.retry_after,
            expires_at: None,
        }
    }
}

/// A decoded delivery on its way to an outcome, with what republishing it needs.
struct Decoded<'a> {
    publisher: &'a Publisher,
    message: &'a SendRequest,
    body: &'a [u8],
    /// The delivery's properties: what the producer sent is carried onto every publish.
    properties: &'a BasicProperties,
    now: DateTime<Utc>,
    /// The denial this delivery replays, carried on whenever it is republished.
    replay_of: Option<i64>,
    /// The metric handles of the rules it was decided under.
    metrics: &'a telemetry::MessageMetrics,
    /// When the worker first received the message and the deadline set so far, carried on
    /// whenever it is republished.
    receipt: Receipt,
    /// Its `receive` span when spans are exported.
    trace: Option<&'a MessageTrace>,
}

impl Decoded<'_> {
    /// Publishes the message to the senders through the `dispatch` exchange, its channel the
    /// routing key, and waits for the confirm, in a `dispatch` span whose context replaces the
    /// producer's `traceparent` when spans are exported.
    async fn publish_dispatch(&self, dispatch: &str) -> Result<(), BrokerError> {
        let message = self.message;
        let mut span = traces::dispatch(self.trace, dispatch, &message.channel);
        let props = span.propagated(broker::json_properties(Some(&message.id), &[]));
        let props = broker::carry(self.properties, props);
        let published = self
            .publisher
            .publish(dispatch, &message.channel, self.body, props)
            .await;
        span.result(published)
    }

    /// Republishes the body to `queue` through `exchange` with `headers`, its id, the replay
    /// it belongs to and its receipt kept.
    async fn publish(
        &self,
        exchange: &str,
        queue: &str,
        headers: &[(&'static str, String)],
    ) -> Result<(), BrokerError> {
        self.publish_with(exchange, queue, headers, &self.receipt)
            .await
    }

    /// [`Decoded::publish`] with `receipt` in place of the delivery's own.
    async fn publish_with(
        &self,
        exchange: &str,
        queue: &str,
        headers: &[(&'static str, String)],
        receipt: &Receipt,
    ) -> Result<(), BrokerError> {
        let mut headers = headers.to_vec();
        if let Some(denial) = self.replay_of {
            headers.push((broker::REPLAY_OF_HEADER, denial.to_string()));
        }
        headers.extend(receipt.headers());
        let props = broker::json_properties(Some(&self.message.id), &headers);
        let props = broker::carry(self.properties, props);
        self.publisher
            .publish(exchange, queue, self.body, props)
            .await
    }
}
