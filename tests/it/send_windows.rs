//! Rules that refuse by the local wall clock, through the real worker at default settings with
//! copies of a message in flight: a `send_window` rule parks a message sent outside its windows
//! until the next opening (across a clock change) and dispatches one sent inside; `check` says
//! the same; a `quiet_hours` rule with `days` refuses only in the quiet periods that start on
//! those weekdays, and names when they end.

use crate::support;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use sendquota::clock::ManualClock;
use sendquota::internals::broker;
use support::fixtures::policy;
use support::{local, request, TestEnv};

/// docs/rules.md's example: business hours in the recipient's zone.
const BUSINESS_HOURS: &str = policy!("business_hours_delayed");

/// Paris moves from 02:00 CET to 03:00 CEST on Sunday 2026-03-29.
const ZONE: &str = "Europe/Paris";

/// How long copies of a message take at most to be decided, each in turn.
const DECIDED_WITHIN: Duration = Duration::from_secs(20);

/// Waits until `queue` holds `n` messages, then takes them.
async fn parked(env: &TestEnv, queue: &str, n: u32) -> Vec<lapin::message::BasicGetMessage> {
    let deadline = Instant::now() + DECIDED_WITHIN;
    while env.ready(queue).await < n {
        assert!(
            Instant::now() < deadline,
            "{n} messages parked in {queue} within {DECIDED_WITHIN:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    env.drain(queue).await
}

/// Saturday 15:00 in Paris, after the Saturday window: three copies of a message are each
/// parked until Monday 09:00 CEST (07:00Z, past the clock change), in the 24-hour delay queue,
/// with no denial and nothing dispatched. Back at that instant, as the delay queue returns it,
/// the message goes out, and so does a message sent inside a window.
#[tokio::test]
async fn a_message_outside_the_send_windows_waits_for_the_next_opening_and_one_inside_goes_out() {
    let mut env = TestEnv::with_config(BUSINESS_HOURS).await;
    let saturday = local(ZONE, "2026-03-28 15:00");
    let clock = ManualClock::new(saturday);
    env.start_worker(&clock);
    for _ in 0..3 {
        env.publish(&request("late", "alice", ZONE)).await;
    }
    let opening = local(ZONE, "2026-03-30 09:00");
    assert_eq!(opening.to_rfc3339(), "2026-03-30T07:00:00+00:00");
    let queue = env.names.delay_queue(86_400_000);
    let copies = parked(&env, &queue, 3).await;
    assert_eq!(copies.len(), 3, "each copy parked once");
    for copy in &copies {
        let until = broker::header(&copy.delivery.properties, broker::DELAYED_UNTIL_HEADER);
        assert_eq!(until.as_deref(), Some("2026-03-30T07:00:00+00:00"));
        let body: serde_json::Value = serde_json::from_slice(&copy.delivery.data).expect("JSON");
        assert_eq!(body["id"], "late");
    }
    assert!(env.take_dispatched().await.is_empty());
    assert!(env.denials().await.is_empty());

    // `check` explains it: the rule's verdict and when it opens.
    let at = saturday.to_rfc3339();
    let checked = env.check(BUSINESS_HOURS, &at, &request("late-2", "alice", ZONE));
    assert_eq!(
        checked,
        serde_json::json!({
            "outcome": "delay",
            "rule": "business-hours",
            "retry_after": "2026-03-30T07:00:00Z",
            "rules": [{
                "rule": "business-hours",
                "kind": "send_window",
                "allowed": false,
                "remaining": null,
                "retry_after": "2026-03-30T07:00:00Z",
            }],
        })
    );

    clock.set(opening);
    env.publish_raw(&copies[0].delivery.data).await;
    env.publish(&request("inside", "bob", ZONE)).await;
    let mut seen = HashMap::new();
    assert!(env.outcome("late", &mut seen).await, "sent at the opening");
    assert!(
        env.outcome("inside", &mut seen).await,
        "sent inside a window"
    );
    env.stop_worker().await;
    assert!(env.denials().await.is_empty());
    assert_eq!(env.keys_without_expiry().await, Vec::<String>::new());
}

const WEEKEND_NIGHTS: &str = policy!("quiet_weekend_nights");

/// Quiet from 22:00 to 07:00 on the nights that start on Friday and Saturday, in Paris: a
/// message on Thursday and on Sunday night goes out; copies of one on Friday night are denied
/// until Saturday 07:00, one on Saturday night until Sunday 07:00 CEST (the clocks went forward
/// in between), each row naming the rule's days.
#[tokio::test]
async fn quiet_hours_on_some_days_refuse_only_the_nights_that_start_on_them() {
    let mut env = TestEnv::with_config(WEEKEND_NIGHTS).await;
    let clock = ManualClock::new(local(ZONE, "2026-03-26 23:00"));
    env.start_worker(&clock);
    let mut seen = HashMap::new();
    for _ in 0..3 {
        env.publish(&request("thu", "alice", ZONE)).await;
    }
    assert!(
        env.outcome("thu", &mut seen).await,
        "Thursday night is not quiet"
    );
    env.copies_decided().await;

    clock.set(local(ZONE, "2026-03-27 23:00"));
    for _ in 0..3 {
        env.publish(&request("fri", "alice", ZONE)).await;
    }
    assert!(
        !env.outcome("fri", &mut seen).await,
        "Friday night is quiet"
    );
    // Every copy is refused at Friday 23:00, before the clock moves on.
    env.copies_decided().await;
    clock.set(local(ZONE, "2026-03-28 23:30"));
    env.publish(&request("sat", "alice", ZONE)).await;
    assert!(
        !env.outcome("sat", &mut seen).await,
        "Saturday night is quiet"
    );
    clock.set(local(ZONE, "2026-03-29 23:00"));
    env.publish(&request("sun", "alice", ZONE)).await;
    assert!(
        env.outcome("sun", &mut seen).await,
        "Sunday night is not quiet"
    );
    env.stop_worker().await;
    for id in env.take_dispatched().await {
        *seen.entry(id).or_default() += 1;
    }

    let reason = "quiet hours 22:00 to 07:00 local time starting on fri, sat";
    let denied: Vec<_> = env
        .denials()
        .await
        .iter()
        .map(|d| {
            (
                d.message_id.clone(),
                d.rule.clone(),
                d.retry_after.map(|t| t.to_rfc3339()),
                d.reason.clone(),
            )
        })
        .collect();
    let row = |id: &str, until: &str| {
        (
            id.to_owned(),
            "weekend-nights".to_owned(),
            Some(until.to_owned()),
            reason.to_owned(),
        )
    };
    assert_eq!(
        denied,
        [
            row("fri", "2026-03-28T06:00:00+00:00"),
            row("sat", "2026-03-29T05:00:00+00:00"),
        ]
    );
    assert_eq!(
        (seen.get("thu"), seen.get("fri"), seen.get("sun")),
        (Some(&1), None, Some(&1)),
        "each copy of thu but one is a duplicate; no copy of fri goes out"
    );
    assert_eq!(env.keys_without_expiry().await, Vec::<String>::new());
}
