//! Which node of a RabbitMQ cluster a connection goes to (`amqp.urls`): the URLs in turn,
//! starting from the one that answered last, each given a short time to answer, so that a
//! node that is down (it refuses at once) or hung (it never answers) costs a worker seconds,
//! not a reconnect backoff's ten, while another node can take its connections.
//!
//! The node that answered last is remembered for the whole process: the worker's consuming
//! and publishing connections, and a command's, go to the same node, and a worker whose
//! session on a node ended starts its next round with the node after it ([`move_on`]).

use std::fmt::Display;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::base::config::redact_url;

/// Longest wait for one node of a list to accept a connection before the next is tried: a
/// hung node must not hold the connection for the broker timeout while others answer. (A
/// single URL keeps the longer broker timeout: there is no other node to try.)
pub const NODE_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// The index, in the process's URL list, of the node the next round starts with: the last
/// that answered, or the one after a node whose session ended.
static PREFERRED: AtomicUsize = AtomicUsize::new(0);

/// Why one node of a round did not give a connection.
#[derive(Debug)]
pub enum NodeFailure<E> {
    /// The client's own error (refused, closed, authentication, TLS, ...).
    Failed(E),
    /// No answer within the round's timeout per node.
    TimedOut(Duration),
}

/// Every node of a round failed: each URL (password redacted) with its failure, in the order
/// they were tried.
#[derive(Debug)]
pub struct RoundFailed<E> {
    /// `(redacted URL, failure)` per node tried.
    pub failures: Vec<(String, NodeFailure<E>)>,
}

impl<E: Display> Display for RoundFailed<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "no rabbitmq node answered: ")?;
        for (n, (url, failure)) in self.failures.iter().enumerate() {
            let sep = if n == 0 { "" } else { "; " };
            match failure {
                NodeFailure::Failed(e) => write!(f, "{sep}{url}: {e}")?,
                NodeFailure::TimedOut(t) => write!(f, "{sep}{url}: no answer within {t:?}")?,
            }
        }
        Ok(())
    }
}

/// The first of `urls` that `connect` opens within `timeout`, trying them in order from the
/// preferred one (and round to it): the connection and its URL's index, remembered as the
/// preferred node. Every URL's failure when none answers.
pub async fn first_answering<C, E, F, Fut>(
    urls: &[String],
    timeout: Duration,
    mut connect: F,
) -> Result<(C, usize), RoundFailed<E>>
where
    F: FnMut(&str) -> Fut,
    Fut: Future<Output = Result<C, E>>,
{
    let mut failures = Vec::with_capacity(urls.len());
    for index in round(PREFERRED.load(Ordering::Relaxed), urls.len()) {
        let url = &urls[index];
        match tokio::time::timeout(timeout, connect(url)).await {
            Ok(Ok(connection)) => {
                PREFERRED.store(index, Ordering::Relaxed);
                return Ok((connection, index));
            }
            Ok(Err(e)) => failures.push((redact_url(url), NodeFailure::Failed(e))),
            Err(_) => failures.push((redact_url(url), NodeFailure::TimedOut(timeout))),
        }
    }
    Err(RoundFailed { failures })
}

/// The indexes of a round over `len` URLs starting at `preferred` (wrapped into range: the
/// list may have changed length).
fn round(preferred: usize, len: usize) -> impl Iterator<Item = usize> {
    let start = preferred.checked_rem(len).unwrap_or(0);
    (0..len).map(move |k| (start + k) % len)
}

/// The node of the last successful connection (an index into the URL list): a session
/// remembers it to say which node to move on from when it ends.
pub fn preferred() -> usize {
    PREFERRED.load(Ordering::Relaxed)
}

/// A session on node `failed` ended: the next round starts with the node after it, so that a
/// node that went away is tried last, not first (a hung one would cost the whole per-node
/// timeout). Nothing changes when another connection has already moved on.
pub fn move_on(failed: usize) {
    let _ = PREFERRED.compare_exchange(
        failed,
        failed.wrapping_add(1),
        Ordering::Relaxed,
        Ordering::Relaxed,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_round_starts_at_the_preferred_node_and_wraps_round_to_it() {
        assert_eq!(round(1, 3).collect::<Vec<_>>(), [1, 2, 0]);
        assert_eq!(round(3, 3).collect::<Vec<_>>(), [0, 1, 2]);
        assert_eq!(round(5, 1).collect::<Vec<_>>(), [0]);
        assert_eq!(round(0, 0).count(), 0);
    }
}
