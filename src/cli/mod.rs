//! The `sendquota` command line: argument parsing and the commands operators and scripts run.
//!
//! Exit codes are part of the interface scripts rely on: 0 the command did its job (a deny is a
//! successful decision), 2 bad input or bad config, 1 a service could not be reached or failed.
//!
//! This module holds the commands, their dispatch and the small ones; `denials.rs` the denial
//! history's (`denials`, `replay`, `prune`) and `queues.rs` those that talk to the broker's
//! queues (`publish`, `tail`, `quarantine`).

mod denials;
mod queues;

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use chrono::{DateTime, SecondsFormat, Utc};
use clap::{Parser, Subcommand, ValueEnum};

use crate::base::clock::{Clock, ManualClock, SystemClock};
use crate::base::config::{ConfigError, LogFormat, LogSettings, Settings};
use crate::base::failpoint;
use crate::base::store::RedisConn;
use crate::decide::limiter::Limiter;
use crate::intake::broker::Names;
use crate::intake::publisher::{self, Publisher};
use crate::record::denials::{DenialStore, Reads};
use crate::request::message::SendRequest;
use crate::startup;

pub use denials::{DenialArgs, FilterArgs, Format, ReplayArgs};

/// sendquota: enforce message-send quotas between producers and senders.
#[derive(Debug, Parser)]
#[command(name = "sendquota", version)]
pub struct Cli {
    /// Config file (TOML). Without one, the headline rule applies with default connections.
    #[arg(long, global = true, env = "SENDQUOTA_CONFIG")]
    pub config: Option<PathBuf>,
    /// The command to run.
    #[command(subcommand)]
    pub command: Command,
}

/// The commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Consume send requests and decide them until SIGTERM or SIGINT.
    Worker {
        /// Fix the clock at this instant (RFC3339), for simulations and tests.
        #[arg(long)]
        now: Option<String>,
    },
    /// Apply database migrations.
    Migrate,
    /// Publish send requests, one JSON object per line, from FILE or standard input.
    Publish {
        /// File of JSON lines; `-` or nothing for standard input.
        file: Option<PathBuf>,
    },
    /// Decide one message without dispatching it; consumes nothing unless --commit.
    Check {
        /// The send request, as JSON.
        #[arg(long)]
        message: String,
        /// Decide at this instant (RFC3339) instead of now.
        #[arg(long, alias = "now")]
        at: Option<String>,
        /// Consume the quota as a real decision would.
        #[arg(long)]
        commit: bool,
    },
    /// List recorded denials, newest first.
    Denials(DenialArgs),
    /// List the messages held by `digest` rules, one JSON line per group (recipient, rule,
    /// digest_by value), oldest first.
    Digests {
        /// Only this recipient's.
        #[arg(long)]
        recipient: Option<String>,
    },
    /// Publish denied messages again (each denial once, even with replays running at once).
    Replay(ReplayArgs),
    /// Drop the monthly denial partitions older than an age.
    Prune {
        /// Drop partitions whose whole month ended more than this long ago (e.g. 90d).
        #[arg(long)]
        older_than: String,
    },
    /// The quarantine queue: messages a service refused for good.
    Quarantine {
        /// What to do with it.
        #[command(subcommand)]
        action: QuarantineAction,
    },
    /// Print what the worker dispatches, one JSON object per line, until interrupted: through
    /// a temporary queue bound to the dispatch exchange, deleted when the command ends.
    Tail {
        /// Only this channel (a routing key of the dispatch exchange, `*` and `#` allowed);
        /// every channel without it.
        #[arg(long)]
        channel: Option<String>,
    },
    /// Print the JSON Schema of a send request: the producer's contract, with every field's
    /// limits (docs/producers.md shows producers validating against it).
    Schema,
    /// Configuration commands.
    Config {
        /// What to do with the configuration.
        #[command(subcommand)]
        action: ConfigAction,
    },
    /// The rules' live changes (SIGHUP or `POST /v1/rules/reload` on a worker).
    Rules {
        /// What to do.
        #[command(subcommand)]
        action: RulesAction,
    },
}

