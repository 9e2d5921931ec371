//! Property tests: a calendar quota that treats priorities (`exempt`, `exempt_counts`, and a
//! `reserve` of its last slots until a local time of day) through the real script against a
//! plain model, over random sequences of messages of random priorities in zones with clock
//! changes: the same verdict, remaining and retry_after at every step, and the same outcome;
//! and a refusal under a reservation admitted exactly at its retry_after, and refused a
//! millisecond before it.
//!
//! The model is the calendar quota's own ([`Model`]) with the priority rules stated plainly:
//! an exempt priority that does not count never meets the rule; one that counts is decided as
//! any message of its priority (taking a slot when there is one it may take) and always goes
//! out; a message below the reservation's priority, while no instant of its local day so far
//! has read the lapse time, is decided with the reserved slots taken off both limits, and
//! with the full limits for the rest of the day. A refusal of such a message lasts until the
//! first minute at which the rule would admit it (nothing else being sent), found minute by
//! minute with the reservation holding again every local morning until its lapse (a lapse time
//! skipped by the clocks going forward is met at the end of the gap).

use crate::calendar_quota_model::{one_rule_with, quota, Decision, Model, STARTS, ZONES};
use crate::support;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};

use chrono::{DateTime, Duration, NaiveTime, Timelike, Utc};
use chrono_tz::Tz;
use proptest::prelude::*;
use sendquota::internals::deadline::Receipt;
use sendquota::internals::decision;
use sendquota::internals::kinds::calendar::{day_number, day_start, DayNumber};
use sendquota::internals::kinds::CalendarQuota;
use sendquota::internals::message::SendRequest;
use sendquota::internals::outcome::OutcomeName;
use sendquota::internals::policy::Policy;
use sendquota::internals::priority::{Priority, PriorityRules, Reserve};
use support::model::LimiterHarness;

/// The first minute of local day `day` in `zone` whose local time reads `until` or later:
/// from then on the reservation has lapsed for the day. `None` when no minute of the day does.
fn lapse_minute(until: NaiveTime, day: DayNumber, zone: Tz) -> Option<DateTime<Utc>> {
    let start = day_start(day, zone);
    (0..)
        .map(|m| start + Duration::minutes(m))
        .take_while(|t| day_number(*t, zone) == day)
        .find(|t| t.with_timezone(&zone).time() >= until)
}

/// The slots `r` keeps off both limits at `now` in `zone`: all of them until the local clock
/// has read the lapse time on `now`'s local day, none after.
fn off_at(r: Reserve, now: DateTime<Utc>, zone: Tz) -> u32 {
    match lapse_minute(r.until, day_number(now, zone), zone) {
        Some(lapse) if now >= lapse => 0,
        _ => r.slots,
    }
}

/// How many more sends the model admits on local day `day` of `zone` with `off` slots taken
/// off both limits (negative when over).
fn left(model: &Model, day: DayNumber, zone: Tz, off: u32) -> i64 {
    let q = model.q;
    let since = |from| model.admitted.values().filter(|&&t| t >= from).count() as i64;
    let on_day = since(day_start(day, zone));
    let in_window = since(day_start(day - i64::from(q.window_days) + 1, zone));
    (i64::from(q.per_day - off) - on_day).min(i64::from(q.per_window - off) - in_window)
}

/// The calendar model deciding with `off` slots fewer on both limits; a refusal's retry_after
/// is left for [`first_admitted`].
fn decide_with(
    model: &mut Model,
    off: u32,
    (id, now, zone, commit): (&str, DateTime<Utc>, Tz, bool),
) -> Decision {
    let today = day_number(now, zone);
    let window_begin = day_start(today - i64::from(model.q.window_days) + 1, zone);
    let left = left(model, today, zone, off);
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
        retry_after: None,
    }
}

