//! Digest instead of deny (`on_deny = "digest"`) through the real worker at default settings:
//! messages a digest rule refuses are held (copies held once, no denial row) and go out as one
//! digest, consuming one send, once the recipient has room again; two workers flushing at once
//! send it once; a digest interrupted after its publish is not sent again; a held message past
//! its deadline is dropped from its digest and recorded expired; `digest_by` groups apart.

use crate::support;

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use sendquota::clock::ManualClock;
use sendquota::internals::broker;
use sendquota::internals::dedup::DispatchMarks;
use sendquota::internals::digest::{self, COUNT_HEADER};
use support::{local, request, TestEnv, OUTCOME_TIMEOUT};

/// One message a day to each recipient; the others are held for the next day's digest. The
/// flusher looks often, so a test waits little.
const DAILY_DIGEST: &str = "[worker]\ndigest_flush_interval_ms = 100\n\
    [[rules]]\nname = \"daily\"\nkind = \"calendar_quota\"\nper_day = 1\n\
    on_deny = \"digest\"\n";

/// Copies of each held message published back to back: all in flight at once.
const COPIES: usize = 3;

/// A digest as the dispatch exchange received it: its count header and body.
struct Sent {
    count: String,
    body: serde_json::Value,
}

impl Sent {
    /// The ids of the requests it carries, sorted.
    fn ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self.body["digest"]["messages"]
            .as_array()
            .expect("messages")
            .iter()
            .map(|m| m["id"].as_str().expect("an id").to_owned())
            .collect();
        ids.sort_unstable();
        ids
    }
}

/// Splits what was dispatched since the last call into single messages' ids and digests.
async fn dispatched(env: &TestEnv) -> (Vec<String>, Vec<Sent>) {
    let (mut singles, mut digests) = (Vec::new(), Vec::new());
    for m in env.drain(&env.dispatched_queue).await {
        let body: serde_json::Value =
            serde_json::from_slice(&m.delivery.data).expect("dispatched body is JSON");
        match broker::header(&m.delivery.properties, COUNT_HEADER) {
            Some(count) => digests.push(Sent { count, body }),
            None => singles.push(body["id"].as_str().expect("an id").to_owned()),
        }
    }
    (singles, digests)
}

