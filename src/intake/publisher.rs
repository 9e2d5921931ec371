//! Publishing with publisher confirms: the channel every outcome is published on, and what
//! happens when the broker refuses a publish (unroutable, nacked, or a body over its
//! `max_message_size`, which closes the channel).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Instant;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{BasicProperties, Channel, Confirmation, Connection};
use tokio::sync::watch;

use crate::base::config::{AmqpSettings, QueueType};
use crate::intake::broker::{
    blocked_state, connect, declare, short, within, BrokerError, Names, REDECLARE_INTERVAL,
};
use crate::intake::confirms::InFlight;

/// A confirmed publisher on a new connection named `role`, for the operators' commands and the
/// console, with the topology declared (so nothing published before any worker ran is
/// unroutable) and declared again should a publish come back unroutable (the requests queue
/// deleted meanwhile). The caller closes the connection when done.
pub async fn open_publisher(
    settings: &AmqpSettings,
    names: &Names,
    role: &str,
) -> Result<(Connection, Publisher), BrokerError> {
    let connection = connect(settings, role).await?;
    let publisher = Publisher::open(&connection)
        .await?
        .healing(names.clone(), settings.queue_type);
    declare(&publisher.channel(), names, settings.queue_type).await?;
    Ok((connection, publisher))
}

