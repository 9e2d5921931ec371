//! Messages to one recipient that a worker holds at once are decided in the order they were
//! published, while other recipients' messages are decided beside them.

use crate::support;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use sendquota::clock::ManualClock;
use sendquota::failpoint::{Failpoint, SLOW_IDS_HOLD};
use support::process::Running;
use support::{local, request, TestEnv, OUTCOME_TIMEOUT};

/// Pairs published back to back, more than the default prefetch holds: the worker takes both
/// messages of many pairs at once.
const PAIRS: usize = 200;

/// 200 recipients get two messages each under the headline rule (one a day), every pair
/// published back to back before the worker binary starts, so it holds both messages of many
/// pairs at once at the default prefetch and concurrency: the first published of each pair is
/// dispatched, the second denied.
#[tokio::test]
async fn the_first_published_of_two_messages_to_one_recipient_wins_the_days_only_slot() {
    let env = TestEnv::new().await;
    assert_eq!(
        (env.settings.worker.concurrency, env.settings.amqp.prefetch),
        (1000, 1000),
        "default concurrency and prefetch"
    );
    for i in 0..PAIRS {
        let recipient = format!("user-{i}");
        env.publish(&request(&format!("first-{i}"), &recipient, "UTC"))
            .await;
        env.publish(&request(&format!("second-{i}"), &recipient, "UTC"))
            .await;
    }
    let worker = Running::spawn(env.cli(&["worker", "--now", "2026-02-02T09:00:00Z"]));
    let mut seen = HashMap::new();
    let mut won_by_the_second = Vec::new();
    for i in 0..PAIRS {
        let first = env.outcome(&format!("first-{i}"), &mut seen).await;
        let second = env.outcome(&format!("second-{i}"), &mut seen).await;
        assert!(first != second, "pair {i}: one dispatched, one denied");
        if second {
            won_by_the_second.push(i);
        }
    }
    drop(worker);
    assert!(
        won_by_the_second.is_empty(),
        "{} of {PAIRS} pairs were won by the second message: {won_by_the_second:?}",
        won_by_the_second.len()
    );
}

/// A recipient's first message is slow to decide (the `slow-ids` failpoint holds it for
/// [`SLOW_IDS_HOLD`]): that recipient's second message waits for it and is denied, while
/// another recipient's message, published after both, is dispatched at once.
#[tokio::test]
async fn a_slow_decision_holds_up_its_recipients_later_messages_and_no_one_elses() {
    let mut env = TestEnv::new().await;
    let clock = ManualClock::new(local("UTC", "2026-02-02 09:00"));
    env.start_worker_with(&clock, Some(Failpoint::SlowIds));
    env.publish(&request("slow-1", "alice", "UTC")).await;
    env.publish(&request("alice-2", "alice", "UTC")).await;
    let published = Instant::now();
    env.publish(&request("bob-1", "bob", "UTC")).await;
    let mut seen = HashMap::new();
    env.dispatched("bob-1", &mut seen).await;
    assert!(
        published.elapsed() < SLOW_IDS_HOLD / 2,
        "bob's message waited {:?} behind alice's slow one",
        published.elapsed()
    );
    assert!(
        !seen.contains_key("alice-2") && env.denial_count("alice-2").await == 0,
        "alice's second message waits for her first to be decided"
    );
    assert!(
        env.outcome("slow-1", &mut seen).await,
        "alice's first message is dispatched"
    );
    assert!(
        !env.outcome("alice-2", &mut seen).await,
        "alice's second message is denied"
    );
    env.stop_worker().await;
    let late = env.take_dispatched().await;
    assert!(
        !seen.contains_key("alice-2") && !late.iter().any(|id| id == "alice-2"),
        "alice's second message is not dispatched as well"
    );
}

/// A message whose decision keeps failing (here every attempt at a `stuck-` id fails as if its
/// Redis shard were away) gives up its turn: the recipient's later messages are decided at
/// once, not after it yields its slot (`yield_slot_after_ms`, 60 s by default), and a burst to
/// one recipient cannot hold every slot of the worker behind one failing message.
#[tokio::test]
async fn a_failing_decision_does_not_hold_up_its_recipients_later_messages() {
    let mut env = TestEnv::new().await;
    let clock = ManualClock::new(local("UTC", "2026-02-02 09:00"));
    env.start_worker_with(&clock, Some(Failpoint::FailStuckIds));
    env.publish(&request("stuck-1", "alice", "UTC")).await;
    env.publish(&request("alice-2", "alice", "UTC")).await;
    let mut seen = HashMap::new();
    env.dispatched("alice-2", &mut seen).await;
    assert!(
        !seen.contains_key("stuck-1"),
        "the failing message is still being retried"
    );
    env.stop_worker().await;
}

