//! Building the worker application and running it until stopped: the connections (Redis,
//! Postgres; the broker's are the worker's sessions), the checks made once at start (Redis's
//! version, the clock against Redis), the deny cache and its subscription, the running rules
//! and their reloads (SIGHUP, the admin API), the admin API, the metrics upkeep, then the
//! worker's sessions until shutdown.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tracing::{error, info, warn};

use crate::act::digest::Flusher;
use crate::act::held::Held;
use crate::act::pipeline::Pipeline;
use crate::act::steps::Steps;
use crate::base::clock::Clock;
use crate::base::config::Settings;
use crate::base::failpoint::Failpoint;
use crate::base::health::Health;
use crate::base::store::RedisConn;
use crate::base::telemetry;
use crate::base::traces::Traces;
use crate::decide::dedup::DispatchMarks;
use crate::decide::deny_cache::{self, DenyCache};
use crate::decide::limiter::Limiter;
use crate::intake::broker::Names;
use crate::intake::worker;
use crate::ops::admin::{self, AdminState};
use crate::ops::console::Console;
use crate::ops::service::Ops;
use crate::record::denials::{DenialError, DenialStore, DenialWriter, Reads};
use crate::record::rollup::{DecisionCounts, RollupWriter};
use crate::rules::reload::{self, LiveRules, Reloader, Rules};

/// How often buffered histogram samples are folded into their buckets.
const METRICS_UPKEEP: Duration = Duration::from_secs(5);

/// How long a stopping worker waits for the decision rollup's last write: one upsert, which
/// Postgres answers in milliseconds; a Postgres that is away must not hold the exit.
const ROLLUP_LAST_FLUSH: Duration = Duration::from_secs(5);

/// Skew between the worker's clock and Redis `TIME` above which a warning is logged.
const SKEW_WARNING_MS: i64 = 1_000;

/// How often the skew is measured again after start: one `TIME` a minute is nothing to Redis,
/// and clocks drift over hours, not seconds.
const SKEW_CHECK: Duration = Duration::from_secs(60);

