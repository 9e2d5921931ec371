//! One message, start to finish, minus the ack: decode -> policy -> decide -> act.
//!
//! [`Pipeline::handle`] returns only once the outcome is durable somewhere else (dispatched
//! with a publisher confirm, denial row committed, parked in a delay queue, held for a digest,
//! or routed to the invalid queue). The caller acks after that, and on an error retries the
//! whole step: every part of it is idempotent by message id, so a retry never consumes quota
//! twice. The decision is [`crate::decide::decision`]'s, the effects are [`super::steps`]'s.

use std::sync::Arc;
use std::time::Instant;

use lapin::message::Delivery;
use lapin::BasicProperties;

use super::digest::{self, Flusher};
use super::steps::{ActError, Delivered, Poison, Steps};
use crate::base::clock::Clock;
use crate::base::failpoint::{self, Failpoint};
use crate::base::traces::{MessageTrace, Step, Traces};
use crate::decide::claim::Claim;
use crate::decide::decision::{self, Decision};
use crate::decide::limiter::{Evaluation, Limiter, LimiterError};
use crate::decide::outcome::{Handled, Outcome, OutcomeName, Verdict};
use crate::intake::publisher::Publisher;
use crate::intake::sequence::Place;
use crate::record::rollup::DecisionCounts;
use crate::request::message::{InvalidMessage, SendRequest};
use crate::rules::policy::Rule;
use crate::rules::reload::{LiveRules, Rules};

