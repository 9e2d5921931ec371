//! Settings: a TOML file, then environment overrides for connections and namespace.
//!
//! Everything is validated here, before any connection is opened, so a bad file stops the
//! process at start-up with one clear line instead of failing on the first message.

use std::path::{Path, PathBuf};

use chrono_tz::Tz;
use serde::{Deserialize, Serialize};

use crate::base::tls::TlsFiles;
use crate::request::message::{one_line, DEFAULT_MAX_BODY_BYTES};
use crate::rules::policy::{Policy, PolicyError, RawRule};

/// Default Redis URL, the local server.
pub const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379";
/// Default broker URL, the local RabbitMQ with its default account and vhost.
pub const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
/// Default database URL, the local Postgres.
pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/sendquota";
/// Default namespace for queue, exchange and key names.
pub const DEFAULT_NAMESPACE: &str = "sendquota";

/// Why the configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The file named by `--config` or `SENDQUOTA_CONFIG`.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not valid TOML of the expected shape.
    #[error("config file {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's message, with line and column.
        message: String,
    },
    /// `default_timezone` is not an IANA zone.
    #[error("default_timezone: unknown time zone \"{0}\"")]
    UnknownTimeZone(String),
    /// The namespace cannot be used in queue and key names.
    #[error("namespace \"{0}\" must be 1 to 64 characters of letters, digits, '_', '-' and '.'")]
    BadNamespace(String),
    /// A setting is out of range.
    #[error("{0}")]
    Invalid(String),
    /// A rule is invalid.
    #[error(transparent)]
    Policy(#[from] PolicyError),
}

/// Everything the process needs, validated.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Prefix of every exchange, queue and Redis key name.
    pub namespace: String,
    /// Redis connection.
    pub redis: RedisSettings,
    /// RabbitMQ connection and topology.
    pub amqp: AmqpSettings,
    /// Postgres connection.
    pub database: DatabaseSettings,
    /// Worker behaviour.
    pub worker: WorkerSettings,
    /// The admin HTTP API.
    pub admin: AdminSettings,
    /// Log lines: their format, and how decision logs show recipients.
    pub log: LogSettings,
    /// Span export.
    pub telemetry: TelemetrySettings,
    /// The validated rules.
    pub policy: Policy,
    /// The file these settings were read from (`None`: no file): a rule reload
    /// (`crate::rules::reload`) reads the same file again.
    pub source: Option<PathBuf>,
}

/// Log lines: their format, and how decision logs show recipients.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogSettings {
    /// `text` for people, `json` (one object per line) for log collectors;
    /// `SENDQUOTA_LOG_FORMAT` overrides it.
    pub format: LogFormat,
    /// `plain` or `hash`: how decision logs show the recipient.
    pub recipient: RecipientLog,
    /// The key of recipient hashes, from `SENDQUOTA_LOG_RECIPIENT_KEY` only (a secret: never in
    /// the file, never printed).
    #[serde(skip)]
    pub recipient_key: RecipientKey,
}

/// Span export (see `traces`): off unless an OTLP endpoint is set.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetrySettings {
    /// The OTLP/HTTP endpoint of a collector, such as `http://127.0.0.1:4318`: spans are posted
    /// to its `/v1/traces` as protobuf. Empty (the default): no span is made or exported.
    /// `SENDQUOTA_OTLP_ENDPOINT` overrides it (OpenTelemetry's `OTEL_EXPORTER_OTLP_ENDPOINT` is
    /// not read: see `check_telemetry`). Plain `http://` only: the exporter has no TLS of its own (a collector runs
    /// beside the worker, as a sidecar or on the node).
    pub otlp_endpoint: String,
}

impl TelemetrySettings {
    /// Where spans are posted: the endpoint's `/v1/traces` (as OpenTelemetry's exporters append
    /// it to `OTEL_EXPORTER_OTLP_ENDPOINT`); `None` when export is off.
    pub fn traces_url(&self) -> Option<String> {
        let base = self.otlp_endpoint.trim();
        (!base.is_empty()).then(|| format!("{}/v1/traces", base.trim_end_matches('/')))
    }
}

/// The format of log lines.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LogFormat {
    /// One line of text per event, coloured on a terminal.
    #[default]
    Text,
    /// One JSON object per line, the event's fields at the top level.
    Json,
}

impl LogFormat {
    /// The format `SENDQUOTA_LOG_FORMAT` names (`text` or `json`); `None` for anything else.
    pub fn parse(name: &str) -> Option<LogFormat> {
        match name.trim() {
            "text" => Some(LogFormat::Text),
            "json" => Some(LogFormat::Json),
            _ => None,
        }
    }
}

/// How decision logs show a recipient.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RecipientLog {
    /// As the producer wrote it.
    #[default]
    Plain,
    /// As HMAC-SHA256 keyed with `SENDQUOTA_LOG_RECIPIENT_KEY`, in hex: the same recipient
    /// always hashes alike (logs can be searched and correlated), and without the key a hash
    /// cannot be reversed by trying every phone number or address.
    Hash,
}

/// The key of recipient hashes in logs; its `Debug` never shows it.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct RecipientKey(pub String);

impl std::fmt::Debug for RecipientKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_empty() { "\"\"" } else { "\"***\"" })
    }
}

/// The admin HTTP API served by the worker.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminSettings {
    /// Address to listen on (`host:port`); empty disables the API.
    pub listen: String,
    /// Bearer tokens accepted on the `/v1` routes; the name is what audits record.
    pub tokens: Vec<AdminToken>,
}

