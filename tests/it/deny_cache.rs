//! The deny cache is exact: over a skewed workload (a few hot recipients who keep being sent
//! to, repeated ids, dispatched ids sent again, resets, midnights, several zones), a limiter
//! answering from the cache gives every decision an uncached limiter gives, while answering
//! many of them without Redis.

use crate::support;

use std::collections::HashMap;
use std::sync::Arc;

use chrono::{DateTime, Duration, Utc};
use proptest::prelude::*;
use sendquota::clock::ManualClock;
use sendquota::config::Settings;
use sendquota::internals::dedup::DispatchMarks;
use sendquota::internals::deny_cache::DenyCache;
use sendquota::internals::limiter::Limiter;
use sendquota::internals::message::SendRequest;
use sendquota::internals::policy::Policy;
use support::fixtures::policy;
use support::{local, request, TestEnv};

const ZONES: [&str; 3] = ["UTC", "America/New_York", "Asia/Kathmandu"];
const CHANNELS: [&str; 2] = ["sms", "email"];
const CATEGORIES: [&str; 2] = ["default", "marketing"];

#[derive(Debug, Clone)]
enum Op {
    Send {
        recipient: usize,
        id: usize,
        zone: usize,
        /// Indexes into [`CHANNELS`] and [`CATEGORIES`].
        channel: usize,
        category: usize,
        advance_minutes: i64,
        /// Whether an admitted message is then dispatched (its id marked, as the worker does).
        dispatch: bool,
    },
    Reset {
        recipient: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    // Recipients 0..3 are hot (most of the traffic), 3..40 cold; ids repeat within a pool.
    let recipient = prop_oneof![8 => 0usize..3, 2 => 3usize..40];
    prop_oneof![
        60 => (recipient, 0usize..400, prop_oneof![9 => Just(0usize), 1 => 0usize..3], (0usize..2, 0usize..2), 0i64..180, prop::bool::weighted(0.8))
            .prop_map(|(recipient, id, zone, (channel, category), advance_minutes, dispatch)| Op::Send { recipient, id, zone, channel, category, advance_minutes, dispatch }),
        1 => (0usize..3).prop_map(|recipient| Op::Reset { recipient }),
    ]
}

/// The worker's default: marks outlive a 7-day quota window by a day.
const DEDUP_TTL_S: u64 = 8 * 24 * 3600;

fn policy(toml: &str) -> Policy {
    Settings::from_toml(toml, |_| None).expect("valid").policy
}

/// Runs random workloads under `toml`'s policy through a cached and an uncached limiter; the
/// cache must answer at least one decision in `min_hit_one_in`.
fn exact_over_random_workloads(toml: &str, min_hit_one_in: u64) {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let redis = rt.block_on(support::connect_redis(&support::single_settings()));
    let policy = policy(toml);
    let hits = std::sync::atomic::AtomicU64::new(0);
    let decisions = std::sync::atomic::AtomicU64::new(0);
    let result = support::property_runner(12).run(&prop::collection::vec(op(), 50..400), |ops| {
        let cached_ns = support::unique("sqtcache");
        let plain_ns = support::unique("sqtplain");
        let cache = Arc::new(DenyCache::new());
        cache.enable(true);
        let cached = Limiter::new(redis.clone(), &cached_ns).with_deny_cache(cache.clone());
        let plain = Limiter::new(redis.clone(), &plain_ns);
        let marks =
            [&cached_ns, &plain_ns].map(|ns| DispatchMarks::new(redis.clone(), ns, DEDUP_TTL_S));
        let mut now: DateTime<Utc> = "2026-03-07T20:00:00Z".parse().expect("instant");
        let outcome = rt.block_on(async {
            for (step, op) in ops.iter().enumerate() {
                match op {
                    Op::Send {
                        recipient,
                        id,
                        zone,
                        channel,
                        category,
                        advance_minutes,
                        dispatch,
                    } => {
                        now += Duration::minutes(*advance_minutes);
                        let mut body =
                            request(&format!("m{id}"), &format!("r{recipient}"), ZONES[*zone]);
                        body["channel"] = CHANNELS[*channel].into();
                        body["category"] = CATEGORIES[*category].into();
                        let m = SendRequest::decode(body.to_string().as_bytes(), 1 << 16)
                            .expect("valid");
                        let before = cache.hits();
                        let a = cached
                            .evaluate(&policy, &m, now, true)
                            .await
                            .expect("cached");
                        // DENY_CACHE_TRACE=1 prints every step, for finding a failing one.
                        if std::env::var("DENY_CACHE_TRACE").is_ok() {
                            eprintln!(
                                "{step} {op:?} {now} hit={} {:?}",
                                cache.hits() > before,
                                a.verdicts()
                                    .iter()
                                    .map(|v| (v.allowed, v.already, v.remaining, v.retry_after))
                                    .collect::<Vec<_>>()
                            );
                        }
                        let b = plain.evaluate(&policy, &m, now, true).await.expect("plain");
                        let view = |e: &sendquota::internals::limiter::Evaluation| {
                            (
                                e.committed(),
                                e.dispatched(),
                                e.verdicts()
                                    .iter()
                                    .map(|v| {
                                        (v.rule.clone(), v.allowed, v.remaining, v.retry_after)
                                    })
                                    .collect::<Vec<_>>(),
                            )
                        };
                        prop_assert_eq!(view(&a), view(&b), "step {} {:?} at {}", step, op, now);
                        if b.committed() && *dispatch {
                            for sent in &marks {
                                sent.mark(&m.recipient, &m.id, now).await.expect("mark");
                            }
                        }
                    }
                    Op::Reset { recipient } => {
                        let r = format!("r{recipient}");
                        cached.reset(&policy, &r).await.expect("reset");
                        plain.reset(&policy, &r).await.expect("reset");
                    }
                }
            }
            Ok(())
        });
        for ns in [&cached_ns, &plain_ns] {
            rt.block_on(support::delete_keys(&mut redis.clone(), &format!("{ns}:*")));
        }
        hits.fetch_add(cache.hits(), std::sync::atomic::Ordering::SeqCst);
        decisions.fetch_add(
            ops.iter().filter(|o| matches!(o, Op::Send { .. })).count() as u64,
            std::sync::atomic::Ordering::SeqCst,
        );
        outcome
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    let (hits, decisions) = (hits.into_inner(), decisions.into_inner());
    eprintln!("deny cache answered {hits} of {decisions} decisions");
    assert!(
        hits * min_hit_one_in > decisions,
        "the cache answered {hits} of {decisions}: too few to matter"
    );
}

#[test]
fn cached_decisions_equal_uncached_ones_for_the_headline_rule() {
    exact_over_random_workloads("", 5);
}

/// Caps that match some channels or categories only: a message's cached verdicts hold for
/// messages matching the same rules, and an admission under some rules changes what is cached
/// under others (an sms denied by the sms cap, then an email to the same recipient, allowed).
#[test]
fn cached_decisions_equal_uncached_ones_for_caps_filtered_by_channel_and_category() {
    exact_over_random_workloads(
        policy!("sms_all_and_marketing_caps"),
        // Every admission invalidates its recipient under filtered caps, and the workload
        // mixes four channel and category pairs: fewer answers, still exact.
        40,
    );
}

#[test]
fn cached_decisions_equal_uncached_ones_for_two_calendar_rules() {
    exact_over_random_workloads(policy!("daily_and_weekly_caps"), 5);
}

#[tokio::test]
async fn a_dispatched_id_sent_again_after_leaving_the_window_is_a_duplicate_not_a_cached_denial() {
    let redis = support::connect_redis(&support::single_settings()).await;
    let ns = support::unique("sqtdup");
    let cache = Arc::new(DenyCache::new());
    cache.enable(true);
    let cached = Limiter::new(redis.clone(), &ns).with_deny_cache(cache.clone());
    let plain = Limiter::new(redis.clone(), &ns);
    // Marks outlive the quota's memory of a send (the window plus two days).
    let marks = DispatchMarks::new(redis.clone(), &ns, 14 * 24 * 3600);
    let policy = policy("");
    let message = |id: &str| {
        SendRequest::decode(request(id, "alice", "UTC").to_string().as_bytes(), 1 << 16)
            .expect("valid")
    };
    // Early in the UTC day: from 10:00 UTC tomorrow has begun in UTC+14, and the cache only
    // keeps denials that no zone could admit yet.
    let day1 = local("UTC", "2026-05-01 01:00");
    let old = message("old");
    // Sends on days 1, 11, 12 and 13; on day 13 "old" has left every zone's window and its
    // entry is gone, but its dispatch mark lives on.
    for (id, day) in [("old", 0), ("s6", 10), ("s7", 11), ("s8", 12)] {
        let at = day1 + Duration::days(day);
        let e = cached.evaluate(&policy, &message(id), at, true).await;
        assert!(e.expect("admitted").committed(), "{id}");
        marks.mark("alice", id, at).await.expect("mark");
    }
    let day13 = day1 + Duration::days(12);
    assert_eq!(
        support::zset_members(
            &mut redis.clone(),
            &format!("{ns}:{{r:alice}}:headline:calendar_quota")
        )
        .await,
        ["s6", "s7", "s8"]
    );
    // Alice is full in every zone: the first denial fills the cache, the next is a hit.
    for (id, hour) in [("d1", 1), ("d2", 2)] {
        let e = cached
            .evaluate(&policy, &message(id), day13 + Duration::hours(hour), true)
            .await
            .expect("denied");
        assert!(!e.committed() && !e.dispatched(), "{id}: {e:?}");
    }
    assert_eq!(cache.hits(), 1, "the second denial came from the cache");
    let at = day13 + Duration::hours(3);
    let again = cached
        .evaluate(&policy, &old, at, true)
        .await
        .expect("again");
    assert!(again.dispatched(), "a duplicate, not a denial: {again:?}");
    assert_eq!(cache.hits(), 1);
    assert_eq!(
        plain
            .evaluate(&policy, &old, at, true)
            .await
            .expect("plain"),
        again
    );
    support::delete_keys(&mut redis.clone(), &format!("{ns}:*")).await;
}

#[test]
fn policies_with_other_kinds_or_scopes_are_not_cached() {
    let p = policy(policy!("headline_and_a_global_gcra"));
    let m = SendRequest::decode(request("x", "r", "UTC").to_string().as_bytes(), 1 << 16)
        .expect("valid");
    assert!(!DenyCache::eligible(&p.rules_for(&m)));
    assert!(DenyCache::eligible(&policy("").rules_for(&m)));
}

/// A worker's cache holds a recipient whose window is full; a reset made by another process
/// (here the test's own limiter, as `DELETE /v1/recipients/{id}/quota` on another worker does)
/// reaches it through pub/sub, and the worker admits the recipient's next message at once.
/// The window is filled on three days: a refusal only because today is full is never cached,
/// so the cache would stay empty and the test could not tell a heard reset from none.
#[tokio::test]
async fn a_reset_through_the_admin_path_reaches_the_workers_cache() {
    a_reset_reaches_the_workers_cache(TestEnv::new().await).await;
}

/// The same on a Redis Cluster: the worker's subscription is on one node, the reset's
/// announcement is published through the cluster connection to whichever node it picks.
#[tokio::test]
async fn on_a_cluster_a_reset_through_the_admin_path_reaches_the_workers_cache() {
    a_reset_reaches_the_workers_cache(TestEnv::on_cluster("").await).await;
}

async fn a_reset_reaches_the_workers_cache(mut env: TestEnv) {
    let port = support::private::free_port();
    env.settings.admin.listen = format!("127.0.0.1:{port}");
    let clock = ManualClock::new(local("UTC", "2026-04-01 09:00"));
    env.start_worker(&clock);
    support::http::wait_until_listening(port).await;
    let mut seen = HashMap::new();
    for day in 1..=3 {
        clock.set(local("UTC", &format!("2026-04-0{day} 09:00")));
        env.publish(&request(&format!("day{day}"), "alice", "UTC"))
            .await;
        assert!(env.outcome(&format!("day{day}"), &mut seen).await);
    }
    for i in 1..=3 {
        // Denied: the window is full; the first from Redis, the next ones from the cache.
        env.publish(&request(&format!("more{i}"), "alice", "UTC"))
            .await;
        assert!(!env.outcome(&format!("more{i}"), &mut seen).await);
    }
    let hits = deny_cache_hits(port).await;
    assert!(hits >= 2, "the worker answered from its cache: {hits} hits");
    let admin = Limiter::new(env.redis.clone(), &env.namespace);
    admin
        .reset(&env.settings.policy, "alice")
        .await
        .expect("reset");
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    env.publish(&request("after-reset", "alice", "UTC")).await;
    assert!(
        env.outcome("after-reset", &mut seen).await,
        "allowed after the reset"
    );
    assert_eq!(deny_cache_hits(port).await, hits, "decided in Redis");
    env.stop_worker().await;
}

/// The worker's `sendquota_deny_cache_hits_total`, from its admin API.
async fn deny_cache_hits(port: u16) -> u64 {
    let metrics = support::http::http(port, "GET", "/metrics", None, "")
        .await
        .body;
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(sendquota::internals::telemetry::DENY_CACHE_HITS))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}
