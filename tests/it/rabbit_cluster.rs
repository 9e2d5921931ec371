//! The worker on a private 3-node RabbitMQ cluster (`amqp.urls`, quorum queues): a node lost
//! under load costs no message and no dispatch outside the crash window, and decisions resume
//! within seconds on another node; a delayed message outlives the node that declared its
//! queue; commands given a list whose first node is down reach the next one at once.

use std::collections::{HashMap, HashSet};
use std::io::BufRead;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use sendquota::clock::ManualClock;
use sendquota::config::{QueueType, WorkerSettings};
use sendquota::internals::broker::{self, Names, Publisher};

use crate::support::private::PrivateRabbitCluster;
use crate::support::{local, request, TempFile, TestEnv};

/// Requests published at a time, every [`PACE`] (about 100 a second), while the nodes go down
/// and come back: a few thousand in all.
const BATCH: usize = 25;
/// See [`BATCH`].
const PACE: Duration = Duration::from_millis(250);
/// Messages per recipient, published one after the other: the headline rule (one a day)
/// dispatches one and denies the other, so dispatches and denials both go on for the whole run.
/// (With a fixed 1,000 recipients, every one had had its message of the day ten seconds into
/// the run, and from then on a correct worker dispatched nothing: read as a stall.)
const PER_RECIPIENT: usize = 2;
/// Every this many messages, a copy of the same id is published too.
const COPY_EVERY: usize = 7;
/// Longest a node loss may stall decisions: the next node answers within the connect time.
const MAX_GAP: Duration = Duration::from_secs(8);

/// A cluster, a test environment whose worker settings are the defaults and whose broker is
/// the cluster (quorum queues), and the topology declared through node 0.
async fn cluster_env() -> (PrivateRabbitCluster, TestEnv, Names) {
    let (cluster, mut env) = tokio::join!(
        async {
            tokio::task::spawn_blocking(PrivateRabbitCluster::start)
                .await
                .expect("private rabbitmq cluster")
        },
        TestEnv::new()
    );
    let listen = env.settings.admin.listen.clone();
    env.settings.worker = WorkerSettings::default();
    env.settings.admin.listen = listen;
    env.settings.amqp.queue_type = QueueType::Quorum;
    env.settings.amqp.urls = cluster.urls();
    let names = Names::of(&env.namespace, QueueType::Quorum);
    let conn = node_connection(&cluster.url(0), "sendquota-test-declare").await;
    let publisher = Publisher::open(&conn).await.expect("publisher");
    broker::declare(&publisher.channel(), &names, QueueType::Quorum)
        .await
        .expect("declare the topology on the cluster");
    let _ = conn.close(200, "declared".into()).await;
    (cluster, env, names)
}

/// A connection of the test's own to one node (not through `amqp.urls`, whose choice of node
/// is the worker's).
async fn node_connection(url: &str, name: &str) -> Connection {
    let properties = ConnectionProperties::default().with_connection_name(name.into());
    Connection::connect(url, properties)
        .await
        .expect("a node of the private cluster answers")
}

/// A quorum queue bound to the dispatch exchange with `#`: every dispatch, kept through a node
/// loss.
async fn quorum_sink(channel: &Channel, queue: &str, exchange: &str) {
    let args = broker::queue_args(QueueType::Quorum);
    crate::support::queues::declare_sink_with(channel, queue, exchange, args).await;
}

/// The dispatches recorded: each id and when it came.
type Seen = Arc<Mutex<Vec<(String, Instant)>>>;

