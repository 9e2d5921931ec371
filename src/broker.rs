//! RabbitMQ: connection, topology and publisher-confirmed publishing.
//!
//! Topology (every name prefixed by the namespace):
//! - exchange `<ns>.requests` (fanout) -> queue `<ns>.requests`: what producers send;
//! - exchange `<ns>.dispatch` (topic, routing key = channel): allowed messages, for the senders;
//! - queue `<ns>.invalid`: bodies that are not valid requests, with the reason in a header;
//! - queues `<ns>.delay.<ms>`: delayed messages wait there for a fixed TTL and are
//!   dead-lettered back to `<ns>.requests`.
//!
//! Declarations are idempotent, so every worker declares everything at start.

use chrono::{DateTime, Utc};

use crate::amqp::{
    AMQPValue, AmqpError, BasicProperties, Channel, Confirmation, Connection, FieldTable,
    LongString, ShortString,
};
use crate::config::QueueType;

/// Header naming why a message was sent to the invalid queue.
pub const REASON_HEADER: &str = "x-sendquota-reason";
/// Header naming the denial a replayed message comes from.
pub const REPLAY_OF_HEADER: &str = "x-sendquota-replay-of";
/// Header carrying the instant a delayed message waits for.
pub const DELAYED_UNTIL_HEADER: &str = "x-sendquota-delayed-until";

/// Delay queue TTLs in milliseconds. A message waiting W goes to the longest tier not above W
/// and comes back to be decided again, so it overshoots by at most the shortest tier.
pub const DELAY_TIERS_MS: [i64; 8] = [
    1_000, 5_000, 30_000, 120_000, 600_000, 3_600_000, 21_600_000, 86_400_000,
];

/// Longest wait for the broker to accept a connection, a declaration or a publish confirm:
/// past it the operation is treated as failed and retried, so a stuck broker cannot stall a
/// message forever.
pub const BROKER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Broker failures: the message must be retried.
#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    /// The connection or channel failed.
    #[error("rabbitmq: {0}")]
    Amqp(#[from] AmqpError),
    /// The broker refused the message (publisher confirm nack).
    #[error("rabbitmq refused the message published to {exchange:?}")]
    Nacked {
        /// The exchange published to.
        exchange: String,
    },
    /// No queue is bound for the routing key, so the message would be lost.
    #[error("no queue is bound to exchange {exchange:?} for routing key {routing_key:?}")]
    Unroutable {
        /// The exchange published to.
        exchange: String,
        /// The routing key.
        routing_key: String,
    },
    /// The broker did not answer within [`BROKER_TIMEOUT`].
    #[error("rabbitmq did not answer within {BROKER_TIMEOUT:?} ({0})")]
    Timeout(&'static str),
    /// The consumer received nothing for a watchdog interval while messages were waiting.
    #[error("consumer stalled: {ready} messages ready but none delivered; restarting it")]
    Stalled {
        /// Messages waiting in the requests queue.
        ready: u32,
    },
}

/// The exchange and queue names of one namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Names {
    /// Exchange and queue producers publish requests to.
    pub requests: String,
    /// Exchange allowed messages are published to.
    pub dispatch: String,
    /// Queue for invalid messages.
    pub invalid: String,
    namespace: String,
}

impl Names {
    /// The names for `namespace`.
    pub fn new(namespace: &str) -> Names {
        Names {
            requests: format!("{namespace}.requests"),
            dispatch: format!("{namespace}.dispatch"),
            invalid: format!("{namespace}.invalid"),
            namespace: namespace.to_owned(),
        }
    }

    /// The delay queue holding messages for `ttl_ms`.
    pub fn delay_queue(&self, ttl_ms: i64) -> String {
        format!("{}.delay.{ttl_ms}", self.namespace)
    }
}

/// Opens a connection named after the process role.
pub async fn connect(url: &str, name: &str) -> Result<Connection, BrokerError> {
    tokio::time::timeout(BROKER_TIMEOUT, Connection::connect(url, name))
        .await
        .map_err(|_| BrokerError::Timeout("connect"))?
        .map_err(BrokerError::from)
}

/// Queue arguments choosing the queue type (`x-queue-type`).
pub fn queue_args(queue_type: QueueType) -> FieldTable {
    let mut args = FieldTable::default();
    let kind = match queue_type {
        QueueType::Quorum => "quorum",
        QueueType::Classic => "classic",
    };
    args.insert("x-queue-type".into(), AMQPValue::LongString(kind.into()));
    args
}

