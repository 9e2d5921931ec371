//! Every kind of bad input goes to the invalid queue with its reason, is acked, and does not
//! stop the worker: a valid message published after it is still decided.

use crate::support;

use std::collections::HashMap;

use sendquota::clock::ManualClock;
use sendquota::internals::broker;
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

/// `VmHWM` (peak resident memory) or `VmRSS` of process `pid`, in KiB.
fn memory_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .expect("the worker's /proc status")
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .expect("a memory figure")
}

/// Hostile bodies far over `max_body_bytes` (here waves of 16 bodies of 4 MiB, on a broker that
/// accepts them) go to the invalid queue whole, and the worker's memory stays within the bound
/// the README states: what the broker may hand it at once (the prefetch, at most the broker's
/// `max_message_size` each), held at most about twice (lapin's receive buffer, and the frames
/// of the invalid-queue publish). The allocator keeps what it took for the next bodies: a
/// second wave takes no more.
#[tokio::test]
async fn oversized_bodies_go_to_the_invalid_queue_whole_within_bounded_memory() {
    const BODIES: usize = 16;
    const SIZE: usize = 4 << 20;
    // The worker's own defaults, quorum queues included.
    let env = TestEnv::with_queue_type("", sendquota::config::QueueType::Quorum).await;
    let mut worker = env
        .worker_command()
        .args(["worker", "--now", "2026-02-02T09:00:00Z"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start the worker");
    let mut seen = HashMap::new();
    env.publish(&request("before", "alice", "UTC")).await;
    assert!(env.outcome("before", &mut seen).await, "the worker is up");
    let base = memory_kib(worker.id(), "VmHWM:");
    let bodies_mib = (BODIES * SIZE) as f64 / (1 << 20) as f64;
    let mut peaks = Vec::new();
    for wave in 0..2 {
        for i in 0..BODIES {
            let body = format!(r#"{{"id":"big-{wave}-{i}","pad":"{}"}}"#, "x".repeat(SIZE));
            env.publish_raw(body.as_bytes()).await;
        }
        let after = format!("after-{wave}");
        env.publish(&request(&after, &after, "UTC")).await;
        assert!(
            env.outcome(&after, &mut seen).await,
            "the worker kept going"
        );
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while env.ready(&env.names.invalid).await < (BODIES * (wave + 1)) as u32 {
            assert!(
                std::time::Instant::now() < deadline,
                "bodies not in the invalid queue"
            );
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        let grown_mib = memory_kib(worker.id(), "VmHWM:").saturating_sub(base) as f64 / 1024.0;
        eprintln!(
            "wave {wave}: peak {grown_mib:.0} MiB over idle, for {bodies_mib:.0} MiB of bodies"
        );
        peaks.push(grown_mib);
    }
    let _ = worker.kill();
    let _ = worker.wait();
    assert!(
        peaks[0] <= 2.0 * bodies_mib,
        "{:.0} MiB grown for {bodies_mib:.0} MiB of bodies",
        peaks[0]
    );
    assert!(
        peaks[1] <= peaks[0] + bodies_mib / 4.0,
        "the second wave took more: {peaks:?} MiB"
    );
    let invalid = env.drain(&env.names.invalid).await;
    assert_eq!(invalid.len(), 2 * BODIES);
    assert!(
        invalid.iter().all(|m| m.delivery.data.len() > SIZE),
        "kept whole"
    );
}
