//! One delivery's task: its pipeline step retried until its outcome is durable, then settled;
//! what follows a failed attempt (quarantine, a yielded slot, a wait, or back to the queue); the
//! unroutable dispatches said once per routing key; the decision's log line.

use std::sync::Arc;
use std::time::Duration;

use lapin::message::Delivery;
use lapin::Channel;
use tokio::sync::watch;
use tracing::{debug, info, warn};

use super::{sleep_or_stop, Backoff, Tally};
use crate::act::pipeline::Pipeline;
use crate::act::steps::{ActError, Poison};
use crate::base::telemetry;
use crate::base::traces;
use crate::decide::claim::Claim;
use crate::decide::outcome::{self, Failure, Handled, Next};
use crate::intake::acks::Settler;
use crate::intake::broker::{BrokerError, Names};
use crate::intake::publisher::Publisher;
use crate::intake::sequence::Place;
use crate::request::message::{InvalidMessage, SendRequest};

/// One delivery being processed, with what it needs to retry.
pub(super) struct Task {
    pub(super) pipeline: Arc<Pipeline>,
    pub(super) publisher: Publisher,
    /// The channel the delivery came on: it can only be acked there.
    pub(super) consuming: Channel,
    pub(super) settler: Settler,
    pub(super) backoff: Backoff,
    /// How long the delivery may keep failing before it yields its slot.
    pub(super) yield_slot_after: Duration,
    pub(super) stop: watch::Receiver<bool>,
    /// Its place in its recipient's line, taken in delivery order.
    pub(super) place: Place,
    /// Its body decoded, or why it is not a request. Boxed: the task's future is moved whole
    /// when it is spawned.
    pub(super) request: Box<Result<SendRequest, InvalidMessage>>,
    /// The routing keys whose dispatches are unroutable, said once each.
    pub(super) unrouted: Arc<Unrouted>,
}

impl Task {
    /// Processes `delivery` on its own task, holding `slot` until it is done, counted in
    /// `tally`.
    pub(super) fn spawn(
        self,
        delivery: Delivery,
        slot: tokio::sync::OwnedSemaphorePermit,
        tally: Arc<std::sync::Mutex<Tally>>,
    ) {
        let in_flight = self.pipeline.rules.current().metrics.in_flight();
        tally.lock().unwrap_or_else(|p| p.into_inner()).running += 1;
        // Boxed: the runtime moves a task's future when it is spawned and again when it
        // completes; a box is moved as a pointer. `process` itself is the task, not a block
        // awaiting it: a block would hold the task and the delivery once more beside the
        // copies `process` keeps, in a box copied whole for every delivery.
        tokio::spawn(Box::pin(self.process(delivery, (slot, in_flight), tally)));
    }

    /// Whether retrying is pointless: a lost channel can neither publish nor ack, and the
    /// broker redelivers the message on the next session.
    fn channels_lost(&self) -> bool {
        !self.consuming.status().connected() || !self.publisher.can_publish()
    }

    /// Handles the delivery until its outcome is durable, then hands it to the settler to be
    /// acked, holding `held` (its slot and its count in flight) until then and counting how it
    /// ended in `tally`. Retries on service failures; gives up (the message goes back to the
    /// queue) when the channel is gone or the worker is stopping.
    async fn process(
        mut self,
        delivery: Delivery,
        held: (tokio::sync::OwnedSemaphorePermit, telemetry::InFlight),
        tally: Arc<std::sync::Mutex<Tally>>,
    ) {
        let ended = self.settle(&delivery).await;
        {
            let mut tally = tally.lock().unwrap_or_else(|p| p.into_inner());
            tally.running -= 1;
            if ended == traces::REQUEUED {
                tally.requeued += 1;
            } else {
                tally.acked += 1;
            }
        }
        drop(held);
    }

