//! (g): publish-to-dispatch latency at half the rate (c) reached, the worker not saturated, as
//! in service. Requests are published paced, each carrying its publish instant; a consumer on
//! the dispatch sink takes arrival minus publish instant. The relay of (a2) in the worker's
//! place first: the broker's (and this process's) share of that latency.

use std::time::{Duration, Instant};

use futures_util::stream::FuturesUnordered;
use futures_util::StreamExt;
use lapin::types::FieldTable;
use lapin::BasicProperties;
use sendquota::config::QueueType;

use super::Bench;
use crate::keyspace::purge_namespace;
use crate::procs::{Procs, Tally};
use crate::progress::Progress;
use crate::queues::on_runtime;
use crate::relay::{relay, RelayShape};
use crate::report::{ms, Report};
use crate::scrape::{histogram, http_get};
use crate::support::{request, TestEnv};
use crate::worker::WorkerChoice;
use sendquota::internals::telemetry::{DECISION_SECONDS, DISPATCH_SECONDS};

/// (g)'s target (issue 39): the worker's p99 at most this far above the no-work relay's, in
/// the same minutes: the latency the worker adds, the broker's own left out.
const LATENCY_OVER_RELAY_MS: f64 = 5.0;
/// (g) publishes every PACE, as many requests as are due by then.
const PACE: Duration = Duration::from_millis(2);
/// (g) publishes this long at its rate before the counted part.
const LATENCY_WARM_UP: Duration = Duration::from_secs(1);

/// (g): the relay, then the worker, at `rate` msgs/s: half of `c`, (c)'s rate, or the rate
/// `--latency-rate` asks for when (g) runs alone (`c` is then `None`).
pub async fn run(
    bench: &Bench,
    worker: &WorkerChoice,
    rate: f64,
    c: Option<f64>,
    report: &mut Report,
) {
    let (procs, seconds) = (&bench.procs, bench.args.latency_seconds);
    let mut g_relay = Tally::default();
    let shape = bench.args.relay_shape();
    let floor = latency_run(Hop::Relay(shape), rate, seconds, procs, &mut g_relay).await;
    report.cpu(procs, "g relay at half (c)'s rate, paced", &g_relay);
    let mut g = Tally::default();
    let hop = Hop::Worker(worker);
    let latency = latency_run(hop, rate, seconds, procs, &mut g).await;
    report.cpu(procs, "g worker at half (c)'s rate, paced", &g);
    let p99 = latency.quantile(0.99);
    // Without a relay p99 (nothing arrived) there is no target to meet.
    let bound_ms = floor
        .quantile(0.99)
        .map(|f| f * 1e3 + LATENCY_OVER_RELAY_MS);
    let complete = latency.samples.len() == latency.counted;
    let detail = |l: &Latency| {
        let of_c = c.map_or(String::new(), |c| {
            format!(" = {:.0}% of (c)", l.achieved / c * 100.0)
        });
        format!(
            "max {}; {}{}; {}; {} of {} dispatched at {:.0} msgs/s{of_c}, {} s after {} s warm-up",
            ms(l.quantile(1.0)),
            l.tail,
            l.stages,
            l.wal,
            l.samples.len(),
            l.counted,
            l.achieved,
            seconds,
            LATENCY_WARM_UP.as_secs()
        )
    };
    report.figure(
        "(g) publish-to-dispatch latency p50 / p99",
        format!("{} / {}", ms(latency.quantile(0.5)), ms(p99)),
        "target",
        p99.zip(bound_ms).map(|(p, b)| p * 1e3 / b),
        &format!(
            "p99 <= the relay's p99 + {LATENCY_OVER_RELAY_MS:.0} ms = {} ({})",
            bound_ms.map_or("-".to_owned(), |b| format!("{b:.2} ms")),
            detail(&latency)
        ),
        Some(complete && p99.zip(bound_ms).is_some_and(|(p, b)| p * 1e3 <= b)),
    );
    report.figure(
        "(g) floor: the no-work relay, p50 / p99",
        format!("{} / {}", ms(floor.quantile(0.5)), ms(floor.quantile(0.99))),
        "",
        None,
        &format!("info: the broker's share ({})", detail(&floor)),
        None,
    );
}

