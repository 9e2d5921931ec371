//! Property test: a calendar quota that treats priorities (`exempt`, `exempt_counts`, and a
//! `reserve` of its last slots until a local time of day) through the real script against a
//! plain model, over random sequences of messages of random priorities in zones with clock
//! changes: the same verdict, remaining and retry_after at every step, and the same outcome.
//!
//! The model is the calendar quota's own ([`Model`]) with the priority rules stated plainly:
//! an exempt priority that does not count never meets the rule; one that counts is decided as
//! any message (taking a slot when there is one) and always goes out; a message below the
//! reservation's priority, while no instant of its local day so far has read the lapse time,
//! is decided with the reserved slots taken off both limits, and a refusal then ends at the
//! first instant its local clock reads the lapse time (found minute by minute, so a time
//! skipped by the clocks going forward is met at the end of the gap).

use crate::calendar_quota_model::{one_rule_with, quota, Decision, Model, STARTS, ZONES};
use crate::support;

use std::collections::BTreeMap;

use chrono::{DateTime, Duration, NaiveTime, Timelike, Utc};
use chrono_tz::Tz;
use proptest::prelude::*;
use sendquota::internals::deadline::Receipt;
use sendquota::internals::decision;
use sendquota::internals::kinds::calendar::{day_number, day_start};
use sendquota::internals::kinds::CalendarQuota;
use sendquota::internals::message::SendRequest;
use sendquota::internals::outcome::OutcomeName;
use sendquota::internals::priority::{Priority, PriorityRules, Reserve};
use support::model::LimiterHarness;

/// Whether the local clock in `zone` has read `until` or later at some instant of `now`'s
/// local day up to `now` (whole minutes: every step lands on one).
fn lapsed(until: NaiveTime, now: DateTime<Utc>, zone: Tz) -> bool {
    let day = now.with_timezone(&zone).date_naive();
    (0..)
        .map(|m| now - Duration::minutes(m))
        .take_while(|t| t.with_timezone(&zone).date_naive() == day)
        .any(|t| t.with_timezone(&zone).time() >= until)
}

/// The first minute after `now` whose local time in `zone` reads `until` or later.
fn lapse(until: NaiveTime, now: DateTime<Utc>, zone: Tz) -> DateTime<Utc> {
    (1..)
        .map(|m| now + Duration::minutes(m))
        .find(|t| t.with_timezone(&zone).time() >= until)
        .expect("the local clock reaches every time of day")
}

/// The calendar model deciding with `slots` fewer on both limits; a refusal lasts until `end`.
fn decide_reserved(
    model: &mut Model,
    slots: u32,
    end: DateTime<Utc>,
    (id, now, zone, commit): (&str, DateTime<Utc>, Tz, bool),
) -> Decision {
    let q = model.q;
    let today = day_number(now, zone);
    let since = |from| model.admitted.values().filter(|&&t| t >= from).count() as i64;
    let window_begin = day_start(today - i64::from(q.window_days) + 1, zone);
    let (on_day, in_window) = (since(day_start(today, zone)), since(window_begin));
    let per_day = i64::from(q.per_day - slots);
    let per_window = i64::from(q.per_window - slots);
    let left = (per_day - on_day).min(per_window - in_window);
    if model.admitted.get(id).is_some_and(|&t| t >= window_begin) {
        return Decision {
            allowed: true,
            remaining: left.max(0),
            retry_after: None,
        };
    }
    if left > 0 {
        if commit {
            model.admitted.insert(id.to_owned(), now);
        }
        return Decision {
            allowed: true,
            remaining: left - 1,
            retry_after: None,
        };
    }
    Decision {
        allowed: false,
        remaining: 0,
        retry_after: Some(end),
    }
}

#[derive(Debug, Clone)]
struct Step {
    advance_minutes: i64,
    zone: usize,
    id: usize,
    priority: Priority,
    commit: bool,
}

fn step() -> impl Strategy<Value = Step> {
    (
        // Mostly hours apart, so that the lapse time passes within a case.
        prop_oneof![3 => 0i64..=6 * 60, 1 => 0i64..=2 * 24 * 60],
        0..ZONES.len(),
        0usize..6,
        prop::sample::select(Priority::ALL.to_vec()),
        prop::bool::weighted(0.85),
    )
        .prop_map(|(advance_minutes, zone, id, priority, commit)| Step {
            advance_minutes,
            zone,
            id,
            priority,
            commit,
        })
}

