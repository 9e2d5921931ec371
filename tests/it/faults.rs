//! The fault suite: 10,000 messages over 4,000 recipients flow through the real worker binary
//! on private Redis, PostgreSQL and RabbitMQ servers while each of them is restarted and the
//! worker is killed with SIGKILL and started again. Then everything is reconciled: every
//! message id ends up in exactly one of dispatched, denied and invalid, and once among the
//! denials; each recipient's quota holds exactly the ids that were dispatched; a dispatch or an
//! invalid routing repeated because its ack was lost in a crash or broker restart (the
//! documented at-least-once window, at most the deliveries in flight) is counted and reported.

use crate::support;

use std::collections::{HashMap, HashSet};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use lapin::options::{BasicGetOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use sendquota::config::QueueType;
use sendquota::internals::broker::{self, Names, Publisher};
use sendquota::internals::denials::DenialStore;
use support::private::{PrivatePostgres, PrivateRabbit, PrivateRedis};

const MESSAGES: usize = 10_000;
const RECIPIENTS: usize = 4_000;
/// One in this many messages is invalid (an unknown time zone).
const INVALID_EVERY: usize = 97;
const NAMESPACE: &str = "faults";
const SINK: &str = "faults.test.sink";

struct World {
    redis: PrivateRedis,
    postgres: PrivatePostgres,
    rabbit: PrivateRabbit,
    config: std::path::PathBuf,
}

impl World {
    fn worker(&self) -> Child {
        support::process::sendquota()
            .args(["--config", self.config.to_str().expect("utf-8")])
            .args(["worker", "--now", "2026-04-01T09:00:00Z"])
            .env("SENDQUOTA_NAMESPACE", NAMESPACE)
            .env("SENDQUOTA_REDIS_URL", self.redis.url())
            .env("SENDQUOTA_AMQP_URL", self.rabbit.url())
            .env("SENDQUOTA_DATABASE_URL", self.postgres.url("sendquota"))
            .env("SENDQUOTA_LOG", "error")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the worker")
    }
}

fn body(i: usize) -> String {
    let zone = if i.is_multiple_of(INVALID_EVERY) {
        "Nowhere/Atlantis"
    } else {
        "UTC"
    };
    support::request(&format!("m{i}"), &format!("r{}", i % RECIPIENTS), zone).to_string()
}

/// A connection through lapin, a client independent of the worker's.
async fn lapin_connect(url: &str, name: &str) -> lapin::Result<lapin::Connection> {
    let properties = lapin::ConnectionProperties::default().with_connection_name(name.into());
    lapin::Connection::connect(url, properties).await
}

/// Messages still waiting in the requests queue, or None while the broker is away.
async fn waiting(world: &World) -> Option<u32> {
    let conn = lapin_connect(&world.rabbit.url(), "faults-probe")
        .await
        .ok()?;
    let ch = conn.create_channel().await.ok()?;
    let q = ch
        .queue_declare(
            format!("{NAMESPACE}.requests").as_str().into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .ok()?;
    let _ = conn.close(200, "probe".into()).await;
    Some(q.message_count())
}

/// Waits until no more than `left` messages wait (the flow has reached that point).
async fn until_waiting_at_most(world: &World, left: u32, within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        if waiting(world).await.is_some_and(|w| w <= left) {
            return;
        }
        assert!(Instant::now() < deadline, "the flow reached {left} waiting");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn drain_ids(ch: &lapin::Channel, queue: &str) -> Vec<String> {
    let mut ids = Vec::new();
    while let Some(m) = ch
        .basic_get(queue.into(), BasicGetOptions { no_ack: true })
        .await
        .expect("basic_get")
    {
        let v: serde_json::Value = serde_json::from_slice(&m.delivery.data).expect("JSON body");
        ids.push(v["id"].as_str().expect("id").to_owned());
    }
    ids
}

fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> tokio::task::JoinHandle<T> {
    tokio::task::spawn_blocking(f)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_messages_survive_restarts_of_every_service_and_a_killed_worker() {
    let started = Instant::now();
    let (redis, postgres, rabbit) = tokio::join!(
        blocking(PrivateRedis::start),
        blocking(PrivatePostgres::start),
        blocking(PrivateRabbit::start)
    );
    let config = std::env::temp_dir().join(format!("{}.toml", support::unique("faults")));
    std::fs::write(
        &config,
        "[amqp]\nqueue_type = \"quorum\"\nprefetch = 16\n\
         [worker]\nconcurrency = 16\nretry_initial_ms = 20\nretry_max_ms = 400\n\
         watchdog_interval_ms = 2000\nshutdown_timeout_ms = 3000\n\
         [redis]\nresponse_timeout_ms = 1000\n\
         [database]\nacquire_timeout_ms = 1000\nstatement_timeout_ms = 2000\n",
    )
    .expect("config");
    let world = World {
        redis: redis.expect("redis"),
        postgres: postgres.expect("postgres"),
        rabbit: rabbit.expect("rabbitmq"),
        config,
    };
    eprintln!(
        "private services up in {:.1} s",
        started.elapsed().as_secs_f64()
    );

    let admin = sqlx::PgPool::connect(&world.postgres.url("postgres"))
        .await
        .expect("postgres");
    sqlx::query("CREATE DATABASE sendquota")
        .execute(&admin)
        .await
        .expect("create db");
    let settings = sendquota::config::DatabaseSettings {
        url: world.postgres.url("sendquota"),
        ..Default::default()
    };
    let store = DenialStore::connect(&settings).await.expect("connect");
    store.migrate().await.expect("migrate");

    // Topology, a durable sink for dispatched messages, and all 10,000 requests.
    let names = Names::new(NAMESPACE);
    let amqp = sendquota::config::AmqpSettings {
        url: world.rabbit.url(),
        ..Default::default()
    };
    let conn = broker::connect(&amqp, "faults-producer")
        .await
        .expect("amqp");
    let publisher = Publisher::open(&conn).await.expect("publisher");
    broker::declare(&publisher.channel(), &names, QueueType::Quorum)
        .await
        .expect("declare");
    let ch = conn.create_channel().await.expect("channel");
    support::declare_sink(&ch, SINK, &names.dispatch).await;
    let bodies: Vec<String> = (0..MESSAGES).map(body).collect();
    futures_util::stream::iter(bodies.iter())
        .map(|b| {
            publisher.publish(
                &names.requests,
                "",
                b.as_bytes(),
                lapin::BasicProperties::default(),
            )
        })
        .buffer_unordered(256)
        .for_each(|r| async move { r.expect("publish") })
        .await;
    let _ = conn.close(200, "published".into()).await;
    eprintln!(
        "published {MESSAGES} in {:.1} s",
        started.elapsed().as_secs_f64()
    );

    // Chaos while the messages flow.
    let mut worker = world.worker();
    let total = MESSAGES as u32;
    let budget = Duration::from_secs(120);
    until_waiting_at_most(&world, total * 9 / 10, budget).await;
    let redis_ref = &world.redis;
    tokio::task::block_in_place(|| redis_ref.restart());
    eprintln!("restarted redis");
    until_waiting_at_most(&world, total * 3 / 4, budget).await;
    tokio::task::block_in_place(|| world.postgres.restart());
    eprintln!("restarted postgres");
    until_waiting_at_most(&world, total * 11 / 20, budget).await;
    worker.kill().expect("SIGKILL the worker");
    let _ = worker.wait();
    let mut worker = world.worker();
    eprintln!("killed the worker with SIGKILL and started it again");
    until_waiting_at_most(&world, total * 2 / 5, budget).await;
    tokio::task::block_in_place(|| world.rabbit.restart());
    eprintln!("restarted rabbitmq");
    until_waiting_at_most(&world, 0, budget).await;

    // Let in-flight messages finish, then stop the worker gracefully.
    let conn = lapin_connect(&world.rabbit.url(), "faults-reader")
        .await
        .expect("amqp");
    let ch = conn.create_channel().await.expect("channel");
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut dispatched: Vec<String> = Vec::new();
    let valid = MESSAGES - MESSAGES.div_ceil(INVALID_EVERY);
    loop {
        dispatched.extend(drain_ids(&ch, SINK).await);
        let denied: i64 = sqlx::query_scalar("SELECT count(DISTINCT message_id) FROM denials")
            .fetch_one(store.pool())
            .await
            .expect("count");
        let distinct: HashSet<&String> = dispatched.iter().collect();
        if distinct.len() + denied as usize >= valid {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "every valid message got an outcome"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let pid = worker.id().to_string();
    let _ = Command::new("kill").args(["-TERM", &pid]).status();
    let _ = worker.wait();
    dispatched.extend(drain_ids(&ch, SINK).await);
    let invalid = drain_ids(&ch, &names.invalid).await;
    let denied: Vec<String> = sqlx::query_scalar("SELECT message_id FROM denials")
        .fetch_all(store.pool())
        .await
        .expect("denials");

    // Reconcile.
    let mut outcomes: HashMap<&str, Vec<&str>> = HashMap::new();
    for (ids, what) in [
        (&dispatched, "dispatched"),
        (&denied, "denied"),
        (&invalid, "invalid"),
    ] {
        for id in ids {
            outcomes.entry(id.as_str()).or_default().push(what);
        }
    }
    let lost: Vec<String> = (0..MESSAGES)
        .map(|i| format!("m{i}"))
        .filter(|id| !outcomes.contains_key(id.as_str()))
        .collect();
    let duplicate_dispatches = dispatched.len() - dispatched.iter().collect::<HashSet<_>>().len();
    let distinct_invalid = invalid.iter().collect::<HashSet<_>>().len();
    let duplicate_invalid = invalid.len() - distinct_invalid;
    let mixed: Vec<_> = outcomes
        .iter()
        .filter(|(_, w)| {
            let kinds: HashSet<&&str> = w.iter().collect();
            kinds.len() > 1 || w.iter().filter(|k| **k == "denied").count() > 1
        })
        .collect();

    // Each recipient's quota holds exactly the ids dispatched to it, each once.
    let client = redis::Client::open(world.redis.url()).expect("redis url");
    let mut rconn = client
        .get_multiplexed_async_connection()
        .await
        .expect("redis");
    let mut quota_mismatches = Vec::new();
    let mut by_recipient: HashMap<usize, HashSet<String>> = HashMap::new();
    for id in &dispatched {
        let i: usize = id[1..].parse().expect("numeric id");
        by_recipient
            .entry(i % RECIPIENTS)
            .or_default()
            .insert(id.clone());
    }
    for r in 0..RECIPIENTS {
        let key = format!("{NAMESPACE}:{{r:r{r}}}:headline:calendar_quota");
        let members = support::zset_members(&mut rconn, &key).await;
        let held: HashSet<String> = members.iter().cloned().collect();
        let sent = by_recipient.remove(&r).unwrap_or_default();
        if held != sent || held.len() != members.len() || held.len() > 1 {
            quota_mismatches.push((r, members, sent));
        }
    }
    eprintln!(
        "faults report: published {MESSAGES}; restarts survived: redis 1, postgres 1, rabbitmq 1, \
         worker SIGKILL 1; dispatched {} ({} distinct), denied {}, invalid {}; lost {}; \
         quota mismatches {}; repeated in the crash window: dispatches {}, invalid routings {}; \
         took {:.1} s",
        dispatched.len(),
        dispatched.len() - duplicate_dispatches,
        denied.len(),
        invalid.len(),
        lost.len(),
        quota_mismatches.len(),
        duplicate_dispatches,
        duplicate_invalid,
        started.elapsed().as_secs_f64()
    );
    let _ = std::fs::remove_file(&world.config);
    assert!(lost.is_empty(), "lost: {:?}", &lost[..lost.len().min(10)]);
    assert!(
        mixed.is_empty(),
        "ids with more than one outcome: {:?}",
        &mixed[..mixed.len().min(10)]
    );
    assert!(
        quota_mismatches.is_empty(),
        "quota mismatches: {:?}",
        &quota_mismatches[..quota_mismatches.len().min(5)]
    );
    assert_eq!(distinct_invalid, MESSAGES.div_ceil(INVALID_EVERY));
    assert_eq!(
        denied.len(),
        denied.iter().collect::<HashSet<_>>().len(),
        "one denial row per id"
    );
    // At most the messages in flight at the kill (the prefetch) can be dispatched or routed twice.
    assert!(
        duplicate_dispatches + duplicate_invalid <= 16,
        "{duplicate_dispatches} duplicate dispatches, {duplicate_invalid} duplicate invalid routings"
    );
}
