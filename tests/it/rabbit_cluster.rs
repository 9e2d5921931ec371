//! The worker on a private 3-node RabbitMQ cluster (`amqp.urls`, quorum queues): a node lost
//! under load costs no message and no dispatch outside the crash window, and decisions resume
//! within seconds on another node; a delayed message outlives the node that declared its
//! queue; commands given a list whose first node is down reach the next one at once.

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

/// Fewer recipients than messages: the headline rule (one a day) denies the rest.
const RECIPIENTS: usize = 1_000;
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

fn body(i: usize) -> String {
    request(&format!("m{i}"), &format!("r{}", i % RECIPIENTS), "UTC").to_string()
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
