//! Deadlines through the real worker at default settings: a request's `expires_at` and a delay
//! rule's `max_delay`. A message past its deadline is recorded as a denial with reason
//! `expired`, is never dispatched and takes no quota; a delay that would outlast the deadline
//! is recorded as expired at once; a parked message that comes back past its deadline expires
//! (its first receipt rides the delay round trip); `replay` skips denials past their deadline
//! and a replay that arrives too late expires; an `expires_at` that is not an instant the
//! worker takes goes to the invalid queue with the reason. Copies of each message are in
//! flight at once, and each message leaves one row.

use crate::support;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use sendquota::clock::ManualClock;
use sendquota::internals::broker::{self, DELAY_TIERS_MS};
use sendquota::internals::denials::{Denial, DenialRow, DenialStore};
use sendquota::internals::message::SendRequest;
use support::fixtures::policy;
use support::process::run_for;
use support::{local, request, TestEnv};

/// Copies of each message published back to back: all in flight at once at the default
/// prefetch.
const COPIES: usize = 4;

/// A request to `recipient` that expires at `expires_at`.
fn expiring(id: &str, recipient: &str, expires_at: DateTime<Utc>) -> serde_json::Value {
    let mut body = request(id, recipient, "UTC");
    body["expires_at"] = rfc3339(expires_at).into();
    body
}

fn rfc3339(at: DateTime<Utc>) -> String {
    at.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true)
}

async fn publish_copies(env: &TestEnv, body: &serde_json::Value) {
    for _ in 0..COPIES {
        env.publish(body).await;
    }
}

/// Waits until message `id` has a denial row and returns its rows, failing should it be
/// dispatched meanwhile.
async fn rows_of(env: &TestEnv, id: &str, seen: &mut HashMap<String, usize>) -> Vec<Denial> {
    assert!(!env.outcome(id, seen).await, "{id} was dispatched");
    env.denials()
        .await
        .into_iter()
        .filter(|d| d.message_id == id)
        .collect()
}

/// Messages parked in any delay queue.
async fn parked(env: &TestEnv) -> u32 {
    let mut total = 0;
    for ttl in DELAY_TIERS_MS {
        total += env.ready(&env.names.delay_queue(ttl)).await;
    }
    total
}

#[tokio::test]
async fn a_message_past_its_expires_at_is_recorded_as_expired_never_sent_and_takes_no_quota() {
    let mut env = TestEnv::new().await;
    let now = local("UTC", "2026-04-01 09:00");
    env.start_worker(&ManualClock::new(now));
    let mut seen = HashMap::new();
    let expired_at = local("UTC", "2026-04-01 08:59:59");
    publish_copies(&env, &expiring("late", "alice", expired_at)).await;
    let rows = rows_of(&env, "late", &mut seen).await;
    assert_eq!(rows.len(), 1, "one row for all copies: {rows:?}");
    let row = &rows[0].row;
    assert_eq!(
        (row.rule.as_str(), row.kind.as_str(), row.reason.as_str()),
        ("deadline", "deadline", "expired")
    );
    assert_eq!(
        (row.expires_at, row.retry_after, row.shadow),
        (Some(expired_at), None, false)
    );
    // The headline rule (one a day) took nothing: alice's next message goes out, and so does
    // one whose deadline is still ahead.
    env.publish(&request("on-time", "alice", "UTC")).await;
    assert!(env.outcome("on-time", &mut seen).await);
    let ahead = local("UTC", "2026-04-01 09:00:01");
    publish_copies(&env, &expiring("just-in-time", "bob", ahead)).await;
    assert!(env.outcome("just-in-time", &mut seen).await);
    // Give the late copies time to be dispatched, were they ever to be.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for id in env.take_dispatched().await {
        *seen.entry(id).or_default() += 1;
    }
    env.stop_worker().await;
    assert_eq!(seen.get("late"), None, "never dispatched");
    assert_eq!(seen.get("just-in-time"), Some(&1));
    assert_eq!(env.denial_rows().await, 1);
}

