//! Policies with several rules through the real worker: every kind next to the headline rule,
//! all-or-nothing inside a scope, exact refunds across scopes, shadow and delay outcomes.

use crate::support;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use redis::AsyncCommands;
use sendquota::clock::ManualClock;
use support::fixtures::policy;
use support::{local, request, TestEnv};

async fn members(env: &TestEnv, key: &str) -> Vec<String> {
    env.redis.clone().zrange(key, 0, -1).await.expect("zrange")
}

fn headline_key(env: &TestEnv, recipient: &str) -> String {
    format!(
        "{}:{{r:{recipient}}}:headline:calendar_quota",
        env.namespace
    )
}

/// Alice's message passes both rules; Bob's first message passes the headline rule (his own
/// quota) but the global rule refuses it: Bob's headline quota must be refunded exactly.
async fn second_rule_refuses_and_headline_is_refunded(rule: &str, first_at: &str, second_at: &str) {
    let config = policy!("headline_and_a_global_second_rule", rule = rule);
    let mut env = TestEnv::with_config(&config).await;
    let clock = ManualClock::new(local("UTC", first_at));
    env.start_worker(&clock);
    let mut seen = HashMap::new();
    env.publish(&request("a1", "alice", "UTC")).await;
    assert!(
        env.outcome("a1", &mut seen).await,
        "alice's message passes both rules"
    );
    clock.set(local("UTC", second_at));
    env.publish(&request("b1", "bob", "UTC")).await;
    assert!(
        !env.outcome("b1", &mut seen).await,
        "the second rule refuses bob's message"
    );
    env.stop_worker().await;
    let denials = env.denials().await;
    assert_eq!(denials.len(), 1);
    assert_eq!(
        (denials[0].message_id.as_str(), denials[0].rule.as_str()),
        ("b1", "second")
    );
    assert_eq!(members(&env, &headline_key(&env, "alice")).await, ["a1"]);
    assert!(
        members(&env, &headline_key(&env, "bob")).await.is_empty(),
        "bob's headline quota was refunded"
    );
    assert_eq!(env.keys_without_expiry().await, Vec::<String>::new());
}

macro_rules! next_to_headline {
    ($($name:ident: $rule:expr,)*) => {$(
        #[tokio::test]
        async fn $name() {
            second_rule_refuses_and_headline_is_refunded(
                $rule,
                "2026-04-01 09:59",
                "2026-04-01 10:01",
            )
            .await;
        }
    )*};
}

next_to_headline! {
    fixed_window_next_to_headline: "kind = \"fixed_window\"\nlimit = 1\nwindow = \"1h\"",
    sliding_window_hash_next_to_headline:
        "kind = \"sliding_window\"\nlimit = 1\nwindow = \"1h\"\nsub_window = \"1m\"",
    sliding_window_list_next_to_headline:
        "kind = \"sliding_window\"\nlimit = 1\nwindow = \"1h\"\nsub_window = \"1m\"\nstorage = \"list\"",
    sliding_log_next_to_headline: "kind = \"sliding_log\"\nsub_window = \"1m\"\npolicies = [{ limit = 1, window = \"1h\" }, { limit = 2, window = \"2h\" }]",
    leaky_bucket_next_to_headline: "kind = \"leaky_bucket\"\ncapacity = 1\nrate = 1\nperiod = \"1h\"",
    token_bucket_next_to_headline: "kind = \"token_bucket\"\ncapacity = 1\nrate = 1\nperiod = \"1h\"",
    gcra_next_to_headline: "kind = \"gcra\"\nrate = 1\nperiod = \"1h\"\nburst = 1",
    zset_window_next_to_headline: "kind = \"zset_window\"\nlimit = 1\nwindow = \"1h\"",
    quiet_hours_next_to_headline: "kind = \"quiet_hours\"\nstart = \"10:00\"\nend = \"11:00\"",
    // 2026-04-01 is a Wednesday.
    send_window_next_to_headline: "kind = \"send_window\"\nwindows = { wed = [\"00:00-10:00\"] }",
}

#[tokio::test]
async fn a_message_refused_by_one_rule_of_a_scope_consumes_nothing_in_the_others() {
    let config = policy!("headline_and_one_in_three_days");
    let mut env = TestEnv::with_config(config).await;
    let clock = ManualClock::new(local("UTC", "2026-04-01 09:00"));
    env.start_worker(&clock);
    let mut seen = HashMap::new();
    env.publish(&request("m1", "alice", "UTC")).await;
    assert!(env.outcome("m1", &mut seen).await);
    // A new day: the headline rule would allow, the 3-day fixed window does not.
    clock.set(local("UTC", "2026-04-02 09:00"));
    env.publish(&request("m2", "alice", "UTC")).await;
    assert!(!env.outcome("m2", &mut seen).await);
    env.stop_worker().await;
    assert_eq!(members(&env, &headline_key(&env, "alice")).await, ["m1"]);
    let denial = &env.denials().await[0];
    assert_eq!(denial.rule, "spacing");
    assert_eq!(denial.reason, "at most 1 per 3d fixed window");
    assert_eq!(denial.retry_after, Some(local("UTC", "2026-04-04 09:00")));
}