/// `rules` subcommands.
#[derive(Debug, Subcommand)]
pub enum RulesAction {
    /// Print the rule changes workers applied, newest first: when, by which token or signal,
    /// the old and new policy hashes, and what changed.
    History {
        /// At most this many.
        #[arg(long, default_value_t = 20)]
        limit: i64,
        /// Output format.
        #[arg(long, value_enum, default_value_t = HistoryFormat::Table)]
        format: HistoryFormat,
    },
}

/// Output formats of `rules history`.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum HistoryFormat {
    /// A line per change (hashes shortened to 12 digits), its difference indented below.
    Table,
    /// One JSON object per line, hashes whole, the difference as an array of lines.
    Json,
}

/// `quarantine` subcommands.
#[derive(Debug, Subcommand)]
pub enum QuarantineAction {
    /// Print the quarantined messages (one JSON object per line, oldest first) without
    /// removing them.
    List {
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: usize,
    },
    /// Publish quarantined messages back to the requests exchange (once their cause is fixed),
    /// each recorded in table `quarantine_replays`.
    Replay {
        /// At most this many.
        #[arg(long, default_value_t = 1000)]
        limit: usize,
    },
}

/// `config` subcommands.
#[derive(Debug, Subcommand)]
pub enum ConfigAction {
    /// Validate the configuration and print the effective settings and policy.
    Check,
}

/// A command's failure, carrying its exit code.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// Bad input: exit code 2.
    #[error("{0}")]
    Input(String),
    /// Bad configuration: exit code 2.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A service failed: exit code 1.
    #[error("{0}")]
    Service(String),
}

impl CliError {
    /// The process exit code for this failure.
    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::Input(_) | CliError::Config(_) => 2,
            CliError::Service(_) => 1,
        }
    }
}

fn service(what: &str) -> impl Fn(&dyn std::fmt::Display) -> CliError + '_ {
    move |e| {
        let message = e.to_string();
        if message.starts_with(&format!("{what}:")) {
            CliError::Service(message)
        } else {
            CliError::Service(format!("{what}: {message}"))
        }
    }
}

/// The `sendquota` command line: starts logging, runs the command, and on failure prints one
/// line on standard error and returns the failure's exit code.
pub fn main(cli: Cli) -> std::process::ExitCode {
    match start(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            let line = crate::request::message::one_line(&e.to_string());
            crate::base::telemetry::report_failure(&format!("sendquota: {line}"));
            std::process::ExitCode::from(e.exit_code())
        }
    }
}

/// Loads the configuration, starts logging as it says, builds the runtime the command runs on
/// (the worker's has `worker.threads` threads) and runs the command to completion.
pub fn start(cli: Cli) -> Result<(), CliError> {
    crate::base::tls::install_crypto_provider();
    let loaded = Settings::load(cli.config.as_deref(), |k| std::env::var(k).ok());
    // Refused settings are reported in the format the environment asks for, if it does.
    let log = match &loaded {
        Ok(settings) => settings.log.clone(),
        Err(_) => LogSettings {
            format: std::env::var("SENDQUOTA_LOG_FORMAT")
                .ok()
                .and_then(|name| LogFormat::parse(&name))
                .unwrap_or_default(),
            ..LogSettings::default()
        },
    };
    crate::base::telemetry::init_logging(&log);
    let settings = loaded?;
    let threads = match cli.command {
        Command::Worker { .. } => settings.worker.threads,
        _ => 0,
    };
    runtime(threads)
        .map_err(|e| CliError::Service(format!("tokio runtime: {e}")))?
        .block_on(run(cli, settings))
}

