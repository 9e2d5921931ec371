//! The two ceilings the worker is measured against, the best this machine does with no
//! sendquota code in the way: (a1) the limiter's exact EVALSHA for the headline rule in bare
//! redis-rs pipelines, the ceiling of the decision path (b) and, on denials, of (f); (a2) a
//! no-work relay through RabbitMQ (its shapes in `relay`), the ceiling of the worker end to end
//! (c), and with (g) the broker's share of its latency.

use std::ops::Range;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use futures_util::StreamExt;
use redis::aio::MultiplexedConnection;
use redis::Value;
use sendquota::internals::keys::{ids_key, recipient_sent_key};
use sendquota::internals::kinds::calendar::{day_number, day_start, window_reach};

use crate::keyspace::headline_key;
use crate::procs::{Procs, Tally};
use crate::progress::Progress;
use crate::queues::{broker_phase, empty_broker_queues, queued};
use crate::relay::{relay, RelayShape};
use crate::report::rate;
use crate::support::TestEnv;

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
        let day_end = day_start(today + 1, chrono_tz::UTC)
            .timestamp_millis()
            .to_string();
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
                        .arg("9")
                        .arg(&today)
                        .arg(&day_begin)
                        .arg(&window_begin)
                        .arg(1)
                        .arg(3)
                        .arg(7)
                        .arg(at_ms + i as i64 - reach)
                        .arg(reach)
                        .arg(&day_end);
                }
                let mut conn = self.conn.clone();
                async move { pipe.query_async::<Vec<Value>>(&mut conn).await }
            })
            .buffer_unordered(self.in_flight);
        let mut allowed = 0usize;
        while let Some(reply) = replies.next().await {
            let reply = reply.expect("EVALSHA pipeline");
            let k = reply.len();
            allowed += reply.iter().filter(|v| committed(v)).count();
            progress.add(k);
        }
        (allowed, began.elapsed())
    }
}

/// Whether a decision script's reply says it committed (lua/decide.lua: the reply's numbers in
/// one string, the first 1 when committed).
pub fn committed(reply: &Value) -> bool {
    match reply {
        Value::BulkString(text) => {
            text.split(|&b| b == b' ').find(|n| !n.is_empty()) == Some(b"1".as_slice())
        }
        other => panic!("decision script replied {other:?}"),
    }
}

/// (a2) once, in `shape`: queue the bodies, relay them, check they all reached the sink, empty
/// it and the requests queue. Returns the rate, how many messages the broker put back in the
/// requests queue after the relay closed its channel although every delivery had been acked,
/// and how many more than `bodies` reached the sink (deliveries seen twice).
pub async fn relay_run(
    env: &TestEnv,
    bodies: &[Vec<u8>],
    procs: &Procs,
    tally: &mut Tally,
    shape: RelayShape,
) -> (f64, usize, usize) {
    let m = bodies.len();
    let phase = move |names, n| relay(shape, names, n);
    let (took, routed) =
        broker_phase(env, bodies, procs, tally, "a2", 0, shape.runtime, phase).await;
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
