//! Watching what the worker dispatches (`sendquota tail`): a temporary queue bound to the
//! dispatch exchange, whose messages are printed as JSON lines until the command is stopped.
//!
//! It is how someone trying sendquota, or an operator checking a channel, sees a dispatch
//! without a sender. Its queue is exclusive to its connection, so the broker deletes it when
//! the command ends, however it ends. While it is bound a dispatch it matches is routed, so
//! the worker counts it as dispatched: when no sender's queue is bound beside it, the messages
//! it prints reach no sender.

use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::{BasicConsumeOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::Channel;
use serde::Serialize;
use serde_json::value::RawValue;

use crate::intake::broker::{self, timed, BrokerError, Names};

/// One dispatched message, as `tail` prints it.
#[derive(Debug, Serialize)]
pub struct Dispatched<'a> {
    /// The routing key it was dispatched with: its channel.
    pub routing_key: &'a str,
    /// Its `message_id` property: the request's id.
    pub message_id: Option<&'a str>,
    /// The request as the producer published it: JSON when it is (always, from the worker),
    /// else the body as text.
    pub body: Body<'a>,
}

/// A dispatched body, as JSON or text.
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum Body<'a> {
    /// The body is JSON, printed as it is.
    Json(&'a RawValue),
    /// The body is not JSON, printed as a string.
    Text(String),
}

impl<'a> Dispatched<'a> {
    /// What `delivery` from the dispatch exchange is.
    pub fn of(delivery: &'a Delivery) -> Dispatched<'a> {
        let body = match serde_json::from_slice::<&RawValue>(&delivery.data) {
            Ok(json) => Body::Json(json),
            Err(_) => Body::Text(String::from_utf8_lossy(&delivery.data).into_owned()),
        };
        Dispatched {
            routing_key: delivery.routing_key.as_str(),
            message_id: delivery
                .properties
                .message_id()
                .as_ref()
                .map(|s| s.as_str()),
            body,
        }
    }
}

/// Binds a temporary queue to `names`' dispatch exchange with `routing_key` (a channel, or `#`
/// for every one) and returns its consumer. The dispatch exchange is declared first, so tail
/// can start before any worker ran.
pub async fn bind(
    channel: &Channel,
    names: &Names,
    routing_key: &str,
) -> Result<(String, lapin::Consumer), BrokerError> {
    let durable = lapin::options::ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    timed(
        "exchange.declare",
        channel.exchange_declare(
            broker::short(&names.dispatch)?,
            lapin::ExchangeKind::Topic,
            durable,
            FieldTable::default(),
        ),
    )
    .await?;
    let temporary = QueueDeclareOptions {
        exclusive: true,
        auto_delete: true,
        ..Default::default()
    };
    let queue = timed(
        "queue.declare",
        channel.queue_declare("".into(), temporary, FieldTable::default()),
    )
    .await?;
    let name = queue.name().as_str().to_owned();
    timed(
        "queue.bind",
        channel.queue_bind(
            queue.name().clone(),
            broker::short(&names.dispatch)?,
            broker::short(routing_key)?,
            QueueBindOptions::default(),
            FieldTable::default(),
        ),
    )
    .await?;
    let no_ack = BasicConsumeOptions {
        no_ack: true,
        ..Default::default()
    };
    let consumer = timed(
        "basic.consume",
        channel.basic_consume(
            queue.name().clone(),
            "sendquota-tail".into(),
            no_ack,
            FieldTable::default(),
        ),
    )
    .await?;
    Ok((name, consumer))
}

/// Writes each delivery of `consumer` to `out` as one JSON line until `stop` completes (Ok) or
/// the consumer fails or ends (the connection was lost).
pub async fn print(
    mut consumer: lapin::Consumer,
    out: &mut impl std::io::Write,
    stop: impl std::future::Future<Output = ()>,
) -> Result<(), TailError> {
    let mut stop = std::pin::pin!(stop);
    loop {
        let delivery = tokio::select! {
            _ = &mut stop => return Ok(()),
            next = consumer.next() => match next {
                Some(delivery) => delivery.map_err(BrokerError::from)?,
                None => return Err(BrokerError::ConsumerEnded.into()),
            },
        };
        let line = serde_json::to_string(&Dispatched::of(&delivery)).unwrap_or_default();
        writeln!(out, "{line}").map_err(TailError::Output)?;
        out.flush().map_err(TailError::Output)?;
    }
}

/// Why `tail` stopped before it was told to.
#[derive(Debug, thiserror::Error)]
pub enum TailError {
    /// The broker failed or the connection was lost.
    #[error(transparent)]
    Broker(#[from] BrokerError),
    /// Standard output could not be written (a closed pipe).
    #[error("writing output: {0}")]
    Output(std::io::Error),
}