/// One bearer token of the admin API.
#[derive(Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AdminToken {
    /// Who holds the token; recorded in the quota reset audit.
    pub name: String,
    /// The secret itself; never printed.
    #[serde(serialize_with = "redacted")]
    pub token: String,
}

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminToken")
            .field("name", &self.name)
            .field("token", &"***")
            .finish()
    }
}

fn redacted<S: serde::Serializer>(_: &str, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str("***")
}

/// Shortest admin token, and shortest recipient hash key, accepted: long enough that guessing
/// is hopeless.
const MIN_TOKEN_CHARS: usize = 16;

/// Most runtime threads a worker may ask for: far beyond any useful count, low enough that a
/// typo cannot make the process try to start millions of threads.
const MAX_THREADS: usize = 1024;

impl Default for AdminSettings {
    fn default() -> Self {
        AdminSettings {
            listen: "127.0.0.1:9090".to_owned(),
            tokens: Vec::new(),
        }
    }
}

/// Redis connection settings.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RedisSettings {
    /// A single server's URL.
    pub url: String,
    /// Seed nodes of a Redis Cluster; when non-empty, `url` is ignored.
    pub cluster_urls: Vec<String>,
    /// Longest wait for one Redis reply, in milliseconds.
    pub response_timeout_ms: u64,
    /// Certificate files for `rediss://` URLs.
    pub tls: TlsFiles,
}

/// Broker settings.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct AmqpSettings {
    /// The broker URL.
    pub url: String,
    /// Deliveries the broker may hand the worker before acks (the consumer's prefetch).
    pub prefetch: u16,
    /// Queue type of the requests and invalid queues: `quorum` (survives a node loss) or
    /// `classic`.
    pub queue_type: QueueType,
    /// Certificate files for an `amqps://` URL.
    pub tls: TlsFiles,
}

/// RabbitMQ queue type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum QueueType {
    /// Replicated, durable; the default.
    Quorum,
    /// Single-node queue.
    Classic,
}

/// Postgres settings.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct DatabaseSettings {
    /// The database URL.
    pub url: String,
    /// Size of the connection pool.
    pub max_connections: u32,
    /// Longest wait for a pooled connection, in milliseconds.
    pub acquire_timeout_ms: u64,
    /// Server-side statement timeout, in milliseconds, so a stuck query frees its connection.
    pub statement_timeout_ms: u64,
    /// Certificate files for the URL's `sslmode` (`require`, `verify-ca`, `verify-full`).
    pub tls: TlsFiles,
}

/// Worker behaviour.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct WorkerSettings {
    /// Runtime threads the worker runs on; 0 = one per CPU. One is the default, and means
    /// tokio's current-thread runtime: a thread decides tens of thousands of messages a
    /// second, more than one consumer receives, and a second thread only adds wake-ups between
    /// threads, which cost CPU per message and buy no throughput (docs/performance.md). More
    /// throughput comes from more workers.
    pub threads: usize,
    /// Messages decided at the same time.
    pub concurrency: usize,
    /// Largest accepted request body, in bytes.
    pub max_body_bytes: usize,
    /// How long a dispatched message id is remembered so a redelivery is not sent twice, in
    /// seconds. Longer than the longest quota window, so a replay inside it is recognised too.
    pub dedup_ttl_secs: u64,
    /// How long a delivery's in-flight claim on its message id lasts unless renewed, in
    /// milliseconds (see `claim`): copies of the message wait while it is held, and a crashed
    /// worker's claim frees its message's copies after this long.
    pub claim_lease_ms: u64,
    /// First retry delay after a service failure, in milliseconds.
    pub retry_initial_ms: u64,
    /// Largest retry delay, in milliseconds.
    pub retry_max_ms: u64,
    /// On SIGTERM or SIGINT, how long in-flight messages may take to finish, in milliseconds;
    /// messages still unacked after that return to the queue.
    pub shutdown_timeout_ms: u64,
    /// Answer repeat denials of recipients known to be full from memory (exact; see
    /// `deny_cache`). Needs Redis pub/sub; off on Redis Cluster.
    pub deny_cache: bool,
    /// Largest number of denials written in one transaction.
    pub denial_batch_size: usize,
    /// Longest a denial waits for its batch to fill, in milliseconds.
    pub denial_batch_wait_ms: u64,
    /// How often the watchdog checks that the consumer still receives deliveries while the
    /// requests queue holds messages, in milliseconds.
    pub watchdog_interval_ms: u64,
    /// How long a delivery may keep failing in its slot before it yields the slot, in
    /// milliseconds: it moves to a delay queue and is retried from there, and its slot goes to
    /// other messages, so messages that keep failing cannot hold every slot.
    pub yield_slot_after_ms: u64,
    /// How often the worker looks for messages held by `on_deny = "digest"` rules whose
    /// recipient has room again, in milliseconds: a digest goes out at most this long after
    /// the room is there.
    pub digest_flush_interval_ms: u64,
    /// Largest digest body, in bytes: a group whose held messages are larger together goes
    /// out as several digests (each one send). Below the broker's `max_message_size`, which
    /// refuses a larger message and closes the channel every dispatch shares.
    pub max_digest_bytes: usize,
}

impl Default for RedisSettings {
    fn default() -> Self {
        RedisSettings {
            url: DEFAULT_REDIS_URL.to_owned(),
            cluster_urls: Vec::new(),
            response_timeout_ms: 5_000,
            tls: TlsFiles::default(),
        }
    }
}

impl Default for AmqpSettings {
    fn default() -> Self {
        AmqpSettings {
            url: DEFAULT_AMQP_URL.to_owned(),
            prefetch: 256,
            queue_type: QueueType::Quorum,
            tls: TlsFiles::default(),
        }
    }
}

