//! `sendquota replay` through the real services: each denial is published once even with two
//! replays at once or a replay killed midway; a replay that is denied again links to the denial
//! it replayed; `--dry-run` changes nothing; `--rate` holds.

use crate::support;

use std::collections::HashMap;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use sendquota::clock::ManualClock;
use sendquota::internals::broker::{self, Names, Publisher};
use sendquota::internals::denials::{DenialFilter, DenialRow, DenialStore};
use sendquota::internals::message::SendRequest;
use sendquota::internals::replay::{replay, ReplayOptions};
use support::{local, request, TestEnv};

/// Records `n` denials directly (as the worker would), one per recipient.
async fn seed_denials(env: &TestEnv, n: usize) {
    let store = DenialStore::from_pool(env.pool.clone());
    for i in 0..n {
        let body = request(&format!("d{i}"), &format!("user-{i}"), "UTC").to_string();
        let message = SendRequest::decode(body.as_bytes(), 1 << 16).expect("valid");
        store
            .insert(&DenialRow {
                rule: "headline".to_owned(),
                kind: "calendar_quota".to_owned(),
                reason: "test".to_owned(),
                retry_after: Some(local("UTC", "2026-04-02 00:00")),
                ..DenialRow::for_message(&message, local("UTC", "2026-04-01 12:00"))
            })
            .await
            .expect("insert denial");
    }
}

/// Replay-of header of every message now in the requests queue.
async fn replayed_denial_ids(env: &TestEnv) -> Vec<i64> {
    env.drain(&env.names.requests)
        .await
        .iter()
        .map(|m| {
            broker::header(&m.delivery.properties, broker::REPLAY_OF_HEADER)
                .and_then(|v| v.parse().ok())
                .expect("replay-of header")
        })
        .collect()
}

fn counts(ids: &[i64]) -> HashMap<i64, usize> {
    let mut c = HashMap::new();
    for id in ids {
        *c.entry(*id).or_default() += 1;
    }
    c
}

fn options(batch: i64) -> ReplayOptions {
    ReplayOptions {
        filter: DenialFilter::default(),
        limit: None,
        rate: None,
        batch,
    }
}

/// Replays every replayable denial of `env` through its publisher, one per batch; how many.
async fn replay_all(env: &TestEnv, store: &DenialStore) -> usize {
    replay(
        store,
        &env.publisher,
        &env.names,
        &options(1),
        chrono::Utc::now,
        |_| {},
    )
    .await
    .expect("replay")
    .replayed
}

/// `sendquota <args>` for `env` ([`TestEnv::cli`]), logging off, its output piped.
fn binary(env: &TestEnv, args: &[&str]) -> Command {
    let mut cmd = env.cli(args);
    cmd.env("SENDQUOTA_LOG", "off")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

#[tokio::test]
async fn a_replayed_message_is_decided_again_and_a_new_denial_links_to_the_old_one() {
    let mut env = TestEnv::new().await;
    let clock = ManualClock::new(local("UTC", "2026-04-01 09:00"));
    env.start_worker(&clock);
    let mut seen = HashMap::new();
    env.publish(&request("m1", "alice", "UTC")).await;
    assert!(env.outcome("m1", &mut seen).await);
    env.publish(&request("m2", "alice", "UTC")).await;
    assert!(!env.outcome("m2", &mut seen).await);
    let first = env.denials().await[0].id;

    // Replayed the same day: denied again, the new row names the one replayed.
    let store = DenialStore::from_pool(env.pool.clone());
    assert_eq!(replay_all(&env, &store).await, 1);
    let deadline = Instant::now() + Duration::from_secs(10);
    while env.denials().await.len() < 2 {
        assert!(Instant::now() < deadline, "the replay was decided");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let rows = env.denials().await;
    assert!(
        rows[0].replayed_at.is_some(),
        "the first denial is marked replayed"
    );
    assert_eq!(
        (rows[1].message_id.as_str(), rows[1].replay_of),
        ("m2", Some(first))
    );

    // The next day the replay of the second denial is dispatched.
    clock.set(local("UTC", "2026-04-02 09:00"));
    assert_eq!(replay_all(&env, &store).await, 1);
    // m2 already has denial rows, so `outcome` would answer "denied" for it at once: wait for
    // its dispatch instead.
    env.dispatched("m2", &mut seen).await;
    env.stop_worker().await;
    assert_eq!(env.denials().await.len(), 2, "no third denial");
}

#[tokio::test]
async fn two_replays_started_together_publish_each_denial_once() {
    let env = TestEnv::new().await;
    seed_denials(&env, 120).await;
    let store = DenialStore::from_pool(env.pool.clone());
    let second = Publisher::open(&env.broker).await.expect("publisher");
    let names = Names::new(&env.namespace);
    let opts = options(5);
    let (a, b) = tokio::join!(
        replay(
            &store,
            &env.publisher,
            &names,
            &opts,
            chrono::Utc::now,
            |_| {}
        ),
        replay(&store, &second, &names, &opts, chrono::Utc::now, |_| {}),
    );
    let (a, b) = (a.expect("first replay"), b.expect("second replay"));
    assert_eq!(a.replayed + b.replayed, 120);
    assert!(
        a.replayed > 0 && b.replayed > 0,
        "both took part: {} and {}",
        a.replayed,
        b.replayed
    );
    let ids = replayed_denial_ids(&env).await;
    assert_eq!(ids.len(), 120);
    assert!(
        counts(&ids).values().all(|&n| n == 1),
        "each denial published once"
    );
}

#[tokio::test]
async fn a_replay_claims_whole_batches_and_stops_at_the_limit() {
    let env = TestEnv::new().await;
    seed_denials(&env, 120).await;
    let store = DenialStore::from_pool(env.pool.clone());
    let all = replay(
        &store,
        &env.publisher,
        &env.names,
        &ReplayOptions {
            limit: Some(110),
            ..options(50)
        },
        chrono::Utc::now,
        |_| {},
    )
    .await
    .expect("replay");
    assert_eq!(
        (all.replayed, all.claims),
        (110, 3),
        "batches of 50, 50 and 10"
    );
    let rest = replay(
        &store,
        &env.publisher,
        &env.names,
        &options(50),
        chrono::Utc::now,
        |_| {},
    )
    .await
    .expect("replay");
    assert_eq!((rest.replayed, rest.claims), (10, 1));
    assert_eq!(replayed_denial_ids(&env).await.len(), 120);
}

#[tokio::test]
async fn a_dry_run_lists_what_would_be_replayed_and_changes_nothing() {
    let env = TestEnv::new().await;
    seed_denials(&env, 3).await;
    let out = binary(&env, &["replay", "--dry-run"])
        .output()
        .expect("run replay");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).expect("utf-8");
    assert!(
        stdout.ends_with("dry run: would replay 3 denials\n"),
        "{stdout}"
    );
    assert_eq!(stdout.lines().filter(|l| l.contains("user-")).count(), 3);
    assert!(
        env.drain(&env.names.requests).await.is_empty(),
        "nothing published"
    );
    assert!(
        env.denials().await.iter().all(|d| d.replayed_at.is_none()),
        "nothing marked"
    );
}

#[tokio::test]
async fn the_rate_limit_holds() {
    let env = TestEnv::new().await;
    seed_denials(&env, 21).await;
    let started = Instant::now();
    let out = binary(&env, &["replay", "--rate", "20/s"])
        .output()
        .expect("run replay");
    let elapsed = started.elapsed();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).expect("utf-8");
    assert!(stdout.starts_with("replayed 21 denials in "), "{stdout}");
    // 21 publishes at 20/s: the last one is due 1 s after the first.
    assert!(elapsed >= Duration::from_millis(1_000), "took {elapsed:?}");
    assert!(elapsed < Duration::from_millis(4_000), "took {elapsed:?}");
    assert_eq!(replayed_denial_ids(&env).await.len(), 21);
}

