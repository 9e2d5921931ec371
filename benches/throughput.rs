//! End-to-end throughput of one worker: N requests are queued first, then the worker decides
//! them (headline rule, two messages per recipient on one day, so half are dispatched and half
//! denied) and the run ends when every message has an outcome.
//!
//! `cargo bench --bench throughput -- [--messages N] [--queue-type quorum|classic] [--shards N]
//! [--workers W]`: `--shards` sets `intake.shards` (every request carries the recipient header
//! either way), `--workers` runs W workers in this process (default 1).

#[path = "../tests/it/support/mod.rs"]
#[allow(dead_code)] // Each bench uses a part of the tests' harness.
mod support;

use std::time::{Duration, Instant};

use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use sendquota::clock::ManualClock;
use sendquota::config::QueueType;
use sendquota::internals::broker;
use support::{request, TestEnv};

struct Args {
    messages: usize,
    queue_type: QueueType,
    shards: u16,
    workers: usize,
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
        workers: 1,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--messages" => out.messages = number(it.next(), "--messages"),
            "--shards" => out.shards = number(it.next(), "--shards"),
            "--workers" => out.workers = number(it.next(), "--workers"),
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

async fn queued(env: &TestEnv, queue: &str) -> u32 {
    env.channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .map(|q| q.message_count())
        .unwrap_or(0)
}

#[tokio::main]
async fn main() {
    let args = args();
    let config = format!("[intake]\nshards = {}\n", args.shards);
    let mut env = TestEnv::with_queue_type(&config, args.queue_type).await;
    let n = args.messages;
    eprintln!("queueing {n} requests ({:?} queue)", args.queue_type);
    let bodies: Vec<(Vec<u8>, String)> = (0..n)
        .map(|i| {
            let recipient = format!("r{}", i / 2);
            let body = request(&format!("m{i}"), &recipient, "UTC");
            (body.to_string().into_bytes(), recipient)
        })
        .collect();
    let publisher = env.publisher.clone();
    let requests = env.names.requests.clone();
    use futures_util::StreamExt;
    futures_util::stream::iter(bodies.iter())
        .map(|(b, recipient)| {
            let header = [(broker::RECIPIENT_HEADER, recipient.clone())];
            publisher.publish(&requests, "", b, broker::json_properties(None, &header))
        })
        .buffer_unordered(512)
        .for_each(|r| async move { r.expect("publish") })
        .await;
    let clock = ManualClock::new("2026-02-02T12:00:00Z".parse().expect("instant"));
    eprintln!("worker started");
    let started = Instant::now();
    env.start_worker(&clock);
    let mut others = Vec::new();
    for _ in 1..args.workers {
        let (settings, clock) = (env.settings.clone(), std::sync::Arc::new(clock.clone()));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let run = tokio::spawn(async move {
            sendquota::startup::run(&settings, clock, None, async {
                let _ = stopped.await;
            })
            .await
            .expect("worker runs");
        });
        others.push((stop, run));
    }
    let mut last_report = Instant::now();
    loop {
        let done =
            queued(&env, &env.dispatched_queue).await as usize + env.denial_rows().await as usize;
        if done >= n {
            break;
        }
        if last_report.elapsed() >= Duration::from_secs(1) {
            eprintln!("{done}/{n} decided");
            last_report = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let elapsed = started.elapsed();
    env.stop_worker().await;
    for (stop, run) in others {
        let _ = stop.send(());
        let _ = run.await;
    }
    let dispatched = queued(&env, &env.dispatched_queue).await;
    let denials = env.denial_rows().await;
    println!(
        "{n} messages in {:.2} s: {:.0} msgs/s ({dispatched} dispatched, {denials} denied, \
         {:?} queue, {} shards, {} workers)",
        elapsed.as_secs_f64(),
        n as f64 / elapsed.as_secs_f64(),
        args.queue_type,
        args.shards,
        args.workers
    );
}
