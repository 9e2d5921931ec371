//! A rule's `on_unavailable` through the real worker, on a private Redis that is stopped and
//! started again: with `allow` a message Redis cannot decide is dispatched unchecked, recorded
//! once as a row marked unchecked and counted; with `wait` (the default), alone or beside an
//! `allow` rule, it is kept until Redis is back and then decided as always. A message Redis
//! refused before going away, or whose unchecked publish failed, is never recorded as
//! dispatched unchecked: it is decided in Redis once it is back. While Redis is away no call
//! waits longer than the response timeout, on one server and on a cluster, and a Redis that
//! is back is used by the next call.

use crate::support;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use sendquota::clock::ManualClock;
use sendquota::config::RedisSettings;
use sendquota::failpoint::Failpoint;
use sendquota::internals::denials::{DenialFilter, DenialStore};
use sendquota::internals::store::RedisConn;
use sendquota::internals::telemetry;
use support::fixtures::policy;
use support::http::{metric, wait_until_ready};
use support::private::{free_port, PrivateRedis, PrivateRedisCluster};
use support::{local, request, TestEnv, OUTCOME_TIMEOUT};

/// The channel of every message here, named by the rules so the outcome counter has a series
/// of its own for it (the metrics are the test process's, shared with other tests).
const CHANNEL: &str = "fail-open";

/// The headline caps on [`CHANNEL`], failing open.
const ALLOW: &str = policy!("daily_on_fail_open_allowing_when_unavailable");

/// A rule on [`CHANNEL`] that waits for Redis (the default).
const STRICT: &str = policy!("ten_an_hour_on_fail_open");

/// A request on [`CHANNEL`].
fn message(id: &str, recipient: &str) -> serde_json::Value {
    let mut m = request(id, recipient, "UTC");
    m["channel"] = CHANNEL.into();
    m
}

/// A worker under `policy` on a private Redis of its own, with its admin API, ready.
async fn worker_on_private_redis(policy: &str) -> (TestEnv, PrivateRedis, u16) {
    let redis = tokio::task::spawn_blocking(PrivateRedis::start)
        .await
        .expect("private redis");
    let mut env = TestEnv::with_config(policy).await;
    env.settings.redis.url = redis.url();
    let port = free_port();
    env.settings.admin.listen = format!("127.0.0.1:{port}");
    env.start_worker(&ManualClock::new(local("UTC", "2026-04-01 09:00")));
    wait_until_ready(port).await;
    (env, redis, port)
}

