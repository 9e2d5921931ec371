//! The Redis connection: one server or a cluster, behind one type.
//!
//! Both are redis-rs multiplexed connections (a `ConnectionManager` on one server, which reconnects
//! by itself; cluster-async on a cluster), so concurrent script calls from many tasks are pipelined
//! on one socket. A command in flight when a link drops fails; the caller retries the message, as
//! after any Redis failure. `rediss://` URLs speak TLS with the certificate files of
//! [`RedisSettings::tls`]. Scripts are always called by EVALSHA that loads the script and repeats
//! the call on NOSCRIPT (see `limiter::script::call`), so a Redis restart or failover that forgets
//! scripts costs one reload.
//!
//! No call waits longer than the response timeout (`response_timeout_ms`), reconnecting
//! included: a message that fails open (`on_unavailable = "allow"`) goes out that soon, and the
//! messages to its recipient queued behind it each as soon. See [`SingleServer`] for how.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{
    Client, Cmd, ErrorKind, IntoConnectionInfo, Pipeline, RedisError, RedisFuture, RedisResult,
    Value,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::base::config::RedisSettings;
use crate::base::tls::TlsFiles;

/// Longest a start-up failure's diagnosis may take (a plaintext `PING` to the server that did
/// not complete a TLS handshake): the local network answers in far less.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// Why the Redis connection could not be opened at start. Each is one line naming the server
/// and the cause; none repeats a URL (it may hold a password).
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The client failed (refused connection, certificates, authentication, ...).
    #[error("{0}")]
    Redis(#[from] RedisError),
    /// The server could not be reached, or did not finish the handshake within the connect
    /// timeout.
    #[error("connecting to {address}{over}: {cause}")]
    Connect {
        /// `host:port` of the server (the first seed of a cluster).
        address: String,
        /// " over TLS" for `rediss://`, else empty.
        over: &'static str,
        /// The I/O error, or how long was waited.
        cause: String,
    },
    /// A `rediss://` URL names a server that answers plaintext Redis: no TLS handshake can
    /// succeed, however long it is retried.
    #[error(
        "TLS handshake with {address} failed ({cause}): the server speaks plaintext Redis, not \
         TLS (use redis://)"
    )]
    PlaintextServer {
        /// `host:port` of the server.
        address: String,
        /// What the TLS client saw: a timeout, or a record it could not read.
        cause: String,
    },
}

/// A client for one server's `url`: TLS with `tls`'s certificates for `rediss://`. Also used
/// for the deny cache's pub/sub connection, which must reach the same server the same way.
pub fn client(url: &str, tls: &TlsFiles) -> RedisResult<Client> {
    if url.starts_with("rediss://") {
        Client::build_with_tls(url, tls.redis().map_err(tls_error)?)
    } else {
        Client::open(url)
    }
}

fn tls_error(e: crate::base::tls::TlsError) -> RedisError {
    RedisError::from((ErrorKind::InvalidClientConfig, "tls", e.to_string()))
}

/// The oldest Redis the decision scripts run on: they raise expiries with `PEXPIRE ... GT`,
/// which Redis 7.0 introduced. An older server would fail every decision, so the worker
/// refuses to start against one.
pub const MIN_REDIS_MAJOR: u32 = 7;

/// Why the worker will not use a Redis server.
#[derive(Debug, thiserror::Error)]
pub enum VersionError {
    /// The server is older than [`MIN_REDIS_MAJOR`].
    #[error("redis {0} is too old: sendquota needs Redis {MIN_REDIS_MAJOR}.0 or later")]
    TooOld(String),
    /// The version could not be read.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
}

/// The server's version when it is one the scripts run on; on a cluster, the oldest among the
/// masters (redis-rs sends `INFO` to each of them). `None` when no version is reported (a
/// Redis-compatible server that hides it): that is left to the scripts to show.
pub async fn check_version(conn: &RedisConn) -> Result<Option<String>, VersionError> {
    let reply: Value = redis::cmd("INFO")
        .arg("server")
        .query_async(&mut conn.clone())
        .await?;
    let mut texts = Vec::new();
    strings(reply, &mut texts);
    let versions: Vec<String> = texts
        .iter()
        .filter_map(|text| {
            text.lines()
                .find_map(|line| line.strip_prefix("redis_version:"))
                .map(|v| v.trim().to_owned())
        })
        .collect();
    for version in &versions {
        supported(version)?;
    }
    Ok(versions.into_iter().min_by_key(|v| semver(v)))
}

