//! A leap second (`23:59:60Z`): RFC 3339 can write it and chrono reads it, but the worker's
//! clock, Unix time, has no such second. One rule for every instant from outside: refused, as
//! an `expires_at` (to the invalid queue, with a reason like any other bad instant's), as
//! `check --at`, `denials --since`, and the API's `?at=` and `?since=`.

use crate::support;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use sendquota::clock::ManualClock;
use support::fixtures::policy;
use support::http::http;
use support::process::Run;
use support::{local, request, TestEnv, ADMIN_TOKEN};

const HEADLINE: &str = policy!("headline");

/// What a refused leap second's reason says after the field.
const LEAP: &str = "must not be a leap second (a 60th second): the worker's clock has none";

#[tokio::test]
async fn a_leap_second_is_refused_as_a_deadline_and_wherever_else_an_instant_comes_from() {
    let mut env = TestEnv::with_config(HEADLINE).await;
    let clock = ManualClock::new(local("UTC", "2016-12-31 09:00"));
    let port = env.start_admin_worker(&clock).await;
    let leaps = ["2016-12-31T23:59:60Z", "2017-01-01T05:29:60.500+05:30"];
    let mut expected = HashMap::new();
    for (i, at) in leaps.iter().enumerate() {
        let body = format!(
            r#"{{"id":"leap-{i}","recipient":"alice","channel":"sms","expires_at":"{at}"}}"#
        );
        env.publish_raw(body.as_bytes()).await;
        expected.insert(body, format!("field `expires_at` {LEAP}, got \"{at}\""));
    }
    let mut seen = HashMap::new();
    env.publish(&request("valid", "alice", "UTC")).await;
    assert!(
        env.outcome("valid", &mut seen).await,
        "no leap second took alice's day"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while env.ready(&env.names.invalid).await < leaps.len() as u32 {
        assert!(
            Instant::now() < deadline,
            "both leap seconds in the invalid queue; dispatched: {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let reasons = env.invalid_reasons().await;
    assert_eq!(reasons, expected);

    let message = r#"{"id":"m","recipient":"bob","channel":"sms"}"#;
    let Run { code, stderr, .. } = env
        .run_cli("", &["check", "--message", message, "--at", leaps[0]])
        .await;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("--at: 2016-12-31T23:59:60Z is a leap second"),
        "{stderr}"
    );
    let Run { code, stderr, .. } = env.run_cli("", &["denials", "--since", leaps[1]]).await;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("2016-12-31T23:59:60.500Z is a leap second"),
        "{stderr}"
    );
    let api = http(
        port,
        "POST",
        "/v1/check?at=2016-12-31T23%3A59%3A60Z",
        Some(ADMIN_TOKEN),
        message,
    )
    .await;
    assert_eq!(api.status, 400, "{}", api.body);
    assert!(api.body.contains("is a leap second"), "{}", api.body);
    let api = http(
        port,
        "GET",
        "/v1/denials?since=2016-12-31T23%3A59%3A60Z",
        Some(ADMIN_TOKEN),
        "",
    )
    .await;
    assert_eq!(api.status, 400, "{}", api.body);
    assert!(api.body.contains("is a leap second"), "{}", api.body);
    env.stop_worker().await;
}