/// A worker at 2026-04-01 09:00 whose one rule, `pace`, admits one message per `period` and
/// holds the others (`on_deny = "delay"`) for at most `max_delay`: alice's m1 has been
/// dispatched, and copies of her m2 are published. Returns the environment, the worker's clock
/// and the dispatches seen.
async fn paced_second_message(
    period: &str,
    max_delay: &str,
) -> (TestEnv, ManualClock, HashMap<String, usize>) {
    let config = policy!(
        "pace_delayed_at_most",
        period = period,
        max_delay = max_delay
    );
    let mut env = TestEnv::with_config(&config).await;
    let clock = ManualClock::new(local("UTC", "2026-04-01 09:00"));
    env.start_worker(&clock);
    let mut seen = HashMap::new();
    env.publish(&request("m1", "alice", "UTC")).await;
    assert!(env.outcome("m1", &mut seen).await);
    publish_copies(&env, &request("m2", "alice", "UTC")).await;
    (env, clock, seen)
}

/// At most one message an hour, held rather than dropped, but for at most 30 minutes: the
/// second message would wait an hour, so it is recorded as expired under the rule at once
/// instead of being parked, and takes nothing: a message at the next slot goes out.
#[tokio::test]
async fn a_delay_that_would_outlast_max_delay_is_recorded_as_expired_at_once() {
    let (mut env, clock, mut seen) = paced_second_message("1h", "30m").await;
    let rows = rows_of(&env, "m2", &mut seen).await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    let row = &rows[0].row;
    assert_eq!(
        (row.rule.as_str(), row.kind.as_str(), row.reason.as_str()),
        ("pace", "gcra", "expired")
    );
    assert_eq!(
        (row.expires_at, row.retry_after),
        (Some(local("UTC", "2026-04-01 09:30")), None),
        "first receipt + max_delay"
    );
    assert_eq!(parked(&env).await, 0, "nothing parked");
    clock.set(local("UTC", "2026-04-01 10:00"));
    env.publish(&request("m3", "alice", "UTC")).await;
    assert!(env.outcome("m3", &mut seen).await, "m2 took no slot");
    env.stop_worker().await;
    assert_eq!(seen.get("m2"), None);
}

/// One message every 10 s, held for at most 20 s from when the worker first received it: the
/// second message is parked until 09:00:10 and keeps coming back while the clock stands still.
/// Should it come back at 09:00:25, the rule would admit it, but it is past its deadline,
/// counted from its first receipt, which the delay round trip kept: it is recorded as expired.
#[tokio::test]
async fn a_parked_message_that_comes_back_past_its_deadline_expires() {
    let (mut env, clock, mut seen) = paced_second_message("10s", "20s").await;
    // A 10 s wait goes to the 5 s queue: back from it and parked again, at least once.
    tokio::time::sleep(Duration::from_millis(6_000)).await;
    assert_eq!(env.denial_count("m2").await, 0, "parked, not expired");
    clock.set(local("UTC", "2026-04-01 09:00:25"));
    let rows = rows_of(&env, "m2", &mut seen).await;
    env.stop_worker().await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    let row = &rows[0].row;
    assert_eq!(row.reason, "expired");
    assert_eq!(row.expires_at, Some(local("UTC", "2026-04-01 09:00:20")));
    assert_eq!(seen.get("m2"), None, "never dispatched");
}

/// Records a denial of `id` to `recipient` whose message's deadline is `expires_at`, as the
/// worker would.
async fn seed(env: &TestEnv, id: &str, recipient: &str, expires_at: Option<DateTime<Utc>>) {
    let body = request(id, recipient, "UTC").to_string();
    let message = SendRequest::decode(body.as_bytes(), 1 << 16).expect("valid");
    DenialStore::from_pool(env.pool.clone())
        .insert(&DenialRow {
            rule: "headline".to_owned(),
            kind: "calendar_quota".to_owned(),
            reason: "test".to_owned(),
            expires_at,
            ..DenialRow::for_message(&message, Utc::now() - chrono::Duration::hours(3))
        })
        .await
        .expect("insert denial");
}

