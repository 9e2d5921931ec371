//! The worker: owns deliveries, concurrency, retries and acks; the decision is the pipeline's.
//!
//! It supervises its broker session itself: when the connection or consumer is lost it
//! reconnects with capped, jittered backoff, declares its topology again and resumes. Messages
//! in flight on the lost channel cannot be acked any more; the broker redelivers them, which is
//! safe because every step is idempotent by message id.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::{watch, Semaphore};
use tracing::{debug, error, info, warn};

use crate::acks::Settler;
use crate::admin::{self, AdminState, Health};
use crate::failpoint::{self, Failpoint};
use lapin::message::Delivery;
use lapin::options::{BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection};

use crate::broker::{self, BrokerError, Names, Publisher};
use crate::claim::Claim;
use crate::clock::Clock;
use crate::config::Settings;
use crate::dedup::DispatchMarks;
use crate::denials::{DenialError, DenialStore, DenialWriter};
use crate::deny_cache::{self, DenyCache};
use crate::limiter::Limiter;
use crate::outcome::{self, Failure, Handled, Next};
use crate::pipeline::{Pipeline, Poison};
use crate::store::RedisConn;
use crate::telemetry;

/// How often buffered histogram samples are folded into their buckets.
const METRICS_UPKEEP: Duration = Duration::from_secs(5);

/// Skew between the worker's clock and Redis `TIME` above which a warning is logged.
const SKEW_WARNING_MS: i64 = 1_000;

/// Failures that stop the worker.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// Redis could not be reached at start-up.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// Redis could not be reached at start-up (with a hint when a plaintext URL met what
    /// looks like a TLS-only server).
    #[error("redis: {0}")]
    RedisStart(String),
    /// Redis is too old for the decision scripts, or its version could not be read.
    #[error(transparent)]
    RedisVersion(#[from] crate::store::VersionError),
    /// Postgres could not be reached at start-up.
    #[error(transparent)]
    Denials(#[from] DenialError),
    /// RabbitMQ could not be reached at start-up.
    #[error("{0}")]
    Broker(String),
    /// The admin API could not listen.
    #[error("admin API: {0}")]
    Admin(std::io::Error),
}

/// Runs the worker until `shutdown` completes, then drains in-flight messages.
pub async fn run(
    settings: &Settings,
    clock: Arc<dyn Clock>,
    failpoint: Option<Failpoint>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), WorkerError> {
    telemetry::prometheus();
    metrics::gauge!(telemetry::RUNTIME_WORKER_THREADS)
        .set(tokio::runtime::Handle::current().metrics().num_workers() as f64);
    let redis = RedisConn::connect(&settings.redis).await.map_err(|e| {
        let plain = settings.redis.url.starts_with("redis://")
            && settings
                .redis
                .cluster_urls
                .iter()
                .all(|u| u.starts_with("redis://"));
        WorkerError::RedisStart(format!(
            "{e}{}",
            tls_hint(plain, &e.to_string(), "rediss://")
        ))
    })?;
    match crate::store::check_version(&redis).await? {
        Some(version) => info!(%version, "redis version checked"),
        None => warn!("redis does not report its version; the scripts need Redis 7.0 or later"),
    }
    let denials = DenialStore::connect(&settings.database).await?;
    report_skew(&redis, clock.as_ref()).await;
    let policy = Arc::new(settings.policy.clone());
    let health = Arc::new(Health::default());
    let (stop_tx, stop) = watch::channel(false);
    let mut limiter = Limiter::new(redis.clone(), &settings.namespace);
    if settings.worker.deny_cache && settings.redis.cluster_urls.is_empty() {
        let cache = Arc::new(DenyCache::new());
        tokio::spawn(deny_cache::listen(
            settings.redis.clone(),
            deny_cache::channel(&settings.namespace),
            cache.clone(),
            stop.clone(),
        ));
        limiter = limiter.with_deny_cache(cache);
    }
    if !settings.admin.listen.is_empty() {
        let listener = tokio::net::TcpListener::bind(&settings.admin.listen)
            .await
            .map_err(WorkerError::Admin)?;
        info!(address = %listener.local_addr().map_err(WorkerError::Admin)?, "admin API listening");
        let state = AdminState {
            policy: policy.clone(),
            limiter: limiter.clone(),
            denials: denials.clone(),
            clock: clock.clone(),
            health: health.clone(),
            tokens: Arc::new(settings.admin.tokens.clone()),
        };
        let mut admin_stop = stop.clone();
        tokio::spawn(async move {
            let stopped = async move {
                let _ = admin_stop.wait_for(|s| *s).await;
            };
            if let Err(e) = admin::serve(listener, state, stopped).await {
                error!(error = %e, "admin API stopped");
            }
        });
    }
    let pipeline = Arc::new(Pipeline {
        policy,
        limiter,
        marks: DispatchMarks::new(redis, &settings.namespace, settings.worker.dedup_ttl_secs),
        denials: DenialWriter::spawn(
            denials,
            settings.worker.denial_batch_size,
            Duration::from_millis(settings.worker.denial_batch_wait_ms),
        ),
        clock,
        names: Names::new(&settings.namespace),
        max_body_bytes: settings.worker.max_body_bytes,
        claim_lease_ms: settings.worker.claim_lease_ms,
        failpoint,
        metrics: telemetry::MessageMetrics::register(
            settings.policy.rules.iter().map(|r| r.name.as_str()),
        ),
    });
    // Histogram samples wait in the recorder until drained; without upkeep they would grow
    // with every message between scrapes.
    let mut upkeep_stop = stop.clone();
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = tokio::time::sleep(METRICS_UPKEEP) => telemetry::prometheus().run_upkeep(),
                _ = upkeep_stop.wait_for(|s| *s) => return,
            }
        }
    });
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    });
    let mut backoff = Backoff::new(&settings.worker);
    let mut stall = failpoint::armed(failpoint, Failpoint::StallConsumerOnce);
    let mut started = false;
    loop {
        let ended = session(
            settings,
            &pipeline,
            &health,
            std::mem::take(&mut stall),
            stop.clone(),
        )
        .await;
        started |= health.consuming();
        health.set_consuming(false);
        if let (Err(e), false) = (&ended, started) {
            // Unreachable at start: fail like Redis and Postgres do, so the orchestrator sees it.
            let plain = settings.amqp.url.starts_with("amqp://");
            let message = e.to_string();
            let hint = tls_hint(plain, &message, "amqps://");
            return Err(WorkerError::Broker(format!("{message}{hint}")));
        }
        match ended {
            Ok(()) => return Ok(()),
            Err(e) => {
                let wait = backoff.next();
                error!(error = %e, retry_in_ms = wait.as_millis() as u64, "broker session lost");
                if sleep_or_stop(wait, &stop).await {
                    return Ok(());
                }
            }
        }
    }
}

