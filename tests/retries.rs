//! A failure of Postgres or of the broker leaves the message unacked and retried with backoff;
//! once the service accepts the outcome it lands exactly once and nothing is lost.

mod support;

use std::collections::HashMap;
use std::time::Duration;

use lapin::options::QueueBindOptions;
use lapin::types::FieldTable;
use sendquota::clock::ManualClock;
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
    env.channel
        .queue_unbind(
            env.dispatched_queue.as_str().into(),
            env.names.dispatch.as_str().into(),
            "#".into(),
            FieldTable::default(),
        )
        .await
        .expect("unbind the sender queue");
    env.start_worker(&clock);
    env.publish(&request("waiting", "alice", "UTC")).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(
        env.take_dispatched().await.is_empty(),
        "an unroutable dispatch is not lost"
    );

    env.channel
        .queue_bind(
            env.dispatched_queue.as_str().into(),
            env.names.dispatch.as_str().into(),
            "sms".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("bind the sender queue");
    let mut seen = HashMap::new();
    assert!(env.outcome("waiting", &mut seen).await);
    env.stop_worker().await;
    for id in env.take_dispatched().await {
        *seen.entry(id).or_default() += 1;
    }
    assert_eq!(seen.get("waiting"), Some(&1), "dispatched exactly once");
}
