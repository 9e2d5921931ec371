//! Decisions per second of the limiter path (policy + one script call per scope, no broker),
//! per kind, each kind alone in a policy, against local Redis; and, from Redis's
//! `INFO commandstats`, the time Redis spent inside the decision script and the commands the
//! script ran, per decision: the figures to compare when a kind's script changes (Redis's own
//! counters, so they do not depend on how busy the client side is).
//!
//! Last, the first messages of `--hostile` distinct recipients whose ids are hostile to key
//! building (braces, colons, percent signs, emoji), each allowed and given one key, against
//! the budget of 30 s for 100,000 that the suite once asserted.
//!
//! `cargo bench --bench decisions -- [--decisions N] [--concurrency C] [--recipients R]
//! [--hostile N]`

#[allow(dead_code)]
mod common;
#[path = "../tests/it/support/mod.rs"]
#[allow(dead_code)] // Each bench uses a part of the tests' harness.
mod support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use chrono::{DateTime, Duration, Utc};
use futures_util::StreamExt;
use sendquota::config::Settings;
use sendquota::internals::limiter::Limiter;
use sendquota::internals::message::SendRequest;
use sendquota::internals::policy::Policy;

const KINDS: [(&str, &str); 10] = [
    ("calendar_quota (headline)", "kind = \"calendar_quota\""),
    ("fixed_window", "kind = \"fixed_window\"\nlimit = 5\nwindow = \"1h\""),
    ("sliding_window hash", "kind = \"sliding_window\"\nlimit = 5\nwindow = \"1h\"\nsub_window = \"1m\""),
    ("sliding_window list", "kind = \"sliding_window\"\nlimit = 5\nwindow = \"1h\"\nsub_window = \"1m\"\nstorage = \"list\""),
    ("sliding_log", "kind = \"sliding_log\"\nsub_window = \"1m\"\npolicies = [{ limit = 3, window = \"10m\" }, { limit = 5, window = \"1h\" }]"),
    ("leaky_bucket", "kind = \"leaky_bucket\"\ncapacity = 5\nrate = 1\nperiod = \"1m\""),
    ("token_bucket", "kind = \"token_bucket\"\ncapacity = 5\nrate = 1\nperiod = \"1m\""),
    ("gcra", "kind = \"gcra\"\nrate = 5\nperiod = \"1h\"\nburst = 5"),
    ("zset_window", "kind = \"zset_window\"\nlimit = 5\nwindow = \"1h\""),
    ("quiet_hours", "kind = \"quiet_hours\"\nstart = \"22:00\"\nend = \"08:00\""),
];

fn policy(rule: &str) -> Policy {
    Settings::from_toml(&format!("[[rules]]\nname = \"r\"\n{rule}\n"), |_| None)
        .expect("bench policy is valid")
        .policy
}

/// Runs `n` committed decisions over `recipients` recipients, `concurrency` at a time, one
/// simulated millisecond apart; returns decisions per second and the share allowed.
async fn run(
    limiter: &Limiter,
    policy: &Arc<Policy>,
    n: usize,
    concurrency: usize,
    recipients: usize,
) -> (f64, f64) {
    let start: DateTime<Utc> = "2026-04-01T12:00:00Z".parse().expect("instant");
    let messages: Vec<SendRequest> = (0..n)
        .map(|i| {
            let body = support::request(&format!("m{i}"), &format!("r{}", i % recipients), "UTC");
            SendRequest::decode(body.to_string().as_bytes(), 1 << 16).expect("valid")
        })
        .collect();
    let began = Instant::now();
    let allowed: usize = futures_util::stream::iter(messages.iter().enumerate())
        .map(|(i, m)| {
            let policy = policy.clone();
            async move {
                let at = start + Duration::milliseconds(i as i64);
                let e = limiter
                    .evaluate(&policy, m, at, true)
                    .await
                    .expect("evaluate");
                usize::from(e.committed())
            }
        })
        .buffer_unordered(concurrency)
        .fold(0, |a, b| async move { a + b })
        .await;
    let secs = began.elapsed().as_secs_f64();
    (n as f64 / secs, allowed as f64 / n as f64)
}

