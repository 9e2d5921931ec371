//! The worker's own AMQP client against the real RabbitMQ: what it publishes arrives whole,
//! confirms and returns mean what they say, and broker errors reach the caller with the
//! broker's reply code instead of hanging.

mod support;

use std::time::Duration;

use sendquota::amqp::{
    AMQPValue, AmqpError, BasicProperties, Channel, Confirmation, Connection, Consumer, Delivery,
    FieldTable,
};
use sendquota::broker;
use sendquota::config::QueueType;
use support::{amqp_url, unique, START_HINT};

const WAIT: Duration = Duration::from_secs(10);

async fn connect() -> Connection {
    Connection::connect(&amqp_url(), "sendquota-amqp-client-test")
        .await
        .unwrap_or_else(|e| {
            panic!(
                "rabbitmq not reachable at {}: {e}; {START_HINT}",
                amqp_url()
            )
        })
}

/// A connection, a channel on it, and a fanout exchange bound to a quorum queue, both named
/// `name` (removed by [`teardown`]).
async fn with_queue(name: &str) -> (Connection, Channel) {
    let conn = connect().await;
    let channel = conn.create_channel().await.expect("channel");
    channel
        .exchange_declare(name, "fanout", FieldTable::default())
        .await
        .expect("declare exchange");
    channel
        .queue_declare(name, false, broker::queue_args(QueueType::Quorum))
        .await
        .expect("declare queue");
    channel.queue_bind(name, name, "").await.expect("bind");
    (conn, channel)
}

async fn teardown(name: &str) {
    let conn = connect().await;
    let channel = conn.create_channel().await.expect("channel");
    channel.queue_delete(name).await.expect("delete queue");
    channel
        .exchange_delete(name)
        .await
        .expect("delete exchange");
    conn.close(200, "test done").await.expect("close");
}

#[tokio::test]
async fn published_messages_arrive_whole_with_their_properties_and_acks_remove_them() {
    let name = unique("amqp_roundtrip");
    let (conn, publisher) = with_queue(&name).await;
    publisher.confirm_select().await.expect("confirm mode");
    // The large body spans several frames of the negotiated 128 KiB maximum.
    let bodies: Vec<Vec<u8>> = vec![
        b"{\"a\":1}".to_vec(),
        Vec::new(),
        (0..300_000u32).map(|i| (i % 251) as u8).collect(),
    ];
    let mut headers = FieldTable::default();
    headers.insert("x-test".into(), AMQPValue::LongString("yes".into()));
    for (i, body) in bodies.iter().enumerate() {
        let properties = BasicProperties::default()
            .with_message_id(format!("m{i}").into())
            .with_content_type("application/json".into())
            .with_headers(headers.clone())
            .with_delivery_mode(2);
        let confirmation = publisher
            .publish(&name, "", true, &properties, body)
            .await
            .expect("publish");
        assert_eq!(confirmation, Confirmation::Ack);
    }

    let consuming = conn.create_channel().await.expect("channel");
    consuming.basic_qos(10).await.expect("qos");
    let mut consumer = consuming.basic_consume(&name).await.expect("consume");
    for (i, body) in bodies.iter().enumerate() {
        let delivery = tokio::time::timeout(WAIT, consumer.next())
            .await
            .expect("a delivery in time")
            .expect("consumer open")
            .expect("delivery");
        assert_eq!(&delivery.data, body, "body of message {i}");
        assert_eq!(delivery.delivery_tag, i as u64 + 1);
        assert!(!delivery.redelivered);
        assert_eq!(delivery.exchange, name);
        let properties = &delivery.properties;
        assert_eq!(
            properties.message_id().as_ref().map(|s| s.as_str()),
            Some(format!("m{i}").as_str())
        );
        assert_eq!(properties.delivery_mode(), &Some(2));
        assert_eq!(properties.headers(), &Some(headers.clone()));
        consuming
            .basic_ack(delivery.delivery_tag, false)
            .expect("ack");
    }
    consuming.close().await.expect("close channel");
    let left = publisher
        .queue_declare(&name, true, FieldTable::default())
        .await
        .expect("passive declare");
    assert_eq!(left, 0, "every acked message is gone from the queue");
    conn.close(200, "test done").await.expect("close");
    teardown(&name).await;
}

async fn next(consumer: &mut Consumer) -> Delivery {
    tokio::time::timeout(WAIT, consumer.next())
        .await
        .expect("a delivery in time")
        .expect("consumer open")
        .expect("delivery")
}