/// The tokio runtime for `threads`: the current-thread runtime for 1 (the worker's default;
/// docs/decisions.md says why not a multi-thread runtime of one worker), else a multi-thread
/// runtime with `threads` worker threads (0 = one per CPU, or as `TOKIO_WORKER_THREADS` says).
pub fn runtime(threads: usize) -> std::io::Result<tokio::runtime::Runtime> {
    let mut builder = if threads == 1 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut builder = tokio::runtime::Builder::new_multi_thread();
        if threads > 0 {
            builder.worker_threads(threads);
        }
        builder
    };
    builder.enable_all().build()
}

async fn run(cli: Cli, settings: Settings) -> Result<(), CliError> {
    // The one clock of every command but `worker`, which may fix it with `--now`.
    let system = SystemClock;
    let clock: &dyn Clock = &system;
    match cli.command {
        Command::Worker { now } => {
            let clock: Arc<dyn Clock> = match now {
                Some(at) => Arc::new(ManualClock::new(parse_instant("--now", &at)?)),
                None => Arc::new(SystemClock),
            };
            let failpoint = match std::env::var("SENDQUOTA_FAILPOINT").ok() {
                Some(value) => Some(failpoint::parse(&value).map_err(CliError::Input)?),
                None => None,
            };
            // A task, not the future `block_on` drives: on a multi-thread runtime (threads > 1)
            // it runs on a worker thread, and deliveries are handed to their tasks without
            // waking another thread for each one.
            let running = tokio::spawn(async move {
                startup::run(&settings, clock, failpoint, shutdown_signal()).await
            });
            match running.await {
                Ok(ran) => ran.map_err(|e| CliError::Service(e.to_string())),
                Err(panicked) => std::panic::resume_unwind(panicked.into_panic()),
            }
        }
        Command::Migrate => {
            let store = DenialStore::connect(&settings.database)
                .await
                .map_err(|e| service("postgres")(&e))?;
            store.migrate().await.map_err(|e| service("migrate")(&e))?;
            println!("migrations applied");
            Ok(())
        }
        Command::Publish { file } => queues::publish(&settings, file).await,
        Command::Check {
            message,
            at,
            commit,
        } => check(&settings, clock, &message, at.as_deref(), commit).await,
        Command::Denials(args) => denials::denials(&settings, clock, args).await,
        Command::Digests { recipient } => digests(&settings, recipient.as_deref()).await,
        Command::Replay(args) => denials::replay(&settings, clock, args).await,
        Command::Prune { older_than } => denials::prune(&settings, clock, &older_than).await,
        Command::Quarantine { action } => queues::quarantine(&settings, action).await,
        Command::Tail { channel } => {
            queues::tail(&settings, channel.as_deref().unwrap_or("#")).await
        }
        Command::Schema => {
            let schema = crate::request::schema::request_schema(settings.worker.max_body_bytes);
            println!("{schema:#}");
            Ok(())
        }
        Command::Config {
            action: ConfigAction::Check,
        } => {
            print!("{}", settings.effective_toml());
            Ok(())
        }
        Command::Rules {
            action: RulesAction::History { limit, format },
        } => rules_history(&settings, limit, format).await,
    }
}

/// `rules history`: the latest `limit` rows of `policy_changes`.
async fn rules_history(
    settings: &Settings,
    limit: i64,
    format: HistoryFormat,
) -> Result<(), CliError> {
    if limit < 1 {
        return Err(CliError::Input("--limit must be at least 1".to_owned()));
    }
    let reads = connect_reads(settings).await?;
    let changes = crate::rules::reload::history(reads.pool(), limit)
        .await
        .map_err(|e| service("postgres")(&reads.failed(e)))?;
    let mut out = std::io::stdout().lock();
    let written = changes.iter().try_for_each(|c| match format {
        HistoryFormat::Json => {
            let line = serde_json::json!({
                "id": c.id, "changed_at": rfc3339(c.changed_at), "source": c.source,
                "old_hash": c.old_hash, "new_hash": c.new_hash,
                "diff": c.diff.lines().collect::<Vec<_>>(),
            });
            writeln!(out, "{line}")
        }
        HistoryFormat::Table => {
            let short = |h: &str| h.chars().take(12).collect::<String>();
            writeln!(
                out,
                "{}  {}  {}  {} -> {}",
                c.id,
                rfc3339(c.changed_at),
                c.source,
                short(&c.old_hash),
                short(&c.new_hash)
            )?;
            c.diff.lines().try_for_each(|l| writeln!(out, "    {l}"))
        }
    });
    written.map_err(|e| CliError::Service(format!("writing output: {e}")))
}

