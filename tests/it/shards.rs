//! Ordered intake across workers (`intake.shards = N`): each recipient's messages hash to one
//! of N single-active-consumer queues, so with several workers they are still decided in the
//! order they were published; a standby worker takes over a stopped one's shards; a delayed
//! message comes back to its recipient's shard.

use crate::support;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use sendquota::clock::ManualClock;
use support::private::PrivateRabbit;
use support::process::Running;
use support::{fixtures::policy, local, request, TestEnv, OUTCOME_TIMEOUT};

const SHARDS: u16 = 4;

/// The configuration of a sharded environment and its worker binaries.
fn sharded() -> String {
    format!("[intake]\nshards = {SHARDS}\n")
}

/// A worker binary of `env` with shards, started and consuming its shards.
async fn sharded_worker(env: &TestEnv) -> Running {
    let mut cmd = env.cli_with(&sharded(), &["worker", "--now", "2026-02-02T09:00:00Z"]);
    // Info says when the shards are consumed; the decision log says which worker decided what.
    cmd.env("SENDQUOTA_LOG", "info,lapin=off,sendquota::decisions=debug");
    let worker = Running::spawn(cmd);
    worker
        .wait_for("the worker consumes its shards", OUTCOME_TIMEOUT, |lines| {
            lines.iter().any(|l| l.contains("consuming every shard"))
        })
        .await;
    worker
}

/// Publishes `pairs` pairs (`<tag>-first-<i>` then `<tag>-second-<i>` to recipient
/// `<tag>-<i>`, back to back, same local day) and returns the pairs the second message won.
async fn pairs_won_by_the_second(env: &TestEnv, tag: &str, pairs: usize) -> Vec<usize> {
    for i in 0..pairs {
        let recipient = format!("{tag}-{i}");
        env.publish_keyed(&request(&format!("{tag}-first-{i}"), &recipient, "UTC"))
            .await;
        env.publish_keyed(&request(&format!("{tag}-second-{i}"), &recipient, "UTC"))
            .await;
    }
    let mut seen = HashMap::new();
    let mut won_by_the_second = Vec::new();
    for i in 0..pairs {
        let first = env.outcome(&format!("{tag}-first-{i}"), &mut seen).await;
        let second = env.outcome(&format!("{tag}-second-{i}"), &mut seen).await;
        assert!(first != second, "pair {i}: one dispatched, one denied");
        if second {
            won_by_the_second.push(i);
        }
    }
    won_by_the_second
}

/// With 4 shards and 3 worker processes running while 300 pairs are published, the first
/// published message of every pair wins the recipient's one slot of the day (headline rule).
/// (Unsharded, 3 workers let the second win now and then: they take a pair's two messages
/// side by side and decide them in the order they arrive.)
#[tokio::test]
async fn with_shards_the_first_published_of_two_messages_wins_with_three_workers() {
    const PAIRS: usize = 300;
    let env = TestEnv::with_config(&sharded()).await;
    let workers = [
        sharded_worker(&env).await,
        sharded_worker(&env).await,
        sharded_worker(&env).await,
    ];
    let lost = pairs_won_by_the_second(&env, "p", PAIRS).await;
    drop(workers);
    assert!(
        lost.is_empty(),
        "{} of {PAIRS} pairs were won by the second message: {lost:?}",
        lost.len()
    );
}

/// The worker started first is the active consumer of every shard; once it is killed, the two
/// standing by take its shards over, and later pairs are still decided, each in order.
#[tokio::test]
async fn a_stopped_workers_shards_are_taken_over_by_a_standby_in_order() {
    const PAIRS: usize = 60;
    let env = TestEnv::with_config(&sharded()).await;
    let first = sharded_worker(&env).await;
    let standby = [sharded_worker(&env).await, sharded_worker(&env).await];
    let before = pairs_won_by_the_second(&env, "before", PAIRS).await;
    // Killed, not stopped: its consumers go without a word, as in a crash.
    let lines = first.stop();
    assert!(
        lines.iter().any(|l| l.contains("before-first-0")),
        "the first worker started is the active one, and decided the first pairs:\n{}",
        lines.join("\n")
    );
    let after = pairs_won_by_the_second(&env, "after", PAIRS).await;
    drop(standby);
    assert_eq!(
        (before, after),
        (vec![], vec![]),
        "pairs won by the second message before and after the stop"
    );
}