/// How often the session checks that its channels are still open: lapin reports a channel
/// the broker closed (a publish to a deleted exchange, say) only to the next call on it.
const CHANNEL_CHECK: Duration = Duration::from_secs(1);

/// One broker session's life: connect, declare, consume, process; ends on shutdown (Ok) or
/// loss. Deliveries arrive on one connection and outcomes are published on another, as
/// RabbitMQ advises: a resource alarm blocks publishing connections, and acks must not wait
/// behind it. While the publishing connection is blocked no new delivery is taken.
async fn session(
    settings: &Settings,
    pipeline: &Arc<Pipeline>,
    health: &Health,
    stall: bool,
    mut stop: watch::Receiver<bool>,
) -> Result<(), BrokerError> {
    let consuming = broker::connect(&settings.amqp, "sendquota-worker-consume").await?;
    let publishing = match broker::connect(&settings.amqp, "sendquota-worker-publish").await {
        Ok(c) => c,
        Err(e) => {
            close(&consuming).await;
            return Err(e);
        }
    };
    let result = consume(
        settings,
        pipeline,
        health,
        stall,
        &mut stop,
        &consuming,
        &publishing,
    )
    .await;
    health.set_blocked(None);
    close(&consuming).await;
    close(&publishing).await;
    result
}

async fn close(connection: &Connection) {
    let _ = tokio::time::timeout(
        broker::BROKER_TIMEOUT,
        connection.close(200, "worker stopping".into()),
    )
    .await;
}