impl Default for DatabaseSettings {
    fn default() -> Self {
        DatabaseSettings {
            url: DEFAULT_DATABASE_URL.to_owned(),
            max_connections: 8,
            acquire_timeout_ms: 5_000,
            statement_timeout_ms: 10_000,
            tls: TlsFiles::default(),
        }
    }
}

impl Default for WorkerSettings {
    fn default() -> Self {
        WorkerSettings {
            threads: 1,
            concurrency: 256,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            dedup_ttl_secs: 8 * 24 * 3600,
            claim_lease_ms: 30_000,
            retry_initial_ms: 100,
            retry_max_ms: 10_000,
            shutdown_timeout_ms: 30_000,
            watchdog_interval_ms: 30_000,
            yield_slot_after_ms: 60_000,
            deny_cache: true,
            denial_batch_size: 500,
            denial_batch_wait_ms: 3,
            digest_flush_interval_ms: 5_000,
            max_digest_bytes: DEFAULT_MAX_DIGEST_BYTES,
        }
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct File {
    namespace: Option<String>,
    default_timezone: Option<String>,
    #[serde(default)]
    redis: RedisSettings,
    #[serde(default)]
    amqp: AmqpSettings,
    #[serde(default)]
    database: DatabaseSettings,
    #[serde(default)]
    worker: WorkerSettings,
    #[serde(default)]
    admin: AdminSettings,
    #[serde(default)]
    log: LogSettings,
    #[serde(default)]
    telemetry: TelemetrySettings,
    #[serde(default)]
    rules: Vec<RawRule>,
}

impl Settings {
    /// Reads the file (if any), applies environment overrides from `env`, validates.
    pub fn load(
        path: Option<&Path>,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Settings, ConfigError> {
        let file = match path {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                    path: path.to_owned(),
                    source,
                })?;
                toml::from_str::<File>(&text).map_err(|e| parse_error(path, &text, &e))?
            }
            None => File::default(),
        };
        let mut settings = Settings::from_file(file, env)?;
        settings.source = path.map(Path::to_owned);
        Ok(settings)
    }

