//! The worker supervises itself: a consumer that silently stops is restarted by the watchdog,
//! a broker resource alarm pauses it without losing or repeating anything, an exchange or
//! queue of its own that an operator deleted comes back within seconds, and SIGTERM drains
//! in-flight messages and exits cleanly without losing any. The binary runs on the number of
//! runtime threads its configuration asks for.

use crate::support;

use std::collections::HashMap;
use std::process::Stdio;
use std::time::{Duration, Instant};

use lapin::options::BasicGetOptions;
use sendquota::clock::ManualClock;
use sendquota::config::{QueueType, WorkerSettings};
use sendquota::failpoint::Failpoint;
use sendquota::internals::broker::{self, Publisher};
use sendquota::internals::keys::{claim_key, scope_tag};
use sendquota::internals::policy::ScopeValue;
use support::fixtures::policy;
use support::http::http;
use support::private::{free_port, PrivateRabbit};
use support::{local, request, TestEnv};

#[tokio::test]
async fn the_watchdog_restarts_a_consumer_that_silently_stopped() {
    let mut env = TestEnv::new().await;
    env.settings.worker.watchdog_interval_ms = 300;
    env.settings.amqp.prefetch = 2;
    let clock = ManualClock::new(local("UTC", "2026-04-01 09:00"));
    env.start_worker_with(&clock, Some(Failpoint::StallConsumerOnce));
    let started = Instant::now();
    // More messages than the prefetch: the stalled consumer holds two, the rest wait in the
    // queue, which is what the watchdog sees.
    for i in 0..6 {
        env.publish(&request(&format!("m{i}"), &format!("user-{i}"), "UTC"))
            .await;
    }
    let mut seen = HashMap::new();
    for i in 0..6 {
        assert!(
            env.outcome(&format!("m{i}"), &mut seen).await,
            "m{i} dispatched after the restart"
        );
    }
    // The first session took nothing: the message waited for at least one watchdog interval.
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "{:?}",
        started.elapsed()
    );
    env.stop_worker().await;
}

/// A consumer whose prefetch window is full of deliveries still being worked on is handed
/// nothing more, and that is no stall. With a prefetch below the concurrency (a bound on the
/// worker's memory an operator may choose) and deliveries held longer than the watchdog's
/// interval (here `slow-` ids, held `SLOW_IDS_HOLD` each), the watchdog saw free slots,
/// messages ready and nothing delivered, and restarted the session: the slow deliveries went
/// back to the queue unfinished, came back first, and the next session did the same, so
/// nothing was ever decided.
#[tokio::test]
async fn a_prefetch_window_full_of_slow_deliveries_is_not_taken_for_a_stall() {
    let mut env = TestEnv::new().await;
    env.settings.worker.watchdog_interval_ms = 300;
    env.settings.amqp.prefetch = 2;
    assert!(usize::from(env.settings.amqp.prefetch) < env.settings.worker.concurrency);
    let clock = ManualClock::new(local("UTC", "2026-04-01 09:00"));
    env.start_worker_with(&clock, Some(Failpoint::SlowIds));
    let ids = ["slow-0", "slow-1", "m0", "m1"];
    for (i, id) in ids.iter().enumerate() {
        env.publish(&request(id, &format!("user-{i}"), "UTC")).await;
    }
    let mut seen = HashMap::new();
    for id in ids {
        env.dispatched(id, &mut seen).await;
    }
    env.stop_worker().await;
    for id in env.take_dispatched().await {
        *seen.entry(id).or_default() += 1;
    }
    assert!(
        seen.values().all(|&n| n == 1),
        "each dispatched once: {seen:?}"
    );
}

async fn queued(env: &TestEnv) -> u32 {
    env.channel
        .queue_declare(
            env.names.requests.as_str().into(),
            lapin::options::QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            lapin::types::FieldTable::default(),
        )
        .await
        .expect("passive declare")
        .message_count()
}