/// Waits until `n` digests were dispatched (and no single message meanwhile), then a few more
/// flush intervals in which no other may come.
async fn digests(env: &TestEnv, n: usize) -> Vec<Sent> {
    let deadline = Instant::now() + OUTCOME_TIMEOUT;
    let mut sent = Vec::new();
    while sent.len() < n {
        assert!(
            Instant::now() < deadline,
            "{n} digests within {OUTCOME_TIMEOUT:?}"
        );
        let (singles, digests) = dispatched(env).await;
        assert!(singles.is_empty(), "no single message: {singles:?}");
        sent.extend(digests);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    let (singles, more) = dispatched(env).await;
    assert!(singles.is_empty() && more.is_empty(), "nothing else sent");
    sent
}

/// Held items, per message id.
async fn held(env: &TestEnv) -> Vec<String> {
    sqlx::query_scalar("SELECT message_id FROM digest_items ORDER BY message_id")
        .fetch_all(&env.pool)
        .await
        .expect("read digest_items")
}

/// Waits until every copy is decided and `ids` are the held messages.
async fn held_are(env: &TestEnv, ids: &[&str]) {
    env.copies_decided().await;
    assert_eq!(held(env).await, ids);
}

async fn publish_copies(env: &TestEnv, body: &serde_json::Value) {
    for _ in 0..COPIES {
        env.publish(body).await;
    }
}

#[tokio::test]
async fn held_messages_go_out_as_one_digest_that_takes_the_next_days_send() {
    let mut env = TestEnv::with_config(DAILY_DIGEST).await;
    let clock = ManualClock::new(local("UTC", "2026-02-02 09:00"));
    env.start_worker(&clock);
    env.publish(&request("n-0", "alice", "UTC")).await;
    for id in ["n-1", "n-2", "n-3"] {
        publish_copies(&env, &request(id, "alice", "UTC")).await;
    }
    held_are(&env, &["n-1", "n-2", "n-3"]).await;
    let (singles, none) = dispatched(&env).await;
    assert_eq!(singles, ["n-0"]);
    assert!(none.is_empty(), "no room today: no digest");
    assert_eq!(env.denial_rows().await, 0, "a held message is not denied");
    // Flushed and refused: left until the rule has room, the next local day.
    let deadline = Instant::now() + OUTCOME_TIMEOUT;
    loop {
        let after: Vec<Option<DateTime<Utc>>> =
            sqlx::query_scalar("SELECT DISTINCT flush_after FROM digest_items")
                .fetch_all(&env.pool)
                .await
                .expect("read flush_after");
        if after == [Some(local("UTC", "2026-02-03 00:00"))] {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the refused group waits for room: {after:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The operator's view: one group of three, waiting for the next day.
    let listed = env
        .cli(&["digests", "--recipient", "alice"])
        .output()
        .expect("run digests");
    assert!(listed.status.success(), "{listed:?}");
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&listed.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(
        (
            &lines[0]["rule"],
            &lines[0]["group"],
            &lines[0]["held"],
            &lines[0]["flush_after"]
        ),
        (
            &"daily".into(),
            &serde_json::Value::Null,
            &3.into(),
            &"2026-02-03T00:00:00Z".into()
        )
    );
    clock.set(local("UTC", "2026-02-03 09:00"));
    let sent = digests(&env, 1).await;
    assert_eq!(sent[0].count, "3");
    let digest = &sent[0].body["digest"];
    assert_eq!(
        (digest["rule"].as_str(), digest["recipient"].as_str()),
        (Some("daily"), Some("alice"))
    );
    assert_eq!(digest["count"], 3);
    assert_eq!(digest["group"], serde_json::Value::Null);
    assert_eq!(sent[0].ids(), ["n-1", "n-2", "n-3"]);
    assert_eq!(
        digest["messages"][0]["payload"],
        serde_json::json!({"template": "t"}),
        "each request whole"
    );
    assert!(held(&env).await.is_empty());
    // The digest took the day's send: the next message is held (check says so), and a copy of
    // a message the digest carried is a duplicate.
    let next = request("n-4", "alice", "UTC");
    let check = env.check(DAILY_DIGEST, "2026-02-03T10:00:00Z", &next);
    assert_eq!(
        (check["outcome"].as_str(), check["rule"].as_str()),
        (Some("digested"), Some("daily"))
    );
    env.publish(&next).await;
    env.publish(&request("n-2", "alice", "UTC")).await;
    held_are(&env, &["n-4"]).await;
    env.stop_worker().await;
    assert_eq!(dispatched(&env).await.0, Vec::<String>::new());
    assert_eq!(env.denial_rows().await, 0);
}

/// Recipients whose held messages two workers flush at once: both walk the same groups at the
/// same instants, so without the group and digest locks they take the same ones.
const RECIPIENTS: usize = 24;

#[tokio::test]
async fn two_workers_flushing_at_once_send_each_digest_once() {
    let mut env = TestEnv::with_config(DAILY_DIGEST).await;
    let clock = ManualClock::new(local("UTC", "2026-02-02 09:00"));
    env.start_worker(&clock);
    let (stop_second, second) = {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (settings, clock) = (env.settings.clone(), std::sync::Arc::new(clock.clone()));
        let task = tokio::spawn(async move {
            sendquota::startup::run(&settings, clock, None, async {
                let _ = stopped.await;
            })
            .await
            .expect("second worker runs");
        });
        (stop, task)
    };
    let mut expected_held = Vec::new();
    for r in 0..RECIPIENTS {
        env.publish(&request(&format!("r{r:02}-0"), &format!("r{r:02}"), "UTC"))
            .await;
    }
    for i in 1..=2 {
        for r in 0..RECIPIENTS {
            let id = format!("r{r:02}-{i}");
            publish_copies(&env, &request(&id, &format!("r{r:02}"), "UTC")).await;
            expected_held.push(id);
        }
    }
    expected_held.sort_unstable();
    let expected_held: Vec<&str> = expected_held.iter().map(String::as_str).collect();
    held_are(&env, &expected_held).await;
    assert_eq!(dispatched(&env).await.0.len(), RECIPIENTS);
    clock.set(local("UTC", "2026-02-03 09:00"));
    let sent = digests(&env, RECIPIENTS).await;
    let mut per_recipient: Vec<(String, String, Vec<String>)> = sent
        .iter()
        .map(|s| {
            let recipient = s.body["digest"]["recipient"].as_str().expect("recipient");
            (recipient.to_owned(), s.count.clone(), s.ids())
        })
        .collect();
    per_recipient.sort_unstable();
    let expected: Vec<(String, String, Vec<String>)> = (0..RECIPIENTS)
        .map(|r| {
            let ids = vec![format!("r{r:02}-1"), format!("r{r:02}-2")];
            (format!("r{r:02}"), "2".to_owned(), ids)
        })
        .collect();
    assert_eq!(per_recipient, expected);
    let _ = stop_second.send(());
    second.await.expect("second worker stops");
    env.stop_worker().await;
    assert!(held(&env).await.is_empty());
}

/// A digest admitted and published by a worker that stopped before deleting its items: they
/// are still held, marked as that digest's. The one whose dispatch mark was written is only
/// deleted; the one without is sent, once.
#[tokio::test]
async fn a_digest_published_before_a_crash_is_not_sent_again() {
    let mut env = TestEnv::with_config(DAILY_DIGEST).await;
    let now = local("UTC", "2026-02-03 09:00");
    let (went, pending) = (
        digest::digest_id("daily", "carol", "", 1),
        digest::digest_id("daily", "dave", "", 3),
    );
    for (recipient, id, digest_id) in [
        ("carol", "c-1", &went),
        ("carol", "c-2", &went),
        ("dave", "d-1", &pending),
    ] {
        let text = request(id, recipient, "UTC").to_string();
        sqlx::query(
            "INSERT INTO digest_items (recipient, rule, group_key, channel, message_id, \
             message_text, held_at, digest_id) VALUES ($1, 'daily', '', 'sms', $2, $3, $4, $5)",
        )
        .bind(recipient)
        .bind(id)
        .bind(text)
        .bind(now)
        .bind(digest_id)
        .execute(&env.pool)
        .await
        .expect("hold");
    }
    let marks = DispatchMarks::new(env.redis.clone(), &env.namespace, 3_600);
    marks.mark("carol", &went, now).await.expect("mark");
    env.start_worker(&ManualClock::new(now));
    let sent = digests(&env, 1).await;
    assert_eq!(
        sent[0].body["digest"]["id"].as_str(),
        Some(pending.as_str())
    );
    assert_eq!(sent[0].ids(), ["d-1"]);
    assert!(held(&env).await.is_empty(), "both digests' items are gone");
    // The held messages count as sent: a late copy of one is a duplicate, not held again.
    publish_copies(&env, &request("c-1", "carol", "UTC")).await;
    held_are(&env, &[]).await;
    env.stop_worker().await;
    assert!(dispatched(&env).await.0.is_empty());
    assert_eq!(env.denial_rows().await, 0);
}

#[tokio::test]
async fn a_held_message_past_its_deadline_is_dropped_from_the_digest_and_recorded_expired() {
    let mut env = TestEnv::with_config(DAILY_DIGEST).await;
    let clock = ManualClock::new(local("UTC", "2026-02-02 09:00"));
    env.start_worker(&clock);
    env.publish(&request("e-0", "erin", "UTC")).await;
    let mut soon = request("e-1", "erin", "UTC");
    soon["expires_at"] = "2026-02-02T18:00:00Z".into();
    let mut later = request("e-2", "erin", "UTC");
    later["expires_at"] = "2026-02-04T00:00:00Z".into();
    for body in [&soon, &later, &request("e-3", "erin", "UTC")] {
        publish_copies(&env, body).await;
    }
    held_are(&env, &["e-1", "e-2", "e-3"]).await;
    assert_eq!(dispatched(&env).await.0, ["e-0"]);
    clock.set(local("UTC", "2026-02-03 09:00"));
    let sent = digests(&env, 1).await;
    assert_eq!(
        (sent[0].count.as_str(), sent[0].ids()),
        ("2", vec!["e-2".into(), "e-3".into()])
    );
    env.stop_worker().await;
    let rows = env.denials().await;
    assert_eq!(rows.len(), 1, "one row for the expired message");
    let row = &rows[0].row;
    assert_eq!(
        (
            row.message_id.as_str(),
            row.rule.as_str(),
            row.reason.as_str()
        ),
        ("e-1", "daily", "expired")
    );
    assert_eq!(row.expires_at, Some(local("UTC", "2026-02-02 18:00")));
    assert_eq!(row.denied_at, local("UTC", "2026-02-03 09:00"));
    assert!(held(&env).await.is_empty());
}

/// One message a day per campaign to each recipient, held messages digested per campaign.
#[tokio::test]
async fn digest_by_sends_one_digest_per_campaign() {
    let config = "[worker]\ndigest_flush_interval_ms = 100\n\
        [[rules]]\nname = \"per-campaign\"\nkind = \"calendar_quota\"\nper_day = 1\n\
        per_attributes = [\"campaign\"]\non_deny = \"digest\"\ndigest_by = \"campaign\"\n";
    let mut env = TestEnv::with_config(config).await;
    let clock = ManualClock::new(local("UTC", "2026-02-02 09:00"));
    env.start_worker(&clock);
    let campaign = |id: &str, name: &str| {
        let mut body = request(id, "frank", "UTC");
        body["attributes"] = serde_json::json!({"campaign": name});
        body
    };
    for (id, name) in [("a-1", "a"), ("b-1", "b")] {
        env.publish(&campaign(id, name)).await;
    }
    env.copies_decided().await;
    for (id, name) in [("a-2", "a"), ("b-2", "b"), ("a-3", "a")] {
        publish_copies(&env, &campaign(id, name)).await;
    }
    held_are(&env, &["a-2", "a-3", "b-2"]).await;
    let mut singles = dispatched(&env).await.0;
    singles.sort_unstable();
    assert_eq!(singles, ["a-1", "b-1"]);
    clock.set(local("UTC", "2026-02-03 09:00"));
    let mut sent = digests(&env, 2).await;
    sent.sort_by_key(|s| s.body["digest"]["group"].as_str().map(str::to_owned));
    assert_eq!(
        sent.iter()
            .map(|s| (s.body["digest"]["group"].clone(), s.count.clone(), s.ids()))
            .collect::<Vec<_>>(),
        [
            (
                "a".into(),
                "2".to_owned(),
                vec!["a-2".to_owned(), "a-3".to_owned()]
            ),
            ("b".into(), "1".to_owned(), vec!["b-2".to_owned()]),
        ]
    );
    env.stop_worker().await;
    assert_eq!(env.denial_rows().await, 0);
}
