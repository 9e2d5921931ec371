//! (d)'s floor: the worker's broker work with nothing decided, run in this process between the
//! two runs of (c). The worker's own `Publisher` and `Settler`, its prefetch and concurrency,
//! half the messages published: what the worker's CPU per message cannot go below with this
//! AMQP client, so that (d) shows what the rest of the worker costs.

use std::sync::Arc;
use std::time::{Duration, Instant};

use sendquota::internals::acks::Settler;
use sendquota::internals::broker::{Names, Publisher};
use tokio::sync::Semaphore;

use crate::procs::{Procs, Tally};
use crate::queues::{
    broker_phase, connection_pair, consume_requests, empty_broker_queues, prefetching_channel,
    spawn_each, worker_runtime,
};
use crate::support::TestEnv;
use crate::worker::WorkerChoice;

/// (d) floor: the worker's broker work with nothing decided. The worker's own [`Publisher`] and
/// [`Settler`], one task per delivery under a semaphore of the worker's concurrency, every
/// other delivery published (publisher-confirmed, mandatory) to the dispatch exchange as the
/// worker dispatches half in (c), every delivery acked through the settler once its outcome
/// is done; the prefetch and concurrency those of the worker in (c) (`(prefetch, concurrency)`).
/// No Redis, no Postgres, no decoding: what is left of (d) once the decisions, the
/// denial rows and the dispatch marks are taken away. Runs on a runtime like [`relay`].
/// Returns the elapsed time.
async fn broker_floor(names: Names, n: usize, (prefetch, concurrency): (u16, usize)) -> Duration {
    let (conn, publish_conn) = connection_pair("sendquota-perf-floor").await;
    let publisher = Publisher::open(&publish_conn)
        .await
        .expect("publisher channel");
    let consume = prefetching_channel(&conn, prefetch).await;
    let (settler, settling) = Settler::spawn(consume.clone());
    let slots = Arc::new(Semaphore::new(concurrency));
    let began = Instant::now();
    let mut consumer = consume_requests(&consume, &names).await;
    spawn_each(&mut consumer, n, "d floor: broker work alone", |delivery| {
        // A slot per delivery in flight, as the worker takes one (prefetch and concurrency are
        // the worker's).
        let (slots, publisher, settler) = (slots.clone(), publisher.clone(), settler.clone());
        let exchange = names.dispatch.clone();
        async move {
            let _slot = slots.acquire_owned().await.expect("semaphore open");
            if delivery.delivery_tag % 2 == 1 {
                let props = sendquota::internals::broker::json_properties(None, &[]);
                publisher
                    .publish(&exchange, "sms", &delivery.data, props)
                    .await
                    .expect("floor publish confirmed and routed");
            }
            settler.ack(delivery.delivery_tag);
        }
    })
    .await;
    settler.finish();
    settling.await.expect("settler");
    let elapsed = began.elapsed();
    drop(consumer);
    let _ = consume.close(200, "floor done".into()).await;
    let _ = conn.close(200, "floor done".into()).await;
    let _ = publish_conn.close(200, "floor done".into()).await;
    elapsed
}

/// (d) floor once: [`broker_phase`] with [`broker_floor`] at `worker`'s prefetch and
/// concurrency; half the bodies must reach the sink.
pub async fn floor_run(
    env: &TestEnv,
    bodies: &[Vec<u8>],
    procs: &Procs,
    tally: &mut Tally,
    worker: &WorkerChoice,
) {
    let m = bodies.len();
    let shape = worker.in_progress();
    let floor = move |names, n| broker_floor(names, n, shape);
    let (_, routed) = broker_phase(
        env,
        bodies,
        procs,
        tally,
        "d floor",
        m / 2,
        worker_runtime(),
        floor,
    )
    .await;
    assert!(
        routed >= m / 2,
        "the floor run lost messages: {routed} of {} routed",
        m / 2
    );
    empty_broker_queues(env).await;
}