/// What (g) measured.
struct Latency {
    /// Publish-to-dispatch latency of each counted message that reached the sink, in
    /// nanoseconds, sorted.
    samples: Vec<u64>,
    /// How the slowest 1% spread over the run ([`tail_spread`]).
    tail: String,
    /// The worker's own stage latencies ([`worker_stages`]); empty for the relay.
    stages: String,
    /// Whether the broker's write-ahead log was rolled over before the run ([`roll_broker_wal`]).
    wal: String,
    /// Counted messages published, and per second while they were.
    counted: usize,
    achieved: f64,
}

impl Latency {
    /// The q-quantile of the samples (nearest rank), in seconds.
    fn quantile(&self, q: f64) -> Option<f64> {
        nearest_rank(&self.samples, q).map(|ns| ns as f64 / 1e9)
    }
}

/// What passes (g)'s requests from the requests queue to the dispatch exchange.
enum Hop<'a> {
    /// The worker binary.
    Worker(&'a WorkerChoice),
    /// The no-work relay of (a2), in this process: the broker's and the client's share of the
    /// latency, the floor under the worker's; in (a2)'s shape, at `--relay-prefetch`.
    Relay(RelayShape),
}

/// (g) once: `hop` on a fresh namespace, requests published at `rate` msgs/s (paced every
/// [`PACE`], publisher-confirmed, on this process's connection) for [`LATENCY_WARM_UP`] and
/// then `seconds` more, each to a new recipient (so each is dispatched) and carrying in its
/// payload its sequence number and its publish instant (`sent_ns`, since `origin`); a consumer
/// of the dispatch sink takes each arrival's instant minus that. The CPU used meanwhile is
/// charged to `tally`.
async fn latency_run(
    hop: Hop<'_>,
    rate: f64,
    seconds: usize,
    procs: &Procs,
    tally: &mut Tally,
) -> Latency {
    let env = TestEnv::with_queue_type("", QueueType::Quorum).await;
    let wal = roll_broker_wal().await;
    let warm = (rate * LATENCY_WARM_UP.as_secs_f64()).ceil() as usize;
    let total = warm + (rate * seconds as f64).ceil() as usize;
    let origin = Instant::now();
    let arrivals = sink_latencies(&env, origin, total).await;
    let (process, relaying) = match hop {
        Hop::Worker(worker) => (Some(worker.start(&env).await), None),
        Hop::Relay(shape) => {
            let relaying = on_runtime(shape.runtime, relay(shape, env.names.clone(), total));
            (None, Some(tokio::spawn(relaying)))
        }
    };
    let pid = process.as_ref().map(|(p, _)| p.pid());
    let before = procs.snap(pid).await;
    let paced = publish_paced(&env, rate, warm, total, origin).await;
    let arrived = arrivals.await.expect("sink consumer");
    let after = procs.snap(pid).await;
    tally.add(before, after, total, arrived.len(), paced.began.elapsed());
    if let Some(relaying) = relaying {
        let relayed = relaying.await.expect("relay task");
        relayed.unwrap_or_else(|e| panic!("g relay: {e}"));
    }
    let mut stages = String::new();
    if let Some((process, port)) = process {
        stages = worker_stages(port).await;
        process.stop();
    }
    purge_namespace(&env, "g cleanup").await;
    let counted_arrivals: Vec<(usize, u64)> = arrived
        .into_iter()
        .filter(|&(seq, _)| seq >= warm)
        .collect();
    let mut samples: Vec<u64> = counted_arrivals.iter().map(|&(_, ns)| ns).collect();
    samples.sort_unstable();
    let tail = tail_spread(&counted_arrivals, &samples, rate, paced.began_utc);
    let counted = total - warm;
    let publishing = paced
        .counted_from
        .map_or(Duration::ZERO, |t| paced.last_sent.duration_since(t));
    Latency {
        samples,
        tail,
        stages,
        wal,
        counted,
        achieved: counted as f64 / publishing.as_secs_f64().max(PACE.as_secs_f64()),
    }
}