    /// Parses settings from TOML text (no file), with environment overrides.
    pub fn from_toml(
        text: &str,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Settings, ConfigError> {
        let file = toml::from_str::<File>(text)
            .map_err(|e| parse_error(Path::new("<inline>"), text, &e))?;
        Settings::from_file(file, env)
    }

    fn from_file(
        mut file: File,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Settings, ConfigError> {
        apply_env(&mut file, &env);
        check_admin(&file.admin)?;
        check_log(&mut file.log, &env)?;
        check_telemetry(&mut file.telemetry, &env)?;
        let namespace = env("SENDQUOTA_NAMESPACE")
            .or(file.namespace)
            .unwrap_or_else(|| DEFAULT_NAMESPACE.to_owned());
        check_namespace(&namespace)?;
        let zone_name = file.default_timezone.unwrap_or_else(|| "UTC".to_owned());
        let zone: Tz = zone_name
            .parse()
            .map_err(|_| ConfigError::UnknownTimeZone(one_line(&zone_name)))?;
        check_urls(&file.redis, &file.amqp, &file.database)?;
        for (section, files) in [
            ("redis.tls", &file.redis.tls),
            ("amqp.tls", &file.amqp.tls),
            ("database.tls", &file.database.tls),
        ] {
            files.check().map_err(|e| {
                ConfigError::Invalid(format!("{section}: {}", one_line(&e.to_string())))
            })?;
        }
        let policy = Policy::from_raw(zone, file.rules)?;
        let settings = Settings {
            namespace,
            redis: file.redis,
            amqp: file.amqp,
            database: file.database,
            worker: file.worker,
            admin: file.admin,
            log: file.log,
            telemetry: file.telemetry,
            policy,
            source: None,
        };
        check_ranges(&settings)?;
        Ok(settings)
    }
}

/// The `SENDQUOTA_*` variables that override the file: each service's URL and TLS files, and
/// the admin API's address and an extra token. (A deployment keeps secrets and addresses in
/// the environment and the rest in the file.)
fn apply_env(file: &mut File, env: &impl Fn(&str) -> Option<String>) {
    if let Some(url) = env("SENDQUOTA_REDIS_URL") {
        file.redis.url = url;
        file.redis.cluster_urls.clear();
    }
    if let Some(urls) = env("SENDQUOTA_REDIS_CLUSTER_URLS") {
        file.redis.cluster_urls = urls
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .map(str::to_owned)
            .collect();
    }
    if let Some(url) = env("SENDQUOTA_AMQP_URL") {
        file.amqp.url = url;
    }
    if let Some(url) = env("SENDQUOTA_DATABASE_URL") {
        file.database.url = url;
    }
    for (service, files) in [
        ("REDIS", &mut file.redis.tls),
        ("AMQP", &mut file.amqp.tls),
        ("DATABASE", &mut file.database.tls),
    ] {
        tls_overrides(service, files, env);
    }
    if let Some(listen) = env("SENDQUOTA_ADMIN_LISTEN") {
        file.admin.listen = listen;
    }
    if let Some(token) = env("SENDQUOTA_ADMIN_TOKEN") {
        file.admin.tokens.push(AdminToken {
            name: "env".to_owned(),
            token,
        });
    }
}

/// One numeric setting and the range the worker can run with. The one list of them,
/// [`NUMERIC_SETTINGS`], is what validation walks, what a refused value's message quotes, and
/// what the tests walk, so a setting cannot be added without a range.
#[derive(Debug)]
pub struct NumericSetting {
    /// The table the setting is in (`worker` for `[worker]`).
    pub section: &'static str,
    /// The key within the table.
    pub key: &'static str,
    /// Smallest value accepted.
    pub min: u64,
    /// Largest value accepted.
    pub max: u64,
    value: fn(&Settings) -> u64,
}

impl NumericSetting {
    /// The one line that refuses `got` (a value as written, or a number) for this setting.
    fn refusal(&self, got: &dyn std::fmt::Display) -> ConfigError {
        ConfigError::Invalid(format!(
            "[{}] {} must be between {} and {} (got {})",
            self.section,
            self.key,
            self.min,
            self.max,
            one_line(&got.to_string())
        ))
    }
}

/// The default of `worker.max_digest_bytes`: 4 KiB below the 128 KiB `max_message_size` that
/// deploy/rabbitmq/rabbitmq.conf sets, so a digest is never refused by a broker set up as
/// recommended (RabbitMQ measures the body; the headroom covers a broker or proxy that counts
/// the properties too), and one held request of the largest default body (64 KiB) fits.
pub const DEFAULT_MAX_DIGEST_BYTES: usize = 126_976;

/// Ten minutes: the longest timeout or interval accepted. Longer ones only hide a failure (a
/// wait that long is a service that is down), and bounds keep every duration far from what
/// `Duration` and tokio's timers can hold.
const MAX_WAIT_MS: u64 = 600_000;

/// An hour: the longest lease, shutdown wait, watchdog interval or slot yield accepted.
const MAX_LONG_WAIT_MS: u64 = 3_600_000;

/// Every numeric setting with its valid range, stated beside it in deploy/config.example.toml.
pub const NUMERIC_SETTINGS: [NumericSetting; 19] = [
    // Below 100 ms a loaded but healthy Redis times out.
    NumericSetting {
        section: "redis",
        key: "response_timeout_ms",
        min: 100,
        max: MAX_WAIT_MS,
        value: |s| s.redis.response_timeout_ms,
    },
    // 0 would be "unlimited" in AMQP: refused, so the worker's memory stays bounded by it.
    NumericSetting {
        section: "amqp",
        key: "prefetch",
        min: 1,
        max: u16::MAX as u64,
        value: |s| u64::from(s.amqp.prefetch),
    },
    NumericSetting {
        section: "database",
        key: "max_connections",
        min: 1,
        max: 1_000,
        value: |s| u64::from(s.database.max_connections),
    },
    NumericSetting {
        section: "database",
        key: "acquire_timeout_ms",
        min: 100,
        max: MAX_WAIT_MS,
        value: |s| s.database.acquire_timeout_ms,
    },
    // Postgres reads 0 as "no timeout": refused, a stuck query must free its connection.
    NumericSetting {
        section: "database",
        key: "statement_timeout_ms",
        min: 100,
        max: MAX_WAIT_MS,
        value: |s| s.database.statement_timeout_ms,
    },
    // 0 = one per CPU.
    NumericSetting {
        section: "worker",
        key: "threads",
        min: 0,
        max: MAX_THREADS as u64,
        value: |s| s.worker.threads as u64,
    },
    // The most deliveries the broker can hand over at once (the largest prefetch).
    NumericSetting {
        section: "worker",
        key: "concurrency",
        min: 1,
        max: u16::MAX as u64,
        value: |s| s.worker.concurrency as u64,
    },
    // The smallest valid request fits in 256 bytes; RabbitMQ refuses bodies over 128 MiB.
    NumericSetting {
        section: "worker",
        key: "max_body_bytes",
        min: 256,
        max: 128 * 1024 * 1024,
        value: |s| s.worker.max_body_bytes as u64,
    },
    // At least an hour, so a redelivery is recognised; at most the longest rule window.
    NumericSetting {
        section: "worker",
        key: "dedup_ttl_secs",
        min: 3_600,
        max: 366 * 86_400,
        value: |s| s.worker.dedup_ttl_secs,
    },
    // Renewed every third of the lease: at 300 ms, every 100 ms.
    NumericSetting {
        section: "worker",
        key: "claim_lease_ms",
        min: 300,
        max: MAX_LONG_WAIT_MS,
        value: |s| s.worker.claim_lease_ms,
    },
    NumericSetting {
        section: "worker",
        key: "retry_initial_ms",
        min: 1,
        max: MAX_WAIT_MS,
        value: |s| s.worker.retry_initial_ms,
    },
    NumericSetting {
        section: "worker",
        key: "retry_max_ms",
        min: 1,
        max: MAX_WAIT_MS,
        value: |s| s.worker.retry_max_ms,
    },
    NumericSetting {
        section: "worker",
        key: "shutdown_timeout_ms",
        min: 100,
        max: MAX_LONG_WAIT_MS,
        value: |s| s.worker.shutdown_timeout_ms,
    },
    // Rows are bound as one array per column (12 parameters whatever the size); the bound
    // keeps one transaction, and the writer's queue of four batches, small.
    NumericSetting {
        section: "worker",
        key: "denial_batch_size",
        min: 1,
        max: 10_000,
        value: |s| s.worker.denial_batch_size as u64,
    },
    // 0 = write what has arrived without waiting; a denial's message waits this long at most.
    NumericSetting {
        section: "worker",
        key: "denial_batch_wait_ms",
        min: 0,
        max: 1_000,
        value: |s| s.worker.denial_batch_wait_ms,
    },
    NumericSetting {
        section: "worker",
        key: "watchdog_interval_ms",
        min: 100,
        max: MAX_LONG_WAIT_MS,
        value: |s| s.worker.watchdog_interval_ms,
    },
    NumericSetting {
        section: "worker",
        key: "yield_slot_after_ms",
        min: 100,
        max: MAX_LONG_WAIT_MS,
        value: |s| s.worker.yield_slot_after_ms,
    },
    // Below 100 ms the flusher's queries on an idle table are most of the worker's work.
    NumericSetting {
        section: "worker",
        key: "digest_flush_interval_ms",
        min: 100,
        max: MAX_LONG_WAIT_MS,
        value: |s| s.worker.digest_flush_interval_ms,
    },
    // Below 1 KiB most digests would carry one message; RabbitMQ refuses bodies over 128 MiB.
    NumericSetting {
        section: "worker",
        key: "max_digest_bytes",
        min: 1_024,
        max: 128 * 1024 * 1024,
        value: |s| s.worker.max_digest_bytes as u64,
    },
];

/// Every numeric setting within its range, and the backoff growing from its first delay.
fn check_ranges(settings: &Settings) -> Result<(), ConfigError> {
    for setting in &NUMERIC_SETTINGS {
        let value = (setting.value)(settings);
        if !(setting.min..=setting.max).contains(&value) {
            return Err(setting.refusal(&value));
        }
    }
    let w = &settings.worker;
    if w.retry_initial_ms > w.retry_max_ms {
        return Err(ConfigError::Invalid(format!(
            "[worker] retry_initial_ms ({}) must be at most retry_max_ms ({})",
            w.retry_initial_ms, w.retry_max_ms
        )));
    }
    Ok(())
}

/// `SENDQUOTA_<SERVICE>_TLS_CA_FILE`, `..._TLS_CLIENT_CERT_FILE` and `..._TLS_CLIENT_KEY_FILE`
/// override the file's settings, as the URLs do (a container mounts its certificates and says
/// where in the environment).
fn tls_overrides(service: &str, files: &mut TlsFiles, env: &impl Fn(&str) -> Option<String>) {
    for (suffix, value) in [
        ("CA_FILE", &mut files.ca_file),
        ("CLIENT_CERT_FILE", &mut files.client_cert_file),
        ("CLIENT_KEY_FILE", &mut files.client_key_file),
    ] {
        if let Some(v) = env(&format!("SENDQUOTA_{service}_TLS_{suffix}")) {
            *value = v;
        }
    }
}

/// Applies `SENDQUOTA_LOG_FORMAT` and `SENDQUOTA_LOG_RECIPIENT_KEY`, and refuses a hashed
/// recipient without a key long enough to keep the hashes from being reversed.
fn check_log(
    log: &mut LogSettings,
    env: &impl Fn(&str) -> Option<String>,
) -> Result<(), ConfigError> {
    if let Some(name) = env("SENDQUOTA_LOG_FORMAT") {
        log.format = LogFormat::parse(&name).ok_or_else(|| {
            ConfigError::Invalid(format!(
                "SENDQUOTA_LOG_FORMAT \"{}\" is not text or json",
                one_line(&name)
            ))
        })?;
    }
    log.recipient_key = RecipientKey(env("SENDQUOTA_LOG_RECIPIENT_KEY").unwrap_or_default());
    if log.recipient == RecipientLog::Hash && log.recipient_key.0.chars().count() < MIN_TOKEN_CHARS
    {
        return Err(ConfigError::Invalid(format!(
            "[log] recipient = \"hash\" needs SENDQUOTA_LOG_RECIPIENT_KEY, at least \
             {MIN_TOKEN_CHARS} characters"
        )));
    }
    Ok(())
}

/// Applies `SENDQUOTA_OTLP_ENDPOINT`, and refuses an endpoint that is not a plain `http://`
/// URL, naming where it came from. OpenTelemetry's `OTEL_EXPORTER_OTLP_ENDPOINT` is not read: a
/// platform that sets it for every pod would turn export on for the worker unasked, and an
/// `https://` one (which this exporter cannot reach) would stop every command from starting.
fn check_telemetry(
    telemetry: &mut TelemetrySettings,
    env: &impl Fn(&str) -> Option<String>,
) -> Result<(), ConfigError> {
    let mut source = "[telemetry] otlp_endpoint";
    if let Some(endpoint) = env("SENDQUOTA_OTLP_ENDPOINT") {
        telemetry.otlp_endpoint = endpoint;
        source = "SENDQUOTA_OTLP_ENDPOINT";
    }
    let Some(url) = telemetry.traces_url() else {
        return Ok(());
    };
    let uri = url.parse::<axum::http::Uri>().ok();
    let http = uri
        .as_ref()
        .is_some_and(|u| u.scheme_str() == Some("http") && u.host().is_some_and(|h| !h.is_empty()));
    if !http {
        return Err(ConfigError::Invalid(format!(
            "{source} \"{}\" is not an http:// URL such as http://127.0.0.1:4318 (spans are \
             exported over plain HTTP only: run the collector beside the worker)",
            one_line(&redact_url(&telemetry.otlp_endpoint))
        )));
    }
    Ok(())
}

fn check_admin(admin: &AdminSettings) -> Result<(), ConfigError> {
    if !admin.listen.is_empty() && admin.listen.parse::<std::net::SocketAddr>().is_err() {
        return Err(ConfigError::Invalid(format!(
            "admin.listen \"{}\" is not an address such as 127.0.0.1:9090",
            one_line(&admin.listen)
        )));
    }
    let mut names = std::collections::HashSet::new();
    for t in &admin.tokens {
        if t.name.is_empty() || !names.insert(t.name.as_str()) {
            return Err(ConfigError::Invalid(format!(
                "admin token names must be non-empty and unique (\"{}\")",
                one_line(&t.name)
            )));
        }
        if t.token.chars().count() < MIN_TOKEN_CHARS {
            return Err(ConfigError::Invalid(format!(
                "admin token \"{}\" is shorter than {MIN_TOKEN_CHARS} characters",
                one_line(&t.name)
            )));
        }
    }
    Ok(())
}

/// Parses every connection URL without connecting, so a malformed one is a configuration error
/// (exit 2) rather than a connection failure. Messages never repeat the URL: it may hold a
/// password.
fn check_urls(
    redis: &RedisSettings,
    amqp: &AmqpSettings,
    database: &DatabaseSettings,
) -> Result<(), ConfigError> {
    let redis_urls = if redis.cluster_urls.is_empty() {
        std::slice::from_ref(&redis.url)
    } else {
        &redis.cluster_urls[..]
    };
    // Parser messages can quote the URL, password included: only say which one is wrong.
    for url in redis_urls {
        let scheme = url.starts_with("redis://") || url.starts_with("rediss://");
        if !scheme || redis::Client::open(url.as_str()).is_err() {
            return Err(ConfigError::Invalid(
                "redis url is not valid: expected redis[s]://[:password@]host:port[/db]".to_owned(),
            ));
        }
    }
    // One TLS configuration serves every node of a cluster, and the nodes a seed names are
    // reached as it was: seeds of both kinds only time out later.
    let tls = redis_urls
        .iter()
        .filter(|u| u.starts_with("rediss://"))
        .count();
    if tls != 0 && tls != redis_urls.len() {
        return Err(ConfigError::Invalid(
            "redis cluster_urls mix redis:// and rediss:// seeds: a cluster's nodes are reached \
             all with TLS or all without"
                .to_owned(),
        ));
    }
    let amqp_scheme = amqp.url.starts_with("amqp://") || amqp.url.starts_with("amqps://");
    if !amqp_scheme || amqp.url.parse::<lapin::uri::AMQPUri>().is_err() {
        return Err(ConfigError::Invalid(
            "amqp url is not valid: expected amqp[s]://user:password@host:port/vhost".to_owned(),
        ));
    }
    check_database_url(&database.url)
}

/// The `sslmode` values Postgres clients (and sqlx) know.
const SSL_MODES: [&str; 6] = [
    "disable",
    "allow",
    "prefer",
    "require",
    "verify-ca",
    "verify-full",
];

/// A Postgres URL sqlx can connect with. An unknown `sslmode` is named (the value is no
/// secret); other parser messages are not repeated, as they can quote the URL.
fn check_database_url(url: &str) -> Result<(), ConfigError> {
    let query = url.split_once('?').map_or("", |(_, q)| q);
    let ssl_mode = query.split('&').find_map(|pair| {
        let (key, value) = pair.split_once('=')?;
        matches!(key, "sslmode" | "ssl-mode").then_some(value)
    });
    if let Some(mode) = ssl_mode.filter(|m| !SSL_MODES.contains(&m.to_ascii_lowercase().as_str())) {
        return Err(ConfigError::Invalid(format!(
            "database url: sslmode \"{}\" is not one of {}",
            one_line(mode),
            SSL_MODES.join(", ")
        )));
    }
    let postgres = url.starts_with("postgres://") || url.starts_with("postgresql://");
    if !postgres || url.parse::<sqlx::postgres::PgConnectOptions>().is_err() {
        return Err(ConfigError::Invalid(
            "database url is not valid: expected postgres://user[:password]@host:port/database"
                .to_owned(),
        ));
    }
    Ok(())
}

impl Settings {
    /// The effective configuration as TOML, connection passwords redacted (`config check`).
    pub fn effective_toml(&self) -> String {
        #[derive(Serialize)]
        struct Effective<'a> {
            namespace: &'a str,
            default_timezone: &'a str,
            redis: RedisSettings,
            amqp: AmqpSettings,
            database: DatabaseSettings,
            worker: &'a WorkerSettings,
            admin: &'a AdminSettings,
            log: &'a LogSettings,
            telemetry: TelemetrySettings,
            rules: &'a [crate::rules::policy::Rule],
        }
        let mut redis = self.redis.clone();
        redis.url = redact_url(&redis.url);
        redis.cluster_urls = redis.cluster_urls.iter().map(|u| redact_url(u)).collect();
        let mut amqp = self.amqp.clone();
        amqp.url = redact_url(&amqp.url);
        let mut database = self.database.clone();
        database.url = redact_url(&database.url);
        let effective = Effective {
            namespace: &self.namespace,
            default_timezone: self.policy.default_zone.name(),
            redis,
            amqp,
            database,
            worker: &self.worker,
            admin: &self.admin,
            log: &self.log,
            telemetry: TelemetrySettings {
                otlp_endpoint: redact_url(&self.telemetry.otlp_endpoint),
            },
            rules: &self.policy.rules,
        };
        toml::to_string(&effective).unwrap_or_else(|e| format!("# cannot print settings: {e}\n"))
    }
}

/// A TOML error as one line. A numeric setting's value that its type cannot hold (negative,
/// beyond the type, beyond TOML's integers, not a whole number) is refused with the setting's
/// range, as a value out of range is; anything else says where, then what.
fn parse_error(path: &Path, text: &str, e: &toml::de::Error) -> ConfigError {
    let numeric = e.span().and_then(|span| numeric_value_at(text, span.start));
    match numeric {
        Some((setting, written)) => setting.refusal(&written),
        None => ConfigError::Parse {
            path: path.to_owned(),
            message: parse_message(text, e),
        },
    }
}

/// The numeric setting whose value (not key) is at byte `at` of `text`, and the value as
/// written: `key = value` on that line, in the table the last `[header]` above it opens (or
/// written as a dotted key).
fn numeric_value_at(text: &str, at: usize) -> Option<(&'static NumericSetting, &str)> {
    let at = (0..=at.min(text.len()))
        .rev()
        .find(|i| text.is_char_boundary(*i))?;
    let start = text[..at].rfind('\n').map_or(0, |i| i + 1);
    let end = text[at..].find('\n').map_or(text.len(), |i| at + i);
    let line = &text[start..end];
    let equals = line.find('=')?;
    if at < start + equals {
        return None;
    }
    let header = text[..start]
        .lines()
        .rev()
        .map(|l| l.split('#').next().unwrap_or("").trim())
        .find(|l| l.starts_with('['))
        .map_or("", |h| h.trim_matches(|c| c == '[' || c == ']').trim());
    let key = line[..equals].trim();
    let path: Vec<&str> = header
        .split('.')
        .chain(key.split('.'))
        .map(|p| p.trim().trim_matches('"'))
        .filter(|p| !p.is_empty())
        .collect();
    let [section, key] = path[..] else {
        return None;
    };
    let setting = NUMERIC_SETTINGS
        .iter()
        .find(|s| s.section == section && s.key == key)?;
    let value = line[equals + 1..].split('#').next().unwrap_or("").trim();
    Some((setting, value))
}

/// A TOML error as one line: where, then what.
fn parse_message(text: &str, e: &toml::de::Error) -> String {
    match e.span() {
        Some(span) => {
            let line = text[..span.start.min(text.len())].matches('\n').count() + 1;
            format!("line {line}: {}", one_line(e.message()))
        }
        None => one_line(e.message()),
    }
}

fn check_namespace(ns: &str) -> Result<(), ConfigError> {
    let ok = !ns.is_empty()
        && ns.len() <= 64
        && ns
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(ConfigError::BadNamespace(one_line(ns)))
    }
}

