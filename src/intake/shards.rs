//! Ordered intake across workers (`intake.shards = N > 1`): the requests exchange feeds a
//! consistent-hash exchange `<ns>.requests.shards` over N queues `<ns>.requests.<i>`, each with
//! single-active-consumer. A recipient's messages all hash to one queue, and only one worker at
//! a time takes from a queue, so they are decided in the order they were published even with
//! several workers (docs/decisions.md, "Ordered intake across workers").
//!
//! Producers keep publishing to the exchange `<ns>.requests` (an exchange's type cannot change
//! in place): it stays a fanout, bound exchange-to-exchange to the consistent-hash one. The
//! exchange cannot read the JSON body, so it hashes the [`RECIPIENT_HEADER`] the producer sets;
//! every republish of the worker carries it (it is an application header, see
//! `broker::carry`), so a delayed message comes back to its recipient's shard.

use lapin::options::QueueDeclareOptions;
use lapin::options::{ExchangeBindOptions, ExchangeDeclareOptions, QueueBindOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, ExchangeKind};

use crate::base::config::QueueType;
use crate::intake::broker::{queue_args, short, timed, BrokerError, Names};

/// The header the consistent-hash exchange hashes: the recipient, exactly as in the body, as
/// an AMQP string. Not `x-sendquota-` (the worker's own headers, which it never carries over):
/// it is the producer's, and every republish carries it as it came. A message without it is
/// still decided; all such messages hash to the same one shard.
pub const RECIPIENT_HEADER: &str = "sendquota-recipient";

/// The exchange type of the `rabbitmq_consistent_hash_exchange` plugin.
const HASH_EXCHANGE_TYPE: &str = "x-consistent-hash";

/// Declares the sharded part of the topology; safe to repeat. The shards are bound before the
/// one requests queue is unbound, so no publish in between is unroutable. That queue stays
/// declared: messages left in it from before the shards are drained first (see the worker).
pub async fn declare(
    channel: &Channel,
    names: &Names,
    queue_type: QueueType,
) -> Result<(), BrokerError> {
    let exchange = names.shard_exchange();
    let mut hash_on = FieldTable::default();
    hash_on.insert(
        "hash-header".into(),
        AMQPValue::LongString(RECIPIENT_HEADER.into()),
    );
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..ExchangeDeclareOptions::default()
    };
    let kind = ExchangeKind::Custom(HASH_EXCHANGE_TYPE.to_owned());
    let declared = timed(
        "exchange.declare",
        channel.exchange_declare(short(&exchange)?, kind, durable, hash_on),
    )
    .await;
    match declared {
        Err(BrokerError::Amqp(source)) => {
            return Err(BrokerError::NoHashExchange { exchange, source })
        }
        other => other?,
    }
    for index in 0..names.shards {
        declare_shard(channel, names, index, queue_type).await?;
    }
    timed(
        "exchange.bind",
        channel.exchange_bind(
            short(&exchange)?,
            short(&names.requests)?,
            "".into(),
            ExchangeBindOptions::default(),
            FieldTable::default(),
        ),
    )
    .await?;
    timed(
        "queue.unbind",
        channel.queue_unbind(
            short(&names.requests)?,
            short(&names.requests)?,
            "".into(),
            FieldTable::default(),
        ),
    )
    .await?;
    Ok(())
}

/// Declares shard `index`'s queue with single-active-consumer and binds it to the hash
/// exchange with weight 1 (the binding key of a consistent-hash exchange is a weight).
async fn declare_shard(
    channel: &Channel,
    names: &Names,
    index: u16,
    queue_type: QueueType,
) -> Result<(), BrokerError> {
    let queue = names.shard_queue(index);
    let mut args = queue_args(queue_type);
    args.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    timed(
        "queue.declare",
        channel.queue_declare(short(&queue)?, durable, args),
    )
    .await?;
    timed(
        "queue.bind",
        channel.queue_bind(
            short(&queue)?,
            short(&names.shard_exchange())?,
            "1".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        ),
    )
    .await?;
    Ok(())
}

/// The prefetch of each shard's consumer: the configured prefetch shared among the shards
/// (rounded up), so a worker active on every shard holds about as many deliveries as with one
/// queue and its memory stays bounded by `amqp.prefetch` (quorum queues refuse a prefetch
/// shared by the channel, AMQP's `global` QoS).
pub fn prefetch_per_shard(prefetch: u16, shards: u16) -> u16 {
    prefetch.div_ceil(shards.max(1)).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_queue_unless_sharded_and_then_one_per_shard() {
        assert_eq!(Names::new("ns").intake_queues(), ["ns.requests"]);
        let sharded = Names::new("ns").sharded(3);
        assert_eq!(
            sharded.intake_queues(),
            ["ns.requests.0", "ns.requests.1", "ns.requests.2"]
        );
        assert_eq!(sharded.shard_exchange(), "ns.requests.shards");
        assert!(sharded.owns("", "ns.requests.2"));
        assert!(!sharded.owns("", "ns.requests.3"));
        assert!(!Names::new("ns").owns("", "ns.requests.0"));
    }

    #[test]
    fn the_prefetch_is_shared_among_the_shards() {
        assert_eq!(prefetch_per_shard(256, 1), 256);
        assert_eq!(prefetch_per_shard(256, 4), 64);
        assert_eq!(prefetch_per_shard(10, 4), 3);
        assert_eq!(prefetch_per_shard(1, 64), 1);
    }
}
