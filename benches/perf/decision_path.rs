//! The decision path without a broker: `Limiter::evaluate` (commit) over decoded requests,
//! many at a time as the worker runs them, each at its own simulated instant. Phases (b), (e)
//! and (f) measure it; its rate against the bare script loop of (a1) is the limiter's overhead.

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use futures_util::StreamExt;
use sendquota::config::Settings;
use sendquota::internals::limiter::Limiter;
use sendquota::internals::message::SendRequest;
use sendquota::internals::policy::Policy;

use crate::progress::Progress;
use crate::support::request;

/// The policy of a config file holding `toml`.
pub fn policy(toml: &str) -> Policy {
    Settings::from_toml(toml, |_| None)
        .expect("bench policy is valid")
        .policy
}

/// A request for `recipient` in UTC, as the worker decodes it from the queue.
pub fn decode(id: &str, recipient: &str) -> SendRequest {
    SendRequest::decode(
        request(id, recipient, "UTC").to_string().as_bytes(),
        1 << 16,
    )
    .expect("valid request")
}

/// Runs `messages[range]` through `Limiter::evaluate` (commit), `concurrency` at a time,
/// message `i` at `at(i)`. Returns how many were admitted and the elapsed time.
#[allow(clippy::too_many_arguments)]
pub async fn evaluate_all(
    progress: &mut Progress,
    limiter: &Limiter,
    policy: &Arc<Policy>,
    messages: &[SendRequest],
    range: Range<usize>,
    at: impl Fn(usize) -> DateTime<Utc>,
    concurrency: usize,
) -> (usize, Duration) {
    let began = Instant::now();
    let mut results = futures_util::stream::iter(range.map(|i| (i, &messages[i])))
        .map(|(i, m)| {
            let when = at(i);
            async move {
                limiter
                    .evaluate(policy, m, when, true)
                    .await
                    .expect("evaluate")
                    .committed()
            }
        })
        .buffer_unordered(concurrency);
    let (mut done, mut allowed) = (0usize, 0usize);
    while let Some(committed) = results.next().await {
        done += 1;
        allowed += usize::from(committed);
        if done.is_multiple_of(1024) {
            progress.add(1024);
        }
    }
    progress.add(done % 1024);
    (allowed, began.elapsed())
}
