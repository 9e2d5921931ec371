//! The no-work relay of (a2) and (g): what RabbitMQ and lapin do on this machine with no
//! sendquota code in the way, in several shapes, so that the ceiling is the fastest relay that
//! can be written on lapin rather than one shaped like the worker.
//!
//! Every shape consumes the requests queue with prefetch 1000 (unless `--relay-prefetch` says
//! otherwise) and republishes every delivery to the dispatch exchange (mandatory,
//! publisher-confirmed, as the worker does), acking it once its confirm arrived. Shapes differ
//! in the runtime (current-thread, or multi-thread with one or two worker threads), whether
//! consuming and publishing share a connection, how acks are sent (one per delivery, or
//! coalesced into `multiple` acks of every delivery confirmed so far) and where confirms are
//! awaited (a task per delivery, or all on the consuming task).
//! `--relay-shapes` runs them all in alternating rounds and prints each one's rate; (a2) uses
//! [`RelayShape::CEILING`], the one that measured fastest (docs/performance.md).

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use lapin::options::{BasicAckOptions, BasicPublishOptions, ConfirmSelectOptions};
use lapin::{BasicProperties, Channel, Confirmation};
use sendquota::internals::broker::Names;
use tokio::sync::mpsc;

use crate::queues::{
    connection_pair, consume_requests, poll_each, prefetching_channel, spawn_detached, spawn_each,
    Runtime,
};

/// Prefetch of every relay shape unless `--relay-prefetch` sets another. The worker of (c) runs
/// at its own settings.
pub const RELAY_PREFETCH: u16 = 1000;

/// How acks are sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Acks {
    /// One `basic.ack` per delivery, from the delivery's task, after its confirm.
    Each,
    /// One task acks, with `multiple`, every delivery confirmed so far whose tag is contiguous
    /// with the last one acked: one frame for all the confirms that arrived meanwhile.
    Coalesced,
}

/// How each delivery's publish and confirm are awaited.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Confirms {
    /// A task per delivery publishes and awaits its own confirm, as the worker's tasks do.
    EachTask,
    /// Every delivery's publish and confirm are polled on the consuming task (a stream of
    /// confirms): lapin's I/O thread wakes one task for a burst of confirms.
    OneTask,
}

/// One way to write the relay.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RelayShape {
    /// The runtime it runs on (current-thread: the worker's default).
    pub runtime: Runtime,
    /// Whether publishing has a connection of its own (as the worker does) or shares the
    /// consuming one.
    pub two_connections: bool,
    pub acks: Acks,
    pub confirms: Confirms,
    /// The consumer's prefetch: the window of unacked deliveries the broker keeps full.
    pub prefetch: u16,
    /// The issue 39 program's way: publishes not mandatory, and each delivery's task spawned
    /// and not joined (the consuming loop only takes deliveries; the tasks count themselves
    /// done). Otherwise publishes are mandatory, as the worker's, and tasks are joined.
    pub plain: bool,
}

impl RelayShape {
    /// The shape (a2) measures with: the fastest of [`RelayShape::all`] in this session's
    /// alternating runs (docs/performance.md).
    ///
    /// By default the issue 39 program with coalesced acks: the plain program (single acks)
    /// reached 33.5k msgs/s where the previous ceiling (a multi-thread runtime of one worker,
    /// coalesced, joined tasks, mandatory publishes) reached 21.4k in the same minutes, and
    /// coalesced acks gave the work relay about +30% over single ones. `--relay-shape K`
    /// picks the K-th of [`RelayShape::short_list`] instead (benches/perf/issue39.sh passes
    /// the winner of its shape table).
    pub const CEILING: RelayShape = RelayShape {
        runtime: Runtime::Workers(2),
        two_connections: false,
        acks: Acks::Coalesced,
        confirms: Confirms::EachTask,
        prefetch: RELAY_PREFETCH,
        plain: true,
    };

    /// The shapes `--relay-shapes-short` compares: the issue's program as it was written
    /// (single acks), [`RelayShape::CEILING`] (it with coalesced acks), it on one worker
    /// thread, and the previous ceiling.
    pub fn short_list(prefetch: u16) -> Vec<RelayShape> {
        let issue = RelayShape {
            acks: Acks::Each,
            ..RelayShape::ceiling_at(prefetch)
        };
        vec![
            issue,
            RelayShape::ceiling_at(prefetch),
            RelayShape {
                runtime: Runtime::Workers(1),
                ..RelayShape::ceiling_at(prefetch)
            },
            RelayShape {
                runtime: Runtime::Workers(1),
                plain: false,
                ..RelayShape::ceiling_at(prefetch)
            },
        ]
    }

    /// [`RelayShape::CEILING`] consuming with `prefetch`.
    pub fn ceiling_at(prefetch: u16) -> RelayShape {
        RelayShape {
            prefetch,
            ..RelayShape::CEILING
        }
    }

