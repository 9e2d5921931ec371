//! Three worker processes sharing one namespace through failures of both clusters at once: a
//! private 3-node RabbitMQ cluster (worker k starting on node k) and a private Redis Cluster of
//! 3 masters with a replica each, at the default settings, under [`Load`]. The node worker 1 is
//! on stops, a Redis master is lost while it is down (a manual failover, or `kill -9`), and the
//! node comes back. Shared by the scale-out test (the manual failover, outcomes exact) and the
//! bench that counts what a killed master costs (`benches/failover_counts.rs`).

use std::time::{Duration, Instant};

use super::cluster_load::{cluster_env, first_dispatch_after, from_node, outcomes};
use super::cluster_load::{Load, Reconciled, MAX_GAP};
use super::drill;
use super::private::PrivateRabbitCluster;
use super::process::Running;

/// Worker processes, as a team that outgrew one runs them.
pub const WORKERS: usize = 3;

/// The node whose loss the run causes: worker 1's, not the load's own clients' (node 0).
pub const LOST_NODE: usize = 1;

/// How the Redis master is lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RedisLoss {
    /// `CLUSTER FAILOVER` on its replica: the replica takes over once it holds every write.
    Failover,
    /// `kill -9` of the master: its replica is promoted without what it had not copied yet.
    #[allow(dead_code)]
    // Counted by benches/failover_counts.rs; the test asserts the failover.
    Kill,
}

/// What one run did.
pub struct Run {
    pub report: Reconciled,
    /// From the node's stop to the first dispatch after it.
    pub broker_gap: Duration,
    /// From the promotion to the first dispatch after it; `None` when none came within twice
    /// [`MAX_GAP`].
    pub redis_gap: Option<Duration>,
    /// The nodes worker [`LOST_NODE`]'s consuming connection reached, in order.
    pub lost_worker_nodes: Vec<usize>,
    /// Every line the workers wrote.
    pub said: Vec<String>,
}

impl Run {
    /// The run's report line.
    pub fn summary(&self, loss: RedisLoss) -> String {
        format!(
            "{WORKERS} workers, Redis master lost by {loss:?}: {}; first dispatch {:.2} s after \
             node {LOST_NODE} stopped, {} after the Redis promotion (crash window: first copy \
             within 1 s of the node stopping)",
            self.report.summary(),
            self.broker_gap.as_secs_f64(),
            self.redis_gap
                .map_or("none".to_owned(), |g| format!("{:.2} s", g.as_secs_f64())),
        )
    }
}

/// One run, from fresh clusters to the outcomes reconciled.
pub async fn run(loss: RedisLoss) -> Run {
    let ((rabbit, env, names), (redis, redis_settings)) =
        tokio::join!(cluster_env(), drill::cluster());
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

    // The broker node goes, the Redis master is lost while it is away, the node comes back.
    let stopping = Instant::now();
    tokio::task::block_in_place(|| rabbit.stop(LOST_NODE));
    let stopped = Instant::now();
    let broker_gap = first_dispatch_after(&seen, stopped).await;
    let master = drill::masters(&redis)[0];
    let promoted = match loss {
        RedisLoss::Failover => drill::fail_over(&redis, master).await,
        RedisLoss::Kill => drill::kill_master(&redis, master).await,
    };
    let redis_gap = tokio::time::timeout(MAX_GAP * 2, first_dispatch_after(&seen, promoted))
        .await
        .ok();
    tokio::task::block_in_place(|| rabbit.start_again(LOST_NODE));
    tokio::task::block_in_place(|| rabbit.wait_all_members_online(0));
    tokio::time::sleep(Duration::from_secs(2)).await;
    let messages = load.finish(&env).await;
    let lost_worker_nodes = consuming_on(&rabbit, &workers[LOST_NODE].lines());
    let said = workers.into_iter().flat_map(Running::stop).collect();
    Run {
        report: outcomes(&seen, &env, messages, stopping, stopped).await,
        broker_gap,
        redis_gap,
        lost_worker_nodes,
        said,
    }
}

/// The nodes a worker's consuming connection reached, in order, from its log `lines`.
fn consuming_on(rabbit: &PrivateRabbitCluster, lines: &[String]) -> Vec<usize> {
    let ports: Vec<String> = (0..rabbit.urls().len())
        .map(|n| format!(":{}/", rabbit.port(n)))
        .collect();
    lines
        .iter()
        .filter(|l| l.contains("connected to rabbitmq") && l.contains("sendquota-worker-consume"))
        .filter_map(|l| ports.iter().position(|port| l.contains(port.as_str())))
        .collect()
}
