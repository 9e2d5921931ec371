//! (a2), (c) and (d): the worker binary end to end on a quorum queue, half the messages
//! dispatched and half denied, against the no-work relay; then its CPU per message and peak RSS
//! beside the floor of its broker work. The runs alternate, a2 c floor floor c a2, so drifting
//! background load falls on the ceiling and on the worker alike. Besides the table, notes on how
//! the worker's clients batch (context switches, TCP segments, acks, denial batches), the Redis
//! commands it sends per message and its start-up time.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use sendquota::config::QueueType;
use sendquota::internals::telemetry::{
    ACK_FRAMES, DECISION_SECONDS, DENIAL_BATCHES, DENIAL_WRITE_SECONDS, DISPATCH_SECONDS,
};

use super::floor::floor_run;
use super::Bench;
use crate::ceilings::relay_run;
use crate::common;
use crate::keyspace::purge_namespace;
use crate::procs::{context_switches, proc_number, segments_sent, thread_ticks, Procs, Tally};
use crate::progress::Progress;
use crate::queues::{bodies, prepublish, queued};
use crate::relay::RelayShape;
use crate::report::{compare_alternating, ms, rate, Report};
use crate::scrape::{counter, histogram, http_get, Histogram};
use crate::support::TestEnv;
use crate::worker::WorkerChoice;

const END_TO_END_MIN_RATIO: f64 = 0.80;
const CPU_MAX_US_PER_MSG: f64 = 25.0;
const RSS_MAX_MIB: f64 = 100.0;

/// (a2) the broker's ceiling, on the worker's topology (quorum requests queue -> dispatch
/// exchange -> the sink queue) in its own namespace, run before and after (c); (c) and (d), the
/// worker binary end to end, run twice like the relay, in the order a2 c floor floor c a2.
/// Returns (c)'s rate from spawn, which (g) publishes at half of.
pub async fn run(bench: &Bench, worker: &WorkerChoice, report: &mut Report) -> f64 {
    let procs = &bench.procs;
    let m = bench.args.messages;
    let bodies = bodies(m);
    let relay_env = TestEnv::with_queue_type("", QueueType::Quorum).await;
    let shape = bench.args.relay_shape();
    let mut a2 = Tally::default();
    let (first_relay, returned_first, extra_first) =
        relay_run(&relay_env, &bodies, procs, &mut a2, shape).await;
    let mut c_tally = Tally::default();
    let first_worker = worker_run(&bodies, procs, &mut c_tally, worker).await;
    let mut floor = Tally::default();
    floor_run(&relay_env, &bodies, procs, &mut floor, worker).await;
    floor_run(&relay_env, &bodies, procs, &mut floor, worker).await;
    let second_worker = worker_run(&bodies, procs, &mut c_tally, worker).await;
    let e2e = first_worker.merge(second_worker);
    let (second_relay, returned_second, extra_second) =
        relay_run(&relay_env, &bodies, procs, &mut a2, shape).await;
    if returned_first + returned_second + extra_first + extra_second > 0 {
        report.note(format!(
            "(a2) after each relay acked all {m} deliveries and closed its channel, the broker \
             put {returned_first} and {returned_second} messages back in the quorum queue \
             (purged); the sink received {extra_first} and {extra_second} more than {m}"
        ));
    }
    drop(relay_env);
    drop(bodies);
    report.cpu(procs, "a2 no-work relay (quorum), 2 runs", &a2);
    let floor_us = report
        .cpu(procs, "d floor: broker work alone, 2 runs", &floor)
        .bench;
    let cpu_us_per_msg = report
        .cpu(procs, "c worker end to end, 2 runs", &c_tally)
        .worker;
    let a2_rate = a2.rate();
    report.figure(
        "(a2) ceiling: no-work relay, quorum queue",
        format!("{a2_rate:.0} msgs/s"),
        "",
        None,
        &format!(
            "runs before/after (c): {first_relay:.0} / {second_relay:.0} msgs/s; {}",
            shape.describe()
        ),
        None,
    );
    let c = throughput_figures(report, &e2e, m, a2_rate, worker);
    resource_figures(report, &e2e, cpu_us_per_msg, floor_us);
    notes(report, &e2e, m);
    c
}