/// While no sender's queue is bound for a channel, the worker's log says so once, with the
/// remedy, however many messages wait and however often they are retried; once a queue is
/// bound they are dispatched.
#[tokio::test]
async fn an_unbound_channel_is_logged_once_with_the_remedy_not_once_per_message_and_retry() {
    const WAITING: usize = 20;
    let env = TestEnv::new().await;
    env.unbind_dispatched().await;
    // The log an operator sees by default.
    let mut cmd = env.cli(&["worker", "--now", "2026-02-02T09:00:00Z"]);
    cmd.env_remove("SENDQUOTA_LOG");
    let worker = Running::spawn(cmd);
    for i in 0..WAITING {
        env.publish(&request(&format!("w-{i}"), &format!("r{i}"), "UTC"))
            .await;
    }
    let said = |lines: &[String]| {
        lines
            .iter()
            .filter(|l| l.contains("no queue is bound"))
            .count()
    };
    worker
        .wait_for("the unbound channel is said", OUTCOME_TIMEOUT, |lines| {
            said(lines) > 0
        })
        .await;
    // Long enough for several retries of every message (retries start at 100 ms by default).
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        env.take_dispatched().await.is_empty(),
        "nothing is routable"
    );
    env.bind_dispatched("sms").await;
    let mut seen = HashMap::new();
    for i in 0..WAITING {
        env.dispatched(&format!("w-{i}"), &mut seen).await;
    }
    let lines = worker.stop();
    let remedy = format!(
        "no queue is bound to {}.dispatch for routing key sms: bind a sender's queue, or run \
         `sendquota tail`",
        env.namespace
    );
    assert_eq!(
        said(&lines),
        1,
        "said once, not per message and retry:\n{}",
        lines.join("\n")
    );
    assert!(
        lines.iter().any(|l| l.contains(&remedy)),
        "with the remedy:\n{}",
        lines.join("\n")
    );
    assert!(
        !lines.iter().any(|l| l.contains("message not decided")),
        "{}",
        lines.join("\n")
    );
    assert!(
        lines
            .iter()
            .any(|l| l.contains("dispatches for routing key sms are routed again")),
        "{}",
        lines.join("\n")
    );
}

/// The README's first example as a new user runs it, with `sendquota tail` as the only queue
/// bound to the dispatch exchange: m-1 is dispatched (tail prints it, one JSON line with its
/// routing key, id and body) and m-2 denied.
#[tokio::test]
async fn the_readme_example_dispatches_m1_which_tail_prints_and_denies_m2() {
    let mut env = TestEnv::new().await;
    env.unbind_dispatched().await;
    let tail = Running::spawn(env.cli(&["tail", "--channel", "sms"]));
    tail.wait_for("tail listens", OUTCOME_TIMEOUT, |lines| {
        lines.iter().any(|l| l.starts_with("tailing "))
    })
    .await;
    let clock = ManualClock::new(local("UTC", "2026-05-01 09:00"));
    env.start_worker(&clock);
    let m1 = r#"{"id":"m-1","recipient":"user-42","channel":"sms","timezone":"Asia/Shanghai"}"#;
    let m2 = r#"{"id":"m-2","recipient":"user-42","channel":"sms","timezone":"Asia/Shanghai"}"#;
    let file = support::TempFile::new(&format!("{m1}\n{m2}\n"));
    let published = support::process::run_for(
        env.cli(&["publish", file.path()]),
        None,
        Duration::from_secs(30),
    );
    assert_eq!(published.code, Some(0), "{published:?}");
    let deadline = Instant::now() + OUTCOME_TIMEOUT;
    while env.denial_count("m-2").await == 0 {
        assert!(Instant::now() < deadline, "m-2 is denied");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tail.wait_for("tail prints m-1", OUTCOME_TIMEOUT, |lines| {
        lines.iter().any(|l| l.contains(r#""message_id":"m-1""#))
    })
    .await;
    env.stop_worker().await;
    let printed: Vec<serde_json::Value> = tail
        .stop()
        .iter()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    let m1: serde_json::Value = serde_json::from_str(m1).expect("m-1 is JSON");
    assert_eq!(
        printed,
        [serde_json::json!({"routing_key": "sms", "message_id": "m-1", "body": m1})]
    );
}
