//! An invalid request's reason repeats a value from the request by one rule, whatever field it
//! came in: quoted and escaped once as a Rust string literal (quotes, backslashes, control,
//! format and other invisible characters as escapes), cut after 40 characters with `...`
//! marking the cut. Checked in the reason headers the real worker writes to the invalid queue.

use crate::support;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use sendquota::clock::ManualClock;
use sendquota::internals::names::NAME_GRAMMAR;
use serde_json::json;
use support::{local, request, TestEnv};

/// A value made to be escaped: a quote, a backslash, a line break, a bidirectional override
/// and markup.
const HOSTILE: &str = "x\"y\\z\n\u{202e}<b>";

/// Publishes each body to a running worker and returns the reason the invalid queue's copy of
/// each carries, by body.
async fn reasons_of(bodies: &[String]) -> HashMap<String, String> {
    let mut env = TestEnv::new().await;
    env.start_worker(&ManualClock::new(local("UTC", "2026-02-02 09:00")));
    for body in bodies {
        env.publish_raw(body.as_bytes()).await;
    }
    env.publish(&request("valid", "alice", "UTC")).await;
    let mut seen = HashMap::new();
    assert!(
        env.outcome("valid", &mut seen).await,
        "the worker kept going"
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while env.ready(&env.names.invalid).await < bodies.len() as u32 {
        assert!(Instant::now() < deadline, "every body in the invalid queue");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    env.stop_worker().await;
    env.invalid_reasons().await
}

/// The same hostile value in the time zone, the priority, `expires_at`, the cost, an
/// attribute key and an unknown field's name is repeated the same way in each reason, escaped
/// exactly once; a long one is cut the same way.
#[tokio::test]
async fn a_hostile_value_is_escaped_exactly_once_and_alike_in_every_field_s_reason() {
    let quoted = format!("{HOSTILE:?}");
    assert_eq!(quoted, r#""x\"y\\z\n\u{202e}<b>""#, "the one rule");
    let long = "a\n".repeat(30);
    let body = |extra: (&str, serde_json::Value)| {
        let mut body = json!({"id": format!("h-{}", extra.0), "recipient": "a", "channel": "sms"});
        body[extra.0] = extra.1;
        body.to_string()
    };
    let table = [
        (
            body(("timezone", HOSTILE.into())),
            format!("unknown time zone {quoted}"),
        ),
        (
            body(("priority", HOSTILE.into())),
            format!("field `priority` must be critical, high, normal or low, got {quoted}"),
        ),
        (
            body(("expires_at", HOSTILE.into())),
            format!(
                "field `expires_at` must be an RFC 3339 instant with an offset, such as \
                 2026-05-01T09:00:00Z, got {quoted}"
            ),
        ),
        (
            body(("cost", HOSTILE.into())),
            format!("field `cost` must be a whole number from 1 to 1000000, got {quoted}"),
        ),
        (
            body((
                "attributes",
                serde_json::Value::Object([(HOSTILE.to_owned(), json!("v"))].into_iter().collect()),
            )),
            format!("field `attributes`: key {quoted} holds `\"` (U+0022): {NAME_GRAMMAR}"),
        ),
        (
            body(("priority", long.clone().into())).replace("h-priority", "h-long"),
            format!(
                "field `priority` must be critical, high, normal or low, got {:?}",
                format!("{}...", &long[..40])
            ),
        ),
    ];
    let unknown = format!(
        r#"{{"id":"h-unknown","recipient":"a","channel":"sms",{}:1}}"#,
        serde_json::to_string(HOSTILE).expect("json")
    );
    let mut bodies: Vec<String> = table.iter().map(|(b, _)| b.clone()).collect();
    bodies.push(unknown.clone());
    let reasons = reasons_of(&bodies).await;
    for (body, reason) in &table {
        assert_eq!(reasons.get(body), Some(reason), "{body}");
    }
    let reason = reasons.get(&unknown).expect("the unknown field's reason");
    assert!(
        reason.starts_with(&format!(
            "not a valid send request: unknown field {quoted}, expected one of `id`"
        )),
        "{reason}"
    );
    assert_eq!(reasons.len(), bodies.len());
}