async fn consume(
    settings: &Settings,
    pipeline: &Arc<Pipeline>,
    health: &Health,
    stall: bool,
    stop: &mut watch::Receiver<bool>,
    consuming: &Connection,
    publishing: &Connection,
) -> Result<(), BrokerError> {
    let publisher = Publisher::open(publishing).await?;
    let channel = broker::timed("channel.open", consuming.create_channel()).await?;
    broker::declare(&channel, &pipeline.names, settings.amqp.queue_type).await?;
    broker::timed(
        "basic.qos",
        channel.basic_qos(settings.amqp.prefetch, BasicQosOptions::default()),
    )
    .await?;
    let mut consumer = broker::timed(
        "basic.consume",
        channel.basic_consume(
            broker::short(&pipeline.names.requests)?,
            "sendquota-worker".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        ),
    )
    .await?;
    info!(queue = %pipeline.names.requests, "consuming");
    health.set_consuming(true);
    let mut blocked = publisher.blocked().clone();
    health.set_blocked(blocked.borrow_and_update().clone());
    let slots = Arc::new(Semaphore::new(settings.worker.concurrency));
    let (settler, settling) = Settler::spawn(channel.clone());
    let mut watchdog =
        tokio::time::interval(Duration::from_millis(settings.worker.watchdog_interval_ms));
    watchdog.tick().await;
    let mut channel_check = tokio::time::interval(CHANNEL_CHECK);
    let mut delivered = false;
    let result = loop {
        let paused = blocked.borrow().is_some();
        tokio::select! {
            _ = stop.changed() => break Ok(()),
            _ = blocked.changed() => health.set_blocked(blocked.borrow_and_update().clone()),
            _ = channel_check.tick() => {
                if !channel.status().connected() {
                    break Err(BrokerError::ChannelClosed("consuming"));
                }
                if !publisher.channel().status().connected() {
                    break Err(BrokerError::ChannelClosed("publishing"));
                }
            }
            _ = watchdog.tick() => {
                // Idle is fine when the queue is empty, every slot is busy or the broker
                // blocks publishing; idle with free slots and ready messages means the
                // consumer stopped without telling us. (A stalled consumer holding all waiting
                // messages within its prefetch shows no ready ones; its backlog is noticed as
                // soon as more arrive.)
                if !delivered && !paused && slots.available_permits() > 0 {
                    let ready = match broker::ready_count(&channel, &pipeline.names.requests).await {
                        Ok(ready) => ready,
                        Err(e) => break Err(e),
                    };
                    if ready > 0 {
                        break Err(BrokerError::Stalled { ready });
                    }
                }
                delivered = false;
            }
            next = consumer.next(), if !stall && !paused => match next {
                Some(Ok(delivery)) => {
                    delivered = true;
                    if delivery.redelivered {
                        metrics::counter!(telemetry::REDELIVERIES).increment(1);
                    }
                    let Ok(slot) = slots.clone().acquire_owned().await else { break Ok(()) };
                    let task = Task {
                        pipeline: pipeline.clone(),
                        publisher: publisher.clone(),
                        consuming: channel.clone(),
                        settler: settler.clone(),
                        backoff: Backoff::new(&settings.worker),
                        yield_slot_after: Duration::from_millis(settings.worker.yield_slot_after_ms),
                        stop: stop.clone(),
                    };
                    tokio::spawn(async move {
                        task.process(delivery).await;
                        drop(slot);
                    });
                }
                Some(Err(e)) => break Err(e.into()),
                None => break Err(BrokerError::ConsumerEnded),
            },
        }
    };
    drop(consumer);
    if result.is_err() {
        // The session is lost: publishes still waiting on it will not be confirmed.
        publisher.end();
    }
    let drained = tokio::time::timeout(
        Duration::from_millis(settings.worker.shutdown_timeout_ms),
        slots.acquire_many(settings.worker.concurrency as u32),
    )
    .await;
    if drained.is_err() {
        warn!("in-flight messages did not finish in time; they return to the queue unacked");
    }
    settler.finish();
    if tokio::time::timeout(broker::BROKER_TIMEOUT, settling)
        .await
        .is_err()
    {
        warn!("acks still owed could not be sent in time; the broker redelivers");
    }
    result
}

/// One delivery being processed, with what it needs to retry.
struct Task {
    pipeline: Arc<Pipeline>,
    publisher: Publisher,
    /// The channel the delivery came on: it can only be acked there.
    consuming: Channel,
    settler: Settler,
    backoff: Backoff,
    /// How long the delivery may keep failing before it yields its slot.
    yield_slot_after: Duration,
    stop: watch::Receiver<bool>,
}

impl Task {
    /// Whether retrying is pointless: a lost channel can neither publish nor ack, and the
    /// broker redelivers the message on the next session.
    fn channels_lost(&self) -> bool {
        !self.consuming.status().connected() || !self.publisher.channel().status().connected()
    }

