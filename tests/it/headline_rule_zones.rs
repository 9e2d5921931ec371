//! The headline rule (1 per local calendar day, 3 per 7 local days) through the real worker:
//! messages published at simulated times, outcomes read back from the dispatch exchange and
//! from Postgres, in zones with clock changes, odd offsets and a midnight that does not exist.

use crate::support;

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use sendquota::clock::ManualClock;
use support::{local, request, TestEnv};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    Sent,
    Denied,
}
use Expect::{Denied, Sent};

/// Publishes one message per step at that local time in `zone` and checks every outcome.
/// Returns the environment so the caller can look at the denial rows.
async fn scenario(zone: &str, steps: &[(&str, Expect)]) -> TestEnv {
    let mut env = TestEnv::new().await;
    let clock = ManualClock::new(local(zone, steps[0].0));
    env.start_worker(&clock);
    let mut dispatched = HashMap::new();
    let mut actual = Vec::new();
    for (i, (at, _)) in steps.iter().enumerate() {
        clock.set(local(zone, at));
        let id = format!("m{i}");
        env.publish(&request(&id, "person", zone)).await;
        let sent = env.outcome(&id, &mut dispatched).await;
        actual.push((*at, if sent { Sent } else { Denied }));
    }
    assert_eq!(actual, steps.to_vec(), "outcomes in {zone}");
    env.stop_worker().await;
    for d in env.take_dispatched().await {
        *dispatched.entry(d).or_default() += 1;
    }
    assert!(
        dispatched.values().all(|&n| n == 1),
        "each dispatched once: {dispatched:?}"
    );
    let denied = env.denials().await;
    assert_eq!(
        denied.len(),
        steps.iter().filter(|(_, e)| *e == Denied).count(),
        "one denial row per denied message"
    );
    assert!(denied
        .iter()
        .all(|d| d.rule == "headline" && d.kind == "calendar_quota"));
    assert_eq!(env.keys_without_expiry().await, Vec::<String>::new());
    env
}

async fn retry_after_of(env: &TestEnv, message_id: &str) -> Option<DateTime<Utc>> {
    env.denials()
        .await
        .into_iter()
        .find(|d| d.message_id == message_id)
        .and_then(|d| d.retry_after)
}

fn utc(s: &str) -> DateTime<Utc> {
    s.parse().unwrap()
}

#[tokio::test]
async fn utc_one_per_day_three_per_seven_days_over_ten_days() {
    let env = scenario(
        "UTC",
        &[
            ("2026-01-01 10:00", Sent),
            ("2026-01-01 23:59", Denied), // same day
            ("2026-01-02 00:00", Sent),
            ("2026-01-03 12:00", Sent),
            ("2026-01-04 12:00", Denied), // 3 in Dec 29 .. Jan 4
            ("2026-01-07 23:59", Denied), // 3 in Jan 1 .. Jan 7
            ("2026-01-08 00:00", Sent),   // Jan 1 left the window
            ("2026-01-08 00:01", Denied), // same day
            ("2026-01-09 08:00", Sent),
            ("2026-01-10 12:00", Sent), // Jan 4 .. 10 holds only Jan 8 and 9
            ("2026-01-11 12:00", Denied), // Jan 8, 9, 10
        ],
    )
    .await;
    // m4 was refused until the first day on which only two sends remain in the window.
    assert_eq!(
        retry_after_of(&env, "m4").await,
        Some(utc("2026-01-08T00:00:00Z"))
    );
}

#[tokio::test]
async fn new_york_spring_forward_day_has_23_hours_and_is_still_one_day() {
    let zone = "America/New_York";
    let env = scenario(
        zone,
        &[
            ("2026-03-07 23:59", Sent),
            ("2026-03-08 00:01", Sent),   // two minutes later, another day
            ("2026-03-08 23:59", Denied), // 22 h 58 min later, the same (23-hour) day
            ("2026-03-09 00:01", Sent),
            ("2026-03-10 12:00", Denied), // 3 in 7 days
            ("2026-03-13 23:59", Denied),
            ("2026-03-14 00:00", Sent), // Mar 7 left the window
        ],
    )
    .await;
    assert_eq!(
        retry_after_of(&env, "m2").await,
        Some(utc("2026-03-09T04:00:00Z"))
    );
    assert_eq!(
        retry_after_of(&env, "m4").await,
        Some(utc("2026-03-14T04:00:00Z"))
    );
}

