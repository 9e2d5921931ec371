//! RabbitMQ as the broker phases use it: request bodies queued ahead (publisher-confirmed),
//! consuming and publishing connections opened as the worker opens them, and a phase run in
//! this process on a runtime shaped like the worker's, so that (a2), (d)'s floor and (g)'s relay
//! pay for their threads what the worker pays for its own.

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use lapin::options::{QueueDeclareOptions, QueuePurgeOptions};
use lapin::types::FieldTable;
use lapin::BasicProperties;
use sendquota::internals::broker::Names;

use crate::procs::{Procs, Tally};
use crate::progress::Progress;
use crate::support::{self, request, TestEnv};

/// Messages in `queue` (ready ones; 0 when it cannot be asked).
pub async fn queued(env: &TestEnv, queue: &str) -> usize {
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
        .map(|q| q.message_count() as usize)
        .unwrap_or(0)
}

/// Request bodies: two per recipient on one day, so half are dispatched and half denied.
pub fn bodies(n: usize) -> Vec<Vec<u8>> {
    (0..n)
        .map(|i| {
            request(&format!("m{i}"), &format!("r{}", i / 2), "UTC")
                .to_string()
                .into_bytes()
        })
        .collect()
}

/// Publishes `bodies` to the requests exchange (publisher-confirmed, 512 in flight) and waits
/// until the requests queue holds them all.
pub async fn prepublish(env: &TestEnv, bodies: &[Vec<u8>], label: &str) {
    let mut progress = Progress::new(label, bodies.len());
    let mut confirms = futures_util::stream::iter(bodies.iter())
        .map(|b| {
            env.publisher
                .publish(&env.names.requests, "", b, BasicProperties::default())
        })
        .buffer_unordered(512);
    while let Some(r) = confirms.next().await {
        r.expect("publish request");
        progress.add(1);
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while queued(env, &env.names.requests).await < bodies.len() {
        assert!(Instant::now() < deadline, "requests queue never filled");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A channel on `conn` with prefetch `prefetch`, for consuming.
pub async fn prefetching_channel(conn: &lapin::Connection, prefetch: u16) -> lapin::Channel {
    let channel = conn.create_channel().await.expect("channel");
    channel
        .basic_qos(prefetch, lapin::options::BasicQosOptions::default())
        .await
        .expect("qos");
    channel
}

/// Starts consuming the requests queue of `names` on `channel`.
pub async fn consume_requests(channel: &lapin::Channel, names: &Names) -> lapin::Consumer {
    channel
        .basic_consume(
            names.requests.as_str().into(),
            "sendquota-perf".into(),
            lapin::options::BasicConsumeOptions::default(),
            lapin::types::FieldTable::default(),
        )
        .await
        .expect("consume")
}

/// Takes `n` deliveries from `consumer` and runs `each(delivery)` for each as a task of its own,
/// as the worker does; returns once all `n` have finished, with progress under `label`. The
/// shared loop of the relay of (a2) and the floor of (d), which differ only in `each`.
pub async fn spawn_each<F>(
    consumer: &mut lapin::Consumer,
    n: usize,
    label: &str,
    mut each: impl FnMut(lapin::message::Delivery) -> F,
) where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    poll_each(consumer, n, label, |delivery| {
        let task = tokio::spawn(each(delivery));
        async move { task.await.expect("delivery task") }
    })
    .await
}

/// Takes `n` deliveries from `consumer` and spawns `each(delivery)` for each, as a plain
/// program does: the loop only takes deliveries, each task counts itself done, and the last
/// one wakes the loop. Returns once all `n` have finished, with progress under `label`.
pub async fn spawn_detached<F>(
    consumer: &mut lapin::Consumer,
    n: usize,
    label: &str,
    mut each: impl FnMut(lapin::message::Delivery) -> F,
) where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    let done = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let all_done = std::sync::Arc::new(tokio::sync::Notify::new());
    let mut progress = Progress::new(label, n);
    for _ in 0..n {
        let delivery = consumer
            .next()
            .await
            .expect("consumer ended")
            .expect("delivery");
        let task = each(delivery);
        let (done, all_done) = (done.clone(), all_done.clone());
        tokio::spawn(async move {
            task.await;
            if done.fetch_add(1, std::sync::atomic::Ordering::AcqRel) + 1 == n {
                all_done.notify_one();
            }
        });
        progress.add(1);
    }
    // `notify_one` keeps a permit when nobody waits yet, so the last task's wake-up is not lost.
    all_done.notified().await;
}

/// Takes `n` deliveries from `consumer` and polls `each(delivery)` for each on this task,
/// beside the consumer: no task per delivery, and every wake-up from lapin's I/O thread lands
/// on one task. Returns once all `n` have finished, with progress under `label`.
pub async fn poll_each<F>(
    consumer: &mut lapin::Consumer,
    n: usize,
    label: &str,
    mut each: impl FnMut(lapin::message::Delivery) -> F,
) where
    F: std::future::Future<Output = ()>,
{
    let mut running = futures_util::stream::FuturesUnordered::new();
    let mut progress = Progress::new(label, n);
    let (mut taken, mut done) = (0usize, 0usize);
    while done < n {
        tokio::select! {
            biased;
            Some(()) = running.next(), if !running.is_empty() => {
                done += 1;
                progress.add(1);
            }
            d = consumer.next(), if taken < n => {
                let delivery = d.expect("consumer ended").expect("delivery");
                taken += 1;
                running.push(each(delivery));
            }
        }
    }
}

/// A consuming and a publishing connection to the test broker, as the worker opens them.
pub async fn connection_pair(role: &str) -> (lapin::Connection, lapin::Connection) {
    let settings = sendquota::config::AmqpSettings {
        url: support::amqp_url(),
        ..Default::default()
    };
    let consume = sendquota::internals::broker::connect(&settings, &format!("{role}-consume"))
        .await
        .expect("amqp connect");
    let publish = sendquota::internals::broker::connect(&settings, &format!("{role}-publish"))
        .await
        .expect("amqp connect");
    (consume, publish)
}

/// Queues `bodies`, runs `phase` on them on a runtime of `threads` threads (see
/// [`on_runtime`]) and charges the CPU used meanwhile to `tally` (`published` of the bodies
/// count as sent on). Returns the time `phase` took and how many messages reached the sink.
#[allow(clippy::too_many_arguments)]
pub async fn broker_phase<F>(
    env: &TestEnv,
    bodies: &[Vec<u8>],
    procs: &Procs,
    tally: &mut Tally,
    label: &str,
    published: usize,
    runtime: Runtime,
    phase: impl FnOnce(Names, usize) -> F,
) -> (Duration, usize)
where
    F: std::future::Future<Output = Duration> + Send + 'static,
{
    let m = bodies.len();
    prepublish(env, bodies, &format!("{label} pre-publish")).await;
    let before = procs.snap(None).await;
    let took = on_runtime(runtime, phase(env.names.clone(), m))
        .await
        .unwrap_or_else(|e| panic!("{label}: {e}"));
    tally.add(before, procs.snap(None).await, m, published, took);
    (took, queued(env, &env.dispatched_queue).await)
}

/// The runtime a broker phase runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Runtime {
    /// tokio's current-thread runtime: one thread polls every task (the worker's default).
    CurrentThread,
    /// tokio's multi-thread runtime with this many worker threads (0: one per CPU).
    Workers(usize),
}

