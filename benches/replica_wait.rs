//! What `redis.wait_replicas = 1` costs in decisions per second.
//!
//! Why it exists: the setting follows every committing call with `WAIT 1 <ms>` on the
//! connection every call shares, and Redis holds that connection until the replica has
//! acknowledged, so the calls behind it wait too. This bench measures the worker's own calls
//! through the library: per message the decision with its in-flight claim
//! (`Limiter::evaluate_claimed`, the headline rule) and, for an allowed one, the dispatch mark,
//! at the worker's default concurrency (256 messages in flight), against a private master with
//! one replica, with and without the setting, in alternating rounds. It prints each round and
//! the medians. Docs: docs/performance.md, docs/guarantees.md.
//!
//!     cargo bench --bench replica_wait -- [--messages N] [--rounds R] [--concurrency C]
//!     (defaults 20000, 3, 256; redis-server on the PATH)

#[allow(dead_code)]
mod common;
#[path = "../tests/it/support/mod.rs"]
#[allow(dead_code)] // Each bench uses a part of the tests' harness.
mod support;

use std::time::Instant;

use chrono::{DateTime, Utc};
use futures_util::StreamExt;
use sendquota::config::{RedisSettings, WorkerSettings};
use sendquota::internals::claim::Claim;
use sendquota::internals::dedup::DispatchMarks;
use sendquota::internals::limiter::Limiter;
use sendquota::internals::message::SendRequest;
use sendquota::internals::policy::Policy;
use sendquota::internals::store::RedisConn;
use support::private::PrivateRedis;

fn main() {
    let messages = common::flag("--messages", 20_000);
    let rounds = common::flag("--rounds", 3);
    let concurrency = common::flag("--concurrency", WorkerSettings::default().concurrency);
    let master = PrivateRedis::start();
    let replica = PrivateRedis::start_replica_of(&master);
    sendquota::cli::runtime(WorkerSettings::default().threads)
        .expect("tokio runtime")
        .block_on(bench(&master, messages, rounds, concurrency));
    drop(replica);
}

async fn bench(master: &PrivateRedis, messages: usize, rounds: usize, concurrency: usize) {
    println!(
        "{messages} messages a run (half to recipients already sent to: denied), {concurrency} \
         in flight, master with one replica; {rounds} alternating rounds"
    );
    let mut rates: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    for round in 1..=rounds {
        for (side, wait_replicas) in [0u32, 1].into_iter().enumerate() {
            let settings = RedisSettings {
                url: master.url(),
                wait_replicas,
                ..RedisSettings::default()
            };
            let conn = support::connect_redis(&settings).await;
            let rate = run(conn, messages, concurrency).await;
            println!("round {round}: wait_replicas = {wait_replicas}: {rate:>8.0} messages/s");
            rates[side].push(rate);
        }
    }
    let [off, on] = rates.map(|mut r| {
        r.sort_by(f64::total_cmp);
        r[r.len() / 2]
    });
    println!(
        "medians: without WAIT {off:.0} messages/s, with WAIT 1 {on:.0} ({:.2}x)",
        on / off
    );
}

/// Decides `n` messages, two per recipient, `concurrency` at a time in a namespace of their
/// own, marking each allowed one dispatched; returns messages per second.
async fn run(conn: RedisConn, n: usize, concurrency: usize) -> f64 {
    let namespace = support::unique("sqtwait");
    let limiter = Limiter::new(conn.clone(), &namespace);
    let marks = DispatchMarks::new(
        conn.clone(),
        &namespace,
        WorkerSettings::default().dedup_ttl_secs,
    );
    let policy = Policy::headline(chrono_tz::UTC);
    let at: DateTime<Utc> = "2026-04-01T12:00:00Z".parse().expect("instant");
    let requests: Vec<SendRequest> = (0..n)
        .map(|i| {
            let body = support::request(&format!("m{i}"), &format!("r{}", i / 2), "UTC");
            SendRequest::decode(body.to_string().as_bytes(), 1 << 16).expect("valid")
        })
        .collect();
    let began = Instant::now();
    let allowed: usize = futures_util::stream::iter(&requests)
        .map(|m| {
            let (limiter, marks, policy) = (&limiter, &marks, &policy);
            async move {
                let claim = Claim::new(30_000);
                let e = limiter.evaluate_claimed(policy, m, at, &claim).await;
                let allowed = e.expect("decision").committed();
                if allowed {
                    marks.mark(&m.recipient, &m.id, at).await.expect("mark");
                }
                usize::from(allowed)
            }
        })
        .buffer_unordered(concurrency)
        .fold(0, |a, b| async move { a + b })
        .await;
    let rate = n as f64 / began.elapsed().as_secs_f64();
    assert_eq!(allowed, n / 2, "one message a recipient allowed");
    support::delete_keys(&mut conn.clone(), &format!("{namespace}:*")).await;
    rate
}