/// (c)'s rate against (a2) and its decision latency. Returns the rate from spawn.
fn throughput_figures(
    report: &mut Report,
    e2e: &EndToEnd,
    m: usize,
    a2_rate: f64,
    worker: &WorkerChoice,
) -> f64 {
    // Timed from spawn, as an operator starting a worker on a backlog sees it: start-up is
    // part of what (c) must win back. From readiness shown beside it.
    let c = rate(2 * m, e2e.elapsed);
    let c_ready = rate(2 * m, e2e.elapsed.saturating_sub(e2e.ready));
    report.figure(
        "(c) worker binary end to end",
        format!("{c:.0} msgs/s"),
        "(a2)",
        Some(c / a2_rate),
        &format!(
            ">= {:.0}% (runs: {}; {} dispatched, {} denied; {}; from spawn; from readiness \
             {c_ready:.0} msgs/s, {:.0}%)",
            END_TO_END_MIN_RATIO * 100.0,
            e2e.runs
                .iter()
                .map(|r| format!("{r:.0}"))
                .collect::<Vec<_>>()
                .join(" / "),
            e2e.dispatched,
            e2e.denied,
            worker.describe(),
            c_ready / a2_rate * 100.0
        ),
        Some(c / a2_rate >= END_TO_END_MIN_RATIO),
    );
    report.figure(
        "(c) decision latency p50 / p99",
        format!(
            "{} / {}",
            ms(e2e.decision.quantile(0.5)),
            ms(e2e.decision.quantile(0.99))
        ),
        "",
        None,
        &format!(
            "mean {}, {} samples",
            ms((e2e.decision.count > 0.0).then(|| e2e.decision.sum / e2e.decision.count)),
            e2e.decision.count
        ),
        None,
    );
    c
}

/// (d): the worker's CPU per message beside its floor, and its peak RSS.
fn resource_figures(report: &mut Report, e2e: &EndToEnd, cpu_us_per_msg: f64, floor_us: f64) {
    report.figure(
        "(d) worker CPU per message",
        format!("{:.1} us", cpu_us_per_msg),
        "target",
        Some(cpu_us_per_msg / CPU_MAX_US_PER_MSG),
        &format!("<= {CPU_MAX_US_PER_MSG:.0} us"),
        Some(cpu_us_per_msg <= CPU_MAX_US_PER_MSG),
    );
    report.figure(
        "(d) floor: the worker's broker work alone",
        format!("{floor_us:.1} us"),
        "target",
        Some(floor_us / CPU_MAX_US_PER_MSG),
        &format!(
            "info: the worker's AMQP client, Publisher and Settler, half published; the worker's \
             other work costs {:.1} us",
            cpu_us_per_msg - floor_us
        ),
        None,
    );
    let rss_mib = e2e.hwm_kib as f64 / 1024.0;
    report.figure(
        "(d) worker peak RSS (VmHWM)",
        format!("{rss_mib:.1} MiB"),
        "target",
        Some(rss_mib / RSS_MAX_MIB),
        &format!("<= {RSS_MAX_MIB:.0} MiB"),
        Some(rss_mib <= RSS_MAX_MIB),
    );
}

