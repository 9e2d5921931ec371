//! The worker: owns broker sessions, deliveries, concurrency, retries and acks; the decision
//! is the pipeline's, and building the application is `startup`'s.
//!
//! It supervises its broker session itself: when the connection is lost it reconnects with
//! capped, jittered backoff, declares its topology again and resumes. Messages in flight on
//! the lost channel cannot be acked any more; the broker redelivers them, which is safe because
//! every step is idempotent by message id. When only the consumer is cancelled (an operator
//! deleted the requests queue) the channel lives on: the worker declares the queue again at
//! once and consumes it there, and the deliveries in flight finish beside and are acked on it.
//! Each delivery is processed by a task of its own (`task`).

mod intake;
mod task;

use std::sync::Arc;
use std::time::Duration;

use lapin::message::Delivery;
use lapin::{Channel, Connection};
use tokio::sync::{watch, Semaphore};
use tracing::{error, info, warn};

use crate::act::digest;
use crate::act::pipeline::Pipeline;
use crate::base::config::Settings;
use crate::base::failpoint::{self, Failpoint};
use crate::base::health::Health;
use crate::base::telemetry;
use crate::intake::acks::Settler;
use crate::intake::broker::{self, BrokerError, Names};
use crate::intake::nodes;
use crate::intake::publisher::Publisher;
use crate::intake::sequence::Sequence;
use crate::request::message::SendRequest;
use intake::{Intake, Next};
use task::{Task, Unrouted};

/// Keeps the worker taking deliveries until `stop` turns true: one broker session after
/// another, reconnecting with capped, jittered backoff after a loss. A session that had been
/// consuming for a while is followed at once by a new round over the nodes (`amqp.urls`),
/// starting after the node it was on: another node of a cluster takes over within the
/// connect time; the backoff applies when a whole round failed. Returns the error of the
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
        let began = std::time::Instant::now();
        let ended = session(
            settings,
            pipeline,
            health,
            std::mem::take(&mut stall),
            stop.clone(),
        )
        .await;
        let consumed = health.consuming();
        started |= consumed;
        health.set_consuming(false);
        match ended {
            Ok(()) => return Ok(()),
            Err(e) if !started => return Err(e),
            Err(e) => {
                // A session that lived is a node lost, not a broker refusing again and again.
                let wait = if consumed && began.elapsed() >= LIVED {
                    backoff = Backoff::new(&settings.worker);
                    Duration::ZERO
                } else {
                    backoff.next()
                };
                error!(error = %e, retry_in_ms = wait.as_millis() as u64, "broker session lost");
                if sleep_or_stop(wait, &stop).await {
                    return Ok(());
                }
            }
        }
    }
}

