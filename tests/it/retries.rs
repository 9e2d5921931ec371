//! A failure of Postgres or of the broker leaves the message unacked and retried with backoff;
//! once the service accepts the outcome it lands exactly once and nothing is lost.

use crate::support;

use std::collections::HashMap;
use std::time::Duration;

use lapin::options::QueueBindOptions;
use lapin::types::FieldTable;
use sendquota::clock::ManualClock;
use sendquota::failpoint::Failpoint;
use sendquota::internals::broker;
use sendquota::internals::denials::DenialStore;
use sendquota::internals::quarantine::{self, Which};
use support::{local, request, TestEnv};

#[tokio::test]
async fn a_denial_that_postgres_refuses_is_retried_until_it_is_written() {
    let mut env = TestEnv::new().await;
    let clock = ManualClock::new(local("UTC", "2026-02-02 09:00"));
    env.start_worker(&clock);
    let mut seen = HashMap::new();
    env.publish(&request("first", "alice", "UTC")).await;
    assert!(env.outcome("first", &mut seen).await);

    sqlx::query("ALTER TABLE denials RENAME TO denials_away")
        .execute(&env.pool)
        .await
        .expect("hide the table");
    env.publish(&request("second", "alice", "UTC")).await;
    // Long enough for several failed attempts (retries start at 20 ms in tests).
    tokio::time::sleep(Duration::from_millis(400)).await;
    sqlx::query("ALTER TABLE denials_away RENAME TO denials")
        .execute(&env.pool)
        .await
        .expect("restore the table");

    assert!(
        !env.outcome("second", &mut seen).await,
        "denied once Postgres accepts it"
    );
    env.stop_worker().await;
    assert_eq!(env.denial_count("second").await, 1);
    assert!(
        env.drain(&env.names.requests).await.is_empty(),
        "acked, not requeued"
    );
}

#[tokio::test]
async fn a_dispatch_no_queue_would_receive_is_retried_until_a_sender_binds() {
    let mut env = TestEnv::new().await;
    let clock = ManualClock::new(local("UTC", "2026-02-02 09:00"));
    env.unbind_dispatched().await;
    env.start_worker(&clock);
    env.publish(&request("waiting", "alice", "UTC")).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(
        env.take_dispatched().await.is_empty(),
        "an unroutable dispatch is not lost"
    );

    env.bind_dispatched("sms").await;
    let mut seen = HashMap::new();
    assert!(env.outcome("waiting", &mut seen).await);
    env.stop_worker().await;
    for id in env.take_dispatched().await {
        *seen.entry(id).or_default() += 1;
    }
    assert_eq!(seen.get("waiting"), Some(&1), "dispatched exactly once");
}