/// A URL with its password (user-info or `password=` parameter) replaced by `***`, for logs
/// and `config check`.
pub fn redact_url(url: &str) -> String {
    let url = redact_userinfo(url);
    match url.find("password=") {
        Some(start) => {
            let value = start + "password=".len();
            let end = url[value..].find('&').map_or(url.len(), |e| value + e);
            format!("{}***{}", &url[..value], &url[end..])
        }
        None => url,
    }
}

fn redact_userinfo(url: &str) -> String {
    // Whatever precedes the first '@' is user information; the password is after its last
    // ':' (past any "scheme://"). Redacting too much is harmless, too little is not.
    let Some(at) = url.find('@') else {
        return url.to_owned();
    };
    let start = url[..at].find("://").map_or(0, |i| i + 3);
    match url[start..at].rfind(':') {
        Some(colon) => format!("{}:***{}", &url[..start + colon], &url[at..]),
        None if start == 0 => format!("***{}", &url[at..]),
        None => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    #[test]
    fn no_file_means_the_headline_rule_in_utc() {
        let s = Settings::load(None, no_env).unwrap();
        assert_eq!(s.namespace, "sendquota");
        assert_eq!(s.policy.rules.len(), 1);
        assert_eq!(s.policy.rules[0].name, "headline");
        assert_eq!(s.policy.default_zone, chrono_tz::UTC);
    }

    #[test]
    fn environment_overrides_connection_settings_and_namespace() {
        let env = |k: &str| match k {
            "SENDQUOTA_REDIS_URL" => Some("redis://elsewhere:1".to_owned()),
            "SENDQUOTA_NAMESPACE" => Some("t1".to_owned()),
            _ => None,
        };
        let s =
            Settings::from_toml("namespace = \"file\"\n[redis]\nurl = \"redis://x\"", env).unwrap();
        assert_eq!(s.redis.url, "redis://elsewhere:1");
        assert_eq!(s.namespace, "t1");
    }

    #[test]
    fn passwords_are_redacted_from_urls() {
        assert_eq!(
            redact_url("amqp://guest:secret@host:5672/%2f"),
            "amqp://guest:***@host:5672/%2f"
        );
        assert_eq!(
            redact_url("redis://127.0.0.1:6379"),
            "redis://127.0.0.1:6379"
        );
        assert_eq!(
            redact_url("postgres://u@h/db?password=x&sslmode=off"),
            "postgres://u@h/db?password=***&sslmode=off"
        );
    }

    #[test]
    fn the_example_config_is_valid_and_states_the_defaults() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/config.example.toml");
        let s = Settings::load(Some(&path), no_env).unwrap();
        let defaults = Settings::load(None, no_env).unwrap();
        assert_eq!(s.policy.rules, defaults.policy.rules);
        assert_eq!(s.worker.dedup_ttl_secs, defaults.worker.dedup_ttl_secs);
        assert_eq!(s.amqp.prefetch, defaults.amqp.prefetch);
        assert_eq!(s.worker.threads, defaults.worker.threads);
        let text = std::fs::read_to_string(&path).unwrap();
        for setting in &NUMERIC_SETTINGS {
            let (min, max) = (setting.min, setting.max);
            assert!(
                text.lines()
                    .any(|l| l.starts_with(&format!("{} = ", setting.key))
                        && l.contains(&format!("# {min} to {max}"))),
                "the example states the range of {}",
                setting.key
            );
        }
    }

    #[test]
    fn a_value_its_type_cannot_hold_is_refused_with_the_setting_s_range() {
        for (text, got) in [
            ("[database]\nmax_connections = -1 # none\n", "-1"),
            (
                "[database]\nmax_connections = 99999999999999999999\n",
                "99999999999999999999",
            ),
            ("database.max_connections = 1e30\n", "1e30"),
            ("[database]\nmax_connections = \"8\"\n", "\"8\""),
        ] {
            assert_eq!(
                Settings::from_toml(text, no_env).unwrap_err().to_string(),
                format!("[database] max_connections must be between 1 and 1000 (got {got})"),
                "{text}"
            );
        }
        let twice = "[database]\nmax_connections = 2\nmax_connections = 3\n";
        let duplicate = Settings::from_toml(twice, no_env).unwrap_err().to_string();
        assert!(
            duplicate.starts_with("config file <inline>: line 3: "),
            "{duplicate}"
        );
    }

    #[test]
    fn json_logs_are_chosen_by_the_file_or_the_environment_which_wins() {
        let file = "[log]\nformat = \"json\"\n";
        assert_eq!(
            Settings::from_toml(file, no_env).unwrap().log.format,
            LogFormat::Json
        );
        let text = |k: &str| (k == "SENDQUOTA_LOG_FORMAT").then(|| "text".to_owned());
        assert_eq!(
            Settings::from_toml(file, text).unwrap().log.format,
            LogFormat::Text
        );
        let xml = |k: &str| (k == "SENDQUOTA_LOG_FORMAT").then(|| "xml".to_owned());
        assert_eq!(
            Settings::from_toml("", xml).unwrap_err().to_string(),
            "SENDQUOTA_LOG_FORMAT \"xml\" is not text or json"
        );
        let err = Settings::from_toml("[log]\nformat = \"xml\"\n", no_env).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("config file <inline>: line 2: unknown variant `xml`"),
            "{err}"
        );
    }

    #[test]
    fn hashed_recipients_need_a_key_from_the_environment_that_is_never_printed() {
        let file = "[log]\nrecipient = \"hash\"\n";
        assert_eq!(
            Settings::from_toml(file, no_env).unwrap_err().to_string(),
            "[log] recipient = \"hash\" needs SENDQUOTA_LOG_RECIPIENT_KEY, at least 16 characters"
        );
        let short = |k: &str| (k == "SENDQUOTA_LOG_RECIPIENT_KEY").then(|| "short".to_owned());
        assert!(Settings::from_toml(file, short).is_err());
        let secret = "log-key-0123456789-secret";
        let keyed = |k: &str| (k == "SENDQUOTA_LOG_RECIPIENT_KEY").then(|| secret.to_owned());
        let settings = Settings::from_toml(file, keyed).unwrap();
        assert_eq!(settings.log.recipient, RecipientLog::Hash);
        assert_eq!(settings.log.recipient_key.0, secret);
        assert!(!settings.effective_toml().contains(secret));
        assert!(!format!("{settings:?}").contains(secret));
        let in_file = "[log]\nrecipient_key = \"log-key-0123456789-secret\"\n";
        assert!(
            Settings::from_toml(in_file, no_env).is_err(),
            "the key is not read from the file"
        );
    }

    #[test]
    fn span_export_is_off_by_default_and_its_endpoint_comes_from_the_file_or_the_environment() {
        assert_eq!(
            Settings::load(None, no_env).unwrap().telemetry.traces_url(),
            None
        );
        let file = "[telemetry]\notlp_endpoint = \"http://collector:4318/\"\n";
        let from_file = Settings::from_toml(file, no_env).unwrap();
        assert_eq!(
            from_file.telemetry.traces_url().as_deref(),
            Some("http://collector:4318/v1/traces")
        );
        let standard = |k: &str| {
            (k == "OTEL_EXPORTER_OTLP_ENDPOINT").then(|| "http://standard:4318".to_owned())
        };
        let ours = |k: &str| match k {
            "SENDQUOTA_OTLP_ENDPOINT" => Some("http://ours:4318".to_owned()),
            _ => standard(k),
        };
        let endpoint = |env: &dyn Fn(&str) -> Option<String>| {
            Settings::from_toml(file, env)
                .unwrap()
                .telemetry
                .otlp_endpoint
        };
        // The platform-wide variable is not ours to follow.
        assert_eq!(endpoint(&standard), "http://collector:4318/");
        assert_eq!(endpoint(&ours), "http://ours:4318");
        let printed = from_file.effective_toml();
        assert!(
            printed.contains("[telemetry]\notlp_endpoint = \"http://collector:4318/\""),
            "{printed}"
        );
    }

    #[test]
    fn an_otlp_endpoint_that_is_not_plain_http_is_refused_naming_its_source() {
        let https =
            |k: &str| (k == "SENDQUOTA_OTLP_ENDPOINT").then(|| "https://collector:4318".to_owned());
        let platform_https = |k: &str| {
            (k == "OTEL_EXPORTER_OTLP_ENDPOINT").then(|| "https://collector:4318".to_owned())
        };
        assert!(Settings::from_toml("", platform_https).is_ok(), "not read");
        assert_eq!(
            Settings::from_toml("", https).unwrap_err().to_string(),
            "SENDQUOTA_OTLP_ENDPOINT \"https://collector:4318\" is not an http:// URL such \
             as http://127.0.0.1:4318 (spans are exported over plain HTTP only: run the collector \
             beside the worker)"
        );
        let file = "[telemetry]\notlp_endpoint = \"collector:4318\"\n";
        let err = Settings::from_toml(file, no_env).unwrap_err().to_string();
        assert!(
            err.starts_with("[telemetry] otlp_endpoint \"collector:4318\""),
            "{err}"
        );
    }

    #[test]
    fn a_namespace_with_a_colon_is_refused() {
        let env = |k: &str| (k == "SENDQUOTA_NAMESPACE").then(|| "a:b".to_owned());
        let err = Settings::load(None, env).unwrap_err();
        assert_eq!(
            err.to_string(),
            "namespace \"a:b\" must be 1 to 64 characters of letters, digits, '_', '-' and '.'"
        );
    }
}