    /// [`Task::process`]'s work: returns how the delivery was settled ([`traces::REQUEUED`]
    /// when given back).
    async fn settle(&mut self, delivery: &Delivery) -> &'static str {
        let claim = Claim::new(self.pipeline.claim_lease_ms);
        let mut failures = Failures::default();
        // The delivery's `receive` span, ended when the delivery is settled or given up;
        // boxed, so that without span export a task's future grows by a pointer only.
        let trace = self.pipeline.traces.as_ref().map(|traces| {
            let request = self.request.as_ref().as_ref().ok();
            Box::new(traces.receive(&delivery.properties, request))
        });
        loop {
            // Boxed: the decision's state machine is kilobytes, and a task's future is moved
            // whole when it is spawned and when it completes.
            let handled = Box::pin(self.pipeline.handle(
                &self.publisher,
                &self.request,
                delivery,
                &claim,
                &mut self.place,
                trace.as_deref(),
            ))
            .await;
            match handled {
                Ok(handled) => {
                    if let Some(trace) = &trace {
                        trace.settled(handled.name().as_str(), handled.rules());
                    }
                    let request = self.request.as_ref().as_ref().ok();
                    if let (Handled::Dispatched { .. } | Handled::Unchecked { .. }, Some(request)) =
                        (&handled, request)
                    {
                        self.unrouted.routed(&request.channel);
                    }
                    // Counted once the outcome is durable, not per attempt.
                    self.pipeline
                        .rules
                        .current()
                        .metrics
                        .outcome(handled.name(), request);
                    self.pipeline
                        .rollup
                        .count(self.pipeline.clock.now(), &handled);
                    log_handled(delivery, request, &handled);
                    self.settler.ack(delivery.delivery_tag);
                    return handled.name().as_str();
                }
                Err(e) => {
                    failures.count(&e, &self.pipeline.steps.names);
                    if let Some(trace) = &trace {
                        trace.failed(&e);
                    }
                    // Boxed: quarantining or yielding a slot is rare, and inline its state
                    // would make every delivery's task many kilobytes larger, copied whole
                    // when the task is spawned and when it completes.
                    let settled = Box::pin(self.after_failure(delivery, &claim, &failures));
                    if let Some(settled) = settled.await {
                        if let Some(trace) = &trace {
                            trace.settled(settled, &[]);
                        }
                        return settled;
                    }
                }
            }
        }
    }

    /// What follows a failed attempt: quarantine a message refused too often, yield the slot
    /// of one that has failed too long, else wait and retry; gives up (back to the queue) when
    /// the channel is gone or the worker stops. Returns what the delivery came to when it is
    /// settled or given up (`None`: retry it).
    async fn after_failure(
        &mut self,
        delivery: &Delivery,
        claim: &Claim,
        f: &Failures,
    ) -> Option<&'static str> {
        let (body, properties) = (&delivery.data, &delivery.properties);
        let message = self.request.as_ref().as_ref().ok();
        if outcome::after_failure(f.refused_in_a_row) == Next::Quarantine {
            let poison = f.poison();
            let quarantined = self
                .pipeline
                .quarantine(&self.publisher, message, body, properties, claim, &poison)
                .await;
            match quarantined {
                Ok(()) => return self.acked(delivery, traces::QUARANTINED),
                Err(q) => warn!(error = %q, "message not quarantined; retrying"),
            }
        }
        let wait = self.backoff.next();
        if f.failing_for() >= self.yield_slot_after {
            let yielded = self
                .pipeline
                .yield_slot(&self.publisher, message, body, properties, claim, wait)
                .await;
            match yielded {
                Ok(()) => return self.acked(delivery, traces::YIELDED),
                Err(y) => warn!(error = %y, "message could not yield its slot"),
            }
        }
        let retry_in_ms = wait.as_millis() as u64;
        match &f.unroutable_dispatch {
            // No sender's queue is bound: said once per routing key, with the remedy.
            Some(key) => {
                if !self
                    .unrouted
                    .first(key, &self.pipeline.steps.names.dispatch)
                {
                    debug!(error = %f.last, retry_in_ms, "message not dispatched");
                }
            }
            None => warn!(error = %f.last, retry_in_ms, "message not decided"),
        }
        if self.channels_lost() || sleep_or_stop(wait, &self.stop).await {
            // Given up without a dispatch: its copies need not wait out the lease.
            self.pipeline.abandon(message, claim).await;
            self.settler.requeue(delivery.delivery_tag);
            return Some(traces::REQUEUED);
        }
        None
    }

    /// Hands `delivery` to the settler to be acked; it is settled, having come to `outcome`.
    fn acked(&self, delivery: &Delivery, outcome: &'static str) -> Option<&'static str> {
        self.settler.ack(delivery.delivery_tag);
        Some(outcome)
    }
}