/// The limit a broker's refusal names, `message size 217346 is larger than configured max
/// size 131072` (RabbitMQ's PRECONDITION_FAILED on a publish over `max_message_size`).
fn size_limit(error: &lapin::Error) -> Option<usize> {
    let lapin::ErrorKind::ProtocolError(amqp) = error.kind() else {
        return None;
    };
    let text = amqp.get_message().as_str();
    let (_, after) = text.split_once("max size ")?;
    let digits: String = after.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// A channel in confirm mode: every publish returns once the broker has taken responsibility
/// for the message (and, for mandatory publishes, routed it to a queue).
#[derive(Clone)]
pub struct Publisher {
    /// The channel publishes go to, shared by every clone: replaced by a new one on the same
    /// connection when the broker closes it over one message (see [`Publisher::reopening`]).
    /// Every publish's future holds a clone of the `Arc`, one increment rather than a clone of
    /// each of lapin's `Channel` parts.
    channel: Arc<RwLock<Arc<Channel>>>,
    /// The largest body the broker takes, learned from its first refusal (`usize::MAX` until
    /// then): a larger body is refused here, before it closes the channel for everyone.
    max_body: Arc<AtomicUsize>,
    /// The connection to open a channel again on; `None` for a publisher whose channel
    /// closing ends it.
    reopen: Option<Arc<Reopen>>,
    blocked: watch::Receiver<Option<String>>,
    /// Set when the session this publisher belongs to is over: publishes still waiting then
    /// fail at once instead of at their timeout (lapin may leave a confirm of a channel the
    /// broker closed unanswered), so their deliveries are given up and their claims released.
    ended: Arc<watch::Sender<bool>>,
    /// The task that polls this channel's publishes until they are confirmed.
    in_flight: InFlight,
    /// The topology this publisher declares again when a publish to it comes back unroutable;
    /// `None` for a publisher that leaves the topology alone.
    healer: Option<Arc<Healer>>,
}

/// What opening a publisher's channel again takes: its connection, and one reopening at a
/// time (every publish that saw the channel close asks for it).
struct Reopen {
    connection: Arc<Connection>,
    lock: tokio::sync::Mutex<()>,
    /// The address of the channel a refusal over a body's size closed, until it is replaced
    /// (0: none): that channel is opened again, any other the broker closes ends the session
    /// (a publish to a deleted exchange: the next session declares it again).
    refused: AtomicUsize,
}

/// Declares a namespace's topology again after a returned publish, at most once per
/// [`REDECLARE_INTERVAL`].
struct Healer {
    names: Names,
    queue_type: QueueType,
    /// When the last declaration after a return began.
    last: tokio::sync::Mutex<Option<Instant>>,
}

impl Healer {
    /// Declares the topology on `channel` unless that began less than [`REDECLARE_INTERVAL`]
    /// ago; a caller arriving while a declaration is under way waits for it to end.
    async fn declare_again(&self, channel: &Channel) -> Result<(), BrokerError> {
        let mut last = self.last.lock().await;
        if last.is_some_and(|at| at.elapsed() < REDECLARE_INTERVAL) {
            return Ok(());
        }
        *last = Some(Instant::now());
        tracing::warn!(namespace = %self.names.namespace,
            "a publish to a queue of the worker's was returned; declaring the topology again");
        declare(channel, &self.names, self.queue_type).await
    }
}

impl Publisher {
    /// Opens a channel on `connection` and switches it to confirm mode.
    pub async fn open(connection: &Connection) -> Result<Publisher, BrokerError> {
        let blocked = blocked_state(connection);
        let channel = confirming_channel(connection, &blocked).await?;
        let ended = watch::channel(false).0;
        let in_flight = InFlight::spawn(ended.subscribe());
        Ok(Publisher {
            channel: Arc::new(RwLock::new(Arc::new(channel))),
            max_body: Arc::new(AtomicUsize::new(usize::MAX)),
            reopen: None,
            blocked,
            ended: Arc::new(ended),
            in_flight,
            healer: None,
        })
    }

    /// A publisher on `connection` that opens its channel again when the broker closes it
    /// over one message's own fault (a body over its `max_message_size`): that message is
    /// refused ([`BrokerError::TooLarge`], as is every later one that large, before it is
    /// sent), the others on the channel at that moment fail once and are retried, and the
    /// session goes on instead of ending for everyone.
    pub async fn reopening(connection: Arc<Connection>) -> Result<Publisher, BrokerError> {
        let publisher = Publisher::open(&connection).await?;
        let reopen = Reopen {
            connection,
            lock: tokio::sync::Mutex::new(()),
            refused: AtomicUsize::new(0),
        };
        Ok(Publisher {
            reopen: Some(Arc::new(reopen)),
            ..publisher
        })
    }

    /// This publisher, declaring the topology of `names` again when a publish to one of its
    /// exchanges or queues ([`Names::owns`]) comes back unroutable, and then publishing once
    /// more: an exchange or queue an operator deleted comes back with the next message for
    /// it, instead of that message failing until a new session.
    pub fn healing(self, names: Names, queue_type: QueueType) -> Publisher {
        let healer = Healer {
            names,
            queue_type,
            last: tokio::sync::Mutex::new(None),
        };
        Publisher {
            healer: Some(Arc::new(healer)),
            ..self
        }
    }

    /// Fails every publish still waiting on this publisher, and every later one.
    pub fn end(&self) {
        self.ended.send_replace(true);
    }

    /// The underlying channel (for declarations).
    pub fn channel(&self) -> Arc<Channel> {
        // A panic while the lock was held cannot leave the `Arc` half-written.
        let current = self.channel.read().unwrap_or_else(|e| e.into_inner());
        current.clone()
    }

    /// Whether this publisher can still publish: its channel is open (or, for a reopening
    /// publisher, a refusal over a body's size closed it and it is being opened again on a
    /// connection still open) and the task that polls its publishes runs.
    pub fn can_publish(&self) -> bool {
        let channel = self.channel();
        let open = channel.status().connected()
            || self.reopen.as_ref().is_some_and(|reopen| {
                reopen.refused.load(Ordering::Relaxed) == address(&channel)
                    && reopen.connection.status().connected()
            });
        open && self.in_flight.running()
    }

    /// The largest body the broker takes, once a refusal has named it.
    pub fn max_body(&self) -> Option<usize> {
        Some(self.max_body.load(Ordering::Relaxed)).filter(|&limit| limit != usize::MAX)
    }

    /// Whether the broker blocks this publisher's connection, and why.
    pub fn blocked(&self) -> &watch::Receiver<Option<String>> {
        &self.blocked
    }

    /// Publishes persistently and waits for the broker's confirmation. The message must reach a
    /// queue: an unroutable message is an error, not a silent loss. A healing publisher (see
    /// [`Publisher::healing`]) first declares its topology again and publishes once more.
    pub async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        properties: BasicProperties,
    ) -> Result<(), BrokerError> {
        let healer = self
            .healer
            .as_ref()
            .filter(|h| h.names.owns(exchange, routing_key));
        let Some(healer) = healer else {
            return self
                .publish_once(exchange, routing_key, body, properties)
                .await;
        };
        let published = self
            .publish_once(exchange, routing_key, body, properties.clone())
            .await;
        match published {
            Err(BrokerError::Unroutable { .. }) => {
                healer.declare_again(&self.channel()).await?;
                self.publish_once(exchange, routing_key, body, properties)
                    .await
            }
            published => published,
        }
    }

    async fn publish_once(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        properties: BasicProperties,
    ) -> Result<(), BrokerError> {
        let options = BasicPublishOptions {
            mandatory: true,
            ..BasicPublishOptions::default()
        };
        let size = body.len();
        let (exchange_name, key) = (short(exchange)?, short(routing_key)?);
        let limit = self.max_body.load(Ordering::Relaxed);
        if body.len() > limit {
            let size = body.len();
            return Err(BrokerError::TooLarge { size, limit });
        }
        let sent_on = self.channel();
        let (channel, body) = (sent_on.clone(), body.to_vec());
        let properties = properties.with_delivery_mode(2);
        let publish = Box::pin(async move {
            channel
                .basic_publish(exchange_name, key, options, &body, properties)
                .await?
                .await
        });
        let outcome = self.in_flight.publish(publish);
        let confirmed = async {
            match outcome.await {
                Ok(confirmation) => Ok(confirmation?),
                // The session ended before the broker answered.
                Err(_) => Err(BrokerError::ChannelClosed("publishing")),
            }
        };
        // One timeout for the frames' write and the confirm: the write is queued at once
        // (a blocked connection does not count), so the wait is the confirm's, as before.
        let confirmation = match within("publish", &self.blocked, confirmed).await {
            Err(BrokerError::Amqp(e)) => return Err(self.after_error(e, &sent_on, size).await),
            confirmation => confirmation?,
        };
        match confirmation {
            Confirmation::Ack(None) | Confirmation::NotRequested => Ok(()),
            Confirmation::Ack(Some(_)) => Err(BrokerError::Unroutable {
                exchange: exchange.to_owned(),
                routing_key: routing_key.to_owned(),
            }),
            Confirmation::Nack(_) => Err(BrokerError::Nacked {
                exchange: exchange.to_owned(),
            }),
        }
    }

    /// What a publish of `size` bytes on `channel` that failed with `error` came to. A
    /// refusal over the body's size (the broker closes the channel for it, failing every
    /// publish waiting there) teaches the limit; the body over it is refused for good, the
    /// others fail as the channel did and are retried. A reopening publisher opens a channel
    /// again first, so that the retries find one; a channel the broker closed for another
    /// reason is left closed.
    async fn after_error(
        &self,
        error: lapin::Error,
        channel: &Arc<Channel>,
        size: usize,
    ) -> BrokerError {
        let limit = size_limit(&error);
        if let Some(limit) = limit {
            let before = self.max_body.fetch_min(limit, Ordering::Relaxed);
            if before > limit {
                tracing::warn!(
                    limit,
                    "rabbitmq refused a message over its max_message_size; \
                    larger bodies are refused before they are published"
                );
            }
            if let Some(reopen) = &self.reopen {
                reopen.refused.store(address(channel), Ordering::Relaxed);
            }
        }
        let refused = self
            .reopen
            .as_ref()
            .is_some_and(|reopen| reopen.refused.load(Ordering::Relaxed) == address(channel));
        if refused && !channel.status().connected() {
            self.reopen_after(channel).await;
        }
        match limit {
            Some(limit) if size > limit => BrokerError::TooLarge { size, limit },
            _ => BrokerError::Amqp(error),
        }
    }

    /// Opens the channel again after `closed`, which a refusal over a body's size closed,
    /// unless another publish has done it already. When that fails (the connection is going
    /// too), the session ends, as it would without reopening.
    async fn reopen_after(&self, closed: &Arc<Channel>) {
        let Some(reopen) = &self.reopen else { return };
        let _one_at_a_time = reopen.lock.lock().await;
        let current = self.channel();
        if !Arc::ptr_eq(&current, closed) && current.status().connected() {
            return;
        }
        match confirming_channel(&reopen.connection, &self.blocked).await {
            Ok(channel) => {
                *self.channel.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(channel);
                reopen.refused.store(0, Ordering::Relaxed);
                tracing::info!("the broker closed the publishing channel; opened another");
            }
            Err(e) => tracing::warn!(error = %e, "could not open the publishing channel again"),
        }
    }
}

/// A channel's identity while it is shared (its allocation's address).
fn address(channel: &Arc<Channel>) -> usize {
    Arc::as_ptr(channel) as usize
}

/// A channel on `connection` in confirm mode.
async fn confirming_channel(
    connection: &Connection,
    blocked: &watch::Receiver<Option<String>>,
) -> Result<Channel, BrokerError> {
    let channel = within("channel.open", blocked, connection.create_channel()).await?;
    within(
        "confirm.select",
        blocked,
        channel.confirm_select(ConfirmSelectOptions::default()),
    )
    .await?;
    Ok(channel)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_over_the_body_size_names_the_brokers_limit() {
        use lapin::protocol::{AMQPError, AMQPErrorKind, AMQPSoftError};
        let refusal = |text: &str| -> lapin::Error {
            let kind = AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED);
            lapin::ErrorKind::ProtocolError(AMQPError::new(kind, text.into())).into()
        };
        let size = "PRECONDITION_FAILED - message size 217346 is larger than configured max \
                    size 131072";
        assert_eq!(size_limit(&refusal(size)), Some(131_072));
        let other = "PRECONDITION_FAILED - invalid expiration 'x'";
        assert_eq!(size_limit(&refusal(other)), None);
    }
}