    /// Every shape `--relay-shapes` compares, each consuming with `prefetch`: the short list,
    /// then every combination of the joined, mandatory shapes.
    pub fn all(prefetch: u16) -> Vec<RelayShape> {
        let mut out = RelayShape::short_list(prefetch);
        for runtime in [
            Runtime::CurrentThread,
            Runtime::Workers(1),
            Runtime::Workers(2),
        ] {
            for two_connections in [false, true] {
                for acks in [Acks::Each, Acks::Coalesced] {
                    for confirms in [Confirms::EachTask, Confirms::OneTask] {
                        let shape = RelayShape {
                            runtime,
                            two_connections,
                            acks,
                            confirms,
                            prefetch,
                            plain: false,
                        };
                        if !out.contains(&shape) {
                            out.push(shape);
                        }
                    }
                }
            }
        }
        out
    }

    /// The shape in words, for the report.
    pub fn describe(&self) -> String {
        format!(
            "{}prefetch {}, {}, {}, {} acks, {}",
            if self.plain {
                "plain (issue 39: not mandatory, tasks not joined), "
            } else {
                ""
            },
            self.prefetch,
            self.runtime.describe(),
            if self.two_connections {
                "consume and publish on two connections"
            } else {
                "one connection"
            },
            match self.acks {
                Acks::Each => "single",
                Acks::Coalesced => "coalesced `multiple`",
            },
            match self.confirms {
                Confirms::EachTask => "a task per delivery awaiting its confirm",
                Confirms::OneTask => "every confirm awaited on the consuming task",
            }
        )
    }
}

/// Relays `n` messages in `shape` on the current runtime. Returns the elapsed time from the
/// open channels.
pub async fn relay(shape: RelayShape, names: Names, n: usize) -> Duration {
    let (conn, publish_conn) = connection_pair("sendquota-perf-relay").await;
    let consume = prefetching_channel(&conn, shape.prefetch).await;
    let publishing = if shape.two_connections {
        &publish_conn
    } else {
        &conn
    };
    let publish = publishing.create_channel().await.expect("channel");
    publish
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm mode");
    let began = Instant::now();
    let mut consumer = consume_requests(&consume, &names).await;
    let (confirmed, acker) = match shape.acks {
        Acks::Each => (None, None),
        Acks::Coalesced => {
            let (tx, rx) = mpsc::unbounded_channel();
            (
                Some(tx),
                Some(tokio::spawn(ack_coalesced(consume.clone(), rx))),
            )
        }
    };
    let props = BasicProperties::default()
        .with_content_type("application/json".into())
        .with_delivery_mode(2);
    let each = |delivery: lapin::message::Delivery| {
        let (publish, consume) = (publish.clone(), consume.clone());
        let (exchange, props) = (names.dispatch.clone(), props.clone());
        let confirmed = confirmed.clone();
        async move {
            let options = BasicPublishOptions {
                mandatory: !shape.plain,
                ..Default::default()
            };
            let confirm = publish
                .basic_publish(
                    exchange.as_str().into(),
                    "sms".into(),
                    options,
                    &delivery.data,
                    props,
                )
                .await
                .expect("publish")
                .await
                .expect("confirm");
            assert_eq!(
                confirm,
                Confirmation::Ack(None),
                "relay publish not confirmed and routed"
            );
            match confirmed {
                Some(tx) => {
                    let _ = tx.send(delivery.delivery_tag);
                }
                None => consume
                    .basic_ack(delivery.delivery_tag, BasicAckOptions::default())
                    .await
                    .expect("ack"),
            }
        }
    };
    match shape.confirms {
        Confirms::EachTask if shape.plain => {
            spawn_detached(&mut consumer, n, "a2 relay", each).await
        }
        Confirms::EachTask => spawn_each(&mut consumer, n, "a2 relay", each).await,
        Confirms::OneTask => poll_each(&mut consumer, n, "a2 relay", each).await,
    }
    let elapsed = began.elapsed();
    drop(confirmed);
    if let Some(acker) = acker {
        acker.await.expect("acker task");
    }
    drop(consumer);
    // Close the consuming channel first so the broker has its acks before the connection goes.
    let _ = consume.close(200, "relay done".into()).await;
    let _ = conn.close(200, "relay done".into()).await;
    let _ = publish_conn.close(200, "relay done".into()).await;
    elapsed
}

/// Acks confirmed deliveries with `multiple`: after each wake-up it takes every tag confirmed
/// meanwhile and acks up to the highest one contiguous with those acked before (delivery tags
/// of a channel count up from 1). Ends, having acked everything, when every sender is gone.
pub async fn ack_coalesced(channel: Channel, mut confirmed: mpsc::UnboundedReceiver<u64>) {
    let mut next = 1u64;
    let mut waiting = BTreeSet::new();
    let mut batch = Vec::with_capacity(256);
    while confirmed.recv_many(&mut batch, 4096).await > 0 {
        waiting.extend(batch.drain(..));
        let mut highest = None;
        while waiting.remove(&next) {
            highest = Some(next);
            next += 1;
        }
        if let Some(tag) = highest {
            channel
                .basic_ack(tag, BasicAckOptions { multiple: true })
                .await
                .expect("ack");
        }
    }
}
