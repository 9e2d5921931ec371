//! Load on a private 3-node RabbitMQ cluster, as the cluster tests drive it: the topology
//! declared on the cluster, a steady flow of requests (two per recipient, some published twice)
//! through whichever node answers, every dispatch recorded from a quorum sink with when it came,
//! and the outcomes reconciled with what was published (lost, dispatched twice, over a
//! recipient's quota, denied twice). Shared by the node-loss test (`rabbit_cluster`) and the
//! scale-out test (`scale_out`), which add their failures.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use sendquota::config::{QueueType, WorkerSettings};
use sendquota::internals::broker::{self, Names, Publisher};

use super::private::PrivateRabbitCluster;
use super::{request, TestEnv};

/// Requests published at a time, every [`PACE`] (about 100 a second), while the nodes go down
/// and come back: a few thousand in all.
pub const BATCH: usize = 25;
/// See [`BATCH`].
pub const PACE: Duration = Duration::from_millis(250);
/// Messages per recipient, published one after the other: the headline rule (one a day)
/// dispatches one and denies the other, so dispatches and denials both go on for the whole run.
/// (With a fixed 1,000 recipients, every one had had its message of the day ten seconds into
/// the run, and from then on a correct worker dispatched nothing: read as a stall.)
pub const PER_RECIPIENT: usize = 2;
/// Every this many messages, a copy of the same id is published too.
pub const COPY_EVERY: usize = 7;
/// Longest a node loss may stall decisions: the next node answers within the connect time.
pub const MAX_GAP: Duration = Duration::from_secs(8);