/// Takes every message of `queue` as it arrives through one of `urls` (the first that answers,
/// again after a lost connection, like any client of a cluster), recording its id and when it
/// came before acking it. A redelivery of an id already recorded (its ack lost with the
/// connection) is not recorded again; a second dispatch of an id is a new message, not a
/// redelivery, and is.
fn record_ids(urls: Vec<String>, queue: String) -> Seen {
    let seen = Seen::default();
    let into = seen.clone();
    tokio::spawn(async move {
        loop {
            let ended = consume_into(&urls, &queue, &into).await;
            eprintln!("the sink's consumer ended ({ended}); consuming again");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    seen
}

/// One connection's consumption of [`record_ids`]: why it ended.
async fn consume_into(urls: &[String], queue: &str, seen: &Seen) -> String {
    let Some(conn) = connect_any(urls, "sendquota-test-sink").await else {
        return "no node answered".to_owned();
    };
    let Ok(channel) = conn.create_channel().await else {
        return "no channel".to_owned();
    };
    let consumer = channel
        .basic_consume(
            queue.into(),
            "sendquota-test-sink".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await;
    let mut consumer = match consumer {
        Ok(c) => c,
        Err(e) => return e.to_string(),
    };
    while let Some(delivery) = consumer.next().await {
        let delivery = match delivery {
            Ok(d) => d,
            Err(e) => return e.to_string(),
        };
        let body: serde_json::Value =
            serde_json::from_slice(&delivery.data).expect("a JSON dispatch");
        let id = body["id"].as_str().expect("an id").to_owned();
        {
            let mut seen = seen.lock().expect("ids");
            if !(delivery.redelivered && seen.iter().any(|(s, _)| *s == id)) {
                seen.push((id, Instant::now()));
            }
        }
        let _ = delivery.acker.ack(BasicAckOptions::default()).await;
    }
    "the stream ended".to_owned()
}

/// A connection to the first of `urls` that answers, if one does.
async fn connect_any(urls: &[String], name: &str) -> Option<Connection> {
    for url in urls {
        let properties = ConnectionProperties::default().with_connection_name(name.into());
        if let Ok(conn) = Connection::connect(url, properties).await {
            return Some(conn);
        }
    }
    None
}

/// `urls` starting at node `first`, the others after it in turn.
fn from_node(urls: &[String], first: usize) -> Vec<String> {
    (0..urls.len())
        .map(|k| urls[(first + k) % urls.len()].clone())
        .collect()
}

/// Request `m<i>`, to recipient `r<i / PER_RECIPIENT>`.
fn body(i: usize) -> String {
    request(&format!("m{i}"), &format!("r{}", i / PER_RECIPIENT), "UTC").to_string()
}

/// Publishes requests `m0`, `m1`, ... (and a copy of every [`COPY_EVERY`]th) through
/// `publisher`, [`BATCH`] every [`PACE`], until `stop` turns true: a steady flow while nodes stop
/// and start. Returns how many distinct ids it published.
async fn publish_steadily(
    urls: Vec<String>,
    requests: String,
    stop: tokio::sync::watch::Receiver<bool>,
) -> usize {
    let mut next = 0;
    let mut publisher = None;
    while !*stop.borrow() {
        let bodies: Vec<String> = (next..next + BATCH)
            .flat_map(|i| {
                let copies = if i % COPY_EVERY == 0 { 2 } else { 1 };
                std::iter::repeat_n(body(i), copies)
            })
            .collect();
        // A batch whose connection was lost is published again whole, through another node
        // if need be: a copy of an id is decided as one.
        loop {
            if publisher.is_none() {
                publisher = open_publisher(&urls).await;
            }
            let Some((_, p)) = &publisher else {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            };
            match publish_all(p, &requests, &bodies).await {
                Ok(()) => break,
                Err(e) => {
                    eprintln!("publishing lost its connection ({e}); publishing again");
                    publisher = None;
                }
            }
        }
        next += BATCH;
        tokio::time::sleep(PACE).await;
    }
    next
}

/// A publisher on the first of `urls` that answers, with its connection.
async fn open_publisher(urls: &[String]) -> Option<(Connection, Publisher)> {
    let conn = connect_any(urls, "sendquota-test-load").await?;
    let publisher = Publisher::open(&conn).await.ok()?;
    Some((conn, publisher))
}

/// Publishes `bodies` to `requests` at once, each confirmed.
async fn publish_all(
    publisher: &Publisher,
    requests: &str,
    bodies: &[String],
) -> Result<(), broker::BrokerError> {
    let pending: futures_util::stream::FuturesUnordered<_> = bodies
        .iter()
        .map(|b| publisher.publish(requests, "", b.as_bytes(), BasicProperties::default()))
        .collect();
    for confirmed in pending.collect::<Vec<_>>().await {
        confirmed?;
    }
    Ok(())
}

/// Polls until the worker's consuming connection is on some node: that node.
async fn worker_node(cluster: &PrivateRabbitCluster) -> usize {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let found = tokio::task::block_in_place(|| cluster.node_of("sendquota-worker-consume"));
        if let Some(n) = found {
            return n;
        }
        assert!(
            Instant::now() < deadline,
            "the worker connected within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The first dispatch recorded at or after `at`, as a wait from `at`.
async fn first_dispatch_after(seen: &Seen, at: Instant) -> Duration {
    let deadline = at + Duration::from_secs(90);
    loop {
        let first = seen
            .lock()
            .expect("ids")
            .iter()
            .find(|(_, when)| *when >= at)
            .map(|(_, when)| *when - at);
        if let Some(gap) = first {
            return gap;
        }
        assert!(Instant::now() < deadline, "dispatches resumed within 90 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Message ids with a denial row, one entry per row.
async fn denied_ids(env: &TestEnv) -> Vec<String> {
    sqlx::query_scalar("SELECT message_id FROM denials")
        .fetch_all(&env.pool)
        .await
        .expect("read the denials")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_a_follower_node_then_the_workers_node_under_load_loses_nothing() {
    // The worker's log says which node it is on and when its sessions end.
    let _ = tracing_subscriber::fmt()
        .with_env_filter("sendquota=info")
        .with_writer(std::io::stderr)
        .try_init();
    let (cluster, mut env, names) = cluster_env().await;
    let clock = ManualClock::new(local("UTC", "2026-06-01 10:00"));
    env.start_worker(&clock);
    let worker = worker_node(&cluster).await;
    let (follower, steady) = ((worker + 1) % 3, (worker + 2) % 3);
    eprintln!("worker on node {worker}; follower {follower}; test clients on node {steady}");

    let conn = node_connection(&cluster.url(steady), "sendquota-test-load").await;
    let channel = conn.create_channel().await.expect("channel");
    let sink = format!("{}.test.cluster-dispatched", env.namespace);
    quorum_sink(&channel, &sink, &names.dispatch).await;
    let _ = conn.close(200, "declared".into()).await;
    let clients = from_node(&cluster.urls(), steady);
    let seen = record_ids(clients.clone(), sink.clone());
    let (stop_publishing, publish_until) = tokio::sync::watch::channel(false);
    let publishing = tokio::spawn(publish_steadily(
        clients,
        names.requests.clone(),
        publish_until,
    ));

    tokio::time::sleep(Duration::from_secs(3)).await;
    tokio::task::block_in_place(|| cluster.stop(follower));
    let follower_gap = first_dispatch_after(&seen, Instant::now()).await;
    tokio::task::block_in_place(|| cluster.start_again(follower));
    let online = tokio::task::block_in_place(|| cluster.wait_all_members_online(steady));
    eprintln!(
        "follower node {follower} stopped and started again; its quorum members online {:.1} s later",
        online.as_secs_f64()
    );
    tokio::time::sleep(Duration::from_secs(2)).await;

    let stopping = Instant::now();
    tokio::task::block_in_place(|| cluster.stop(worker));
    let stopped = Instant::now();
    let resumed = tokio::time::timeout(MAX_GAP * 2, first_dispatch_after(&seen, stopped)).await;
    let Ok(gap) = resumed else {
        let dispatched = seen.lock().expect("ids").len();
        let denied = denied_ids(&env).await.len();
        tokio::task::block_in_place(|| diagnose(&cluster, steady, &[&names.requests, &sink]));
        panic!(
            "no dispatch within {:?} of node {worker} stopping; so far dispatched {dispatched}, \
             denial rows {denied}",
            MAX_GAP * 2
        );
    };
    let moved_to = worker_node(&cluster).await;
    eprintln!(
        "stopping node {worker} took {:.1} s; the worker moved to node {moved_to}; first \
         dispatch {:.2} s after it stopped",
        (stopped - stopping).as_secs_f64(),
        gap.as_secs_f64()
    );
    tokio::task::block_in_place(|| cluster.start_again(worker));
    tokio::time::sleep(Duration::from_secs(2)).await;
    let _ = stop_publishing.send(true);
    let messages = publishing.await.expect("every request published");

    // Every id ends dispatched or denied.
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let dispatched: HashSet<String> = seen
            .lock()
            .expect("ids")
            .iter()
            .map(|(id, _)| id.clone())
            .collect();
        let denied: HashSet<String> = denied_ids(&env).await.into_iter().collect();
        if dispatched.len() + denied.len() >= messages || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    env.stop_worker().await;
    tokio::time::sleep(Duration::from_millis(500)).await;

    let seen = seen.lock().expect("ids").clone();
    let denied = denied_ids(&env).await;
    let window = (
        stopping - Duration::from_secs(1),
        stopped + Duration::from_secs(1),
    );
    let report = reconcile(messages, &seen, &denied, window);
    eprintln!(
        "rabbit cluster report: published {messages} (+{} copies); dispatched {} ({} distinct), \
         denied {}; lost {}; duplicate dispatches {} in the crash window (first copy within 1 s \
         of the worker's node stopping), {} outside it; ids both dispatched and denied {}; \
         duplicate denial rows {}; gap after the follower's stop {:.2} s, after the worker's \
         node's {:.2} s",
        messages.div_ceil(COPY_EVERY),
        seen.len(),
        report.distinct_dispatched,
        denied.len(),
        report.lost.len(),
        report.in_window,
        report.outside_window.len(),
        report.mixed.len(),
        report.duplicate_denials,
        follower_gap.as_secs_f64(),
        gap.as_secs_f64(),
    );
    assert!(
        report.lost.is_empty(),
        "lost: {:?}",
        &report.lost[..report.lost.len().min(10)]
    );
    assert!(
        report.outside_window.is_empty(),
        "dispatched twice outside the crash window: {:?}",
        report.outside_window
    );
    assert!(
        report.mixed.is_empty(),
        "dispatched and denied: {:?}",
        report.mixed
    );
    assert_eq!(report.duplicate_denials, 0, "one denial row per id");
    assert_eq!(
        report.distinct_dispatched,
        messages.div_ceil(PER_RECIPIENT),
        "one dispatch per recipient a day"
    );
    assert!(
        gap < MAX_GAP,
        "decisions resumed {gap:?} after the worker's node stopped"
    );
    assert!(
        follower_gap < MAX_GAP,
        "decisions resumed {follower_gap:?} after the follower stopped"
    );
}

/// Prints the cluster's view of `queues` (through node `through`): what a stall looked like.
fn diagnose(cluster: &PrivateRabbitCluster, through: usize, queues: &[&str]) {
    let mut said = String::new();
    let listings: [&[&str]; 2] = [
        &[
            "list_queues",
            "name",
            "type",
            "leader",
            "members",
            "online",
            "messages",
            "messages_ready",
            "messages_unacknowledged",
            "consumers",
        ],
        &[
            "list_channels",
            "connection",
            "number",
            "confirm",
            "messages_unconfirmed",
            "messages_unacknowledged",
            "consumer_count",
        ],
    ];
    for args in listings {
        let listed = cluster.ctl_output(through, args).unwrap_or_else(|e| e);
        said.push_str(&format!("== rabbitmqctl {args:?}\n{listed}\n"));
    }
    for queue in queues {
        let status = cluster.queues_output(through, &["quorum_status", queue]);
        said.push_str(&format!(
            "== quorum_status {queue}\n{}\n",
            status.unwrap_or_else(|e| e)
        ));
    }
    eprintln!("the cluster when dispatches did not resume:\n{said}");
}

/// What the outcomes of one run add up to.
struct Reconciled {
    distinct_dispatched: usize,
    lost: Vec<String>,
    /// Ids dispatched more than once whose first dispatch came in the crash window.
    in_window: usize,
    outside_window: Vec<String>,
    mixed: Vec<String>,
    duplicate_denials: usize,
}

/// Reconciles the dispatches (`seen`, with when each arrived) and denial rows with the ids
/// published; a duplicate dispatch is in the crash window when its first copy arrived within
/// `window` (the worker's node going away with dispatches not yet marked).
fn reconcile(
    messages: usize,
    seen: &[(String, Instant)],
    denied: &[String],
    window: (Instant, Instant),
) -> Reconciled {
    let mut first: HashMap<&str, (Instant, usize)> = HashMap::new();
    for (id, at) in seen {
        first.entry(id.as_str()).or_insert((*at, 0)).1 += 1;
    }
    let denied_set: HashSet<&str> = denied.iter().map(String::as_str).collect();
    let lost = (0..messages)
        .map(|i| format!("m{i}"))
        .filter(|id| !first.contains_key(id.as_str()) && !denied_set.contains(id.as_str()))
        .collect();
    let (mut in_window, mut outside_window) = (0, Vec::new());
    for (id, (at, count)) in &first {
        if *count > 1 && (window.0..=window.1).contains(at) {
            in_window += count - 1;
        } else if *count > 1 {
            outside_window.push((*id).to_owned());
        }
    }
    Reconciled {
        distinct_dispatched: first.len(),
        lost,
        in_window,
        outside_window,
        mixed: first
            .keys()
            .filter(|id| denied_set.contains(**id))
            .map(|id| (*id).to_owned())
            .collect(),
        duplicate_denials: denied.len() - denied_set.len(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delayed_message_outlives_the_node_that_declared_its_quorum_delay_queue() {
    let (cluster, mut env, names) = cluster_env().await;
    let conn = node_connection(&cluster.url(2), "sendquota-test-delay").await;
    let channel = conn.create_channel().await.expect("channel");
    let sink = format!("{}.test.cluster-dispatched", env.namespace);
    quorum_sink(&channel, &sink, &names.dispatch).await;
    let publisher = Publisher::open(&conn).await.expect("publisher");
    let delay = names.delay_queue(5_000);
    assert_eq!(delay, format!("{}.delay.q.5000", env.namespace));
    let parked = request("parked", "rita", "UTC").to_string();
    publisher
        .publish("", &delay, parked.as_bytes(), BasicProperties::default())
        .await
        .expect("park a message in the 5 s delay queue");
    let parked_at = Instant::now();
    tokio::task::block_in_place(|| cluster.stop(0));

    // The worker's list starts with the stopped node: it moves on to node 1.
    let clock = ManualClock::new(local("UTC", "2026-06-01 10:00"));
    env.start_worker(&clock);
    let seen = record_ids(from_node(&cluster.urls(), 2), sink);
    let deadline = Instant::now() + Duration::from_secs(60);
    let back = loop {
        if let Some((id, at)) = seen.lock().expect("ids").first().cloned() {
            break (id, at);
        }
        assert!(
            Instant::now() < deadline,
            "the parked message came back from the delay queue and was dispatched"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    eprintln!(
        "parked message dispatched {:.1} s after it was parked, node 0 (the queue's declarer) down",
        (back.1 - parked_at).as_secs_f64()
    );
    assert_eq!(back.0, "parked");
    assert!(
        back.1 - parked_at >= Duration::from_millis(4_500),
        "it waited its delay"
    );
    assert_eq!(
        worker_node(&cluster).await,
        1,
        "the worker went to the next node"
    );
    env.stop_worker().await;
    let _ = conn.close(200, "done".into()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_and_tail_given_a_dead_first_node_connect_to_the_next_at_once() {
    let (cluster, env, names) = cluster_env().await;
    let urls = [PrivateRabbitCluster::dead_url(), cluster.url(1)].join(",");
    let lines = TempFile::new(&format!("{}\n", body(1)));
    let mut publish = env.cli(&["publish", lines.path()]);
    publish.env("SENDQUOTA_AMQP_URLS", &urls);
    let started = Instant::now();
    let out = tokio::task::spawn_blocking(move || publish.output())
        .await
        .expect("publish runs")
        .expect("publish starts");
    let took = started.elapsed();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let conn = node_connection(&cluster.url(2), "sendquota-test-read").await;
    let channel = conn.create_channel().await.expect("channel");
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    let ready = channel
        .queue_declare(
            names.requests.as_str().into(),
            passive,
            FieldTable::default(),
        )
        .await
        .expect("the requests queue")
        .message_count();
    assert_eq!(ready, 1, "the request went to the cluster through node 1");

    let mut tail = env.cli(&["tail", "--channel", "sms"]);
    tail.env("SENDQUOTA_AMQP_URLS", &urls)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    let started = Instant::now();
    let mut child = tail.spawn().expect("tail starts");
    let stderr = child.stderr.take().expect("tail's stderr");
    let tailing = tokio::task::spawn_blocking(move || {
        let mut said = String::new();
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            said.push_str(&line);
            said.push('\n');
            if line.contains("tailing") {
                return (true, said);
            }
        }
        (false, said)
    });
    let tailing = tokio::time::timeout(Duration::from_secs(20), tailing).await;
    let tail_took = started.elapsed();
    let _ = child.kill();
    let _ = child.wait();
    let said = match &tailing {
        Ok(Ok((_, said))) => said.clone(),
        other => format!("{other:?}"),
    };
    assert!(
        matches!(tailing, Ok(Ok((true, _)))),
        "tail started tailing through node 1: {said}"
    );
    eprintln!(
        "with a dead first node: publish took {:.2} s, tail listened after {:.2} s",
        took.as_secs_f64(),
        tail_took.as_secs_f64()
    );
    // A refused connection costs nothing; the time is the command's own start.
    assert!(took < Duration::from_secs(5), "publish took {took:?}");
    assert!(
        tail_took < Duration::from_secs(5),
        "tail took {tail_took:?}"
    );
    let _ = conn.close(200, "done".into()).await;
}
