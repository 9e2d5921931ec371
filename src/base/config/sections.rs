//! The settings' tables as the file writes them, each with its defaults: what a deployment can
//! set, apart from how it is checked (`ranges`, `checks`) and overridden (`env`).

use serde::{Deserialize, Serialize};

use crate::base::tls::TlsFiles;
use crate::request::message::DEFAULT_MAX_BODY_BYTES;

/// Default Redis URL, the local server.
pub const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379";
/// Default broker URL, the local RabbitMQ with its default account and vhost.
pub const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
/// Default database URL, the local Postgres.
pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/sendquota";
/// Default namespace for queue, exchange and key names.
pub const DEFAULT_NAMESPACE: &str = "sendquota";

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
    /// Replicas every committing call waits for (Redis `WAIT`), 0 for none: Redis replicates
    /// asynchronously, so a quota write a master acknowledged and died before copying is lost
    /// at a failover; waiting for a replica narrows that to a replica lost with it.
    pub wait_replicas: u32,
    /// Longest wait for those replicas after a call, in milliseconds; past it the decision
    /// stands unreplicated (counted in `sendquota_redis_unreplicated_total`).
    pub wait_timeout_ms: u64,
    /// Certificate files for `rediss://` URLs.
    pub tls: TlsFiles,
}

/// Broker settings.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct AmqpSettings {
    /// The broker URL.
    pub url: String,
    /// The nodes of a RabbitMQ cluster, tried in turn: a connection goes to the first that
    /// answers, and moves on to the next when its node goes away. When non-empty, `url` is
    /// ignored.
    pub urls: Vec<String>,
    /// Deliveries the broker may hand the worker before acks (the consumer's prefetch).
    pub prefetch: u16,
    /// Queue type of the requests and invalid queues: `quorum` (survives a node loss) or
    /// `classic`.
    pub queue_type: QueueType,
    /// Certificate files for an `amqps://` URL.
    pub tls: TlsFiles,
}

impl AmqpSettings {
    /// The URLs connections try, in order: `urls`, or `url` alone when `urls` is empty. One
    /// place decides, so every role (worker, CLI, console) reaches the same nodes.
    pub fn broker_urls(&self) -> &[String] {
        if self.urls.is_empty() {
            std::slice::from_ref(&self.url)
        } else {
            &self.urls
        }
    }
}

/// How requests come in: one queue, or shards that keep each recipient's messages in order
/// across workers.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct IntakeSettings {
    /// Request queues: 1 (the default) is one queue all workers share, where a recipient's
    /// messages are decided in the order they arrive at the workers; N > 1 hashes each
    /// message's recipient header to one of N single-active-consumer queues, so that with
    /// several workers a recipient's messages are still decided in the order they were
    /// published (docs/decisions.md, "Ordered intake across workers").
    pub shards: u16,
}

impl Default for IntakeSettings {
    fn default() -> Self {
        IntakeSettings { shards: 1 }
    }
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
    /// The database URL: the primary, which every write goes to.
    pub url: String,
    /// A read-only database URL (a streaming replica) that operator reads use: `denials`,
    /// the admin API's listing, the console, `rules history`, `digests`, `replay --dry-run`.
    /// Empty: they read `url`. Lets operators query history without loading the primary the
    /// workers write to; a read that feeds a write (replay's claim) still reads the primary.
    pub read_url: String,
    /// Size of the connection pool (the read pool's too).
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
            wait_replicas: 0,
            wait_timeout_ms: 100,
            tls: TlsFiles::default(),
        }
    }
}

impl Default for AmqpSettings {
    fn default() -> Self {
        AmqpSettings {
            url: DEFAULT_AMQP_URL.to_owned(),
            urls: Vec::new(),
            prefetch: 1000,
            queue_type: QueueType::Quorum,
            tls: TlsFiles::default(),
        }
    }
}

impl Default for DatabaseSettings {
    fn default() -> Self {
        DatabaseSettings {
            url: DEFAULT_DATABASE_URL.to_owned(),
            read_url: String::new(),
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
            concurrency: 1000,
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
            denial_batch_wait_ms: 10,
            digest_flush_interval_ms: 5_000,
            max_digest_bytes: DEFAULT_MAX_DIGEST_BYTES,
        }
    }
}

/// The default of `worker.max_digest_bytes`: 4 KiB below the 128 KiB `max_message_size` that
/// deploy/rabbitmq/rabbitmq.conf sets, so a digest is never refused by a broker set up as
/// recommended (RabbitMQ measures the body; the headroom covers a broker or proxy that counts
/// the properties too), and one held request of the largest default body (64 KiB) fits.
pub const DEFAULT_MAX_DIGEST_BYTES: usize = 126_976;
