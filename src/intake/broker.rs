//! RabbitMQ: connection, topology, the receipt and properties of a message (publishing is
//! `publisher`).
//!
//! Topology (every name prefixed by the namespace):
//! - exchange `<ns>.requests` (fanout) -> queue `<ns>.requests`: what producers send;
//! - exchange `<ns>.dispatch` (topic, routing key = channel): allowed messages, for the senders;
//! - queue `<ns>.invalid`: bodies that are not valid requests, with the reason in a header;
//! - queue `<ns>.quarantine`: valid requests a service refuses for good (poison), with the
//!   reason, attempts and errors in headers, until `sendquota quarantine replay`;
//! - queues `<ns>.delay.q.<ms>` (quorum, the default) or `<ns>.delay.<ms>` (classic):
//!   delayed messages wait there for a fixed TTL and are dead-lettered back to
//!   `<ns>.requests` (see `delays`).
//! - with `intake.shards = N > 1`, the exchange `<ns>.requests` feeds a consistent-hash
//!   exchange over N single-active-consumer queues instead of the queue `<ns>.requests`
//!   (`shards`).
//!
//! Declarations are idempotent, so every worker declares everything at start, and again
//! when a publish to one of its queues comes back unroutable (an operator deleted it).

use std::future::Future;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures_util::StreamExt;
use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, Event};
use tokio::sync::watch;

use super::nodes::{first_answering, NodeFailure, NODE_CONNECT_TIMEOUT};
use crate::base::config::{AmqpSettings, QueueType};
use crate::decide::deadline::Receipt;

/// Header naming why a message was sent to the invalid queue.
pub const REASON_HEADER: &str = "x-sendquota-reason";
/// Header naming the denial a replayed message comes from.
pub const REPLAY_OF_HEADER: &str = "x-sendquota-replay-of";
/// Headers of a quarantined message: why, how many attempts it had, and its first and last
/// error.
pub const QUARANTINE_REASON_HEADER: &str = "x-sendquota-quarantine-reason";
/// See [`QUARANTINE_REASON_HEADER`].
pub const QUARANTINE_ATTEMPTS_HEADER: &str = "x-sendquota-attempts";
/// See [`QUARANTINE_REASON_HEADER`].
pub const QUARANTINE_FIRST_ERROR_HEADER: &str = "x-sendquota-first-error";
/// See [`QUARANTINE_REASON_HEADER`].
pub const QUARANTINE_LAST_ERROR_HEADER: &str = "x-sendquota-last-error";
/// Header carrying the instant a delayed message waits for.
pub const DELAYED_UNTIL_HEADER: &str = "x-sendquota-delayed-until";
/// Header carrying when the worker first received a message it republishes (see
/// [`crate::decide::deadline::Receipt`]): a delay rule's `max_delay` counts from it.
pub const FIRST_RECEIVED_HEADER: &str = "x-sendquota-first-received";
/// Header carrying the deadline delay rules' `max_delay` set for a message so far, or that a
/// replay's denial row kept (see [`crate::decide::deadline`]).
pub const DEADLINE_HEADER: &str = "x-sendquota-deadline";

/// Delay queue TTLs in milliseconds. A message waiting W goes to the longest tier not above W
/// and comes back to be decided again, so it overshoots by at most the shortest tier.
pub const DELAY_TIERS_MS: [i64; 8] = [
    1_000, 5_000, 30_000, 120_000, 600_000, 3_600_000, 21_600_000, 86_400_000,
];

/// Longest wait for the broker to accept a connection, a declaration or a publish confirm:
/// past it the operation is treated as failed and retried, so a stuck broker cannot stall a
/// message forever. Time while the broker blocks the connection (a resource alarm) does not
/// count: a publish confirmed after the alarm clears must not be sent again.
pub const BROKER_TIMEOUT: Duration = Duration::from_secs(10);

/// Shortest time between two declarations of the topology after returned publishes: the first
/// return declares everything again, and the publishes returned meanwhile (a storm of them,
/// one per message in flight) only publish once more instead of each declaring it too.
pub const REDECLARE_INTERVAL: Duration = Duration::from_secs(1);

