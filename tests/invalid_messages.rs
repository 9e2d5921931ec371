//! Every kind of bad input goes to the invalid queue with its reason, is acked, and does not
//! stop the worker: a valid message published after it is still decided.

mod support;

use std::collections::HashMap;

use sendquota::broker;
use sendquota::clock::ManualClock;
use support::{local, request, TestEnv};

/// Publishes `body`, then a valid message; returns the reason header of the one message that
/// reached the invalid queue, after checking its body is the original.
async fn reason_for(body: &[u8]) -> String {
    let mut env = TestEnv::new().await;
    let clock = ManualClock::new(local("UTC", "2026-02-02 09:00"));
    env.start_worker(&clock);
    env.publish_raw(body).await;
    env.publish(&request("valid", "alice", "UTC")).await;
    let mut seen = HashMap::new();
    assert!(
        env.outcome("valid", &mut seen).await,
        "the worker kept going"
    );
    env.stop_worker().await;
    let invalid = env.drain(&env.names.invalid).await;
    assert_eq!(invalid.len(), 1, "exactly one invalid message");
    assert_eq!(invalid[0].delivery.data, body, "the body is kept as it was");
    assert!(env.denials().await.is_empty());
    broker::header(&invalid[0].delivery.properties, broker::REASON_HEADER).expect("reason header")
}

#[tokio::test]
async fn bad_json_is_invalid() {
    let reason = reason_for(b"{not json").await;
    assert!(
        reason.starts_with("not a valid send request: key must be a string"),
        "{reason}"
    );
}

#[tokio::test]
async fn a_missing_id_is_invalid() {
    let reason = reason_for(br#"{"recipient":"a","channel":"sms"}"#).await;
    assert_eq!(reason, "missing field `id`");
}

#[tokio::test]
async fn a_missing_recipient_is_invalid() {
    let reason = reason_for(br#"{"id":"x","channel":"sms"}"#).await;
    assert_eq!(reason, "missing field `recipient`");
}

#[tokio::test]
async fn a_missing_channel_is_invalid() {
    let reason = reason_for(br#"{"id":"x","recipient":"a"}"#).await;
    assert_eq!(reason, "missing field `channel`");
}

#[tokio::test]
async fn an_unknown_time_zone_is_invalid() {
    let reason =
        reason_for(br#"{"id":"x","recipient":"a","channel":"sms","timezone":"Europe/Atlantis"}"#)
            .await;
    assert_eq!(reason, "unknown time zone \"Europe/Atlantis\"");
}

#[tokio::test]
async fn an_oversized_body_is_invalid() {
    let padding = "x".repeat(70_000);
    let body = format!(r#"{{"id":"x","recipient":"a","channel":"sms","payload":"{padding}"}}"#);
    let reason = reason_for(body.as_bytes()).await;
    assert_eq!(
        reason,
        format!("body is {} bytes, more than the limit of 65536", body.len())
    );
}

#[tokio::test]
async fn a_control_character_in_the_id_is_invalid() {
    let reason = reason_for(br#"{"id":"x\u0000y","recipient":"a","channel":"sms"}"#).await;
    assert_eq!(reason, "field `id` contains a control character");
}

#[tokio::test]
async fn a_control_character_in_the_recipient_is_invalid() {
    let reason = reason_for(br#"{"id":"x","recipient":"a\nb","channel":"sms"}"#).await;
    assert_eq!(reason, "field `recipient` contains a control character");
}

#[tokio::test]
async fn a_too_long_id_is_invalid() {
    let body = format!(
        r#"{{"id":"{}","recipient":"a","channel":"sms"}}"#,
        "i".repeat(129)
    );
    let reason = reason_for(body.as_bytes()).await;
    assert_eq!(
        reason,
        "field `id` is 129 characters, more than the limit of 128"
    );
}

/// 64 emoji are within the channel's 64 characters but are 256 bytes, one more than an AMQP
/// routing key holds: refused before any quota is taken, so the recipient's next message is
/// still allowed.
#[tokio::test]
async fn a_channel_over_255_bytes_is_invalid_and_takes_no_quota() {
    let body = format!(
        r#"{{"id":"emoji","recipient":"alice","channel":"{}"}}"#,
        "\u{1F600}".repeat(64)
    );
    let reason = reason_for(body.as_bytes()).await;
    assert_eq!(
        reason,
        "field `channel` is 256 bytes in UTF-8, more than AMQP's limit of 255"
    );
}

/// The id travels as the AMQP `message_id` property, also at most 255 bytes.
#[tokio::test]
async fn an_id_over_255_bytes_is_invalid_and_takes_no_quota() {
    let body = format!(
        r#"{{"id":"{}","recipient":"alice","channel":"sms"}}"#,
        "\u{00E9}".repeat(128)
    );
    let reason = reason_for(body.as_bytes()).await;
    assert_eq!(
        reason,
        "field `id` is 256 bytes in UTF-8, more than AMQP's limit of 255"
    );
}
