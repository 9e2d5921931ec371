//! The worker on a real 3-master Redis Cluster: scopes hash to different slots and nodes, each
//! scope's rules share one slot, so every script call is single-slot (no CROSSSLOT), and the
//! outcomes are the same as on one server. Both topologies get the decision scripts back
//! after forgetting them, and the worker reads the version of every server it will use.

use crate::support;

use std::collections::HashMap;

use sendquota::clock::ManualClock;
use sendquota::config::Settings;
use sendquota::internals::limiter::Limiter;
use sendquota::internals::message::SendRequest;
use sendquota::internals::store::RedisConn;
use support::fixtures::policy;
use support::{local, request, TestEnv};

#[tokio::test]
async fn the_worker_decides_across_scopes_on_a_redis_cluster() {
    let config = policy!("headline_per_channel_and_global_burst");
    let mut env = TestEnv::on_cluster(config).await;
    let clock = ManualClock::new(local("UTC", "2026-04-01 09:00"));
    env.start_worker(&clock);
    let mut seen = HashMap::new();
    let mut outcomes = Vec::new();
    // 20 recipients (spread over the cluster's slots), two messages each: the second is denied
    // by the headline rule; the first 25 admitted exhaust the global burst.
    for round in 0..2 {
        for r in 0..20 {
            let id = format!("m{round}-{r}");
            env.publish(&request(&id, &format!("user-{r}"), "UTC"))
                .await;
            outcomes.push((id.clone(), env.outcome(&id, &mut seen).await));
        }
    }
    env.stop_worker().await;
    let sent: Vec<&str> = outcomes
        .iter()
        .filter(|(_, s)| *s)
        .map(|(id, _)| id.as_str())
        .collect();
    let expected: Vec<String> = (0..20).map(|r| format!("m0-{r}")).collect();
    assert_eq!(
        sent,
        expected.iter().map(String::as_str).collect::<Vec<_>>()
    );
    let denials = env.denials().await;
    assert_eq!(denials.len(), 20);
    assert!(denials.iter().all(|d| d.rule == "headline"));
    // Headline keys live on several nodes: the keys really are spread.
    let keys = env.keys().await;
    assert!(keys.len() >= 20 + 2, "keys: {keys:?}");
    assert_eq!(env.keys_without_expiry().await, Vec::<String>::new());
}

#[tokio::test]
async fn a_refused_global_rule_refunds_recipient_quota_on_another_node() {
    let config = policy!("headline_and_three_an_hour_for_everyone");
    let mut env = TestEnv::on_cluster(config).await;
    let clock = ManualClock::new(local("UTC", "2026-04-01 09:00"));
    env.start_worker(&clock);
    let mut seen = HashMap::new();
    let mut sent = 0;
    for r in 0..8 {
        let id = format!("m{r}");
        env.publish(&request(&id, &format!("user-{r}"), "UTC"))
            .await;
        sent += usize::from(env.outcome(&id, &mut seen).await);
    }
    env.stop_worker().await;
    assert_eq!(sent, 3, "the global limit admits three");
    // Only the three admitted recipients hold a headline entry: the five refused were refunded.
    let headline_keys: Vec<String> = env
        .keys()
        .await
        .into_iter()
        .filter(|k| k.ends_with(":headline:calendar_quota"))
        .collect();
    assert_eq!(headline_keys.len(), 3, "{headline_keys:?}");
}

/// SCRIPT FLUSH on every master: what a restarted or failed-over Redis looks like to a client
/// that loaded its scripts before.
async fn forget_scripts(conn: &RedisConn) {
    match conn {
        RedisConn::Single(c) => {
            let _: () = redis::cmd("SCRIPT")
                .arg("FLUSH")
                .query_async(&mut c.clone())
                .await
                .expect("SCRIPT FLUSH");
        }
        RedisConn::Cluster(c) => {
            use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo};
            let all = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
            let mut flush = redis::cmd("SCRIPT");
            flush.arg("FLUSH");
            c.connection()
                .route_command(flush, all)
                .await
                .expect("SCRIPT FLUSH on every master");
        }
    }
}

#[tokio::test]
async fn a_redis_that_forgot_the_decision_scripts_is_sent_them_again_and_decides() {
    let policy = Settings::from_toml(policy!("headline"), |_| None)
        .expect("valid policy")
        .policy;
    let now = local("UTC", "2026-04-01 09:00");
    let message = |id: &str| {
        SendRequest::decode(request(id, "alice", "UTC").to_string().as_bytes(), 1 << 16)
            .expect("valid request")
    };
    for (target, settings) in support::redis_targets() {
        let conn = support::connect_redis(&settings).await;
        let namespace = support::unique("sqtnoscript");
        let limiter = Limiter::new(conn.clone(), &namespace);
        forget_scripts(&conn).await;
        let first = limiter
            .evaluate(&policy, &message("m1"), now, true)
            .await
            .unwrap_or_else(|e| panic!("{target}: first decision after SCRIPT FLUSH: {e}"));
        forget_scripts(&conn).await;
        let second = limiter
            .evaluate(&policy, &message("m2"), now, true)
            .await
            .unwrap_or_else(|e| panic!("{target}: second decision after SCRIPT FLUSH: {e}"));
        support::delete_keys(&mut conn.clone(), &format!("{namespace}:*")).await;
        assert!(
            first.committed(),
            "{target}: the day's first message is admitted"
        );
        let refused: Vec<(&str, bool)> = second
            .verdicts()
            .iter()
            .map(|v| (v.rule.as_str(), v.allowed))
            .collect();
        assert_eq!(
            (second.committed(), refused),
            (false, vec![("headline", false)]),
            "{target}: the reloaded script saw the first send"
        );
    }
}

#[tokio::test]
async fn the_redis_version_is_read_from_a_single_server_and_from_every_cluster_master() {
    let installed = std::process::Command::new("redis-server")
        .arg("--version")
        .output()
        .expect("redis-server --version");
    let installed = String::from_utf8_lossy(&installed.stdout).into_owned();
    for (name, settings) in support::redis_targets() {
        let conn = support::connect_redis(&settings).await;
        let version = sendquota::internals::store::check_version(&conn)
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}"))
            .unwrap_or_else(|| panic!("{name}: no version reported"));
        assert!(
            installed.contains(&format!("v={version} ")),
            "{name}: read {version}, the installed server is {installed}"
        );
    }
}