/// Completes on SIGTERM or SIGINT.
async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

/// The RFC3339 instant of option `flag`, in the supported range (see [`crate::base::clock::in_range`]).
fn parse_instant(flag: &str, s: &str) -> Result<DateTime<Utc>, CliError> {
    let at = DateTime::parse_from_rfc3339(s)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|e| CliError::Input(format!("{flag} {s:?} is not an RFC3339 instant: {e}")))?;
    crate::base::clock::in_range(at).map_err(|e| CliError::Input(format!("{flag}: {e}")))
}

/// Option `flag`'s RFC3339 instant, or an age (`7d`, `36h`, `90m`, `30s`) counted back from
/// `now`, in the supported range.
pub fn parse_since(flag: &str, s: &str, now: DateTime<Utc>) -> Result<DateTime<Utc>, CliError> {
    crate::base::clock::parse_instant_or_age(s, now)
        .map_err(|e| CliError::Input(format!("{flag} {e}")))
}

fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::AutoSi, true)
}

async fn check(
    settings: &Settings,
    clock: &dyn Clock,
    message: &str,
    at: Option<&str>,
    commit: bool,
) -> Result<(), CliError> {
    let request = SendRequest::decode(message.as_bytes(), settings.worker.max_body_bytes)
        .map_err(|e| CliError::Input(format!("invalid message: {e}")))?;
    let now = match at {
        Some(at) => parse_instant("--at", at)?,
        None => clock.now(),
    };
    let redis = RedisConn::connect(&settings.redis)
        .await
        .map_err(|e| service("redis")(&e))?;
    let limiter = Limiter::new(redis, &settings.namespace);
    let out = crate::ops::service::check(&limiter, &settings.policy, &request, now, commit)
        .await
        .map_err(|e| service("redis")(&e))?;
    println!("{out}");
    Ok(())
}

/// [`publisher::open_publisher`], its failure as the command's.
async fn open_publisher(
    settings: &Settings,
    names: &Names,
    role: &str,
) -> Result<(lapin::Connection, Publisher), CliError> {
    publisher::open_publisher(&settings.amqp, names, role)
        .await
        .map_err(|e| service("rabbitmq")(&e))
}

async fn connect_store(settings: &Settings) -> Result<DenialStore, CliError> {
    DenialStore::connect(&settings.database)
        .await
        .map_err(|e| service("postgres")(&e))
}

/// Where the command's reads go: `database.read_url` when set, else `database.url`.
async fn connect_reads(settings: &Settings) -> Result<Reads, CliError> {
    Reads::connect(&settings.database)
        .await
        .map_err(|e| service("postgres")(&e))
}

/// `digests`: the groups of held messages, one JSON line each.
async fn digests(settings: &Settings, recipient: Option<&str>) -> Result<(), CliError> {
    let reads = connect_reads(settings).await?;
    let groups = crate::act::held::held_groups(reads.pool(), recipient)
        .await
        .map_err(|e| service("postgres")(&reads.failed(e)))?;
    let mut out = std::io::stdout().lock();
    for group in &groups {
        let line = serde_json::to_string(group).map_err(|e| CliError::Service(e.to_string()))?;
        writeln!(out, "{line}").map_err(|e| CliError::Service(format!("stdout: {e}")))?;
    }
    Ok(())
}
