//! The Redis keys a run makes: a plain connection of the bench's own, removing a namespace's
//! keys (SCAN and batched UNLINK, also when the run is interrupted: (e) alone leaves a million
//! recipients' keys), Redis's memory, and the headline rule's key as the limiter names it.

use std::time::{Duration, Instant};

use redis::aio::MultiplexedConnection;
use sendquota::internals::keys::{rule_key, scope_tag};
use sendquota::internals::policy::ScopeValue;

use crate::support::{self, TestEnv};

/// A connection of the bench's own, beside the limiter's: the bare loop, INFO, MEMORY USAGE
/// and cleanup.
pub async fn multiplexed() -> MultiplexedConnection {
    redis::Client::open(support::redis_url())
        .expect("redis url")
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| panic!("redis not reachable: {e}; {}", support::START_HINT))
}

/// Removes every key matching `pattern` with SCAN and batched UNLINK; returns how many.
pub async fn purge(conn: &mut MultiplexedConnection, pattern: &str, label: &str) -> usize {
    let mut cursor: u64 = 0;
    let mut removed = 0usize;
    let mut last = Instant::now();
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(10_000)
            .query_async(conn)
            .await
            .expect("SCAN");
        if !keys.is_empty() {
            removed += redis::cmd("UNLINK")
                .arg(&keys)
                .query_async::<usize>(conn)
                .await
                .expect("UNLINK");
        }
        if last.elapsed() >= Duration::from_secs(1) {
            eprintln!("[{label}] unlinked {removed} keys so far");
            last = Instant::now();
        }
        cursor = next;
        if cursor == 0 {
            return removed;
        }
    }
}

/// Removes this run's keys when the bench is interrupted (Ctrl-C or SIGTERM), then exits 130.
/// Phase (e) alone leaves a million recipients' keys; left in a shared Redis they slowed every
/// later SCAN, and a whole test suite once ran out of time on them.
pub async fn purge_on_interrupt() {
    let Ok(mut term) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
    else {
        return;
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    eprintln!("perf: interrupted; removing this run's keys");
    let pattern = format!("sqt_{}_*", std::process::id());
    let removed = purge(&mut multiplexed().await, &pattern, "interrupted").await;
    eprintln!("perf: removed {removed} keys");
    std::process::exit(130);
}

pub async fn used_memory(conn: &mut MultiplexedConnection) -> i64 {
    let info: String = redis::cmd("INFO")
        .arg("memory")
        .query_async(conn)
        .await
        .expect("INFO memory");
    info.lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// The headline rule's key for a recipient, as the limiter names it.
pub fn headline_key(namespace: &str, recipient: &str) -> String {
    rule_key(
        namespace,
        &scope_tag(&ScopeValue::Recipient(recipient)),
        "headline",
        "calendar_quota",
    )
}

/// Removes the Redis keys of `env`'s namespace.
pub async fn purge_namespace(env: &TestEnv, label: &str) {
    let mut conn = multiplexed().await;
    purge(&mut conn, &format!("{}:*", env.namespace), label).await;
}
