//! The worker: owns broker sessions, deliveries, concurrency, retries and acks; the decision
//! is the pipeline's, and building the application is `startup`'s.
//!
//! It supervises its broker session itself: when the connection is lost it reconnects with
//! capped, jittered backoff, declares its topology again and resumes. Messages in flight on
//! the lost channel cannot be acked any more; the broker redelivers them, which is safe because
//! every step is idempotent by message id. When only the consumer is cancelled (an operator
//! deleted the requests queue) the channel lives on: the worker declares the queue again at
//! once and consumes it there, and the deliveries in flight finish beside and are acked on it.

use std::sync::Arc;
use std::time::Duration;

use futures_util::{FutureExt, StreamExt};
use lapin::message::Delivery;
use lapin::options::{BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection};
use tokio::sync::{watch, Semaphore};
use tracing::{debug, error, info, warn};

use crate::act::digest;
use crate::act::pipeline::Pipeline;
use crate::act::steps::{ActError, Poison};
use crate::base::config::Settings;
use crate::base::failpoint::{self, Failpoint};
use crate::base::health::Health;
use crate::base::telemetry;
use crate::base::traces;
use crate::decide::claim::Claim;
use crate::decide::outcome::{self, Failure, Handled, Next};
use crate::intake::acks::Settler;
use crate::intake::broker::{self, BrokerError, Names, Publisher};
use crate::intake::sequence::{Place, Sequence};
use crate::request::message::{InvalidMessage, SendRequest};

/// Keeps the worker taking deliveries until `stop` turns true: one broker session after
/// another, reconnecting with capped, jittered backoff after a loss. Returns the error of the
/// first session when no session ever started (the broker is unreachable at start: the caller
/// fails like it does for Redis and Postgres, so the orchestrator sees it).
pub async fn supervise(
    settings: &Settings,
    pipeline: &Arc<Pipeline>,
    health: &Health,
    failpoint: Option<Failpoint>,
    stop: watch::Receiver<bool>,
) -> Result<(), BrokerError> {
    let mut backoff = Backoff::new(&settings.worker);
    let mut stall = failpoint::armed(failpoint, Failpoint::StallConsumerOnce);
    let mut started = false;
    loop {
        let ended = session(
            settings,
            pipeline,
            health,
            std::mem::take(&mut stall),
            stop.clone(),
        )
        .await;
        started |= health.consuming();
        health.set_consuming(false);
        match ended {
            Ok(()) => return Ok(()),
            Err(e) if !started => return Err(e),
            Err(e) => {
                let wait = backoff.next();
                error!(error = %e, retry_in_ms = wait.as_millis() as u64, "broker session lost");
                if sleep_or_stop(wait, &stop).await {
                    return Ok(());
                }
            }
        }
    }
}

/// How often the session checks that its channels are still open: lapin reports a channel
/// the broker closed (a publish to a deleted exchange, say) only to the next call on it.
const CHANNEL_CHECK: Duration = Duration::from_secs(1);

/// One broker session's life: connect, declare, consume, process; ends on shutdown (Ok) or
/// loss. Deliveries arrive on one connection and outcomes are published on another, as
/// RabbitMQ advises: a resource alarm blocks publishing connections, and acks must not wait
/// behind it. While the publishing connection is blocked no new delivery is taken.
async fn session(
    settings: &Settings,
    pipeline: &Arc<Pipeline>,
    health: &Health,
    stall: bool,
    mut stop: watch::Receiver<bool>,
) -> Result<(), BrokerError> {
    let consuming = broker::connect(&settings.amqp, "sendquota-worker-consume").await?;
    let publishing = match broker::connect(&settings.amqp, "sendquota-worker-publish").await {
        Ok(c) => c,
        Err(e) => {
            close(&consuming).await;
            return Err(e);
        }
    };
    let result = consume(
        settings,
        pipeline,
        health,
        stall,
        &mut stop,
        &consuming,
        &publishing,
    )
    .await;
    health.set_blocked(None);
    close(&consuming).await;
    close(&publishing).await;
    result
}