/// Notes on (c) and (d): how the worker's clients batch, what it sends Redis, its start-up.
fn notes(report: &mut Report, e2e: &EndToEnd, m: usize) {
    report.note(format!(
        "(d) the worker's {} threads made {:.1} context switches per message and its sockets sent \
         {:.2} TCP data segments per message (Redis, broker and Postgres, start-up included); \
         its CPU per message by thread (user + system us, start-up included): {}",
        e2e.threads,
        e2e.switches_per_msg,
        e2e.segments_per_msg,
        e2e.threads_cpu
            .iter()
            .map(|(name, user, system)| format!("{name} {user:.1} + {system:.1}"))
            .collect::<Vec<_>>()
            .join("; ")
    ));
    report.note(format!(
        "(c) over both runs the worker sent {:.0} multiple and {:.0} single acks for {} messages, \
         and wrote its {} denials in {:.0} batches ({:.0} rows each)",
        e2e.ack_frames.0,
        e2e.ack_frames.1,
        2 * m,
        e2e.denied,
        e2e.denial_batches,
        e2e.denied as f64 / e2e.denial_batches.max(1.0)
    ));
    report.note(format!(
        "(c) Redis commands per message, server-wide (calls, us executing; EVALSHA's time \
         includes the commands its script runs, listed too): {}",
        e2e.commands
            .iter()
            .map(|(name, calls, us)| format!("{name} {calls:.2} x, {us:.1} us"))
            .collect::<Vec<_>>()
            .join("; ")
    ));
    report.note(format!(
        "(c) the worker was ready (consuming, Redis and Postgres reachable) {:.0} ms after \
         spawn, both runs together: process start, connections, topology, all inside its rate, \
         which is timed from spawn (the rate from readiness is beside the verdict). \
         Dispatch publish+confirm p50/p99 {} / {}; denial write p50/p99 {} / {}",
        e2e.ready.as_secs_f64() * 1e3,
        ms(e2e.dispatch.quantile(0.5)),
        ms(e2e.dispatch.quantile(0.99)),
        ms(e2e.denial_write.quantile(0.5)),
        ms(e2e.denial_write.quantile(0.99)),
    ));
}

/// (c)/(d): the worker binary decides `n` queued requests.
async fn end_to_end(
    env: &TestEnv,
    n: usize,
    procs: &Procs,
    tally: &mut Tally,
    choice: &WorkerChoice,
) -> EndToEnd {
    let commands_before = common::command_stats(&mut procs.conn.clone()).await;
    let before = procs.snap(None).await;
    let began = Instant::now();
    // Ready: the point the relay's own timer starts from (its connection and channels open,
    // about to consume).
    let (worker, port) = choice.start(env).await;
    let pid = worker.pid();
    let ready = began.elapsed();
    wait_for_outcomes(env, n).await;
    let elapsed = began.elapsed();
    let after = procs.snap(Some(pid)).await;
    let commands_after = common::command_stats(&mut procs.conn.clone()).await;
    let hwm_kib = proc_number(pid, "status", "VmHWM:");
    let (switches, threads) = context_switches(pid);
    // How well the worker's clients batch what they send: a Redis command, a publish or an ack
    // written alone is one segment.
    let segments = segments_sent(pid);
    let threads_cpu = thread_ticks(pid)
        .into_iter()
        .map(|(name, (user, system))| {
            let per = |ticks: u64| ticks as f64 * procs.tick_us / n as f64;
            (name, per(user), per(system))
        })
        .collect();
    let commands = commands_per_message(&commands_before, &commands_after, n);
    let metrics = http_get(port, "/metrics").await.unwrap_or_default();
    worker.stop();
    tally.add(before, after, n, 0, elapsed);
    if metrics.is_empty() {
        eprintln!("[c] warning: could not scrape /metrics on port {port}");
    }
    EndToEnd {
        elapsed,
        ready,
        dispatched: queued(env, &env.dispatched_queue).await,
        denied: env.denial_rows().await as usize,
        runs: vec![rate(n, elapsed)],
        hwm_kib,
        decision: histogram(&metrics, DECISION_SECONDS),
        dispatch: histogram(&metrics, DISPATCH_SECONDS),
        denial_write: histogram(&metrics, DENIAL_WRITE_SECONDS),
        switches_per_msg: switches as f64 / n as f64,
        segments_per_msg: segments as f64 / n as f64,
        threads,
        commands,
        threads_cpu,
        ack_frames: (
            counter(&metrics, ACK_FRAMES, Some("multiple")),
            counter(&metrics, ACK_FRAMES, Some("single")),
        ),
        denial_batches: counter(&metrics, DENIAL_BATCHES, None),
    }
}

