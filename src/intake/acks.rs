//! Settling deliveries with the broker: acks coalesced into `multiple` acks, nacks in order.
//!
//! Every ack frame costs the worker, the broker's channel and, on a quorum queue, a settle
//! command in its log. Messages finish out of order (an allowed one waits for its publish
//! confirm, a denied one for its batch of denial rows), so the tasks hand their outcome to this
//! channel's settler instead of acking themselves. It keeps the highest delivery tag up to
//! which everything is settled and acks each new run of finished deliveries with one
//! `basic.ack(multiple)`. A finished delivery stuck behind one that is still being worked on
//! (a message retrying while Postgres is down) is acked on its own after [`ACK_HOLD`], so a
//! slow message never holds the others' acks, and with them the prefetch window, for long.
//!
//! Nothing is acked before its outcome is durable: a task reports a delivery only once
//! [`crate::act::pipeline::Pipeline::handle`] returned. Delivery tags on a channel are 1, 2, 3, ...
//! in delivery order, and a `multiple` ack covers only tags reported finished. A nack (the
//! message goes back to the queue) is sent at once, before any later `multiple` ack that
//! would otherwise cover its tag.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, Instant};

use futures_util::stream::FuturesUnordered;
use futures_util::{FutureExt, StreamExt};

use lapin::options::{BasicAckOptions, BasicNackOptions};
use lapin::Channel;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tracing::warn;

use crate::intake::broker::BROKER_TIMEOUT;

/// Longest a finished delivery waits for the deliveries before it before it is acked alone.
/// Longer than the spread of a full window's publish confirms under load (a quorum queue's
/// come tens of milliseconds apart), so that acks stay coalesced; short beside a message that
/// retries for seconds, which holds the others' acks only this long.
pub const ACK_HOLD: Duration = Duration::from_millis(100);

/// How a task's delivery ended.
#[derive(Debug, Clone, Copy)]
enum Settle {
    /// Its outcome is durable: ack.
    Ack(u64),
    /// It must be delivered again: nack with requeue.
    Requeue(u64),
    /// The session is ending: send every ack still owed and stop.
    Finish,
}

/// Handle through which tasks report their deliveries; cheap to clone.
#[derive(Clone)]
pub struct Settler {
    tx: mpsc::UnboundedSender<Settle>,
}

impl Settler {
    /// Starts settling deliveries of `channel`. The task ends after [`Settler::finish`] (or
    /// once every handle is dropped), having sent every ack it still owed.
    pub fn spawn(channel: Channel) -> (Settler, JoinHandle<()>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (Settler { tx }, tokio::spawn(run(channel, rx)))
    }

    /// The delivery's outcome is durable: it may be acked.
    pub fn ack(&self, delivery_tag: u64) {
        let _ = self.tx.send(Settle::Ack(delivery_tag));
    }

    /// The delivery goes back to the queue to be delivered again.
    pub fn requeue(&self, delivery_tag: u64) {
        let _ = self.tx.send(Settle::Requeue(delivery_tag));
    }

    /// Sends every ack still owed and stops; reports from tasks still running are dropped
    /// (their deliveries stay unacked and the broker redelivers them).
    pub fn finish(&self) {
        let _ = self.tx.send(Settle::Finish);
    }
}

/// Finished deliveries above the settled prefix.
#[derive(Default)]
struct Ledger {
    /// Every tag up to this one is settled.
    settled_upto: u64,
    /// Tag -> when it finished, while its ack is still owed; `None` once acked alone or nacked.
    finished: BTreeMap<u64, Option<Instant>>,
}

impl Ledger {
    /// Advances the settled prefix over finished tags; the tag a `multiple` ack must carry to
    /// settle them, if any of them is still owed an ack.
    fn advance(&mut self) -> Option<u64> {
        let mut ack_upto = None;
        while let Some(owed) = self.finished.remove(&(self.settled_upto + 1)) {
            self.settled_upto += 1;
            if owed.is_some() {
                ack_upto = Some(self.settled_upto);
            }
        }
        ack_upto
    }

    /// Finished tags owed an ack for longer than `hold`, now marked as acked alone.
    fn overdue(&mut self, now: Instant, hold: Duration) -> Vec<u64> {
        let mut tags = Vec::new();
        for (&tag, owed) in self.finished.iter_mut() {
            if owed.is_some_and(|at| now.duration_since(at) >= hold) {
                *owed = None;
                tags.push(tag);
            }
        }
        tags
    }
}

/// A settlement frame handed to lapin, whose outcome is still to be seen.
type Sent = Pin<Box<dyn Future<Output = lapin::Result<()>> + Send>>;

/// Hands settlement frames to lapin in the order they are decided, without waiting for each:
/// lapin queues a frame on the first poll of its future, so one poll sends it (a nack before
/// the later `multiple` ack that must not cover its tag), and the futures are kept to see
/// their outcome. Waiting for each frame to be written before deciding the next held every
/// finished delivery for a round trip through lapin's I/O thread, long enough for most of them
/// to be acked alone.
struct Outbox {
    channel: Channel,
    sent: FuturesUnordered<Sent>,
    failed: bool,
}