/// Every string in a reply: one `INFO` text from a server, one per master from a cluster.
fn strings(reply: Value, out: &mut Vec<String>) {
    match reply {
        Value::BulkString(bytes) => out.push(String::from_utf8_lossy(&bytes).into_owned()),
        Value::SimpleString(text) | Value::VerbatimString { text, .. } => out.push(text),
        Value::Array(items) => items.into_iter().for_each(|v| strings(v, out)),
        Value::Map(entries) => entries.into_iter().for_each(|(_, v)| strings(v, out)),
        _ => {}
    }
}

/// A version's numbers, for comparing: "7.10.0" is newer than "7.9.1".
fn semver(version: &str) -> Vec<u32> {
    version.split('.').map(|p| p.parse().unwrap_or(0)).collect()
}

fn supported(version: &str) -> Result<(), VersionError> {
    match version
        .split('.')
        .next()
        .and_then(|m| m.parse::<u32>().ok())
    {
        Some(major) if major >= MIN_REDIS_MAJOR => Ok(()),
        _ => Err(VersionError::TooOld(version.to_owned())),
    }
}

/// A Redis connection usable by scripts and commands alike; cheap to clone.
#[derive(Clone)]
pub enum RedisConn {
    /// A single server, reconnecting by itself.
    Single(SingleServer),
    /// A Redis Cluster; keys of one scope share a hash tag and so a slot. Its calls are
    /// bounded as a whole (retries, redirections and reconnects included) by the response
    /// timeout, redis-rs's `overall_response_timeout`.
    Cluster(ClusterServer),
}

/// A Redis Cluster's connection: redis-rs's cluster-async connection, opened anew when the calls
/// on one hash tag, or on the whole cluster, have timed out for [`ClusterServer::stuck_after`]
/// without an answer.
///
/// redis-rs 1.8's cluster connection can stop for good at a failover under load: while it
/// refreshes the slot map it polls nothing else, and the refresh waits for the write half of
/// a lock (a fair tokio `RwLock`) that was already handed to a request or a reconnect that is
/// no longer polled. Every call then times out, on every shard, until the process restarts
/// (docs/guarantees.md has the minimal case); sometimes only one shard's calls stop. Its API
/// offers no way to reset the connection, so a stuck one is replaced by a new one from the
/// same client; calls made meanwhile fail as while any Redis is away. A shard whose master is
/// down until its replica is promoted looks the same for that long: the new connection it
/// costs then is harmless.
#[derive(Clone)]
pub struct ClusterServer {
    shared: Arc<ClusterShared>,
}

/// What every clone of a [`ClusterServer`] shares.
struct ClusterShared {
    client: ClusterClient,
    current: RwLock<ClusterConnection>,
    /// When a call was last answered, in milliseconds since `origin`.
    answered_ms: AtomicU64,
    /// Per hash tag whose calls time out: when the first did since one was last answered (ms
    /// since `origin`). Emptied when the connection is opened anew.
    timing_out: Mutex<HashMap<Vec<u8>, u64>>,
    /// Whether `timing_out` holds any tag: an answer, the common case, then takes no lock.
    any_timing_out: AtomicBool,
    origin: Instant,
    /// Set while a new connection is being opened: one at a time.
    reopening: AtomicBool,
    stuck_after: Duration,
    timeout: Duration,
    wait: Option<ReplicaWait>,
}

impl ClusterServer {
    /// The shortest silence after which a connection counts as stuck: two response timeouts,
    /// and at least 2 s, so that a tag counts only when its calls keep timing out, not for the
    /// one call in flight when a master dies.
    pub fn stuck_after(timeout: Duration) -> Duration {
        (timeout * 2).max(Duration::from_secs(2))
    }

    /// The connection calls go to now (for commands routed by hand: every master, a node).
    pub fn connection(&self) -> ClusterConnection {
        // A panic while the lock was held cannot leave the connection half-written.
        let current = self
            .shared
            .current
            .read()
            .unwrap_or_else(|e| e.into_inner());
        current.clone()
    }

