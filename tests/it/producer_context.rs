//! What a producer sends beside the body travels with the message (issue 25, trace context):
//! its `correlation_id` and application headers, W3C `traceparent` and `tracestate` among
//! them, reach the sender on the dispatch, wait with it in a delay queue and come back with
//! it, and go with it to the invalid queue and to quarantine. The worker's own headers are
//! never taken from a producer, and the broker's dead-lettering headers are not carried.

use crate::support;

use std::time::{Duration, Instant};

use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::BasicProperties;
use sendquota::clock::ManualClock;
use sendquota::internals::broker;
use support::fixtures::policy;
use support::{local, request, TestEnv};

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
const TRACESTATE: &str = "congo=t61rcWkgMzE";

/// Properties as a producer instrumented with OpenTelemetry sends them, plus a header only the
/// worker may set (forged) and one only the broker sets.
fn producer_properties() -> BasicProperties {
    let mut headers = FieldTable::default();
    for (name, value) in [
        ("traceparent", TRACEPARENT),
        ("tracestate", TRACESTATE),
        ("x-tenant", "acme"),
        (broker::DELAYED_UNTIL_HEADER, "forged"),
        ("x-death", "from another broker"),
    ] {
        headers.insert(name.into(), AMQPValue::LongString(LongString::from(value)));
    }
    // An extra routing key (RabbitMQ's sender-selected distribution): an array of strings.
    let cc = vec![AMQPValue::LongString(LongString::from(
        "sendquota.test.elsewhere",
    ))];
    headers.insert("CC".into(), AMQPValue::FieldArray(cc.into()));
    BasicProperties::default()
        .with_correlation_id(ShortString::from("order-1234"))
        .with_headers(headers)
}

async fn publish_with_context(env: &TestEnv, body: &serde_json::Value) {
    env.publisher
        .publish(
            &env.names.requests,
            "",
            body.to_string().as_bytes(),
            producer_properties(),
        )
        .await
        .expect("publish request");
}

/// Asserts that `properties` carry the producer's context and nothing it may not set.
fn assert_carried(properties: &BasicProperties, where_: &str) {
    assert_eq!(
        properties.correlation_id().as_ref().map(|c| c.as_str()),
        Some("order-1234"),
        "{where_}: correlation_id"
    );
    for (name, value) in [
        ("traceparent", TRACEPARENT),
        ("tracestate", TRACESTATE),
        ("x-tenant", "acme"),
    ] {
        assert_eq!(
            broker::header(properties, name).as_deref(),
            Some(value),
            "{where_}: {name}"
        );
    }
    assert_ne!(
        broker::header(properties, broker::DELAYED_UNTIL_HEADER).as_deref(),
        Some("forged"),
        "{where_}: a producer's x-sendquota-* header is never passed on"
    );
    assert_eq!(
        broker::header(properties, "x-death"),
        None,
        "{where_}: the broker's x-death is not carried"
    );
    let carried_cc = properties
        .headers()
        .as_ref()
        .is_some_and(|h| h.inner().contains_key("CC"));
    assert!(
        !carried_cc,
        "{where_}: a CC routing key would route the republish elsewhere too"
    );
}

/// Takes the first message that reaches `queue` within 20 s.
async fn first_in(env: &TestEnv, queue: &str) -> lapin::message::BasicGetMessage {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(m) = env.drain(queue).await.into_iter().next() {
            return m;
        }
        assert!(Instant::now() < deadline, "a message in {queue}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Dispatched, parked for quiet hours and back, and invalid: each copy carries the context.
#[tokio::test]
async fn the_producers_context_reaches_the_sender_and_every_queue_the_message_visits() {
    let config = policy!("quiet_from_22_to_7_delayed");
    let mut env = TestEnv::with_config(config).await;
    let clock = ManualClock::new(local("UTC", "2026-05-04 12:00"));
    env.start_worker(&clock);

    publish_with_context(&env, &request("day", "ana", "UTC")).await;
    let sent = first_in(&env, &env.dispatched_queue).await;
    assert_carried(&sent.delivery.properties, "dispatch");

    clock.set(local("UTC", "2026-05-04 23:00"));
    publish_with_context(&env, &request("night", "ana", "UTC")).await;
    let queue = env.names.delay_queue(broker::delay_tier(
        local("UTC", "2026-05-04 23:00"),
        local("UTC", "2026-05-05 07:00"),
    ));
    let parked = first_in(&env, &queue).await;
    assert_carried(&parked.delivery.properties, "delay queue");
    assert_eq!(
        broker::header(&parked.delivery.properties, broker::DELAYED_UNTIL_HEADER).as_deref(),
        Some("2026-05-05T07:00:00+00:00"),
        "the worker's own header is its own"
    );
    // Back from the delay queue, as the broker returns it, after the quiet hours.
    clock.set(local("UTC", "2026-05-05 07:00"));
    env.publisher
        .publish(
            &env.names.requests,
            "",
            &parked.delivery.data,
            parked.delivery.properties.clone(),
        )
        .await
        .expect("return the parked message");
    let later = first_in(&env, &env.dispatched_queue).await;
    assert_carried(&later.delivery.properties, "dispatch after the delay");

    publish_with_context(&env, &serde_json::json!({"id": "bad", "recipient": "ana"})).await;
    let invalid = first_in(&env, &env.names.invalid).await;
    assert_carried(&invalid.delivery.properties, "invalid queue");
    env.stop_worker().await;
}

/// A message Postgres refuses to record is quarantined with the producer's context, and a
/// quarantine replay sends it back to the requests exchange with it.
#[tokio::test]
async fn a_quarantined_message_keeps_the_producers_context_through_its_replay() {
    let mut env = TestEnv::new().await;
    let _worker = env.start_worker_quarantining_picky().await;
    publish_with_context(&env, &request("p2", "picky", "UTC")).await;
    let quarantined = first_in(&env, &env.names.quarantine).await;
    assert_carried(&quarantined.delivery.properties, "quarantine");
    env.stop_worker().await;

    // Back in quarantine (taken above), then replayed into a queue bound to the requests
    // exchange: the replay carries the context too.
    env.publisher
        .publish(
            "",
            &env.names.quarantine,
            &quarantined.delivery.data,
            quarantined.delivery.properties.clone(),
        )
        .await
        .expect("back to quarantine");
    let replayed = env.sink("replayed", &env.names.requests).await;
    let run = support::process::run_for(
        env.cli(&["quarantine", "replay"]),
        None,
        Duration::from_secs(30),
    );
    assert_eq!(run.code, Some(0), "{run:?}");
    let again = first_in(&env, &replayed).await;
    assert_carried(&again.delivery.properties, "quarantine replay");
}