impl Runtime {
    /// The runtime `sendquota::cli::runtime` builds for `threads`.
    pub fn of(threads: usize) -> Runtime {
        match threads {
            1 => Runtime::CurrentThread,
            n => Runtime::Workers(n),
        }
    }

    /// The runtime in words, for the report.
    pub fn describe(&self) -> String {
        match self {
            Runtime::CurrentThread => "current-thread runtime".to_owned(),
            Runtime::Workers(1) => "multi-thread runtime of 1 worker thread".to_owned(),
            Runtime::Workers(n) => format!("multi-thread runtime of {n} worker threads"),
        }
    }

    fn build(&self) -> std::io::Result<tokio::runtime::Runtime> {
        match self {
            Runtime::CurrentThread => tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build(),
            Runtime::Workers(n) => {
                let mut builder = tokio::runtime::Builder::new_multi_thread();
                if *n > 0 {
                    builder.worker_threads(*n);
                }
                builder.enable_all().build()
            }
        }
    }
}

/// The worker's default runtime (`worker.threads`): the floor runs on the same, so it pays for
/// its threads what the worker pays for its own.
pub fn worker_runtime() -> Runtime {
    Runtime::of(sendquota::config::WorkerSettings::default().threads)
}

/// Runs `phase` as a task on a runtime of its own, on a thread of its own, so a phase pays for
/// its threads, not for this process's runtime.
pub async fn on_runtime<F>(runtime: Runtime, phase: F) -> Result<Duration, String>
where
    F: std::future::Future<Output = Duration> + Send + 'static,
{
    let (done, finished) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let ran = runtime
            .build()
            .map_err(|e| format!("runtime: {e}"))
            .and_then(|rt| {
                rt.block_on(async move { tokio::spawn(phase).await })
                    .map_err(|e| format!("task: {e}"))
            });
        let _ = done.send(ran);
    });
    finished
        .await
        .map_err(|_| "its thread ended without a result".to_owned())?
}

/// Purges the sink and the requests queue after a broker phase.
pub async fn empty_broker_queues(env: &TestEnv) {
    for queue in [&env.dispatched_queue, &env.names.requests] {
        env.channel
            .queue_purge(queue.as_str().into(), QueuePurgeOptions::default())
            .await
            .expect("purge");
    }
}