#[tokio::test]
async fn a_replay_killed_midway_and_run_again_publishes_each_denial_once_more_at_most_in_flight() {
    let env = TestEnv::new().await;
    seed_denials(&env, 60).await;
    let mut first = binary(&env, &["replay", "--rate", "40/s"])
        .spawn()
        .expect("start replay");
    tokio::time::sleep(Duration::from_millis(700)).await;
    first.kill().expect("SIGKILL the replay");
    let _ = first.wait();
    let out = binary(&env, &["replay"]).output().expect("second replay");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ids = replayed_denial_ids(&env).await;
    let per_denial = counts(&ids);
    assert_eq!(per_denial.len(), 60, "every denial was replayed");
    let twice: Vec<_> = per_denial.iter().filter(|(_, &n)| n > 1).collect();
    // Rows are claimed and committed one at a time: only the one in flight at the kill can go
    // out again.
    assert!(twice.len() <= 1, "published more than once: {twice:?}");
    assert!(env.denials().await.iter().all(|d| d.replayed_at.is_some()));
}

/// A payload number beyond f64 comes back as the producer wrote it, in `denials --format json`
/// and in the replayed message (it came back as 1.2345678901234568e+29 when the history was
/// read into floating point).
#[tokio::test]
async fn a_payload_number_beyond_f64_is_listed_and_replayed_as_written() {
    const PAYLOAD: &str = r#"{"account":123456789012345678901234567890,"note":"x"}"#;
    let mut env = TestEnv::new().await;
    let clock = ManualClock::new(local("UTC", "2026-04-01 09:00"));
    env.start_worker(&clock);
    let mut seen = HashMap::new();
    env.publish(&request("b1", "ben", "UTC")).await;
    assert!(env.outcome("b1", &mut seen).await);
    let body = format!(r#"{{"id":"b2","recipient":"ben","channel":"sms","payload":{PAYLOAD}}}"#);
    env.publish_raw(body.as_bytes()).await;
    assert!(!env.outcome("b2", &mut seen).await);

    let listed = binary(&env, &["denials", "--format", "json"])
        .output()
        .expect("run denials");
    let listed = String::from_utf8(listed.stdout).expect("utf-8");
    assert!(
        listed.contains(&format!(r#""payload":{PAYLOAD}"#)),
        "the payload as written: {listed}"
    );

    clock.set(local("UTC", "2026-04-02 09:00"));
    let store = DenialStore::from_pool(env.pool.clone());
    assert_eq!(replay_all(&env, &store).await, 1);
    let deadline = Instant::now() + Duration::from_secs(15);
    let dispatched = loop {
        let got = env.drain(&env.dispatched_queue).await;
        if let Some(m) = got.into_iter().next() {
            break String::from_utf8(m.delivery.data).expect("utf-8");
        }
        assert!(Instant::now() < deadline, "the replay was dispatched");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    env.stop_worker().await;
    assert!(
        dispatched.contains(&format!(r#""payload":{PAYLOAD}"#)),
        "the replayed payload as written: {dispatched}"
    );
}