/// Failures that stop the worker: each service unreachable at start, so an orchestrator sees
/// the worker fail instead of idling.
#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    /// Redis could not be reached at start-up (with a hint when a plaintext URL met what
    /// looks like a TLS-only server).
    #[error("redis: {0}")]
    Redis(String),
    /// Redis is too old for the decision scripts, or its version could not be read.
    #[error(transparent)]
    RedisVersion(#[from] crate::base::store::VersionError),
    /// Postgres could not be reached at start-up.
    #[error(transparent)]
    Denials(#[from] DenialError),
    /// The read replica's URL (`database.read_url`) could not be used.
    #[error(transparent)]
    Reads(#[from] crate::record::denials::ReadError),
    /// RabbitMQ could not be reached at start-up.
    #[error("{0}")]
    Broker(String),
    /// The admin API could not listen.
    #[error("admin API: {0}")]
    Admin(std::io::Error),
    /// The worker's clock reads an instant outside the supported range: every decision would
    /// be made at a wrong instant.
    #[error("the worker's clock: {0}")]
    Clock(#[from] crate::base::clock::OutOfRange),
    /// Span export was configured but could not start.
    #[error(transparent)]
    Traces(#[from] crate::base::traces::TracesError),
}

/// Runs the worker until `shutdown` completes, then drains in-flight messages.
pub async fn run(
    settings: &Settings,
    clock: Arc<dyn Clock>,
    failpoint: Option<Failpoint>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), StartupError> {
    crate::base::clock::in_range(clock.now())?;
    let hangups = reload::hangups();
    start_metrics();
    let redis = connect_redis(settings).await?;
    let denials = DenialStore::connect(&settings.database).await?;
    report_skew(&redis, clock.as_ref()).await;
    let health = Arc::new(Health::default());
    let (stop_tx, stop) = watch::channel(false);
    let limiter = limiter(settings, &redis, &stop).with_failpoint(failpoint);
    let rules = LiveRules::new(Rules::new(settings.policy.clone()));
    let reloader = reloader(settings, &rules, &denials, &limiter, hangups, &stop);
    let (redis_for_skew, clock_for_skew) = (redis.clone(), clock.clone());
    if !settings.admin.listen.is_empty() {
        let ops = Ops {
            reloader,
            limiter: limiter.clone(),
            denials: denials.clone(),
            reads: Reads::beside(&denials, &settings.database)?,
            clock: clock.clone(),
            health: health.clone(),
            tokens: Arc::new(settings.admin.tokens.clone()),
        };
        serve_admin(settings, ops, stop.clone()).await?;
    }
    let names = Names::of_settings(settings);
    let traces = start_traces(settings, &names)?;
    let rollup = Rollup::start(&denials, &clock);
    let steps = steps(settings, redis, denials, names, failpoint, &rules);
    let digests = digests(settings, &steps, &limiter, &rules, &clock);
    let pipeline = Arc::new(Pipeline {
        rules,
        limiter,
        steps,
        digests,
        clock,
        max_body_bytes: settings.worker.max_body_bytes,
        claim_lease_ms: settings.worker.claim_lease_ms,
        failpoint,
        traces,
        rollup: rollup.counts.clone(),
    });
    keep_metrics_up(stop.clone());
    keep_checking_skew(redis_for_skew, clock_for_skew, stop.clone());
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    });
    let supervised = worker::supervise(settings, &pipeline, &health, failpoint, stop).await;
    rollup.stop().await;
    // The deliveries have drained: their spans have ended and the last batch can go.
    if let Some(traces) = &pipeline.traces {
        traces.shutdown().await;
    }
    supervised.map_err(|e| broker_error(settings, e))
}

/// The Prometheus recorder, installed before any metric is touched, and the runtime's thread
/// count on it.
fn start_metrics() {
    telemetry::prometheus();
    metrics::gauge!(telemetry::RUNTIME_WORKER_THREADS)
        .set(tokio::runtime::Handle::current().metrics().num_workers() as f64);
}

/// The running rules' reloader, reloading on each SIGHUP in `hangups` until `stop`.
fn reloader(
    settings: &Settings,
    rules: &LiveRules,
    denials: &DenialStore,
    limiter: &Limiter,
    hangups: Option<tokio::signal::unix::Signal>,
    stop: &watch::Receiver<bool>,
) -> Arc<Reloader> {
    let reloader = Arc::new(Reloader::new(
        rules.clone(),
        settings,
        denials.clone(),
        limiter.deny_cache().cloned(),
    ));
    tokio::spawn(reload::reload_on_hangup(
        hangups,
        reloader.clone(),
        stop.clone(),
    ));
    reloader
}

/// The decision rollup's counts and their writer. It is stopped after the worker's sessions
/// have drained, not with them: their last decisions are counted until then.
struct Rollup {
    counts: Arc<DecisionCounts>,
    stop: watch::Sender<bool>,
    written: tokio::task::JoinHandle<()>,
}

impl Rollup {
    /// Counts kept in memory, written to `denials`' database every second.
    fn start(denials: &DenialStore, clock: &Arc<dyn Clock>) -> Rollup {
        let counts = Arc::new(DecisionCounts::default());
        let (stop, stopped) = watch::channel(false);
        let written =
            RollupWriter::new(counts.clone(), denials.pool().clone(), clock.clone()).spawn(stopped);
        Rollup {
            counts,
            stop,
            written,
        }
    }

    /// Writes the last second's counts: the writer flushes once more when told to stop.
    async fn stop(self) {
        let _ = self.stop.send(true);
        if tokio::time::timeout(ROLLUP_LAST_FLUSH, self.written)
            .await
            .is_err()
        {
            warn!("the decision rollup's last counts were not written in time");
        }
    }
}

/// Span export, when the settings name an endpoint.
fn start_traces(settings: &Settings, names: &Names) -> Result<Option<Arc<Traces>>, StartupError> {
    let traces = Traces::start(&settings.telemetry, &names.requests)?.map(Arc::new);
    if traces.is_some() {
        info!(endpoint = %crate::base::config::redact_url(&settings.telemetry.otlp_endpoint),
            "exporting spans over OTLP/HTTP");
    }
    Ok(traces)
}

/// The steps outcomes take, on the worker's connections, with the running rules' metric
/// handles for the durations of dispatches and denial writes.
fn steps(
    settings: &Settings,
    redis: RedisConn,
    denials: DenialStore,
    names: Names,
    failpoint: Option<Failpoint>,
    rules: &LiveRules,
) -> Arc<Steps> {
    let current = rules.current();
    let held = Held::new(denials.pool().clone());
    Arc::new(Steps {
        marks: DispatchMarks::new(redis, &settings.namespace, settings.worker.dedup_ttl_secs)
            .batched(),
        denials: DenialWriter::spawn(
            denials,
            settings.worker.denial_batch_size,
            Duration::from_millis(settings.worker.denial_batch_wait_ms),
        ),
        held,
        names,
        failpoint,
        dispatch_seconds: current.metrics.dispatch_seconds.clone(),
        denial_write_seconds: current.metrics.denial_write_seconds.clone(),
    })
}

/// The digest flusher, through the same steps, limiter and rules as the pipeline.
fn digests(
    settings: &Settings,
    steps: &Arc<Steps>,
    limiter: &Limiter,
    rules: &LiveRules,
    clock: &Arc<dyn Clock>,
) -> Arc<Flusher> {
    Arc::new(Flusher {
        steps: steps.clone(),
        limiter: limiter.clone(),
        rules: rules.clone(),
        clock: clock.clone(),
        max_body_bytes: settings.worker.max_body_bytes,
        max_digest_bytes: settings.worker.max_digest_bytes,
        interval: Duration::from_millis(settings.worker.digest_flush_interval_ms),
    })
}

/// The worker's sessions' failure as the start-up error, with a hint when a plaintext URL met
/// what looks like a TLS-only broker.
fn broker_error(settings: &Settings, e: crate::intake::broker::BrokerError) -> StartupError {
    let plain = settings
        .amqp
        .broker_urls()
        .iter()
        .all(|u| u.starts_with("amqp://"));
    let message = e.to_string();
    let hint = tls_hint(plain, &message, "amqps://");
    StartupError::Broker(format!("{message}{hint}"))
}

/// The Redis connection, its version checked for the decision scripts.
async fn connect_redis(settings: &Settings) -> Result<RedisConn, StartupError> {
    let redis = RedisConn::connect(&settings.redis).await.map_err(|e| {
        let plain = settings.redis.url.starts_with("redis://")
            && settings
                .redis
                .cluster_urls
                .iter()
                .all(|u| u.starts_with("redis://"));
        StartupError::Redis(format!(
            "{e}{}",
            tls_hint(plain, &e.to_string(), "rediss://")
        ))
    })?;
    match crate::base::store::check_version(&redis).await? {
        Some(version) => info!(%version, "redis version checked"),
        None => warn!("redis does not report its version; the scripts need Redis 7.0 or later"),
    }
    Ok(redis)
}

/// The limiter, with a deny cache kept subscribed to its invalidations until `stop` when
/// the settings ask for one.
fn limiter(settings: &Settings, redis: &RedisConn, stop: &watch::Receiver<bool>) -> Limiter {
    let limiter = Limiter::new(redis.clone(), &settings.namespace);
    if !settings.worker.deny_cache {
        return limiter;
    }
    let cache = Arc::new(DenyCache::new());
    tokio::spawn(deny_cache::listen(
        settings.redis.clone(),
        crate::decide::keys::deny_cache_channel(&settings.namespace),
        cache.clone(),
        stop.clone(),
    ));
    limiter.with_deny_cache(cache)
}

/// Serves the admin API (the JSON API over `ops`, and the console) on the settings' address
/// until `stop`; fails only if it cannot listen.
async fn serve_admin(
    settings: &Settings,
    ops: Ops,
    mut stop: watch::Receiver<bool>,
) -> Result<(), StartupError> {
    let state = AdminState {
        ops,
        console: Arc::new(Console::new(
            settings.amqp.clone(),
            Names::of_settings(settings),
        )),
    };
    let listen = &settings.admin.listen;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(StartupError::Admin)?;
    info!(address = %listener.local_addr().map_err(StartupError::Admin)?, "admin API listening");
    tokio::spawn(async move {
        let stopped = async move {
            let _ = stop.wait_for(|s| *s).await;
        };
        if let Err(e) = admin::serve(listener, state, stopped).await {
            error!(error = %e, "admin API stopped");
        }
    });
    Ok(())
}

/// Folds buffered histogram samples into their buckets until `stop`: samples wait in the
/// recorder until drained, and without upkeep they would grow with every message between
/// scrapes.
fn keep_metrics_up(mut stop: watch::Receiver<bool>) {
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = tokio::time::sleep(METRICS_UPKEEP) => telemetry::prometheus().run_upkeep(),
                _ = stop.wait_for(|s| *s) => return,
            }
        }
    });
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