/// Everything a message's decision needs, shared by all in-flight messages.
pub struct Pipeline {
    /// The running rules, with their metric handles: each decision takes one snapshot.
    pub rules: LiveRules,
    /// Quota state in Redis.
    pub limiter: Limiter,
    /// The effects an outcome is made durable through (shared with the digest flusher).
    pub steps: Arc<Steps>,
    /// The digest flusher each broker session runs beside its deliveries.
    pub digests: Arc<Flusher>,
    /// The worker's clock.
    pub clock: Arc<dyn Clock>,
    /// Largest accepted body.
    pub max_body_bytes: usize,
    /// The lease of each delivery's in-flight claim, in ms.
    pub claim_lease_ms: u64,
    /// A deliberate stop for crash tests; `None` in production.
    pub failpoint: Option<Failpoint>,
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
    ) -> Result<Handled, ActError> {
        match request {
            Ok(message) => {
                self.decide(publisher, message, delivery, claim, place, trace)
                    .await
            }
            Err(invalid) => {
                place.leave();
                let (body, properties) = (&delivery.data, &delivery.properties);
                self.steps
                    .invalid(publisher, body, properties, invalid)
                    .await
            }
        }
    }

    /// Decides a decoded request in its turn and makes its outcome durable: the flow.
    async fn decide(
        &self,
        publisher: &Publisher,
        message: &SendRequest,
        delivery: &Delivery,
        claim: &Claim,
        place: &mut Place,
        trace: Option<&MessageTrace>,
    ) -> Result<Handled, ActError> {
        place.turn().await;
        self.injected_faults(message, place).await?;
        // One snapshot for the whole decision: a reload meanwhile does not reach it.
        let rules = self.rules.current();
        let now = self.clock.now();
        let order = self.steps.held.order();
        let d = Delivered::of(publisher, message, delivery, (now, order), trace);
        if let Some(expired) = decision::before_rules(message, &d.receipt, now) {
            // Past its deadline: no rule is asked, so no quota is taken and no claim held.
            place.leave();
            if self.steps.marks.is_marked(message, now).await? {
                return Ok(Handled::Duplicate);
            }
            return self.act(&d, &rules, claim, expired).await;
        }
        let mut span = crate::base::traces::decide(trace);
        let verdicts = match self.evaluate(&d, &rules, claim, place, &mut span).await? {
            Evaluated::Decided(verdicts) => verdicts,
            Evaluated::Settled(handled) => return Ok(handled),
            Evaluated::InFlight => return self.steps.wait_in_flight(&d).await,
            Evaluated::Unavailable(rule, error) => {
                drop(span);
                return self.steps.unchecked(&d, rule, &error).await;
            }
        };
        let decided = decision::decide(&rules.policy, message, &d.receipt, &verdicts);
        span.decided(decided.outcome.name().as_str(), decided.outcome.rule_name());
        drop(span);
        self.act(&d, &rules, claim, decided).await
    }

    /// Asks the limiter about `d`'s message under `rules` (in its turn, which it leaves once
    /// the limiter has answered) and counts the verdicts; what it came to.
    async fn evaluate<'r>(
        &self,
        d: &Delivered<'_>,
        rules: &'r Rules,
        claim: &Claim,
        place: &mut Place,
        span: &mut Step,
    ) -> Result<Evaluated<'r>, ActError> {
        let (message, now) = (d.message, d.now);
        let started = Instant::now();
        let evaluation = self
            .limiter
            .evaluate_claimed(&rules.policy, message, now, claim)
            .await;
        // Decided, or failed: the next message to the recipient may be decided now. A failed
        // decision gives up its turn and is retried outside the line; keeping the turn would
        // hold every later message to the recipient, and the slots they wait in, until it
        // yields its slot (a minute by default).
        place.leave();
        let verdicts = match span.result(evaluation) {
            Ok(Evaluation::Decided { verdicts, .. }) => verdicts,
            Ok(Evaluation::Dispatched) => {
                span.decided(OutcomeName::Duplicate.as_str(), None);
                return Ok(Evaluated::Settled(Handled::Duplicate));
            }
            Ok(Evaluation::InFlight { .. }) => {
                span.decided(OutcomeName::InFlight.as_str(), None);
                return Ok(Evaluated::InFlight);
            }
            Err(e) if e.is_unavailable() => {
                return match rules.policy.fails_open(message) {
                    Some(rule) => Ok(Evaluated::Unavailable(rule, e)),
                    None => Err(e.into()),
                };
            }
            Err(e) => return Err(e.into()),
        };
        rules
            .metrics
            .decision_seconds
            .record(started.elapsed().as_secs_f64());
        for v in &verdicts {
            rules.metrics.verdict(&v.rule, v.allowed);
        }
        self.rollup.verdicts(now, &verdicts);
        Ok(Evaluated::Decided(verdicts))
    }

    /// Makes `decision` on `d`, taken under `rules`, durable through the step for its outcome.
    async fn act(
        &self,
        d: &Delivered<'_>,
        rules: &Rules,
        claim: &Claim,
        decision: Decision,
    ) -> Result<Handled, ActError> {
        let Decision { outcome, deadline } = decision;
        let steps = &self.steps;
        match outcome {
            Outcome::Allow { shadow_refusals } => {
                let renew = || self.limiter.renew_claim(d.message, claim, self.clock.now());
                steps
                    .dispatch(d, claim, renew, shadow_refusals, deadline)
                    .await
            }
            Outcome::Deny { rule, retry_after } => steps.deny(d, rule, retry_after, deadline).await,
            Outcome::Delay { until, rule } => steps.delay(d, until, rule.rule, deadline).await,
            Outcome::Expired { rule, deadline } => {
                steps.expire_delivery(d, rule.as_ref(), deadline).await
            }
            Outcome::Digest { rule } => {
                // The snapshot that decided has the rule; without it, the group is the plainest.
                let group = rules
                    .policy
                    .rule(&rule.rule)
                    .map_or("", |r| digest::group_of(r, d.message));
                steps.hold(d, &rule, group, deadline).await
            }
        }
    }

    /// The crash tests' faults on a message's way to its decision: a failure for `stuck-`
    /// ids, a hold for `slow-` ones.
    async fn injected_faults(
        &self,
        message: &SendRequest,
        place: &mut Place,
    ) -> Result<(), ActError> {
        if failpoint::armed(self.failpoint, Failpoint::FailStuckIds)
            && message.id.starts_with("stuck-")
        {
            place.leave();
            let injected = std::io::Error::other("failpoint fail-stuck-ids");
            return Err(ActError::Redis(injected.into()));
        }
        if failpoint::armed(self.failpoint, Failpoint::SlowIds) && message.id.starts_with("slow-") {
            tokio::time::sleep(failpoint::SLOW_IDS_HOLD).await;
        }
        Ok(())
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
    ) -> Result<(), ActError> {
        if let Some(message) = message {
            self.refund_poison(message, claim).await?;
        }
        let id = match message {
            Some(m) => Some(m.id.as_str()),
            None => properties.message_id().as_ref().map(|s| s.as_str()),
        };
        self.steps
            .quarantine(publisher, id, body, properties, poison)
            .await
    }

    /// Gives back what a message about to be quarantined took: every rule's quota and its
    /// in-flight claim.
    async fn refund_poison(&self, message: &SendRequest, claim: &Claim) -> Result<(), ActError> {
        if failpoint::armed(self.failpoint, Failpoint::FailQuarantineRefund)
            && message
                .recipient
                .starts_with(failpoint::FAILING_RECIPIENT_PREFIX)
        {
            return Err(ActError::Redis(
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
    ) -> Result<(), ActError> {
        self.steps
            .yield_slot(publisher, body, properties, wait)
            .await?;
        self.abandon(message, claim).await;
        Ok(())
    }

    /// Drops the delivery's in-flight claim on its message, for a delivery given up without a
    /// dispatch (it goes back to the queue): its copies need not wait out the lease. Nothing
    /// to drop for a body that is no request (`None`).
    pub async fn abandon(&self, message: Option<&SendRequest>, claim: &Claim) {
        if let Some(message) = message {
            let now = self.clock.now();
            self.limiter.release_claim(message, claim, now).await;
        }
    }
}

/// What asking the limiter came to, for the flow.
enum Evaluated<'r> {
    /// Every rule's verdict, in policy order.
    Decided(Vec<Verdict>),
    /// Nothing to decide: the message went out before.
    Settled(Handled),
    /// Another delivery of the id holds it.
    InFlight,
    /// Redis is unavailable and every rule matching the message lets it out unchecked: the
    /// first of them, and the error.
    Unavailable(&'r Rule, LimiterError),
}
