//! A publisher's publishes, from their frames to their confirms, polled on one task.
//!
//! lapin settles each publish from its own I/O thread twice: when its frames are written and
//! when the broker confirms it. A task awaiting its own publish is woken from that thread both
//! times, and waking a runtime from another thread costs a system call (and, when the runtime
//! was idle, a context switch) per wake-up. Here one task polls every publish of a channel: a
//! burst of confirms wakes the runtime once (a task already woken is not woken again), and
//! each publishing task is then woken from the runtime's own thread, which costs no system
//! call. Measurements are in docs/performance.md.

use std::future::Future;
use std::pin::Pin;

use futures_util::stream::FuturesUnordered;
use futures_util::StreamExt;
use lapin::Confirmation;
use tokio::sync::{mpsc, oneshot, watch};

/// A publish as lapin runs it: its frames handed to the I/O thread, then the broker's answer.
pub type Publish = Pin<Box<dyn Future<Output = lapin::Result<Confirmation>> + Send>>;

/// Hands publishes to their channel's confirming task; cheap to clone.
#[derive(Clone)]
pub struct InFlight {
    tx: mpsc::UnboundedSender<Waiting>,
}

/// A publish and where its outcome goes.
struct Waiting {
    publish: Publish,
    done: oneshot::Sender<lapin::Result<Confirmation>>,
}

impl InFlight {
    /// Starts the task that polls this channel's publishes. It stops, dropping the publishes
    /// still waiting (their callers see [`InFlight::publish`]'s receiver closed), once `ended`
    /// turns true or its sender is gone (the publisher dropped), and otherwise once every
    /// handle is dropped and no publish waits. A publish whose caller stopped waiting (its
    /// timeout) is dropped too, as it was when each caller polled its own.
    pub fn spawn(ended: watch::Receiver<bool>) -> InFlight {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(run(rx, ended));
        InFlight { tx }
    }

    /// Hands `publish` to the task; the receiver yields its outcome, or is closed when the
    /// publisher's session ended first (or the task is gone: see [`InFlight::running`]).
    pub fn publish(&self, publish: Publish) -> oneshot::Receiver<lapin::Result<Confirmation>> {
        let (done, outcome) = oneshot::channel();
        // A task that has stopped drops `done` with the message: the receiver is closed.
        let _ = self.tx.send(Waiting { publish, done });
        outcome
    }

    /// Whether the task still takes publishes: it stops when the session ends, and would if a
    /// publish panicked, after which every publish would fail while the channel looks open.
    pub fn running(&self) -> bool {
        !self.tx.is_closed()
    }
}

/// Polls every publish handed over until it is settled, and sends each its outcome.
async fn run(mut rx: mpsc::UnboundedReceiver<Waiting>, mut ended: watch::Receiver<bool>) {
    let mut waiting = FuturesUnordered::new();
    let mut arrived = Vec::with_capacity(64);
    let mut open = true;
    while open || !waiting.is_empty() {
        tokio::select! {
            // Ended (or the sender gone): what still waits is dropped, and its callers told.
            _ = ended.wait_for(|ended| *ended) => return,
            n = rx.recv_many(&mut arrived, 1024), if open => {
                open = n > 0;
                waiting.extend(arrived.drain(..).map(|mut w: Waiting| async move {
                    tokio::select! {
                        outcome = &mut w.publish => {
                            let _ = w.done.send(outcome);
                        }
                        // Its caller gave up (a timeout): nobody waits for the outcome.
                        () = w.done.closed() => {}
                    }
                }));
            }
            Some(()) = waiting.next(), if !waiting.is_empty() => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A running task, and the sender that ends its session.
    fn in_flight() -> (watch::Sender<bool>, InFlight) {
        let (ended, ending) = watch::channel(false);
        (ended, InFlight::spawn(ending))
    }

    /// A publish the broker settles when `settle` sends its answer.
    fn publish_settled_by() -> (Publish, oneshot::Sender<Confirmation>) {
        let (settle, settled) = oneshot::channel();
        let publish =
            Box::pin(async move { Ok(settled.await.unwrap_or(Confirmation::NotRequested)) });
        (publish, settle)
    }

    #[tokio::test]
    async fn each_publish_gets_its_own_outcome_in_whatever_order_the_broker_settles_them() {
        let (_ended, in_flight) = in_flight();
        let (first, settle_first) = publish_settled_by();
        let (second, settle_second) = publish_settled_by();
        let (first, second) = (in_flight.publish(first), in_flight.publish(second));
        settle_second.send(Confirmation::Nack(None)).unwrap();
        assert!(matches!(second.await, Ok(Ok(Confirmation::Nack(None)))));
        settle_first.send(Confirmation::Ack(None)).unwrap();
        assert!(matches!(first.await, Ok(Ok(Confirmation::Ack(None)))));
    }

    #[tokio::test]
    async fn a_session_that_ends_fails_the_publishes_still_waiting_and_every_later_one() {
        let (ended, in_flight) = in_flight();
        let (waiting, _never_settled) = publish_settled_by();
        let waiting = in_flight.publish(waiting);
        ended.send_replace(true);
        let outcome = tokio::time::timeout(Duration::from_secs(5), waiting).await;
        assert!(
            matches!(outcome, Ok(Err(_))),
            "a waiting publish is told at once"
        );
        let (later, _) = publish_settled_by();
        let later = tokio::time::timeout(Duration::from_secs(5), in_flight.publish(later)).await;
        assert!(
            matches!(later, Ok(Err(_))),
            "a later publish is told at once"
        );
    }

    #[tokio::test]
    async fn a_publish_whose_caller_stopped_waiting_is_dropped() {
        let (_ended, in_flight) = in_flight();
        let (dropped, dropped_when_polled) = oneshot::channel::<()>();
        let publish: Publish = Box::pin(async move {
            let _held = dropped;
            std::future::pending::<()>().await;
            Ok(Confirmation::NotRequested)
        });
        drop(in_flight.publish(publish));
        let dropped = tokio::time::timeout(Duration::from_secs(5), dropped_when_polled).await;
        assert!(
            matches!(dropped, Ok(Err(_))),
            "the abandoned publish is dropped"
        );
        assert!(in_flight.running());
    }

    #[tokio::test]
    async fn the_task_is_running_until_its_session_ends() {
        let (ended, in_flight) = in_flight();
        assert!(in_flight.running());
        ended.send_replace(true);
        for _ in 0..100 {
            if !in_flight.running() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the task still runs after its session ended");
    }

    #[tokio::test]
    async fn publishes_handed_over_are_settled_after_every_handle_is_dropped() {
        let (_ended, in_flight) = in_flight();
        let (publish, settle) = publish_settled_by();
        let outcome = in_flight.publish(publish);
        drop(in_flight);
        settle.send(Confirmation::Ack(None)).unwrap();
        assert!(matches!(outcome.await, Ok(Ok(Confirmation::Ack(None)))));
    }
}