/// Waits (at most 300 s) until each of the `n` messages has an outcome.
async fn wait_for_outcomes(env: &TestEnv, n: usize) {
    let mut progress = Progress::new("c worker end to end", n);
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let done = outcomes(env, n).await;
        if done >= n {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "only {done}/{n} messages have an outcome after 300 s"
        );
        // The estimate can run ahead of the exact count taken near the end: never backwards.
        progress.add(done.saturating_sub(progress.done));
        // Close to the end the poll is frequent, so the end is seen a few ms late at most.
        let nearly = done.saturating_mul(10) >= n.saturating_mul(9);
        tokio::time::sleep(Duration::from_millis(if nearly { 2 } else { 20 })).await;
    }
}

/// Redis commands between two INFO commandstats, per message: (command, calls, microseconds
/// executing), those called at least once per 100 messages, most time first.
fn commands_per_message(
    before: &BTreeMap<String, (u64, u64)>,
    after: &BTreeMap<String, (u64, u64)>,
    n: usize,
) -> Vec<(String, f64, f64)> {
    let mut commands: Vec<(String, f64, f64)> = after
        .iter()
        .map(|(name, &(calls, us))| {
            let (calls0, us0) = before.get(name).copied().unwrap_or((0, 0));
            (
                name.clone(),
                calls.saturating_sub(calls0) as f64 / n as f64,
                us.saturating_sub(us0) as f64 / n as f64,
            )
        })
        .filter(|(_, calls, _)| *calls >= 0.01)
        .collect();
    commands.sort_by(|a, b| b.2.total_cmp(&a.2));
    commands
}

/// Messages of (c) with an outcome: dispatched ones waiting in the sink plus denial rows. Polled
/// every 20 ms while the worker runs, so it must cost the measured services next to nothing: a
/// `count(*)` of the denials, scanning every row written so far, took Postgres 1-6 ms a call,
/// about a quarter of what the worker's own denial writes cost it. Denial ids drawn from the
/// sequence count instead; they can run ahead of committed rows (a batch in flight), so the
/// exact count is taken only once they say all `n` are done.
async fn outcomes(env: &TestEnv, n: usize) -> usize {
    let dispatched = queued(env, &env.dispatched_queue).await;
    let drawn: i64 = sqlx::query_scalar(
        "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM denials_id_seq",
    )
    .fetch_one(&env.pool)
    .await
    .expect("read the denial id sequence");
    let estimate = dispatched + usize::try_from(drawn).unwrap_or(0);
    if estimate < n {
        return estimate;
    }
    dispatched + env.denial_rows().await as usize
}

pub(super) struct EndToEnd {
    /// From the worker's spawn to the last outcome.
    pub(super) elapsed: Duration,
    /// From the worker's spawn to its first ready answer on `/readyz`.
    ready: Duration,
    /// Each run's rate from spawn, msgs/s.
    runs: Vec<f64>,
    dispatched: usize,
    denied: usize,
    hwm_kib: u64,
    decision: Histogram,
    dispatch: Histogram,
    denial_write: Histogram,
    /// Context switches of the worker's threads per message, and how many threads it has.
    switches_per_msg: f64,
    /// Write system calls of the worker per message (start-up included).
    segments_per_msg: f64,
    threads: usize,
    /// Redis commands during the run: (command, calls per message, microseconds per message).
    commands: Vec<(String, f64, f64)>,
    /// The worker's CPU by thread name: (name, user us per message, system us per message).
    threads_cpu: Vec<(String, f64, f64)>,
    /// Ack frames the worker sent: (multiple, single).
    ack_frames: (f64, f64),
    /// Denial batches the worker committed.
    denial_batches: f64,
}