/// Logs how far the worker's clock is from Redis `TIME`.
async fn report_skew(redis: &RedisConn, clock: &dyn Clock) {
    match measure_skew(redis, clock).await {
        Ok(skew) if skew.abs() > SKEW_WARNING_MS => {
            warn!(skew_ms = skew, "worker clock differs from Redis TIME")
        }
        Ok(skew) => info!(skew_ms = skew, "worker clock checked against Redis TIME"),
        Err(e) => warn!(error = %e, "could not read Redis TIME"),
    }
}

/// The worker's clock minus Redis `TIME`, in milliseconds, also set as the skew gauge.
async fn measure_skew(redis: &RedisConn, clock: &dyn Clock) -> redis::RedisResult<i64> {
    let (secs, micros): (i64, i64) = redis::cmd("TIME").query_async(&mut redis.clone()).await?;
    let skew = clock.now().timestamp_millis() - (secs * 1000 + micros / 1000);
    metrics::gauge!(telemetry::CLOCK_SKEW_SECONDS).set(skew as f64 / 1000.0);
    Ok(skew)
}

/// Measures the skew again every [`SKEW_CHECK`] until `stop`, so the gauge (and the alert on
/// it) sees a clock that drifts after start. A failed read keeps the last value: Redis being
/// away is seen by readiness.
fn keep_checking_skew(redis: RedisConn, clock: Arc<dyn Clock>, mut stop: watch::Receiver<bool>) {
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = tokio::time::sleep(SKEW_CHECK) => {}
                _ = stop.wait_for(|s| *s) => return,
            }
            let _ = measure_skew(&redis, clock.as_ref()).await;
        }
    });
}
