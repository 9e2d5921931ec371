//! Property test: `lua/kinds/calendar_quota.lua` in real Redis against a plain Rust model of the
//! rule, over random sequences of (time, zone, message id) with repeated ids, dry runs mixed
//! in, and a recipient whose messages change zones from one step to the next: the same
//! decision, remaining and retry_after at every step, and no key without expiry. The model
//! never forgets a send, so the script, which does, must only forget sends no zone counts any
//! more. After every admission the key must live as long as its newest entry counts anywhere.
//! Then the cases from the field: two zones on one day, and an admission in one zone next to
//! a send only a zone further west still counts; and keys written before sends were kept as
//! instants (local day numbers) still counting after the upgrade.

use crate::support;

use std::collections::BTreeMap;

use chrono::{DateTime, Duration, Utc};
use chrono_tz::Tz;
use proptest::prelude::*;
use sendquota::internals::kinds::calendar::{day_number, day_start, window_reach, DayNumber};
use sendquota::internals::kinds::{CalendarQuota, Kind};
use sendquota::internals::message::SendRequest;
use sendquota::internals::policy::{Match, OnDeny, Policy, Rule, Scope};
use sendquota::internals::priority::PriorityRules;
use support::model::LimiterHarness;

/// The rule as a specification, for one recipient whose messages may carry any zone: a send is
/// admitted at instant `now` in zone Z when, in Z's calendar, fewer than `per_day` admitted
/// sends lie on today, and fewer than `per_window` in the window (today and the `window - 1`
/// days before it); the day and the window end with today, so sends after it (a decision at an
/// instant before them) count on their own days. An id whose latest admission falls in that
/// window is recognised and consumes nothing again. Nothing is ever forgotten.
pub(crate) struct Model {
    pub(crate) q: CalendarQuota,
    /// Each id's latest admission.
    pub(crate) admitted: BTreeMap<String, DateTime<Utc>>,
}

#[derive(Debug, PartialEq)]
pub(crate) struct Decision {
    pub(crate) allowed: bool,
    pub(crate) remaining: i64,
    pub(crate) retry_after: Option<DateTime<Utc>>,
}

impl Model {
    /// Sends counted on local day `day` of `zone`: (since the day began, since its window began).
    fn usage(&self, day: DayNumber, zone: Tz) -> (i64, i64) {
        let window = i64::from(self.q.window_days);
        let day_begin = day_start(day, zone);
        let window_begin = day_start(day - window + 1, zone);
        let day_end = day_start(day + 1, zone);
        let since = |from| {
            let on = |t: &&DateTime<Utc>| **t >= from && **t < day_end;
            self.admitted.values().filter(on).count() as i64
        };
        (since(day_begin), since(window_begin))
    }

    fn has_room(&self, day: DayNumber, zone: Tz) -> bool {
        let (on_day, in_window) = self.usage(day, zone);
        on_day < i64::from(self.q.per_day) && in_window < i64::from(self.q.per_window)
    }

    pub(crate) fn decide(
        &mut self,
        id: &str,
        now: DateTime<Utc>,
        zone: Tz,
        commit: bool,
    ) -> Decision {
        let window = i64::from(self.q.window_days);
        let today = day_number(now, zone);
        let (on_day, in_window) = self.usage(today, zone);
        let left =
            (i64::from(self.q.per_day) - on_day).min(i64::from(self.q.per_window) - in_window);
        let window_begin = day_start(today - window + 1, zone);
        let day_end = day_start(today + 1, zone);
        if self
            .admitted
            .get(id)
            .is_some_and(|&t| t >= window_begin && t < day_end)
        {
            return Decision {
                allowed: true,
                remaining: left.max(0),
                retry_after: None,
            };
        }
        if self.has_room(today, zone) {
            if commit {
                self.admitted.insert(id.to_owned(), now);
            }
            return Decision {
                allowed: true,
                remaining: left - 1,
                retry_after: None,
            };
        }
        let next = (today + 1..)
            .find(|&d| self.has_room(d, zone))
            .expect("room on some later day");
        Decision {
            allowed: false,
            remaining: 0,
            retry_after: Some(day_start(next, zone)),
        }
    }
}

/// A policy of one calendar quota, `cq`, on each recipient, in UTC by default.
fn one_rule(q: CalendarQuota) -> Policy {
    one_rule_with(q, PriorityRules::default())
}

/// [`one_rule`] treating priorities as `priority` says.
pub(crate) fn one_rule_with(q: CalendarQuota, priority: PriorityRules) -> Policy {
    Policy {
        default_zone: chrono_tz::UTC,
        rules: vec![Rule {
            name: "cq".to_owned(),
            kind: Kind::CalendarQuota(q),
            matcher: Match::default(),
            scope: Scope::Recipient,
            per_attributes: Vec::new(),
            on_deny: OnDeny::Drop,
            max_delay: None,
            priority,
            on_unavailable: Default::default(),
            digest_by: None,
        }],
    }
}