    /// Notes how a call on `tag` ended: an answer of any kind shows the connection works for
    /// it; a timeout after [`ClusterServer::stuck_after`] without an answer, on the tag or on
    /// the whole cluster, opens a new connection beside the calls.
    fn observe<T>(&self, tag: Option<&[u8]>, reply: &RedisResult<T>) {
        let shared = &self.shared;
        let now_ms = u64::try_from(shared.origin.elapsed().as_millis()).unwrap_or(u64::MAX);
        let timed_out = matches!(reply, Err(e) if e.is_timeout());
        if !timed_out {
            shared.answered_ms.store(now_ms, Ordering::Relaxed);
        }
        let since_answer = now_ms.saturating_sub(shared.answered_ms.load(Ordering::Relaxed));
        let on_tag = tag.map_or(0, |tag| {
            if !timed_out && !shared.any_timing_out.load(Ordering::Relaxed) {
                return 0;
            }
            let mut timing_out = shared.timing_out.lock().unwrap_or_else(|e| e.into_inner());
            if !timed_out {
                timing_out.remove(tag);
            } else if timing_out.len() >= MAX_TAGS_TIMING_OUT {
                timing_out.clear();
            }
            let first = timed_out.then(|| *timing_out.entry(tag.to_vec()).or_insert(now_ms));
            shared
                .any_timing_out
                .store(!timing_out.is_empty(), Ordering::Relaxed);
            first.map_or(0, |first| now_ms.saturating_sub(first))
        });
        let silent = since_answer.max(on_tag);
        if timed_out
            && Duration::from_millis(silent) >= shared.stuck_after
            && !shared.reopening.swap(true, Ordering::AcqRel)
        {
            tokio::spawn(self.clone().reopen(silent));
        }
    }

    /// Replaces the connection by a new one, after `silent_ms` without an answer.
    async fn reopen(self, silent_ms: u64) {
        let shared = &self.shared;
        let opened = tokio::time::timeout(shared.timeout * 2, shared.client.get_async_connection());
        match opened.await {
            Ok(Ok(connection)) => {
                *shared.current.write().unwrap_or_else(|e| e.into_inner()) = connection;
                tracing::warn!(
                    silent_ms,
                    "Redis Cluster calls kept timing out without an answer; \
                    opened a new cluster connection"
                );
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "could not open a new Redis Cluster connection")
            }
            Err(_) => tracing::warn!("opening a new Redis Cluster connection timed out"),
        }
        let now_ms = u64::try_from(shared.origin.elapsed().as_millis()).unwrap_or(u64::MAX);
        // The next attempt waits for another silence as long.
        shared.answered_ms.store(now_ms, Ordering::Relaxed);
        shared
            .timing_out
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        shared.any_timing_out.store(false, Ordering::Relaxed);
        shared.reopening.store(false, Ordering::Release);
    }
}

/// Hash tags followed at most at once: past it, the timing-out ones are forgotten.
const MAX_TAGS_TIMING_OUT: usize = 10_000;

/// The first hash tag among `cmd`'s arguments: every key the worker names has one, and keys
/// come before values in every command it sends, so it is the tag of the call's shard. `None`
/// for a command without one.
fn first_tag(cmd: &Cmd) -> Option<&[u8]> {
    cmd.args_iter().find_map(|arg| match arg {
        redis::Arg::Simple(bytes) => hash_tag(bytes),
        _ => None,
    })
}

/// The part of `key` between its first `{` and the next `}`, when not empty (Redis Cluster's
/// rule for which part of a key picks its slot).
fn hash_tag(key: &[u8]) -> Option<&[u8]> {
    let open = key.iter().position(|&b| b == b'{')?;
    let close = key[open + 1..].iter().position(|&b| b == b'}')?;
    Some(&key[open + 1..open + 1 + close]).filter(|tag| !tag.is_empty())
}

