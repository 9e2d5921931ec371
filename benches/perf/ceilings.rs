//! The two ceilings the worker is measured against, the best this machine does with no
//! sendquota code in the way: (a1) the limiter's exact EVALSHA for the headline rule in bare
//! redis-rs pipelines, the ceiling of the decision path (b) and, on denials, of (f); (a2) a
//! no-work relay through RabbitMQ, the ceiling of the worker end to end (c), and with (g) the
//! broker's share of its latency.

use std::ops::Range;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use futures_util::stream::FuturesUnordered;
use futures_util::StreamExt;
use lapin::BasicProperties;
use redis::aio::MultiplexedConnection;
use redis::Value;
use sendquota::internals::broker::Names;
use sendquota::internals::dedup::recipient_sent_key;
use sendquota::internals::kinds::calendar::{day_number, day_start, window_reach};
use sendquota::internals::limiter::keys::ids_key;

use crate::keyspace::headline_key;
use crate::procs::{Procs, Tally};
use crate::progress::Progress;
use crate::queues::{
    broker_phase, connection_pair, consume_requests, empty_broker_queues, prefetching_channel,
    queued,
};
use crate::report::rate;
use crate::support::TestEnv;

/// Prefetch of the relay ceiling (a2). The worker of (c) runs at its own settings.
const RELAY_PREFETCH: u16 = 1000;

/// The bare decision loop: the limiter's exact EVALSHA for the headline rule, sent in
/// pipelines over one multiplexed connection, several pipelines in flight.
pub struct LuaLoop {
    pub conn: MultiplexedConnection,
    pub sha: String,
    pub namespace: String,
    pub pipeline: usize,
    pub in_flight: usize,
}

impl LuaLoop {
    /// Decides messages `range` at `at` (+1 ms per decision index); decision `i` is message
    /// `<prefix>m<i>` for recipient `<prefix><recipient(i)>`. Returns how many were admitted
    /// and the elapsed time.
    pub async fn run(
        &self,
        progress: &mut Progress,
        range: Range<usize>,
        prefix: &str,
        at: DateTime<Utc>,
        recipient: impl Fn(usize) -> usize,
    ) -> (usize, Duration) {
        // The worker's arguments for the headline rule (lua/calendar_quota.lua) in UTC.
        let today = day_number(at, chrono_tz::UTC);
        let at_ms = at.timestamp_millis();
        let day_begin = day_start(today, chrono_tz::UTC)
            .timestamp_millis()
            .to_string();
        let window_begin = day_start(today - 6, chrono_tz::UTC)
            .timestamp_millis()
            .to_string();
        let reach = window_reach(7).num_milliseconds();
        let today = today.to_string();
        let end = range.end;
        let began = Instant::now();
        let mut replies = futures_util::stream::iter(range.step_by(self.pipeline))
            .map(|first| {
                let mut pipe = redis::pipe();
                for i in first..(first + self.pipeline).min(end) {
                    let who = format!("{prefix}{}", recipient(i));
                    let key = headline_key(&self.namespace, &who);
                    let ids = ids_key(&key);
                    let marks = recipient_sent_key(&self.namespace, &who);
                    pipe.cmd("EVALSHA")
                        .arg(&self.sha)
                        .arg(3)
                        .arg(key)
                        .arg(ids)
                        .arg(marks)
                        .arg(at_ms + i as i64)
                        .arg(format!("{prefix}m{i}"))
                        .arg("commit")
                        .arg(1)
                        .arg(1)
                        .arg("calendar_quota")
                        .arg("1")
                        .arg("8")
                        .arg(&today)
                        .arg(&day_begin)
                        .arg(&window_begin)
                        .arg(1)
                        .arg(3)
                        .arg(7)
                        .arg(at_ms + i as i64 - reach)
                        .arg(reach);
                }
                let mut conn = self.conn.clone();
                async move { pipe.query_async::<Vec<Value>>(&mut conn).await }
            })
            .buffer_unordered(self.in_flight);
        let mut allowed = 0usize;
        while let Some(reply) = replies.next().await {
            let reply = reply.expect("EVALSHA pipeline");
            let k = reply.len();
            for v in reply {
                match v {
                    Value::Array(items) => {
                        allowed += usize::from(matches!(items.first(), Some(Value::Int(1))));
                    }
                    other => panic!("decision script replied {other:?}"),
                }
            }
            progress.add(k);
        }
        (allowed, began.elapsed())
    }
}