/// The README's retry_after for a message `r` keeps slots from, refused at `now`: the first
/// minute after it at which the rule admits the message, nothing else being sent, found minute
/// by minute with the kept slots off the limits each day until its lapse.
fn first_admitted(model: &Model, r: Reserve, now: DateTime<Utc>, zone: Tz) -> DateTime<Utc> {
    let mut lapses = BTreeMap::new();
    let horizon = now + Duration::days(i64::from(model.q.window_days) + 3);
    let mut t = now + Duration::minutes(1);
    while t < horizon {
        let day = day_number(t, zone);
        let lapse = *lapses
            .entry(day)
            .or_insert_with(|| lapse_minute(r.until, day, zone));
        let off = if lapse.is_some_and(|l| t >= l) {
            0
        } else {
            r.slots
        };
        if left(model, day, zone, off) > 0 {
            return t;
        }
        t += Duration::minutes(1);
    }
    panic!("no room within the window after {now}")
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
/// day, some of them in the small hours where clocks change. With `reserved_only`, always a
/// reservation and no exemption.
fn rules(reserved_only: bool) -> impl Strategy<Value = (CalendarQuota, PriorityRules)> {
    quota().prop_flat_map(move |q| {
        let exempt = prop::sample::subsequence(
            Priority::ALL.to_vec(),
            0..=if reserved_only { 0 } else { 2 },
        );
        let reserve = (
            prop::bool::weighted(if reserved_only { 1.0 } else { 0.8 }),
            1..=q.per_day.min(q.per_window),
            prop::sample::select(vec![Priority::Normal, Priority::High, Priority::Critical]),
            prop_oneof![0u32..24, Just(2), Just(1)],
            prop::sample::select(vec![0u32, 15, 30, 45]),
        )
            .prop_map(|(reserved, slots, for_at_least, hour, minute)| {
                reserved.then_some((slots, for_at_least, hour, minute))
            });
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

/// The refusals under a reservation one case met, and how many of them agreed with the model
/// (the same retry_after, the message admitted at it and refused a millisecond before it).
#[derive(Debug, Default)]
struct Tally {
    refusals: u32,
    agreed: u32,
}

/// Runs `steps` for one recipient against the script and the model. Every verdict, outcome
/// and commit must agree; a refusal under a reservation must also agree on its retry_after,
/// be admitted at it and refused just before it, unless `count_only`, when those are counted.
fn run_case(
    h: &LimiterHarness,
    (q, rules): (CalendarQuota, PriorityRules),
    recipient: &str,
    mut now: DateTime<Utc>,
    steps: &[Step],
    count_only: bool,
) -> Result<Tally, TestCaseError> {
    let policy = one_rule_with(q, rules.clone());
    let mut model = Model {
        q,
        admitted: BTreeMap::new(),
    };
    let mut tally = Tally::default();
    for (i, s) in steps.iter().enumerate() {
        now += Duration::minutes(s.advance_minutes);
        let zone: Tz = ZONES[s.zone].parse().expect("zone");
        let id = format!("id{}", s.id);
        let mut body = support::request(&id, recipient, ZONES[s.zone]);
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
        let kept = rules.reserve.filter(|r| s.priority < r.for_at_least);
        let want = match kept {
            Some(r) => {
                let step = (id.as_str(), now, zone, s.commit);
                let mut want = decide_with(&mut model, off_at(r, now, zone), step);
                if !want.allowed {
                    want.retry_after = Some(first_admitted(&model, r, now, zone));
                }
                want
            }
            None => model.decide(&id, now, zone, s.commit),
        };
        let local = now
            .with_timezone(&zone)
            .time()
            .with_second(0)
            .expect("time");
        if kept.is_some() && !want.allowed {
            tally.refusals += 1;
            let agreed = got == want
                && got.retry_after.is_some_and(|at| {
                    admits(h, &policy, &message, at)
                        && !admits(h, &policy, &message, at - Duration::milliseconds(1))
                });
            if agreed {
                tally.agreed += 1;
            } else if !count_only {
                prop_assert_eq!(
                    &got,
                    &want,
                    "step {} at {} ({} local) in {}: {:?}",
                    i,
                    now,
                    local,
                    zone,
                    s
                );
                let at = got.retry_after.expect("a retry_after");
                prop_assert!(
                    admits(h, &policy, &message, at),
                    "step {}: refused at {}",
                    i,
                    at
                );
                prop_assert!(false, "step {}: admitted before {}", i, at);
            }
            let (got_now, want_now) =
                ((got.allowed, got.remaining), (want.allowed, want.remaining));
            prop_assert_eq!(got_now, want_now, "step {} at {}: {:?}", i, now, s);
        } else {
            prop_assert_eq!(
                &got,
                &want,
                "step {} at {} ({} local) in {}: {:?}",
                i,
                now,
                local,
                zone,
                s
            );
        }
        let want_outcome = if want.allowed || exempt {
            OutcomeName::Allow
        } else {
            OutcomeName::Deny
        };
        prop_assert_eq!(outcome, want_outcome, "step {}", i);
        prop_assert_eq!(eval.committed(), s.commit && (want.allowed || exempt));
    }
    Ok(tally)
}

/// Whether the rule admits `message` at `at` (a dry run: nothing is taken).
fn admits(h: &LimiterHarness, policy: &Policy, message: &SendRequest, at: DateTime<Utc>) -> bool {
    h.evaluate(policy, message, at, false).verdicts()[0].allowed
}

#[test]
fn calendar_quota_with_priorities_matches_the_model() {
    let h = LimiterHarness::single("sqtprio");
    let case = AtomicU32::new(0);
    let strategy = (
        rules(false),
        0..STARTS.len(),
        prop::collection::vec(step(), 1..30),
    );
    let result = support::property_runner(96).run(&strategy, |(rules, start, steps)| {
        let recipient = format!("r{}", case.fetch_add(1, Ordering::SeqCst));
        let start = STARTS[start].parse().expect("start instant");
        run_case(&h, rules, &recipient, start, &steps, false).map(|_| ())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// The README's retry_after under a reservation, on a fixed sample of cases (the same every
/// run): every refusal of a message the reservation keeps slots from names the first instant
/// that admits it, before or after the day's lapse, on a later day's morning or at its lapse.
#[test]
fn a_refusal_under_a_reservation_is_admitted_exactly_at_its_retry_after() {
    let h = LimiterHarness::single("sqtresv");
    let (case, refusals, agreed) = (AtomicU32::new(0), AtomicU32::new(0), AtomicU32::new(0));
    let strategy = (
        rules(true),
        0..STARTS.len(),
        prop::collection::vec(step(), 1..30),
    );
    let result = support::model::seeded_runner(48, 38).run(&strategy, |(rules, start, steps)| {
        let recipient = format!("r{}", case.fetch_add(1, Ordering::SeqCst));
        let start = STARTS[start].parse().expect("start instant");
        let tally = run_case(&h, rules, &recipient, start, &steps, true)?;
        refusals.fetch_add(tally.refusals, Ordering::SeqCst);
        agreed.fetch_add(tally.agreed, Ordering::SeqCst);
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    let (refusals, agreed) = (refusals.into_inner(), agreed.into_inner());
    assert!(
        refusals >= 50,
        "only {refusals} refusals under a reservation met"
    );
    assert_eq!(
        agreed, refusals,
        "{agreed} of {refusals} refusals under a reservation admitted exactly at their \
         retry_after and refused a millisecond before it"
    );
}
