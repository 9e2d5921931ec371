//! Idempotency by message id and the crash window, through the real services.

use crate::support;

use std::collections::HashMap;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use redis::AsyncCommands;
use sendquota::clock::ManualClock;
use sendquota::failpoint::Failpoint;
use sendquota::internals::claim::Claim;
use sendquota::internals::message::SendRequest;
use support::fixtures::policy;
use support::http::{http, wait_until_ready};
use support::private::free_port;
use support::{local, request, TestEnv};

fn headline_key(env: &TestEnv, recipient_tag: &str) -> String {
    format!(
        "{}:{{r:{recipient_tag}}}:headline:calendar_quota",
        env.namespace
    )
}

async fn members(env: &TestEnv, key: &str) -> Vec<String> {
    env.redis.clone().zrange(key, 0, -1).await.expect("zrange")
}

/// Publishes message `dup` for alice twice, then a marker for bob, one message at a time (so
/// the marker's outcome proves both copies were handled); returns how often `dup` went out.
async fn dispatches_of_an_id_published_twice(env: &mut TestEnv) -> usize {
    env.settings.worker.concurrency = 1;
    env.settings.amqp.prefetch = 1;
    let clock = ManualClock::new(local("UTC", "2026-02-02 09:00"));
    env.start_worker(&clock);
    env.publish(&request("dup", "alice", "UTC")).await;
    env.publish(&request("dup", "alice", "UTC")).await;
    env.publish(&request("marker", "bob", "UTC")).await;
    let mut seen = HashMap::new();
    assert!(env.outcome("marker", &mut seen).await);
    env.stop_worker().await;
    for id in env.take_dispatched().await {
        *seen.entry(id).or_default() += 1;
    }
    assert!(
        env.denials().await.is_empty(),
        "a redelivery is not a denial"
    );
    seen.get("dup").copied().unwrap_or(0)
}

#[tokio::test]
async fn the_same_message_id_published_twice_is_dispatched_once_and_consumes_once() {
    let mut env = TestEnv::new().await;
    assert_eq!(dispatches_of_an_id_published_twice(&mut env).await, 1);
    assert_eq!(members(&env, &headline_key(&env, "alice")).await, ["dup"]);
}

#[tokio::test]
async fn an_id_published_twice_is_dispatched_once_when_no_rule_is_per_recipient() {
    // No script call reaches the recipient's dispatch marks: they are read on their own.
    let mut env = TestEnv::with_config(policy!("a_hundred_an_hour_per_channel")).await;
    assert_eq!(dispatches_of_an_id_published_twice(&mut env).await, 1);
}

#[tokio::test]
async fn an_id_published_twice_is_dispatched_once_on_a_redis_cluster() {
    let mut env = TestEnv::on_cluster("").await;
    assert_eq!(dispatches_of_an_id_published_twice(&mut env).await, 1);
    assert_eq!(env.keys_without_expiry().await, Vec::<String>::new());
}

#[tokio::test]
async fn a_denied_message_delivered_twice_has_one_denial_row() {
    let mut env = TestEnv::new().await;
    env.settings.worker.concurrency = 1;
    env.settings.amqp.prefetch = 1;
    let clock = ManualClock::new(local("UTC", "2026-02-02 09:00"));
    env.start_worker(&clock);
    env.publish(&request("first", "alice", "UTC")).await;
    env.publish(&request("late", "alice", "UTC")).await;
    env.publish(&request("late", "alice", "UTC")).await;
    env.publish(&request("marker", "bob", "UTC")).await;
    let mut seen = HashMap::new();
    assert!(env.outcome("marker", &mut seen).await);
    env.stop_worker().await;
    assert_eq!(env.denial_count("late").await, 1);
    assert_eq!(members(&env, &headline_key(&env, "alice")).await, ["first"]);
}

#[tokio::test]
async fn a_recipient_with_braces_and_colons_never_shares_state_with_another() {
    let mut env = TestEnv::new().await;
    let clock = ManualClock::new(local("UTC", "2026-02-02 09:00"));
    env.start_worker(&clock);
    let mut seen = HashMap::new();
    // The second recipient is the first one's percent-encoding: a naive encoder would give
    // both the same key.
    env.publish(&request("m1", "a}{b:c", "UTC")).await;
    assert!(env.outcome("m1", &mut seen).await);
    env.publish(&request("m2", "a%7D%7Bb%3Ac", "UTC")).await;
    assert!(env.outcome("m2", &mut seen).await);
    env.publish(&request("m3", "a}{b:c", "UTC")).await;
    assert!(!env.outcome("m3", &mut seen).await);
    env.stop_worker().await;
    assert_eq!(
        members(&env, &headline_key(&env, "a%7D%7Bb%3Ac")).await,
        ["m1"]
    );
    assert_eq!(
        members(&env, &headline_key(&env, "a%257D%257Bb%253Ac")).await,
        ["m2"]
    );
}