    /// Handles the delivery until its outcome is durable, then hands it to the settler to be
    /// acked. Retries on service failures; gives up (the message goes back to the queue) when
    /// the channel is gone or the worker is stopping.
    async fn process(mut self, delivery: Delivery) {
        let claim = Claim::new(self.pipeline.claim_lease_ms);
        let mut attempts = 0u32;
        let mut refused_in_a_row = 0u32;
        let mut first_error: Option<String> = None;
        let mut failing_since: Option<std::time::Instant> = None;
        loop {
            attempts += 1;
            // Boxed: the decision's state machine is kilobytes, and a task's future is moved
            // whole when it is spawned and when it completes.
            let handled = Box::pin(self.pipeline.handle(
                &self.publisher,
                &delivery.data,
                &delivery.properties,
                &claim,
            ))
            .await;
            match handled {
                Ok(handled) => {
                    log_handled(&delivery, &handled);
                    self.settler.ack(delivery.delivery_tag);
                    return;
                }
                Err(e) => {
                    let error = e.to_string();
                    first_error.get_or_insert_with(|| error.clone());
                    refused_in_a_row = match e.failure() {
                        Failure::Refused => refused_in_a_row + 1,
                        Failure::Transient => 0,
                    };
                    if outcome::after_failure(refused_in_a_row) == Next::Quarantine {
                        let poison = Poison {
                            reason: error.clone(),
                            attempts,
                            first_error: first_error.clone().unwrap_or_default(),
                        };
                        let quarantined = self
                            .pipeline
                            .quarantine(
                                &self.publisher,
                                &delivery.data,
                                &delivery.properties,
                                &claim,
                                &poison,
                            )
                            .await;
                        match quarantined {
                            Ok(()) => {
                                self.settler.ack(delivery.delivery_tag);
                                return;
                            }
                            Err(q) => warn!(error = %q, "message not quarantined; retrying"),
                        }
                    }
                    let wait = self.backoff.next();
                    let failing_for = failing_since.get_or_insert_with(std::time::Instant::now);
                    if failing_for.elapsed() >= self.yield_slot_after {
                        let yielded = self
                            .pipeline
                            .yield_slot(
                                &self.publisher,
                                &delivery.data,
                                &delivery.properties,
                                &claim,
                                wait,
                            )
                            .await;
                        match yielded {
                            Ok(()) => {
                                self.settler.ack(delivery.delivery_tag);
                                return;
                            }
                            Err(y) => warn!(error = %y, "message could not yield its slot"),
                        }
                    }
                    warn!(error = %error, retry_in_ms = wait.as_millis() as u64, "message not decided");
                    if self.channels_lost() || sleep_or_stop(wait, &self.stop).await {
                        // Given up without a dispatch: its copies need not wait out the lease.
                        self.pipeline.abandon(&delivery.data, &claim).await;
                        self.settler.requeue(delivery.delivery_tag);
                        return;
                    }
                }
            }
        }
    }
}

fn log_handled(delivery: &Delivery, handled: &Handled) {
    let id = delivery
        .properties
        .message_id()
        .as_ref()
        .map(|s| s.as_str());
    match handled {
        Handled::Invalid { reason } => warn!(message_id = ?id, %reason, "invalid message"),
        other => {
            debug!(message_id = ?id, outcome = ?other, redelivered = delivery.redelivered, "handled")
        }
    }
}

/// A hint for a start-up failure of a plaintext URL that reads like a TLS-only server's
/// answer: it resets the connection, or sends a TLS alert the client cannot parse.
fn tls_hint(plain: bool, error: &str, scheme: &str) -> String {
    let tls_like = [
        "reset by peer",
        "failed to parse",
        "unexpected end",
        "broken pipe",
    ]
    .iter()
    .any(|s| error.to_ascii_lowercase().contains(s));
    if plain && tls_like {
        format!(" (if the server accepts TLS only, use {scheme})")
    } else {
        String::new()
    }
}

/// Waits `wait`, or less if the worker is told to stop; returns whether it is stopping.
async fn sleep_or_stop(wait: Duration, stop: &watch::Receiver<bool>) -> bool {
    let mut stop = stop.clone();
    if *stop.borrow() {
        return true;
    }
    tokio::select! {
        _ = tokio::time::sleep(wait) => *stop.borrow(),
        _ = stop.changed() => true,
    }
}

/// Capped exponential backoff with jitter, so many workers do not retry in lockstep.
struct Backoff {
    next_ms: u64,
    max_ms: u64,
}

impl Backoff {
    fn new(worker: &crate::config::WorkerSettings) -> Backoff {
        Backoff {
            next_ms: worker.retry_initial_ms,
            max_ms: worker.retry_max_ms,
        }
    }

    fn next(&mut self) -> Duration {
        let base = self.next_ms;
        self.next_ms = (self.next_ms * 2).min(self.max_ms);
        // Jitter up to a quarter of the delay, from the clock's low bits: no need for a RNG.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| u64::from(d.subsec_nanos()))
            .unwrap_or(0);
        Duration::from_millis(base + nanos % (base / 4 + 1))
    }
}

/// Logs how far the worker's clock is from Redis `TIME`.
async fn report_skew(redis: &RedisConn, clock: &dyn Clock) {
    let reply: redis::RedisResult<(i64, i64)> =
        redis::cmd("TIME").query_async(&mut redis.clone()).await;
    match reply {
        Ok((secs, micros)) => {
            let skew = clock.now().timestamp_millis() - (secs * 1000 + micros / 1000);
            metrics::gauge!(telemetry::CLOCK_SKEW_MS).set(skew as f64);
            if skew.abs() > SKEW_WARNING_MS {
                warn!(skew_ms = skew, "worker clock differs from Redis TIME");
            } else {
                info!(skew_ms = skew, "worker clock checked against Redis TIME");
            }
        }
        Err(e) => warn!(error = %e, "could not read Redis TIME"),
    }
}
