//! A failover drill on a Redis Cluster with replicas: callers making script calls on keys of
//! every shard, and the instants a replica is promoted and each shard answers again. Shared by
//! the failover test and the bench that reproduces redis-rs's hang (`benches/cluster_hang.rs`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis::aio::ConnectionLike;
use sendquota::config::RedisSettings;

use super::private::{PrivateRedis, PrivateRedisCluster};

/// Calls in flight at once, as a worker's default concurrency makes them.
pub const CALLERS: usize = 64;

/// Callers making a counting script call each, over and over, until stopped, noting when each
/// shard (named by the port of the master that served it at the start) last answered.
pub struct Callers {
    answered: Arc<Mutex<HashMap<u16, Instant>>>,
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Callers {
    /// [`CALLERS`] callers on `conn`, over 300 keys of `cluster`'s shards.
    pub fn start<C>(cluster: &PrivateRedisCluster, conn: C) -> Callers
    where
        C: ConnectionLike + Clone + Send + Sync + 'static,
    {
        let keys: Arc<Vec<(u16, String)>> = Arc::new(
            (0..300)
                .map(|i| {
                    let key = format!("{{drill-{i}}}:count");
                    (cluster.owner(&key).port, key)
                })
                .collect(),
        );
        let answered = Arc::new(Mutex::new(HashMap::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let tasks = (0..CALLERS)
            .map(|n| {
                let (conn, keys) = (conn.clone(), keys.clone());
                let (answered, stop) = (answered.clone(), stop.clone());
                tokio::spawn(call_until(n, conn, keys, answered, stop))
            })
            .collect();
        Callers {
            answered,
            stop,
            tasks,
        }
    }

    /// The ports of `masters` whose shards answered no call after `since`.
    pub fn silent_since(&self, masters: &[&PrivateRedis], since: Instant) -> Vec<u16> {
        let answered = self.answered.lock().expect("lock");
        masters
            .iter()
            .map(|m| m.port)
            .filter(|port| answered.get(port).is_none_or(|at| *at <= since))
            .collect()
    }

    /// How long after `since` every shard of `masters` had answered a call, or the shards
    /// still silent once `limit` has passed.
    pub async fn resumed(
        &self,
        masters: &[&PrivateRedis],
        since: Instant,
        limit: Duration,
    ) -> Result<Duration, Vec<u16>> {
        loop {
            let silent = self.silent_since(masters, since);
            if silent.is_empty() {
                return Ok(since.elapsed());
            }
            if since.elapsed() >= limit {
                return Err(silent);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Stops the callers and waits for them: a call under way ends within its timeout.
    pub async fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        for task in self.tasks {
            let _ = task.await;
        }
    }
}

async fn call_until<C: ConnectionLike + Clone + Send + Sync>(
    n: usize,
    conn: C,
    keys: Arc<Vec<(u16, String)>>,
    answered: Arc<Mutex<HashMap<u16, Instant>>>,
    stop: Arc<AtomicBool>,
) {
    let script = redis::Script::new(
        "redis.call('INCR', KEYS[1]) redis.call('PEXPIRE', KEYS[1], 60000) return 1",
    );
    let mut i = n;
    while !stop.load(Ordering::Relaxed) {
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
            // Failures are what the drill causes: only when answers resume counts.
            Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
}

/// A fresh private cluster of 3 masters with a replica each, and the settings a worker
/// connects to it with: its masters as the seeds, a response timeout of 1 s.
pub async fn cluster() -> (PrivateRedisCluster, RedisSettings) {
    let cluster = tokio::task::spawn_blocking(PrivateRedisCluster::start_with_replicas)
        .await
        .expect("private redis cluster with replicas");
    let settings = RedisSettings {
        cluster_urls: masters(&cluster).iter().map(|m| m.url()).collect(),
        response_timeout_ms: 1_000,
        ..RedisSettings::default()
    };
    (cluster, settings)
}

/// The cluster's masters at its start.
pub fn masters(cluster: &PrivateRedisCluster) -> Vec<&PrivateRedis> {
    cluster.nodes[..3].iter().collect()
}

/// Waits (up to 10 s) until `replica` says it is a master; the instant it did.
pub async fn promotion(replica: &PrivateRedis) -> Instant {
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

/// A manual failover: `CLUSTER FAILOVER` on `master`'s replica; the instant it is promoted.
pub async fn fail_over(cluster: &PrivateRedisCluster, master: &PrivateRedis) -> Instant {
    let replica = cluster.replica_of(master);
    let out = std::process::Command::new("redis-cli")
        .arg("-p")
        .arg(replica.port.to_string())
        .args(["cluster", "failover"])
        .output()
        .expect("redis-cli");
    assert!(out.status.success(), "CLUSTER FAILOVER on {}", replica.port);
    promotion(replica).await
}

/// A master lost: `kill -9` of `master`; the instant its replica is promoted.
pub async fn kill_master(cluster: &PrivateRedisCluster, master: &PrivateRedis) -> Instant {
    let replica = cluster.replica_of(master);
    tokio::task::block_in_place(|| master.kill());
    promotion(replica).await
}
