//! What a setting must be beyond its range: the admin API's address and tokens, connection
//! URLs parsed without connecting, the namespace. Checked before any connection is opened, so a
//! bad file stops the process with one line, never repeating a URL that may hold a password.

use super::{AdminSettings, AmqpSettings, ConfigError, DatabaseSettings, RedisSettings};
use crate::request::message::one_line;

/// Shortest admin token, and shortest recipient hash key, accepted: long enough that guessing
/// is hopeless.
pub(super) const MIN_TOKEN_CHARS: usize = 16;

pub(super) fn check_admin(admin: &AdminSettings) -> Result<(), ConfigError> {
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
pub(super) fn check_urls(
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
    check_amqp_urls(amqp.broker_urls())?;
    check_database_url("database url", &database.url)?;
    if database.read_url.is_empty() {
        return Ok(());
    }
    check_database_url("database read_url", &database.read_url)
}

/// Every broker URL parses, and all are `amqp://` or all `amqps://`: one TLS configuration
/// serves every node, and a list that mixes them only fails later, on one node.
fn check_amqp_urls(urls: &[String]) -> Result<(), ConfigError> {
    for url in urls {
        let scheme = url.starts_with("amqp://") || url.starts_with("amqps://");
        if !scheme || url.parse::<lapin::uri::AMQPUri>().is_err() {
            return Err(ConfigError::Invalid(
                "amqp url is not valid: expected amqp[s]://user:password@host:port/vhost"
                    .to_owned(),
            ));
        }
    }
    let tls = urls.iter().filter(|u| u.starts_with("amqps://")).count();
    if tls != 0 && tls != urls.len() {
        return Err(ConfigError::Invalid(
            "amqp urls mix amqp:// and amqps:// nodes: a cluster's nodes are reached all with \
             TLS or all without"
                .to_owned(),
        ));
    }
    Ok(())
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
fn check_database_url(setting: &str, url: &str) -> Result<(), ConfigError> {
    let query = url.split_once('?').map_or("", |(_, q)| q);
    let ssl_mode = query.split('&').find_map(|pair| {
        let (key, value) = pair.split_once('=')?;
        matches!(key, "sslmode" | "ssl-mode").then_some(value)
    });
    if let Some(mode) = ssl_mode.filter(|m| !SSL_MODES.contains(&m.to_ascii_lowercase().as_str())) {
        return Err(ConfigError::Invalid(format!(
            "{setting}: sslmode \"{}\" is not one of {}",
            one_line(mode),
            SSL_MODES.join(", ")
        )));
    }
    let postgres = url.starts_with("postgres://") || url.starts_with("postgresql://");
    if !postgres || url.parse::<sqlx::postgres::PgConnectOptions>().is_err() {
        return Err(ConfigError::Invalid(format!(
            "{setting} is not valid: expected postgres://user[:password]@host:port/database"
        )));
    }
    Ok(())
}

pub(super) fn check_namespace(ns: &str) -> Result<(), ConfigError> {
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