/// Rolls the local RabbitMQ's quorum-queue write-ahead log over and waits for its segment
/// writer, so that no run of (g) pays for a roll-over the other side did not: the WAL rolls
/// at 512 MiB (`wal_max_size_bytes`), and the segment writer then copies every queue's entries
/// out for seconds while the broker stalls, which decides the p99 of the run it lands in
/// (docs/performance.md). A (g) run writes far less than 512 MiB. Says so, or why it could not
/// (no `rabbitmqctl` here, another broker): then runs are comparable only when neither paid.
async fn roll_broker_wal() -> String {
    const ROLL: &str = "ok = ra_log_wal:force_roll_over(ra_log_wal), \
                        ra_log_segment_writer:await(ra_log_segment_writer).";
    let roll = || {
        std::process::Command::new("rabbitmqctl")
            .args(["eval", ROLL])
            .output()
    };
    match tokio::task::spawn_blocking(roll)
        .await
        .expect("rabbitmqctl thread")
    {
        Ok(out) if out.status.success() => "the broker's WAL rolled over before the run".into(),
        Ok(out) => format!(
            "the broker's WAL not rolled over ({})",
            String::from_utf8_lossy(&out.stderr).trim()
        ),
        Err(e) => format!("the broker's WAL not rolled over (rabbitmqctl: {e})"),
    }
}

/// The worker's decision and publish+confirm latencies over the run, from its `/metrics`: which
/// of its steps the publish-to-dispatch latency is spent in.
async fn worker_stages(port: u16) -> String {
    let metrics = http_get(port, "/metrics").await.unwrap_or_default();
    let decision = histogram(&metrics, DECISION_SECONDS);
    let dispatch = histogram(&metrics, DISPATCH_SECONDS);
    format!(
        "; the worker's decision p50 / p99 {} / {}, publish+confirm {} / {}",
        ms(decision.quantile(0.5)),
        ms(decision.quantile(0.99)),
        ms(dispatch.quantile(0.5)),
        ms(dispatch.quantile(0.99))
    )
}

/// The q-quantile of `sorted` by nearest rank.
fn nearest_rank(sorted: &[u64], q: f64) -> Option<u64> {
    let rank = ((q * sorted.len() as f64).ceil() as usize).max(1);
    sorted.get(rank - 1).copied()
}

/// Where in time the slowest 1% of `arrivals` (`(seq, latency ns)`; `sorted` their latencies)
/// were published, by 100 ms windows of publish time (`seq / rate`): a tail in few windows is a
/// stall of some hop, one spread over most windows is a queue that every burst waits in. Each
/// window also gets its time of day (UTC, from `began`, when publishing began), to set beside
/// the services' own logs and files.
fn tail_spread(
    arrivals: &[(usize, u64)],
    sorted: &[u64],
    rate: f64,
    began: chrono::DateTime<chrono::Utc>,
) -> String {
    let Some(p99) = nearest_rank(sorted, 0.99) else {
        return "no samples".to_owned();
    };
    let window = |seq: usize| (seq as f64 / rate / 0.1) as usize;
    let mut slow = std::collections::BTreeMap::<usize, usize>::new();
    for &(seq, _) in arrivals.iter().filter(|&&(_, ns)| ns >= p99) {
        *slow.entry(window(seq)).or_default() += 1;
    }
    let first = arrivals
        .iter()
        .map(|&(seq, _)| window(seq))
        .min()
        .unwrap_or(0);
    let last = arrivals
        .iter()
        .map(|&(seq, _)| window(seq))
        .max()
        .unwrap_or(0);
    let mut worst: Vec<(usize, usize)> = slow.iter().map(|(&w, &n)| (n, w)).collect();
    worst.sort_unstable_by(|a, b| b.cmp(a));
    let at: Vec<String> = worst
        .iter()
        .take(4)
        .map(|&(n, w)| {
            let at = began + chrono::Duration::milliseconds(w as i64 * 100);
            format!(
                "{n} at {:.1} s, {}",
                w as f64 / 10.0,
                at.format("%H:%M:%S%.3f")
            )
        })
        .collect();
    format!(
        "the slowest 1% in {} of {} 100-ms windows ({})",
        slow.len(),
        last + 1 - first,
        at.join(", ")
    )
}

