//! The commands that talk to the broker's queues: `publish` (send requests from a file),
//! `tail` (what the worker dispatches) and `quarantine` (list and replay what was refused for
//! good).

use std::io::{BufRead, Write};
use std::path::PathBuf;

use futures_util::{StreamExt, TryStreamExt};

use super::{connect_store, open_publisher, service, shutdown_signal, CliError, QuarantineAction};
use crate::base::config::Settings;
use crate::intake::broker::{self, Names};
use crate::intake::shards;
use crate::request::message::SendRequest;

/// Publishes in flight at once when `publish` sends a file: enough to hide the confirm round
/// trip, few enough to keep memory flat.
const PUBLISH_IN_FLIGHT: usize = 256;

/// `publish`: every line of `file` (standard input for none or `-`) validated first, then
/// published with confirms, [`PUBLISH_IN_FLIGHT`] at a time.
pub(super) async fn publish(settings: &Settings, file: Option<PathBuf>) -> Result<(), CliError> {
    let reader: Box<dyn BufRead> = match file.as_deref() {
        None => Box::new(std::io::stdin().lock()),
        Some(p) if p.as_os_str() == "-" => Box::new(std::io::stdin().lock()),
        Some(p) => Box::new(std::io::BufReader::new(std::fs::File::open(p).map_err(
            |e| CliError::Input(format!("cannot read {}: {e}", p.display())),
        )?)),
    };
    // Validate everything first: a bad line publishes nothing, so a corrected file can simply
    // be published again.
    let mut requests = Vec::new();
    for (index, line) in reader.lines().enumerate() {
        let line = line.map_err(|e| CliError::Input(format!("line {}: {e}", index + 1)))?;
        if line.trim().is_empty() {
            continue;
        }
        let request = SendRequest::decode(line.as_bytes(), settings.worker.max_body_bytes)
            .map_err(|e| CliError::Input(format!("line {}: {e}", index + 1)))?;
        requests.push((request.id, request.recipient, line));
    }
    let names = Names::of_settings(settings);
    let (connection, publisher) = open_publisher(settings, &names, "sendquota-publish").await?;
    let total = requests.len();
    let mut sent = 0usize;
    let mut confirms = futures_util::stream::iter(requests.iter())
        .map(|(id, recipient, line)| {
            // The header the shards hash (docs/producers.md), set as every producer should.
            let header = [(shards::RECIPIENT_HEADER, recipient.clone())];
            let props = broker::json_properties(Some(id), &header);
            publisher.publish(&names.requests, "", line.as_bytes(), props)
        })
        .buffer_unordered(PUBLISH_IN_FLIGHT);
    let progress_every = (total / 20).max(10_000);
    while let Some(()) = confirms
        .try_next()
        .await
        .map_err(|e| service("rabbitmq")(&e))?
    {
        sent += 1;
        if sent.is_multiple_of(progress_every) {
            eprintln!("published {sent}/{total}");
        }
    }
    drop(confirms);
    let _ = connection.close(200, "done".into()).await;
    println!("published {sent} messages to {}", names.requests);
    Ok(())
}

/// Prints what is dispatched with `routing_key` until SIGINT or SIGTERM (exit 0); the line on
/// standard error says where it listens, so standard output holds only the JSON lines.
pub(super) async fn tail(settings: &Settings, routing_key: &str) -> Result<(), CliError> {
    let names = Names::of_settings(settings);
    let rabbitmq = |e: &dyn std::fmt::Display| service("rabbitmq")(e);
    let connection = broker::connect(&settings.amqp, "sendquota-tail")
        .await
        .map_err(|e| rabbitmq(&e))?;
    let tailed = async {
        let channel = broker::timed("channel.open", connection.create_channel()).await?;
        let (queue, consumer) = crate::ops::tail::bind(&channel, &names, routing_key).await?;
        eprintln!(
            "tailing {} (routing key {routing_key}) through temporary queue {queue}; \
             Ctrl-C to stop",
            names.dispatch
        );
        let mut out = std::io::stdout().lock();
        crate::ops::tail::print(consumer, &mut out, shutdown_signal()).await
    }
    .await;
    let _ = connection.close(200, "done".into()).await;
    tailed.map_err(|e| match e {
        crate::ops::tail::TailError::Broker(e) => rabbitmq(&e),
        output => CliError::Service(output.to_string()),
    })
}

/// `quarantine list` and `quarantine replay`.
pub(super) async fn quarantine(
    settings: &Settings,
    action: QuarantineAction,
) -> Result<(), CliError> {
    let names = Names::of_settings(settings);
    match action {
        QuarantineAction::List { limit } => {
            let listed = crate::ops::quarantine::list_held(&settings.amqp, &names, ROLE, limit)
                .await
                .map_err(|e| service("rabbitmq")(&e))?;
            let mut out = std::io::stdout().lock();
            for q in listed {
                let line = serde_json::to_string(&q).map_err(|e| service("rabbitmq")(&e))?;
                writeln!(out, "{line}")
                    .map_err(|e| CliError::Service(format!("writing output: {e}")))?;
            }
            Ok(())
        }
        QuarantineAction::Replay { limit } => {
            let store = connect_store(settings).await?;
            let which = crate::ops::quarantine::Which::All { limit };
            let replayed = crate::ops::quarantine::replay_held(
                &settings.amqp,
                &names,
                &store,
                &which,
                crate::ops::quarantine::CLI_ACTOR,
                ROLE,
            )
            .await
            .map_err(|e| CliError::Service(e.to_string()))?;
            println!(
                "replayed {replayed} quarantined messages to {}",
                names.requests
            );
            Ok(())
        }
    }
}

/// The connection name of the quarantine commands.
const ROLE: &str = "sendquota-quarantine";