/// A cluster, a test environment whose worker settings are the defaults and whose broker is
/// the cluster (quorum queues), and the topology declared through node 0.
pub async fn cluster_env() -> (PrivateRabbitCluster, TestEnv, Names) {
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
pub async fn node_connection(url: &str, name: &str) -> Connection {
    let properties = ConnectionProperties::default().with_connection_name(name.into());
    Connection::connect(url, properties)
        .await
        .expect("a node of the private cluster answers")
}

/// A quorum queue bound to the dispatch exchange with `#`: every dispatch, kept through a node
/// loss.
pub async fn quorum_sink(channel: &Channel, queue: &str, exchange: &str) {
    let args = broker::queue_args(QueueType::Quorum);
    crate::support::queues::declare_sink_with(channel, queue, exchange, args).await;
}

/// The dispatches recorded: each id and when it came.
pub type Seen = Arc<Mutex<Vec<(String, Instant)>>>;

/// A steady flow of requests through the cluster ([`publish_steadily`]) and every dispatch
/// recorded from a quorum sink ([`record_ids`]), through the nodes from one node on.
pub struct Load {
    /// The dispatches recorded so far.
    pub seen: Seen,
    /// The sink queue's name (for [`diagnose`]).
    pub sink: String,
    stop: tokio::sync::watch::Sender<bool>,
    publishing: tokio::task::JoinHandle<usize>,
}

impl Load {
    /// Declares the sink through node `through` and starts publishing and recording through
    /// the nodes from `through` on.
    pub async fn start(
        cluster: &PrivateRabbitCluster,
        env: &TestEnv,
        names: &Names,
        through: usize,
    ) -> Load {
        let conn = node_connection(&cluster.url(through), "sendquota-test-load").await;
        let channel = conn.create_channel().await.expect("channel");
        let sink = format!("{}.test.cluster-dispatched", env.namespace);
        quorum_sink(&channel, &sink, &names.dispatch).await;
        let _ = conn.close(200, "declared".into()).await;
        let clients = from_node(&cluster.urls(), through);
        let seen = record_ids(clients.clone(), sink.clone());
        let (stop, until) = tokio::sync::watch::channel(false);
        let publishing = tokio::spawn(publish_steadily(clients, names.requests.clone(), until));
        Load {
            seen,
            sink,
            stop,
            publishing,
        }
    }

    /// Stops publishing, then waits (up to 120 s) until every id published has an outcome;
    /// how many ids were published.
    pub async fn finish(&mut self, env: &TestEnv) -> usize {
        let _ = self.stop.send(true);
        let messages = (&mut self.publishing)
            .await
            .expect("every request published");
        wait_for_outcomes(&self.seen, env, messages).await;
        messages
    }
}

/// Takes every message of `queue` as it arrives through one of `urls` (the first that answers,
/// again after a lost connection, like any client of a cluster), recording its id and when it
/// came before acking it. A redelivery of an id already recorded (its ack lost with the
/// connection) is not recorded again; a second dispatch of an id is a new message, not a
/// redelivery, and is.
pub fn record_ids(urls: Vec<String>, queue: String) -> Seen {
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
pub async fn connect_any(urls: &[String], name: &str) -> Option<Connection> {
    for url in urls {
        let properties = ConnectionProperties::default().with_connection_name(name.into());
        if let Ok(conn) = Connection::connect(url, properties).await {
            return Some(conn);
        }
    }
    None
}

/// `urls` starting at node `first`, the others after it in turn.
pub fn from_node(urls: &[String], first: usize) -> Vec<String> {
    (0..urls.len())
        .map(|k| urls[(first + k) % urls.len()].clone())
        .collect()
}

/// Request `m<i>`, to recipient `r<i / PER_RECIPIENT>`.
pub fn body(i: usize) -> String {
    request(&format!("m{i}"), &format!("r{}", i / PER_RECIPIENT), "UTC").to_string()
}

/// Publishes requests `m0`, `m1`, ... (and a copy of every [`COPY_EVERY`]th) through
/// `publisher`, [`BATCH`] every [`PACE`], until `stop` turns true: a steady flow while nodes stop
/// and start. Returns how many distinct ids it published.
pub async fn publish_steadily(
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
pub async fn open_publisher(urls: &[String]) -> Option<(Connection, Publisher)> {
    let conn = connect_any(urls, "sendquota-test-load").await?;
    let publisher = Publisher::open(&conn).await.ok()?;
    Some((conn, publisher))
}

/// Publishes `bodies` to `requests` at once, each confirmed.
pub async fn publish_all(
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
pub async fn worker_node(cluster: &PrivateRabbitCluster) -> usize {
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
pub async fn first_dispatch_after(seen: &Seen, at: Instant) -> Duration {
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
pub async fn denied_ids(env: &TestEnv) -> Vec<String> {
    sqlx::query_scalar("SELECT message_id FROM denials")
        .fetch_all(&env.pool)
        .await
        .expect("read the denials")
}

/// Prints the cluster's view of `queues` (through node `through`): what a stall looked like.
pub fn diagnose(cluster: &PrivateRabbitCluster, through: usize, queues: &[&str]) {
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
pub struct Reconciled {
    /// Distinct ids published.
    pub messages: usize,
    /// Dispatches recorded (every copy) and denial rows.
    pub dispatches: usize,
    pub denials: usize,
    pub distinct_dispatched: usize,
    pub lost: Vec<String>,
    /// Ids dispatched more than once whose first dispatch came in the crash window.
    pub in_window: usize,
    pub outside_window: Vec<String>,
    pub mixed: Vec<String>,
    pub duplicate_denials: usize,
    /// Recipients with more than one distinct id dispatched: each may have one a day.
    pub over_quota: Vec<String>,
}

/// The outcomes of the `messages` ids published, once the workers have stopped: the
/// dispatches recorded in `seen` and the denial rows, reconciled with a crash window of 1 s
/// around the node loss (from `stopping` to `stopped`).
pub async fn outcomes(
    seen: &Seen,
    env: &TestEnv,
    messages: usize,
    stopping: Instant,
    stopped: Instant,
) -> Reconciled {
    // A dispatch confirmed as the workers stopped reaches the sink's consumer a moment later.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let seen = seen.lock().expect("ids").clone();
    let denied = denied_ids(env).await;
    let window = (
        stopping - Duration::from_secs(1),
        stopped + Duration::from_secs(1),
    );
    reconcile(messages, &seen, &denied, window)
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
        messages,
        dispatches: seen.len(),
        denials: denied.len(),
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
        over_quota: over_quota(first.keys().copied()),
    }
}

/// The recipients (`r<i / PER_RECIPIENT>` of id `m<i>`, see [`body`]) with more than one
/// distinct id among `dispatched`.
fn over_quota<'a>(dispatched: impl Iterator<Item = &'a str>) -> Vec<String> {
    let mut per: HashMap<usize, usize> = HashMap::new();
    for id in dispatched {
        let i: usize = id
            .strip_prefix('m')
            .and_then(|n| n.parse().ok())
            .expect("ids are m<i>");
        *per.entry(i / PER_RECIPIENT).or_default() += 1;
    }
    let mut over: Vec<String> = per
        .into_iter()
        .filter(|(_, n)| *n > 1)
        .map(|(r, _)| format!("r{r}"))
        .collect();
    over.sort();
    over
}

/// Waits (up to 120 s) until every one of the `messages` ids published has an outcome: recorded
/// in `seen` or denied.
async fn wait_for_outcomes(seen: &Seen, env: &TestEnv, messages: usize) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let dispatched: HashSet<String> = seen
            .lock()
            .expect("ids")
            .iter()
            .map(|(id, _)| id.clone())
            .collect();
        let denied: HashSet<String> = denied_ids(env).await.into_iter().collect();
        if dispatched.len() + denied.len() >= messages || Instant::now() > deadline {
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

impl Reconciled {
    /// The counts, for a test's report line.
    pub fn summary(&self) -> String {
        format!(
            "published {} ids (+{} copies); dispatched {} ({} distinct), denied {}; lost {}; \
             recipients over quota {}; duplicate dispatches {} in the crash window, {} outside \
             it; ids both dispatched and denied {}; duplicate denial rows {}",
            self.messages,
            self.messages.div_ceil(COPY_EVERY),
            self.dispatches,
            self.distinct_dispatched,
            self.denials,
            self.lost.len(),
            self.over_quota.len(),
            self.in_window,
            self.outside_window.len(),
            self.mixed.len(),
            self.duplicate_denials,
        )
    }

    /// Fails unless the outcomes are exact: none lost, none dispatched twice
    /// outside the crash window, none both dispatched and denied, one denial row per denied id,
    /// and every recipient's one message of the day dispatched, no more. `context` (what the
    /// workers said, say) goes with a loss.
    pub fn assert_exact(&self, context: &str) {
        assert!(
            self.lost.is_empty(),
            "lost: {:?}; {context}",
            &self.lost[..self.lost.len().min(10)]
        );
        assert!(
            self.over_quota.is_empty(),
            "more than one dispatch a day: {:?}",
            self.over_quota
        );
        assert!(
            self.outside_window.is_empty(),
            "dispatched twice outside the crash window: {:?}",
            self.outside_window
        );
        assert!(
            self.mixed.is_empty(),
            "dispatched and denied: {:?}",
            self.mixed
        );
        assert_eq!(self.duplicate_denials, 0, "one denial row per id");
        assert_eq!(
            self.distinct_dispatched,
            self.messages.div_ceil(PER_RECIPIENT),
            "every recipient had its message of the day"
        );
    }
}
