//! End-to-end throughput with W worker processes sharing one namespace, and what each process
//! on the machine spent per message (issue 40 item 4: what bounds scale-out here).
//!
//! Each run queues N requests first (headline rule, two messages per recipient on one day, so
//! half are dispatched and half denied), then starts W `sendquota worker` processes at the
//! defaults and times them from spawn until every message has an outcome. Around the run it
//! reads the CPU time of every worker, Redis, RabbitMQ (every beam.smp), Postgres (every
//! postgres process), this bench (publishing nothing while timed: it only polls the outcome
//! counts) and the rest of the machine, from /proc. Runs alternate over the worker counts
//! (1, 2, 4, 1, 2, 4, ...): this machine's speed drifts between minutes, so each count's
//! median comes from the same minutes as the others'.
//!
//! `cargo bench --bench throughput -- [--messages N] [--workers 1,2,4] [--rounds R]
//! [--shards S] [--queue-type quorum|classic]`: `--shards` sets `intake.shards` (every request
//! carries the recipient header either way).

#[path = "../tests/it/support/mod.rs"]
#[allow(dead_code)] // Each bench uses a part of the tests' harness.
mod support;

#[allow(dead_code)]
mod common;

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use sendquota::config::QueueType;
use sendquota::internals::broker;
use support::process::Running;
use support::{request, TestEnv};

/// The workers' fixed clock: every request is for the same local day.
const WORKER_NOW: &str = "2026-02-02T12:00:00Z";

struct Args {
    messages: usize,
    queue_type: QueueType,
    shards: u16,
    workers: Vec<usize>,
    rounds: usize,
}

fn number<T: std::str::FromStr>(value: Option<String>, name: &str) -> T {
    value.and_then(|v| v.parse().ok()).unwrap_or_else(|| {
        eprintln!("{name} takes a whole number");
        std::process::exit(2)
    })
}

fn args() -> Args {
    let mut out = Args {
        messages: 20_000,
        queue_type: QueueType::Quorum,
        shards: 1,
        workers: vec![1],
        rounds: 1,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--messages" => out.messages = number(it.next(), "--messages"),
            "--shards" => out.shards = number(it.next(), "--shards"),
            "--rounds" => out.rounds = number(it.next(), "--rounds"),
            "--workers" => {
                let list = it.next().unwrap_or_default();
                out.workers = list
                    .split(',')
                    .map(|w| number(Some(w.to_owned()), "--workers (a list: 1,2,4)"))
                    .collect();
            }
            "--queue-type" => {
                out.queue_type = match it.next().as_deref() {
                    Some("quorum") => QueueType::Quorum,
                    Some("classic") => QueueType::Classic,
                    _ => {
                        eprintln!("--queue-type takes quorum or classic");
                        std::process::exit(2)
                    }
                }
            }
            "--bench" => {}
            other => {
                eprintln!("unknown argument {other}");
                std::process::exit(2)
            }
        }
    }
    out
}

/// CPU ticks of the processes a run measures, at one instant.
#[derive(Clone, Copy, Default)]
struct Ticks {
    busy: u64,
    idle: u64,
    redis: u64,
    rabbit: u64,
    postgres: u64,
    bench: u64,
}

impl Ticks {
    fn now(redis_pid: &str) -> Ticks {
        let sum = |pids: Vec<String>| pids.iter().filter_map(|p| common::cpu_ticks(p)).sum();
        let (busy, idle) = common::machine_ticks();
        Ticks {
            busy,
            idle,
            redis: common::cpu_ticks(redis_pid).unwrap_or(0),
            rabbit: sum(common::pids_named("beam.smp")),
            postgres: common::postgres_ticks(),
            bench: common::cpu_ticks("self").unwrap_or(0),
        }
    }
}

/// One run's rate and CPU microseconds per message, per process.
struct Run {
    workers: usize,
    rate: f64,
    /// Each worker's, in start order.
    each_worker: Vec<f64>,
    redis: f64,
    rabbit: f64,
    postgres: f64,
    bench: f64,
    other: f64,
    /// Busy share of the machine's cores over the run, in percent.
    busy_pct: f64,
}

impl Run {
    fn all_workers(&self) -> f64 {
        self.each_worker.iter().sum()
    }

    fn total(&self) -> f64 {
        self.all_workers() + self.redis + self.rabbit + self.postgres + self.bench + self.other
    }

    fn line(&self) -> String {
        let each: Vec<String> = self.each_worker.iter().map(|w| format!("{w:.1}")).collect();
        format!(
            "{} workers: {:.0} msgs/s; CPU-us per message: workers {:.1} ({}), redis {:.1}, \
             rabbitmq {:.1}, postgres {:.1}, bench {:.1}, other {:.1}, total {:.1}; machine \
             busy {:.0}%",
            self.workers,
            self.rate,
            self.all_workers(),
            each.join(" + "),
            self.redis,
            self.rabbit,
            self.postgres,
            self.bench,
            self.other,
            self.total(),
            self.busy_pct
        )
    }
}