impl ConnectionLike for ClusterServer {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        let mut connection = self.connection();
        Box::pin(async move {
            let reply = connection.req_packed_command(cmd).await;
            self.observe(first_tag(cmd), &reply);
            reply
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        let mut connection = self.connection();
        Box::pin(async move {
            let replies = connection
                .req_packed_commands(pipeline, offset, count)
                .await;
            self.observe(None, &replies);
            replies
        })
    }

    fn get_db(&self) -> i64 {
        self.connection().get_db()
    }
}

/// A single server's connection: redis-rs's `ConnectionManager`, reconnecting with one connect
/// attempt at a time, and every call bounded by the response timeout.
///
/// The manager makes every call await its current connection future, and after a lost link
/// that future is the reconnect itself: with retries it was the whole backoff chain (about
/// 6.6 s against a stopped server, whatever the response timeout), which each call waited out,
/// and each failed chain started the next for the next call. With one attempt per reconnect a
/// call waits at most for the attempt under way, and redis-rs starts the next attempt beside
/// the calls, when one fails. A call that meets the refusal of an earlier attempt is made once
/// more, on the attempt it just started: a refused connect sent nothing, and so the first call
/// after Redis is back is answered instead of failing on an old refusal.
#[derive(Clone)]
pub struct SingleServer {
    manager: ConnectionManager,
    /// The response timeout: the longest any call waits, reconnecting included.
    timeout: Duration,
    wait: Option<ReplicaWait>,
}

/// `call`, cut off once `limit` has passed with the error redis-rs's own timeouts give (a
/// timed-out I/O error), which callers take for an unavailable Redis.
///
/// `call` awaits the manager's calls through `ConnectionLike`, which boxes each one: the
/// manager's call state is kilobytes, and held inline it would be copied whole each time a
/// future holding it is built or moved (this box, the timeout, `call` itself), on every call.
fn within<'a, T: Send + 'a>(
    limit: Duration,
    call: impl std::future::Future<Output = RedisResult<T>> + Send + 'a,
) -> RedisFuture<'a, T> {
    Box::pin(async move {
        tokio::time::timeout(limit, call)
            .await
            .unwrap_or_else(|_| Err(std::io::Error::from(std::io::ErrorKind::TimedOut).into()))
    })
}

impl ConnectionLike for SingleServer {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        let manager = &mut self.manager;
        within(self.timeout, async move {
            match manager.req_packed_command(cmd).await {
                Err(e) if e.is_connection_refusal() => manager.req_packed_command(cmd).await,
                reply => reply,
            }
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        let manager = &mut self.manager;
        within(self.timeout, async move {
            match manager.req_packed_commands(pipeline, offset, count).await {
                Err(e) if e.is_connection_refusal() => {
                    manager.req_packed_commands(pipeline, offset, count).await
                }
                reply => reply,
            }
        })
    }

    fn get_db(&self) -> i64 {
        self.manager.get_db()
    }
}

impl RedisConn {
    /// Connects as the settings say: the cluster seeds if any are given, else the single URL.
    /// The first attempt is bounded by the connect timeout (`response_timeout_ms`) and its
    /// failure is reported at once, with its cause; retries with backoff are for reconnecting
    /// later, when a server that was there comes back.
    pub async fn connect(settings: &RedisSettings) -> Result<RedisConn, ConnectError> {
        let timeout = Duration::from_millis(settings.response_timeout_ms);
        let connected = if settings.cluster_urls.is_empty() {
            Self::connect_single(settings, timeout).await
        } else {
            Self::connect_cluster(settings, timeout).await
        };
        match connected {
            Ok(conn) => Ok(conn),
            Err(e) => {
                let first = settings.cluster_urls.first().unwrap_or(&settings.url);
                Err(explain(e, first, timeout).await)
            }
        }
    }

    async fn connect_single(settings: &RedisSettings, timeout: Duration) -> RedisResult<RedisConn> {
        let client = client(&settings.url, &settings.tls)?;
        // No retries: a call would wait for them (see `SingleServer`), and the first connect
        // is one attempt, whose failure is reported at once. No response timeout of the
        // manager's own: `SingleServer` bounds every call, reconnecting included, by the same
        // duration, and a second timer per call would only cost its registration.
        let config = ConnectionManagerConfig::new()
            .set_number_of_retries(0)
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(None);
        Ok(RedisConn::Single(SingleServer {
            manager: ConnectionManager::new_with_config(client, config).await?,
            timeout,
            wait: ReplicaWait::of(settings),
        }))
    }