pub(crate) const ZONES: [&str; 9] = [
    "UTC",
    "America/New_York",
    "Europe/London",
    "Australia/Lord_Howe",
    "Asia/Kathmandu",
    "Pacific/Kiritimati",
    "America/Santiago",
    "Pacific/Pago_Pago",
    "Etc/GMT+12",
];

pub(crate) const STARTS: [&str; 3] = [
    "2026-03-05T10:00:00Z",
    "2026-09-01T02:00:00Z",
    "2026-10-28T20:00:00Z",
];

#[derive(Debug, Clone)]
struct Step {
    advance_minutes: i64,
    zone: usize,
    id: usize,
    commit: bool,
}

fn step() -> impl Strategy<Value = Step> {
    (
        // Mostly hours apart, so that messages in different zones meet on one day.
        prop_oneof![3 => 0i64..=12 * 60, 1 => 0i64..=2 * 24 * 60],
        0..ZONES.len(),
        0usize..6,
        prop::bool::weighted(0.85),
    )
        .prop_map(|(advance_minutes, zone, id, commit)| Step {
            advance_minutes,
            zone,
            id,
            commit,
        })
}

pub(crate) fn quota() -> impl Strategy<Value = CalendarQuota> {
    (1u32..=3, 0u32..=3, 1u32..=8).prop_map(|(per_day, extra, window_days)| CalendarQuota {
        per_day,
        per_window: per_day + extra,
        window_days,
    })
}

#[test]
fn calendar_quota_script_matches_the_model_on_a_single_server() {
    script_matches_model(support::single_settings());
}

#[test]
fn calendar_quota_script_matches_the_model_on_a_cluster() {
    script_matches_model(support::cluster_settings());
}