/// Queues the run's requests on a fresh namespace; returns it.
async fn queue_requests(args: &Args) -> TestEnv {
    let config = format!("[intake]\nshards = {}\n", args.shards);
    let env = TestEnv::with_queue_type(&config, args.queue_type).await;
    let bodies: Vec<(Vec<u8>, String)> = (0..args.messages)
        .map(|i| {
            let recipient = format!("r{}", i / 2);
            let body = request(&format!("m{i}"), &recipient, "UTC");
            (body.to_string().into_bytes(), recipient)
        })
        .collect();
    let publisher = env.publisher.clone();
    let requests = env.names.requests.clone();
    futures_util::stream::iter(bodies.iter())
        .map(|(b, recipient)| {
            let header = [(broker::RECIPIENT_HEADER, recipient.clone())];
            publisher.publish(&requests, "", b, broker::json_properties(None, &header))
        })
        .buffer_unordered(512)
        .for_each(|r| async move { r.expect("publish") })
        .await;
    env
}

/// Starts `workers` worker processes on `env`, waits until every message has an outcome, and
/// says what the run cost.
async fn run(args: &Args, workers: usize, redis_pid: &str) -> Run {
    let n = args.messages;
    let env = queue_requests(args).await;
    let config = format!("\n[intake]\nshards = {}\n", args.shards);
    let before = Ticks::now(redis_pid);
    let started = Instant::now();
    let procs: Vec<Running> = (0..workers)
        .map(|_| Running::spawn(env.cli_with(&config, &["worker", "--now", WORKER_NOW])))
        .collect();
    let mut last_report = Instant::now();
    loop {
        let done =
            env.ready(&env.dispatched_queue).await as usize + env.denial_rows().await as usize;
        if done >= n {
            break;
        }
        if last_report.elapsed() >= Duration::from_secs(2) {
            eprintln!("  {workers} workers: {done}/{n} decided");
            last_report = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let elapsed = started.elapsed();
    let after = Ticks::now(redis_pid);
    let worker_ticks: Vec<u64> = procs
        .iter()
        .map(|p| common::cpu_ticks(&p.id().to_string()).unwrap_or(0))
        .collect();
    for p in procs {
        let warnings = p.stop();
        if !warnings.is_empty() {
            eprintln!("  a worker wrote:\n    {}", warnings.join("\n    "));
        }
    }
    let tick_us = 1e6 / common::clock_ticks_per_second();
    let per = |ticks: u64| ticks as f64 * tick_us / n as f64;
    let busy = after.busy - before.busy;
    let idle = after.idle - before.idle;
    let mut run = Run {
        workers,
        rate: n as f64 / elapsed.as_secs_f64(),
        each_worker: worker_ticks.iter().map(|&t| per(t)).collect(),
        redis: per(after.redis.saturating_sub(before.redis)),
        rabbit: per(after.rabbit.saturating_sub(before.rabbit)),
        postgres: per(after.postgres.saturating_sub(before.postgres)),
        bench: per(after.bench.saturating_sub(before.bench)),
        other: 0.0,
        busy_pct: 100.0 * busy as f64 / (busy + idle).max(1) as f64,
    };
    // Every process not named above: the machine's busy time less theirs.
    run.other = (per(busy) - run.total()).max(0.0);
    run
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

/// One line per worker count: the medians of its runs.
fn summary(runs: &[Run], workers: usize) -> String {
    let of = |f: &dyn Fn(&Run) -> f64| {
        median(
            runs.iter()
                .filter(|r| r.workers == workers)
                .map(f)
                .collect(),
        )
    };
    let rates: Vec<String> = runs
        .iter()
        .filter(|r| r.workers == workers)
        .map(|r| format!("{:.0}", r.rate))
        .collect();
    format!(
        "| {workers} | {:.0} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.0}% |",
        of(&|r| r.rate),
        rates.join(", "),
        of(&|r| r.all_workers()),
        of(&|r| r.redis),
        of(&|r| r.rabbit),
        of(&|r| r.postgres),
        of(&|r| r.bench + r.other),
        of(&|r| r.total()),
        of(&|r| r.busy_pct),
    )
}

#[tokio::main]
async fn main() {
    let args = args();
    let mut conn = redis::Client::open(support::redis_url())
        .expect("redis url")
        .get_multiplexed_async_connection()
        .await
        .expect("Redis answers");
    let redis_pid = common::local_redis_pid(&mut conn).await.unwrap_or_default();
    eprintln!(
        "{} messages per run, {:?} queue, {} shards, workers {:?}, {} rounds; load {}",
        args.messages,
        args.queue_type,
        args.shards,
        args.workers,
        args.rounds,
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );
    let mut runs = Vec::new();
    for round in 1..=args.rounds {
        for &w in &args.workers {
            let r = run(&args, w, &redis_pid).await;
            println!("round {round}: {}", r.line());
            runs.push(r);
        }
    }
    println!(
        "\nmedians of {} rounds ({} messages each; CPU-us per message):\n\
         | workers | msgs/s | runs | workers' CPU | redis | rabbitmq | postgres | other | \
         total | machine busy |\n|---|---|---|---|---|---|---|---|---|---|",
        args.rounds, args.messages
    );
    for &w in &args.workers {
        println!("{}", summary(&runs, w));
    }
}