/// How long a session must have lived for its loss to be followed by a new round at once
/// rather than after the backoff: a session that keeps failing as soon as it starts backs off.
const LIVED: Duration = Duration::from_secs(1);

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
    let node = nodes::preferred();
    let publishing = match broker::connect(&settings.amqp, "sendquota-worker-publish").await {
        Ok(c) => Arc::new(c),
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
    if result.is_err() {
        nodes::move_on(node);
        // Closing waits for the node's answer: a hung node must not hold the next round.
        tokio::spawn(async move {
            close(&consuming).await;
            close(&publishing).await;
        });
        return result;
    }
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

/// A session's consumer and publisher on `consuming` and `publishing`: the digest flusher
/// beside the deliveries, then, once `stop` turns or the session is lost, the flusher stopped
/// and the deliveries in flight drained.
async fn consume(
    settings: &Settings,
    pipeline: &Arc<Pipeline>,
    health: &Health,
    stall: bool,
    stop: &mut watch::Receiver<bool>,
    consuming: &Connection,
    publishing: &Arc<Connection>,
) -> Result<(), BrokerError> {
    let publisher = Publisher::reopening(publishing.clone())
        .await?
        .healing(pipeline.steps.names.clone(), settings.amqp.queue_type);
    let channel = broker::timed("channel.open", consuming.create_channel()).await?;
    let mut consumer = Intake::start(settings, &pipeline.steps.names, &channel).await?;
    // The session's flusher publishes on the session's publisher, so it lives as long.
    let (flusher_stop, flusher_stopped) = watch::channel(false);
    let flusher = tokio::spawn(digest::flush_until_stopped(
        pipeline.digests.clone(),
        publisher.clone(),
        flusher_stopped,
    ));
    health.set_consuming(true);
    let (settler, settling) = Settler::spawn(channel.clone());
    let deliveries = Deliveries::new(settings, pipeline, publisher, channel, settler);
    let result = deliveries.receive(&mut consumer, health, stall, stop).await;
    // Deliveries the broker handed over that no task took: they go back when the channel
    // closes.
    let untaken = consumer.untaken();
    drop(consumer);
    // A flush under way finishes (its digest sent and marked, or left to the next one).
    let _ = flusher_stop.send(true);
    let shutdown = Duration::from_millis(settings.worker.shutdown_timeout_ms);
    if tokio::time::timeout(shutdown, flusher).await.is_err() {
        warn!("the digest flush did not finish in the shutdown timeout; the next one resumes it");
    }
    if result.is_err() {
        // The session is lost: publishes still waiting on it will not be confirmed.
        deliveries.publisher.end();
    }
    deliveries.drain(settling, result.is_ok(), untaken).await;
    result
}

/// A session's deliveries: what each one's task is spawned with, the slots they take, and
/// how they are counted.
struct Deliveries<'s> {
    settings: &'s Settings,
    pipeline: &'s Arc<Pipeline>,
    publisher: Publisher,
    /// The channel deliveries come on, and are acked on.
    channel: Channel,
    slots: Arc<Semaphore>,
    /// The most deliveries the session can have in flight: the broker hands over no more
    /// until some are acked, and no task runs without a slot.
    window: usize,
    sequence: Arc<Sequence>,
    unrouted: Arc<Unrouted>,
    tally: Arc<std::sync::Mutex<Tally>>,
    settler: Settler,
}

