//! One run that measures sendquota against its ceilings and prints every figure with its ratio
//! to the ceiling or target:
//!
//! - (a1) ceiling: the calendar_quota decision script driven by a bare pipelined redis-rs loop
//!   (the exact EVALSHA the limiter sends for the headline rule), decisions/s;
//! - (a2) ceiling: a no-work relay through RabbitMQ from a quorum queue to the dispatch
//!   exchange (prefetch 1000, publisher confirms awaited, acks coalesced), msgs/s, in the
//!   fastest shape measured (`relay::RelayShape::CEILING`, printed beside it). It keeps its own
//!   prefetch, threads and ack strategy whatever the worker's: it is the broker's and the
//!   client's best, and a ceiling shaped like the worker would flatter (c)'s ratio.
//!   `--relay-prefetch N` runs it (and (g)'s relay) at prefetch N instead: at the worker's
//!   own prefetch it shows how much of (c)'s distance to (a2) the window alone accounts for;
//! - (b) the decision path (`Limiter::evaluate`, commit, no broker): the headline rule alone and
//!   with two more kinds, against (a1);
//! - (c) the worker binary end to end (quorum queue, half dispatched and half denied), at its
//!   DEFAULT settings (prefetch and concurrency from src/base/config/sections.rs; `--worker-prefetch N` sets
//!   both to N to measure a candidate default), against (a2), with p50/p99 decision latency
//!   from its /metrics histogram; run twice like the relay, each run timed from the worker's
//!   spawn (its start-up is part of what it must win back against the relay). The binary is this package's,
//!   or the one `SENDQUOTA_PERF_WORKER_BIN=/path/to/sendquota` names (another build of the
//!   worker, an older commit's), so that one bench binary drives both sides of an A/B;
//! - (d) the worker's CPU per message and peak RSS, beside the floor under it: the same broker
//!   work (the worker's publisher and settler, half the messages published, coalesced acks, the
//!   worker's prefetch and concurrency) with nothing decided, run in this process between the
//!   two runs of (c);
//! - (e) Redis memory per active recipient, and the decision rate over 1,000,000 recipients
//!   against 10,000 (both pools drawn from 1,000,000 pre-populated recipients' keys);
//! - (f) a hot-recipient workload: new messages to 100 recipients whose whole window is full,
//!   so every one is denied, decided by the decision path without and with the in-process deny
//!   cache, against each other (target: over 1.5x) and against the bare pipelined EVALSHA loop
//!   on the same denials (the Redis ceiling for denials, which the cache should exceed); that
//!   the cache's answers are exact is tests/it/deny_cache.rs's to check, not the bench's;
//! - (g) publish-to-dispatch latency at half the maximum rate: the worker (same binary and
//!   settings as (c)) on an empty namespace, requests published at half of (c)'s rate, paced
//!   every 2 ms, for `--latency-seconds` (after a 1 s warm-up that is not counted), each
//!   carrying its publish instant in its payload (`sent_ns`) and each admitted (distinct
//!   recipients); a consumer on the dispatch sink takes receive minus publish instant: p50,
//!   p99 and max against 20 ms for the p99. Before it, the same with the relay of (a2) in the
//!   worker's place: the broker's (and this process's) share of that latency.
//!
//! Besides, every phase reports the CPU time each process spent per operation (this process,
//! Redis and the part of it executing scripts, RabbitMQ, Postgres, the worker, everything
//! else, idle) so it shows where the time goes on a small machine. The machine may be shared:
//! figures compared with each other ((a1) and (b), the two pools of (e), the three sides of
//! (f)) run in alternating slices, (a2) and (c) run twice each in the order a2 c c a2 (the
//! floor of (d) between the two runs of (c)), and a phase during which
//! other processes took more than 15% of the machine is named in a warning.
//!
//! `cargo bench --bench perf -- [--decisions N] [--concurrency C] [--pipeline P] [--in-flight F]
//! [--messages M] [--recipients R] [--small-recipients S] [--pool-decisions D] [--sample K]
//! [--hot-recipients H] [--hot-decisions N] [--worker-prefetch N] [--latency-seconds S]
//! [--relay-shapes ROUNDS] [--decision-phases-only 1] [--end-to-end-only 1] [--latency-rate R]
//! [--relay-prefetch N] [--relay-shapes-short ROUNDS] [--relay-shape K] [--series PAIRS]
//! [--work-relay-runtimes ROUNDS] [--work-relay-runtime K]`
//! (`--relay-shapes` runs only (a2) in every shape the relay can take, alternating, to choose
//! the ceiling's, see `relay`; `--decision-phases-only` runs the warm-up, (a1) and (b) alone:
//! no broker, no worker; `--end-to-end-only` runs (a2), (c) and (d) alone; `--latency-rate`
//! runs (g) alone at R msgs/s; `--relay-shapes-short` compares only the short list of relay
//! shapes, `--relay-shape K` runs (a2) in the K-th of them; `--series` runs issue 39's series,
//! see `phases::series`, with (a3) the work relay of `phases::work_relay`;
//! `--work-relay-runtimes` compares (a3) alone on each runtime, `--work-relay-runtime K` runs
//! it on the K-th)
//! (cargo runs the bench executable as `perf-HASH --bench ARGS`; it can be run so directly).
//!
//! Layout: `main` parses the flags, runs the phases in this order: warm-up, (a1) with (b), (a2)
//! with (c) and (d), (g), (e), (f) (one module each under `phases/`), and prints the report.
//! Beside them: `args` (flags), `progress` (progress lines), `procs` (CPU and memory of processes
//! from /proc), `scrape` (the worker's /metrics), `keyspace` (this run's Redis keys), `queues`
//! (RabbitMQ helpers), `decision_path` (`Limiter::evaluate` driven concurrently), `ceilings`
//! ((a1) and (a2)), `relay` (the no-work relay's shapes), `worker` (the worker binary, started through the tests' harness) and
//! `report` (the table and the notes).