/// Three denials: one past its deadline, one before it, one without. `replay --dry-run` says
/// it would replay two and skip one, and why; `replay` publishes those two, the one with a
/// deadline carrying it. A worker whose clock reads past that deadline when the replay arrives
/// records it as expired (linked to the denial it replays) and dispatches the other.
#[tokio::test]
async fn replay_skips_denials_past_their_deadline_and_a_late_replay_expires() {
    let mut env = TestEnv::new().await;
    let now = Utc::now();
    let soon = now + chrono::Duration::hours(1);
    seed(
        &env,
        "gone",
        "alice",
        Some(now - chrono::Duration::minutes(1)),
    )
    .await;
    seed(&env, "soon", "bob", Some(soon)).await;
    seed(&env, "whenever", "carol", None).await;
    let dry = run_for(
        env.cli(&["replay", "--dry-run"]),
        None,
        Duration::from_secs(30),
    );
    assert_eq!(dry.code, Some(0), "{}", dry.stderr);
    assert!(
        dry.stdout.ends_with(
            "dry run: would replay 2 denials\ndry run: skipped 1 denials whose message is past \
             its deadline (expires_at)\n"
        ),
        "{}",
        dry.stdout
    );
    assert!(!dry.stdout.contains("alice"), "{}", dry.stdout);
    let run = run_for(env.cli(&["replay"]), None, Duration::from_secs(30));
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    assert!(
        run.stdout.starts_with("replayed 2 denials in "),
        "{}",
        run.stdout
    );
    let ids: HashMap<String, i64> = env
        .denials()
        .await
        .iter()
        .map(|d| (d.message_id.clone(), d.id))
        .collect();
    let clock = ManualClock::new(soon + chrono::Duration::minutes(1));
    env.start_worker(&clock);
    let mut seen = HashMap::new();
    // Its seeded row is there already: wait for the dispatch itself.
    env.dispatched("whenever", &mut seen).await;
    let deadline = Instant::now() + support::OUTCOME_TIMEOUT;
    let late = loop {
        let rows = env.denials().await;
        if let Some(row) = rows.into_iter().find(|d| d.replay_of == Some(ids["soon"])) {
            break row;
        }
        assert!(Instant::now() < deadline, "the late replay was recorded");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    env.stop_worker().await;
    assert_eq!(
        (
            late.message_id.as_str(),
            late.rule.as_str(),
            late.reason.as_str()
        ),
        ("soon", "deadline", "expired")
    );
    // Postgres keeps microseconds; the header carries what the row kept.
    assert_eq!(
        late.expires_at,
        env.denials()
            .await
            .iter()
            .find(|d| d.id == ids["soon"])
            .and_then(|d| d.expires_at)
    );
    assert_eq!(seen.get("soon"), None, "never dispatched");
    let gone = env.denials().await;
    let gone = gone.iter().find(|d| d.id == ids["gone"]).expect("gone");
    assert_eq!(gone.replayed_at, None, "skipped, not marked");
}

#[tokio::test]
async fn an_expires_at_the_worker_cannot_take_goes_to_the_invalid_queue_with_the_reason() {
    let mut env = TestEnv::new().await;
    env.start_worker(&ManualClock::new(local("UTC", "2026-04-01 09:00")));
    let not_rfc3339 = "must be an RFC 3339 instant with an offset, such as 2026-05-01T09:00:00Z";
    let out_of_range =
        "must lie from 1970-01-01T00:00:00Z up to (not including) 9000-01-01T00:00:00Z";
    let table = [
        (
            r#""2026-04-01T10:00:00""#,
            format!(r#"{not_rfc3339}, got "2026-04-01T10:00:00""#),
        ),
        (
            r#""2026-04-01""#,
            format!(r#"{not_rfc3339}, got "2026-04-01""#),
        ),
        (
            r#""2026-02-30T10:00:00Z""#,
            format!(r#"{not_rfc3339}, got "2026-02-30T10:00:00Z""#),
        ),
        (
            r#""in an hour""#,
            format!(r#"{not_rfc3339}, got "in an hour""#),
        ),
        (r#""""#, format!(r#"{not_rfc3339}, got """#)),
        (
            r#""9000-01-01T00:00:00Z""#,
            format!(r#"{out_of_range}, got "9000-01-01T00:00:00Z""#),
        ),
        (
            r#""1969-12-31T23:00:00Z""#,
            format!(r#"{out_of_range}, got "1969-12-31T23:00:00Z""#),
        ),
        ("1775037600", "must be a string, got a number".to_owned()),
        (
            r#"{"at":"2026-04-01T10:00:00Z"}"#,
            "must be a string, got an object".to_owned(),
        ),
    ];
    let mut expected = HashMap::new();
    for (i, (expires_at, reason)) in table.iter().enumerate() {
        let body = format!(
            r#"{{"id":"bad-{i}","recipient":"alice","channel":"sms","expires_at":{expires_at}}}"#
        );
        for _ in 0..COPIES {
            env.publish_raw(body.as_bytes()).await;
        }
        expected.insert(body, format!("field `expires_at` {reason}"));
    }
    // None of them took alice's day.
    let mut seen = HashMap::new();
    env.publish(&request("valid", "alice", "UTC")).await;
    assert!(env.outcome("valid", &mut seen).await, "no quota was taken");
    let deadline = Instant::now() + support::OUTCOME_TIMEOUT;
    let mut reasons = HashMap::new();
    while reasons.values().map(Vec::len).sum::<usize>() < table.len() * COPIES {
        assert!(
            Instant::now() < deadline,
            "every copy was routed: {reasons:?}"
        );
        for m in env.drain(&env.names.invalid).await {
            let reason = broker::header(&m.delivery.properties, broker::REASON_HEADER)
                .expect("reason header");
            let body = String::from_utf8(m.delivery.data).expect("utf-8");
            reasons.entry(body).or_insert_with(Vec::new).push(reason);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    env.stop_worker().await;
    for (body, reason) in &expected {
        assert_eq!(
            reasons.get(body),
            Some(&vec![reason.clone(); COPIES]),
            "{body}"
        );
    }
    assert!(env.denials().await.is_empty());
}

/// `check` decides as the worker does: a message past its deadline is `expired` without
/// asking its rules (even with `--commit`, nothing is taken), and a delay that would outlast
/// a rule's `max_delay` is `expired` under that rule; the report shows the deadline.
#[tokio::test]
async fn check_explains_the_deadline_and_takes_nothing_from_an_expired_message() {
    let config = policy!("headline_and_quiet_nights_delayed_at_most_2h");
    let env = TestEnv::with_config(config).await;
    let check = |message: &serde_json::Value, at: &str, commit: bool| {
        let message = message.to_string();
        let mut args = vec!["check", "--message", &message, "--at", at];
        args.extend(commit.then_some("--commit"));
        let run = run_for(env.cli_with(config, &args), None, Duration::from_secs(30));
        assert_eq!(run.code, Some(0), "{}", run.stderr);
        serde_json::from_str::<serde_json::Value>(&run.stdout).expect("one JSON object")
    };
    let late = expiring("late", "alice", local("UTC", "2026-04-01 08:00"));
    assert_eq!(
        check(&late, "2026-04-01T09:00:00Z", true),
        serde_json::json!({"outcome": "expired", "rule": null, "retry_after": null,
            "rules": [], "deadline": "2026-04-01T08:00:00Z"})
    );
    let night = check(
        &request("m1", "alice", "UTC"),
        "2026-04-01T23:00:00Z",
        false,
    );
    assert_eq!(
        (&night["outcome"], &night["rule"], &night["deadline"]),
        (
            &"expired".into(),
            &"night".into(),
            &"2026-04-02T01:00:00Z".into()
        ),
        "{night}"
    );
    let ahead = expiring("m2", "alice", local("UTC", "2026-04-01 12:00"));
    let allowed = check(&ahead, "2026-04-01T09:00:00Z", true);
    assert_eq!(
        (&allowed["outcome"], &allowed["deadline"]),
        (&"allow".into(), &"2026-04-01T12:00:00Z".into()),
        "the expired --commit took nothing: {allowed}"
    );
}