#[tokio::test]
async fn new_york_fall_back_day_has_25_hours_and_is_still_one_day() {
    let zone = "America/New_York";
    scenario(
        zone,
        &[
            ("2026-10-31 12:00", Sent),
            ("2026-11-01 00:30", Sent),
            ("2026-11-01 23:30", Denied), // 24 h after 00:30 on a 25-hour day: same day
            ("2026-11-02 00:10", Sent),
            ("2026-11-03 00:10", Denied),
        ],
    )
    .await;
}

#[tokio::test]
async fn london_spring_forward() {
    let zone = "Europe/London";
    let env = scenario(
        zone,
        &[
            ("2026-03-28 23:59", Sent),
            ("2026-03-29 00:01", Sent),
            ("2026-03-29 23:59", Denied),
            ("2026-03-30 00:00", Sent),
            ("2026-03-30 08:00", Denied),
            ("2026-04-01 08:00", Denied),
            ("2026-04-04 00:00", Sent), // Mar 28 left the window
        ],
    )
    .await;
    assert_eq!(
        retry_after_of(&env, "m5").await,
        Some(utc("2026-04-03T23:00:00Z"))
    );
}

#[tokio::test]
async fn lord_howe_thirty_minute_clock_change() {
    let zone = "Australia/Lord_Howe";
    let env = scenario(
        zone,
        &[
            ("2026-10-03 23:59", Sent),
            ("2026-10-04 00:01", Sent),
            ("2026-10-04 23:59", Denied), // a 23.5-hour day
            ("2026-10-05 00:00", Sent),
            ("2026-10-05 12:00", Denied),
        ],
    )
    .await;
    // Oct 5 00:00 at +11:00.
    assert_eq!(
        retry_after_of(&env, "m2").await,
        Some(utc("2026-10-04T13:00:00Z"))
    );
}

#[tokio::test]
async fn kathmandu_quarter_hour_offset() {
    let zone = "Asia/Kathmandu";
    let env = scenario(
        zone,
        &[
            ("2026-05-01 23:59", Sent),
            ("2026-05-02 00:01", Sent),
            ("2026-05-02 23:00", Denied),
            ("2026-05-03 09:00", Sent),
            ("2026-05-04 09:00", Denied),
        ],
    )
    .await;
    // May 3 00:00 at +05:45.
    assert_eq!(
        retry_after_of(&env, "m2").await,
        Some(utc("2026-05-02T18:15:00Z"))
    );
}

#[tokio::test]
async fn kiritimati_days_are_not_utc_days() {
    let zone = "Pacific/Kiritimati";
    scenario(
        zone,
        &[
            // 10:30 and 09:30 UTC on different UTC days, but one local day (+14:00).
            ("2026-06-01 00:30", Sent),
            ("2026-06-01 23:30", Denied),
            // 23:59 and 00:01 local are 2 minutes apart and on different local days, but on the
            // same UTC day (09:59 and 10:01 UTC).
            ("2026-06-02 23:59", Sent),
            ("2026-06-03 00:01", Sent),
            ("2026-06-04 00:01", Denied),
        ],
    )
    .await;
}

#[tokio::test]
async fn santiago_day_without_midnight_starts_at_one() {
    // Clocks jump from 24:00 on Sep 5 to 01:00 on Sep 6: no 00:00 on Sep 6.
    let zone = "America/Santiago";
    let env = scenario(
        zone,
        &[
            ("2026-09-04 12:00", Sent),
            ("2026-09-05 12:00", Sent),
            ("2026-09-05 20:00", Denied),
            // The first instant of Sep 6, exactly the retry_after of the denial before it.
            ("2026-09-06 01:00", Sent),
            ("2026-09-06 12:00", Denied),
        ],
    )
    .await;
    assert_eq!(
        retry_after_of(&env, "m2").await,
        Some(utc("2026-09-06T04:00:00Z"))
    );
}