#[tokio::test]
async fn a_nacked_delivery_comes_back_marked_redelivered_and_a_multiple_ack_settles_the_rest() {
    let name = unique("amqp_nack");
    let (conn, channel) = with_queue(&name).await;
    channel.confirm_select().await.expect("confirm mode");
    for i in 0..3 {
        let properties = BasicProperties::default().with_message_id(format!("n{i}").into());
        let confirmation = channel
            .publish(&name, "", false, &properties, b"x")
            .await
            .expect("publish");
        assert_eq!(confirmation, Confirmation::Ack);
    }
    let mut consumer = channel.basic_consume(&name).await.expect("consume");
    let first = next(&mut consumer).await;
    assert_eq!(
        first.properties.message_id().as_ref().map(|s| s.as_str()),
        Some("n0")
    );
    channel
        .basic_nack(first.delivery_tag, false, true)
        .expect("nack");
    let mut redelivered = None;
    let mut others = Vec::new();
    for _ in 0..3 {
        let d = next(&mut consumer).await;
        if d.redelivered {
            redelivered = Some(d);
        } else {
            others.push(d);
        }
    }
    let redelivered = redelivered.expect("the nacked message comes back");
    assert_eq!(
        redelivered
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.as_str()),
        Some("n0")
    );
    assert_eq!(others.len(), 2);
    let last = others
        .iter()
        .chain([&redelivered])
        .map(|d| d.delivery_tag)
        .max()
        .expect("tags");
    channel.basic_ack(last, true).expect("multiple ack");
    channel.close().await.expect("close channel");
    let check = conn.create_channel().await.expect("channel");
    let left = check
        .queue_declare(&name, true, FieldTable::default())
        .await
        .expect("passive");
    assert_eq!(left, 0);
    conn.close(200, "test done").await.expect("close");
    teardown(&name).await;
}

#[tokio::test]
async fn a_mandatory_message_that_reaches_no_queue_is_returned_not_confirmed_as_delivered() {
    let name = unique("amqp_unroutable");
    let conn = connect().await;
    let channel = conn.create_channel().await.expect("channel");
    channel
        .exchange_declare(&name, "topic", FieldTable::default())
        .await
        .expect("declare");
    channel.confirm_select().await.expect("confirm mode");
    let properties = BasicProperties::default().with_message_id("lost".into());
    let mandatory = channel
        .publish(&name, "nobody.listens", true, &properties, b"x")
        .await;
    assert_eq!(mandatory, Ok(Confirmation::Returned));
    let plain = channel
        .publish(&name, "nobody.listens", false, &properties, b"x")
        .await;
    assert_eq!(
        plain,
        Ok(Confirmation::Ack),
        "without mandatory the broker drops it silently"
    );
    channel
        .exchange_delete(&name)
        .await
        .expect("delete exchange");
    conn.close(200, "test done").await.expect("close");
}

#[tokio::test]
async fn a_broker_error_closes_only_its_channel_and_reaches_every_waiting_caller() {
    let conn = connect().await;
    let channel = conn.create_channel().await.expect("channel");
    channel.confirm_select().await.expect("confirm mode");
    let missing = unique("amqp_missing");
    let published = channel
        .publish(&missing, "", false, &BasicProperties::default(), b"x")
        .await;
    match published {
        Err(AmqpError::ChannelClosed { code: 404, text }) => {
            assert!(text.contains(&missing), "{text}")
        }
        other => panic!("expected the broker's 404, got {other:?}"),
    }
    assert!(!channel.is_open());
    assert!(matches!(
        channel.basic_qos(1).await,
        Err(AmqpError::ChannelClosed { code: 404, .. })
    ));
    assert!(
        conn.is_connected(),
        "a channel error leaves the connection up"
    );
    let other = conn
        .create_channel()
        .await
        .expect("a new channel on the same connection");
    let absent = other
        .queue_declare(&missing, true, FieldTable::default())
        .await;
    assert!(
        matches!(absent, Err(AmqpError::ChannelClosed { code: 404, .. })),
        "{absent:?}"
    );
    conn.close(200, "test done").await.expect("close");
}

#[tokio::test]
async fn closing_the_connection_ends_its_consumers_with_an_error() {
    let name = unique("amqp_close");
    let (conn, channel) = with_queue(&name).await;
    let mut consumer = channel.basic_consume(&name).await.expect("consume");
    conn.close(200, "test done").await.expect("close");
    let ended = tokio::time::timeout(WAIT, consumer.next())
        .await
        .expect("consumer told in time");
    assert!(
        matches!(ended, Some(Err(AmqpError::Closed(_)))),
        "{ended:?}"
    );
    assert!(tokio::time::timeout(WAIT, consumer.next())
        .await
        .expect("in time")
        .is_none());
    assert!(!channel.is_open());
    assert!(
        channel.basic_ack(1, false).is_err(),
        "nothing can be sent on a closed connection"
    );
    teardown(&name).await;
}

#[tokio::test]
async fn wrong_credentials_are_refused_with_the_brokers_reason() {
    let url = amqp_url().replacen("guest:guest", "guest:wrong-password", 1);
    assert_ne!(url, amqp_url(), "the test URL carries guest:guest");
    let refused = Connection::connect(&url, "sendquota-amqp-client-test").await;
    match refused {
        Err(AmqpError::ConnectionClosed { code: 403, text }) => {
            assert!(text.contains("ACCESS_REFUSED"), "{text}")
        }
        Err(other) => panic!("expected ACCESS_REFUSED, got {other}"),
        Ok(_) => panic!("a wrong password was accepted"),
    }
    let bad = Connection::connect("http://localhost", "x").await;
    assert!(matches!(bad, Err(AmqpError::Url(_))), "not an AMQP URL");
}
