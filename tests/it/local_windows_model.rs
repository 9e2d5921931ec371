//! Property tests: the kinds that refuse by the wall clock, `send_window` and `quiet_hours`
//! with `days`, decided through their scripts in real Redis, against plain models that read
//! the local wall clock minute by minute: "is this instant allowed?", and the first whole UTC
//! minute after now at which the answer changes. Random window sets, at random instants that
//! cluster around clock changes in zones that shift by an hour (America/New_York,
//! Europe/London, America/Santiago, whose changes fall at midnight), by half an hour
//! (Australia/Lord_Howe), not at all (Asia/Kolkata), or skip a whole day (Pacific/Apia, Friday
//! 2011-12-30). In these zones offsets are whole minutes and windows start and end on whole
//! local minutes, so the answer only changes on whole UTC minutes and the scan is exact.

use crate::support;

use std::sync::atomic::{AtomicU32, Ordering};

use chrono::{DateTime, Datelike, Duration, Timelike, Utc};
use chrono_tz::Tz;
use proptest::prelude::*;
use sendquota::internals::deadline::Receipt;
use sendquota::internals::decision;
use support::fixtures::policy;
use support::model::{decoded, policy, LimiterHarness};

const WEEKDAYS: [&str; 7] = ["mon", "tue", "wed", "thu", "fri", "sat", "sun"];

/// Each zone with the clock changes around which instants are drawn (UTC).
const ZONE_CHANGES: [(&str, &str); 11] = [
    ("America/New_York", "2026-03-08T07:00:00Z"), // 02:00 EST -> 03:00 EDT
    ("America/New_York", "2026-11-01T06:00:00Z"), // 02:00 EDT -> 01:00 EST
    ("Europe/London", "2026-03-29T01:00:00Z"),    // 01:00 GMT -> 02:00 BST
    ("Europe/London", "2026-10-25T01:00:00Z"),    // 02:00 BST -> 01:00 GMT
    ("Australia/Lord_Howe", "2026-04-04T15:00:00Z"), // 02:00 -> 01:30
    ("Australia/Lord_Howe", "2026-10-03T15:30:00Z"), // 02:00 -> 02:30
    ("Asia/Kolkata", "2026-03-08T07:00:00Z"),     // no change
    ("America/Santiago", "2026-04-05T03:00:00Z"), // 24:00 -> 23:00
    ("America/Santiago", "2026-09-06T04:00:00Z"), // 24:00 -> 01:00
    ("Pacific/Apia", "2011-12-30T10:00:00Z"),     // Thursday 24:00 -> Saturday 00:00
    ("Pacific/Apia", "2011-09-24T14:00:00Z"),     // 03:00 -> 04:00
];

/// A zone and an instant: mostly within a week before or a few days after one of its clock
/// changes (a weekly window can be that far away), to the millisecond.
fn zone_and_instant() -> impl Strategy<Value = (Tz, DateTime<Utc>)> {
    (
        prop::sample::select(&ZONE_CHANGES[..]),
        -8 * 86_400_000i64..=3 * 86_400_000,
    )
        .prop_map(|((zone, change), off)| {
            let change: DateTime<Utc> = change.parse().expect("instant");
            (
                zone.parse().expect("zone"),
                change + Duration::milliseconds(off),
            )
        })
}

/// Local wall time in `zone` at `t`: (weekday, Monday = 0; ms since midnight).
fn wall(t: DateTime<Utc>, zone: Tz) -> (usize, i64) {
    let local = t.with_timezone(&zone);
    let ms = i64::from(local.num_seconds_from_midnight()) * 1_000
        + i64::from(local.nanosecond() / 1_000_000);
    (local.weekday().num_days_from_monday() as usize, ms)
}

/// The first whole UTC minute after `now` (within three weeks) at which `holds` is true.
fn first_minute_after(now: DateTime<Utc>, holds: impl Fn(DateTime<Utc>) -> bool) -> DateTime<Utc> {
    let minute = 60_000;
    let first = now.timestamp_millis().div_euclid(minute) * minute + minute;
    (0..21 * 24 * 60)
        .map(|m| DateTime::from_timestamp_millis(first + m * minute).expect("instant"))
        .find(|&t| holds(t))
        .unwrap_or_else(|| panic!("nothing changes for three weeks from {now}"))
}

/// What the rule said, in the models' terms.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Decision {
    allowed: bool,
    retry_after: Option<DateTime<Utc>>,
}