async fn close(connection: &Connection) {
    let _ = tokio::time::timeout(
        broker::BROKER_TIMEOUT,
        connection.close(200, "worker stopping".into()),
    )
    .await;
}

async fn consume(
    settings: &Settings,
    pipeline: &Arc<Pipeline>,
    health: &Health,
    stall: bool,
    stop: &mut watch::Receiver<bool>,
    consuming: &Connection,
    publishing: &Connection,
) -> Result<(), BrokerError> {
    let publisher = Publisher::open(publishing)
        .await?
        .healing(pipeline.steps.names.clone(), settings.amqp.queue_type);
    let channel = broker::timed("channel.open", consuming.create_channel()).await?;
    let mut consumer = consume_requests(settings, &pipeline.steps.names, &channel).await?;
    // The session's flusher publishes on the session's publisher, so it lives as long.
    let (flusher_stop, flusher_stopped) = watch::channel(false);
    let flusher = tokio::spawn(digest::flush_until_stopped(
        pipeline.digests.clone(),
        publisher.clone(),
        flusher_stopped,
    ));
    health.set_consuming(true);
    let mut blocked = publisher.blocked().clone();
    health.set_blocked(blocked.borrow_and_update().clone());
    let slots = Arc::new(Semaphore::new(settings.worker.concurrency));
    // The most deliveries the session can have in flight: the broker hands over no more
    // until some are acked, and no task runs without a slot.
    let window = settings
        .worker
        .concurrency
        .min(usize::from(settings.amqp.prefetch));
    let sequence = Sequence::new();
    let unrouted = Arc::new(Unrouted::default());
    let tally = Arc::new(std::sync::Mutex::new(Tally::default()));
    let (settler, settling) = Settler::spawn(channel.clone());
    let mut watchdog =
        tokio::time::interval(Duration::from_millis(settings.worker.watchdog_interval_ms));
    watchdog.tick().await;
    let mut channel_check = tokio::time::interval(CHANNEL_CHECK);
    let mut delivered = false;
    let result = loop {
        let paused = blocked.borrow().is_some();
        tokio::select! {
            _ = stop.changed() => break Ok(()),
            _ = blocked.changed() => health.set_blocked(blocked.borrow_and_update().clone()),
            _ = channel_check.tick() => {
                if !channel.status().connected() {
                    break Err(BrokerError::ChannelClosed("consuming"));
                }
                if !publisher.can_publish() {
                    break Err(BrokerError::ChannelClosed("publishing"));
                }
            }
            _ = watchdog.tick() => {
                // Idle is fine when the broker blocks publishing, or when the deliveries in
                // flight fill the window: a window full of slow deliveries is no stall.
                let in_flight = settings.worker.concurrency - slots.available_permits();
                if !delivered && !paused && in_flight < window {
                    if let Err(e) = check_not_stalled(&channel, &pipeline.steps.names.requests).await {
                        break Err(e);
                    }
                }
                delivered = false;
            }
            next = consumer.next(), if !stall && !paused => match next {
                Some(Ok(delivery)) => {
                    delivered = true;
                    if delivery.redelivered {
                        metrics::counter!(telemetry::REDELIVERIES).increment(1);
                    }
                    // Decoded once, here: the recipient places it in line, and the decision
                    // reads the same request.
                    let request =
                        Box::new(SendRequest::decode(&delivery.data, pipeline.max_body_bytes));
                    // Here, where deliveries come in order, not on the delivery's task: tasks
                    // start in no particular order.
                    let recipient = request.as_ref().as_ref().ok().map(|m| m.recipient.as_str());
                    let place = sequence.join(recipient);
                    let Ok(slot) = slots.clone().acquire_owned().await else { break Ok(()) };
                    let task = Task {
                        pipeline: pipeline.clone(),
                        publisher: publisher.clone(),
                        consuming: channel.clone(),
                        settler: settler.clone(),
                        backoff: Backoff::new(&settings.worker),
                        yield_slot_after: Duration::from_millis(settings.worker.yield_slot_after_ms),
                        stop: stop.clone(),
                        place,
                        request,
                        unrouted: unrouted.clone(),
                    };
                    task.spawn(delivery, slot, tally.clone());
                }
                Some(Err(e)) => break Err(e.into()),
                None => {
                    health.set_consuming(false);
                    match consume_again(settings, &pipeline.steps.names, &channel).await {
                        Ok(again) => consumer = again,
                        Err(e) => break Err(e),
                    }
                    health.set_consuming(true);
                }
            },
        }
    };
    // Deliveries the broker handed over that no task took: they go back when the channel
    // closes.
    let mut untaken = 0;
    while let Some(Some(Ok(_))) = consumer.next().now_or_never() {
        untaken += 1;
    }
    drop(consumer);
    // A flush under way finishes (its digest sent and marked, or left to the next one).
    let _ = flusher_stop.send(true);
    let shutdown = Duration::from_millis(settings.worker.shutdown_timeout_ms);
    if tokio::time::timeout(shutdown, flusher).await.is_err() {
        warn!("the digest flush did not finish in the shutdown timeout; the next one resumes it");
    }
    if result.is_err() {
        // The session is lost: publishes still waiting on it will not be confirmed.
        publisher.end();
    }
    let at_stop = Tally::now(&tally);
    let after = drain(settings, &slots, &tally, settler, settling).await;
    if result.is_ok() {
        let drained = after.acked - at_stop.acked;
        let returned = after.requeued - at_stop.requeued + after.running + untaken;
        info!(
            drained,
            returned,
            "stopped: the deliveries in flight drained (finished and acked) or returned to the \
             queue unacked"
        );
    }
    result
}