/// A quota and what it does with priorities: any exempt set, counted or not, and a
/// reservation of up to its smallest limit for high or critical (or normal) until a time of
/// day, some of them in the small hours where clocks change.
fn rules() -> impl Strategy<Value = (CalendarQuota, PriorityRules)> {
    quota().prop_flat_map(|q| {
        let exempt = prop::sample::subsequence(Priority::ALL.to_vec(), 0..=2);
        let reserve = prop::option::weighted(
            0.8,
            (
                1..=q.per_day.min(q.per_window),
                prop::sample::select(vec![Priority::Normal, Priority::High, Priority::Critical]),
                prop_oneof![0u32..24, Just(2), Just(1)],
                prop::sample::select(vec![0u32, 15, 30, 45]),
            ),
        );
        (Just(q), exempt, any::<bool>(), reserve).prop_map(|(q, exempt, exempt_counts, reserve)| {
            let rules = PriorityRules {
                exempt_counts: exempt_counts && !exempt.is_empty(),
                exempt,
                reserve: reserve.map(|(slots, for_at_least, hour, minute)| Reserve {
                    slots,
                    for_at_least,
                    until: NaiveTime::from_hms_opt(hour, minute, 0).expect("time"),
                }),
            };
            (q, rules)
        })
    })
}

#[test]
fn calendar_quota_with_priorities_matches_the_model() {
    let h = LimiterHarness::single("sqtprio");
    let case = std::sync::atomic::AtomicU32::new(0);
    let strategy = (
        rules(),
        0..STARTS.len(),
        prop::collection::vec(step(), 1..30),
    );
    let result = support::property_runner(96).run(&strategy, |((q, rules), start, steps)| {
        let n = case.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let recipient = format!("r{n}");
        let policy = one_rule_with(q, rules.clone());
        let mut model = Model {
            q,
            admitted: BTreeMap::new(),
        };
        let mut now: DateTime<Utc> = STARTS[start].parse().expect("start instant");
        for (i, s) in steps.iter().enumerate() {
            now += Duration::minutes(s.advance_minutes);
            let zone: Tz = ZONES[s.zone].parse().expect("zone");
            let id = format!("id{}", s.id);
            let mut body = support::request(&id, &recipient, ZONES[s.zone]);
            body["priority"] = s.priority.as_str().into();
            let message = SendRequest::decode(body.to_string().as_bytes(), 1 << 16).expect("valid");
            let eval = h.evaluate(&policy, &message, now, s.commit);
            let outcome = decision::decide(&policy, &message, &Receipt::new(now), eval.verdicts())
                .outcome
                .name();
            let exempt = rules.exempt.contains(&s.priority);
            if exempt && !rules.exempt_counts {
                prop_assert!(eval.verdicts().is_empty(), "step {}: rule met", i);
                prop_assert_eq!(outcome, OutcomeName::Allow);
                continue;
            }
            let v = &eval.verdicts()[0];
            let got = Decision {
                allowed: v.allowed,
                remaining: v.remaining.expect("calendar_quota counts"),
                retry_after: v.retry_after,
            };
            let reserved = rules
                .reserve
                .filter(|r| !exempt && s.priority < r.for_at_least && !lapsed(r.until, now, zone));
            let want = match reserved {
                Some(r) => decide_reserved(
                    &mut model,
                    r.slots,
                    lapse(r.until, now, zone),
                    (&id, now, zone, s.commit),
                ),
                None => model.decide(&id, now, zone, s.commit),
            };
            prop_assert_eq!(
                &got,
                &want,
                "step {} at {} ({} local) in {}: {:?}",
                i,
                now,
                now.with_timezone(&zone)
                    .time()
                    .with_second(0)
                    .expect("time"),
                zone,
                s
            );
            let want_outcome = if want.allowed || exempt {
                OutcomeName::Allow
            } else {
                OutcomeName::Deny
            };
            prop_assert_eq!(outcome, want_outcome, "step {}", i);
            prop_assert_eq!(eval.committed(), s.commit && (want.allowed || exempt));
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}