fn script_matches_model(settings: sendquota::config::RedisSettings) {
    let h = LimiterHarness::on("sqtprop", &settings);
    let case = std::sync::atomic::AtomicU32::new(0);
    let strategy = (
        quota(),
        0..STARTS.len(),
        prop::collection::vec(step(), 1..40),
    );
    let result = support::property_runner(96).run(&strategy, |(q, start, steps)| {
        let n = case.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let recipient = format!("r{n}");
        let policy = one_rule(q);
        let mut model = Model {
            q,
            admitted: BTreeMap::new(),
        };
        let mut now: DateTime<Utc> = STARTS[start].parse().expect("start instant");
        let key = format!("{}:{{r:{recipient}}}:cq:calendar_quota", h.namespace);
        let pttl = |key: &str| -> i64 { h.query(redis::cmd("PTTL").arg(key)) };
        for (i, s) in steps.iter().enumerate() {
            now += Duration::minutes(s.advance_minutes);
            let zone: Tz = ZONES[s.zone].parse().expect("zone");
            let id = format!("id{}", s.id);
            let body = support::request(&id, &recipient, ZONES[s.zone]).to_string();
            let message = SendRequest::decode(body.as_bytes(), 1 << 16).expect("valid");
            let eval = h.evaluate(&policy, &message, now, s.commit);
            let v = &eval.verdicts()[0];
            let got = Decision {
                allowed: v.allowed,
                remaining: v.remaining.expect("calendar_quota counts"),
                retry_after: v.retry_after,
            };
            let want = model.decide(&id, now, zone, s.commit);
            prop_assert_eq!(got, want, "step {} at {} in {}: {:?}", i, now, zone, s);
            prop_assert_eq!(eval.committed(), s.commit && v.allowed);
            if eval.committed() {
                let needed = window_reach(q.window_days);
                let ttl = pttl(&key);
                // The clock runs on between the commit and PTTL: 5 s covers a slow machine.
                prop_assert!(
                    ttl >= needed.num_milliseconds() - 5_000,
                    "step {}: key expires in {} ms, its newest entry counts for {} ms",
                    i,
                    ttl,
                    needed.num_milliseconds()
                );
            }
        }
        let ttl = pttl(&key);
        prop_assert!(
            ttl == -2 || ttl > 0,
            "key {} has no expiry (PTTL {})",
            key,
            ttl
        );
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// One recipient's messages decided with the limiter against real Redis, one rule `q`.
struct Recipient {
    h: LimiterHarness,
    name: String,
    policy: Policy,
}

impl Recipient {
    fn new(q: CalendarQuota) -> Recipient {
        Recipient {
            h: LimiterHarness::single("sqtzones"),
            name: "pat".to_owned(),
            policy: one_rule(q),
        }
    }

    /// Decides and commits message `id` at `at` in `zone` (`None`: no timezone field, so the
    /// policy's default, UTC): whether it was admitted, and its retry_after.
    fn send(&self, id: &str, at: &str, zone: Option<&str>) -> (bool, Option<DateTime<Utc>>) {
        let mut body = support::request(id, &self.name, zone.unwrap_or("UTC"));
        if zone.is_none() {
            body.as_object_mut().expect("object").remove("timezone");
        }
        let message = SendRequest::decode(body.to_string().as_bytes(), 1 << 16).expect("valid");
        let at: DateTime<Utc> = at.parse().expect("instant");
        let eval = self.h.evaluate(&self.policy, &message, at, true);
        (eval.verdicts()[0].allowed, eval.verdicts()[0].retry_after)
    }

    /// Writes entries the way the version before instants did: scored by local day number.
    fn legacy_entries(&self, entries: &[(&str, &str)]) {
        let key = format!("{}:{{r:{}}}:cq:calendar_quota", self.h.namespace, self.name);
        for (id, date) in entries {
            let at: DateTime<Utc> = format!("{date}T12:00:00Z").parse().expect("date");
            let day = day_number(at, chrono_tz::UTC);
            let _: i64 = self.h.query(redis::cmd("ZADD").arg(&key).arg(day).arg(*id));
        }
    }
}

fn headline() -> CalendarQuota {
    CalendarQuota {
        per_day: 1,
        per_window: 3,
        window_days: 7,
    }
}

fn utc(s: &str) -> DateTime<Utc> {
    s.parse().expect("instant")
}

#[test]
fn two_zones_never_give_one_recipient_two_sends_on_one_local_day() {
    // 11:00Z on May 1 is 01:00 on May 2 in Kiritimati (+14) and 11:00 on May 1 in UTC: the
    // first send is on the UTC message's own day either way round.
    for (first, second) in [
        (Some("Pacific/Kiritimati"), Some("UTC")),
        (Some("Pacific/Kiritimati"), None),
        (None, Some("Pacific/Kiritimati")),
    ] {
        let r = Recipient::new(headline());
        assert!(r.send("k-1", "2026-05-01T11:00:00Z", first).0, "{first:?}");
        let (allowed, _) = r.send("u-1", "2026-05-01T11:00:00Z", second);
        assert!(!allowed, "{second:?} after {first:?} at one instant");
    }
}

#[test]
fn an_admission_in_one_zone_keeps_the_sends_a_zone_further_west_still_counts() {
    // 1 per day, 2 per 3 days. m2 (London, Jan 13 00:30) is on New York's Jan 12 as well, and
    // m1 (Jan 10) is in New York's window Jan 10..12, so m3 in New York is refused until its
    // Jan 13 begins (05:00Z), when Jan 10 leaves the window.
    let r = Recipient::new(CalendarQuota {
        per_day: 1,
        per_window: 2,
        window_days: 3,
    });
    assert!(
        r.send("m1", "2026-01-10T12:00:00Z", Some("Europe/London"))
            .0
    );
    assert!(
        r.send("m2", "2026-01-13T00:30:00Z", Some("Europe/London"))
            .0
    );
    let (allowed, retry) = r.send("m3", "2026-01-13T01:00:00Z", Some("America/New_York"));
    assert!(!allowed);
    assert_eq!(retry, Some(utc("2026-01-13T05:00:00Z")));
    // At that instant it is admitted (m2 is on its Jan 12, m1 left).
    assert!(
        r.send("m3", "2026-01-13T05:00:00Z", Some("America/New_York"))
            .0
    );
}

#[test]
fn keys_written_as_local_day_numbers_keep_counting_after_the_upgrade() {
    let r = Recipient::new(headline());
    r.legacy_entries(&[("a", "2026-03-01"), ("b", "2026-03-03")]);
    // An id the old version admitted is recognised.
    assert!(r.send("a", "2026-03-05T10:00:00Z", None).0);
    // Two in the window and none today: room for one, kept as an instant.
    assert!(r.send("c", "2026-03-05T10:00:00Z", None).0);
    // The same day is full (c), and so is the window (a, b, c) until Mar 1 leaves it on Mar 8.
    let (allowed, retry) = r.send("d", "2026-03-06T10:00:00Z", None);
    assert!(!allowed);
    assert_eq!(retry, Some(utc("2026-03-08T00:00:00Z")));
    assert!(r.send("d", "2026-03-08T00:00:00Z", None).0);

    let today = Recipient::new(headline());
    today.legacy_entries(&[("e", "2026-03-05")]);
    let (allowed, retry) = today.send("f", "2026-03-05T23:00:00Z", None);
    assert!(!allowed, "a legacy send today fills today");
    assert_eq!(retry, Some(utc("2026-03-06T00:00:00Z")));
}
