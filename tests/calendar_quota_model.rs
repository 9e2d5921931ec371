//! Property test: `lua/calendar_quota.lua` in real Redis against a plain Rust model of the
//! rule, over random sequences of (time, zone, message id) with repeated ids, dry runs mixed
//! in: the same decision, remaining and retry_after at every step, and no key without expiry.
//! After every admission the key must outlive its newest entry in every zone: until that day
//! plus the window begins in the westernmost zone (UTC-12), whichever zone the recipient has
//! now, since a recipient who moves west still counts the entry there.

mod support;

use std::collections::BTreeMap;

use chrono::{DateTime, Duration, Utc};
use chrono_tz::Tz;
use proptest::prelude::*;
use sendquota::limiter::calendar::{day_number, day_start, DayNumber};
use sendquota::limiter::Limiter;
use sendquota::message::SendRequest;
use sendquota::policy::{CalendarQuota, Kind, Match, OnDeny, Policy, Rule, Scope};

/// The rule as a specification: a send is admitted on local day T when fewer than `per_day`
/// admitted sends are on day T and fewer than `per_window` are on days after T - window.
/// An id admitted within the window is recognised and consumes nothing again. When a send is
/// admitted, sends that have left the window are forgotten.
struct Model {
    q: CalendarQuota,
    admitted: BTreeMap<String, DayNumber>,
}

#[derive(Debug, PartialEq)]
struct Decision {
    allowed: bool,
    remaining: i64,
    retry_after: Option<DateTime<Utc>>,
}

impl Model {
    fn usage(&self, day: DayNumber) -> (i64, i64) {
        let window = i64::from(self.q.window_days);
        let on_day = self.admitted.values().filter(|&&d| d == day).count() as i64;
        let in_window = self
            .admitted
            .values()
            .filter(|&&d| d > day - window)
            .count() as i64;
        (on_day, in_window)
    }

    fn has_room(&self, day: DayNumber) -> bool {
        let (on_day, in_window) = self.usage(day);
        on_day < i64::from(self.q.per_day) && in_window < i64::from(self.q.per_window)
    }

    fn decide(&mut self, id: &str, today: DayNumber, zone: Tz, commit: bool) -> Decision {
        let window = i64::from(self.q.window_days);
        let (on_day, in_window) = self.usage(today);
        let left =
            (i64::from(self.q.per_day) - on_day).min(i64::from(self.q.per_window) - in_window);
        if self.admitted.get(id).is_some_and(|&d| d > today - window) {
            return Decision {
                allowed: true,
                remaining: left.max(0),
                retry_after: None,
            };
        }
        if self.has_room(today) {
            if commit {
                self.admitted.retain(|_, d| *d > today - window);
                self.admitted.insert(id.to_owned(), today);
            }
            return Decision {
                allowed: true,
                remaining: left - 1,
                retry_after: None,
            };
        }
        let next = (today + 1..)
            .find(|&d| self.has_room(d))
            .expect("room on some later day");
        Decision {
            allowed: false,
            remaining: 0,
            retry_after: Some(day_start(next, zone)),
        }
    }
}

const ZONES: [&str; 8] = [
    "UTC",
    "America/New_York",
    "Europe/London",
    "Australia/Lord_Howe",
    "Asia/Kathmandu",
    "Pacific/Kiritimati",
    "America/Santiago",
    "Pacific/Pago_Pago",
];

const STARTS: [&str; 3] = [
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
        0i64..=2 * 24 * 60,
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

fn quota() -> impl Strategy<Value = CalendarQuota> {
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

/// The key's remaining time to live in milliseconds (-2 when it is gone).
async fn pttl(redis: &sendquota::store::RedisConn, key: &str) -> i64 {
    redis::cmd("PTTL")
        .arg(key)
        .query_async(&mut redis.clone())
        .await
        .expect("pttl")
}

fn script_matches_model(settings: sendquota::config::RedisSettings) {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let namespace = support::unique("sqtprop");
    let redis = rt.block_on(support::connect_redis(&settings));
    let limiter = Limiter::new(redis.clone(), &namespace);
    let case = std::sync::atomic::AtomicU32::new(0);
    let strategy = (
        quota(),
        0..STARTS.len(),
        prop::collection::vec(step(), 1..40),
    );
    let result = support::property_runner(96).run(&strategy, |(q, start, steps)| {
        let n = case.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let recipient = format!("r{n}");
        let policy = Policy {
            default_zone: chrono_tz::UTC,
            rules: vec![Rule {
                name: "cq".to_owned(),
                kind: Kind::CalendarQuota(q),
                matcher: Match::default(),
                scope: Scope::Recipient,
                on_deny: OnDeny::Drop,
            }],
        };
        let mut model = Model {
            q,
            admitted: BTreeMap::new(),
        };
        let mut now: DateTime<Utc> = STARTS[start].parse().expect("start instant");
        let key = format!("{namespace}:{{r:{recipient}}}:cq:calendar_quota");
        rt.block_on(async {
            for (i, s) in steps.iter().enumerate() {
                now += Duration::minutes(s.advance_minutes);
                let zone: Tz = ZONES[s.zone].parse().expect("zone");
                let id = format!("id{}", s.id);
                let body = support::request(&id, &recipient, ZONES[s.zone]).to_string();
                let message = SendRequest::decode(body.as_bytes(), 1 << 16).expect("valid");
                let eval = limiter
                    .evaluate(&policy, &message, now, s.commit)
                    .await
                    .expect("evaluate");
                let v = &eval.verdicts[0];
                let got = Decision {
                    allowed: v.allowed,
                    remaining: v.remaining.expect("calendar_quota counts"),
                    retry_after: v.retry_after,
                };
                let want = model.decide(&id, day_number(now, zone), zone, s.commit);
                prop_assert_eq!(got, want, "step {} at {} in {}: {:?}", i, now, zone, s);
                prop_assert_eq!(eval.committed, s.commit && v.allowed);
                if eval.committed {
                    let newest = model.admitted.values().max().copied().expect("admitted");
                    let west = chrono_tz::Etc::GMTPlus12;
                    let needed = day_start(newest + i64::from(q.window_days), west) - now;
                    let ttl = pttl(&redis, &key).await;
                    // The clock runs on between the commit and PTTL: 5 s covers a slow machine.
                    prop_assert!(
                        ttl >= needed.num_milliseconds() - 5_000,
                        "step {}: key expires in {} ms, its newest entry (day {}) counts for {} ms",
                        i,
                        ttl,
                        newest,
                        needed.num_milliseconds()
                    );
                }
            }
            let ttl = pttl(&redis, &key).await;
            prop_assert!(
                ttl == -2 || ttl > 0,
                "key {} has no expiry (PTTL {})",
                key,
                ttl
            );
            Ok(())
        })
    });
    rt.block_on(support::delete_keys(
        &mut redis.clone(),
        &format!("{namespace}:*"),
    ));
    if let Err(e) = result {
        panic!("{e}");
    }
}