/// When [`publish_paced`] began, published its first counted request and its last one.
struct Paced {
    began: Instant,
    began_utc: chrono::DateTime<chrono::Utc>,
    counted_from: Option<Instant>,
    last_sent: Instant,
}

/// Publishes `total` requests to `env`'s requests exchange at `rate` msgs/s, every [`PACE`] as
/// many as are due, and waits for their confirms; request `warm` is the first counted.
async fn publish_paced(
    env: &TestEnv,
    rate: f64,
    warm: usize,
    total: usize,
    origin: Instant,
) -> Paced {
    let mut progress = Progress::new(&format!("g publish at {rate:.0} msgs/s"), total);
    let mut ticks = tokio::time::interval(PACE);
    let mut confirms = FuturesUnordered::new();
    let (mut sent, mut counted_from, mut last_sent) = (0usize, None, Instant::now());
    let (began, began_utc) = (Instant::now(), chrono::Utc::now());
    while sent < total || !confirms.is_empty() {
        tokio::select! {
            Some(confirm) = confirms.next(), if !confirms.is_empty() => {
                let confirm: Result<(), sendquota::internals::broker::BrokerError> = confirm;
                confirm.expect("publish request");
            }
            _ = ticks.tick(), if sent < total => {
                let due = ((began.elapsed().as_secs_f64() * rate) as usize).min(total);
                for i in sent..due {
                    if i == warm {
                        counted_from = Some(Instant::now());
                    }
                    let mut body = request(&format!("g{i}"), &format!("g{i}"), "UTC");
                    body["payload"] = serde_json::json!({
                        "template": "t",
                        "seq": i,
                        "sent_ns": origin.elapsed().as_nanos() as u64,
                    });
                    let publisher = env.publisher.clone();
                    let exchange = env.names.requests.clone();
                    confirms.push(async move {
                        let body = body.to_string().into_bytes();
                        publisher
                            .publish(&exchange, "", &body, BasicProperties::default())
                            .await
                    });
                }
                last_sent = Instant::now();
                progress.add(due - sent);
                sent = due;
            }
        }
    }
    Paced {
        began,
        began_utc,
        counted_from,
        last_sent,
    }
}

/// Consumes `env`'s dispatch sink (no acks) until `total` requests arrived or none came for
/// 10 s; yields each one's (`seq`, arrival minus `sent_ns`) from its payload, in nanoseconds
/// since `origin`.
async fn sink_latencies(
    env: &TestEnv,
    origin: Instant,
    total: usize,
) -> tokio::task::JoinHandle<Vec<(usize, u64)>> {
    let channel = env.amqp.create_channel().await.expect("channel");
    let mut consumer = channel
        .basic_consume(
            env.dispatched_queue.as_str().into(),
            "sendquota-perf-latency".into(),
            lapin::options::BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("consume the sink");
    tokio::spawn(async move {
        let mut arrived = Vec::with_capacity(total);
        let mut progress = Progress::new("g dispatched", total);
        while arrived.len() < total {
            let Ok(Some(delivery)) =
                tokio::time::timeout(Duration::from_secs(10), consumer.next()).await
            else {
                eprintln!("[g] the sink received {} of {total}", arrived.len());
                break;
            };
            let now = origin.elapsed().as_nanos() as u64;
            let delivery = delivery.expect("sink delivery");
            let body: serde_json::Value =
                serde_json::from_slice(&delivery.data).expect("dispatched body is JSON");
            let field = |name: &str| body["payload"][name].as_u64().expect("payload field");
            arrived.push((field("seq") as usize, now.saturating_sub(field("sent_ns"))));
            progress.add(1);
        }
        drop(channel);
        arrived
    })
}
