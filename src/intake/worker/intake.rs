//! What a session takes deliveries from: the one requests queue, or (`intake.shards > 1`)
//! every shard's queue, one consumer each on the session's channel.
//!
//! With shards, messages left in the one requests queue from before (it is unbound when the
//! shards are declared) are taken first: the shards are consumed only once that queue is
//! empty and every delivery from it is in the worker's hands, so a recipient's older message
//! there is placed in line before its newer ones in a shard (docs/operations.md, "Moving from
//! 1 to N shards").

use std::pin::Pin;
use std::time::Duration;

use futures_util::stream::{self, SelectAll};
use futures_util::{FutureExt, Stream, StreamExt};
use lapin::message::Delivery;
use lapin::options::{BasicCancelOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::Channel;
use tracing::info;

use crate::base::config::Settings;
use crate::intake::broker::{self, BrokerError, Names};
use crate::intake::shards;

/// How often a worker draining the one requests queue asks whether it is empty.
const DRAIN_CHECK: Duration = Duration::from_millis(200);

/// The consumer tag of the one requests queue's consumer.
const TAG: &str = "sendquota-worker";

/// One shard's deliveries, then `None` once its consumer ended, named by its queue.
type Shard = Pin<Box<dyn Stream<Item = (String, Option<lapin::Result<Delivery>>)> + Send>>;

/// What the session's consumers gave next. Returned by value once per delivery and taken
/// apart at once: boxing the delivery would cost an allocation per message to save a copy.
#[allow(clippy::large_enum_variant)]
pub(super) enum Next {
    /// A delivery to take.
    Delivery(Delivery),
    /// The channel failed.
    Failed(lapin::Error),
    /// The consumer of this queue ended while the channel may be open (the broker cancels a
    /// consumer whose queue was deleted).
    Ended(String),
}

/// The session's consumers.
pub(super) enum Intake {
    /// The one requests queue (`intake.shards = 1`): as before shards existed.
    One(lapin::Consumer),
    /// The one requests queue still holds messages from before the shards: taken first.
    Draining(lapin::Consumer, tokio::time::Interval, bool),
    /// Every shard's queue.
    Shards(SelectAll<Shard>),
}

impl Intake {
    /// Declares the topology on `channel` and starts consuming: the one requests queue with
    /// the configured prefetch, or, sharded, what is left in it first and then the shards.
    pub(super) async fn start(
        settings: &Settings,
        names: &Names,
        channel: &Channel,
    ) -> Result<Intake, BrokerError> {
        broker::declare(channel, names, settings.amqp.queue_type).await?;
        if names.shards <= 1 {
            qos(channel, settings.amqp.prefetch).await?;
            return Ok(Intake::One(consume(channel, &names.requests, TAG).await?));
        }
        qos(
            channel,
            shards::prefetch_per_shard(settings.amqp.prefetch, names.shards),
        )
        .await?;
        if broker::ready_count(channel, &names.requests).await? > 0 {
            info!(queue = %names.requests, "taking what is left in the unsharded queue first");
            let old = consume(channel, &names.requests, TAG).await?;
            let check = tokio::time::interval(DRAIN_CHECK);
            return Ok(Intake::Draining(old, check, false));
        }
        consume_shards(names, channel).await
    }

    /// Whether the watchdog can tell a stalled consumer by ready messages in its queue: not
    /// with shards, where a worker standing by (single-active-consumer) sees the messages the
    /// active one has not taken yet, and AMQP does not say which consumer is active.
    pub(super) fn watchable(&self) -> bool {
        !matches!(self, Intake::Shards(_))
    }

    /// Deliveries the broker handed over that no task took, counted as the session ends: they
    /// go back to their queue when the channel closes.
    pub(super) fn untaken(&mut self) -> usize {
        let mut untaken = 0;
        match self {
            Intake::One(consumer) | Intake::Draining(consumer, ..) => {
                while let Some(Some(Ok(_))) = consumer.next().now_or_never() {
                    untaken += 1;
                }
            }
            Intake::Shards(all) => {
                while let Some(Some((_, Some(Ok(_))))) = all.next().now_or_never() {
                    untaken += 1;
                }
            }
        }
        untaken
    }

    /// The next delivery, or why none comes. While draining, it switches to the shards once
    /// the one requests queue is empty and its consumer, cancelled, gave its last delivery.
    pub(super) async fn next(&mut self, names: &Names, channel: &Channel) -> Next {
        loop {
            match self {
                Intake::One(consumer) => return from(consumer.next().await, &names.requests),
                Intake::Shards(all) => match all.next().await {
                    Some((_, Some(Ok(delivery)))) => return Next::Delivery(delivery),
                    Some((_, Some(Err(e)))) => return Next::Failed(e),
                    Some((queue, None)) => return Next::Ended(queue),
                    None => return Next::Ended(names.requests.clone()),
                },
                Intake::Draining(old, check, cancelled) => {
                    tokio::select! {
                        next = old.next() => match next {
                            None if *cancelled => {}
                            next => return from(next, &names.requests),
                        },
                        _ = check.tick(), if !*cancelled => {
                            match cancel_when_empty(old, names, channel).await {
                                Ok(done) => *cancelled = done,
                                Err(BrokerError::Amqp(e)) => return Next::Failed(e),
                                Err(_) => continue,
                            }
                            continue;
                        }
                    }
                }
            }
            // The drained queue's consumer ended after its cancel: on to the shards.
            *self = match consume_shards(names, channel).await {
                Ok(shards) => shards,
                Err(_) => return Next::Ended(names.requests.clone()),
            };
        }
    }
}

/// A lapin consumer's next item as [`Next`].
fn from(next: Option<lapin::Result<Delivery>>, queue: &str) -> Next {
    match next {
        Some(Ok(delivery)) => Next::Delivery(delivery),
        Some(Err(e)) => Next::Failed(e),
        None => Next::Ended(queue.to_owned()),
    }
}

/// Cancels the consumer of the one requests queue once that queue has no message ready (its
/// consumer then gives what it holds and ends); whether it did.
async fn cancel_when_empty(
    old: &lapin::Consumer,
    names: &Names,
    channel: &Channel,
) -> Result<bool, BrokerError> {
    if broker::ready_count(channel, &names.requests).await? > 0 {
        return Ok(false);
    }
    broker::timed(
        "basic.cancel",
        channel.basic_cancel(old.tag(), BasicCancelOptions::default()),
    )
    .await?;
    info!(queue = %names.requests, "the unsharded queue is drained; consuming the shards");
    Ok(true)
}

/// Consumes every shard's queue on `channel`, each with a tag of its own.
async fn consume_shards(names: &Names, channel: &Channel) -> Result<Intake, BrokerError> {
    let mut all = SelectAll::new();
    for queue in names.intake_queues() {
        all.push(consume_shard(channel, &queue).await?);
    }
    info!(
        shards = names.shards,
        "consuming every shard (single active consumer each)"
    );
    Ok(Intake::Shards(all))
}

/// Consumes one shard's queue, as a stream that ends with `None` when its consumer does.
async fn consume_shard(channel: &Channel, queue: &str) -> Result<Shard, BrokerError> {
    let consumer = consume(channel, queue, &format!("{TAG}.{queue}")).await?;
    let name = queue.to_owned();
    let ended = name.clone();
    Ok(Box::pin(
        consumer
            .map(move |next| (name.clone(), Some(next)))
            .chain(stream::once(async move { (ended, None) })),
    ))
}

/// After the consumer of `queue` ended on an open channel (its queue deleted): declares the
/// topology again and consumes that queue again beside the others.
pub(super) async fn consume_again(
    intake: &mut Intake,
    settings: &Settings,
    names: &Names,
    channel: &Channel,
    queue: &str,
) -> Result<(), BrokerError> {
    match intake {
        Intake::Shards(all) => {
            broker::declare(channel, names, settings.amqp.queue_type).await?;
            all.push(consume_shard(channel, queue).await?);
        }
        _ => *intake = Intake::start(settings, names, channel).await?,
    }
    Ok(())
}

async fn qos(channel: &Channel, prefetch: u16) -> Result<(), BrokerError> {
    broker::timed(
        "basic.qos",
        channel.basic_qos(prefetch, BasicQosOptions::default()),
    )
    .await
}

async fn consume(
    channel: &Channel,
    queue: &str,
    tag: &str,
) -> Result<lapin::Consumer, BrokerError> {
    let consumer = broker::timed(
        "basic.consume",
        channel.basic_consume(
            broker::short(queue)?,
            broker::short(tag)?,
            BasicConsumeOptions::default(),
            FieldTable::default(),
        ),
    )
    .await?;
    info!(%queue, "consuming");
    Ok(consumer)
}
