//! `redis.wait_replicas`: Redis replicates asynchronously, so a quota write a master
//! acknowledged and then lost in a failover would let a recipient be sent one message more.
//! With the setting, every committing call (the decision, the dispatch mark) is followed on
//! the same connection by `WAIT`, so that a decision's outcome is only acted on once a replica
//! holds it; without it the worker sends no `WAIT` at all. A replica that does not answer
//! in time does not stop the worker: the decision stands on the master, and is counted as
//! unreplicated so that an operator can see the exposure.

use crate::support;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use sendquota::clock::ManualClock;
use sendquota::config::RedisSettings;
use sendquota::internals::telemetry;
use support::http::metric;
use support::private::PrivateRedis;
use support::{local, request, TestEnv};

/// A master with one replica, each a private server.
async fn master_and_replica() -> (PrivateRedis, PrivateRedis) {
    tokio::task::spawn_blocking(|| {
        let master = PrivateRedis::start();
        let replica = PrivateRedis::start_replica_of(&master);
        (master, replica)
    })
    .await
    .expect("private redis servers")
}

/// An environment whose worker uses `master`, waiting for `replicas` replicas up to
/// `timeout_ms` after each committing call; the worker runs with its admin API, whose port is
/// returned.
async fn worker_waiting_for(
    master: &PrivateRedis,
    replicas: u32,
    timeout_ms: u64,
) -> (TestEnv, u16) {
    let mut env = TestEnv::new().await;
    env.settings.redis.url = master.url();
    env.settings.redis.wait_replicas = replicas;
    env.settings.redis.wait_timeout_ms = timeout_ms;
    let port = env
        .start_admin_worker(&ManualClock::new(local("UTC", "2026-04-01 09:00")))
        .await;
    (env, port)
}

/// Publishes `n` requests two per recipient (`m0`.. to `user-0`..) and waits for each one's
/// outcome; returns how many were dispatched, each id counted once however often it came.
async fn decide_two_per_recipient(env: &TestEnv, n: usize) -> HashMap<String, usize> {
    env.publish_two_per_recipient(n).await;
    let mut seen = HashMap::new();
    for i in 0..n {
        env.outcome(&format!("m{i}"), &mut seen).await;
    }
    seen
}

/// The `calls=` count of `command` in the server's `INFO commandstats`, 0 if never called.
fn calls(server: &PrivateRedis, command: &str) -> u64 {
    let stats = server.info("commandstats");
    stats
        .lines()
        .find_map(|l| l.strip_prefix(&format!("cmdstat_{command}:calls=")))
        .and_then(|rest| rest.split(',').next()?.parse().ok())
        .unwrap_or(0)
}

