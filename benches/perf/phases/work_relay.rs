//! (a3) the work relay: the fastest relay that also does, per message, the external work the
//! worker must do, and nothing else. Per delivery: the worker's own decision call (the
//! library's `Limiter::evaluate_claimed`, so the EVALSHA's keys and arguments are the worker's
//! by construction, one call a message); for an admitted message a persistent, mandatory,
//! confirmed publish to the dispatch exchange, then the worker's dispatch mark
//! (`DispatchMarks::mark_dispatched`, batched as the worker's are); for a refused one the
//! worker's denial row through its own `DenialWriter` (the same statement, batch size and
//! wait); then a coalesced ack. What the worker records beyond the denial row (events,
//! rollups, verdict counts) is its own cost, not the job's, and is left out.
//!
//! It runs in the shape of the fastest no-work relay (one connection, a consume and a publish
//! channel, prefetch 1000, a task per delivery, coalesced acks), on connections to Redis and
//! Postgres of its own, opened on its runtime. Which runtime is fastest for this work is
//! measured, not assumed: `--work-relay-runtimes ROUNDS` runs it on each of
//! [`WORK_RELAY_RUNTIMES`] alternately and names the fastest, which `--work-relay-runtime K`
//! then picks (benches/perf/issue39.sh does both).

use std::sync::Arc;
use std::time::{Duration, Instant};

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{BasicProperties, Confirmation};
use sendquota::config::Settings;
use sendquota::internals::broker::Names;
use sendquota::internals::claim::Claim;
use sendquota::internals::dedup::DispatchMarks;
use sendquota::internals::denials::{DenialRow, DenialStore, DenialWriter};
use sendquota::internals::limiter::{Evaluation, Limiter};
use sendquota::internals::message::SendRequest;
use sendquota::internals::policy::Policy;
use sendquota::internals::store::RedisConn;
use tokio::sync::mpsc;

use super::Bench;
use crate::procs::{Procs, Tally};
use crate::queues::{
    bodies, broker_phase, connection_pair, consume_requests, empty_broker_queues,
    prefetching_channel, spawn_each, Runtime,
};
use crate::relay::{ack_coalesced, RELAY_PREFETCH};
use crate::report::{compare_alternating, rate};
use crate::support::TestEnv;

/// The runtimes `--work-relay-runtimes` compares (a3) on: the worker's (current-thread), a
/// multi-thread runtime of one worker, and the relay's (two workers).
pub const WORK_RELAY_RUNTIMES: [Runtime; 3] = [
    Runtime::CurrentThread,
    Runtime::Workers(1),
    Runtime::Workers(2),
];

/// The runtime (a3) runs on unless `--work-relay-runtime` picks another: the one that measured
/// fastest (`--work-relay-runtimes`; the figures are in docs/performance.md, (a3)).
pub const WORK_RELAY_RUNTIME: Runtime = Runtime::CurrentThread;

/// What each delivery's task needs: the worker's clients, opened on the relay's runtime.
struct Work {
    limiter: Limiter,
    policy: Arc<Policy>,
    marks: DispatchMarks,
    denials: DenialWriter,
    claim_lease_ms: u64,
    max_body_bytes: usize,
}

impl Work {
    /// The worker's Redis connection, denial writer and marks for `settings`, the policy given.
    async fn open(settings: &Settings, policy: Arc<Policy>) -> Work {
        let redis = RedisConn::connect(&settings.redis).await.expect("redis");
        let store = DenialStore::connect(&settings.database)
            .await
            .expect("postgres");
        let w = &settings.worker;
        Work {
            limiter: Limiter::new(redis.clone(), &settings.namespace),
            marks: DispatchMarks::new(redis, &settings.namespace, w.dedup_ttl_secs).batched(),
            denials: DenialWriter::spawn(
                store,
                w.denial_batch_size,
                Duration::from_millis(w.denial_batch_wait_ms),
            ),
            policy,
            claim_lease_ms: w.claim_lease_ms,
            max_body_bytes: w.max_body_bytes,
        }
    }

    /// Decides `body`; returns the message when it may go out (it is then published and
    /// marked by the caller), after writing its denial row when it may not.
    async fn decide(&self, body: &[u8]) -> Option<SendRequest> {
        let message = SendRequest::decode(body, self.max_body_bytes).expect("valid request");
        let now = chrono::Utc::now();
        let claim = Claim::new(self.claim_lease_ms);
        let evaluation = self
            .limiter
            .evaluate_claimed(&self.policy, &message, now, &claim)
            .await
            .expect("decision");
        let verdicts = match evaluation {
            Evaluation::Decided {
                committed: true, ..
            } => return Some(message),
            Evaluation::Decided { verdicts, .. } => verdicts,
            other => panic!("(a3) decided nothing: {other:?}"),
        };
        let refusal = verdicts
            .into_iter()
            .find(|v| !v.allowed)
            .expect("a refused message has a refusing verdict");
        let row = DenialRow {
            rule: refusal.rule,
            kind: refusal.kind.to_owned(),
            reason: refusal.reason,
            retry_after: refusal.retry_after,
            ..DenialRow::for_message(&message, now)
        };
        self.denials.write(row).await.expect("denial row");
        None
    }
}

