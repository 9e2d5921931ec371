//! The `sendquota` command line: argument parsing and the commands operators and scripts run.
//!
//! Exit codes are part of the interface scripts rely on: 0 the command did its job (a deny is a
//! successful decision), 2 bad input or bad config, 1 a service could not be reached or failed.

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::sync::Arc;

use chrono::{DateTime, SecondsFormat, Utc};
use clap::{Parser, Subcommand, ValueEnum};
use futures_util::{StreamExt, TryStreamExt};

use crate::base::clock::{Clock, ManualClock, SystemClock};
use crate::base::config::{ConfigError, LogFormat, LogSettings, Settings};
use crate::base::failpoint;
use crate::base::store::RedisConn;
use crate::decide::limiter::Limiter;
use crate::intake::broker::{self, Names, Publisher};
use crate::record::denials::{Denial, DenialFilter, DenialStore};
use crate::request::message::SendRequest;
use crate::startup;

/// Publishes in flight at once when `publish` sends a file: enough to hide the confirm round
/// trip, few enough to keep memory flat.
const PUBLISH_IN_FLIGHT: usize = 256;

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

/// Filters shared by `denials` and `replay`.
#[derive(Debug, clap::Args)]
pub struct FilterArgs {
    /// Only this recipient.
    #[arg(long)]
    recipient: Option<String>,
    /// Only this rule.
    #[arg(long)]
    rule: Option<String>,
    /// Only this channel.
    #[arg(long)]
    channel: Option<String>,
    /// Only this category.
    #[arg(long)]
    category: Option<String>,
    /// Denied at or after: RFC3339, or an age such as 7d, 36h, 90m.
    #[arg(long)]
    since: Option<String>,
    /// Denied before: RFC3339, or an age such as 7d, 36h, 90m.
    #[arg(long)]
    until: Option<String>,
}

impl FilterArgs {
    fn filter(self, now: DateTime<Utc>) -> Result<DenialFilter, CliError> {
        Ok(DenialFilter {
            recipient: self.recipient,
            rule: self.rule,
            channel: self.channel,
            category: self.category,
            since: self
                .since
                .map(|s| parse_since("--since", &s, now))
                .transpose()?,
            until: self
                .until
                .map(|s| parse_since("--until", &s, now))
                .transpose()?,
            ..DenialFilter::default()
        })
    }
}

/// Filters and format of `denials`.
#[derive(Debug, clap::Args)]
pub struct DenialArgs {
    #[command(flatten)]
    filter: FilterArgs,
    /// Only shadow denials (true) or only real ones (false).
    #[arg(long)]
    shadow: Option<bool>,
    /// Only unchecked dispatches (true: sent unchecked while Redis was unavailable) or only the
    /// other rows (false).
    #[arg(long)]
    unchecked: Option<bool>,
    /// Only replayed denials (true) or only unreplayed ones (false).
    #[arg(long)]
    replayed: Option<bool>,
    /// Continue after this denial id (the last id of the previous page).
    #[arg(long)]
    after: Option<i64>,
    /// At most this many rows.
    #[arg(long, default_value_t = 100)]
    limit: i64,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    format: Format,
}

/// What `replay` takes.
#[derive(Debug, clap::Args)]
pub struct ReplayArgs {
    #[command(flatten)]
    filter: FilterArgs,
    /// Only denials whose retry_after has passed.
    #[arg(long)]
    due: bool,
    /// List what would be replayed; publish and change nothing.
    #[arg(long)]
    dry_run: bool,
    /// At most this many denials.
    #[arg(long)]
    limit: Option<usize>,
    /// At most this many publishes per second: `50/s`, `50`, `300/m`.
    #[arg(long)]
    rate: Option<String>,
    /// Denials claimed per transaction. A crash republishes at most one batch (the quota
    /// recognises those ids), so the default claims one at a time.
    #[arg(long, default_value_t = 1)]
    batch: i64,
}

/// Output formats of `denials`.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum Format {
    /// Aligned columns for people.
    Table,
    /// One JSON object per line.
    Json,
    /// Comma-separated values with a header line.
    Csv,
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
        Command::Publish { file } => publish(&settings, file).await,
        Command::Check {
            message,
            at,
            commit,
        } => check(&settings, clock, &message, at.as_deref(), commit).await,
        Command::Denials(args) => denials(&settings, clock, args).await,
        Command::Digests { recipient } => digests(&settings, recipient.as_deref()).await,
        Command::Replay(args) => replay(&settings, clock, args).await,
        Command::Prune { older_than } => prune(&settings, clock, &older_than).await,
        Command::Quarantine { action } => quarantine(&settings, action).await,
        Command::Tail { channel } => tail(&settings, channel.as_deref().unwrap_or("#")).await,
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
    let store = connect_store(settings).await?;
    let changes = crate::rules::reload::history(&store, limit)
        .await
        .map_err(|e| service("postgres")(&e))?;
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