/// The keys of `namespace` on `server`, sorted.
fn keys(server: &PrivateRedis, namespace: &str) -> Vec<String> {
    let out = std::process::Command::new("redis-cli")
        .args(["-p", &server.port.to_string(), "--scan", "--pattern"])
        .arg(format!("{namespace}*"))
        .output()
        .expect("redis-cli");
    let mut keys: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_owned)
        .collect();
    keys.sort();
    keys
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_committing_call_waits_for_a_replica_when_asked_and_none_waits_by_default() {
    let (master, replica) = master_and_replica().await;
    let (mut env, port) = worker_waiting_for(&master, 1, 2_000).await;
    let dispatched = decide_two_per_recipient(&env, 40).await;
    assert_eq!(dispatched.len(), 20, "one message per recipient dispatched");
    assert!(dispatched.values().all(|&n| n == 1), "{dispatched:?}");
    assert_eq!(metric(port, telemetry::REDIS_UNREPLICATED).await, 0);
    // Stopped, the worker has written every mark (a mark follows its dispatch's confirm, so
    // it can still be on its way when the dispatch is seen).
    env.stop_worker().await;
    // 40 decisions, each followed by a WAIT, and 20 dispatch marks, written in batches (the
    // marks confirmed together go as one pipeline), each batch followed by one.
    let waits = calls(&master, "wait");
    assert!(
        waits > 40,
        "{waits} WAIT calls for 40 decisions and 20 marks"
    );
    let on_master = keys(&master, &env.namespace);
    assert!(!on_master.is_empty());
    assert_eq!(keys(&replica, &env.namespace), on_master);

    // The default waits for no replica and sends no WAIT.
    let before = calls(&master, "wait");
    env.settings.redis.wait_replicas = RedisSettings::default().wait_replicas;
    assert_eq!(env.settings.redis.wait_replicas, 0);
    env.start_admin_worker(&ManualClock::new(local("UTC", "2026-04-02 09:00")))
        .await;
    let mut seen = HashMap::new();
    env.publish(&request("next-day", "user-0", "UTC")).await;
    assert!(
        env.outcome("next-day", &mut seen).await,
        "a new day's message goes out"
    );
    assert_eq!(
        calls(&master, "wait"),
        before,
        "no WAIT without the setting"
    );
    env.stop_worker().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_replica_gone_decisions_stand_exact_and_each_is_counted_unreplicated() {
    let (master, replica) = master_and_replica().await;
    let (mut env, port) = worker_waiting_for(&master, 1, 50).await;
    tokio::task::spawn_blocking(move || replica.kill())
        .await
        .expect("kill the replica");
    let began = Instant::now();
    let dispatched = decide_two_per_recipient(&env, 20).await;
    assert_eq!(dispatched.len(), 10, "one message per recipient dispatched");
    assert!(dispatched.values().all(|&n| n == 1), "{dispatched:?}");
    assert_eq!(
        env.denial_rows().await,
        10,
        "the second of each recipient is denied"
    );
    // 20 decisions, none acknowledged by a replica, each waited its 50 ms on the connection
    // they share; then the 10 marks in one batch or more, which follow the dispatches the
    // test saw.
    assert!(began.elapsed() >= Duration::from_millis(20 * 50));
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let unreplicated = metric(port, telemetry::REDIS_UNREPLICATED).await;
        if unreplicated > 20 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{unreplicated} unreplicated calls counted, not the 20 decisions and the marks"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The quota the unreplicated calls took holds.
    let mut seen = HashMap::new();
    env.publish(&request("third", "user-0", "UTC")).await;
    assert!(
        !env.outcome("third", &mut seen).await,
        "user-0's day is taken"
    );
    env.stop_worker().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_each_committing_call_waits_on_the_master_that_took_its_write() {
    let (cluster, mut settings) = support::drill::cluster().await;
    settings.wait_replicas = 1;
    settings.wait_timeout_ms = 2_000;
    let conn = support::connect_redis(&settings).await;
    let namespace = support::unique("sqtwait");
    let limiter = sendquota::internals::limiter::Limiter::new(conn, &namespace);
    let policy = sendquota::internals::policy::Policy::headline(chrono_tz::UTC);
    let at = local("UTC", "2026-04-01 09:00");
    for i in 0..60 {
        let body = request(&format!("m{i}"), &format!("user-{i}"), "UTC").to_string();
        let message = sendquota::internals::message::SendRequest::decode(body.as_bytes(), 1 << 16)
            .expect("valid request");
        let decided = limiter.evaluate(&policy, &message, at, true).await;
        assert!(decided.expect("decided").committed(), "m{i} is allowed");
    }
    // The WAIT went with each call to the master of its recipient's slot, in one pipeline:
    // every master took writes, and waited after them, and its replica holds them.
    let masters = support::drill::masters(&cluster);
    for master in masters {
        let waits = calls(master, "wait");
        let scripts = calls(master, "evalsha");
        assert!(
            scripts > 0,
            "master {} took some of the 60 recipients",
            master.port
        );
        assert_eq!(waits, scripts, "a WAIT after each call on {}", master.port);
        let replica = cluster.replica_of(master);
        assert_eq!(keys(replica, &namespace), keys(master, &namespace));
    }
}