/// Postgres refuses one message's denial row for its data (here a trigger refusing alice's
/// rows as numeric refuses a number it cannot hold, SQLSTATE 22003). The refusal is the
/// message's own: the rows written beside it in the same batches are written, the message is
/// retried a few times, then moved to the quarantine queue with why, and acked; nothing waits
/// on it forever.
#[tokio::test]
async fn a_denial_postgres_refuses_for_its_data_is_quarantined_and_its_batch_is_written() {
    const OTHERS: usize = 40;
    let mut env = TestEnv::new().await;
    support::refuse_denials_of(
        &env.pool,
        "alice",
        "22003",
        "value overflows numeric format",
    )
    .await;
    let clock = ManualClock::new(local("UTC", "2026-02-02 09:00"));
    env.start_worker(&clock);
    let mut seen = HashMap::new();
    for i in 0..OTHERS {
        let id = format!("first-{i}");
        env.publish(&request(&id, &format!("r{i}"), "UTC")).await;
        assert!(env.outcome(&id, &mut seen).await);
    }
    env.publish(&request("first-alice", "alice", "UTC")).await;
    assert!(env.outcome("first-alice", &mut seen).await);
    // Each recipient's second message of the day is denied: the poison among the others.
    let poison = br#"{"id":"poison","recipient":"alice","channel":"sms","payload":{"x":1}}"#;
    for i in 0..OTHERS {
        if i == OTHERS / 2 {
            env.publish_raw(poison).await;
        }
        env.publish(&request(&format!("second-{i}"), &format!("r{i}"), "UTC"))
            .await;
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let quarantined = loop {
        let got = env.drain(&env.names.quarantine).await;
        if !got.is_empty() {
            break got;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the poison message was quarantined"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(quarantined.len(), 1);
    let q = &quarantined[0].delivery;
    assert_eq!(q.data, poison, "the body as it was published");
    let header = |name| broker::header(&q.properties, name).unwrap_or_default();
    let reason = header(broker::QUARANTINE_REASON_HEADER);
    assert!(
        reason.contains("SQLSTATE 22003"),
        "the reason names Postgres's refusal: {reason}"
    );
    assert_eq!(header(broker::QUARANTINE_ATTEMPTS_HEADER), "3");
    assert!(!header(broker::QUARANTINE_FIRST_ERROR_HEADER).is_empty());
    for i in 0..OTHERS {
        assert!(
            !env.outcome(&format!("second-{i}"), &mut seen).await,
            "second-{i} denied, its row written"
        );
    }
    env.stop_worker().await;
    assert_eq!(env.denial_count("poison").await, 0);
    assert!(
        env.drain(&env.names.requests).await.is_empty(),
        "the poison was acked, not left to be retried"
    );
}

/// Once the cause is fixed, `sendquota quarantine replay` publishes the message again and it
/// is decided like any other; `quarantine list` shows it until then. Here the cause is a
/// trigger that refuses one recipient's denial rows with a data error, dropped before replay.
#[tokio::test]
async fn a_quarantined_message_is_listed_and_replayed_once_its_cause_is_fixed() {
    let mut env = TestEnv::new().await;
    let (_clock, mut seen) = env.start_worker_quarantining_picky().await;
    env.publish(&request("p2", "picky", "UTC")).await;

    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let listed = loop {
        let run = support::process::run_for(
            env.cli(&["quarantine", "list"]),
            None,
            Duration::from_secs(30),
        );
        assert_eq!(run.code, Some(0), "{run:?}");
        if !run.stdout.is_empty() {
            break run.stdout;
        }
        assert!(std::time::Instant::now() < deadline, "p2 quarantined");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let entry: serde_json::Value = serde_json::from_str(listed.trim()).expect("one JSON line");
    assert_eq!(entry["message_id"], "p2");
    assert!(
        entry["reason"]
            .as_str()
            .is_some_and(|r| r.contains("picky refuses")),
        "{entry}"
    );
    let again = support::process::run_for(
        env.cli(&["quarantine", "list"]),
        None,
        Duration::from_secs(30),
    );
    assert_eq!(
        again.stdout, listed,
        "listing leaves the message in quarantine"
    );

    env.accept_denials().await;
    quarantine_replay(&env, 1);
    assert!(
        !env.outcome("p2", &mut seen).await,
        "p2 decided again: denied, its row written"
    );
    env.stop_worker().await;
    assert_eq!(env.denial_count("p2").await, 1);
    let audited: (Option<String>, String) =
        sqlx::query_as("SELECT message_id, reason FROM quarantine_replays")
            .fetch_one(&env.pool)
            .await
            .expect("one audit row");
    assert_eq!(audited.0.as_deref(), Some("p2"));
    assert!(audited.1.contains("picky refuses"));
    assert!(env.drain(&env.names.quarantine).await.is_empty());
}

/// `quarantine replay` takes what the queue held when it started, each message once. Here the
/// quarantine queue is also bound to the requests exchange, so every replay lands back in
/// quarantine at once, as it does when the cause is not fixed and the worker quarantines it
/// again: a run that went on until the queue was empty replayed its own replays up to its
/// limit (1,000 replays and audit rows for a few messages). Two copies of one message are two
/// messages: both are replayed.
#[tokio::test]
async fn a_quarantine_replay_takes_each_message_the_queue_held_at_its_start_once() {
    const HELD: usize = 7;
    let env = TestEnv::new().await;
    // The last is a second copy of the first (a producer's retry, quarantined twice): two
    // messages, both replayed.
    for i in (0..HELD - 1).chain([0]) {
        quarantine_picky(&env, &format!("q{i}")).await;
    }
    env.channel
        .queue_bind(
            env.names.quarantine.as_str().into(),
            env.names.requests.as_str().into(),
            "".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("bind the quarantine queue to the requests exchange");

    quarantine_replay(&env, HELD);
    let (rows, ids): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT message_id) FROM quarantine_replays")
            .fetch_one(&env.pool)
            .await
            .expect("the audit rows");
    assert_eq!(
        (rows, ids),
        (HELD as i64, HELD as i64 - 1),
        "one audit row per message, two for the id quarantined twice"
    );
    assert_eq!(
        env.ready(&env.names.quarantine).await,
        HELD as u32,
        "each replayed once, back in quarantine"
    );
}

/// Quarantining a message gives back what it took before publishing it to the quarantine
/// queue: while Redis fails between the two steps (here the `fail-quarantine-refund`
/// failpoint, for `gone-` recipients, every time) no copy is published, and once Redis
/// answers the message is quarantined once. Published first, each failed refund left a copy
/// in the queue and the retry published another.
#[tokio::test]
async fn a_quarantine_whose_refund_fails_leaves_no_copy_and_is_quarantined_once_later() {
    let mut env = TestEnv::new().await;
    env.refuse_denials_to("gone-picky").await;
    let clock = ManualClock::new(local("UTC", "2026-02-02 09:00"));
    env.start_worker_with(&clock, Some(Failpoint::FailQuarantineRefund));
    let mut seen = HashMap::new();
    env.publish(&request("g1", "gone-picky", "UTC")).await;
    assert!(env.outcome("g1", &mut seen).await, "g1 uses the day");
    env.publish(&request("g2", "gone-picky", "UTC")).await;
    // Retries start at 20 ms and double up to 500 ms: three refusals, then several attempts
    // at quarantining it.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert_eq!(
        env.ready(&env.names.quarantine).await,
        0,
        "no copy while the refund fails"
    );
    env.stop_worker().await;

    env.start_worker(&clock);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while env.ready(&env.names.quarantine).await == 0 {
        assert!(std::time::Instant::now() < deadline, "g2 quarantined");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    env.stop_worker().await;
    assert_eq!(
        env.quarantined().await,
        vec![Some("g2".to_owned())],
        "quarantined once"
    );
}

/// A listing or a replay returns once the messages it looked at and gave back are ready in the
/// quarantine queue again. The broker requeues a closed channel's unacked messages after it
/// has answered the close: a count right after the command (an operator's, or the next
/// listing's) found fewer messages than the queue held (without the wait this test
/// failed in its first round, in both runs).
#[tokio::test]
async fn a_listing_or_a_replay_returns_with_what_it_gave_back_ready_again() {
    const ROUNDS: usize = 60;
    let env = TestEnv::new().await;
    let store = DenialStore::from_pool(env.pool.clone());
    for round in 0..ROUNDS {
        for id in ["first", "second"] {
            quarantine_picky(&env, id).await;
        }
        let listed = quarantine::list_held(&env.settings.amqp, &env.names, "test", 10)
            .await
            .expect("list the quarantine");
        assert_eq!(listed.len(), 2, "round {round}: both listed");
        assert_eq!(
            env.ready(&env.names.quarantine).await,
            2,
            "round {round}: both are back after the listing"
        );
        let which = Which::One {
            message_id: "second".to_owned(),
        };
        let replayed = quarantine::replay_held(
            &env.settings.amqp,
            &env.names,
            &store,
            &which,
            "test",
            "test",
        )
        .await
        .expect("replay");
        assert_eq!(replayed, 1, "round {round}: the second is replayed");
        assert_eq!(
            env.ready(&env.names.quarantine).await,
            1,
            "round {round}: the first, looked at and not replayed, is back"
        );
        env.drain(&env.names.quarantine).await;
    }
}

/// Messages that keep failing while others go through (here every attempt at a `stuck-` id
/// fails as if Redis were away) must not hold every slot. More of them than the worker's
/// default concurrency arrive first; each yields its slot after `yield_slot_after_ms` of
/// failing and waits in a delay queue, so the messages behind them are dispatched. Once the
/// cause is gone (a worker without the failpoint), every stuck message is dispatched, once.
#[tokio::test]
async fn messages_that_keep_failing_yield_their_slots_to_the_others() {
    const GOOD: usize = 20;
    let mut env = TestEnv::with_config("[worker]\nyield_slot_after_ms = 1000\n").await;
    // More than every slot at the default concurrency.
    let stuck = env.settings.worker.concurrency + 100;
    let clock = ManualClock::new(local("UTC", "2026-02-02 09:00"));
    env.start_worker_with(&clock, Some(Failpoint::FailStuckIds));
    for i in 0..stuck {
        env.publish(&request(&format!("stuck-{i}"), &format!("s{i}"), "UTC"))
            .await;
    }
    for i in 0..GOOD {
        env.publish(&request(&format!("good-{i}"), &format!("g{i}"), "UTC"))
            .await;
    }
    let mut seen = HashMap::new();
    for i in 0..GOOD {
        env.dispatched(&format!("good-{i}"), &mut seen).await;
    }
    assert!(
        seen.keys().all(|id| id.starts_with("good-")),
        "stuck messages fail: {seen:?}"
    );
    env.stop_worker().await;

    env.start_worker(&clock);
    for i in 0..stuck {
        env.dispatched(&format!("stuck-{i}"), &mut seen).await;
    }
    env.stop_worker().await;
    for id in env.take_dispatched().await {
        *seen.entry(id).or_default() += 1;
    }
    let twice: Vec<_> = seen.iter().filter(|(_, &n)| n != 1).collect();
    assert!(twice.is_empty(), "dispatched more than once: {twice:?}");
    assert_eq!(seen.len(), stuck + GOOD);
}

/// Puts a request `id` to picky in `env`'s quarantine queue, as the worker does when Postgres
/// refuses picky's denial rows.
async fn quarantine_picky(env: &TestEnv, id: &str) {
    let body = request(id, "picky", "UTC").to_string();
    let headers = [(broker::QUARANTINE_REASON_HEADER, "picky refuses".to_owned())];
    env.publisher
        .publish(
            "",
            &env.names.quarantine,
            body.as_bytes(),
            broker::json_properties(Some(id), &headers),
        )
        .await
        .expect("quarantine a message");
}

/// Runs `sendquota quarantine replay` for `env`, which must say it replayed `expected`
/// messages.
fn quarantine_replay(env: &TestEnv, expected: usize) {
    let run = support::process::run_for(
        env.cli(&["quarantine", "replay"]),
        None,
        Duration::from_secs(30),
    );
    assert_eq!(run.code, Some(0), "{run:?}");
    assert!(
        run.stdout
            .contains(&format!("replayed {expected} quarantined messages")),
        "{run:?}"
    );
}
