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
