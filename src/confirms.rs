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
    /// turns true or its sender is gone, and otherwise once every handle is dropped and no
    /// publish waits.
    pub fn spawn(ended: watch::Receiver<bool>) -> InFlight {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(run(rx, ended));
        InFlight { tx }
    }

    /// Hands `publish` to the task; the receiver yields its outcome, or is closed when the
    /// publisher's session ended first.
    pub fn publish(&self, publish: Publish) -> oneshot::Receiver<lapin::Result<Confirmation>> {
        let (done, outcome) = oneshot::channel();
        // A task that has stopped drops `done` with the message: the receiver is closed.
        let _ = self.tx.send(Waiting { publish, done });
        outcome
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
                waiting.extend(arrived.drain(..).map(|w: Waiting| async move {
                    let _ = w.done.send(w.publish.await);
                }));
            }
            Some(()) = waiting.next(), if !waiting.is_empty() => {}
        }
    }
}
