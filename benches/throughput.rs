//! End-to-end throughput of one worker: N requests are queued first, then the worker decides
//! them (headline rule, two messages per recipient on one day, so half are dispatched and half
//! denied) and the run ends when every message has an outcome.
//!
//! `cargo bench --bench throughput -- [--messages N] [--queue-type quorum|classic]`

#[path = "../tests/it/support/mod.rs"]
#[allow(dead_code)] // Each bench uses a part of the tests' harness.
mod support;

use std::time::{Duration, Instant};

use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use sendquota::clock::ManualClock;
use sendquota::config::QueueType;
use support::{request, TestEnv};

struct Args {
    messages: usize,
    queue_type: QueueType,
}

fn args() -> Args {
    let mut out = Args {
        messages: 20_000,
        queue_type: QueueType::Quorum,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--messages" => {
                out.messages = it.next().and_then(|v| v.parse().ok()).unwrap_or_else(|| {
                    eprintln!("--messages takes a whole number");
                    std::process::exit(2)
                })
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
    let mut env = TestEnv::with_queue_type("", args.queue_type).await;
    let n = args.messages;
    eprintln!("queueing {n} requests ({:?} queue)", args.queue_type);
    let bodies: Vec<Vec<u8>> = (0..n)
        .map(|i| {
            request(&format!("m{i}"), &format!("r{}", i / 2), "UTC")
                .to_string()
                .into_bytes()
        })
        .collect();
    let publisher = env.publisher.clone();
    let requests = env.names.requests.clone();
    use futures_util::StreamExt;
    futures_util::stream::iter(bodies.iter())
        .map(|b| publisher.publish(&requests, "", b, lapin::BasicProperties::default()))
        .buffer_unordered(512)
        .for_each(|r| async move { r.expect("publish") })
        .await;
    let clock = ManualClock::new("2026-02-02T12:00:00Z".parse().expect("instant"));
    eprintln!("worker started");
    let started = Instant::now();
    env.start_worker(&clock);
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
    let dispatched = queued(&env, &env.dispatched_queue).await;
    let denials = env.denial_rows().await;
    println!(
        "{n} messages in {:.2} s: {:.0} msgs/s ({dispatched} dispatched, {denials} denied, {:?} queue)",
        elapsed.as_secs_f64(),
        n as f64 / elapsed.as_secs_f64(),
        args.queue_type
    );
}