/// The session's deliveries as their tasks start and end: what a stopping worker says it
/// drained and returned. Counted under one lock, so a delivery is always in exactly one of the
/// three.
#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    /// Tasks still working on their delivery.
    running: usize,
    /// Deliveries handed to the settler to be acked (an outcome, a quarantine, a yield).
    acked: usize,
    /// Deliveries given up and handed back to the queue.
    requeued: usize,
}

impl Tally {
    /// The counts now.
    fn now(tally: &std::sync::Mutex<Tally>) -> Tally {
        *tally.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Declares the topology on `channel` and starts consuming the requests queue there with the
/// configured prefetch.
async fn consume_requests(
    settings: &Settings,
    names: &Names,
    channel: &Channel,
) -> Result<lapin::Consumer, BrokerError> {
    broker::declare(channel, names, settings.amqp.queue_type).await?;
    broker::timed(
        "basic.qos",
        channel.basic_qos(settings.amqp.prefetch, BasicQosOptions::default()),
    )
    .await?;
    let consumer = broker::timed(
        "basic.consume",
        channel.basic_consume(
            broker::short(&names.requests)?,
            "sendquota-worker".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        ),
    )
    .await?;
    info!(queue = %names.requests, "consuming");
    Ok(consumer)
}

/// After the consumer ended while its channel is still open (the broker cancels a consumer
/// whose queue was deleted, and the messages waiting there went with it): declares the queue
/// again and consumes it on the same channel, at once, so producers' messages have a queue
/// again. The deliveries already taken finish beside the new consumer and are acked on this
/// channel, the only one they can be acked on; their slots and the settler are the session's.
/// Fails with [`BrokerError::ConsumerEnded`] when the channel is gone too: the session is lost.
async fn consume_again(
    settings: &Settings,
    names: &Names,
    channel: &Channel,
) -> Result<lapin::Consumer, BrokerError> {
    if !channel.status().connected() {
        return Err(BrokerError::ConsumerEnded);
    }
    warn!(queue = %names.requests, "the broker cancelled the consumer (was the queue deleted?); \
        declaring it again while the deliveries in flight finish");
    consume_requests(settings, names, channel).await
}

/// The watchdog's check, for a consumer that received nothing for an interval while it had
/// free slots and the broker did not block it: messages ready in `queue` mean it stopped
/// without telling us. (A stalled consumer holding all waiting messages within its prefetch
/// shows no ready ones; its backlog is noticed as soon as more arrive.)
async fn check_not_stalled(channel: &Channel, queue: &str) -> Result<(), BrokerError> {
    match broker::ready_count(channel, queue).await? {
        0 => Ok(()),
        ready => Err(BrokerError::Stalled { ready }),
    }
}

/// Lets the deliveries in flight finish (up to the shutdown timeout) and sends the acks still
/// owed; what does not make it returns to the queue unacked. Returns the session's counts as
/// the settler stopped taking reports: a task still running then is returned.
async fn drain(
    settings: &Settings,
    slots: &Semaphore,
    tally: &std::sync::Mutex<Tally>,
    settler: Settler,
    settling: tokio::task::JoinHandle<()>,
) -> Tally {
    let drained = tokio::time::timeout(
        Duration::from_millis(settings.worker.shutdown_timeout_ms),
        slots.acquire_many(settings.worker.concurrency as u32),
    )
    .await;
    if drained.is_err() {
        warn!("in-flight messages did not finish in time; they return to the queue unacked");
    }
    let settled = Tally::now(tally);
    settler.finish();
    if tokio::time::timeout(broker::BROKER_TIMEOUT, settling)
        .await
        .is_err()
    {
        warn!("acks still owed could not be sent in time; the broker redelivers");
    }
    settled
}

/// One delivery being processed, with what it needs to retry.
struct Task {
    pipeline: Arc<Pipeline>,
    publisher: Publisher,
    /// The channel the delivery came on: it can only be acked there.
    consuming: Channel,
    settler: Settler,
    backoff: Backoff,
    /// How long the delivery may keep failing before it yields its slot.
    yield_slot_after: Duration,
    stop: watch::Receiver<bool>,
    /// Its place in its recipient's line, taken in delivery order.
    place: Place,
    /// Its body decoded, or why it is not a request. Boxed: the task's future is moved whole
    /// when it is spawned.
    request: Box<Result<SendRequest, InvalidMessage>>,
    /// The routing keys whose dispatches are unroutable, said once each.
    unrouted: Arc<Unrouted>,
}

impl Task {
    /// Processes `delivery` on its own task, holding `slot` until it is done, counted in
    /// `tally`.
    fn spawn(
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
struct Unrouted {
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

/// Waits `wait`, or less if the worker is told to stop; returns whether it is stopping.
async fn sleep_or_stop(wait: Duration, stop: &watch::Receiver<bool>) -> bool {
    let mut stop = stop.clone();
    if *stop.borrow() {
        return true;
    }
    tokio::select! {
        _ = tokio::time::sleep(wait) => *stop.borrow(),
        _ = stop.changed() => true,
    }
}

/// Capped exponential backoff with jitter, so many workers do not retry in lockstep.
struct Backoff {
    next_ms: u64,
    max_ms: u64,
}

impl Backoff {
    fn new(worker: &crate::base::config::WorkerSettings) -> Backoff {
        Backoff {
            next_ms: worker.retry_initial_ms,
            max_ms: worker.retry_max_ms,
        }
    }

    fn next(&mut self) -> Duration {
        let base = self.next_ms;
        self.next_ms = (self.next_ms * 2).min(self.max_ms);
        // Jitter up to a quarter of the delay, from the clock's low bits: no need for a RNG.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| u64::from(d.subsec_nanos()))
            .unwrap_or(0);
        Duration::from_millis(base + nanos % (base / 4 + 1))
    }
}