/// Broker failures: the message must be retried.
#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    /// The connection or channel failed, or the broker refused an operation.
    #[error("rabbitmq: {0}")]
    Amqp(#[from] lapin::Error),
    /// The TLS certificate files could not be used.
    #[error("rabbitmq: {0}")]
    Tls(#[from] crate::base::tls::TlsError),
    /// The broker refused to declare the consistent-hash exchange `intake.shards` > 1 needs:
    /// almost always its plugin is not enabled.
    #[error(
        "rabbitmq cannot declare the x-consistent-hash exchange {exchange:?} that intake.shards > 1 \
         needs: is the plugin rabbitmq_consistent_hash_exchange enabled? \
         (rabbitmq-plugins enable rabbitmq_consistent_hash_exchange) ({source})"
    )]
    NoHashExchange {
        /// The exchange.
        exchange: String,
        /// The broker's refusal.
        source: lapin::Error,
    },
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
    /// No node of `amqp.urls` gave a connection: each one's failure, in the order tried.
    #[error("{0}")]
    NoNode(String),
    /// The broker did not answer within [`BROKER_TIMEOUT`].
    #[error("rabbitmq did not answer within {BROKER_TIMEOUT:?} ({0})")]
    Timeout(&'static str),
    /// The consumer received nothing for a watchdog interval while messages were waiting.
    #[error("consumer stalled: {ready} messages ready but none delivered; restarting it")]
    Stalled {
        /// Messages waiting in the requests queue.
        ready: u32,
    },
    /// The delivery stream ended and its channel is gone with it. (A consumer the broker
    /// cancels on an open channel, its queue deleted, is started again on that channel.)
    #[error("rabbitmq: the consumer was cancelled")]
    ConsumerEnded,
    /// The broker closed a channel of the session (a publish to a deleted exchange, say).
    #[error("rabbitmq closed the {0} channel")]
    ChannelClosed(&'static str),
    /// A name or routing key does not fit in AMQP's 255-byte short string.
    #[error("name too long for AMQP (over 255 bytes): {0:?}")]
    NameTooLong(String),
    /// The broker refuses a body this large (its `max_message_size`, learned from the refusal
    /// of an earlier publish): the message's own fault, which no retry cures.
    #[error("rabbitmq refuses a message body of {size} bytes: its max_message_size is {limit}")]
    TooLarge {
        /// The body's size in bytes.
        size: usize,
        /// The broker's limit.
        limit: usize,
    },
}

impl BrokerError {
    /// Whether the broker refused this message for its own sake (its size), so that retrying
    /// it cannot succeed, as opposed to the broker or the network failing.
    pub fn refuses_the_message(&self) -> bool {
        matches!(self, BrokerError::TooLarge { .. })
    }
}

/// `s` as an AMQP short string, or an error naming it (lapin's `From` would panic).
pub fn short(s: &str) -> Result<ShortString, BrokerError> {
    ShortString::try_new(s).map_err(|_| BrokerError::NameTooLong(s.to_owned()))
}

/// `future`, failed with [`BrokerError::Timeout`] once it has waited [`BROKER_TIMEOUT`] while
/// the connection was not blocked. Waiting starts afresh when a block ends.
pub async fn within<T, E>(
    what: &'static str,
    blocked: &watch::Receiver<Option<String>>,
    future: impl Future<Output = Result<T, E>>,
) -> Result<T, BrokerError>
where
    BrokerError: From<E>,
{
    let mut blocked = blocked.clone();
    tokio::pin!(future);
    loop {
        if blocked.borrow_and_update().is_some() {
            tokio::select! {
                done = &mut future => return Ok(done?),
                _ = blocked.wait_for(Option::is_none) => continue,
            }
        }
        tokio::select! {
            done = &mut future => return Ok(done?),
            _ = tokio::time::sleep(BROKER_TIMEOUT) => return Err(BrokerError::Timeout(what)),
            _ = blocked.wait_for(Option::is_some) => continue,
        }
    }
}

/// A timeout for operations on a connection that is never blocked (the consuming one).
pub async fn timed<T, E>(
    what: &'static str,
    future: impl Future<Output = Result<T, E>>,
) -> Result<T, BrokerError>
where
    BrokerError: From<E>,
{
    Ok(tokio::time::timeout(BROKER_TIMEOUT, future)
        .await
        .map_err(|_| BrokerError::Timeout(what))??)
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
    /// Queue for messages a service refuses for good (see `pipeline::Pipeline::quarantine`).
    pub quarantine: String,
    /// The namespace every name starts with, for log lines.
    pub namespace: String,
    /// The type of the delay queues, which their names tell apart (see [`Names::delay_queue`]).
    pub delay_type: QueueType,
    /// Request shards (`intake.shards`): 1 is the one requests queue.
    pub shards: u16,
}

impl Names {
    /// The names for `namespace` with classic delay queues (`<ns>.delay.<ms>`), as before
    /// `amqp.queue_type` reached them: see [`Names::of`].
    pub fn new(namespace: &str) -> Names {
        Names::of(namespace, QueueType::Classic)
    }

    /// The names for `namespace` whose delay queues are of `delay_type`: the worker's and
    /// every command's, from `amqp.queue_type`.
    pub fn of(namespace: &str, delay_type: QueueType) -> Names {
        Names {
            requests: format!("{namespace}.requests"),
            dispatch: format!("{namespace}.dispatch"),
            invalid: format!("{namespace}.invalid"),
            quarantine: format!("{namespace}.quarantine"),
            namespace: namespace.to_owned(),
            delay_type,
            shards: 1,
        }
    }

    /// These names with `shards` request shards (`intake.shards`): what every process that
    /// declares the topology must use, so that none binds the one requests queue again beside
    /// the shards.
    pub fn sharded(self, shards: u16) -> Names {
        Names {
            shards: shards.max(1),
            ..self
        }
    }

    /// The names of `settings`' namespace, delay queue type and shards: the worker's and every
    /// command's.
    pub fn of_settings(settings: &crate::base::config::Settings) -> Names {
        Names::of(&settings.namespace, settings.amqp.queue_type).sharded(settings.intake.shards)
    }

    /// The consistent-hash exchange the requests exchange feeds when sharded.
    pub fn shard_exchange(&self) -> String {
        format!("{}.shards", self.requests)
    }

    /// The queue of shard `index` (0-based).
    pub fn shard_queue(&self, index: u16) -> String {
        format!("{}.{index}", self.requests)
    }

    /// The queues workers consume requests from: the one requests queue, or every shard's.
    pub fn intake_queues(&self) -> Vec<String> {
        if self.shards <= 1 {
            return vec![self.requests.clone()];
        }
        (0..self.shards).map(|i| self.shard_queue(i)).collect()
    }

    /// The delay queue holding messages for `ttl_ms`: `<ns>.delay.q.<ms>` for quorum queues,
    /// `<ns>.delay.<ms>` for classic ones. The names differ because a queue cannot change type:
    /// declaring the classic queues of an existing deployment as quorum would be refused.
    pub fn delay_queue(&self, ttl_ms: i64) -> String {
        super::delays::queue_name(&self.namespace, self.delay_type, ttl_ms)
    }

    /// The durable queues other than the delay queues, which have arguments of their own.
    fn queues(&self) -> [&str; 3] {
        [&self.requests, &self.invalid, &self.quarantine]
    }

    /// Whether a publish to `exchange` with `routing_key` is meant for an exchange or queue the
    /// worker declares: the requests exchange, or through the default exchange the requests,
    /// invalid, quarantine or a delay queue. When one comes back unroutable, that exchange or
    /// queue was deleted and declaring the topology again brings it back. A dispatch is not:
    /// the queues bound to the dispatch exchange are the senders', and an unroutable dispatch
    /// waits for a sender to bind one.
    pub fn owns(&self, exchange: &str, routing_key: &str) -> bool {
        if !exchange.is_empty() {
            return exchange == self.requests;
        }
        self.queues().contains(&routing_key)
            || (self.shards > 1 && (0..self.shards).any(|i| self.shard_queue(i) == routing_key))
            || DELAY_TIERS_MS
                .iter()
                .any(|&ttl| self.delay_queue(ttl) == routing_key)
    }
}

/// Opens a connection named after the process role (`sendquota-worker-consume`, ...), with
/// TLS for `amqps://` URLs and the negotiated heartbeat, to the first node of `amqp.urls` that
/// answers (see [`super::nodes`]); with one URL, that broker or its error.
pub async fn connect(settings: &AmqpSettings, name: &str) -> Result<Connection, BrokerError> {
    let tls = settings.tls.amqp()?;
    let urls = settings.broker_urls();
    let open = |url: &str| {
        let properties = ConnectionProperties::default().with_connection_name(name.into());
        let tls = tls.clone();
        let url = url.to_owned();
        async move {
            let runtime = lapin::runtime::default_runtime()?;
            Connection::connect_with_config(&url, properties, tls, runtime).await
        }
    };
    let timeout = if urls.len() > 1 {
        NODE_CONNECT_TIMEOUT
    } else {
        BROKER_TIMEOUT
    };
    match first_answering(urls, timeout, open).await {
        Ok((connection, index)) => {
            if urls.len() > 1 {
                let node = crate::base::config::redact_url(&urls[index]);
                tracing::info!(%node, connection = name, "connected to rabbitmq");
            }
            Ok(connection)
        }
        Err(round) if urls.len() > 1 => Err(BrokerError::NoNode(round.to_string())),
        Err(mut round) => match round.failures.pop().map(|(_, failure)| failure) {
            Some(NodeFailure::Failed(e)) => Err(BrokerError::Amqp(e)),
            _ => Err(BrokerError::Timeout("connect")),
        },
    }
}

/// Whether the broker blocks `connection` (a resource alarm), and why: `Some(reason)` while
/// blocked. Follows the connection's events until every receiver is dropped.
pub fn blocked_state(connection: &Connection) -> watch::Receiver<Option<String>> {
    let initial = connection
        .status()
        .blocked()
        .then(|| "blocked by the broker".to_owned());
    let (tx, rx) = watch::channel(initial);
    let mut events = Box::pin(connection.events_listener());
    tokio::spawn(async move {
        loop {
            tokio::select! {
                event = events.next() => match event {
                    Some(Event::ConnectionBlocked(reason)) => {
                        tracing::warn!(%reason, "rabbitmq blocked the publishing connection");
                        let _ = tx.send(Some(reason));
                    }
                    Some(Event::ConnectionUnblocked) => {
                        tracing::info!("rabbitmq unblocked the publishing connection");
                        let _ = tx.send(None);
                    }
                    Some(_) => {}
                    None => return,
                },
                _ = tx.closed() => return,
            }
        }
    });
    rx
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
    let durable_exchange = ExchangeDeclareOptions {
        durable: true,
        ..ExchangeDeclareOptions::default()
    };
    let durable_queue = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    let none = FieldTable::default;
    let exchanges = [
        (&names.requests, lapin::ExchangeKind::Fanout),
        (&names.dispatch, lapin::ExchangeKind::Topic),
    ];
    for (exchange, kind) in exchanges {
        timed(
            "exchange.declare",
            channel.exchange_declare(short(exchange)?, kind, durable_exchange, none()),
        )
        .await?;
    }
    for queue in names.queues() {
        timed(
            "queue.declare",
            channel.queue_declare(short(queue)?, durable_queue, queue_args(queue_type)),
        )
        .await?;
    }
    route_requests(channel, names, queue_type).await?;
    for ttl in DELAY_TIERS_MS {
        let args = super::delays::queue_args(names.delay_type, ttl, &names.requests);
        timed(
            "queue.declare",
            channel.queue_declare(short(&names.delay_queue(ttl))?, durable_queue, args),
        )
        .await?;
    }
    Ok(())
}

/// Binds the requests queue to the requests exchange, or with shards the shards instead.
async fn route_requests(
    channel: &Channel,
    names: &Names,
    queue_type: QueueType,
) -> Result<(), BrokerError> {
    if names.shards > 1 {
        return crate::intake::shards::declare(channel, names, queue_type).await;
    }
    timed(
        "queue.bind",
        channel.queue_bind(
            short(&names.requests)?,
            short(&names.requests)?,
            "".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        ),
    )
    .await?;
    Ok(())
}

/// Messages ready in `queue` (a passive declare): for the consumer watchdog, and what a
/// quarantine replay takes at most.
pub async fn ready_count(channel: &Channel, queue: &str) -> Result<u32, BrokerError> {
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    let declared = timed(
        "queue.declare passive",
        channel.queue_declare(short(queue)?, passive, FieldTable::default()),
    )
    .await?;
    Ok(declared.message_count())
}

/// The header that says which denial a delivery replays, to carry over when the delivery is
/// republished from its properties (a quarantine, its replay, a yielded slot).
pub fn replay_header(properties: &BasicProperties) -> Option<(&'static str, String)> {
    header(properties, REPLAY_OF_HEADER).map(|d| (REPLAY_OF_HEADER, d))
}

/// The receipt a delivery carries in its headers, received at `now`: read once, at intake, so
/// that deciding works on a typed value and never on the broker's properties. A header that
/// does not hold an RFC 3339 instant (or a denial id) counts as absent: the headers are the
/// worker's own, and one a producer set can only shorten its own message's life.
pub fn receipt(properties: &BasicProperties, now: DateTime<Utc>) -> Receipt {
    let instant = |name| {
        header(properties, name)
            .and_then(|text| DateTime::parse_from_rfc3339(&text).ok())
            .map(|at| at.with_timezone(&Utc))
    };
    Receipt {
        first_received: instant(FIRST_RECEIVED_HEADER)
            .filter(|at| *at <= now)
            .unwrap_or(now),
        held_until: instant(DEADLINE_HEADER),
        replay_of: header(properties, REPLAY_OF_HEADER).and_then(|v| v.parse::<i64>().ok()),
    }
}

/// The headers that carry `receipt` to the next delivery of the message.
pub fn receipt_headers(receipt: &Receipt) -> Vec<(&'static str, String)> {
    let mut headers = Vec::with_capacity(3);
    if let Some(denial) = receipt.replay_of {
        headers.push((REPLAY_OF_HEADER, denial.to_string()));
    }
    headers.push((FIRST_RECEIVED_HEADER, rfc3339(receipt.first_received)));
    headers.extend(receipt.held_until.map(|at| (DEADLINE_HEADER, rfc3339(at))));
    headers
}

/// The receipt headers of a delivery to keep when it is republished whole (a yielded slot):
/// as they came, so the next delivery counts from the same first receipt.
pub fn carried_receipt(properties: &BasicProperties) -> Vec<(&'static str, String)> {
    [FIRST_RECEIVED_HEADER, DEADLINE_HEADER]
        .into_iter()
        .filter_map(|name| header(properties, name).map(|value| (name, value)))
        .collect()
}

fn rfc3339(at: DateTime<Utc>) -> String {
    at.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true)
}