    async fn connect_cluster(
        settings: &RedisSettings,
        timeout: Duration,
    ) -> RedisResult<RedisConn> {
        let mut builder = ClusterClient::builder(settings.cluster_urls.iter().map(String::as_str))
            .connection_timeout(timeout)
            .response_timeout(timeout)
            .overall_response_timeout(Some(timeout))
            .retries(3);
        // The configuration refuses seeds that mix TLS and plaintext.
        if settings
            .cluster_urls
            .iter()
            .any(|u| u.starts_with("rediss://"))
        {
            builder = builder.certs(settings.tls.redis().map_err(tls_error)?);
        }
        let client = builder.build()?;
        let connection = client.get_async_connection().await?;
        let shared = ClusterShared {
            client,
            current: RwLock::new(connection),
            answered_ms: AtomicU64::new(0),
            timing_out: Mutex::new(HashMap::new()),
            any_timing_out: AtomicBool::new(false),
            origin: Instant::now(),
            reopening: AtomicBool::new(false),
            stuck_after: ClusterServer::stuck_after(timeout),
            timeout,
            wait: ReplicaWait::of(settings),
        };
        Ok(RedisConn::Cluster(ClusterServer {
            shared: Arc::new(shared),
        }))
    }
}

/// Seconds between two log lines about unreplicated writes.
const UNREPLICATED_LOG_INTERVAL_S: u64 = 10;

/// When an unreplicated write was last logged, in seconds since the epoch.
static UNREPLICATED_LOGGED_S: AtomicU64 = AtomicU64::new(0);

/// How many replicas a committing call waits for, and how long at most (`redis.wait_replicas`,
/// `redis.wait_timeout_ms`). Redis replicates asynchronously: a master that acknowledged a
/// quota write and died before a replica copied it loses the write at the failover, and the
/// recipient could be sent one message more. `WAIT` on the connection that wrote, after the
/// write, returns once that many replicas hold it (or the timeout passed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplicaWait {
    /// Replicas to wait for.
    pub replicas: u32,
    /// Longest wait, in milliseconds.
    pub timeout_ms: u64,
}

impl ReplicaWait {
    fn of(settings: &RedisSettings) -> Option<ReplicaWait> {
        (settings.wait_replicas > 0).then_some(ReplicaWait {
            replicas: settings.wait_replicas,
            timeout_ms: settings.wait_timeout_ms,
        })
    }

    /// Appends the wait to `pipe`, a committing call's commands: in one pipeline the `WAIT`
    /// goes down the same connection, to the same node (on a cluster, the node of the
    /// pipeline's keys), right after the write it is for.
    pub fn append_to(self, pipe: &mut Pipeline) {
        pipe.cmd("WAIT").arg(self.replicas).arg(self.timeout_ms);
    }

    /// [`ReplicaWait::check`] of `WAIT`'s reply in a pipeline's replies (its last), which is
    /// a count of replicas; anything else counts as none.
    pub fn check_reply(self, reply: Option<&Value>) {
        self.check(match reply {
            Some(Value::Int(n)) => *n,
            _ => 0,
        });
    }

    /// Notes `WAIT`'s reply, the replicas that acknowledged: fewer than asked for is counted
    /// and logged, and the decision stands (it is on the master; failing it now would make
    /// the retry count the message twice).
    pub fn check(self, acknowledged: i64) {
        if acknowledged >= i64::from(self.replicas) {
            return;
        }
        metrics::counter!(crate::base::telemetry::REDIS_UNREPLICATED).increment(1);
        // While a replica is gone every call comes here: one line in each interval says so,
        // the metric counts them all.
        let now_s = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let last = UNREPLICATED_LOGGED_S.load(Ordering::Relaxed);
        if now_s >= last.saturating_add(UNREPLICATED_LOG_INTERVAL_S)
            && UNREPLICATED_LOGGED_S
                .compare_exchange(last, now_s, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            tracing::warn!(
                acknowledged,
                wanted = self.replicas,
                timeout_ms = self.timeout_ms,
                "a Redis write was not acknowledged by enough replicas in time; it stands \
                 (sendquota_redis_unreplicated_total counts every such write)"
            );
        }
    }
}

/// A failed connect to `url` as the operator needs it: a `rediss://` server that answers
/// plaintext is named as such, and an I/O failure (a timeout says how long was waited) names
/// the server.
async fn explain(e: RedisError, url: &str, timeout: Duration) -> ConnectError {
    let tls = url.starts_with("rediss://");
    let Some(address) = url
        .into_connection_info()
        .ok()
        .map(|i| i.addr().to_string())
    else {
        return ConnectError::Redis(e);
    };
    let after =
        crate::rules::kinds::human_ms(i64::try_from(timeout.as_millis()).unwrap_or(i64::MAX));
    let cause = if e.is_timeout() {
        format!("timed out after {after}")
    } else {
        crate::request::message::one_line(&e.to_string())
    };
    if tls && answers_plaintext(&address, timeout.min(PROBE_TIMEOUT)).await {
        return ConnectError::PlaintextServer { address, cause };
    }
    if e.is_io_error() {
        let over = if tls { " over TLS" } else { "" };
        return ConnectError::Connect {
            address,
            over,
            cause,
        };
    }
    ConnectError::Redis(e)
}

