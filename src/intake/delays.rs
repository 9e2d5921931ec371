//! The delay queues: one per tier of `broker::DELAY_TIERS_MS`, each holding its messages for
//! its fixed TTL and then dead-lettering them back to `<ns>.requests`.
//!
//! With `amqp.queue_type = quorum` (the default) they are quorum queues, replicated like the
//! requests queue, so a delayed message survives the loss of the node that declared the queue
//! (a classic queue lives on that node alone: unavailable while it is down, gone with its
//! disk). Their dead-lettering is at-least-once: the queue keeps a message until the requests
//! exchange's queue has confirmed it, so one moving back when a node dies is not lost (it may
//! arrive twice, which deciding by message id makes harmless). RabbitMQ only does that for a
//! queue that refuses publishes when full (`x-overflow: reject-publish`) rather than dropping
//! its oldest messages. Quorum queues expire messages by TTL from RabbitMQ 3.10.
//!
//! A queue cannot change type (a declaration with other arguments is refused and closes the
//! channel), so the quorum queues have names of their own, `<ns>.delay.q.<ms>`, beside the
//! classic `<ns>.delay.<ms>` of deployments from before them: those drain back to the
//! requests queue by themselves as their TTLs pass (docs/operations.md).

use lapin::types::{AMQPValue, FieldTable};

use crate::base::config::QueueType;

/// The name of the delay queue of `namespace` holding messages for `ttl_ms`, by type.
pub fn queue_name(namespace: &str, queue_type: QueueType, ttl_ms: i64) -> String {
    match queue_type {
        QueueType::Quorum => format!("{namespace}.delay.q.{ttl_ms}"),
        QueueType::Classic => format!("{namespace}.delay.{ttl_ms}"),
    }
}

/// The arguments of a delay queue of `queue_type` for `ttl_ms`, dead-lettering to the
/// `requests` exchange. Every message in a queue has the same TTL, so they expire in order.
pub fn queue_args(queue_type: QueueType, ttl_ms: i64, requests: &str) -> FieldTable {
    let text = |s: &str| AMQPValue::LongString(s.into());
    let mut args = FieldTable::default();
    args.insert("x-message-ttl".into(), AMQPValue::LongLongInt(ttl_ms));
    args.insert("x-dead-letter-exchange".into(), text(requests));
    match queue_type {
        QueueType::Quorum => {
            args.insert("x-queue-type".into(), text("quorum"));
            args.insert("x-dead-letter-strategy".into(), text("at-least-once"));
            args.insert("x-overflow".into(), text("reject-publish"));
        }
        QueueType::Classic => {
            args.insert("x-queue-type".into(), text("classic"));
        }
    }
    args
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quorum_delay_queues_are_named_apart_from_the_classic_ones_they_replace() {
        assert_eq!(
            queue_name("ns", QueueType::Quorum, 1_000),
            "ns.delay.q.1000"
        );
        assert_eq!(queue_name("ns", QueueType::Classic, 1_000), "ns.delay.1000");
    }

    #[test]
    fn quorum_delay_queues_dead_letter_at_least_once() {
        let args = queue_args(QueueType::Quorum, 5_000, "ns.requests");
        let get = |k: &str| args.inner().get(k).cloned();
        let text = |s: &str| Some(AMQPValue::LongString(s.into()));
        assert_eq!(get("x-dead-letter-strategy"), text("at-least-once"));
        assert_eq!(get("x-overflow"), text("reject-publish"));
        assert_eq!(get("x-dead-letter-exchange"), text("ns.requests"));
        assert_eq!(get("x-message-ttl"), Some(AMQPValue::LongLongInt(5_000)));
        let classic = queue_args(QueueType::Classic, 5_000, "ns.requests");
        assert!(!classic.inner().contains_key("x-dead-letter-strategy"));
    }
}
