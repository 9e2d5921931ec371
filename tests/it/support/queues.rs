//! The broker side: publishing requests as a producer does, and reading what the worker routed
//! (dispatched, invalid, quarantined or waiting) from queues of the test's namespace.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use lapin::options::{BasicGetOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection};
use sendquota::internals::broker::{self, DELAY_TIERS_MS};

use super::{amqp_url, request, TestEnv, OUTCOME_TIMEOUT};

impl TestEnv {
    /// Unbinds the test's own dispatched queue from the dispatch exchange: no queue receives
    /// a dispatch, as before any sender ran.
    pub async fn unbind_dispatched(&self) {
        self.channel
            .queue_unbind(
                self.dispatched_queue.as_str().into(),
                self.names.dispatch.as_str().into(),
                "#".into(),
                FieldTable::default(),
            )
            .await
            .expect("unbind the sender queue");
    }

    /// Binds the test's own dispatched queue to the dispatch exchange with `routing_key`, as a
    /// sender would.
    pub async fn bind_dispatched(&self, routing_key: &str) {
        self.channel
            .queue_bind(
                self.dispatched_queue.as_str().into(),
                self.names.dispatch.as_str().into(),
                routing_key.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("bind the sender queue");
    }

    /// The message ids in the quarantine queue, oldest first, left there (as `sendquota
    /// quarantine list` shows them).
    pub async fn quarantined(&self) -> Vec<Option<String>> {
        let listed = sendquota::internals::quarantine::list_held(
            &self.settings.amqp,
            &self.names,
            "sendquota-test",
            1_000,
        )
        .await
        .expect("list the quarantine");
        listed.into_iter().map(|q| q.message_id).collect()
    }

    /// Messages ready (not counting deliveries in progress) in `queue`.
    pub async fn ready(&self, queue: &str) -> u32 {
        let passive = lapin::options::QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        self.channel
            .queue_declare(queue.into(), passive, lapin::types::FieldTable::default())
            .await
            .expect("passive declare")
            .message_count()
    }

    /// Publishes a raw body to the requests exchange, as a producer would.
    pub async fn publish_raw(&self, body: &[u8]) {
        self.publisher
            .publish(&self.names.requests, "", body, BasicProperties::default())
            .await
            .expect("publish request");
    }

    /// Publishes a JSON request.
    pub async fn publish(&self, request: &serde_json::Value) {
        self.publish_raw(request.to_string().as_bytes()).await;
    }

    /// Publishes a JSON request with its recipient in the header the shards hash, as
    /// docs/producers.md asks of producers.
    pub async fn publish_keyed(&self, request: &serde_json::Value) {
        let recipient = request["recipient"].as_str().expect("a recipient");
        let properties = broker::json_properties(
            request["id"].as_str(),
            &[(broker::RECIPIENT_HEADER, recipient.to_owned())],
        );
        self.publisher
            .publish(
                &self.names.requests,
                "",
                request.to_string().as_bytes(),
                properties,
            )
            .await
            .expect("publish request");
    }

    /// Publishes `n` headline requests `m0`, `m1`, ... two per recipient (`user-0`, `user-0`,
    /// `user-1`, ...): under the headline rule on one day, half are dispatched, half denied.
    pub async fn publish_two_per_recipient(&self, n: usize) {
        for i in 0..n {
            self.publish(&request(
                &format!("m{i}"),
                &format!("user-{}", i / 2),
                "UTC",
            ))
            .await;
        }
    }

    /// Publishes one message of each kind an operator watches and waits until each has its
    /// outcome: `allowed` (alice's first today under the headline rule), `denied` (her second)
    /// and a body that is not a request, with message id `invalid`.
    pub async fn publish_allowed_denied_invalid(&self) {
        let mut seen = HashMap::new();
        self.publish(&request("allowed", "alice", "UTC")).await;
        assert!(
            self.outcome("allowed", &mut seen).await,
            "allowed is dispatched"
        );
        self.publish(&request("denied", "alice", "UTC")).await;
        assert!(!self.outcome("denied", &mut seen).await, "denied is denied");
        let properties = BasicProperties::default().with_message_id("invalid".into());
        self.publisher
            .publish(&self.names.requests, "", b"not json", properties)
            .await
            .expect("publish request");
        let deadline = Instant::now() + OUTCOME_TIMEOUT;
        while self.drain(&self.names.invalid).await.is_empty() {
            assert!(Instant::now() < deadline, "the invalid body was routed");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Takes every message waiting in `queue`.
    pub async fn drain(&self, queue: &str) -> Vec<lapin::message::BasicGetMessage> {
        drain(&self.channel, queue).await
    }

    /// Takes every message waiting in the invalid queue: the reason the worker gave each, by
    /// body (which must be UTF-8).
    pub async fn invalid_reasons(&self) -> HashMap<String, String> {
        self.drain(&self.names.invalid)
            .await
            .into_iter()
            .map(|m| {
                let reason = broker::header(&m.delivery.properties, broker::REASON_HEADER)
                    .expect("reason header");
                (String::from_utf8(m.delivery.data).expect("utf-8"), reason)
            })
            .collect()
    }

    /// Ids of the messages dispatched since the last call.
    pub async fn take_dispatched(&self) -> Vec<String> {
        self.drain(&self.dispatched_queue)
            .await
            .iter()
            .map(|m| {
                let v: serde_json::Value =
                    serde_json::from_slice(&m.delivery.data).expect("dispatched body is JSON");
                v["id"]
                    .as_str()
                    .expect("dispatched body has an id")
                    .to_owned()
            })
            .collect()
    }

    /// Waits until every copy of the messages published so far has been decided: nothing
    /// waits in the requests queue or in the shortest delay queue (where a copy that found
    /// another in flight waits its turn) for longer than a copy's trip through that queue.
    pub async fn copies_decided(&self) {
        let delay = self.names.delay_queue(DELAY_TIERS_MS[0]);
        let deadline = Instant::now() + OUTCOME_TIMEOUT;
        let mut idle_since = Instant::now();
        while idle_since.elapsed() < Duration::from_millis(2_500) {
            assert!(Instant::now() < deadline, "the copies were all decided");
            if self.ready(&self.names.requests).await + self.ready(&delay).await > 0 {
                idle_since = Instant::now();
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until message `id` has an outcome: dispatched (returns true) or denied (false).
    /// Dispatched ids seen meanwhile are kept in `seen`.
    pub async fn outcome(&self, id: &str, seen: &mut HashMap<String, usize>) -> bool {
        let deadline = Instant::now() + OUTCOME_TIMEOUT;
        loop {
            for d in self.take_dispatched().await {
                *seen.entry(d).or_default() += 1;
            }
            if seen.contains_key(id) {
                return true;
            }
            if self.denial_count(id).await > 0 {
                return false;
            }
            assert!(
                Instant::now() < deadline,
                "no outcome for message {id} within {OUTCOME_TIMEOUT:?}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Waits until message `id` is dispatched, whatever rows it leaves (a shadow rule records
    /// its row before the dispatch). Dispatched ids seen meanwhile are kept in `seen`.
    pub async fn dispatched(&self, id: &str, seen: &mut HashMap<String, usize>) {
        let deadline = Instant::now() + OUTCOME_TIMEOUT;
        while !seen.contains_key(id) {
            for d in self.take_dispatched().await {
                *seen.entry(d).or_default() += 1;
            }
            assert!(
                Instant::now() < deadline,
                "message {id} not dispatched within {OUTCOME_TIMEOUT:?}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// Every message waiting in `queue` on `channel`, taken off it (on any broker).
pub async fn drain(channel: &Channel, queue: &str) -> Vec<lapin::message::BasicGetMessage> {
    let mut out = Vec::new();
    let get = BasicGetOptions { no_ack: true };
    while let Some(m) = channel
        .basic_get(queue.into(), get)
        .await
        .expect("basic_get")
    {
        out.push(m);
    }
    out
}

/// Declares `queue` (durable) and binds it to `exchange` with `#`: every message published there
/// lands in it, for a test to read.
pub async fn declare_sink(channel: &Channel, queue: &str, exchange: &str) {
    declare_sink_with(channel, queue, exchange, FieldTable::default()).await;
}

/// [`declare_sink`] with the queue arguments `args` (its type, say).
pub async fn declare_sink_with(channel: &Channel, queue: &str, exchange: &str, args: FieldTable) {
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(queue.into(), durable, args)
        .await
        .expect("declare the sink queue");
    channel
        .queue_bind(
            queue.into(),
            exchange.into(),
            "#".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("bind the sink queue");
}

/// A lapin connection to the test broker, named `name`.
pub async fn lapin_connect(name: &str) -> lapin::Result<Connection> {
    let properties = lapin::ConnectionProperties::default().with_connection_name(name.into());
    Connection::connect(&amqp_url(), properties).await
}