/// The `sendquota worker` binary on this test's namespace and database with `config`
/// ([`TestEnv::cli_with`]), its admin API on `admin_port` (0: any free port).
fn spawn_worker_binary(env: &TestEnv, config: &str, failpoint: bool, admin_port: u16) -> Child {
    let mut cmd = env.cli_with(config, &["worker", "--now", "2026-02-02T09:00:00Z"]);
    cmd.env("SENDQUOTA_ADMIN_LISTEN", format!("127.0.0.1:{admin_port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    if failpoint {
        assert!(
            sendquota::failpoint::enabled(),
            "{}",
            support::NEEDS_FAILPOINTS
        );
        cmd.env("SENDQUOTA_FAILPOINT", "hang-after-admit");
    } else {
        cmd.env_remove("SENDQUOTA_FAILPOINT");
    }
    cmd.spawn().expect("start the sendquota binary")
}

/// A producer's retries put copies of one message in flight at once. Ten copies of each of
/// twenty messages, each message's copies back to back, decided by two worker processes at
/// their default concurrency and prefetch: every message is dispatched exactly once and no
/// copy is denied (copies that find another in flight wait their turn through the shortest
/// delay queue, then are duplicates).
#[tokio::test]
async fn ten_copies_of_each_message_across_two_workers_are_dispatched_once_each() {
    const IDS: usize = 20;
    const COPIES: usize = 10;
    let env = TestEnv::new().await;
    let mut workers = [
        spawn_worker_binary(&env, "", false, 0),
        spawn_worker_binary(&env, "", false, 0),
    ];
    for i in 0..IDS {
        for _ in 0..COPIES {
            env.publish(&request(&format!("dup-{i}"), &format!("r{i}"), "UTC"))
                .await;
        }
    }
    let mut seen: HashMap<String, usize> = HashMap::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while seen.len() < IDS {
        assert!(
            Instant::now() < deadline,
            "{} of {IDS} messages dispatched",
            seen.len()
        );
        for id in env.take_dispatched().await {
            *seen.entry(id).or_default() += 1;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    env.copies_decided().await;
    for id in env.take_dispatched().await {
        *seen.entry(id).or_default() += 1;
    }
    for worker in &mut workers {
        worker.kill().expect("stop a worker");
        worker.wait().expect("reap a worker");
    }
    let twice: Vec<_> = seen.iter().filter(|(_, n)| **n != 1).collect();
    assert!(twice.is_empty(), "dispatched more than once: {twice:?}");
    assert_eq!(seen.len(), IDS);
    assert_eq!(env.denial_rows().await, 0, "no copy is denied");
}

#[tokio::test]
async fn a_worker_killed_after_redis_admitted_a_message_dispatches_it_once_after_restart() {
    let env = TestEnv::new().await;
    // The killed worker's in-flight claim holds the message's copies for one lease.
    let config = "[worker]\nclaim_lease_ms = 1000\n";
    let key = headline_key(&env, "alice");

    let mut first = spawn_worker_binary(&env, config, true, 0);
    env.publish(&request("crash", "alice", "UTC")).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while members(&env, &key).await.is_empty() {
        assert!(
            Instant::now() < deadline,
            "the worker never admitted the message"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    first.kill().expect("SIGKILL the worker"); // std's kill is SIGKILL on Unix
    first.wait().expect("reap the worker");
    assert!(
        env.take_dispatched().await.is_empty(),
        "nothing went out before the crash"
    );

    let mut second = spawn_worker_binary(&env, config, false, 0);
    let mut seen = HashMap::new();
    let sent = env.outcome("crash", &mut seen).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    for id in env.take_dispatched().await {
        *seen.entry(id).or_default() += 1;
    }
    second.kill().expect("stop the second worker");
    second.wait().expect("reap the second worker");
    assert!(sent, "the redelivered message is dispatched");
    assert_eq!(seen.get("crash"), Some(&1));
    assert_eq!(members(&env, &key).await, ["crash"], "quota consumed once");
    assert!(env.denials().await.is_empty());
}

#[tokio::test]
async fn a_message_stuck_in_flight_does_not_hold_back_the_acks_of_the_messages_behind_it() {
    let mut env = TestEnv::new().await;
    // At most 4 unacked deliveries: if the finished ones waited for the stuck one to be acked
    // with it, the broker would stop delivering after the 4th and the rest would never be decided.
    env.settings.worker.concurrency = 4;
    env.settings.amqp.prefetch = 4;
    env.settings.worker.shutdown_timeout_ms = 200;
    let clock = ManualClock::new(local("UTC", "2026-02-02 09:00"));
    env.start_worker_with(&clock, Some(Failpoint::HangAfterAdmit));
    let ids: Vec<String> = (0..21).map(|i| format!("m{i}")).collect();
    for id in &ids {
        env.publish(&request(id, "alice", "UTC")).await;
    }
    // The first one admitted hangs; every other one is denied (alice's day is full).
    let deadline = Instant::now() + Duration::from_secs(10);
    while env.denials().await.len() < 20 {
        assert!(
            Instant::now() < deadline,
            "only {} of 20 denials within 10 s",
            env.denials().await.len()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    env.stop_worker().await;
    let mut denied: Vec<String> = env
        .denials()
        .await
        .into_iter()
        .map(|d| d.row.message_id)
        .collect();
    let stuck: Vec<String> = env
        .drain(&env.names.requests)
        .await
        .iter()
        .map(|m| {
            let v: serde_json::Value = serde_json::from_slice(&m.delivery.data).expect("JSON");
            v["id"].as_str().expect("id").to_owned()
        })
        .collect();
    assert_eq!(
        stuck.len(),
        1,
        "only the stuck message goes back to the queue: {stuck:?}"
    );
    assert_eq!(
        members(&env, &headline_key(&env, "alice")).await,
        stuck,
        "the message back in the queue is the one admitted"
    );
    denied.extend(stuck);
    denied.sort_by_key(|id| id[1..].parse::<u32>().expect("number"));
    assert_eq!(denied, ids, "every message has exactly one outcome");
}

#[tokio::test]
async fn a_burst_of_finished_deliveries_is_settled_with_a_few_multiple_acks() {
    let env = TestEnv::new().await;
    // Two per recipient: half dispatched, half denied, all queued before the worker starts.
    let n = 400;
    env.publish_two_per_recipient(n).await;
    let port = free_port();
    let mut worker = spawn_worker_binary(&env, "", false, port);
    wait_until_ready(port).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut dispatched = 0;
    loop {
        dispatched += env.take_dispatched().await.len();
        if dispatched + env.denial_rows().await as usize >= n {
            break;
        }
        assert!(Instant::now() < deadline, "{dispatched} dispatched of {n}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let metrics = http(port, "GET", "/metrics", None, "").await.body;
    let _ = worker.kill();
    let _ = worker.wait();
    let frames = |kind: &str| -> u64 {
        let series = format!(
            "{}{{kind=\"{kind}\"}} ",
            sendquota::internals::telemetry::ACK_FRAMES
        );
        metrics
            .lines()
            .find_map(|line| line.strip_prefix(series.as_str()))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    };
    let (multiple, single) = (frames("multiple"), frames("single"));
    assert_eq!(dispatched, n / 2);
    assert!(multiple >= 1, "{metrics}");
    // Acking as tasks reported took about 93 multiple acks for these 400 messages; settling
    // once the other runnable tasks have reported takes about 4. Single acks (deliveries held
    // behind a slower one, such as the first denial batch creating its partition) depend on
    // timing and are not counted here.
    assert!(
        multiple <= (n / 20) as u64,
        "{multiple} multiple and {single} single acks for {n} messages"
    );
}

/// Two deliveries of one message id (two claim tokens) decided one after the other while the
/// first is still in flight: the second is told the id is in flight, decides nothing and takes
/// no quota; once the first gives its claim back, the second is decided and admitted as the
/// same message, consuming nothing more. With the headline rule (the claim is taken in the
/// decision's own call) and with a global rule only (in a call of its own first), on the
/// single server and the cluster. Unlike the two-worker test, no timing is involved.
#[test]
fn a_second_delivery_of_an_id_in_flight_is_told_so_and_decides_nothing() {
    let policies = [
        ("headline", ""),
        ("global only", policy!("five_an_hour_for_everyone")),
    ];
    for (target, redis) in support::redis_targets() {
        for (name, toml) in policies {
            let h = support::model::LimiterHarness::on("sqtclaim", &redis);
            let policy = sendquota::config::Settings::from_toml(toml, |_| None)
                .expect("valid")
                .policy;
            let now = local("UTC", "2026-02-02 09:00");
            let message = |id: &str| {
                SendRequest::decode(request(id, "alice", "UTC").to_string().as_bytes(), 1 << 16)
                    .expect("valid")
            };
            let (first, second) = (Claim::new(30_000), Claim::new(30_000));
            let m = message("m1");
            let taken = h.evaluate_claimed(&policy, &m, now, &first);
            assert!(
                taken.committed(),
                "{target}, {name}: the first delivery admitted"
            );
            let copy = h.evaluate_claimed(&policy, &m, now, &second);
            assert!(
                copy.in_flight().is_some_and(|ms| ms > 0 && ms <= 30_000),
                "{target}, {name}: the copy is told the id is in flight: {copy:?}"
            );
            assert!(
                !copy.committed() && copy.verdicts().is_empty(),
                "{target}, {name}: {copy:?}"
            );
            h.rt.block_on(h.limiter.release_claim(&m, &first, now));
            let after = h.evaluate_claimed(&policy, &m, now, &second);
            assert!(
                after.committed(),
                "{target}, {name}: decided once released: {after:?}"
            );
            // The copies consumed one send between them: the headline rule admits nothing more
            // today, and the global rule's five an hour would have three left after another.
            let room = h.evaluate(&policy, &message("m2"), now, false);
            let remaining: Vec<_> = room.verdicts().iter().map(|v| v.remaining).collect();
            let expected = if toml.is_empty() {
                vec![Some(0)]
            } else {
                vec![Some(3)]
            };
            assert_eq!(remaining, expected, "{target}, {name}: {room:?}");
        }
    }
}