/// Whether the server at `address` answers a plaintext `PING` as Redis does (with a reply or
/// an error such as NOAUTH) within `limit`.
async fn answers_plaintext(address: &str, limit: Duration) -> bool {
    let probe = async {
        let mut stream = tokio::net::TcpStream::connect(address).await.ok()?;
        stream.write_all(b"PING\r\n").await.ok()?;
        let mut first = [0u8; 1];
        stream.read_exact(&mut first).await.ok()?;
        Some(matches!(first[0], b'+' | b'-'))
    };
    matches!(tokio::time::timeout(limit, probe).await, Ok(Some(true)))
}

impl RedisConn {
    /// The replicas committing calls wait for, if the settings ask for any.
    pub fn replica_wait(&self) -> Option<ReplicaWait> {
        match self {
            RedisConn::Single(c) => c.wait,
            RedisConn::Cluster(c) => c.shared.wait,
        }
    }

    /// Sends `cmd`, a committing call, and with [`RedisConn::replica_wait`] waits for the
    /// replicas after it, in one pipeline; the reply is `cmd`'s.
    pub async fn query_committing<T: redis::FromRedisValue>(
        &mut self,
        cmd: &Cmd,
    ) -> RedisResult<T> {
        let Some(wait) = self.replica_wait() else {
            return cmd.query_async(self).await;
        };
        let mut pipe = redis::pipe();
        pipe.add_command(cmd.clone());
        wait.append_to(&mut pipe);
        let (reply, acknowledged): (T, i64) = pipe.query_async(self).await?;
        wait.check(acknowledged);
        Ok(reply)
    }
}

impl ConnectionLike for RedisConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            RedisConn::Single(c) => c.req_packed_command(cmd),
            RedisConn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            RedisConn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            RedisConn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            RedisConn::Single(c) => c.get_db(),
            RedisConn::Cluster(c) => c.get_db(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_calls_shard_is_named_by_the_first_hash_tag_among_its_arguments() {
        let keys = [
            "abc",
            "2",
            "ns:{alice}:day",
            "ns:{bob}:week",
            "{\"json\": 1}",
        ];
        let script = keys.iter().fold(redis::cmd("SCRIPTED"), |mut c, a| {
            c.arg(*a);
            c
        });
        assert_eq!(first_tag(&script), Some(&b"alice"[..]));
        assert_eq!(first_tag(&redis::cmd("GET").arg("a{}b{c}").clone()), None);
        assert_eq!(first_tag(&redis::cmd("GET").arg("plain").clone()), None);
        assert_eq!(first_tag(&redis::cmd("PING").clone()), None);
    }

    #[test]
    fn redis_7_and_later_are_supported_and_older_servers_are_named_in_the_error() {
        assert!(supported("7.0.15").is_ok());
        assert!(supported("8.2.1").is_ok());
        assert_eq!(
            supported("6.2.14").map_err(|e| e.to_string()),
            Err("redis 6.2.14 is too old: sendquota needs Redis 7.0 or later".into())
        );
    }

    #[test]
    fn every_info_text_of_a_reply_is_found_and_versions_compare_by_number() {
        let mut texts = Vec::new();
        strings(
            Value::Map(vec![
                (
                    Value::SimpleString("a:1".into()),
                    Value::VerbatimString {
                        format: redis::VerbatimFormat::Text,
                        text: "redis_version:7.0.15\r\n".into(),
                    },
                ),
                (
                    Value::SimpleString("b:2".into()),
                    Value::BulkString(b"redis_version:7.10.0\r\n".to_vec()),
                ),
            ]),
            &mut texts,
        );
        assert_eq!(
            texts,
            ["redis_version:7.0.15\r\n", "redis_version:7.10.0\r\n"]
        );
        assert!(semver("7.10.0") > semver("7.9.1"));
    }
}