/// The delay tier for a message that must wait until `until`, seen at `now`.
pub fn delay_tier(now: DateTime<Utc>, until: DateTime<Utc>) -> i64 {
    delay_tier_for((until - now).num_milliseconds())
}

/// The delay tier for a message that must wait `wait` ms: the longest that does not overshoot
/// it, or the shortest.
pub fn delay_tier_for(wait: i64) -> i64 {
    DELAY_TIERS_MS
        .iter()
        .rev()
        .copied()
        .find(|&tier| tier <= wait)
        .unwrap_or(DELAY_TIERS_MS[0])
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

/// `properties` of a publish with the producer's own context carried over from the delivery
/// it republishes (`from`): its `correlation_id` and every application header (`traceparent`
/// and `tracestate` of W3C trace context, a tenant, ...), so a sender, a delay queue, the
/// invalid queue or the quarantine sees what the producer sent. Not carried: the worker's own
/// headers (`x-sendquota-*`, which each publish sets itself, so a producer's forged one never
/// passes) and those the broker adds when it dead-letters or redelivers (`x-death`,
/// `x-first-death-*`, `x-last-death-*`, `x-delivery-count`), which would grow with every trip
/// through a delay queue, and the sender-selected routing keys `CC` and `BCC`. A header the publish sets itself wins.
pub fn carry(from: &BasicProperties, mut properties: BasicProperties) -> BasicProperties {
    if let Some(id) = from.correlation_id() {
        properties = properties.with_correlation_id(id.clone());
    }
    let Some(carried) = from.headers().as_ref().filter(|h| !h.inner().is_empty()) else {
        return properties;
    };
    let mut headers = properties.headers().clone().unwrap_or_default();
    for (name, value) in carried.inner() {
        if is_application_header(name.as_str()) && !headers.inner().contains_key(name) {
            headers.insert(name.clone(), value.clone());
        }
    }
    properties.with_headers(headers)
}

/// Whether a header is the producer's own, to be carried: not the worker's, not the broker's.
fn is_application_header(name: &str) -> bool {
    const BROKERS: [&str; 4] = [
        "x-death",
        "x-first-death-",
        "x-last-death-",
        "x-delivery-count",
    ];
    // `CC` and `BCC` are routing keys to RabbitMQ: carried, they would route every republish
    // (a dispatch, a delay) to the producer's extra queues too.
    !name.starts_with("x-sendquota-")
        && !BROKERS.iter().any(|b| name.starts_with(b))
        && !matches!(name, "CC" | "BCC")
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
    fn the_worker_owns_its_queues_and_the_requests_exchange_but_not_the_senders_queues() {
        let names = Names::new("ns");
        for queue in [
            "ns.requests",
            "ns.invalid",
            "ns.quarantine",
            "ns.delay.1000",
        ] {
            assert!(names.owns("", queue), "{queue}");
        }
        assert!(names.owns("ns.requests", ""));
        assert!(
            !names.owns("ns.dispatch", "sms"),
            "a dispatch is the senders'"
        );
        for other in ["ns.dispatch", "ns.delay.7", "other.invalid", "ns.invalid.x"] {
            assert!(!names.owns("", other), "{other}");
        }
        let quorum = Names::of("ns", QueueType::Quorum);
        assert!(quorum.owns("", "ns.delay.q.1000"));
        assert!(quorum.owns("", "ns.requests"));
        assert!(!quorum.owns("", "ns.delay.q.7"));
    }

    #[test]
    fn a_wait_takes_the_longest_tier_that_does_not_overshoot() {
        assert_eq!(delay_tier(at(0), at(0)), 1_000);
        assert_eq!(delay_tier(at(0), at(4)), 1_000);
        assert_eq!(delay_tier(at(0), at(29)), 5_000);
        assert_eq!(delay_tier(at(0), at(7_200)), 3_600_000);
        assert_eq!(delay_tier(at(0), at(7 * 86_400)), 86_400_000);
    }

    #[test]
    fn a_receipt_survives_its_headers() {
        let kept = Receipt {
            first_received: instant("2026-05-01T09:00:00.250Z"),
            held_until: Some(instant("2026-05-01T11:00:00Z")),
            replay_of: Some(7),
        };
        let props = json_properties(Some("m"), &receipt_headers(&kept));
        let later = instant("2026-05-01T10:00:00Z");
        assert_eq!(receipt(&props, later), kept);
        assert_eq!(carried_receipt(&props), receipt_headers(&kept)[1..]);
        let fresh = json_properties(Some("m"), &[]);
        assert_eq!(receipt(&fresh, later), Receipt::new(later));
        let forged = json_properties(
            Some("m"),
            &[(FIRST_RECEIVED_HEADER, "yesterday".to_owned())],
        );
        assert_eq!(receipt(&forged, later), Receipt::new(later));
    }

    fn instant(text: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(text)
            .expect("an instant")
            .with_timezone(&Utc)
    }
}
