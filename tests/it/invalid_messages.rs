//! Every kind of bad input goes to the invalid queue with its reason, is acked, and does not
//! stop the worker: a valid message published after it is still decided.

use crate::support;

use std::collections::HashMap;

use sendquota::clock::ManualClock;
use sendquota::internals::broker;
use support::{local, request, TestEnv};

/// A fresh environment with the worker running, its clock on a Monday morning.
async fn with_worker() -> TestEnv {
    let mut env = TestEnv::new().await;
    env.start_worker(&ManualClock::new(local("UTC", "2026-02-02 09:00")));
    env
}

/// Publishes `body`, then a valid message; returns the reason header of the one message that
/// reached the invalid queue, after checking its body is the original.
async fn reason_for(body: &[u8]) -> String {
    let mut env = with_worker().await;
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

/// What a reason says after the field: a name is dot-separated words.
const NAME: &str =
    ": a name is one or more words of letters, digits, `_` and `-` joined by single \
                    dots, such as `sms` or `push.ios`";
/// What a reason says of a format character.
const CF: &str = "an invisible formatting or bidirectional control character (Unicode category Cf)";
/// What a reason says of a payload number past Postgres's scale.
const SCALE: &str =
    "which the denial history cannot store: Postgres's numeric keeps at most 16383 \
                     digits after the decimal point, zeros written at the end included";
/// What a reason says of a payload number past Postgres's weight.
const WEIGHT: &str = "which the denial history cannot store: Postgres's numeric keeps at most \
                      131072 digits before the decimal point";

/// Producer input that slipped through (a channel of a space or a topic wildcard, ids and
/// recipients with bidi overrides and line separators, payload numbers the denial history
/// cannot store) or was refused in serde_json's words (a lone surrogate was "unexpected end of
/// hex escape"): each goes through the real worker to the invalid queue, before any quota is
/// taken, with a reason that names the field and the problem; nothing is recorded or
/// quarantined, and the worker keeps deciding.
#[tokio::test]
async fn each_input_no_request_can_carry_lands_in_the_invalid_queue_with_a_reason_naming_it() {
    let table: Vec<(&str, String)> = vec![
        (
            r#"{"id":"c1","recipient":"a","channel":" "}"#,
            format!("field `channel` holds U+0020{NAME}"),
        ),
        (
            r#"{"id":"c2","recipient":"a","channel":"sms.#"}"#,
            format!("field `channel` holds `#` (U+0023){NAME}"),
        ),
        (
            r#"{"id":"c3","recipient":"a","channel":"sms.*"}"#,
            format!("field `channel` holds `*` (U+002A){NAME}"),
        ),
        (
            r#"{"id":"c4","recipient":"a","channel":"sms..ios"}"#,
            format!("field `channel` has an empty word (a leading, trailing or doubled dot){NAME}"),
        ),
        (
            r#"{"id":"c5","recipient":"a","channel":"\ud83d\ude00"}"#,
            format!("field `channel` holds U+1F600{NAME}"),
        ),
        (
            r#"{"id":"c6","recipient":"a","channel":"sms","category":"two words"}"#,
            format!("field `category` holds U+0020{NAME}"),
        ),
        (
            r#"{"id":"f1\u2028x","recipient":"a","channel":"sms"}"#,
            "field `id` contains U+2028, a line or paragraph separator".to_owned(),
        ),
        (
            r#"{"id":"f2","recipient":"evil\u202egpj.exe","channel":"sms"}"#,
            format!("field `recipient` contains U+202E, {CF}"),
        ),
        (
            r#"{"id":"f3","recipient":"a","channel":"s\u200bms"}"#,
            format!("field `channel` contains U+200B, {CF}"),
        ),
        (
            r#"{"id":"f4","recipient":"a","channel":"sms","category":"\ufeffx"}"#,
            format!("field `category` contains U+FEFF, {CF}"),
        ),
        (
            r#"{"id":"n1","recipient":"a","channel":"sms","payload":{"x":1e-20000}}"#,
            format!("field `payload` holds the number 1e-20000, {SCALE}"),
        ),
        (
            r#"{"id":"n2","recipient":"a","channel":"sms","payload":[1e131072]}"#,
            format!("field `payload` holds the number 1e131072, {WEIGHT}"),
        ),
        (
            r#"{"id":"n3","recipient":"a","channel":"sms","payload":1.0e-16383}"#,
            format!("field `payload` holds the number 1.0e-16383, {SCALE}"),
        ),
        (
            r#"{"id":"\ud800","recipient":"a","channel":"sms"}"#,
            r"field `id`: lone surrogate \ud800 in a string is not valid Unicode".to_owned(),
        ),
        (
            r#"{"id":"s2","recipient":"a","channel":"sms","payload":{"k":"\udc00"}}"#,
            r"field `payload`: lone surrogate \udc00 in a string is not valid Unicode".to_owned(),
        ),
        (
            r#"{"id":"t1","recipient":7,"channel":"sms"}"#,
            "field `recipient` must be a string, got a number".to_owned(),
        ),
        (
            r#"{"id":"t2","recipient":"a","channel":"sms","cost":2.5}"#,
            "field `cost` must be a whole number from 1 to 1000000, got 2.5".to_owned(),
        ),
        (
            r#"["t3","a","sms",null,null,null]"#,
            "not a valid send request: expected a JSON object, got an array".to_owned(),
        ),
    ];
    let mut env = with_worker().await;
    for (body, _) in &table {
        env.publish_raw(body.as_bytes()).await;
    }
    env.publish(&request("valid", "alice", "UTC")).await;
    let mut seen = HashMap::new();
    assert!(
        env.outcome("valid", &mut seen).await,
        "the worker kept going"
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while env.ready(&env.names.invalid).await < table.len() as u32 {
        assert!(
            std::time::Instant::now() < deadline,
            "every body in the invalid queue"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    env.stop_worker().await;
    let reasons = env.invalid_reasons().await;
    for (body, reason) in &table {
        assert_eq!(reasons.get(*body), Some(reason), "{body}");
    }
    assert_eq!(reasons.len(), table.len());
    assert!(env.denials().await.is_empty());
    assert!(env.drain(&env.names.quarantine).await.is_empty());
    let keys = env.keys().await;
    assert!(
        !keys.iter().any(|k| k.contains("{r:a}")),
        "no quota taken: {keys:?}"
    );
}

/// Payload numbers Postgres's numeric can hold, up to each of its limits, are kept: a denied
/// message carrying one is recorded with its payload as written, not quarantined. One digit
/// past a limit is invalid up front: no number reaches the denial history that it refuses.
#[tokio::test]
async fn payload_numbers_at_postgres_limits_are_recorded_and_one_past_them_are_invalid() {
    const STORED: [&str; 7] = [
        "1e131071",
        "-9.9e131071",
        "1e-16383",
        "1.5e-16382",
        "0e-16383",
        "1e400",
        "0e1073741822",
    ];
    const PAST: [&str; 5] = [
        "1e131072",
        "1e-16384",
        "1.0e-16383",
        "0e-16384",
        "0e1073741823",
    ];
    let mut env = with_worker().await;
    let mut seen = HashMap::new();
    env.publish(&request("first", "nora", "UTC")).await;
    assert!(
        env.outcome("first", &mut seen).await,
        "nora's message of the day"
    );
    let body = |id: &str, number: &str| {
        format!(r#"{{"id":"{id}","recipient":"nora","channel":"sms","payload":{{"n":{number}}}}}"#)
    };
    for (i, number) in PAST.iter().enumerate() {
        env.publish_raw(body(&format!("past-{i}"), number).as_bytes())
            .await;
    }
    for (i, number) in STORED.iter().enumerate() {
        let id = format!("kept-{i}");
        env.publish_raw(body(&id, number).as_bytes()).await;
        assert!(
            !env.outcome(&id, &mut seen).await,
            "{number}: denied and recorded"
        );
    }
    env.stop_worker().await;
    let rows = env.denials().await;
    for (i, number) in STORED.iter().enumerate() {
        let row = rows
            .iter()
            .find(|d| d.message_id == format!("kept-{i}"))
            .expect("a denial row");
        assert!(
            row.message
                .text()
                .contains(&format!(r#""payload":{{"n":{number}}}"#)),
            "{number}: {}",
            row.message.text()
        );
    }
    assert_eq!(env.drain(&env.names.invalid).await.len(), PAST.len());
    assert!(env.drain(&env.names.quarantine).await.is_empty());
}

/// The lowest `VmRSS` of process `pid` over a second, in KiB: the allocator gives freed pages
/// back to the system shortly after they are freed, not at once.
async fn settled_rss_kib(pid: u32) -> u64 {
    let mut lowest = u64::MAX;
    for _ in 0..10 {
        lowest = lowest.min(memory_kib(pid, "VmRSS:"));
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    lowest
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
/// docs/operations.md states: what the broker may hand it at once (the prefetch, at most the
/// broker's `max_message_size` each), held at most about twice (lapin's receive buffer, and the
/// frames of the invalid-queue publish). Once the waves are through, the worker holds about what it
/// held after the first: a leak would keep every wave's bodies resident.
#[tokio::test]
async fn oversized_bodies_go_to_the_invalid_queue_whole_within_bounded_memory() {
    const BODIES: usize = 16;
    const SIZE: usize = 4 << 20;
    const WAVES: usize = 3;
    // The worker's own defaults, quorum queues included.
    let env = TestEnv::with_queue_type("", sendquota::config::QueueType::Quorum).await;
    let mut worker = env
        .cli(&["worker", "--now", "2026-02-02T09:00:00Z"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start the worker");
    let mut seen = HashMap::new();
    env.publish(&request("before", "alice", "UTC")).await;
    assert!(env.outcome("before", &mut seen).await, "the worker is up");
    let base = memory_kib(worker.id(), "VmHWM:");
    let base_rss = memory_kib(worker.id(), "VmRSS:");
    let bodies_mib = (BODIES * SIZE) as f64 / (1 << 20) as f64;
    let mut peaks = Vec::new();
    let mut retained = Vec::new();
    for wave in 0..WAVES {
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
        let kept_mib = settled_rss_kib(worker.id()).await.saturating_sub(base_rss) as f64 / 1024.0;
        eprintln!(
            "wave {wave}: peak {grown_mib:.0} MiB over idle, {kept_mib:.0} MiB still resident, \
             for {bodies_mib:.0} MiB of bodies"
        );
        peaks.push(grown_mib);
        retained.push(kept_mib);
    }
    let _ = worker.kill();
    let _ = worker.wait();
    // The peak is cumulative: the last figure bounds every wave.
    assert!(
        peaks[WAVES - 1] <= 2.0 * bodies_mib,
        "{peaks:?} MiB grown for {bodies_mib:.0} MiB of bodies a wave"
    );
    // A leak would keep each wave's bodies (64 MiB) resident after it: two waves' worth more
    // after the third than after the first. The peak cannot tell: how many bodies of a wave
    // are held at once varies with the machine's load (a second wave's peak was 56 MiB above
    // the first's once under the whole suite, with no leak). What the allocator keeps of the
    // freed bodies varies too (33 MiB more after a second wave than after the first, once
    // under the whole suite), so the bound is one wave.
    assert!(
        retained[WAVES - 1] <= retained[0] + bodies_mib,
        "later waves left more resident: {retained:?} MiB"
    );
    let invalid = env.drain(&env.names.invalid).await;
    assert_eq!(invalid.len(), WAVES * BODIES);
    assert!(
        invalid.iter().all(|m| m.delivery.data.len() > SIZE),
        "kept whole"
    );
}