/// Decides `id` under `policy` at `now` in `zone` (committing), and checks what every clock
/// rule must: no remaining, nothing kept in Redis, and an outcome (`check`'s and the worker's)
/// with the verdict's retry_after. Returns the verdict and its reason.
fn decide(
    h: &LimiterHarness,
    policy: &sendquota::internals::policy::Policy,
    id: &str,
    now: DateTime<Utc>,
    zone: Tz,
) -> (Decision, String) {
    let message = decoded(id, "r", zone.name());
    let eval = h.evaluate(policy, &message, now, true);
    let verdict = &eval.verdicts()[0];
    assert_eq!(verdict.remaining, None, "clock rules do not count");
    assert_eq!(
        decision::decide(policy, &message, &Receipt::new(now), eval.verdicts())
            .outcome
            .retry_after(),
        verdict.retry_after,
        "the outcome waits for the rule alone"
    );
    let decision = Decision {
        allowed: verdict.allowed,
        retry_after: verdict.retry_after,
    };
    (decision, verdict.reason.clone())
}

// ---------------------------------------------------------------------------------------------
// send_window
// ---------------------------------------------------------------------------------------------

/// Each weekday's windows as (start, end) minutes: made of distinct quarter hours paired in
/// order, so they do not overlap; half the days near the small hours, where clocks change.
fn week() -> impl Strategy<Value = [Vec<(u32, u32)>; 7]> {
    let day = prop_oneof![
        prop::collection::btree_set(0u32..=96, 0..=4),
        prop::collection::btree_set(0u32..=20, 0..=4),
    ]
    .prop_map(|points| {
        let points: Vec<u32> = points.into_iter().map(|q| q * 15).collect();
        points
            .chunks_exact(2)
            .map(|p| (p[0], p[1]))
            .collect::<Vec<_>>()
    });
    prop::array::uniform7(day).prop_filter("some window", |w| w.iter().any(|d| !d.is_empty()))
}

fn hh_mm(minutes: u32) -> String {
    format!("{:02}:{:02}", minutes / 60, minutes % 60)
}

fn send_window_toml(week: &[Vec<(u32, u32)>; 7]) -> String {
    let days: Vec<String> = week
        .iter()
        .zip(WEEKDAYS)
        .filter(|(spans, _)| !spans.is_empty())
        .map(|(spans, day)| {
            let spans: Vec<String> = spans
                .iter()
                .map(|&(a, b)| format!("\"{}-{}\"", hh_mm(a), hh_mm(b)))
                .collect();
            format!("{day} = [{}]", spans.join(", "))
        })
        .collect();
    format!(
        "[[rules]]\nname = \"w\"\nkind = \"send_window\"\non_deny = \"delay\"\nwindows = {{ {} }}\n",
        days.join(", ")
    )
}

/// The rule by definition: an instant is allowed when the local wall time it reads is inside
/// one of that weekday's windows.
fn open_at(week: &[Vec<(u32, u32)>; 7], t: DateTime<Utc>, zone: Tz) -> bool {
    let (day, ms) = wall(t, zone);
    week[day]
        .iter()
        .any(|&(a, b)| i64::from(a) * 60_000 <= ms && ms < i64::from(b) * 60_000)
}