/// Declares every exchange and queue of `names`; safe to repeat.
pub async fn declare(
    channel: &Channel,
    names: &Names,
    queue_type: QueueType,
) -> Result<(), BrokerError> {
    let none = FieldTable::default;
    channel
        .exchange_declare(&names.requests, "fanout", none())
        .await?;
    channel
        .exchange_declare(&names.dispatch, "topic", none())
        .await?;
    for queue in [&names.requests, &names.invalid] {
        channel
            .queue_declare(queue, false, queue_args(queue_type))
            .await?;
    }
    channel
        .queue_bind(&names.requests, &names.requests, "")
        .await?;
    for ttl in DELAY_TIERS_MS {
        // Classic queues: every message in one has the same TTL, so they expire in order.
        let mut args = queue_args(QueueType::Classic);
        args.insert("x-message-ttl".into(), AMQPValue::LongLongInt(ttl));
        args.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString(names.requests.as_str().into()),
        );
        channel
            .queue_declare(&names.delay_queue(ttl), false, args)
            .await?;
    }
    Ok(())
}

/// The delay tier for a message that must wait until `until`, seen at `now`.
pub fn delay_tier(now: DateTime<Utc>, until: DateTime<Utc>) -> i64 {
    let wait = (until - now).num_milliseconds();
    DELAY_TIERS_MS
        .iter()
        .rev()
        .copied()
        .find(|&tier| tier <= wait)
        .unwrap_or(DELAY_TIERS_MS[0])
}

/// A channel in confirm mode: every publish returns once the broker has taken responsibility
/// for the message (and, for mandatory publishes, routed it to a queue).
#[derive(Clone)]
pub struct Publisher {
    channel: Channel,
}

impl Publisher {
    /// Opens a channel on `connection` and switches it to confirm mode.
    pub async fn open(connection: &Connection) -> Result<Publisher, BrokerError> {
        let channel = connection.create_channel().await?;
        channel.confirm_select().await?;
        Ok(Publisher { channel })
    }

    /// The underlying channel (for declarations).
    pub fn channel(&self) -> &Channel {
        &self.channel
    }

    /// Publishes persistently and waits for the broker's confirmation. The message must reach a
    /// queue: an unroutable message is an error, not a silent loss.
    pub async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        properties: BasicProperties,
    ) -> Result<(), BrokerError> {
        let properties = properties.with_delivery_mode(2);
        let publish = self
            .channel
            .publish(exchange, routing_key, true, &properties, body);
        let confirmation = tokio::time::timeout(BROKER_TIMEOUT, publish)
            .await
            .map_err(|_| BrokerError::Timeout("publish confirm"))??;
        match confirmation {
            Confirmation::Ack | Confirmation::NotRequested => Ok(()),
            Confirmation::Returned => Err(BrokerError::Unroutable {
                exchange: exchange.to_owned(),
                routing_key: routing_key.to_owned(),
            }),
            Confirmation::Nack => Err(BrokerError::Nacked {
                exchange: exchange.to_owned(),
            }),
        }
    }
}

/// Properties for a JSON message with the given id and string headers.
pub fn json_properties(message_id: Option<&str>, headers: &[(&str, String)]) -> BasicProperties {
    let mut table = FieldTable::default();
    for (name, value) in headers {
        table.insert(
            (*name).into(),
            AMQPValue::LongString(LongString::from(value.as_str())),
        );
    }
    let mut properties = BasicProperties::default()
        .with_content_type("application/json".into())
        .with_headers(table);
    if let Some(id) = message_id.and_then(|id| ShortString::try_new(id).ok()) {
        properties = properties.with_message_id(id);
    }
    properties
}

/// A string header of a delivery, if present.
pub fn header(properties: &BasicProperties, name: &str) -> Option<String> {
    match properties.headers().as_ref()?.inner().get(name)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        AMQPValue::LongLongInt(n) => Some(n.to_string()),
        AMQPValue::LongInt(n) => Some(n.to_string()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(secs, 0).unwrap()
    }

    #[test]
    fn a_wait_takes_the_longest_tier_that_does_not_overshoot() {
        assert_eq!(delay_tier(at(0), at(0)), 1_000);
        assert_eq!(delay_tier(at(0), at(4)), 1_000);
        assert_eq!(delay_tier(at(0), at(29)), 5_000);
        assert_eq!(delay_tier(at(0), at(7_200)), 3_600_000);
        assert_eq!(delay_tier(at(0), at(7 * 86_400)), 86_400_000);
    }
}
