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
//! exactness cannot tell from a defect: `cargo bench --bench failover_counts` counts what it
//! costs, and `cluster_failover::` shows the connection follows it.

use crate::support::cluster_load::MAX_GAP;
use crate::support::scale_out::{self, RedisLoss, LOST_NODE};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_workers_through_a_broker_node_restart_and_a_redis_failover_keep_quotas_exact() {
    let run = scale_out::run(RedisLoss::Failover).await;
    eprintln!("scale-out report: {}", run.summary(RedisLoss::Failover));
    let nodes = &run.lost_worker_nodes;
    assert!(
        nodes.len() >= 2 && nodes[0] == LOST_NODE && nodes[1] != LOST_NODE,
        "worker {LOST_NODE} consumed on node {LOST_NODE} (the first of its list), then moved to \
         another when it stopped: {nodes:?}; the workers wrote:\n{}",
        run.said.join("\n")
    );
    run.report
        .assert_exact(&format!("the workers wrote:\n{}", run.said.join("\n")));
    assert!(
        run.broker_gap < MAX_GAP,
        "decisions resumed {:?} after the node stopped",
        run.broker_gap
    );
    // Each shard's own resumption within 5 s of its promotion is `cluster_failover::`'s.
    assert!(
        run.redis_gap.is_some_and(|gap| gap < MAX_GAP),
        "dispatches resumed {:?} after the Redis promotion",
        run.redis_gap
    );
}