impl Outbox {
    fn ack(&mut self, tag: u64, multiple: bool) {
        let channel = self.channel.clone();
        self.send(Box::pin(async move {
            channel.basic_ack(tag, BasicAckOptions { multiple }).await
        }));
    }

    fn nack(&mut self, tag: u64) {
        let options = BasicNackOptions {
            multiple: false,
            requeue: true,
        };
        let channel = self.channel.clone();
        self.send(Box::pin(
            async move { channel.basic_nack(tag, options).await },
        ));
    }

    fn send(&mut self, mut frame: Sent) {
        match (&mut frame).now_or_never() {
            Some(result) => self.seen(result),
            None => self.sent.push(frame),
        }
    }

    /// Reports a settlement that failed: the channel is gone and the broker redelivers
    /// everything unsettled, so it is logged once per channel.
    fn seen(&mut self, result: lapin::Result<()>) {
        if let Err(e) = result {
            if !self.failed {
                warn!(error = %e, "ack or nack failed; the broker redelivers what is unsettled");
            }
            self.failed = true;
        }
    }
}

async fn run(channel: Channel, mut rx: mpsc::UnboundedReceiver<Settle>) {
    let mut ledger = Ledger::default();
    let mut tick = tokio::time::interval(ACK_HOLD / 2);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut outbox = Outbox {
        channel,
        sent: FuturesUnordered::new(),
        failed: false,
    };
    let multiple = metrics::counter!(crate::base::telemetry::ACK_FRAMES, "kind" => "multiple");
    let single = metrics::counter!(crate::base::telemetry::ACK_FRAMES, "kind" => "single");
    loop {
        tokio::select! {
            next = rx.recv() => {
                let Some(first) = next else { break };
                // Let the other runnable tasks report first: under load one multiple ack then
                // covers a whole pass of the runtime's queue instead of the few deliveries
                // reported since the last wake-up.
                tokio::task::yield_now().await;
                let mut next = Some(first);
                let mut finishing = false;
                while let Some(settle) = next {
                    match settle {
                        Settle::Finish => finishing = true,
                        Settle::Ack(tag) => {
                            ledger.finished.insert(tag, Some(Instant::now()));
                        }
                        Settle::Requeue(tag) => {
                            outbox.nack(tag);
                            ledger.finished.insert(tag, None);
                        }
                    }
                    next = rx.try_recv().ok();
                }
                if let Some(tag) = ledger.advance() {
                    multiple.increment(1);
                    outbox.ack(tag, true);
                }
                if finishing {
                    break;
                }
            }
            Some(result) = outbox.sent.next(), if !outbox.sent.is_empty() => outbox.seen(result),
            _ = tick.tick() => {
                for tag in ledger.overdue(Instant::now(), ACK_HOLD) {
                    single.increment(1);
                    outbox.ack(tag, false);
                }
            }
        }
    }
    // Acks still owed now are behind deliveries that never finished: each is sent alone.
    for tag in ledger.overdue(Instant::now(), Duration::ZERO) {
        single.increment(1);
        outbox.ack(tag, false);
    }
    // The session closes its connection after this: let the frames go out first.
    let written = async {
        while let Some(result) = outbox.sent.next().await {
            outbox.seen(result);
        }
    };
    let _ = tokio::time::timeout(BROKER_TIMEOUT, written).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ledger(finished: &[(u64, bool)]) -> Ledger {
        let now = Instant::now();
        Ledger {
            settled_upto: 0,
            finished: finished
                .iter()
                .map(|&(tag, owed)| (tag, owed.then_some(now)))
                .collect(),
        }
    }

    #[test]
    fn a_run_of_finished_deliveries_is_acked_by_its_last_owed_tag() {
        let mut l = ledger(&[(1, true), (2, true), (3, true), (5, true)]);
        assert_eq!(l.advance(), Some(3));
        assert_eq!(l.settled_upto, 3);
        assert_eq!(l.finished.keys().copied().collect::<Vec<_>>(), [5]);
    }

    #[test]
    fn a_multiple_ack_never_carries_a_tag_already_settled() {
        // 3 was nacked and 4 acked alone: the ack for 1..=4 must carry 2, not 4.
        let mut l = ledger(&[(1, true), (2, true), (3, false), (4, false)]);
        assert_eq!(l.advance(), Some(2));
        assert_eq!(l.settled_upto, 4);
        let mut settled = ledger(&[(1, false)]);
        assert_eq!(settled.advance(), None, "nothing owed, no ack");
    }

    #[test]
    fn nothing_is_acked_past_a_delivery_still_in_progress() {
        let mut l = ledger(&[(2, true), (3, true)]);
        assert_eq!(l.advance(), None);
        assert_eq!(l.settled_upto, 0);
    }

    #[test]
    fn finished_deliveries_held_too_long_are_acked_alone_once() {
        let mut l = ledger(&[(2, true), (3, false)]);
        let later = Instant::now() + ACK_HOLD;
        assert_eq!(l.overdue(later, ACK_HOLD), [2]);
        assert!(l.overdue(later, ACK_HOLD).is_empty());
        l.finished.insert(1, Some(later));
        assert_eq!(
            l.advance(),
            Some(1),
            "2 and 3 settled already: the ack carries 1"
        );
        assert_eq!(l.settled_upto, 3);
    }
}
