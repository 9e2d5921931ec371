//! Replaying denied messages: publish each original request again, exactly once per denial,
//! safely from cron.
//!
//! A run replays the denials that existed when it started (never the new denials its own
//! replays cause, so a run cannot feed itself). Rows are claimed in batches with
//! `FOR UPDATE SKIP LOCKED`, published (publisher-confirmed,
//! same message id, a header naming the denial), then marked replayed in the same transaction.
//! Two replays running at once claim disjoint rows. A crash between publish and commit rolls the
//! marks back, so those messages are published again by the next run; the quota recognises their
//! ids and the dispatch marks stop a second dispatch.

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use futures_util::stream::{FuturesUnordered, StreamExt};
use lapin::BasicProperties;

use crate::intake::broker::{self, BrokerError, Names};
use crate::intake::publisher::Publisher;
use crate::intake::shards;
use crate::record::denials::{Denial, DenialError, DenialFilter, DenialStore};

/// What to replay and how fast.
#[derive(Debug, Clone)]
pub struct ReplayOptions {
    /// Which denials (shadow and already-replayed ones are never replayed; set `live_at` to
    /// skip those past their deadline).
    pub filter: DenialFilter,
    /// At most this many.
    pub limit: Option<usize>,
    /// At most this many publishes per second.
    pub rate: Option<f64>,
    /// Rows claimed per transaction.
    pub batch: i64,
}

/// What a replay did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReplayReport {
    /// Denials published again and marked replayed.
    pub replayed: usize,
    /// Transactions that claimed rows (batches).
    pub claims: usize,
    /// Time taken.
    pub elapsed: Duration,
}

/// A replay failure; what was published and marked before it stays marked.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// Postgres failed.
    #[error(transparent)]
    Denials(#[from] DenialError),
    /// RabbitMQ failed.
    #[error(transparent)]
    Broker(#[from] BrokerError),
}

/// Replays matching denials, calling `progress` with the running count after each publish.
pub async fn replay(
    store: &DenialStore,
    publisher: &Publisher,
    names: &Names,
    options: &ReplayOptions,
    now: impl Fn() -> DateTime<Utc>,
    mut progress: impl FnMut(usize),
) -> Result<ReplayReport, ReplayError> {
    let started = Instant::now();
    let limit = options.limit.unwrap_or(usize::MAX);
    let mut replayed = 0usize;
    let up_to = store.last_id().await?;
    let mut cursor = 0i64;
    let mut claims = 0usize;
    while replayed < limit {
        let batch =
            i64::try_from(limit - replayed).map_or(options.batch, |left| options.batch.min(left));
        let claim = store.claim(&options.filter, batch, cursor, up_to).await?;
        let Some(last) = claim.rows().last() else {
            break;
        };
        cursor = last.id;
        claims += 1;
        // Publish the batch concurrently (paced by the rate), then wait for every confirm:
        // only confirmed rows are marked.
        let mut confirms = FuturesUnordered::new();
        for (i, denial) in claim.rows().iter().enumerate() {
            if let Some(rate) = options.rate {
                let due = started + Duration::from_secs_f64((replayed + i) as f64 / rate);
                tokio::time::sleep_until(due.into()).await;
            }
            let body = denial.message.text().as_bytes().to_vec();
            let properties = properties(denial);
            confirms.push(async move {
                publisher
                    .publish(&names.requests, "", &body, properties)
                    .await
                    .map(|()| denial.id)
            });
        }
        let mut ids = Vec::with_capacity(claim.rows().len());
        while let Some(confirmed) = confirms.next().await {
            ids.push(confirmed?);
            replayed += 1;
            progress(replayed);
        }
        drop(confirms);
        claim.finish(&ids, now()).await?;
    }
    Ok(ReplayReport {
        replayed,
        claims,
        elapsed: started.elapsed(),
    })
}

/// The replay's properties: the original message id, a header naming the denial, and the
/// deadline, which goes with the message: the worker records it as expired should it arrive
/// past it (its expires_at is in the body; a max_delay's is not).
fn properties(denial: &Denial) -> BasicProperties {
    let deadline = denial.expires_at.map(|at| {
        (
            broker::DEADLINE_HEADER,
            at.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true),
        )
    });
    // The recipient header too, so that with shards the replay goes to its recipient's shard.
    let mut headers = vec![
        (broker::REPLAY_OF_HEADER, denial.id.to_string()),
        (shards::RECIPIENT_HEADER, denial.recipient.clone()),
    ];
    headers.extend(deadline);
    broker::json_properties(Some(&denial.message_id), &headers)
}

/// Parses a replay rate: `50/s`, `50` (per second) or `300/m`.
pub fn parse_rate(text: &str) -> Option<f64> {
    let (n, per) = match text.split_once('/') {
        Some((n, "s")) => (n, 1.0),
        Some((n, "m")) => (n, 60.0),
        Some((n, "h")) => (n, 3600.0),
        Some(_) => return None,
        None => (text, 1.0),
    };
    n.trim()
        .parse::<f64>()
        .ok()
        .filter(|r| r.is_finite() && *r > 0.0)
        .map(|r| r / per)
}

#[cfg(test)]
mod tests {
    use super::parse_rate;

    #[test]
    fn rates_are_per_second() {
        assert_eq!(parse_rate("50/s"), Some(50.0));
        assert_eq!(parse_rate("20"), Some(20.0));
        assert_eq!(parse_rate("120/m"), Some(2.0));
        assert_eq!(parse_rate("0/s"), None);
        assert_eq!(parse_rate("fast"), None);
    }
}
