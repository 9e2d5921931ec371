//! What losing a Redis master costs three workers under load, counted (issue 40 item 2): the
//! scale-out run of `tests/it/scale_out.rs` (three worker processes on a private 3-node
//! RabbitMQ cluster and a private Redis Cluster with replicas, worker 1's node stopped and
//! started again) with the master lost by `kill -9` instead of a manual failover. A killed
//! master's replica is promoted without the writes it had not copied yet, so a quota write or
//! a dispatch mark can be lost (docs/guarantees.md): this counts the ids lost, the recipients
//! over their quota (double-counted sends) and the duplicate dispatches, run by run, rather
//! than asserting none.
//!
//! `cargo bench --bench failover_counts -- [--runs N] [--failover]` (`--failover`: the manual
//! failover the test asserts exact, for comparison). Each run starts its clusters afresh.

#[path = "../tests/it/support/mod.rs"]
#[allow(dead_code)] // Each bench uses a part of the tests' harness.
mod support;

use support::scale_out::{self, RedisLoss};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let runs: usize = args
        .iter()
        .position(|a| a == "--runs")
        .and_then(|i| args.get(i + 1)?.parse().ok())
        .unwrap_or(3);
    let loss = if args.iter().any(|a| a == "--failover") {
        RedisLoss::Failover
    } else {
        RedisLoss::Kill
    };
    let mut totals = [0usize; 4];
    for n in 1..=runs {
        eprintln!("run {n} of {runs}: starting the clusters and three workers");
        let run = scale_out::run(loss).await;
        println!("run {n}: {}", run.summary(loss));
        let r = &run.report;
        for (total, count) in totals.iter_mut().zip([
            r.lost.len(),
            r.over_quota.len(),
            r.in_window,
            r.outside_window.len(),
        ]) {
            *total += count;
        }
    }
    println!(
        "{runs} runs, Redis master lost by {loss:?}: lost {}, recipients over quota {}, \
         duplicate dispatches {} in the crash window and {} outside it",
        totals[0], totals[1], totals[2], totals[3]
    );
}
