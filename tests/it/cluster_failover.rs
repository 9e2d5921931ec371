//! A Redis Cluster with replicas losing masters under load, as an operator's failover drill
//! does it: a `CLUSTER FAILOVER` on one master's replica, then a `kill -9` of another master.
//! The worker's Redis connection follows the new topology by itself: script calls on every
//! shard are answered again within 5 s of each promotion, in every one of three runs (the
//! cluster client redis-rs ships could stop for good at such a failover; see
//! `store::ClusterServer` and `benches/cluster_hang.rs`).

use crate::support;

use std::time::Duration;

use sendquota::internals::store::RedisConn;
use support::drill::{self, Callers};

/// Longest a shard may go unanswered after its promotion.
const RESUMED_WITHIN: Duration = Duration::from_secs(5);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn script_calls_on_every_shard_resume_within_5_s_of_each_promotion_in_three_runs() {
    for run in 1..=3 {
        let (cluster, settings) = drill::cluster().await;
        let masters = drill::masters(&cluster);
        let conn = RedisConn::connect(&settings).await.expect("connect");
        let callers = Callers::start(&cluster, conn);
        tokio::time::sleep(Duration::from_millis(500)).await;

        let drills = [("the manual failover", 0), ("the killed master", 1)];
        for (after, master) in drills {
            let promoted = if master == 0 {
                drill::fail_over(&cluster, masters[master]).await
            } else {
                drill::kill_master(&cluster, masters[master]).await
            };
            match callers.resumed(&masters, promoted, RESUMED_WITHIN).await {
                Ok(took) => eprintln!("run {run}: every shard answered {took:?} after {after}"),
                Err(silent) => panic!(
                    "run {run}: the shards first served by {silent:?} answered no call within \
                     {RESUMED_WITHIN:?} of {after}'s promotion"
                ),
            }
        }
        callers.stop().await;
    }
}
