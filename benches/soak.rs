//! Soak: the worker binary under a steady publish rate for a bounded time. Reports the worker's
//! resident memory over the run (it must stay flat) and Redis memory per active recipient for
//! the headline rule.
//!
//! `cargo bench --bench soak -- [--seconds 300] [--rate 1000]`

#[allow(dead_code)]
mod common;
#[path = "../tests/it/support/mod.rs"]
#[allow(dead_code)] // Each bench uses a part of the tests' harness.
mod support;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::{request, TestEnv};

/// Resident set size of `pid` in KiB, from /proc.
fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

#[tokio::main]
async fn main() {
    let seconds = common::flag("--seconds", 300);
    let rate = common::flag("--rate", 1_000);
    let env = TestEnv::with_queue_type("", sendquota::config::QueueType::Quorum).await;
    let config = std::env::temp_dir().join(format!("{}-soak.toml", env.namespace));
    std::fs::write(&config, "[amqp]\nqueue_type = \"quorum\"\n").expect("config");
    let mut worker = env
        .worker_command()
        .args(["--config", config.to_str().expect("utf-8"), "worker"])
        .stdout(Stdio::null())
        .spawn()
        .expect("start the worker");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let pid = worker.id();
    let rss_start = rss_kib(pid);
    println!(
        "soak: {seconds} s at {rate} msgs/s; worker RSS at start {} KiB",
        rss_start
    );
    let started = Instant::now();
    let mut sent = 0u64;
    let mut samples = Vec::new();
    let mut next_sample = Duration::from_secs(10);
    // Two messages per recipient a day: half dispatched, half denied; new recipients keep
    // arriving, so the set of active recipients grows for the whole run.
    while started.elapsed() < Duration::from_secs(seconds) {
        let due = (started.elapsed().as_secs_f64() * rate as f64) as u64;
        while sent < due {
            let body = request(&format!("m{sent}"), &format!("r{}", sent / 2), "UTC");
            env.publish(&body).await;
            sent += 1;
        }
        if started.elapsed() >= next_sample {
            let rss = rss_kib(pid);
            samples.push(rss);
            eprintln!(
                "{:>4} s: {sent} published, worker RSS {rss} KiB",
                started.elapsed().as_secs()
            );
            next_sample += Duration::from_secs(10);
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let rss_end = rss_kib(pid);
    let _ = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status();
    let _ = worker.wait();
    let _ = std::fs::remove_file(&config);
    let keys = env.keys().await;
    let headline: Vec<&String> = keys
        .iter()
        .filter(|k| k.ends_with(":calendar_quota"))
        .collect();
    let mut conn = env.redis.clone();
    let mut total = 0u64;
    let sample: Vec<&&String> = headline
        .iter()
        .step_by((headline.len() / 1_000).max(1))
        .collect();
    for key in &sample {
        let bytes: u64 = redis::cmd("MEMORY")
            .arg("USAGE")
            .arg(key.as_str())
            .query_async(&mut conn)
            .await
            .unwrap_or(0);
        total += bytes;
    }
    let per_recipient = total as f64 / sample.len().max(1) as f64;
    println!(
        "soak: published {sent}; worker RSS start {rss_start} KiB, end {rss_end} KiB, max {} KiB; \
         {} active recipients, Redis MEMORY USAGE per headline key {per_recipient:.0} bytes \
         (mean of {} keys)",
        samples
            .iter()
            .copied()
            .max()
            .unwrap_or(rss_end)
            .max(rss_end),
        headline.len(),
        sample.len()
    );
}