/// One relayed message: publish, wait for its confirm, ack.
type RelayOne = std::pin::Pin<Box<dyn std::future::Future<Output = lapin::Result<()>> + Send>>;

/// (a2): consumes the requests queue (quorum) with prefetch 1000 and republishes every
/// delivery to the dispatch exchange, publisher-confirmed and mandatory as the worker does,
/// acking after the confirm; all of it concurrently, through lapin, the worker's AMQP client,
/// on two connections as the worker uses (so the ceiling is the broker's and the client's,
/// not extra work). Spawned on a runtime shaped like the worker's (see [`on_worker_runtime`]).
/// Returns the elapsed time.
pub async fn relay(names: Names, n: usize) -> Duration {
    let (conn, publish_conn) = connection_pair("sendquota-perf-relay").await;
    let consume = prefetching_channel(&conn, RELAY_PREFETCH).await;
    let publish = publish_conn.create_channel().await.expect("channel");
    publish
        .confirm_select(lapin::options::ConfirmSelectOptions::default())
        .await
        .expect("confirm mode");
    let mut progress = Progress::new("a2 relay", n);
    let began = Instant::now();
    let mut consumer = consume_requests(&consume, &names).await;
    let mut in_flight: FuturesUnordered<RelayOne> = FuturesUnordered::new();
    let mut done = 0usize;
    let props = BasicProperties::default()
        .with_content_type("application/json".into())
        .with_delivery_mode(2);
    while done < n {
        tokio::select! {
            biased;
            Some(r) = in_flight.next(), if !in_flight.is_empty() => {
                r.expect("relay one message");
                done += 1;
                progress.add(1);
            }
            d = consumer.next() => {
                let delivery = d.expect("consumer ended").expect("delivery");
                let (publish, consume) = (publish.clone(), consume.clone());
                let (exchange, props) = (names.dispatch.clone(), props.clone());
                in_flight.push(Box::pin(async move {
                    let options = lapin::options::BasicPublishOptions {
                        mandatory: true,
                        ..Default::default()
                    };
                    let confirm = publish
                        .basic_publish(exchange.as_str().into(), "sms".into(), options, &delivery.data, props)
                        .await?
                        .await?;
                    assert_eq!(
                        confirm,
                        lapin::Confirmation::Ack(None),
                        "relay publish not confirmed and routed"
                    );
                    consume
                        .basic_ack(delivery.delivery_tag, lapin::options::BasicAckOptions::default())
                        .await
                }));
            }
        }
    }
    let elapsed = began.elapsed();
    drop(consumer);
    // Close the consuming channel first so the broker has its acks before the connection goes.
    let _ = consume.close(200, "relay done".into()).await;
    let _ = conn.close(200, "relay done".into()).await;
    let _ = publish_conn.close(200, "relay done".into()).await;
    elapsed
}

/// (a2) once: queue the bodies, relay them, check they all reached the sink, empty it and
/// the requests queue. Returns the rate, how many messages the broker put back in the
/// requests queue after the relay closed its channel although every delivery had been acked,
/// and how many more than `bodies` reached the sink (deliveries seen twice).
pub async fn relay_run(
    env: &TestEnv,
    bodies: &[Vec<u8>],
    procs: &Procs,
    tally: &mut Tally,
) -> (f64, usize, usize) {
    let m = bodies.len();
    let (took, routed) = broker_phase(env, bodies, procs, tally, "a2", 0, relay).await;
    assert!(
        routed >= m,
        "the relay lost messages: {routed} of {m} routed"
    );
    let mut returned = 0;
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        returned = queued(env, &env.names.requests).await;
        if returned > 0 {
            break;
        }
    }
    empty_broker_queues(env).await;
    (rate(m, took), returned, routed - m)
}
