//! A Redis Cluster with replicas losing masters under load, as an operator's failover drill
//! does it: a `CLUSTER FAILOVER` on one master's replica, then a `kill -9` of another master.
//! The worker's Redis connection follows the new topology by itself: script calls on every
//! shard are answered again within 5 s of each promotion, in every one of three runs (the
//! cluster client redis-rs ships could stop for good at such a failover; see
//! `store::ClusterServer`).

use crate::support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sendquota::config::RedisSettings;
use sendquota::internals::store::RedisConn;
use support::private::{PrivateRedis, PrivateRedisCluster};

/// Calls in flight at once, as a worker's default concurrency makes them.
const CALLERS: usize = 64;

/// Longest a shard may go unanswered after its promotion.
const RESUMED_WITHIN: Duration = Duration::from_secs(5);

/// When each shard (named by the port of its first master) last answered a call.
type LastAnswered = Arc<Mutex<HashMap<u16, Instant>>>;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn script_calls_on_every_shard_resume_within_5_s_of_each_promotion_in_three_runs() {
    for run in 1..=3 {
        let cluster = tokio::task::spawn_blocking(PrivateRedisCluster::start_with_replicas)
            .await
            .expect("private redis cluster with replicas");
        let masters: Vec<&PrivateRedis> = cluster.nodes[..3].iter().collect();
        let settings = RedisSettings {
            cluster_urls: masters.iter().map(|m| m.url()).collect(),
            response_timeout_ms: 1_000,
            ..RedisSettings::default()
        };
        let conn = RedisConn::connect(&settings).await.expect("connect");
        // Keys of every shard: a hash tag each, grouped by the master that serves it now.
        let keys: Vec<(u16, String)> = (0..300)
            .map(|i| {
                let key = format!("{{failover-{i}}}:count");
                (cluster.owner(&key).port, key)
            })
            .collect();
        let answered: LastAnswered = Arc::default();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let callers: Vec<_> = (0..CALLERS)
            .map(|n| {
                let (conn, keys, answered, stop) =
                    (conn.clone(), keys.clone(), answered.clone(), stop.clone());
                tokio::spawn(call_until(n, conn, keys, answered, stop))
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(500)).await;

        // A manual failover of the first master, then the second master lost outright.
        let replica = cluster.replica_of(masters[0]);
        redis_cli(replica.port, &["cluster", "failover"]);
        let promoted = promotion(replica).await;
        assert_resumed(&answered, &masters, promoted, run, "the manual failover").await;

        let replica = cluster.replica_of(masters[1]);
        tokio::task::block_in_place(|| masters[1].kill());
        let promoted = promotion(replica).await;
        assert_resumed(&answered, &masters, promoted, run, "the killed master").await;

        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for caller in callers {
            caller.await.expect("caller");
        }
    }
}

/// Calls a counting script on `keys` (one in `CALLERS` of them, from the `n`th) until `stop`,
/// noting when each shard answered.
async fn call_until(
    n: usize,
    conn: RedisConn,
    keys: Vec<(u16, String)>,
    answered: LastAnswered,
    stop: Arc<std::sync::atomic::AtomicBool>,
) {
    let script = redis::Script::new(
        "redis.call('INCR', KEYS[1]) redis.call('PEXPIRE', KEYS[1], 60000) return 1",
    );
    let mut i = n;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let (shard, key) = &keys[i % keys.len()];
        i += CALLERS;
        let mut c = conn.clone();
        match script.key(key).invoke_async::<i64>(&mut c).await {
            Ok(_) => {
                answered
                    .lock()
                    .expect("lock")
                    .insert(*shard, Instant::now());
            }
            // Failures are what the drill causes: the test asks only when answers resume.
            Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
}

/// Waits (up to 10 s) until `replica` says it is a master; the instant it did.
async fn promotion(replica: &PrivateRedis) -> Instant {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if tokio::task::block_in_place(|| replica.role()) == "master" {
            return Instant::now();
        }
        assert!(
            Instant::now() < deadline,
            "replica {} promoted within 10 s",
            replica.port
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until every shard has answered a call made after `promoted`, failing when one has
/// not within [`RESUMED_WITHIN`].
async fn assert_resumed(
    answered: &LastAnswered,
    masters: &[&PrivateRedis],
    promoted: Instant,
    run: usize,
    after: &str,
) {
    loop {
        let late: Vec<u16> = {
            let answered = answered.lock().expect("lock");
            masters
                .iter()
                .map(|m| m.port)
                .filter(|port| answered.get(port).is_none_or(|at| *at <= promoted))
                .collect()
        };
        if late.is_empty() {
            eprintln!(
                "run {run}: every shard answered {:.2} s after {after}'s promotion",
                promoted.elapsed().as_secs_f64()
            );
            return;
        }
        assert!(
            promoted.elapsed() < RESUMED_WITHIN,
            "run {run}: the shards first served by {late:?} answered no call within \
             {RESUMED_WITHIN:?} of {after}'s promotion"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn redis_cli(port: u16, args: &[&str]) {
    let out = std::process::Command::new("redis-cli")
        .arg("-p")
        .arg(port.to_string())
        .args(args)
        .output()
        .expect("redis-cli");
    assert!(out.status.success(), "redis-cli {args:?}");
}