/// Microseconds inside EVALSHA and commands run by the scripts, per decision, between two
/// snapshots of `common::command_stats`.
fn script_cost(
    before: &BTreeMap<String, (u64, u64)>,
    after: &BTreeMap<String, (u64, u64)>,
    n: usize,
) -> (f64, f64) {
    let delta = |name: &str| {
        let (c0, u0) = before.get(name).copied().unwrap_or((0, 0));
        let (c1, u1) = after.get(name).copied().unwrap_or((0, 0));
        (c1.saturating_sub(c0), u1.saturating_sub(u0))
    };
    let inner: u64 = after
        .keys()
        .filter(|name| !matches!(name.as_str(), "evalsha" | "info" | "script|load"))
        .map(|name| delta(name).0)
        .sum();
    (
        delta("evalsha").1 as f64 / n as f64,
        inner as f64 / n as f64,
    )
}

#[tokio::main]
async fn main() {
    let n = common::flag("--decisions", 50_000);
    let concurrency = common::flag("--concurrency", 128);
    let recipients = common::flag("--recipients", 10_000);
    let redis = support::connect_redis(&support::single_settings()).await;
    let namespace = support::unique("sqtbench");
    let limiter = Limiter::new(redis.clone(), &namespace);
    println!(
        "{n} decisions per kind, {concurrency} concurrent, {recipients} recipients, local Redis"
    );
    println!(
        "{:<28} {:>12} {:>9} {:>14} {:>14}",
        "kind", "decisions/s", "allowed", "script us/dec", "commands/dec"
    );
    for (name, rule) in KINDS {
        let policy = Arc::new(policy(rule));
        let before = common::command_stats(&mut redis.clone()).await;
        let (rate, allowed) = run(&limiter, &policy, n, concurrency, recipients).await;
        let (script_us, commands) =
            script_cost(&before, &common::command_stats(&mut redis.clone()).await, n);
        println!(
            "{name:<28} {rate:>12.0} {:>8.0}% {script_us:>14.2} {commands:>14.2}",
            allowed * 100.0
        );
        support::delete_keys(&mut redis.clone(), &format!("{namespace}:*")).await;
    }
    let hostile = common::flag("--hostile", 100_000);
    let policy = Arc::new(Policy::headline(chrono_tz::UTC));
    let started = Instant::now();
    let allowed = first_messages_to_hostile_ids(&limiter, &policy, hostile, concurrency).await;
    let took = started.elapsed();
    support::delete_keys(&mut redis.clone(), &format!("{namespace}:*")).await;
    let budget = 30.0 * hostile as f64 / 100_000.0;
    println!(
        "{hostile} first messages to hostile recipient ids: {allowed} allowed in {:.1} s \
         ({:.0}/s); budget {budget:.1} s: {}",
        took.as_secs_f64(),
        hostile as f64 / took.as_secs_f64(),
        if took.as_secs_f64() <= budget {
            "ok"
        } else {
            "SLOW"
        }
    );
}

/// Decides the first message of each of `n` recipients with hostile ids; returns how many
/// were allowed (all of them, when the key building is right).
async fn first_messages_to_hostile_ids(
    limiter: &Limiter,
    policy: &Arc<Policy>,
    n: usize,
    concurrency: usize,
) -> usize {
    let now: DateTime<Utc> = "2026-03-02T09:00:00Z".parse().expect("instant");
    futures_util::stream::iter(0..n)
        .map(|i| async move {
            let request = support::first_message_to_hostile_id(i);
            let evaluation = limiter
                .evaluate(policy, &request, now, true)
                .await
                .expect("redis answers");
            usize::from(evaluation.committed())
        })
        .buffer_unordered(concurrency)
        .fold(0, |sum, one| async move { sum + one })
        .await
}
