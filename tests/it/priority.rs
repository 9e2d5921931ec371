//! Priorities through the real worker at default settings, copies of each message in flight:
//! a critical message passes a cap that a promotion already used (exempt, not counted), or
//! passes it and uses the slot itself (exempt, counted); a rule that keeps its last slot for
//! high priorities until 18:00 local parks a normal message until then and lets a high one
//! through, and a refusal under it lasts until the first instant that admits the message (the
//! README's example, through `check`, and a delay rule's parking); an exempt message that
//! counts cannot take a slot kept for a higher priority; `check` says which of these applied;
//! a priority that is not one is invalid.

use crate::support;

use std::collections::HashMap;

use sendquota::clock::ManualClock;
use sendquota::internals::broker;
use support::fixtures::policy;
use support::{local, request, TestEnv};

const ZONE: &str = "Europe/Berlin";

/// A request of `priority` (none: the field left out, which is `normal`).
fn prioritized(id: &str, recipient: &str, priority: Option<&str>) -> serde_json::Value {
    let mut body = request(id, recipient, ZONE);
    if let Some(p) = priority {
        body["priority"] = p.into();
    }
    body
}

/// Publishes `copies` copies of `message` back to back.
async fn publish_copies(env: &TestEnv, message: &serde_json::Value, copies: usize) {
    for _ in 0..copies {
        env.publish(message).await;
    }
}

/// Yesterday's kind of promotion takes the day's slot; the password reset after it still goes
/// out, and the next promotion is denied: the critical one was not counted.
#[tokio::test]
async fn a_critical_message_passes_a_cap_the_day_already_used() {
    let config = policy!("daily_critical_exempt");
    let mut env = TestEnv::with_config(config).await;
    let clock = ManualClock::new(local(ZONE, "2026-06-01 09:00"));
    env.start_worker(&clock);
    let mut seen = HashMap::new();
    publish_copies(&env, &prioritized("promo-1", "ana", None), 3).await;
    assert!(env.outcome("promo-1", &mut seen).await, "the day's first");
    publish_copies(&env, &prioritized("reset", "ana", Some("critical")), 3).await;
    assert!(env.outcome("reset", &mut seen).await, "critical passes");
    publish_copies(&env, &prioritized("promo-2", "ana", Some("normal")), 3).await;
    assert!(!env.outcome("promo-2", &mut seen).await, "the day is used");
    env.copies_decided().await;
    env.stop_worker().await;
    assert_eq!(seen.get("promo-1"), Some(&1), "each dispatched once");
    assert_eq!(seen.get("reset"), Some(&1));
    let rows = env.denials().await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(
        (rows[0].message_id.as_str(), rows[0].rule.as_str()),
        ("promo-2", "daily")
    );

    let at = local(ZONE, "2026-06-01 10:00").to_rfc3339();
    let checked = env.check(
        config,
        &at,
        &prioritized("reset-2", "ben", Some("critical")),
    );
    assert_eq!(
        checked,
        serde_json::json!({
            "outcome": "allow", "rule": null, "retry_after": null, "rules": [],
            "not_matched": [{"rule": "daily", "exempt_priority": "critical"}],
        })
    );
}

/// With `exempt_counts`, the critical message goes out however full the day is, and takes the
/// slot when there is one: the promotion after it is denied.
#[tokio::test]
async fn an_exempt_message_that_counts_takes_the_slot_and_is_never_held_back() {
    let config = policy!("daily_critical_and_high_exempt_and_counted");
    let mut env = TestEnv::with_config(config).await;
    let clock = ManualClock::new(local(ZONE, "2026-06-01 09:00"));
    env.start_worker(&clock);
    let mut seen = HashMap::new();
    publish_copies(&env, &prioritized("code", "ana", Some("critical")), 3).await;
    assert!(env.outcome("code", &mut seen).await);
    publish_copies(&env, &prioritized("promo", "ana", Some("low")), 3).await;
    assert!(
        !env.outcome("promo", &mut seen).await,
        "the code took the slot"
    );
    publish_copies(&env, &prioritized("alert", "ana", Some("high")), 3).await;
    assert!(
        env.outcome("alert", &mut seen).await,
        "full, and still sent"
    );
    env.copies_decided().await;
    env.stop_worker().await;
    let denied: Vec<String> = env
        .denials()
        .await
        .into_iter()
        .map(|d| d.message_id.clone())
        .collect();
    assert_eq!(denied, ["promo"], "the exempt refusal is not recorded");
    assert_eq!((seen.get("code"), seen.get("alert")), (Some(&1), Some(&1)));
}

