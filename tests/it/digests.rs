//! Digest instead of deny (`on_deny = "digest"`) through the real worker at default settings:
//! messages a digest rule refuses are held (copies held once, no denial row) and go out as one
//! digest, consuming one send, once the recipient has room again; two workers flushing at once
//! send it once; a digest interrupted after its publish is not sent again; a held message past
//! its deadline is dropped from its digest and recorded expired; `digest_by` groups apart.
//! Faults between the steps of a flush (a digest that cannot be routed, a dispatch mark or an
//! item binding that fails, a worker losing its Postgres session mid-publish) hold back no
//! other digest, send none twice and take no second send.

use crate::support;

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use sendquota::clock::ManualClock;
use sendquota::failpoint::{Failpoint, SLOW_IDS_HOLD};
use sendquota::internals::broker::{self, Publisher};
use sendquota::internals::dedup::DispatchMarks;
use sendquota::internals::digest::{self, COUNT_HEADER};
use support::fixtures::policy;
use support::private::PrivateRabbit;
use support::{local, request, TestEnv, OUTCOME_TIMEOUT};

/// One message a day to each recipient; the others are held for the next day's digest. The
/// flusher looks often, so a test waits little.
const DAILY_DIGEST: &str = policy!("daily_digest");

/// Copies of each held message published back to back: all in flight at once.
const COPIES: usize = 3;

/// A digest as the dispatch exchange received it: its count header and body.
struct Sent {
    count: String,
    body: serde_json::Value,
    /// The body's size as published, in bytes.
    bytes: usize,
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
    split(env.drain(&env.dispatched_queue).await)
}