impl EndToEnd {
    /// Two runs of `n` messages each as one: times and counts added, per-message figures
    /// averaged, the peak RSS the larger.
    fn merge(self, o: EndToEnd) -> EndToEnd {
        let mean = |a: f64, b: f64| (a + b) / 2.0;
        EndToEnd {
            elapsed: self.elapsed + o.elapsed,
            ready: self.ready + o.ready,
            runs: [self.runs, o.runs].concat(),
            dispatched: self.dispatched + o.dispatched,
            denied: self.denied + o.denied,
            hwm_kib: self.hwm_kib.max(o.hwm_kib),
            decision: self.decision.plus(o.decision),
            dispatch: self.dispatch.plus(o.dispatch),
            denial_write: self.denial_write.plus(o.denial_write),
            switches_per_msg: mean(self.switches_per_msg, o.switches_per_msg),
            segments_per_msg: mean(self.segments_per_msg, o.segments_per_msg),
            threads: self.threads.max(o.threads),
            commands: mean_by_name(self.commands, o.commands),
            threads_cpu: mean_by_name(self.threads_cpu, o.threads_cpu),
            ack_frames: (
                self.ack_frames.0 + o.ack_frames.0,
                self.ack_frames.1 + o.ack_frames.1,
            ),
            denial_batches: self.denial_batches + o.denial_batches,
        }
    }
}

/// Two runs' per-message figures by name, averaged (a name missing from a run counts 0 there),
/// largest second figure first.
fn mean_by_name(a: Vec<(String, f64, f64)>, b: Vec<(String, f64, f64)>) -> Vec<(String, f64, f64)> {
    let mut sums: BTreeMap<String, (f64, f64)> = BTreeMap::new();
    for (name, x, y) in a.into_iter().chain(b) {
        let sum = sums.entry(name).or_default();
        sum.0 += x;
        sum.1 += y;
    }
    let mut out: Vec<(String, f64, f64)> = sums
        .into_iter()
        .map(|(name, (x, y))| (name, x / 2.0, y / 2.0))
        .collect();
    out.sort_by(|a, b| b.2.total_cmp(&a.2));
    out
}

/// (c) once: a fresh namespace, the bodies queued, the worker binary run over them until each
/// has its outcome, the namespace's keys purged.
pub(super) async fn worker_run(
    bodies: &[Vec<u8>],
    procs: &Procs,
    tally: &mut Tally,
    worker: &WorkerChoice,
) -> EndToEnd {
    let env = TestEnv::with_queue_type("", QueueType::Quorum).await;
    prepublish(&env, bodies, "c pre-publish").await;
    let e2e = end_to_end(&env, bodies.len(), procs, tally, worker).await;
    purge_namespace(&env, "c cleanup").await;
    e2e
}

/// `--relay-shapes ROUNDS`: (a2) in every [`RelayShape`], `rounds` alternating rounds, each
/// shape's rates and median printed with the winner: how [`RelayShape::CEILING`] was chosen.
/// `--relay-shapes-short ROUNDS`: the same over [`RelayShape::short_list`] only.
pub async fn compare_relay_shapes(bench: &Bench) {
    let prefetch = bench.args.relay_prefetch();
    let (shapes, rounds) = if bench.args.relay_shapes_short > 0 {
        (
            RelayShape::short_list(prefetch),
            bench.args.relay_shapes_short,
        )
    } else {
        (RelayShape::all(prefetch), bench.args.relay_shapes)
    };
    let bodies = bodies(bench.args.messages);
    let env = TestEnv::with_queue_type("", QueueType::Quorum).await;
    let names: Vec<String> = shapes.iter().map(|s| s.describe()).collect();
    let title = format!(
        "(a2) relay shapes, {} messages a run, {rounds} alternating rounds",
        bodies.len()
    );
    let (env, bodies, procs) = (&env, &bodies, &bench.procs);
    compare_alternating("a2 shapes", &title, &names, rounds, |i| {
        let shape = shapes[i];
        async move {
            let mut tally = Tally::default();
            relay_run(env, bodies, procs, &mut tally, shape).await.0
        }
    })
    .await;
}