/// The day's only slot is kept for high and critical messages until 18:00 Berlin time: a
/// normal message at 09:00 is parked until 18:00 (16:00Z), a high one goes out, and at 18:00
/// anyone may take what is left.
#[tokio::test]
async fn a_reserved_slot_parks_a_normal_message_until_the_reservation_lapses() {
    let config = policy!("daily_slot_kept_for_high_until_18_delayed");
    let mut env = TestEnv::with_config(config).await;
    let morning = local(ZONE, "2026-06-01 09:00");
    let clock = ManualClock::new(morning);
    env.start_worker(&clock);
    publish_copies(&env, &prioritized("digest", "ana", None), 3).await;
    let mut seen = HashMap::new();
    publish_copies(&env, &prioritized("otp", "ben", Some("high")), 3).await;
    assert!(
        env.outcome("otp", &mut seen).await,
        "high takes the kept slot"
    );
    env.copies_decided().await;
    let queue = env
        .names
        .delay_queue(broker::delay_tier(morning, local(ZONE, "2026-06-01 18:00")));
    let parked = env.drain(&queue).await;
    assert_eq!(parked.len(), 3, "each copy of the normal message parked");
    for copy in &parked {
        let until = broker::header(&copy.delivery.properties, broker::DELAYED_UNTIL_HEADER);
        assert_eq!(until.as_deref(), Some("2026-06-01T16:00:00+00:00"));
    }
    assert!(env.denials().await.is_empty());

    let at = morning.to_rfc3339();
    let checked = env.check(config, &at, &prioritized("digest-2", "cem", None));
    assert_eq!(checked["outcome"], "delay");
    assert_eq!(checked["retry_after"], "2026-06-01T16:00:00Z");
    assert_eq!(
        checked["rules"][0]["reserved_until"],
        "2026-06-01T16:00:00Z"
    );
    assert_eq!(checked["rules"][0]["remaining"], 0);

    clock.set(local(ZONE, "2026-06-01 18:00"));
    env.publish_raw(&parked[0].delivery.data).await;
    assert!(
        env.outcome("digest", &mut seen).await,
        "sent once it lapsed"
    );
    env.stop_worker().await;
    assert_eq!(seen.get("otp"), Some(&1));
}

/// What `sendquota check --at <at>` prints for `message` under `config`, committing it with
/// `commit`.
fn check(
    env: &TestEnv,
    config: &str,
    at: &str,
    message: &serde_json::Value,
    commit: bool,
) -> serde_json::Value {
    let mut args = vec!["check", "--at", at, "--message"];
    let body = message.to_string();
    args.push(&body);
    args.extend(commit.then_some("--commit"));
    let out = env.cli_with(config, &args).output().expect("run check");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("check prints JSON")
}

/// A request in UTC of `priority`.
fn in_utc(id: &str, recipient: &str, priority: &str) -> serde_json::Value {
    let mut body = request(id, recipient, "UTC");
    body["priority"] = priority.into();
    body
}

/// The README's priority example (1 a day, 3 a week, critical exempt, the day's slot kept for
/// high and above until 18:00) in UTC: once a high message took the day's slot at 09:00, a
/// normal message is refused until 18:00 the next day, the first instant that admits it (the
/// next morning the slot is kept again), whether asked before today's lapse, at it, after it
/// or the next morning; a millisecond before that instant it is still refused.
#[tokio::test]
async fn a_refusal_under_a_reservation_names_the_first_instant_that_admits_the_message() {
    let config = policy!("headline_reserved");
    let env = TestEnv::with_config(config).await;
    let high = check(
        &env,
        config,
        "2026-06-01T09:00:00Z",
        &in_utc("otp", "ana", "high"),
        true,
    );
    assert_eq!(high["outcome"], "allow", "{high}");
    let promo = in_utc("promo", "ana", "normal");
    for at in [
        "2026-06-01T10:00:00Z",
        "2026-06-01T18:00:00Z",
        "2026-06-01T19:00:00Z",
        "2026-06-02T00:00:00Z",
        "2026-06-02T17:59:59.999Z",
    ] {
        let refused = check(&env, config, at, &promo, false);
        assert_eq!(
            (refused["outcome"].as_str(), refused["retry_after"].as_str()),
            (Some("deny"), Some("2026-06-02T18:00:00Z")),
            "asked at {at}: {refused}"
        );
    }
    let admitted = check(&env, config, "2026-06-02T18:00:00Z", &promo, false);
    assert_eq!(admitted["outcome"], "allow", "{admitted}");
}