#[test]
fn send_windows_match_the_wall_clock_across_clock_changes() {
    let h = LimiterHarness::single("sqtsendwindow");
    let case = AtomicU32::new(0);
    let strategy = (week(), prop::collection::vec(zone_and_instant(), 1..6));
    let result = support::property_runner(384).run(&strategy, |(week, instants)| {
        let n = case.fetch_add(1, Ordering::SeqCst);
        let toml = send_window_toml(&week);
        let policy = policy(&toml);
        for (i, &(zone, now)) in instants.iter().enumerate() {
            let (got, reason) = decide(&h, &policy, &format!("w{n}-{i}"), now, zone);
            let context = format!(
                "{toml}in {zone} at {now} (local {})",
                now.with_timezone(&zone)
                    .format("%a %Y-%m-%d %H:%M:%S%.3f %Z")
            );
            if open_at(&week, now, zone) {
                prop_assert_eq!(
                    got,
                    Decision {
                        allowed: true,
                        retry_after: None
                    },
                    "{}",
                    context
                );
                continue;
            }
            let opens = first_minute_after(now, |t| open_at(&week, t, zone));
            prop_assert_eq!(
                got,
                Decision {
                    allowed: false,
                    retry_after: Some(opens)
                },
                "{}",
                context
            );
            let local = opens.with_timezone(&zone);
            let expected = format!(
                "outside send windows (next opens {} {} local time)",
                WEEKDAYS[local.weekday().num_days_from_monday() as usize],
                local.format("%H:%M")
            );
            prop_assert_eq!(reason, expected, "{}", context);
        }
        prop_assert!(h.keys_with_ttl("").is_empty(), "send_window keeps no keys");
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// The cases the brief of the kind names, pinned: a window whose start a spring-forward skips
/// opens when the gap ends; a fall-back repeats a window; the day Apia skipped has no window.
#[test]
fn send_windows_at_clock_changes_open_at_the_instants_the_wall_clock_says() {
    let h = LimiterHarness::single("sqtsendwindowpin");
    let utc = |s: &str| s.parse::<DateTime<Utc>>().expect("instant");
    let cases = [
        // New York, Sunday 2026-03-08, 01:30 EST: 02:30 does not exist, 03:00 EDT comes first.
        (
            "sun = [\"02:30-04:00\"]",
            "America/New_York",
            "2026-03-08T06:30:00Z",
            Some("2026-03-08T07:00:00Z"),
            "outside send windows (next opens sun 03:00 local time)",
        ),
        // New York, Sunday 2026-11-01, 01:45 EDT: past 01:00-01:30, which the fall-back at
        // 06:00Z repeats (01:00 EST).
        (
            "sun = [\"01:00-01:30\"]",
            "America/New_York",
            "2026-11-01T05:45:00Z",
            Some("2026-11-01T06:00:00Z"),
            "outside send windows (next opens sun 01:00 local time)",
        ),
        // Apia, Thursday 2011-12-29 at noon: Friday the 30th never happened there; the next
        // Friday window is on 2012-01-06 (UTC+14).
        (
            "fri = [\"09:00-17:00\"]",
            "Pacific/Apia",
            "2011-12-29T22:00:00Z",
            Some("2012-01-05T19:00:00Z"),
            "outside send windows (next opens fri 09:00 local time)",
        ),
        // Santiago's day of 2026-09-06 starts at 01:00: a window from midnight opens then.
        (
            "sun = [\"00:00-02:00\"]",
            "America/Santiago",
            "2026-09-06T03:30:00Z",
            Some("2026-09-06T04:00:00Z"),
            "outside send windows (next opens sun 01:00 local time)",
        ),
    ];
    for (i, (windows, zone, now, opens, reason)) in cases.into_iter().enumerate() {
        let policy = policy(&policy!(
            "send_window_with_given_windows",
            windows = windows
        ));
        let zone: Tz = zone.parse().expect("zone");
        let got = decide(&h, &policy, &format!("p{i}"), utc(now), zone);
        let want = Decision {
            allowed: opens.is_none(),
            retry_after: opens.map(utc),
        };
        assert_eq!(
            got,
            (want, reason.to_owned()),
            "{windows} in {zone} at {now}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// quiet_hours with days
// ---------------------------------------------------------------------------------------------

/// The rule by definition: a quiet period starts at `start` on each of `days` and lasts to
/// the next `end` (the next day's when `end` is not after `start`); an instant is quiet when
/// its local wall time falls in one.
fn quiet_at(start: u32, end: u32, days: &[usize], t: DateTime<Utc>, zone: Tz) -> bool {
    let (day, ms) = wall(t, zone);
    let (start, end) = (i64::from(start) * 60_000, i64::from(end) * 60_000);
    let on = |d: usize| days.contains(&d);
    if start < end {
        on(day) && start <= ms && ms < end
    } else {
        (on(day) && ms >= start) || (on((day + 6) % 7) && ms < end)
    }
}

#[test]
fn quiet_hours_on_some_days_match_the_wall_clock_across_clock_changes() {
    let h = LimiterHarness::single("sqtquietdays");
    let case = AtomicU32::new(0);
    let quarter = prop_oneof![0u32..96, 0u32..20].prop_map(|q| q * 15);
    let strategy = (
        (quarter.clone(), quarter).prop_filter("start != end", |(a, b)| a != b),
        prop::collection::btree_set(0usize..7, 1..=7),
        prop::collection::vec(zone_and_instant(), 1..6),
    );
    let result = support::property_runner(384).run(&strategy, |((start, end), days, instants)| {
        let n = case.fetch_add(1, Ordering::SeqCst);
        let days: Vec<usize> = days.into_iter().collect();
        let names: Vec<String> = days
            .iter()
            .map(|&d| format!("\"{}\"", WEEKDAYS[d]))
            .collect();
        let toml = format!(
            "[[rules]]\nname = \"q\"\nkind = \"quiet_hours\"\nstart = \"{}\"\nend = \"{}\"\n\
                 days = [{}]\n",
            hh_mm(start),
            hh_mm(end),
            names.join(", ")
        );
        let policy = policy(&toml);
        for (i, &(zone, now)) in instants.iter().enumerate() {
            let (got, _) = decide(&h, &policy, &format!("q{n}-{i}"), now, zone);
            let quiet = |t| quiet_at(start, end, &days, t, zone);
            let want = Decision {
                allowed: !quiet(now),
                retry_after: quiet(now).then(|| first_minute_after(now, |t| !quiet(t))),
            };
            let context = format!(
                "{toml}in {zone} at {now} (local {})",
                now.with_timezone(&zone)
                    .format("%a %Y-%m-%d %H:%M:%S%.3f %Z")
            );
            prop_assert_eq!(got, want, "{}", context);
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}
