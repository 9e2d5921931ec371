//! A minimal case of redis-rs's cluster connection stopping for good at a failover under load,
//! beside the worker's own connection, which recovers.
//!
//! Why it exists: on 2026-11-28 two workers on a Redis Cluster hung after a master was lost,
//! every decision timing out on every shard until a restart. This bench shows the cause is in
//! redis-rs's cluster client (1.8), with nothing of sendquota's but the connection wrapper
//! it compares: 64 callers make a counting script call each, over and over, on keys of every
//! shard of a private cluster of 3 masters with a replica each; a `CLUSTER FAILOVER` moves one
//! master to its replica, then another master is killed (`kill -9`) and its replica promoted.
//! For each connection, redis-rs's `ClusterConnection` as it comes (`raw`) and sendquota's
//! `RedisConn` (`ClusterServer`: a new connection when no call on the whole cluster is
//! answered for two response timeouts), it prints how long after each promotion every shard
//! answered a call again, or `hung` when some shard had not within 30 s. Both are built with
//! the worker's settings (response timeout 1 s, 3 retries). Docs: docs/guarantees.md.
//!
//!     cargo bench --bench cluster_hang -- [--runs N]      (default 3; root, redis-server)

#[path = "../tests/it/support/mod.rs"]
#[allow(dead_code)] // Each bench uses a part of the tests' harness.
mod support;

use std::time::Duration;

use sendquota::internals::store::RedisConn;
use support::drill::{self, Callers};

/// How long a shard may stay silent before the run calls the connection hung.
const HUNG_AFTER: Duration = Duration::from_secs(30);

fn main() {
    let runs = std::env::args()
        .skip_while(|a| a != "--runs")
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or(3);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    runtime.block_on(async {
        for run in 1..=runs {
            for raw in [true, false] {
                let name = if raw { "raw redis-rs" } else { "sendquota" };
                let outcome = drill_once(raw).await;
                println!("run {run} {name:>12}: {outcome}");
            }
        }
    });
}

/// One drill on a fresh cluster; what became of the calls after each promotion.
async fn drill_once(raw: bool) -> String {
    let (cluster, settings) = drill::cluster().await;
    let masters = drill::masters(&cluster);
    let callers = if raw {
        let timeout = Duration::from_millis(settings.response_timeout_ms);
        let client = redis::cluster::ClusterClient::builder(settings.cluster_urls.clone())
            .connection_timeout(timeout)
            .response_timeout(timeout)
            .overall_response_timeout(Some(timeout))
            .retries(3)
            .build()
            .expect("a cluster client");
        let conn = client.get_async_connection().await.expect("connect");
        Callers::start(&cluster, conn)
    } else {
        Callers::start(
            &cluster,
            RedisConn::connect(&settings).await.expect("connect"),
        )
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut said = Vec::new();
    for (what, master) in [("failover", 0), ("kill -9", 1)] {
        let promoted = if master == 0 {
            drill::fail_over(&cluster, masters[master]).await
        } else {
            drill::kill_master(&cluster, masters[master]).await
        };
        match callers.resumed(&masters, promoted, HUNG_AFTER).await {
            Ok(took) => said.push(format!(
                "{what}: answered {:.2} s after",
                took.as_secs_f64()
            )),
            Err(silent) => {
                said.push(format!(
                    "{what}: hung ({} shards silent {HUNG_AFTER:?})",
                    silent.len()
                ));
                break;
            }
        }
    }
    callers.stop().await;
    said.join(", ")
}