/// Dispatched messages as single messages' ids and digests.
fn split(messages: Vec<lapin::message::BasicGetMessage>) -> (Vec<String>, Vec<Sent>) {
    let (mut singles, mut digests) = (Vec::new(), Vec::new());
    for m in messages {
        let body: serde_json::Value =
            serde_json::from_slice(&m.delivery.data).expect("dispatched body is JSON");
        match broker::header(&m.delivery.properties, COUNT_HEADER) {
            Some(count) => digests.push(Sent {
                count,
                body,
                bytes: m.delivery.data.len(),
            }),
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

/// Another worker on the same settings and clock, in this process (without failpoints).
struct SecondWorker {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl SecondWorker {
    fn start(env: &TestEnv, clock: &ManualClock) -> SecondWorker {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (settings, clock) = (env.settings.clone(), std::sync::Arc::new(clock.clone()));
        let task = tokio::spawn(async move {
            sendquota::startup::run(&settings, clock, None, async {
                let _ = stopped.await;
            })
            .await
            .expect("second worker runs");
        });
        SecondWorker { stop, task }
    }

    async fn stop(self) {
        let _ = self.stop.send(());
        self.task.await.expect("second worker stops");
    }
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

/// Holds `body` under rule `daily` as the worker would have at `now`, bound to the digest
/// `digest_id` when given (admitted, not yet sent): the state a stopped worker leaves.
async fn hold(
    env: &TestEnv,
    body: &serde_json::Value,
    digest_id: Option<&str>,
    now: DateTime<Utc>,
) {
    let field = |name: &str| body[name].as_str().map(str::to_owned);
    let expires_at = field("expires_at").map(|t| {
        DateTime::parse_from_rfc3339(&t)
            .expect("an RFC 3339 deadline")
            .with_timezone(&Utc)
    });
    sqlx::query(
        "INSERT INTO digest_items (recipient, rule, group_key, channel, message_id, \
         message_text, held_at, digest_id, expires_at) \
         VALUES ($1, 'daily', '', $2, $3, $4, $5, $6, $7)",
    )
    .bind(field("recipient"))
    .bind(field("channel"))
    .bind(field("id"))
    .bind(body.to_string())
    .bind(now)
    .bind(digest_id)
    .bind(expires_at)
    .execute(&env.pool)
    .await
    .expect("hold");
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
    let second = SecondWorker::start(&env, &clock);
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
    second.stop().await;
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
        hold(&env, &request(id, recipient, "UTC"), Some(digest_id), now).await;
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
    let config = policy!("one_a_day_per_campaign_digested_by_campaign");
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

/// A digest on a channel no sender queue is bound to comes back unroutable at every attempt:
/// it stays held and is tried again, while the flush goes on to the other digests and groups.
#[tokio::test]
async fn a_digest_that_cannot_be_sent_does_not_hold_back_the_others() {
    let mut env = TestEnv::with_config(DAILY_DIGEST).await;
    let now = local("UTC", "2026-02-03 09:00");
    env.unbind_dispatched().await;
    env.bind_dispatched("sms").await;
    let mut push = request("m-1", "mallory", "UTC");
    push["channel"] = "push".into();
    let stuck = digest::digest_id("daily", "mallory", "", 1);
    hold(&env, &push, Some(&stuck), now).await;
    hold(&env, &request("c-1", "carol", "UTC"), None, now).await;
    env.start_worker(&ManualClock::new(now));
    let sent = digests(&env, 1).await;
    assert_eq!(sent[0].body["digest"]["recipient"].as_str(), Some("carol"));
    assert_eq!(held(&env).await, ["m-1"], "the unroutable digest is kept");
    // Once a sender listens on its channel, it goes out.
    env.bind_dispatched("push").await;
    let sent = digests(&env, 1).await;
    assert_eq!(sent[0].body["digest"]["id"].as_str(), Some(stuck.as_str()));
    assert_eq!(sent[0].ids(), ["m-1"]);
    env.stop_worker().await;
    assert!(held(&env).await.is_empty());
}

/// Redis fails every dispatch mark of the digests to `gone-` recipients (the
/// `fail-after-decision` failpoint) after the broker confirmed the publish: the digest is not
/// published again for it, and its items are gone.
#[tokio::test]
async fn a_digest_whose_dispatch_mark_fails_after_its_publish_is_not_sent_again() {
    let mut env = TestEnv::with_config(DAILY_DIGEST).await;
    let now = local("UTC", "2026-02-03 09:00");
    let id = digest::digest_id("daily", "gone-gail", "", 1);
    hold(&env, &request("g-1", "gone-gail", "UTC"), Some(&id), now).await;
    env.start_worker_with(&ManualClock::new(now), Some(Failpoint::FailAfterDecision));
    let sent = digests(&env, 1).await;
    assert_eq!(sent[0].ids(), ["g-1"]);
    assert!(held(&env).await.is_empty());
    env.stop_worker().await;
    assert!(dispatched(&env).await.1.is_empty(), "sent once");
}

/// A worker stalls publishing a digest (the `slow-ids` failpoint holds the publish of digests
/// to `slow-` recipients) and its Postgres sessions are cut meanwhile, as a network partition
/// would: a second worker flushing all along does not send the digest too.
#[tokio::test]
async fn a_digest_being_sent_is_left_alone_when_its_workers_postgres_session_is_lost() {
    let mut env = TestEnv::with_config(DAILY_DIGEST).await;
    let now = local("UTC", "2026-02-03 09:00");
    let id = digest::digest_id("daily", "slow-sam", "", 1);
    hold(&env, &request("s-1", "slow-sam", "UTC"), Some(&id), now).await;
    let started = Instant::now();
    let clock = ManualClock::new(now);
    env.start_worker_with(&clock, Some(Failpoint::SlowIds));
    // The first worker has leased the digest and stalls before its publish.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let cut: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = current_database() AND pid <> pg_backend_pid()",
    )
    .fetch_all(&env.pool)
    .await
    .expect("cut the worker's sessions");
    assert!(!cut.is_empty(), "the worker had sessions");
    let second = SecondWorker::start(&env, &clock);
    let sent = digests(&env, 1).await;
    assert_eq!(sent[0].ids(), ["s-1"]);
    // Past the first worker's stall: had the second sent it, the first sends it again then.
    let past = started + SLOW_IDS_HOLD + Duration::from_secs(2);
    tokio::time::sleep_until(past.into()).await;
    assert!(dispatched(&env).await.1.is_empty(), "sent once");
    second.stop().await;
    env.stop_worker().await;
    assert!(held(&env).await.is_empty());
}

/// The limiter admits a digest, then Postgres fails before its items are bound to it (the
/// `fail-after-decision` failpoint, for `gone-` recipients, every time), and that worker stops.
/// By the time another worker flushes, the group's oldest item is past its deadline: the
/// digest is still the one admitted (named by that item), so it is sent without a second send
/// (the day has one), carrying the live item.
#[tokio::test]
async fn a_digest_admitted_before_its_items_were_bound_is_sent_once_its_oldest_item_expired() {
    let mut env = TestEnv::with_config(DAILY_DIGEST).await;
    let mut soon = request("g-1", "gone-gus", "UTC");
    soon["expires_at"] = "2026-02-03T09:30:00Z".into();
    let held_at = local("UTC", "2026-02-02 12:00");
    hold(&env, &soon, None, held_at).await;
    hold(&env, &request("g-2", "gone-gus", "UTC"), None, held_at).await;
    let clock = ManualClock::new(local("UTC", "2026-02-03 09:00"));
    env.start_worker_with(&clock, Some(Failpoint::FailAfterDecision));
    let admitted = digest::digest_id("daily", "gone-gus", "", 1);
    let deadline = Instant::now() + OUTCOME_TIMEOUT;
    while !admitted_by_limiter(&env, &admitted).await {
        assert!(Instant::now() < deadline, "the limiter admitted {admitted}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    env.stop_worker().await;
    assert_eq!(held(&env).await, ["g-1", "g-2"]);

    clock.set(local("UTC", "2026-02-03 10:00"));
    env.start_worker(&clock);
    let sent = digests(&env, 1).await;
    assert_eq!(
        sent[0].body["digest"]["id"].as_str(),
        Some(admitted.as_str())
    );
    assert_eq!(
        (sent[0].count.as_str(), sent[0].ids()),
        ("1", vec!["g-2".into()])
    );
    env.stop_worker().await;
    let rows = env.denials().await;
    let expired: Vec<(&str, &str)> = rows
        .iter()
        .map(|d| (d.message_id.as_str(), d.reason.as_str()))
        .collect();
    assert_eq!(expired, [("g-1", "expired")]);
}

/// Whether some sorted set of the test's namespace holds `member` (a rule's count of ids).
async fn admitted_by_limiter(env: &TestEnv, member: &str) -> bool {
    let mut conn = env.redis.clone();
    for key in env.keys().await {
        let kind: String = redis::cmd("TYPE")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .expect("type");
        if kind == "zset"
            && support::zset_members(&mut conn, &key)
                .await
                .iter()
                .any(|m| m == member)
        {
            return true;
        }
    }
    false
}

/// A group the rules refused is left until they have room: a message held meanwhile does not
/// bring it back sooner (it waits with the others, its `flush_after` untouched), and goes out
/// with them once there is room.
#[tokio::test]
async fn a_message_held_after_its_group_was_refused_waits_with_the_group() {
    let mut env = TestEnv::with_config(DAILY_DIGEST).await;
    let clock = ManualClock::new(local("UTC", "2026-02-02 09:00"));
    env.start_worker(&clock);
    env.publish(&request("h-0", "hana", "UTC")).await;
    publish_copies(&env, &request("h-1", "hana", "UTC")).await;
    held_are(&env, &["h-1"]).await;
    let refused = || async {
        sqlx::query_scalar::<_, Option<DateTime<Utc>>>(
            "SELECT flush_after FROM digest_items ORDER BY message_id",
        )
        .fetch_all(&env.pool)
        .await
        .expect("read flush_after")
    };
    let deadline = Instant::now() + OUTCOME_TIMEOUT;
    while refused().await != [Some(local("UTC", "2026-02-03 00:00"))] {
        assert!(
            Instant::now() < deadline,
            "the flusher looked at hana's group"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    publish_copies(&env, &request("h-2", "hana", "UTC")).await;
    held_are(&env, &["h-1", "h-2"]).await;
    // Ten flushes and more: none takes the group up again today.
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    assert_eq!(
        refused().await,
        [Some(local("UTC", "2026-02-03 00:00")), None]
    );
    assert_eq!(dispatched(&env).await.0, ["h-0"]);
    clock.set(local("UTC", "2026-02-03 09:00"));
    let sent = digests(&env, 1).await;
    assert_eq!(sent[0].ids(), ["h-1", "h-2"]);
    env.stop_worker().await;
}

/// Waits until `n` messages to `recipient` are held.
async fn held_to(env: &TestEnv, recipient: &str, n: i64) {
    let deadline = Instant::now() + OUTCOME_TIMEOUT;
    loop {
        let held: i64 =
            sqlx::query_scalar("SELECT count(*) FROM digest_items WHERE recipient = $1")
                .bind(recipient)
                .fetch_one(&env.pool)
                .await
                .expect("count digest_items");
        if held == n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{n} held to {recipient} within {OUTCOME_TIMEOUT:?}: {held}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The row of the held message `message_id` to `recipient`: what a digest id is numbered by.
async fn item_of(env: &TestEnv, recipient: &str, message_id: &str) -> i64 {
    sqlx::query_scalar("SELECT id FROM digest_items WHERE recipient = $1 AND message_id = $2")
        .bind(recipient)
        .bind(message_id)
        .fetch_one(&env.pool)
        .await
        .expect("read a held item")
}

/// Messages published to one recipient in one burst, all in flight at once at the default
/// prefetch: the first goes out, the others are held.
const BURST: usize = 21;

#[tokio::test]
async fn a_digest_lists_its_messages_in_the_order_they_were_held_and_is_named_by_the_oldest() {
    let mut env = TestEnv::with_config(DAILY_DIGEST).await;
    let clock = ManualClock::new(local("UTC", "2026-02-02 09:00"));
    env.start_worker(&clock);
    for round in 0..3 {
        let recipient = format!("ordered-{round}");
        for i in 0..BURST {
            env.publish(&request(&format!("n-{i}"), &recipient, "UTC"))
                .await;
        }
        held_to(&env, &recipient, BURST as i64 - 1).await;
        let oldest = item_of(&env, &recipient, "n-1").await;
        let (singles, none) = dispatched(&env).await;
        assert_eq!(singles, ["n-0"], "round {round}");
        assert!(none.is_empty(), "round {round}: no room today: no digest");
        clock.set(local("UTC", &format!("2026-02-{:02} 09:00", 3 + round)));
        let sent = digests(&env, 1).await;
        let digest = &sent[0].body["digest"];
        let listed: Vec<&str> = digest["messages"]
            .as_array()
            .expect("messages")
            .iter()
            .map(|m| m["id"].as_str().expect("an id"))
            .collect();
        let published: Vec<String> = (1..BURST).map(|i| format!("n-{i}")).collect();
        assert_eq!(listed, published, "round {round}: the order they were held");
        assert_eq!(
            digest["id"].as_str(),
            Some(digest::digest_id("daily", &recipient, "", oldest).as_str()),
            "round {round}: named by the oldest held message"
        );
    }
    env.stop_worker().await;
}

#[tokio::test]
async fn a_digest_to_a_long_recipient_carries_a_message_id_that_fits_an_amqp_short_string() {
    let mut env = TestEnv::with_config(DAILY_DIGEST).await;
    let clock = ManualClock::new(local("UTC", "2026-02-02 09:00"));
    env.start_worker(&clock);
    let recipient = "r".repeat(256);
    env.publish(&request("n-0", &recipient, "UTC")).await;
    env.publish(&request("n-1", &recipient, "UTC")).await;
    held_to(&env, &recipient, 1).await;
    let item = item_of(&env, &recipient, "n-1").await;
    assert_eq!(dispatched(&env).await.0, ["n-0"]);
    clock.set(local("UTC", "2026-02-03 09:00"));
    let deadline = Instant::now() + OUTCOME_TIMEOUT;
    let sent = loop {
        let mut sent = env.drain(&env.dispatched_queue).await;
        if let Some(m) = sent.pop() {
            break m;
        }
        assert!(
            Instant::now() < deadline,
            "a digest within {OUTCOME_TIMEOUT:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let body: serde_json::Value =
        serde_json::from_slice(&sent.delivery.data).expect("dispatched body is JSON");
    let id = digest::digest_id("daily", &recipient, "", item);
    // A consumer drops a copy by the message id: the digest's own, on every copy of it.
    assert_eq!(
        sent.delivery
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.as_str()),
        Some(id.as_str())
    );
    assert!(id.len() <= 255, "{} bytes: {id}", id.len());
    assert_eq!(body["digest"]["id"].as_str(), Some(id.as_str()));
    assert_eq!(
        body["digest"]["recipient"].as_str(),
        Some(recipient.as_str())
    );
    env.stop_worker().await;
}

/// What deploy/rabbitmq/rabbitmq.conf sets as the broker's `max_message_size` (and the README
/// recommends): a digest above it is refused by the broker.
const BROKER_MAX_MESSAGE_SIZE: usize = 131_072;

/// Three sends a day (and a week), at the default digest bound; what comes after is held for
/// the next day's digests.
const THREE_A_DAY_DIGEST: &str = policy!("three_a_day_digest");

#[tokio::test]
async fn held_messages_larger_together_than_the_digest_bound_go_out_as_several_digests_within_it() {
    let mut env = TestEnv::with_config(THREE_A_DAY_DIGEST).await;
    let bound = env.settings.worker.max_digest_bytes;
    assert!(
        bound <= BROKER_MAX_MESSAGE_SIZE,
        "the default bound is below the broker's"
    );
    let clock = ManualClock::new(local("UTC", "2026-02-02 09:00"));
    env.start_worker(&clock);
    for id in ["s-0", "s-1", "s-2"] {
        env.publish(&request(id, "grace", "UTC")).await;
    }
    env.copies_decided().await;
    // Seven requests of about 40 KB: 280 KB together (one digest of them would be refused by
    // the broker), three of them fit in the default bound. The next day's three sends carry
    // them as three digests: 3, 3 and 1, oldest first.
    let big: Vec<String> = (0..7).map(|n| format!("b-{n}")).collect();
    for id in &big {
        let mut body = request(id, "grace", "UTC");
        body["payload"] = serde_json::json!({"template": "t", "text": "x".repeat(40_000)});
        env.publish(&body).await;
    }
    env.copies_decided().await;
    assert_eq!(held(&env).await, big);
    let mut singles = dispatched(&env).await.0;
    singles.sort_unstable();
    assert_eq!(singles, ["s-0", "s-1", "s-2"]);
    clock.set(local("UTC", "2026-02-03 09:00"));
    let deadline = Instant::now() + OUTCOME_TIMEOUT;
    let mut sent = Vec::new();
    while !held(&env).await.is_empty() {
        assert!(
            Instant::now() < deadline,
            "every held message sent within {OUTCOME_TIMEOUT:?}; held: {:?}, {} digests sent",
            held(&env).await,
            sent.len()
        );
        sent.extend(dispatched(&env).await.1);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    let (singles, more) = dispatched(&env).await;
    assert!(singles.is_empty(), "no single message: {singles:?}");
    sent.extend(more);
    let sizes: Vec<usize> = sent.iter().map(|s| s.bytes).collect();
    assert!(
        sizes.iter().all(|&b| b <= bound),
        "every digest within {bound} bytes: {sizes:?}"
    );
    assert_eq!(sent.len(), 3, "three digests: {sizes:?}");
    for s in &sent {
        assert_eq!(s.count, s.ids().len().to_string());
    }
    let mut ids: Vec<String> = sent.iter().flat_map(Sent::ids).collect();
    ids.sort_unstable();
    assert_eq!(ids, big, "each held message sent exactly once");
    env.stop_worker().await;
    assert_eq!(env.denial_rows().await, 0);
}

/// The digest [`hold_four_large`] binds its messages to.
const PENDING: &str = "digest:daily:hank::1";

/// Holds four requests of about 40 KB to hank in the digest [`PENDING`], admitted and not yet
/// sent (about 160 KB together: over the default bound and the broker's limit); their ids,
/// oldest first.
async fn hold_four_large(env: &TestEnv, now: DateTime<Utc>) -> Vec<String> {
    let big: Vec<String> = (0..4).map(|n| format!("h-{n}")).collect();
    for id in &big {
        let mut body = request(id, "hank", "UTC");
        body["payload"] = serde_json::json!({"template": "t", "text": "x".repeat(40_000)});
        hold(env, &body, Some(PENDING), now).await;
    }
    big
}

/// A digest admitted while the bound was larger (or before there was one) and not yet sent
/// when the worker starts: the items past the bound go back to their group, whose next digest
/// (the day's send) carries them, so no digest the worker publishes is over the bound.
#[tokio::test]
async fn a_pending_digest_over_the_bound_sends_what_fits_and_returns_the_rest_to_its_group() {
    let mut env = TestEnv::with_config(DAILY_DIGEST).await;
    let bound = env.settings.worker.max_digest_bytes;
    let now = local("UTC", "2026-02-03 09:00");
    let (pending, big) = (PENDING, hold_four_large(&env, now).await);
    env.start_worker(&ManualClock::new(now));
    let sent = digests(&env, 2).await;
    let sizes: Vec<usize> = sent.iter().map(|s| s.bytes).collect();
    assert!(
        sizes.iter().all(|&b| b <= bound),
        "every digest within {bound} bytes: {sizes:?}"
    );
    assert_eq!(sent[0].body["digest"]["id"].as_str(), Some(pending));
    assert_eq!(
        sent.iter().map(Sent::ids).collect::<Vec<_>>(),
        [big[..3].to_vec(), big[3..].to_vec()],
        "the oldest three in the pending digest, the last in the group's next"
    );
    assert!(held(&env).await.is_empty());
    env.stop_worker().await;
    assert_eq!(env.denial_rows().await, 0);
}

/// A digest bound above the broker's own `max_message_size` (a broker set lower than the
/// worker was told): the broker refuses the first digest, closing the channel it came on. The
/// worker learns the limit from the refusal, opens another channel on the same connection and
/// sends the digest in parts that fit. The session goes on for everyone else: no connection
/// of the worker's is opened again, and requests decided meanwhile are dispatched once each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_digest_the_broker_refuses_as_too_large_goes_out_in_parts_and_the_session_goes_on() {
    let conf = format!("max_message_size = {BROKER_MAX_MESSAGE_SIZE}\n");
    let rabbit = tokio::task::spawn_blocking(move || PrivateRabbit::start_with(&conf))
        .await
        .expect("private rabbitmq");
    let mut env = TestEnv::with_config(DAILY_DIGEST).await;
    env.settings.amqp.url = rabbit.url();
    env.settings.worker.max_digest_bytes = 4 * BROKER_MAX_MESSAGE_SIZE;
    let conn = broker::connect(&env.settings.amqp, "sendquota-test")
        .await
        .expect("private rabbitmq answers");
    let publisher = Publisher::open(&conn).await.expect("publisher");
    broker::declare(
        &publisher.channel(),
        &env.names,
        env.settings.amqp.queue_type,
    )
    .await
    .expect("declare topology");
    let sink = format!("{}.test.private-dispatched", env.namespace);
    let channel = conn.create_channel().await.expect("channel");
    support::declare_sink(&channel, &sink, &env.names.dispatch).await;

    let now = local("UTC", "2026-02-03 09:00");
    let big = hold_four_large(&env, now).await;
    env.start_worker(&ManualClock::new(now));
    let others: Vec<String> = (0..20).map(|n| format!("o-{n}")).collect();
    for (n, id) in others.iter().enumerate() {
        let body = request(id, &format!("olga-{n}"), "UTC").to_string();
        publisher
            .publish(&env.names.requests, "", body.as_bytes(), Default::default())
            .await
            .expect("publish a request");
    }
    let connections = || worker_connections(&rabbit);
    let at_start = wait_for(|| Some(connections()).filter(|c| c.len() == 2)).await;

    let (mut singles, mut sent) = (Vec::new(), Vec::new());
    let deadline = Instant::now() + OUTCOME_TIMEOUT;
    while sent.len() < 2 || singles.len() < others.len() {
        assert!(
            Instant::now() < deadline,
            "2 digests and {} requests dispatched within {OUTCOME_TIMEOUT:?}: {} and {:?}",
            others.len(),
            sent.len(),
            singles
        );
        let (s, d) = split(support::drain(&channel, &sink).await);
        singles.extend(s);
        sent.extend(d);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let sizes: Vec<usize> = sent.iter().map(|s| s.bytes).collect();
    assert!(
        sizes.iter().all(|&b| b <= BROKER_MAX_MESSAGE_SIZE),
        "every digest within the broker's {BROKER_MAX_MESSAGE_SIZE} bytes: {sizes:?}"
    );
    assert_eq!(
        sent.iter().map(Sent::ids).collect::<Vec<_>>(),
        [big[..3].to_vec(), big[3..].to_vec()],
        "the oldest three in the pending digest, the last in the group's next"
    );
    singles.sort_unstable();
    let mut expected = others.clone();
    expected.sort_unstable();
    assert_eq!(singles, expected, "every request dispatched once");
    assert_eq!(
        connections(),
        at_start,
        "the worker kept the connections it started with"
    );
    env.stop_worker().await;
    let _ = conn.close(200, "done".into()).await;
}

/// The worker's connections to `rabbit`, by name and when they were opened.
fn worker_connections(rabbit: &PrivateRabbit) -> Vec<String> {
    let listed = rabbit
        .ctl_output(&[
            "list_connections",
            "name",
            "connected_at",
            "client_properties",
            "--no-table-headers",
            "-q",
        ])
        .unwrap_or_default();
    let mut connections: Vec<String> = listed
        .lines()
        .filter(|l| l.contains("sendquota-worker"))
        .map(str::to_owned)
        .collect();
    connections.sort_unstable();
    connections
}

/// Polls `probe` until it returns something, for up to [`OUTCOME_TIMEOUT`].
async fn wait_for<T>(mut probe: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + OUTCOME_TIMEOUT;
    loop {
        if let Some(found) = probe() {
            return found;
        }
        assert!(Instant::now() < deadline, "not within {OUTCOME_TIMEOUT:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
