//! The Redis side: the deployments tests run against (the single server and the cluster), and
//! the keys a test's namespace holds.

use redis::AsyncCommands;
use sendquota::config::RedisSettings;
use sendquota::internals::store::RedisConn;

use super::{redis_url, TestEnv, START_HINT};

impl TestEnv {
    /// Every Redis key of this test's namespace (on every master of a cluster).
    pub async fn keys(&self) -> Vec<String> {
        all_keys(&self.redis, &format!("{}:*", self.namespace))
            .await
            .expect("scan keys")
    }

    /// Keys of this namespace that have no expiry: a test fails on any.
    pub async fn keys_without_expiry(&self) -> Vec<String> {
        let mut out = Vec::new();
        let mut conn = self.redis.clone();
        for key in self.keys().await {
            let ttl: i64 = redis::cmd("PTTL")
                .arg(&key)
                .query_async(&mut conn)
                .await
                .expect("pttl");
            if ttl == -1 {
                out.push(key);
            }
        }
        out
    }
}

/// Settings for the shared single Redis server.
pub fn single_settings() -> RedisSettings {
    RedisSettings {
        url: redis_url(),
        ..RedisSettings::default()
    }
}

/// Seed URLs of the private Redis Cluster the test script starts.
pub fn cluster_urls() -> Vec<String> {
    match std::env::var("SENDQUOTA_TEST_REDIS_CLUSTER_URLS") {
        Ok(urls) if !urls.trim().is_empty() => urls.split(',').map(str::to_owned).collect(),
        _ => panic!(
            "SENDQUOTA_TEST_REDIS_CLUSTER_URLS is not set: run the suite with \
             `deploy/local/test.sh`, which starts a private 3-master Redis Cluster, or start one \
             with `deploy/local/redis-cluster.sh start DIR` and export the URLs it prints"
        ),
    }
}

/// Settings for the test Redis Cluster.
pub fn cluster_settings() -> RedisSettings {
    RedisSettings {
        cluster_urls: cluster_urls(),
        ..RedisSettings::default()
    }
}

/// The Redis deployments limiter tests run against: the single server and the cluster.
pub fn redis_targets() -> Vec<(&'static str, RedisSettings)> {
    vec![
        ("single", single_settings()),
        ("cluster", cluster_settings()),
    ]
}

/// Connects to a target, failing with the way to start it.
pub async fn connect_redis(settings: &RedisSettings) -> RedisConn {
    RedisConn::connect(settings).await.unwrap_or_else(|e| {
        panic!(
            "redis not reachable ({:?} / {:?}): {e}; {START_HINT}",
            settings.url, settings.cluster_urls
        )
    })
}

/// Every member of the sorted set at `key`, lowest score first (quota entries, dispatch marks).
pub async fn zset_members(conn: &mut impl redis::aio::ConnectionLike, key: &str) -> Vec<String> {
    redis::cmd("ZRANGE")
        .arg(key)
        .arg(0)
        .arg(-1)
        .query_async(conn)
        .await
        .expect("zrange")
}

/// Keys matching `pattern`, on every master when `conn` is a cluster (SCAN on a cluster
/// connection would only visit one node).
pub async fn all_keys(conn: &RedisConn, pattern: &str) -> redis::RedisResult<Vec<String>> {
    match conn {
        RedisConn::Single(c) => {
            let mut c = c.clone();
            let mut iter = c.scan_match::<_, String>(pattern).await?;
            let mut keys = Vec::new();
            while let Some(k) = iter.next_item().await {
                keys.push(k?);
            }
            Ok(keys)
        }
        RedisConn::Cluster(c) => {
            use redis::cluster_routing::{
                MultipleNodeRoutingInfo, RoutingInfo, SingleNodeRoutingInfo,
            };
            let mut c = c.connection();
            let all = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
            let redis::Value::Map(nodes) = c.route_command(redis::cmd("DBSIZE"), all).await? else {
                return Ok(Vec::new());
            };
            let mut keys = Vec::new();
            for (addr, _) in nodes {
                let addr: String = redis::from_redis_value(addr)?;
                let Some((host, port)) = addr.rsplit_once(':') else {
                    continue;
                };
                let Ok(port) = port.parse::<u16>() else {
                    continue;
                };
                let mut cursor = 0u64;
                loop {
                    let route = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                        host: host.to_owned(),
                        port,
                    });
                    let mut cmd = redis::cmd("SCAN");
                    cmd.arg(cursor)
                        .arg("MATCH")
                        .arg(pattern)
                        .arg("COUNT")
                        .arg(500);
                    let (next, found): (u64, Vec<String>) =
                        redis::from_redis_value(c.route_command(cmd, route).await?)?;
                    keys.extend(found);
                    cursor = next;
                    if cursor == 0 {
                        break;
                    }
                }
            }
            Ok(keys)
        }
    }
}

/// Deletes every key matching `pattern` (one DEL per key, so cluster slots never mix).
pub async fn delete_keys(conn: &mut RedisConn, pattern: &str) {
    if let Ok(keys) = all_keys(conn, pattern).await {
        for key in keys {
            let _: redis::RedisResult<()> = conn.del(key).await;
        }
    }
}

/// Suffixes that make recipient ids hostile to key building; the numeric prefix keeps every
/// id distinct.
const HOSTILE_SUFFIXES: &[&str] = &[
    "", "{", "}", ":", "%", "%7B", "a}{b:c", " ", "\u{2028}", "é", "中", "😀", "\u{200b}", "\"",
    "\\",
];

/// Message `m-<i>` (sms, no zone) to recipient `<i><suffix>`, with suffixes hostile to key
/// building (braces, colons, percent signs, spaces, emoji): every id distinct.
pub fn first_message_to_hostile_id(i: usize) -> sendquota::internals::message::SendRequest {
    sendquota::internals::message::SendRequest {
        id: format!("m-{i}"),
        recipient: format!("{i}{}", HOSTILE_SUFFIXES[i % HOSTILE_SUFFIXES.len()]),
        channel: "sms".to_owned(),
        category: "default".to_owned(),
        timezone: None,
        cost: 1,
        payload: None,
        attributes: Default::default(),
        expires_at: None,
        priority: Default::default(),
    }
}

/// The part of a key Redis Cluster hashes: the first `{...}` with content, else the key.
pub fn cluster_tag(key: &str) -> &str {
    if let Some(open) = key.find('{') {
        if let Some(len) = key[open + 1..].find('}') {
            if len > 0 {
                return &key[open + 1..open + 1 + len];
            }
        }
    }
    key
}
