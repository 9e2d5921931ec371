//! The quarantine queue from the operator's side: what is in it, and publishing it back to the
//! requests exchange once the cause is fixed (`sendquota quarantine list|replay`).
//!
//! Messages land there from the worker (`pipeline::Pipeline::quarantine`) when a service
//! refuses them for good. A replay publishes each one again, publisher-confirmed, records it in
//! `quarantine_replays`, and only then acks it off the quarantine queue: a crash in between
//! publishes it once more, which the message's id makes harmless (its claim, quota and
//! dispatch mark recognise it).
//!
//! A replay takes only what the queue held when it started, each message at most once: with
//! the cause not fixed, the worker quarantines the replayed messages again, at the queue's
//! tail, and a run that went on until the queue was empty would replay its own replays until
//! its limit.

use lapin::options::{BasicAckOptions, BasicGetOptions};
use lapin::Channel;
use serde::Serialize;

use crate::broker::{self, timed, BrokerError, Names, Publisher};
use crate::denials::{DenialError, DenialStore};

/// One quarantined message, as `quarantine list` prints it.
#[derive(Debug, Clone, Serialize)]
pub struct Quarantined {
    /// Its `message_id` property.
    pub message_id: Option<String>,
    /// Why it was quarantined.
    pub reason: Option<String>,
    /// Attempts at it before it was.
    pub attempts: Option<String>,
    /// Its first error.
    pub first_error: Option<String>,
    /// Its body, as the producer sent it.
    pub body: String,
}

/// Failures of a quarantine command.
#[derive(Debug, thiserror::Error)]
pub enum QuarantineError {
    /// The broker failed.
    #[error(transparent)]
    Broker(#[from] BrokerError),
    /// The audit row could not be written (the message stays in quarantine).
    #[error(transparent)]
    Audit(#[from] DenialError),
}

/// Takes the next message off the quarantine queue, unacked.
async fn next(
    channel: &Channel,
    names: &Names,
) -> Result<Option<(u64, Quarantined, lapin::BasicProperties)>, BrokerError> {
    let got = timed(
        "basic.get",
        channel.basic_get(
            broker::short(&names.quarantine)?,
            BasicGetOptions { no_ack: false },
        ),
    )
    .await?;
    Ok(got.map(|m| {
        let d = m.delivery;
        let p = &d.properties;
        let quarantined = Quarantined {
            message_id: p.message_id().as_ref().map(|s| s.to_string()),
            reason: broker::header(p, broker::QUARANTINE_REASON_HEADER),
            attempts: broker::header(p, broker::QUARANTINE_ATTEMPTS_HEADER),
            first_error: broker::header(p, broker::QUARANTINE_FIRST_ERROR_HEADER),
            body: String::from_utf8_lossy(&d.data).into_owned(),
        };
        (d.delivery_tag, quarantined, d.properties)
    }))
}

/// Up to `limit` quarantined messages, oldest first, left in the queue: they are taken unacked
/// on `channel`, which the caller closes to give them back.
pub async fn list(
    channel: &Channel,
    names: &Names,
    limit: usize,
) -> Result<Vec<Quarantined>, BrokerError> {
    let mut out = Vec::new();
    while out.len() < limit {
        match next(channel, names).await? {
            Some((_, quarantined, _)) => out.push(quarantined),
            None => break,
        }
    }
    Ok(out)
}

/// Publishes up to `limit` quarantined messages back to the requests exchange, each recorded
/// in `quarantine_replays` and then acked off the quarantine queue; returns how many. Only as
/// many messages as the queue held when it started are taken: the queue is first in, first
/// out and quarantined-again replays join its tail, so those are the messages it held, each
/// taken once (two copies of one message, a producer's retry, are two messages).
pub async fn replay(
    channel: &Channel,
    publisher: &Publisher,
    names: &Names,
    store: &DenialStore,
    limit: usize,
) -> Result<usize, QuarantineError> {
    let held = broker::ready_count(channel, &names.quarantine).await? as usize;
    let mut replayed = 0;
    while replayed < limit.min(held) {
        let Some((tag, quarantined, properties)) = next(channel, names).await? else {
            break;
        };
        let headers: Vec<_> = broker::replay_header(&properties).into_iter().collect();
        let props = broker::json_properties(quarantined.message_id.as_deref(), &headers);
        let props = broker::carry(&properties, props);
        publisher
            .publish(&names.requests, "", quarantined.body.as_bytes(), props)
            .await?;
        store
            .record_quarantine_replay(
                quarantined.message_id.as_deref(),
                quarantined.reason.as_deref().unwrap_or(""),
            )
            .await?;
        timed(
            "basic.ack",
            channel.basic_ack(tag, BasicAckOptions::default()),
        )
        .await?;
        replayed += 1;
    }
    Ok(replayed)
}