async fn publish(settings: &Settings, file: Option<PathBuf>) -> Result<(), CliError> {
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
        requests.push((request.id, line));
    }
    let names = Names::new(&settings.namespace);
    let (connection, publisher) = open_publisher(settings, &names, "sendquota-publish").await?;
    let total = requests.len();
    let mut sent = 0usize;
    let mut confirms = futures_util::stream::iter(requests.iter())
        .map(|(id, line)| {
            let props = broker::json_properties(Some(id), &[]);
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

async fn denials(settings: &Settings, clock: &dyn Clock, args: DenialArgs) -> Result<(), CliError> {
    if args.limit < 1 {
        return Err(CliError::Input("--limit must be at least 1".to_owned()));
    }
    let filter = DenialFilter {
        shadow: args.shadow,
        unchecked: args.unchecked,
        replayed: args.replayed,
        after: args.after,
        limit: args.limit,
        ..args.filter.filter(clock.now())?
    };
    let store = connect_store(settings).await?;
    let rows = store
        .list(&filter)
        .await
        .map_err(|e| service("postgres")(&e))?;
    print_denials(&rows, args.format)
}

fn print_denials(rows: &[Denial], format: Format) -> Result<(), CliError> {
    let mut out = std::io::stdout().lock();
    let written = match format {
        Format::Json => rows.iter().try_for_each(|d| {
            let line = serde_json::to_string(&d.to_json()).map_err(std::io::Error::other)?;
            writeln!(out, "{line}")
        }),
        Format::Csv => write_csv(&mut out, rows),
        Format::Table => write_table(&mut out, rows),
    };
    written.map_err(|e| CliError::Service(format!("writing output: {e}")))
}

/// Prints what is dispatched with `routing_key` until SIGINT or SIGTERM (exit 0); the line on
/// standard error says where it listens, so standard output holds only the JSON lines.
async fn tail(settings: &Settings, routing_key: &str) -> Result<(), CliError> {
    let names = Names::new(&settings.namespace);
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

/// [`broker::open_publisher`], its failure as the command's.
async fn open_publisher(
    settings: &Settings,
    names: &Names,
    role: &str,
) -> Result<(lapin::Connection, Publisher), CliError> {
    broker::open_publisher(&settings.amqp, names, role)
        .await
        .map_err(|e| service("rabbitmq")(&e))
}

async fn quarantine(settings: &Settings, action: QuarantineAction) -> Result<(), CliError> {
    let names = Names::new(&settings.namespace);
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

async fn connect_store(settings: &Settings) -> Result<DenialStore, CliError> {
    DenialStore::connect(&settings.database)
        .await
        .map_err(|e| service("postgres")(&e))
}

async fn replay(settings: &Settings, clock: &dyn Clock, args: ReplayArgs) -> Result<(), CliError> {
    let now = clock.now();
    let rate = match args.rate.as_deref() {
        Some(text) => Some(crate::ops::replay::parse_rate(text).ok_or_else(|| {
            CliError::Input(format!(
                "--rate {text:?} is not a rate such as 50/s, 50 or 300/m"
            ))
        })?),
        None => None,
    };
    if args.batch < 1 || args.limit == Some(0) {
        return Err(CliError::Input(
            "--batch and --limit must be at least 1".to_owned(),
        ));
    }
    let filter = DenialFilter {
        due_at: args.due.then_some(now),
        live_at: Some(now),
        ..args.filter.filter(now)?
    };
    let store = connect_store(settings).await?;
    if args.dry_run {
        let limit = args
            .limit
            .map_or(crate::record::denials::MAX_LIMIT, |l| l as i64);
        let rows = store
            .replayable(&filter, limit)
            .await
            .map_err(|e| service("postgres")(&e))?;
        let past_deadline = store
            .past_deadline(&filter, now)
            .await
            .map_err(|e| service("postgres")(&e))?;
        print_denials(&rows, Format::Table)?;
        println!("dry run: would replay {} denials", rows.len());
        if past_deadline > 0 {
            println!(
                "dry run: skipped {past_deadline} denials whose message is past its deadline \
                 (expires_at)"
            );
        }
        return Ok(());
    }
    let names = Names::new(&settings.namespace);
    let (connection, publisher) = open_publisher(settings, &names, "sendquota-replay").await?;
    let bar = progress_bar(args.limit);
    let options = crate::ops::replay::ReplayOptions {
        filter,
        limit: args.limit,
        rate,
        batch: args.batch,
    };
    let result = crate::ops::replay::replay(
        &store,
        &publisher,
        &names,
        &options,
        || clock.now(),
        |n| bar.set_position(n as u64),
    )
    .await;
    bar.finish_and_clear();
    let _ = connection.close(200, "done".into()).await;
    let report = result.map_err(|e| CliError::Service(e.to_string()))?;
    let secs = report.elapsed.as_secs_f64();
    println!(
        "replayed {} denials in {secs:.2} s ({:.1}/s)",
        report.replayed,
        report.replayed as f64 / secs.max(1e-9)
    );
    Ok(())
}

/// A progress bar on stderr when it is a terminal; hidden otherwise (cron, pipes).
fn progress_bar(len: Option<usize>) -> indicatif::ProgressBar {
    use std::io::IsTerminal;
    if !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = match len {
        Some(n) => indicatif::ProgressBar::new(n as u64),
        None => indicatif::ProgressBar::no_length(),
    };
    bar.set_draw_target(indicatif::ProgressDrawTarget::stderr());
    bar
}

/// `digests`: the groups of held messages, one JSON line each.
async fn digests(settings: &Settings, recipient: Option<&str>) -> Result<(), CliError> {
    let store = connect_store(settings).await?;
    let groups = crate::act::held::held_groups(store.pool(), recipient)
        .await
        .map_err(|e| service("postgres")(&e))?;
    let mut out = std::io::stdout().lock();
    for group in &groups {
        let line = serde_json::to_string(group).map_err(|e| CliError::Service(e.to_string()))?;
        writeln!(out, "{line}").map_err(|e| CliError::Service(format!("stdout: {e}")))?;
    }
    Ok(())
}

async fn prune(settings: &Settings, clock: &dyn Clock, older_than: &str) -> Result<(), CliError> {
    let now = clock.now();
    let cutoff = parse_since("--older-than", older_than, now)?;
    if cutoff > now {
        return Err(CliError::Input(
            "--older-than must be an age such as 90d".to_owned(),
        ));
    }
    let store = connect_store(settings).await?;
    let dropped = store
        .prune(cutoff)
        .await
        .map_err(|e| service("postgres")(&e))?;
    for name in &dropped {
        println!("dropped {name}");
    }
    println!(
        "pruned {} partitions older than {}",
        dropped.len(),
        rfc3339(cutoff)
    );
    Ok(())
}

const COLUMNS: [&str; 9] = [
    "id",
    "denied_at",
    "recipient",
    "channel",
    "category",
    "rule",
    "kind",
    "retry_after",
    "replayed_at",
];

fn row_cells(d: &Denial) -> [String; 9] {
    [
        d.id.to_string(),
        rfc3339(d.denied_at),
        d.recipient.clone(),
        d.channel.clone(),
        d.category.clone(),
        if d.shadow {
            format!("{} (shadow)", d.rule)
        } else if d.unchecked {
            format!("{} (unchecked)", d.rule)
        } else if d.reason == crate::decide::deadline::EXPIRED_REASON {
            format!("{} (expired)", d.rule)
        } else {
            d.rule.clone()
        },
        d.kind.clone(),
        d.retry_after.map(rfc3339).unwrap_or_default(),
        d.replayed_at.map(rfc3339).unwrap_or_default(),
    ]
}

fn write_table(out: &mut impl Write, rows: &[Denial]) -> std::io::Result<()> {
    let cells: Vec<[String; 9]> = rows.iter().map(row_cells).collect();
    let mut widths = COLUMNS.map(str::len);
    for row in &cells {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |cells: &[String]| {
        cells
            .iter()
            .zip(widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect::<Vec<_>>()
            .join("  ")
            .trim_end()
            .to_owned()
    };
    writeln!(out, "{}", line(&COLUMNS.map(str::to_owned)))?;
    for row in &cells {
        writeln!(out, "{}", line(row))?;
    }
    Ok(())
}

fn write_csv(out: &mut impl Write, rows: &[Denial]) -> std::io::Result<()> {
    fn field(s: &str) -> String {
        if s.contains([',', '"', '\n', '\r']) {
            format!("\"{}\"", s.replace('"', "\"\""))
        } else {
            s.to_owned()
        }
    }
    writeln!(out, "{},reason,message_id", COLUMNS.join(","))?;
    for d in rows {
        let mut cells: Vec<String> = row_cells(d).iter().map(|c| field(c)).collect();
        cells.push(field(&d.reason));
        cells.push(field(&d.message_id));
        writeln!(out, "{}", cells.join(","))?;
    }
    Ok(())
}