impl<'s> Deliveries<'s> {
    fn new(
        settings: &'s Settings,
        pipeline: &'s Arc<Pipeline>,
        publisher: Publisher,
        channel: Channel,
        settler: Settler,
    ) -> Deliveries<'s> {
        Deliveries {
            settings,
            pipeline,
            publisher,
            channel,
            slots: Arc::new(Semaphore::new(settings.worker.concurrency)),
            window: settings
                .worker
                .concurrency
                .min(usize::from(settings.amqp.prefetch)),
            sequence: Sequence::new(),
            unrouted: Arc::new(Unrouted::default()),
            tally: Arc::new(std::sync::Mutex::new(Tally::default())),
            settler,
        }
    }

    /// Takes deliveries from `consumer` until `stop` turns (Ok) or the session is lost: none
    /// while the broker blocks publishing (or `stall`, a crash test's stalled consumer), the
    /// channels checked every [`CHANNEL_CHECK`] and the consumer every watchdog interval, and
    /// the requests queue consumed again when the broker cancels the consumer.
    async fn receive(
        &self,
        consumer: &mut Intake,
        health: &Health,
        stall: bool,
        stop: &mut watch::Receiver<bool>,
    ) -> Result<(), BrokerError> {
        let mut blocked = self.publisher.blocked().clone();
        health.set_blocked(blocked.borrow_and_update().clone());
        let mut watchdog = tokio::time::interval(Duration::from_millis(
            self.settings.worker.watchdog_interval_ms,
        ));
        watchdog.tick().await;
        let mut channel_check = tokio::time::interval(CHANNEL_CHECK);
        let names = &self.pipeline.steps.names;
        let mut delivered = false;
        let mut publisher_down = false;
        loop {
            let paused = blocked.borrow().is_some();
            tokio::select! {
                _ = stop.changed() => return Ok(()),
                _ = blocked.changed() => health.set_blocked(blocked.borrow_and_update().clone()),
                _ = channel_check.tick() => self.check_channels(&mut publisher_down)?,
                _ = watchdog.tick() => {
                    // Idle is fine when the broker blocks publishing.
                    if !std::mem::take(&mut delivered) && !paused && consumer.watchable() {
                        self.check_not_idle().await?;
                    }
                }
                next = consumer.next(names, &self.channel), if !stall && !paused => match next {
                    Next::Delivery(delivery) => {
                        delivered = true;
                        if !self.take(delivery, stop).await {
                            return Ok(());
                        }
                    }
                    Next::Failed(e) => return Err(e.into()),
                    Next::Ended(queue) => {
                        health.set_consuming(false);
                        consume_again(consumer, self.settings, names, &self.channel, &queue).await?;
                        health.set_consuming(true);
                    }
                },
            }
        }
    }

    /// Fails when a channel is closed: lapin reports a channel the broker closed only to the
    /// next call on it. The publisher must be down on two checks in a row (`was_down` holds
    /// the last): a channel the broker closed over one message's size is being opened again
    /// (see `Publisher::reopening`).
    fn check_channels(&self, was_down: &mut bool) -> Result<(), BrokerError> {
        if !self.channel.status().connected() {
            return Err(BrokerError::ChannelClosed("consuming"));
        }
        let down = !self.publisher.can_publish();
        let was = std::mem::replace(was_down, down);
        if down && was {
            return Err(BrokerError::ChannelClosed("publishing"));
        }
        Ok(())
    }

    /// The watchdog's check of a consumer that received nothing for an interval, unless the
    /// deliveries in flight fill the window: a window full of slow deliveries is no stall.
    async fn check_not_idle(&self) -> Result<(), BrokerError> {
        let in_flight = self.settings.worker.concurrency - self.slots.available_permits();
        if in_flight < self.window {
            check_not_stalled(&self.channel, &self.pipeline.steps.names.requests).await?;
        }
        Ok(())
    }

    /// Decodes `delivery` once, places it in its recipient's line and processes it on a task
    /// of its own once a slot is free; false when the slots are closed.
    async fn take(&self, delivery: Delivery, stop: &watch::Receiver<bool>) -> bool {
        if delivery.redelivered {
            metrics::counter!(telemetry::REDELIVERIES).increment(1);
        }
        // Decoded once, here: the recipient places it in line, and the decision reads the
        // same request.
        let request = Box::new(SendRequest::decode(
            &delivery.data,
            self.pipeline.max_body_bytes,
        ));
        // Here, where deliveries come in order, not on the delivery's task: tasks start in no
        // particular order.
        let recipient = request.as_ref().as_ref().ok().map(|m| m.recipient.as_str());
        let place = self.sequence.join(recipient);
        let Ok(slot) = self.slots.clone().acquire_owned().await else {
            return false;
        };
        let task = Task {
            pipeline: self.pipeline.clone(),
            publisher: self.publisher.clone(),
            consuming: self.channel.clone(),
            settler: self.settler.clone(),
            backoff: Backoff::new(&self.settings.worker),
            yield_slot_after: Duration::from_millis(self.settings.worker.yield_slot_after_ms),
            stop: stop.clone(),
            place,
            request,
            unrouted: self.unrouted.clone(),
        };
        task.spawn(delivery, slot, self.tally.clone());
        true
    }

    /// Lets the deliveries in flight finish or return to the queue (see [`drain`]); when the
    /// session `stopped` (rather than being lost), says how many of each, counting the
    /// `untaken` deliveries no task took as returned.
    async fn drain(self, settling: tokio::task::JoinHandle<()>, stopped: bool, untaken: usize) {
        let at_stop = Tally::now(&self.tally);
        let after = drain(
            self.settings,
            &self.slots,
            &self.tally,
            self.settler,
            settling,
        )
        .await;
        if stopped {
            let drained = after.acked - at_stop.acked;
            let returned = after.requeued - at_stop.requeued + after.running + untaken;
            info!(
                drained,
                returned,
                "stopped: the deliveries in flight drained (finished and acked) or returned to the \
                 queue unacked"
            );
        }
    }
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

/// After the consumer of `queue` ended while its channel is still open (the broker cancels a
/// consumer whose queue was deleted, and the messages waiting there went with it): declares the
/// queue again and consumes it on the same channel, at once, so producers' messages have a
/// queue again. The deliveries already taken finish beside the new consumer and are acked on
/// this channel, the only one they can be acked on; their slots and the settler are the
/// session's. Fails with [`BrokerError::ConsumerEnded`] when the channel is gone too: the
/// session is lost.
async fn consume_again(
    consumer: &mut Intake,
    settings: &Settings,
    names: &Names,
    channel: &Channel,
    queue: &str,
) -> Result<(), BrokerError> {
    if !channel.status().connected() {
        return Err(BrokerError::ConsumerEnded);
    }
    warn!(%queue, "the broker cancelled the consumer (was the queue deleted?); \
        declaring it again while the deliveries in flight finish");
    intake::consume_again(consumer, settings, names, channel, queue).await
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