/// Relays `n` messages doing the worker's external work. Returns the elapsed time from the
/// open connections.
async fn work_relay(settings: Settings, policy: Arc<Policy>, names: Names, n: usize) -> Duration {
    let (conn, spare) = connection_pair("sendquota-perf-work-relay").await;
    let work = Arc::new(Work::open(&settings, policy).await);
    let consume = prefetching_channel(&conn, RELAY_PREFETCH).await;
    let publish = conn.create_channel().await.expect("channel");
    publish
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm mode");
    let began = Instant::now();
    let mut consumer = consume_requests(&consume, &names).await;
    let (confirmed, taken) = mpsc::unbounded_channel();
    let acker = tokio::spawn(ack_coalesced(consume.clone(), taken));
    let props = BasicProperties::default()
        .with_content_type("application/json".into())
        .with_delivery_mode(2);
    let each = |delivery: lapin::message::Delivery| {
        let (publish, work, confirmed) = (publish.clone(), work.clone(), confirmed.clone());
        let (exchange, props) = (names.dispatch.clone(), props.clone());
        async move {
            if let Some(message) = work.decide(&delivery.data).await {
                let options = BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                };
                let confirm = publish
                    .basic_publish(
                        exchange.as_str().into(),
                        message.channel.as_str().into(),
                        options,
                        &delivery.data,
                        props,
                    )
                    .await
                    .expect("publish")
                    .await
                    .expect("confirm");
                assert_eq!(confirm, Confirmation::Ack(None), "(a3) publish not routed");
                work.marks
                    .mark_dispatched(&message, chrono::Utc::now())
                    .await
                    .expect("dispatch mark");
            }
            let _ = confirmed.send(delivery.delivery_tag);
        }
    };
    spawn_each(&mut consumer, n, "a3 work relay", each).await;
    let elapsed = began.elapsed();
    drop(confirmed);
    acker.await.expect("acker task");
    drop(consumer);
    let _ = consume.close(200, "relay done".into()).await;
    let _ = conn.close(200, "relay done".into()).await;
    let _ = spare.close(200, "relay done".into()).await;
    elapsed
}

/// (a3) once on a fresh namespace (its own keys and denial table, as (c) gets): queue the
/// bodies, relay them on `runtime`, check the admitted half reached the sink and the refused
/// half has rows. Returns the rate.
pub async fn work_relay_run(
    bodies: &[Vec<u8>],
    procs: &Procs,
    tally: &mut Tally,
    policy: Arc<Policy>,
    runtime: Runtime,
) -> f64 {
    let env = TestEnv::with_queue_type("", sendquota::config::QueueType::Quorum).await;
    let m = bodies.len();
    let settings = env.settings.clone();
    let phase = move |names, n| work_relay(settings, policy, names, n);
    let (took, routed) =
        broker_phase(&env, bodies, procs, tally, "a3", m / 2, runtime, phase).await;
    let denied = env.denial_rows().await as usize;
    assert!(
        routed + denied >= m,
        "(a3) lost messages: {routed} dispatched and {denied} denied of {m}"
    );
    empty_broker_queues(&env).await;
    crate::keyspace::purge_namespace(&env, "a3 cleanup").await;
    rate(m, took)
}

/// `--work-relay-runtimes ROUNDS`: (a3) on each of [`WORK_RELAY_RUNTIMES`], `rounds`
/// alternating rounds; prints each runtime's rates and median, and the fastest (as
/// `fastest: K.`, which benches/perf/issue39.sh reads).
pub async fn compare_runtimes(bench: &Bench) {
    let rounds = bench.args.work_relay_runtimes;
    let bodies = bodies(bench.args.messages);
    let policy = Arc::new(crate::decision_path::policy(""));
    let names: Vec<String> = WORK_RELAY_RUNTIMES.iter().map(|r| r.describe()).collect();
    let title = format!(
        "(a3) work relay runtimes, {} messages a run, {rounds} alternating rounds",
        bodies.len()
    );
    let (bodies, procs, policy) = (&bodies, &bench.procs, &policy);
    compare_alternating("a3 runtimes", &title, &names, rounds, |i| async move {
        let mut tally = Tally::default();
        let runtime = WORK_RELAY_RUNTIMES[i];
        work_relay_run(bodies, procs, &mut tally, policy.clone(), runtime).await
    })
    .await;
}