#[tokio::test]
async fn a_shadow_rule_records_what_it_would_deny_and_the_message_is_dispatched() {
    let config = policy!("headline_five_a_day_and_a_shadow_trial_rule");
    let mut env = TestEnv::with_config(config).await;
    let clock = ManualClock::new(local("UTC", "2026-04-01 09:00"));
    env.start_worker(&clock);
    let mut seen = HashMap::new();
    env.publish(&request("m1", "alice", "UTC")).await;
    assert!(env.outcome("m1", &mut seen).await);
    env.publish(&request("m2", "alice", "UTC")).await;
    // Shadow denials are dispatched (their row is written first).
    env.dispatched("m2", &mut seen).await;
    env.stop_worker().await;
    let denials = env.denials().await;
    assert_eq!(denials.len(), 1);
    assert_eq!(
        (
            denials[0].message_id.as_str(),
            denials[0].rule.as_str(),
            denials[0].shadow
        ),
        ("m2", "trial", true)
    );
    // The headline rule counted both dispatched messages.
    assert_eq!(
        members(&env, &headline_key(&env, "alice")).await,
        ["m1", "m2"]
    );
}

#[tokio::test]
async fn a_delay_rule_parks_the_message_until_it_allows_then_dispatches_it_once() {
    let config = policy!("pace_one_per_10s_delayed");
    let mut env = TestEnv::with_config(config).await;
    let clock = ManualClock::new(local("UTC", "2026-04-01 09:00"));
    env.start_worker(&clock);
    let mut seen = HashMap::new();
    env.publish(&request("m1", "alice", "UTC")).await;
    assert!(env.outcome("m1", &mut seen).await);
    env.publish(&request("m2", "alice", "UTC")).await;
    // With the clock standing still, m2 keeps coming back from the shortest delay queue and is
    // parked again; it is neither dispatched nor denied.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    for id in env.take_dispatched().await {
        *seen.entry(id).or_default() += 1;
    }
    assert!(!seen.contains_key("m2"), "not dispatched before its time");
    clock.set(local("UTC", "2026-04-01 09:00:10"));
    let deadline = Instant::now() + Duration::from_secs(10);
    while !seen.contains_key("m2") {
        assert!(Instant::now() < deadline, "m2 came back and was dispatched");
        for id in env.take_dispatched().await {
            *seen.entry(id).or_default() += 1;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    env.stop_worker().await;
    assert_eq!(seen.get("m2"), Some(&1));
    assert!(env.denials().await.is_empty(), "a delay is not a denial");
}

#[tokio::test]
async fn changing_a_rules_limits_keeps_its_counters() {
    use sendquota::config::Settings;
    use sendquota::internals::limiter::Limiter;
    use sendquota::internals::message::SendRequest;
    let env = TestEnv::new().await;
    let rule = |limit: u32| {
        Settings::from_toml(
            &policy!("fixed_window_w_of_limit_per_hour", limit = limit),
            |_| None,
        )
        .expect("valid")
        .policy
    };
    let limiter = Limiter::new(env.redis.clone(), &env.namespace);
    let at = local("UTC", "2026-04-01 09:00");
    let message = |id: &str| {
        SendRequest::decode(request(id, "alice", "UTC").to_string().as_bytes(), 1 << 16)
            .expect("valid")
    };
    let first = limiter
        .evaluate(&rule(3), &message("m1"), at, true)
        .await
        .expect("evaluate");
    assert_eq!(first.verdicts()[0].remaining, Some(2));
    // The limit drops to 1: the send already counted fills the new window.
    let second = limiter
        .evaluate(&rule(1), &message("m2"), at, true)
        .await
        .expect("evaluate");
    assert!(!second.verdicts()[0].allowed);
    // And back up to 3: one counted, one more admitted, one left.
    let third = limiter
        .evaluate(&rule(3), &message("m3"), at, true)
        .await
        .expect("evaluate");
    assert_eq!(third.verdicts()[0].remaining, Some(1));
}

/// A scope of thousands of rules is decided in one call and each rule's result comes back in
/// its place: the script's reply is a string of five numbers a rule, longer than Lua hands to
/// one call at once (about 8,000 values), so it is written in slices.
#[tokio::test]
async fn a_scope_of_two_thousand_rules_is_decided_with_every_rules_result_in_its_place() {
    use sendquota::config::Settings;
    use sendquota::internals::limiter::Limiter;
    use sendquota::internals::message::SendRequest;
    const RULES: u32 = 2_000;
    let env = TestEnv::new().await;
    let toml: String = (1..=RULES)
        .map(|i| {
            format!(
                "[[rules]]\nname = \"w{i}\"\nkind = \"fixed_window\"\nlimit = {}\nwindow = \"1h\"\n",
                i + 1
            )
        })
        .collect();
    let policy = Settings::from_toml(&toml, |_| None).expect("valid").policy;
    let limiter = Limiter::new(env.redis.clone(), &env.namespace);
    let message = SendRequest::decode(
        request("m1", "alice", "UTC").to_string().as_bytes(),
        1 << 16,
    )
    .expect("valid");
    let decided = limiter
        .evaluate(&policy, &message, local("UTC", "2026-04-01 09:00"), true)
        .await
        .expect("evaluate");
    assert!(decided.committed());
    let remaining: Vec<Option<i64>> = decided.verdicts().iter().map(|v| v.remaining).collect();
    let expected: Vec<Option<i64>> = (1..=RULES).map(|i| Some(i64::from(i))).collect();
    assert_eq!(remaining, expected);
}

/// A denial's retry_after is an instant at which the message would be admitted: denied at
/// 23:30 by the headline rule, whose day ends at midnight, while quiet hours run from 00:00 to
/// 01:00, the message may go at 01:00, not at midnight (a replay `--due` then would only be
/// refused again).
#[tokio::test]
async fn retry_after_skips_a_quiet_period_that_begins_when_the_refusal_ends() {
    let config = policy!("headline_and_quiet_from_midnight_to_one");
    let mut env = TestEnv::with_config(config).await;
    let clock = ManualClock::new(local("UTC", "2026-04-01 22:00"));
    env.start_worker(&clock);
    let mut seen = HashMap::new();
    env.publish(&request("n1", "nina", "UTC")).await;
    assert!(env.outcome("n1", &mut seen).await);
    clock.set(local("UTC", "2026-04-01 23:30"));
    env.publish(&request("n2", "nina", "UTC")).await;
    assert!(!env.outcome("n2", &mut seen).await);
    env.stop_worker().await;
    let denials = env.denials().await;
    assert_eq!(denials.len(), 1);
    assert_eq!(denials[0].rule, "headline");
    assert_eq!(
        denials[0].retry_after,
        Some(local("UTC", "2026-04-02 01:00")),
        "the first instant both rules admit"
    );
}

/// `check`, `POST /v1/check` and the worker give one answer. Nina had today's message; asked
/// at 15:00 (Paris), the headline rule frees her at midnight, which falls in the quiet period
/// of 22:00 to 08:00: all three say 08:00 tomorrow, the first instant both rules admit.
#[tokio::test]
async fn check_the_admin_check_and_the_worker_give_the_same_retry_after_past_quiet_hours() {
    const ZONE: &str = "Europe/Paris";
    const TOKEN: &str = support::ADMIN_TOKEN;
    let config = policy!("headline_and_quiet_nights_delayed");
    let mut env = TestEnv::with_config(config).await;
    let clock = ManualClock::new(local(ZONE, "2026-04-01 09:00"));
    let port = env.start_admin_worker(&clock).await;
    let mut seen = HashMap::new();
    env.publish(&request("n1", "nina", ZONE)).await;
    assert!(env.outcome("n1", &mut seen).await);

    let at = local(ZONE, "2026-04-01 15:00");
    let at_text = at.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true);
    let second = request("n2", "nina", ZONE);
    let expected = local(ZONE, "2026-04-02 08:00");
    let expected_text = expected.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true);

    let run = env
        .run_cli(
            config,
            &["check", "--message", &second.to_string(), "--at", &at_text],
        )
        .await;
    assert_eq!(run.code, Some(0), "{run:?}");
    let checked: serde_json::Value = serde_json::from_str(&run.stdout).expect("one JSON object");
    assert_eq!(
        (&checked["outcome"], &checked["retry_after"]),
        (&"deny".into(), &expected_text.clone().into()),
        "sendquota check: {checked}"
    );

    let reply = support::http::http(
        port,
        "POST",
        &format!("/v1/check?at={at_text}"),
        Some(TOKEN),
        &second.to_string(),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let admin = reply.json();
    assert_eq!(
        (&admin["outcome"], &admin["retry_after"]),
        (&"deny".into(), &expected_text.into()),
        "POST /v1/check: {admin}"
    );

    clock.set(at);
    env.publish(&second).await;
    assert!(!env.outcome("n2", &mut seen).await);
    env.stop_worker().await;
    let denials = env.denials().await;
    assert_eq!(denials.len(), 1);
    assert_eq!(
        denials[0].retry_after,
        Some(expected),
        "the worker's denial row"
    );
}