/// Publishes every id in `ids` twice (two copies in flight), `ids[i]` to recipient `r<i>`.
async fn publish_twice(env: &TestEnv, ids: &[&str]) {
    for _copy in 0..2 {
        for (i, id) in ids.iter().enumerate() {
            env.publish(&message(id, &format!("r{i}"))).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_allow_a_message_redis_cannot_decide_is_dispatched_unchecked_and_recorded_once() {
    let (mut env, redis, port) = worker_on_private_redis(ALLOW).await;
    let mut seen = HashMap::new();
    env.publish(&message("before", "alice")).await;
    assert!(env.outcome("before", &mut seen).await, "decided in Redis");

    tokio::task::block_in_place(|| redis.stop());
    // Alice's second message today: Redis would deny it, but nothing can ask Redis.
    env.publish(&message("late", "alice")).await;
    let ids = ["m0", "m1", "m2"];
    publish_twice(&env, &ids).await;
    let unchecked = format!(
        "{}{{outcome=\"unchecked\",channel=\"{CHANNEL}\",category=\"other\"}}",
        telemetry::DECISIONS
    );
    let deliveries = 1 + 2 * ids.len() as u64;
    let deadline = Instant::now() + 2 * OUTCOME_TIMEOUT;
    while metric(port, &unchecked).await < deliveries {
        assert!(
            Instant::now() < deadline,
            "every copy was handled unchecked"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for id in ["late"].iter().chain(&ids) {
        env.dispatched(id, &mut seen).await;
    }
    assert_eq!(metric(port, &unchecked).await, deliveries);
    assert!(metric(port, telemetry::UNCHECKED).await >= deliveries);
    // `check` needs Redis: it fails as for any unreachable service, and explains nothing.
    let check = env
        .cli_with(
            ALLOW,
            &["check", "--message", &message("c", "alice").to_string()],
        )
        .env("SENDQUOTA_REDIS_URL", redis.url())
        .output()
        .expect("run check");
    let stderr = String::from_utf8_lossy(&check.stderr);
    assert_eq!(check.status.code(), Some(1), "{stderr}");
    assert!(stderr.starts_with("sendquota: redis"), "{stderr}");

    let rows = env.denials().await;
    let recorded: Vec<&str> = rows.iter().map(|d| d.message_id.as_str()).collect();
    assert_eq!(
        recorded.len(),
        4,
        "one row per message, copies included: {recorded:?}"
    );
    for id in ["late"].iter().chain(&ids) {
        assert!(recorded.contains(id), "{id} recorded: {recorded:?}");
    }
    for row in &rows {
        assert!(row.unchecked && !row.shadow, "{row:?}");
        assert_eq!(
            (row.rule.as_str(), row.kind.as_str()),
            ("daily", "calendar_quota")
        );
        assert!(
            row.reason
                .starts_with("unchecked: redis unavailable (redis: "),
            "{}",
            row.reason
        );
        assert_eq!(row.retry_after, None);
    }

    tokio::task::block_in_place(|| redis.start_again());
    wait_until_ready(port).await;
    // Decided in Redis again: "before" still holds alice's day ("late" took nothing).
    env.publish(&message("after", "alice")).await;
    assert!(
        !env.outcome("after", &mut seen).await,
        "alice's day is full"
    );
    env.publish(&message("fresh", "r9")).await;
    assert!(env.outcome("fresh", &mut seen).await);
    let rows = env.denials().await;
    let after = rows.last().expect("the denial of after");
    assert_eq!(
        (after.message_id.as_str(), after.unchecked),
        ("after", false)
    );

    // A replay takes the denial, never the messages that went out unchecked.
    let store = DenialStore::from_pool(env.pool.clone());
    let replayable = store
        .replayable(&DenialFilter::default(), 100)
        .await
        .expect("replayable denials");
    let replayable: Vec<&str> = replayable.iter().map(|d| d.message_id.as_str()).collect();
    assert_eq!(replayable, ["after"]);
    let out = env
        .cli(&["denials", "--unchecked", "true", "--recipient", "alice"])
        .output()
        .expect("run denials");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let table = String::from_utf8_lossy(&out.stdout);
    assert_eq!(table.lines().count(), 2, "a header and late: {table}");
    assert!(table.contains(" daily (unchecked) "), "{table}");
    env.stop_worker().await;
}

/// Under `policy`, messages published while Redis is stopped are not sent; once it is back
/// each is decided in Redis: dispatched once (its copy finds the dispatch mark), no row.
async fn messages_wait_for_redis(policy: &str) {
    let (mut env, redis, port) = worker_on_private_redis(policy).await;
    tokio::task::block_in_place(|| redis.stop());
    let ids = ["w0", "w1", "w2"];
    publish_twice(&env, &ids).await;
    let held = Instant::now() + Duration::from_secs(3);
    while Instant::now() < held {
        assert_eq!(
            env.take_dispatched().await,
            Vec::<String>::new(),
            "nothing is sent unchecked"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(env.denial_rows().await, 0);

    tokio::task::block_in_place(|| redis.start_again());
    wait_until_ready(port).await;
    let mut seen = HashMap::new();
    for id in ids {
        env.dispatched(id, &mut seen).await;
    }
    env.copies_decided().await;
    for d in env.take_dispatched().await {
        *seen.entry(d).or_default() += 1;
    }
    assert_eq!(seen, ids.iter().map(|id| (id.to_string(), 1)).collect());
    assert_eq!(env.denial_rows().await, 0);
    env.stop_worker().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn by_default_a_message_waits_until_redis_is_back() {
    messages_wait_for_redis(&ALLOW.replace("on_unavailable = \"allow\"\n", "")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_one_of_whose_rules_waits_waits_beside_an_allow_rule() {
    messages_wait_for_redis(&format!("{ALLOW}{STRICT}")).await;
}

/// `check` decides in Redis as ever, and says what the worker would do with the message were
/// Redis unavailable, where a rule matching it sets `on_unavailable = "allow"`.
#[tokio::test]
async fn check_says_whether_a_message_would_go_out_unchecked() {
    let env = TestEnv::new().await;
    let at = "2026-04-01T09:00:00Z";
    let open = env.check(ALLOW, at, &message("c1", "alice"));
    assert_eq!(
        (open["outcome"].as_str(), open["on_unavailable"].as_str()),
        (Some("allow"), Some("allow")),
        "{open}"
    );
    let mixed = env.check(&format!("{ALLOW}{STRICT}"), at, &message("c1", "alice"));
    assert_eq!(mixed["on_unavailable"], "wait", "{mixed}");
    for (policy, body) in [
        (STRICT, message("c1", "alice")),
        (ALLOW, request("c1", "alice", "UTC")),
    ] {
        let waits = env.check(policy, at, &body);
        assert_eq!(
            waits.get("on_unavailable"),
            None,
            "no rule asks for it: {waits}"
        );
    }
}

/// Redis refuses a message and then goes away before the refusal is settled (the
/// `fail-after-decision` failpoint fails the step after every refusal of a `gone-` recipient's
/// message): Redis decided it, so it is not let out unchecked, whatever `on_unavailable` says.
/// It waits, and once the cause is gone (a worker without the failpoint) it is denied as Redis
/// said, a row a replay can take.
#[tokio::test]
async fn a_message_redis_refused_before_going_away_is_never_let_out_unchecked() {
    let mut env = TestEnv::with_config(ALLOW).await;
    let clock = ManualClock::new(local("UTC", "2026-04-01 09:00"));
    env.start_worker_with(&clock, Some(Failpoint::FailAfterDecision));
    let mut seen = HashMap::new();
    env.publish(&message("first", "gone-gwen")).await;
    assert!(env.outcome("first", &mut seen).await, "gwen's first today");
    for _copy in 0..2 {
        env.publish(&message("second", "gone-gwen")).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(env.take_dispatched().await, Vec::<String>::new());
    assert_eq!(env.denial_rows().await, 0, "no unchecked row");
    env.stop_worker().await;

    env.start_worker(&clock);
    assert!(!env.outcome("second", &mut seen).await, "denied");
    env.copies_decided().await;
    env.stop_worker().await;
    let rows = env.denials().await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(
        (rows[0].message_id.as_str(), rows[0].unchecked),
        ("second", false)
    );
    assert!(env.take_dispatched().await.is_empty());
}

/// While Redis is away, a message that fails open meets a dispatch exchange no sender queue is
/// bound to, so its publish fails: no row says it went out unchecked. Once Redis is back, it is
/// decided there and denied (the recipient's day is full), and that denial is recorded, for a
/// replay to take.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unchecked_dispatch_that_is_not_published_leaves_no_row_in_the_denials_way() {
    let (mut env, redis, port) = worker_on_private_redis(ALLOW).await;
    let mut seen = HashMap::new();
    env.publish(&message("before", "alice")).await;
    assert!(env.outcome("before", &mut seen).await, "decided in Redis");
    env.unbind_dispatched().await;
    tokio::task::block_in_place(|| redis.stop());
    env.publish(&message("late", "alice")).await;
    let unchecked = format!(
        "{}{{outcome=\"unchecked\",channel=\"{CHANNEL}\",category=\"other\"}}",
        telemetry::DECISIONS
    );
    // Attempts go on, each failing its publish.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(metric(port, &unchecked).await, 0);
    assert_eq!(
        env.denial_rows().await,
        0,
        "no row for a publish that failed"
    );

    tokio::task::block_in_place(|| redis.start_again());
    wait_until_ready(port).await;
    assert!(!env.outcome("late", &mut seen).await, "alice's day is full");
    env.bind_dispatched("#").await;
    env.stop_worker().await;
    let rows = env.denials().await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(
        (rows[0].message_id.as_str(), rows[0].unchecked),
        ("late", false)
    );
    let replayable = DenialStore::from_pool(env.pool.clone())
        .replayable(&DenialFilter::default(), 100)
        .await
        .expect("replayable denials");
    assert_eq!(replayable.len(), 1);
    assert!(env.take_dispatched().await.is_empty());
}

/// The channel of the burst that fails open.
const BURST_CHANNEL: &str = "fail-open-burst";

/// A response timeout short enough that a call waiting for anything else shows: redis-rs's
/// reconnect chain took about 6.6 s against a stopped server.
const SHORT_TIMEOUT_MS: u64 = 1_000;

/// What a call may take beyond the response timeout: scheduling, not waiting for Redis.
const TIMER_SLACK: Duration = Duration::from_millis(250);

/// `GET key` on `conn`, and how long it took.
async fn timed_get(conn: &RedisConn, key: &str) -> (redis::RedisResult<Option<String>>, Duration) {
    let started = Instant::now();
    let reply = redis::cmd("GET")
        .arg(key)
        .query_async(&mut conn.clone())
        .await;
    (reply, started.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_fails_within_the_response_timeout_while_redis_is_away_and_the_next_call_once_it_is_back_is_answered(
) {
    let redis = tokio::task::spawn_blocking(PrivateRedis::start)
        .await
        .expect("private redis");
    let timeout = Duration::from_millis(SHORT_TIMEOUT_MS);
    let settings = RedisSettings {
        url: redis.url(),
        response_timeout_ms: SHORT_TIMEOUT_MS,
        ..RedisSettings::default()
    };
    let conn = RedisConn::connect(&settings).await.expect("connect");
    let (reply, _) = timed_get(&conn, "probe").await;
    assert_eq!(reply.expect("redis is up"), None);

    tokio::task::block_in_place(|| redis.stop());
    let mut took = Vec::new();
    for _ in 0..5 {
        let (reply, elapsed) = timed_get(&conn, "probe").await;
        let e = reply.expect_err("redis is away");
        assert!(e.is_io_error(), "an unavailable redis: {e}");
        took.push(elapsed);
    }
    eprintln!("calls while redis is away took {took:?}");
    assert!(
        took.iter().all(|t| *t <= timeout + TIMER_SLACK),
        "each call within the response timeout ({timeout:?}): {took:?}"
    );

    tokio::task::block_in_place(|| redis.start_again());
    // A reconnect attempt begun while Redis was away may still end in its refusal (seen once
    // in a batch of tests on a loaded machine): one call may fail with it, the next is
    // answered, both within the response timeout.
    let (mut reply, mut elapsed) = timed_get(&conn, "probe").await;
    eprintln!("the first call once redis is back: {reply:?} after {elapsed:?}");
    if reply.is_err() {
        assert!(elapsed <= timeout + TIMER_SLACK, "failed after {elapsed:?}");
        (reply, elapsed) = timed_get(&conn, "probe").await;
        eprintln!("the second call once redis is back: {reply:?} after {elapsed:?}");
    }
    assert_eq!(
        reply.expect("the first or second call once redis is back is answered"),
        None
    );
    assert!(elapsed <= timeout, "answered after {elapsed:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_a_call_to_a_stopped_master_fails_within_the_response_timeout_while_the_others_answer(
) {
    let cluster = tokio::task::spawn_blocking(PrivateRedisCluster::start)
        .await
        .expect("private redis cluster");
    let timeout = Duration::from_millis(SHORT_TIMEOUT_MS);
    let settings = RedisSettings {
        cluster_urls: cluster.urls(),
        response_timeout_ms: SHORT_TIMEOUT_MS,
        ..RedisSettings::default()
    };
    let conn = RedisConn::connect(&settings).await.expect("connect");
    // Two keys on different masters.
    let away = "{probe-0}";
    let live = (1..)
        .map(|i| format!("{{probe-{i}}}"))
        .find(|k| cluster.owner(k).port != cluster.owner(away).port)
        .expect("a key on another master");
    for key in [away, live.as_str()] {
        let (reply, _) = timed_get(&conn, key).await;
        assert_eq!(reply.expect("the cluster is up"), None);
    }

    let stopped = cluster.owner(away);
    tokio::task::block_in_place(|| stopped.stop());
    let mut took = Vec::new();
    for _ in 0..5 {
        let (reply, elapsed) = timed_get(&conn, away).await;
        let e = reply.expect_err("the key's master is away");
        assert!(e.is_io_error(), "an unavailable redis: {e}");
        took.push(elapsed);
        let (reply, elapsed) = timed_get(&conn, &live).await;
        assert_eq!(reply.expect("the other masters answer"), None);
        assert!(
            elapsed <= timeout,
            "a live master answered after {elapsed:?}"
        );
    }
    eprintln!("calls to the stopped master took {took:?}");
    assert!(
        took.iter().all(|t| *t <= timeout + TIMER_SLACK),
        "each call within the response timeout ({timeout:?}): {took:?}"
    );

    tokio::task::block_in_place(|| {
        stopped.start_again();
        cluster.wait_ok();
    });
    let back = Instant::now();
    let answered = loop {
        if let (Ok(reply), _) = timed_get(&conn, away).await {
            eprintln!("the master back answered after {:?}", back.elapsed());
            break reply;
        }
        assert!(
            back.elapsed() < Duration::from_secs(2),
            "the master back is used again within 2 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(answered, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_allow_a_burst_to_one_recipient_goes_out_unchecked_within_the_response_timeout_a_message(
) {
    // A channel of its own, so the unchecked count of the test above is its own too.
    let policy = ALLOW.replace(CHANNEL, BURST_CHANNEL);
    let message = |id: &str, recipient: &str| {
        let mut m = message(id, recipient);
        m["channel"] = BURST_CHANNEL.into();
        m
    };
    let (mut env, redis, _port) = worker_on_private_redis(&policy).await;
    assert_eq!(
        env.settings.redis.response_timeout_ms,
        RedisSettings::default().response_timeout_ms,
        "the default response timeout"
    );
    let timeout = Duration::from_millis(env.settings.redis.response_timeout_ms);
    let mut seen = HashMap::new();
    env.publish(&message("before", "bob")).await;
    assert!(env.outcome("before", &mut seen).await, "decided in Redis");

    tokio::task::block_in_place(|| redis.stop());
    let stopped = Instant::now();
    let ids = ["burst-0", "burst-1", "burst-2", "burst-3"];
    for id in ids {
        env.publish(&message(id, "bob")).await;
    }
    // When each went out, after Redis stopped.
    let mut out: Vec<(String, Duration)> = Vec::new();
    let deadline = stopped + timeout * ids.len() as u32 + Duration::from_secs(2);
    while out.len() < ids.len() && Instant::now() < deadline {
        for id in env.take_dispatched().await {
            out.push((id, stopped.elapsed()));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    eprintln!("the burst went out at {out:?} after Redis stopped");
    let mut sent: Vec<&str> = out.iter().map(|(id, _)| id.as_str()).collect();
    sent.sort_unstable();
    assert_eq!(
        sent,
        ids,
        "the burst went out within {:?}: {out:?}",
        deadline - stopped
    );
    let mut previous = Duration::ZERO;
    for (id, at) in &out {
        assert!(
            *at - previous <= timeout,
            "{id} went out {:?} after the message before it, beyond the response timeout \
             ({timeout:?}): {out:?}",
            *at - previous
        );
        previous = *at;
    }

    // Back: Bob's day is full ("before"), so a message decided in Redis is denied, and one
    // still failing open would go out.
    tokio::task::block_in_place(|| redis.start_again());
    let back = Instant::now();
    env.publish(&message("after", "bob")).await;
    assert!(
        !env.outcome("after", &mut seen).await,
        "decided in Redis again: bob's day is full"
    );
    eprintln!("decided in Redis {:?} after it was back", back.elapsed());
    assert!(
        back.elapsed() < Duration::from_secs(2),
        "decided {:?} after Redis was back",
        back.elapsed()
    );
    let rows = env.denials().await;
    let after = rows.last().expect("the denial of after");
    assert_eq!(
        (after.message_id.as_str(), after.unchecked),
        ("after", false)
    );
    env.stop_worker().await;
}
