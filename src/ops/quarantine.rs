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

use std::time::Duration;

use lapin::options::{BasicAckOptions, BasicGetOptions};
use lapin::{Channel, Connection};
use serde::Serialize;

use crate::base::config::AmqpSettings;
use crate::intake::broker::{self, timed, BrokerError, Names};
use crate::intake::publisher::{self, Publisher};
use crate::record::denials::{DenialError, DenialStore};

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
/// on `channel`, which the caller gives back with [`give_back`].
async fn list(
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

/// The actor `sendquota quarantine replay` records in `quarantine_replays` (the console records
/// the admin token's name).
pub const CLI_ACTOR: &str = "cli";

/// Which quarantined messages a replay takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Which {
    /// The oldest, up to `limit` of them.
    All {
        /// At most this many.
        limit: usize,
    },
    /// The message with this `message_id` (its first copy, should the queue hold two): the
    /// messages before it are looked at and given back, in their places.
    One {
        /// Its `message_id` property.
        message_id: String,
    },
}

/// Publishes the quarantined messages `which` names back to the requests exchange, each
/// recorded in `quarantine_replays` (with `actor`) and then acked off the quarantine queue;
/// returns how many, and how many of the messages the queue held it left there. Only as many
/// messages as the queue held when it started are looked at: the queue is first in, first out
/// and quarantined-again replays join its tail, so those are the messages it held, each taken
/// once (two copies of one message, a producer's retry, are two messages). Messages looked at
/// but not replayed stay unacked on `channel`, which the caller gives back with [`give_back`].
async fn replay(
    channel: &Channel,
    publisher: &Publisher,
    names: &Names,
    store: &DenialStore,
    which: &Which,
    actor: &str,
) -> Result<(usize, u32), QuarantineError> {
    let held = broker::ready_count(channel, &names.quarantine).await? as usize;
    let wanted = match which {
        Which::All { limit } => (*limit).min(held),
        Which::One { .. } => 1,
    };
    let (mut replayed, mut looked_at) = (0, 0);
    while replayed < wanted && looked_at < held {
        let Some((tag, quarantined, properties)) = next(channel, names).await? else {
            break;
        };
        looked_at += 1;
        if let Which::One { message_id } = which {
            if quarantined.message_id.as_deref() != Some(message_id.as_str()) {
                continue;
            }
        }
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
                actor,
            )
            .await?;
        timed(
            "basic.ack",
            channel.basic_ack(tag, BasicAckOptions::default()),
        )
        .await?;
        replayed += 1;
    }
    Ok((replayed, (held - replayed) as u32))
}

/// How long [`give_back`] waits for the messages to be ready again.
const GIVE_BACK_WAIT: Duration = Duration::from_secs(2);

/// Closes `channel`, which gives back the messages taken unacked on it, and waits (on a new
/// channel of `connection`) until the quarantine queue holds `expected` ready messages again.
/// The broker answers the close before it has requeued them, so without the wait a count right
/// after the command (an operator's, or the next listing's) could miss them. The wait is a
/// best effort: messages quarantined meanwhile count too, and it gives up after
/// [`GIVE_BACK_WAIT`] (another client taking messages meanwhile leaves fewer); the messages
/// come back either way. A broker failure here is logged, not returned: what the command did
/// (messages replayed, recorded and acked) stands, and closing the connection gives the
/// messages back as well.
async fn give_back(connection: &Connection, channel: Channel, names: &Names, expected: u32) {
    let waited = async {
        timed("channel.close", channel.close(200, "done".into())).await?;
        let waiting = timed("channel.open", connection.create_channel()).await?;
        let until = tokio::time::Instant::now() + GIVE_BACK_WAIT;
        while broker::ready_count(&waiting, &names.quarantine).await? < expected
            && tokio::time::Instant::now() < until
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Ok::<_, BrokerError>(())
    };
    if let Err(e) = waited.await {
        tracing::warn!(error = %e, "quarantined messages given back without waiting for them");
    }
}

/// The oldest `limit` quarantined messages, read on a connection of its own (named `role`) and
/// given back before it is closed: what the `quarantine list` command and the console show.
pub async fn list_held(
    settings: &AmqpSettings,
    names: &Names,
    role: &str,
    limit: usize,
) -> Result<Vec<Quarantined>, BrokerError> {
    let connection = broker::connect(settings, role).await?;
    let listed = async {
        let channel = timed("channel.open", connection.create_channel()).await?;
        let held = broker::ready_count(&channel, &names.quarantine).await?;
        let listed = list(&channel, names, limit).await?;
        give_back(&connection, channel, names, held).await;
        Ok(listed)
    }
    .await;
    // Closing the connection gives the listed messages back to the queue if they were not.
    let _ = connection.close(200, "done".into()).await;
    listed
}

/// Replays the quarantined messages `which` names (see `replay`) on a connection of its own
/// (named `role`), closed afterwards: what the `quarantine replay` command and the console do.
pub async fn replay_held(
    settings: &AmqpSettings,
    names: &Names,
    store: &DenialStore,
    which: &Which,
    actor: &str,
    role: &str,
) -> Result<usize, QuarantineError> {
    let (connection, publisher) = publisher::open_publisher(settings, names, role).await?;
    let replayed = async {
        let channel = timed("channel.open", connection.create_channel()).await?;
        let (replayed, left) = replay(&channel, &publisher, names, store, which, actor).await?;
        give_back(&connection, channel, names, left).await;
        Ok(replayed)
    }
    .await;
    let _ = connection.close(200, "done".into()).await;
    replayed
}
