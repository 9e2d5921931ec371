//! Scale-out under failures (issue 40 item 4): three worker processes share one namespace on a
//! private 3-node RabbitMQ cluster (each worker starting on a node of its own) and a private
//! Redis Cluster of 3 masters with a replica each, at the default settings, while requests
//! flow (two per recipient, decided at once by different workers; some published twice). The
//! node one worker is on stops, a Redis master fails over while it is down, and the node starts
//! again. Afterwards every recipient has had exactly its one message of the day, no id is
//! lost, dispatched twice outside the crash window or both dispatched and denied, and every
//! denial is recorded once.
//!
//! The Redis failover is a `CLUSTER FAILOVER` (the replica takes over once it holds every write
//! of its master): what an operator's drill or a maintenance does. A master killed outright can
//! lose the writes its replica had not copied yet (docs/guarantees.md), which a test of
//! exactness cannot tell from a defect; `cluster_failover::` covers that kill.

use std::time::{Duration, Instant};

use crate::support::cluster_load::{
    cluster_env, first_dispatch_after, from_node, outcomes, Load, MAX_GAP,
};
use crate::support::drill;
use crate::support::private::PrivateRabbitCluster;
use crate::support::process::Running;

/// Worker processes, as a team that outgrew one runs them.
const WORKERS: usize = 3;

/// The node whose loss the test causes: worker 1's, not the test's own clients' (node 0).
const LOST_NODE: usize = 1;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_workers_through_a_broker_node_restart_and_a_redis_failover_keep_quotas_exact() {
    let ((rabbit, env, names), (redis, redis_settings)) =
        tokio::join!(cluster_env(), drill::cluster());
    // Worker k's list starts at node k: the three share the load across the nodes.
    let redis_urls = redis_settings.cluster_urls.join(",");
    let workers: Vec<Running> = (0..WORKERS)
        .map(|k| {
            let mut cmd = env.cli(&["worker", "--now", "2026-06-01T10:00:00Z"]);
            cmd.env(
                "SENDQUOTA_AMQP_URLS",
                from_node(&rabbit.urls(), k).join(","),
            )
            .env("SENDQUOTA_REDIS_CLUSTER_URLS", &redis_urls)
            // Info: each worker says which node it connected to.
            .env("SENDQUOTA_LOG", "info");
            Running::spawn(cmd)
        })
        .collect();
    let mut load = Load::start(&rabbit, &env, &names, 0).await;
    let seen = load.seen.clone();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let lost = &workers[LOST_NODE];
    assert_eq!(
        consuming_on(&rabbit, &lost.lines()),
        vec![LOST_NODE],
        "worker {LOST_NODE} consumes on node {LOST_NODE} (the first of its list); it wrote:\n{}",
        lost.lines().join("\n")
    );

    // The broker node goes, Redis fails over while it is away, the node comes back.
    let stopping = Instant::now();
    tokio::task::block_in_place(|| rabbit.stop(LOST_NODE));
    let stopped = Instant::now();
    let broker_gap = first_dispatch_after(&seen, stopped).await;
    let masters = drill::masters(&redis);
    let promoted = drill::fail_over(&redis, masters[0]).await;
    let redis_gap = tokio::time::timeout(MAX_GAP * 2, first_dispatch_after(&seen, promoted))
        .await
        .unwrap_or_else(|_| {
            panic!(
                "no dispatch within {:?} of the Redis failover; the workers wrote:\n{}",
                MAX_GAP * 2,
                workers
                    .iter()
                    .flat_map(Running::lines)
                    .collect::<Vec<_>>()
                    .join("\n")
            )
        });
    tokio::task::block_in_place(|| rabbit.start_again(LOST_NODE));
    tokio::task::block_in_place(|| rabbit.wait_all_members_online(0));
    tokio::time::sleep(Duration::from_secs(2)).await;
    let messages = load.finish(&env).await;
    let moved = consuming_on(&rabbit, &workers[LOST_NODE].lines());
    assert!(
        moved.len() >= 2 && moved[1] != LOST_NODE,
        "worker {LOST_NODE} moved to another node when its own stopped: {moved:?}"
    );
    let said: Vec<String> = workers.into_iter().flat_map(Running::stop).collect();
    let report = outcomes(&seen, &env, messages, stopping, stopped).await;
    eprintln!(
        "scale-out report ({WORKERS} workers): {}; first dispatch {:.2} s after node \
         {LOST_NODE} stopped, {:.2} s after the Redis promotion (crash window: first copy \
         within 1 s of the node stopping)",
        report.summary(),
        broker_gap.as_secs_f64(),
        redis_gap.as_secs_f64(),
    );
    report.assert_exact(&format!("the workers wrote:\n{}", said.join("\n")));
    assert!(
        broker_gap < MAX_GAP,
        "decisions resumed {broker_gap:?} after the node stopped"
    );
    // Each shard's own resumption within 5 s of its promotion is `cluster_failover::`'s.
    assert!(
        redis_gap < MAX_GAP,
        "dispatches resumed {redis_gap:?} after the Redis promotion"
    );
}

/// The nodes a worker's consuming connection reached, in order, from its log `lines`.
fn consuming_on(rabbit: &PrivateRabbitCluster, lines: &[String]) -> Vec<usize> {
    lines
        .iter()
        .filter(|l| l.contains("connected to rabbitmq") && l.contains("sendquota-worker-consume"))
        .filter_map(|l| {
            (0..rabbit.urls().len()).find(|&n| l.contains(&format!(":{}/", rabbit.port(n))))
        })
        .collect()
}