/// A message a `delay` rule parks comes back from the delay queue to the shard of its
/// recipient (the recipient header travels with it), not to the shard of messages without
/// the header.
#[tokio::test]
async fn a_delayed_message_comes_back_to_its_recipients_shard() {
    const RECIPIENTS: usize = 8;
    let config = format!("{}{}", sharded(), policy!("quiet_from_22_to_7_delayed"));
    let mut env = TestEnv::with_config(&config).await;
    let shard_of = |counts: &[u32]| counts.iter().position(|&n| n > 0);
    let mut expected = vec![0u32; usize::from(SHARDS)];
    for i in 0..RECIPIENTS {
        env.publish_keyed(&request(&format!("d-{i}"), &format!("late-{i}"), "UTC"))
            .await;
        let counts = shard_counts(&env).await;
        let now: u32 = counts.iter().sum();
        assert_eq!(now, 1, "one message waits, in one shard: {counts:?}");
        let shard = shard_of(&counts).expect("a shard holds it");
        expected[shard] += 1;
        // Taken off again by a worker below: here each recipient's shard is only learned.
        env.drain(&env.names.shard_queue(shard as u16)).await;
    }
    assert!(
        expected.iter().filter(|&&n| n > 0).count() > 1,
        "the recipients spread over several shards: {expected:?}"
    );
    for i in 0..RECIPIENTS {
        env.publish_keyed(&request(&format!("d-{i}"), &format!("late-{i}"), "UTC"))
            .await;
    }
    // A second before quiet hours end: each message is parked for the 1 s tier.
    let clock = ManualClock::new(local("UTC", "2026-02-02 06:59:59"));
    env.start_worker(&clock);
    wait_until(&env, "every message is parked", |c| {
        c.iter().sum::<u32>() == 0
    })
    .await;
    env.stop_worker().await;
    let target = expected.clone();
    wait_until(&env, "every message came back to its shard", move |c| {
        c == target.as_slice()
    })
    .await;
}

/// Messages ready in each shard's queue.
async fn shard_counts(env: &TestEnv) -> Vec<u32> {
    let mut counts = Vec::new();
    for queue in env.names.intake_queues() {
        counts.push(env.ready(&queue).await);
    }
    counts
}

async fn wait_until(env: &TestEnv, what: &str, done: impl Fn(&[u32]) -> bool) {
    let deadline = Instant::now() + OUTCOME_TIMEOUT;
    loop {
        let counts = shard_counts(env).await;
        if done(&counts) {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: {counts:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A broker without the `rabbitmq_consistent_hash_exchange` plugin (a private node, whose
/// plugins file enables none) cannot hold the shards: a sharded worker stops at start with
/// exit 1 and a line naming the plugin and how to enable it.
#[tokio::test]
async fn a_sharded_worker_on_a_broker_without_the_plugin_stops_at_start_naming_it() {
    let rabbit = tokio::task::spawn_blocking(PrivateRabbit::start)
        .await
        .expect("start a private rabbitmq");
    let env = TestEnv::new().await;
    let mut cmd = env.cli_with(&sharded(), &["worker"]);
    cmd.env("SENDQUOTA_AMQP_URL", rabbit.url());
    let run = tokio::task::spawn_blocking(move || {
        support::process::run_for(cmd, None, Duration::from_secs(60))
    })
    .await
    .expect("the worker ran");
    assert_eq!(run.code, Some(1), "{run:?}");
    assert!(
        run.stderr
            .contains("rabbitmq-plugins enable rabbitmq_consistent_hash_exchange"),
        "{}",
        run.stderr
    );
}