#[tokio::test]
async fn sigterm_finishes_in_flight_messages_exits_0_and_loses_nothing() {
    let env = TestEnv::new().await;
    let config = "prefetch = 20\n[worker]\nconcurrency = 20\n";
    let n = 400;
    env.publish_two_per_recipient(n).await;
    let worker = spawn_worker(&env, config, free_port());
    // Stop it while it is busy.
    let deadline = Instant::now() + Duration::from_secs(20);
    while queued(&env).await as usize > n * 3 / 4 {
        assert!(Instant::now() < deadline, "the worker started consuming");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    stop_cleanly(worker);

    // Everything is decided exactly once or still queued: dispatched + denied + waiting = n.
    let dispatched = env.take_dispatched().await;
    let denied = env.denials().await.len();
    let waiting = queued(&env).await as usize;
    assert!(dispatched.len() + denied > 0, "it was stopped mid-flow");
    assert!(waiting > 0, "it was stopped mid-flow");
    assert_eq!(
        dispatched.len() + denied + waiting,
        n,
        "nothing lost or doubled"
    );
}

#[tokio::test]
async fn the_worker_runs_on_as_many_runtime_threads_as_configured() {
    let env = TestEnv::new().await;
    for (worker_toml, threads) in [("", 1), ("[worker]\nthreads = 3\n", 3)] {
        let id = format!("m-threads{threads}");
        env.publish(&request(&id, &id, "UTC")).await;
        let port = free_port();
        let worker = spawn_worker(&env, worker_toml, port);
        let deadline = Instant::now() + Duration::from_secs(20);
        while !env.take_dispatched().await.contains(&id) {
            assert!(Instant::now() < deadline, "{id} dispatched");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // The runtime's own count: client crates resolve host names on its blocking pool,
        // whose threads carry the same name as its workers.
        let metrics = http(port, "GET", "/metrics", None, "").await.body;
        let runtime_threads = metrics
            .lines()
            .find_map(|l| l.strip_prefix("sendquota_runtime_worker_threads "))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or_else(|| panic!("the runtime's worker threads in /metrics:\n{metrics}"))
            as usize;
        stop_cleanly(worker);
        assert_eq!(runtime_threads, threads, "config {worker_toml:?}");
    }
}

/// Starts the worker binary with `config` ([`TestEnv::cli_with`]), against `env`'s services and
/// namespace, its admin API on `admin_port`.
fn spawn_worker(env: &TestEnv, config: &str, admin_port: u16) -> std::process::Child {
    env.cli_with(config, &["worker", "--now", "2026-04-01T09:00:00Z"])
        .env("SENDQUOTA_ADMIN_LISTEN", format!("127.0.0.1:{admin_port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the worker")
}

/// Sends SIGTERM to `worker`, waits for it and checks that it exited with 0.
fn stop_cleanly(worker: std::process::Child) {
    let out = crate::support::process::terminate(worker);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// RabbitMQ blocks the connections that publish while a resource alarm is on. The worker
/// publishes on a connection of its own: while it is blocked the worker takes no new delivery
/// and is not ready, its confirms wait without timing out (a publish that the broker takes
/// after the alarm must not be sent a second time), and when the alarm clears every message is
/// dispatched once. The alarm is node-wide, so the test has a node of its own.
#[tokio::test]
async fn a_memory_alarm_pauses_the_worker_until_it_clears_and_nothing_is_sent_twice() {
    const MESSAGES: usize = 40;
    let rabbit = tokio::task::spawn_blocking(PrivateRabbit::start)
        .await
        .expect("start a private rabbitmq");
    let mut env = TestEnv::new().await;
    env.settings.amqp.url = rabbit.url();
    env.settings.amqp.queue_type = QueueType::Quorum;
    let port = free_port();
    env.settings.admin.listen = format!("127.0.0.1:{port}");
    // A lease far shorter than the block: the claims of the messages waiting on it must be
    // renewed, or copies of them could be decided meanwhile.
    env.settings.worker.claim_lease_ms = 1_000;

    // Topology, a sink for dispatched messages and the requests, all before the alarm.
    let conn = broker::connect(&env.settings.amqp, "alarm-producer")
        .await
        .expect("private rabbitmq");
    let publisher = Publisher::open(&conn).await.expect("publisher");
    broker::declare(&publisher.channel(), &env.names, QueueType::Quorum)
        .await
        .expect("declare");
    let sink = lapin_connect_to(&rabbit.url()).await;
    let channel = sink.create_channel().await.expect("channel");
    support::declare_sink(&channel, "sink", &env.names.dispatch).await;
    for i in 0..MESSAGES {
        let body =
            serde_json::to_vec(&request(&format!("a{i}"), &format!("u{i}"), "UTC")).expect("json");
        publisher
            .publish(
                &env.names.requests,
                "",
                &body,
                broker::json_properties(None, &[]),
            )
            .await
            .expect("publish");
    }
    let _ = conn.close(200, "published".into()).await;

    rabbit.ctl(&["set_vm_memory_high_watermark", "0"]);
    let clock = ManualClock::new(local("UTC", "2026-04-01 09:00"));
    env.start_worker(&clock);
    support::http::wait_until_listening(port).await;
    // The worker's first dispatch makes the broker block its publishing connection.
    let deadline = Instant::now() + Duration::from_secs(20);
    let blocked = loop {
        let ready = http(port, "GET", "/readyz", None, "").await;
        if ready.status == 503 && !ready.json()["blocked"].is_null() {
            break ready.json();
        }
        assert!(
            Instant::now() < deadline,
            "the worker reports the block: {}",
            ready.body
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(blocked["consuming"], true, "{blocked}");
    assert!(
        blocked["blocked"]
            .as_str()
            .is_some_and(|r| r.contains("memory")),
        "the broker's reason: {blocked}"
    );
    // Longer than the broker timeout: no confirm wait may give up while the block lasts.
    tokio::time::sleep(broker::BROKER_TIMEOUT + Duration::from_secs(2)).await;
    assert!(
        drain_ids(&channel).await.is_empty(),
        "nothing is dispatched while publishing is blocked"
    );
    assert_eq!(
        http(port, "GET", "/readyz", None, "").await.status,
        503,
        "still not ready while blocked"
    );
    let held = live_claims(&env, MESSAGES).await;
    assert!(
        held > 0,
        "the messages waiting on the block still hold their claims, renewed past many leases"
    );

    rabbit.ctl(&["set_vm_memory_high_watermark", "0.4"]);
    let mut dispatched = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while dispatched.len() < MESSAGES {
        assert!(
            Instant::now() < deadline,
            "{} of {MESSAGES} dispatched after the alarm cleared",
            dispatched.len()
        );
        dispatched.extend(drain_ids(&channel).await);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    support::http::wait_until_ready(port).await;
    // A confirm that had timed out would show up as a second copy a little later.
    tokio::time::sleep(Duration::from_secs(1)).await;
    dispatched.extend(drain_ids(&channel).await);
    dispatched.sort();
    let mut unique = dispatched.clone();
    unique.dedup();
    assert_eq!(unique.len(), MESSAGES, "every message dispatched");
    assert_eq!(dispatched, unique, "no message dispatched twice");
    env.stop_worker().await;
}

/// How many of messages `a0`.. (recipient `u<i>`) hold an in-flight claim: its key lives
/// until Redis expires it with the lease.
async fn live_claims(env: &TestEnv, messages: usize) -> usize {
    let mut conn = env.redis.clone();
    let mut live = 0;
    for i in 0..messages {
        let tag = scope_tag(&ScopeValue::Recipient(&format!("u{i}")));
        let held: bool = redis::cmd("EXISTS")
            .arg(claim_key(&env.namespace, &tag, &format!("a{i}")))
            .query_async(&mut conn)
            .await
            .expect("exists");
        live += usize::from(held);
    }
    live
}

async fn lapin_connect_to(url: &str) -> lapin::Connection {
    lapin::Connection::connect(url, lapin::ConnectionProperties::default())
        .await
        .expect("private rabbitmq")
}

/// The ids of the messages waiting in the sink, taken off it.
async fn drain_ids(channel: &lapin::Channel) -> Vec<String> {
    let mut ids = Vec::new();
    while let Some(m) = channel
        .basic_get("sink".into(), BasicGetOptions { no_ack: true })
        .await
        .expect("basic.get")
    {
        let request: serde_json::Value = serde_json::from_slice(&m.delivery.data).expect("json");
        ids.push(request["id"].as_str().expect("id").to_owned());
    }
    ids
}

/// The broker closes the worker's publishing channel when a publish names an exchange that is
/// gone. The worker then rebuilds its whole session (declaring its topology again, so the
/// exchange is back) and every message is dispatched once a sender's queue is bound again:
/// deliveries wait unacked meanwhile, and none is lost.
#[tokio::test]
async fn deleting_the_dispatch_exchange_under_load_rebuilds_the_session_and_loses_nothing() {
    const MESSAGES: usize = 300;
    let mut env = TestEnv::new().await;
    let clock = ManualClock::new(local("UTC", "2026-04-01 09:00"));
    env.start_worker(&clock);
    let ids: Vec<String> = (0..MESSAGES).map(|i| format!("x{i}")).collect();
    // A steady load, about 3 s of it: the deletion falls in the middle.
    let (publisher, requests) = (env.publisher.clone(), env.names.requests.clone());
    let producer = tokio::spawn({
        let ids = ids.clone();
        async move {
            for (i, id) in ids.iter().enumerate() {
                let body = serde_json::to_vec(&request(id, &format!("u{i}"), "UTC")).expect("json");
                publisher
                    .publish(&requests, "", &body, broker::json_properties(None, &[]))
                    .await
                    .expect("publish a request");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    });
    let mut seen = HashMap::new();
    env.dispatched("x30", &mut seen).await;
    env.channel
        .exchange_delete(
            env.names.dispatch.as_str().into(),
            lapin::options::ExchangeDeleteOptions::default(),
        )
        .await
        .expect("delete the dispatch exchange");
    // The worker declares the exchange again in its next session; the sink's binding went with
    // the old exchange, so the test binds it again once the exchange is back.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        // A passive declare of a missing exchange closes the channel: one channel per try.
        let probe = env.amqp.create_channel().await.expect("channel");
        let passive = lapin::options::ExchangeDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let exists = probe
            .exchange_declare(
                env.names.dispatch.as_str().into(),
                lapin::ExchangeKind::Topic,
                passive,
                lapin::types::FieldTable::default(),
            )
            .await
            .is_ok();
        if exists {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the worker declared the dispatch exchange again"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    support::declare_sink(&env.channel, &env.dispatched_queue, &env.names.dispatch).await;
    producer.await.expect("the producer published everything");
    let deadline = Instant::now() + Duration::from_secs(30);
    while seen.len() < MESSAGES {
        assert!(
            Instant::now() < deadline,
            "{} of {MESSAGES} dispatched after the exchange came back",
            seen.len()
        );
        for id in env.take_dispatched().await {
            *seen.entry(id).or_default() += 1;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut dispatched: Vec<&String> = seen.keys().collect();
    dispatched.sort();
    let mut expected: Vec<&String> = ids.iter().collect();
    expected.sort();
    assert_eq!(dispatched, expected, "every message dispatched, none lost");
    env.stop_worker().await;
}

/// How soon a queue of the worker's that was deleted must be back and in use: a declaration
/// takes milliseconds, the rest is slack for a loaded machine.
const HEALED_WITHIN: Duration = Duration::from_secs(5);

/// Deleting the requests queue cancels the worker's consumer (the messages it held go with
/// the queue). The worker declares the queue again at once and consumes it, while the
/// deliveries already in flight (here each held for `SLOW_IDS_HOLD`, as behind a slow
/// service) finish beside it and are acked on their own channel: a request published right
/// after the deletion is dispatched within seconds, long before the shutdown timeout, and
/// every message that was in flight is dispatched once.
#[tokio::test]
async fn a_deleted_requests_queue_is_consumed_again_at_once_while_in_flight_messages_finish() {
    const SLOW: usize = 20;
    let mut env = TestEnv::new().await;
    env.settings.worker.shutdown_timeout_ms = WorkerSettings::default().shutdown_timeout_ms;
    let clock = ManualClock::new(local("UTC", "2026-04-01 09:00"));
    env.start_worker_with(&clock, Some(Failpoint::SlowIds));
    let mut seen = HashMap::new();
    env.publish(&request("before", "alice", "UTC")).await;
    env.dispatched("before", &mut seen).await;
    for i in 0..SLOW {
        env.publish(&request(&format!("slow-{i}"), &format!("s{i}"), "UTC"))
            .await;
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while queued(&env).await > 0 {
        assert!(Instant::now() < deadline, "the slow messages are in flight");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    delete_queue(&env, &env.names.requests).await;
    let deleted = Instant::now();
    // Unroutable until the worker has declared and bound the queue again.
    let body = serde_json::to_vec(&request("after", "bob", "UTC")).expect("json");
    while let Err(e) = env
        .publisher
        .publish(
            &env.names.requests,
            "",
            &body,
            broker::json_properties(None, &[]),
        )
        .await
    {
        assert!(
            deleted.elapsed() < HEALED_WITHIN,
            "the requests queue was declared again at once: {e}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    env.dispatched("after", &mut seen).await;
    assert!(
        deleted.elapsed() < HEALED_WITHIN,
        "a request published after the deletion was dispatched within {HEALED_WITHIN:?}, not \
         after the in-flight messages: {:?}",
        deleted.elapsed()
    );
    for i in 0..SLOW {
        env.dispatched(&format!("slow-{i}"), &mut seen).await;
    }
    env.stop_worker().await;
    for id in env.take_dispatched().await {
        *seen.entry(id).or_default() += 1;
    }
    let twice: Vec<_> = seen.iter().filter(|(_, &n)| n != 1).collect();
    assert!(twice.is_empty(), "dispatched more than once: {twice:?}");
    assert_eq!(seen.len(), SLOW + 2, "nothing in flight was lost: {seen:?}");
}

/// An operator deletes the invalid queue under a running worker. The next invalid message's
/// publish comes back unroutable; the worker declares its topology again and publishes it once
/// more, so it lands in the invalid queue with its reason within seconds (it used to be retried
/// forever, the queue never coming back).
#[tokio::test]
async fn a_deleted_invalid_queue_is_declared_again_for_the_next_invalid_message() {
    let mut env = running_worker().await;
    delete_queue(&env, &env.names.invalid).await;
    let body = br#"{"id":"typo","recipient":"alice","channel":"sms","timezon":"UTC"}"#;
    env.publish_raw(body).await;
    let invalid = first_message_in(&env, &env.names.invalid).await;
    assert_eq!(invalid.delivery.data, body, "the body as it was published");
    let reason = broker::header(&invalid.delivery.properties, broker::REASON_HEADER);
    assert!(
        reason.as_deref().is_some_and(|r| r.contains("timezon")),
        "the reason names the unknown field: {reason:?}"
    );
    env.stop_worker().await;
}

/// The same for the quarantine queue: a poison message (Postgres refuses its denial row for
/// its data) is quarantined with its headers although the queue had been deleted.
#[tokio::test]
async fn a_deleted_quarantine_queue_is_declared_again_for_the_next_poison_message() {
    let mut env = running_worker().await;
    env.refuse_denials_to("picky").await;
    env.publish(&request("p1", "picky", "UTC")).await;
    env.dispatched("p1", &mut HashMap::new()).await;
    delete_queue(&env, &env.names.quarantine).await;
    let poison = request("p2", "picky", "UTC").to_string();
    env.publish_raw(poison.as_bytes()).await;
    let quarantined = first_message_in(&env, &env.names.quarantine).await;
    assert_eq!(quarantined.delivery.data, poison.as_bytes());
    let reason = broker::header(
        &quarantined.delivery.properties,
        broker::QUARANTINE_REASON_HEADER,
    );
    assert!(
        reason
            .as_deref()
            .is_some_and(|r| r.contains("picky refuses")),
        "the quarantine reason: {reason:?}"
    );
    env.stop_worker().await;
}

/// The same for a delay queue: a message a quiet-hours rule delays until 08:00 is parked in
/// the 6-hour delay queue, declared again, with the instant it waits for.
#[tokio::test]
async fn a_deleted_delay_queue_is_declared_again_for_the_next_delayed_message() {
    let quiet = policy!("quiet_nights_delayed");
    let mut env = TestEnv::with_config(quiet).await;
    let clock = ManualClock::new(local("UTC", "2026-04-01 21:00"));
    env.start_worker(&clock);
    env.publish(&request("day", "alice", "UTC")).await;
    env.dispatched("day", &mut HashMap::new()).await;
    clock.set(local("UTC", "2026-04-01 23:00"));
    let queue = env.names.delay_queue(21_600_000);
    delete_queue(&env, &queue).await;
    env.publish(&request("night", "bob", "UTC")).await;
    let parked = first_message_in(&env, &queue).await;
    let until = broker::header(&parked.delivery.properties, broker::DELAYED_UNTIL_HEADER);
    assert_eq!(until.as_deref(), Some("2026-04-02T08:00:00+00:00"));
    env.stop_worker().await;
}

/// A producer's publisher that heals, as `sendquota publish` and the replays open theirs: with
/// no worker running, a publish to the requests exchange whose queue was deleted declares the
/// topology again and is routed to the queue instead of failing.
#[tokio::test]
async fn a_producers_publish_brings_a_deleted_requests_queue_back_and_lands_in_it() {
    let env = TestEnv::new().await;
    delete_queue(&env, &env.names.requests).await;
    let publisher = Publisher::open(&env.broker)
        .await
        .expect("publisher")
        .healing(env.names.clone(), env.settings.amqp.queue_type);
    let body = request("m1", "alice", "UTC").to_string();
    publisher
        .publish(
            &env.names.requests,
            "",
            body.as_bytes(),
            broker::json_properties(None, &[]),
        )
        .await
        .expect("routed once the queue is declared again");
    assert_eq!(env.ready(&env.names.requests).await, 1);
}

/// A worker at default settings on the headline policy, started, and seen to have dispatched a
/// first message (so its topology is declared and it consumes).
async fn running_worker() -> TestEnv {
    let mut env = TestEnv::new().await;
    let clock = ManualClock::new(local("UTC", "2026-04-01 09:00"));
    env.start_worker(&clock);
    env.publish(&request("first", "first", "UTC")).await;
    env.dispatched("first", &mut HashMap::new()).await;
    env
}

/// Deletes `queue` (and whatever it holds) through the test's own connection, as an operator
/// would.
async fn delete_queue(env: &TestEnv, queue: &str) {
    env.channel
        .queue_delete(queue.into(), lapin::options::QueueDeleteOptions::default())
        .await
        .unwrap_or_else(|e| panic!("delete {queue}: {e}"));
}

/// The first message to reach `queue` within [`HEALED_WITHIN`], taken off it; the queue may be
/// missing until then.
async fn first_message_in(env: &TestEnv, queue: &str) -> lapin::message::BasicGetMessage {
    let deadline = Instant::now() + HEALED_WITHIN;
    loop {
        // A basic.get on a missing queue closes the channel: one channel per try.
        let probe = env.amqp.create_channel().await.expect("channel");
        let got = probe
            .basic_get(queue.into(), BasicGetOptions { no_ack: true })
            .await;
        let _ = probe.close(200, "probed".into()).await;
        if let Ok(Some(message)) = got {
            return message;
        }
        assert!(
            Instant::now() < deadline,
            "{queue} was declared again and got its message within {HEALED_WITHIN:?} ({got:?})",
            got = got.map(|m| m.is_some())
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