#[path = "../common/mod.rs"]
#[allow(dead_code)]
mod common;
#[path = "../../tests/it/support/mod.rs"]
#[allow(dead_code)] // Each bench uses a part of the tests' harness.
mod support;

mod args;
mod ceilings;
mod decision_path;
mod keyspace;
mod phases;
mod procs;
mod progress;
mod queues;
mod relay;
mod report;
mod scrape;
mod worker;

use std::time::Instant;

use phases::Bench;
use report::Report;
use worker::WorkerChoice;

/// The worker's allocator, so that the broker floor of (d), run in this process, pays what the
/// worker pays for its allocations.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() {
    let args = args::parse();
    let started = Instant::now();
    eprintln!(
        "perf: {} decisions per decision phase, {} messages per broker phase, {} recipients' \
         keys, pools of {} and {} recipients ({} decisions each), {} decisions per side to {} \
         hot recipients",
        args.decisions,
        args.messages,
        args.recipients,
        args.small_recipients,
        args.recipients,
        args.pool_decisions,
        args.hot_decisions,
        args.hot_recipients
    );
    let worker = WorkerChoice::new(&args);
    eprintln!("perf: worker binary {}, {}", worker.bin, worker.describe());
    let mut report = Report::default();
    let mut bench = Bench::open(args.clone()).await;
    if args.relay_shapes > 0 || args.relay_shapes_short > 0 {
        phases::end_to_end::compare_relay_shapes(&bench).await;
        return;
    }
    if args.work_relay_runtimes > 0 {
        phases::work_relay::compare_runtimes(&bench).await;
        return;
    }
    if args.series > 0 {
        // Issue 39's series: (a2), (a3), (c) alternating, then the floors (benches/perf/issue39.sh).
        phases::series::run(&bench, &worker, args.series, &mut report).await;
        drop(bench);
        report.print(&args, &worker, started.elapsed());
        return;
    }
    if args.latency_rate > 0 {
        // (g) alone at this rate, for tracing its hops (benches/latency/trace.sh).
        let rate = args.latency_rate as f64;
        phases::latency::run(&bench, &worker, rate, None, &mut report).await;
        drop(bench);
        report.print(&args, &worker, started.elapsed());
        return;
    }
    if args.end_to_end_only > 0 {
        // (a2), (c) and (d) alone: an A/B of the worker in a few minutes.
        phases::end_to_end::run(&bench, &worker, &mut report).await;
        drop(bench);
        report.print(&args, &worker, started.elapsed());
        return;
    }
    phases::decision::warm_up(&mut bench).await;
    // (a1) and (b).
    phases::decision::run(&mut bench, &mut report).await;
    if args.decision_phases_only == 0 {
        // (a2), (c) and (d): (c)'s rate, which (g) publishes at half of.
        let c = phases::end_to_end::run(&bench, &worker, &mut report).await;
        // (g), (e), (f).
        phases::latency::run(&bench, &worker, c / 2.0, Some(c), &mut report).await;
        phases::scale::run(&mut bench, &mut report).await;
        phases::hot::run(&mut bench, &mut report).await;
    }
    // Removes the namespace's queues, keys and database before the report.
    drop(bench);
    report.print(&args, &worker, started.elapsed());
}
