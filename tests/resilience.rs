//! The worker supervises itself: a consumer that silently stops is restarted by the watchdog,
//! and SIGTERM drains in-flight messages and exits cleanly without losing any. The binary runs
//! on the number of runtime threads its configuration asks for.

mod support;

use std::collections::HashMap;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use sendquota::clock::ManualClock;
use sendquota::worker::Failpoint;
use support::{local, request, TestEnv};

#[tokio::test]
async fn the_watchdog_restarts_a_consumer_that_silently_stopped() {
    let mut env = TestEnv::new().await;
    env.settings.worker.watchdog_interval_ms = 300;
    env.settings.amqp.prefetch = 2;
    let clock = ManualClock::new(local("UTC", "2026-04-01 09:00"));
    env.start_worker_with(&clock, Some(Failpoint::StallConsumerOnce));
    let started = Instant::now();
    // More messages than the prefetch: the stalled consumer holds two, the rest wait in the
    // queue, which is what the watchdog sees.
    for i in 0..6 {
        env.publish(&request(&format!("m{i}"), &format!("user-{i}"), "UTC"))
            .await;
    }
    let mut seen = HashMap::new();
    for i in 0..6 {
        assert!(
            env.outcome(&format!("m{i}"), &mut seen).await,
            "m{i} dispatched after the restart"
        );
    }
    // The first session took nothing: the message waited for at least one watchdog interval.
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "{:?}",
        started.elapsed()
    );
    env.stop_worker().await;
}

async fn queued(env: &TestEnv) -> u32 {
    env.channel
        .queue_declare(
            env.names.requests.as_str().into(),
            lapin::options::QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            lapin::types::FieldTable::default(),
        )
        .await
        .expect("passive declare")
        .message_count()
}

#[tokio::test]
async fn sigterm_finishes_in_flight_messages_exits_0_and_loses_nothing() {
    let env = TestEnv::new().await;
    let config = std::env::temp_dir().join(format!("{}-term.toml", env.namespace));
    std::fs::write(
        &config,
        "[amqp]\nqueue_type = \"classic\"\nprefetch = 20\n[worker]\nconcurrency = 20\n",
    )
    .expect("config");
    let n = 400;
    env.publish_two_per_recipient(n).await;
    let worker = spawn_worker(&env, &config);
    // Stop it while it is busy.
    let deadline = Instant::now() + Duration::from_secs(20);
    while queued(&env).await as usize > n * 3 / 4 {
        assert!(Instant::now() < deadline, "the worker started consuming");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    stop_cleanly(worker, &config);

    // Everything is decided exactly once or still queued: dispatched + denied + waiting = n.
    let dispatched = env.take_dispatched().await;
    let denied = env.denials().await.len();
    let waiting = queued(&env).await as usize;
    assert!(dispatched.len() + denied > 0, "it was stopped mid-flow");
    assert!(waiting > 0, "it was stopped mid-flow");
    assert_eq!(
        dispatched.len() + denied + waiting,
        n,
        "nothing lost or doubled"
    );
}

#[tokio::test]
async fn the_worker_runs_on_as_many_runtime_threads_as_configured() {
    let env = TestEnv::new().await;
    for (worker_toml, threads) in [("", 1), ("[worker]\nthreads = 3\n", 3)] {
        let config = std::env::temp_dir().join(format!("{}-threads{threads}.toml", env.namespace));
        std::fs::write(
            &config,
            format!("[amqp]\nqueue_type = \"classic\"\n{worker_toml}"),
        )
        .expect("config");
        let id = format!("m-threads{threads}");
        env.publish(&request(&id, &id, "UTC")).await;
        let worker = spawn_worker(&env, &config);
        let deadline = Instant::now() + Duration::from_secs(20);
        while !env.take_dispatched().await.contains(&id) {
            assert!(Instant::now() < deadline, "{id} dispatched");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let runtime_threads = std::fs::read_dir(format!("/proc/{}/task", worker.id()))
            .expect("the worker's threads")
            .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
            .filter(|name| name.trim() == "tokio-rt-worker")
            .count();
        stop_cleanly(worker, &config);
        assert_eq!(runtime_threads, threads, "config {worker_toml:?}");
    }
}

/// Starts the worker binary on `config`, against `env`'s services and namespace.
fn spawn_worker(env: &TestEnv, config: &std::path::Path) -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_sendquota"))
        .args([
            "--config",
            config.to_str().expect("utf-8"),
            "worker",
            "--now",
            "2026-04-01T09:00:00Z",
        ])
        .env("SENDQUOTA_NAMESPACE", &env.namespace)
        .env("SENDQUOTA_REDIS_URL", support::redis_url())
        .env("SENDQUOTA_AMQP_URL", support::amqp_url())
        .env("SENDQUOTA_DATABASE_URL", &env.database_url)
        .env("SENDQUOTA_ADMIN_LISTEN", "")
        .env("SENDQUOTA_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the worker")
}

/// Sends SIGTERM to `worker`, waits for it, removes its config file and checks that it
/// exited with 0.
fn stop_cleanly(worker: std::process::Child, config: &std::path::Path) {
    assert!(Command::new("kill")
        .args(["-TERM", &worker.id().to_string()])
        .status()
        .expect("kill")
        .success());
    let out = worker.wait_with_output().expect("wait for the worker");
    let _ = std::fs::remove_file(config);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