/// A high message exempt from a cap that still counts it cannot take the slot kept for
/// critical messages until 09:00: at 07:00 it goes out uncounted, and the critical message at
/// 08:00 takes the kept slot. After the lapse a high message takes a free slot again, so the
/// normal message after it is denied.
#[tokio::test]
async fn an_exempt_message_that_counts_leaves_the_reserved_slot_to_the_higher_priority() {
    let config = policy!("exempt_below_reserve");
    let env = TestEnv::with_config(config).await;
    let high = check(
        &env,
        config,
        "2026-06-01T07:00:00Z",
        &in_utc("alert", "ana", "high"),
        true,
    );
    assert_eq!(high["outcome"], "allow", "{high}");
    assert_eq!(
        (
            &high["rules"][0]["exempt"],
            &high["rules"][0]["allowed"],
            &high["rules"][0]["reserved_until"]
        ),
        (
            &serde_json::json!(true),
            &serde_json::json!(false),
            &serde_json::json!("2026-06-01T09:00:00Z")
        ),
        "sent, not counted: {high}"
    );
    let critical = check(
        &env,
        config,
        "2026-06-01T08:00:00Z",
        &in_utc("reset", "ana", "critical"),
        true,
    );
    assert_eq!(critical["outcome"], "allow", "{critical}");

    let later = check(
        &env,
        config,
        "2026-06-01T10:00:00Z",
        &in_utc("alert", "ben", "high"),
        true,
    );
    assert_eq!(
        (&later["outcome"], &later["rules"][0]["allowed"]),
        (&serde_json::json!("allow"), &serde_json::json!(true)),
        "a free slot taken: {later}"
    );
    let promo = check(
        &env,
        config,
        "2026-06-01T11:00:00Z",
        &in_utc("promo", "ben", "normal"),
        false,
    );
    assert_eq!(promo["outcome"], "deny", "{promo}");
}

/// With the day's only slot kept for high messages until 18:00 Berlin time and taken by one, a
/// delay rule parks a normal message sent at 09:00 until 18:00 the next day (16:00Z), the
/// first instant that admits it, in the delay queue for that wait: not until today's 18:00,
/// when the day is full, in a shorter one.
#[tokio::test]
async fn a_delay_rule_parks_a_message_kept_from_the_reserved_slot_until_it_is_admitted() {
    let config = policy!("daily_slot_kept_for_high_until_18_delayed");
    let mut env = TestEnv::with_config(config).await;
    let morning = local(ZONE, "2026-06-01 09:00");
    let clock = ManualClock::new(morning);
    env.start_worker(&clock);
    let mut seen = HashMap::new();
    env.publish(&prioritized("otp", "ana", Some("high"))).await;
    assert!(
        env.outcome("otp", &mut seen).await,
        "high takes the day's slot"
    );
    env.publish(&prioritized("digest", "ana", None)).await;
    env.copies_decided().await;
    env.stop_worker().await;
    let admitted_at = local(ZONE, "2026-06-02 18:00");
    let queue = env
        .names
        .delay_queue(broker::delay_tier(morning, admitted_at));
    let parked = env.drain(&queue).await;
    assert_eq!(
        parked.len(),
        1,
        "parked in the queue for the wait until {admitted_at}"
    );
    let until = broker::header(&parked[0].delivery.properties, broker::DELAYED_UNTIL_HEADER);
    assert_eq!(until.as_deref(), Some("2026-06-02T16:00:00+00:00"));
}

/// A priority that is not one of the four is refused before any quota is taken, naming the
/// field and the choices.
#[tokio::test]
async fn an_unknown_priority_is_invalid_with_the_choices() {
    let mut env = TestEnv::new().await;
    let clock = ManualClock::new(local(ZONE, "2026-06-01 09:00"));
    env.start_worker(&clock);
    env.publish(&prioritized("urgent", "ana", Some("urgent")))
        .await;
    env.publish(&prioritized("fine", "ana", Some("low"))).await;
    let mut seen = HashMap::new();
    assert!(
        env.outcome("fine", &mut seen).await,
        "the day's slot is still free"
    );
    env.copies_decided().await;
    let invalid = env.drain(&env.names.invalid).await;
    assert_eq!(invalid.len(), 1);
    let reason = broker::header(&invalid[0].delivery.properties, broker::REASON_HEADER);
    assert_eq!(
        reason.as_deref(),
        Some("field `priority` must be critical, high, normal or low, got \"urgent\"")
    );
    env.stop_worker().await;
}