/// One delivery's failed attempts so far.
#[derive(Default)]
struct Failures {
    attempts: u32,
    refused_in_a_row: u32,
    first: Option<String>,
    last: String,
    since: Option<std::time::Instant>,
    /// The routing key of the last failure's dispatch when no queue was bound for it.
    unroutable_dispatch: Option<String>,
}

impl Failures {
    /// Counts a failed attempt.
    fn count(&mut self, e: &ActError, names: &Names) {
        self.attempts += 1;
        self.unroutable_dispatch = match e {
            ActError::Broker(BrokerError::Unroutable {
                exchange,
                routing_key,
            }) if *exchange == names.dispatch => Some(routing_key.clone()),
            _ => None,
        };
        self.last = e.to_string();
        self.first.get_or_insert_with(|| self.last.clone());
        self.since.get_or_insert_with(std::time::Instant::now);
        self.refused_in_a_row = match e.failure() {
            Failure::Refused => self.refused_in_a_row + 1,
            Failure::Transient => 0,
        };
    }

    /// How long the delivery has been failing.
    fn failing_for(&self) -> Duration {
        self.since.map_or(Duration::ZERO, |t| t.elapsed())
    }

    /// Why the delivery is quarantined, for its headers.
    fn poison(&self) -> Poison {
        Poison {
            reason: self.last.clone(),
            attempts: self.attempts,
            first_error: self.first.clone().unwrap_or_default(),
        }
    }
}

/// The routing keys for which a dispatch came back unroutable, no sender's queue being bound:
/// said once per key with the remedy, not once per message and retry, until a dispatch with
/// that key is routed again.
#[derive(Default)]
pub(super) struct Unrouted {
    keys: std::sync::Mutex<std::collections::HashSet<String>>,
    /// Whether `keys` has any: every dispatch asks, and the lock is taken only then.
    any: std::sync::atomic::AtomicBool,
}

impl Unrouted {
    /// Notes that a dispatch to `exchange` with `key` was unroutable; the first time for `key`,
    /// logs it with the remedy and returns true.
    fn first(&self, key: &str, exchange: &str) -> bool {
        let mut keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
        if keys.contains(key) {
            return false;
        }
        keys.insert(key.to_owned());
        self.any.store(true, std::sync::atomic::Ordering::Relaxed);
        warn!(
            exchange,
            routing_key = key,
            "no queue is bound to {exchange} for routing key \
            {key}: bind a sender's queue, or run `sendquota tail`; its dispatches wait until one \
            is bound"
        );
        true
    }

    /// Notes that a dispatch with `key` was routed: should it be unroutable again, it is said
    /// again.
    fn routed(&self, key: &str) {
        if !self.any.load(std::sync::atomic::Ordering::Relaxed) {
            return;
        }
        let mut keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
        if keys.remove(key) {
            info!(
                routing_key = key,
                "dispatches for routing key {key} are routed again"
            );
        }
        self.any
            .store(!keys.is_empty(), std::sync::atomic::Ordering::Relaxed);
    }
}

/// Logs what a delivery came to, under [`telemetry::DECISION_LOG`]: an invalid body at warn,
/// a decided request at debug (off by default; see there). Field values are only formatted,
/// and a recipient only hashed, when the line is written.
fn log_handled(delivery: &Delivery, request: Option<&SendRequest>, handled: &Handled) {
    let outcome = handled.name().as_str();
    let Some(request) = request else {
        let id = delivery
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.as_str());
        if let Handled::Invalid { reason } = handled {
            warn!(target: telemetry::DECISION_LOG, message_id = id, outcome, %reason,
                "invalid message");
        }
        return;
    };
    let rules = handled.rules();
    debug!(
        target: telemetry::DECISION_LOG,
        message_id = %request.id,
        recipient = %telemetry::recipient(&request.recipient),
        channel = %request.channel,
        category = %request.category,
        outcome,
        rule = (!rules.is_empty()).then(|| tracing::field::display(rules.join(","))),
        redelivered = delivery.redelivered,
        "decided"
    );
}
