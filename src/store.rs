//! The Redis connection: one server or a cluster, behind one type.
//!
//! Both are multiplexed, so concurrent script calls from many tasks are pipelined on one
//! socket. Scripts are always called by EVALSHA that loads the script and repeats the call on
//! NOSCRIPT (see `limiter::script::call`), so a Redis restart or failover that forgets
//! scripts costs one reload.

use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, Value};

use crate::config::RedisSettings;

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

/// The server's version, if it is one the scripts run on. Asked from inside Lua
/// (`redis.REDIS_VERSION`, itself new in 7.0), which works the same on one server and on a
/// cluster node.
pub async fn check_version(conn: &RedisConn) -> Result<String, VersionError> {
    let version: Option<String> = redis::cmd("EVAL")
        .arg("return redis.REDIS_VERSION")
        .arg(0)
        .query_async(&mut conn.clone())
        .await?;
    supported(version)
}

fn supported(version: Option<String>) -> Result<String, VersionError> {
    let Some(version) = version else {
        return Err(VersionError::TooOld("older than 7.0".to_owned()));
    };
    let major = version
        .split('.')
        .next()
        .and_then(|m| m.parse::<u32>().ok());
    match major {
        Some(m) if m >= MIN_REDIS_MAJOR => Ok(version),
        _ => Err(VersionError::TooOld(version)),
    }
}

/// A Redis connection usable by scripts and commands alike; cheap to clone.
#[derive(Clone)]
pub enum RedisConn {
    /// A single server, reconnecting by itself.
    Single(ConnectionManager),
    /// A Redis Cluster; keys of one scope share a hash tag and so a slot.
    Cluster(ClusterConnection),
}

impl RedisConn {
    /// Connects as the settings say: the cluster seeds if any are given, else the single URL.
    pub async fn connect(settings: &RedisSettings) -> redis::RedisResult<RedisConn> {
        let timeout = Duration::from_millis(settings.response_timeout_ms);
        if settings.cluster_urls.is_empty() {
            let client = redis::Client::open(settings.url.as_str())?;
            let config = ConnectionManagerConfig::new()
                .set_response_timeout(Some(timeout))
                .set_connection_timeout(Some(timeout))
                .set_number_of_retries(2);
            Ok(RedisConn::Single(
                client.get_connection_manager_with_config(config).await?,
            ))
        } else {
            let client = ClusterClient::builder(settings.cluster_urls.iter().map(String::as_str))
                .connection_timeout(timeout)
                .response_timeout(timeout)
                .retries(3)
                .build()?;
            Ok(RedisConn::Cluster(client.get_async_connection().await?))
        }
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
    fn redis_7_and_later_are_supported_and_older_servers_are_named_in_the_error() {
        assert_eq!(supported(Some("7.0.15".into())).ok(), Some("7.0.15".into()));
        assert_eq!(supported(Some("8.2.1".into())).ok(), Some("8.2.1".into()));
        assert_eq!(
            supported(None).map_err(|e| e.to_string()),
            Err("redis older than 7.0 is too old: sendquota needs Redis 7.0 or later".into())
        );
        assert_eq!(
            supported(Some("6.2.14".into())).map_err(|e| e.to_string()),
            Err("redis 6.2.14 is too old: sendquota needs Redis 7.0 or later".into())
        );
    }
}
