//! The worker on a private 3-node RabbitMQ cluster (`amqp.urls`, quorum queues): a node lost
//! under load costs no message and no dispatch outside the crash window, and decisions resume
//! within seconds on another node; a delayed message outlives the node that declared its
//! queue; commands given a list whose first node is down reach the next one at once.

use std::io::BufRead;
use std::time::{Duration, Instant};

use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use lapin::BasicProperties;
use sendquota::clock::ManualClock;
use sendquota::internals::broker::Publisher;

use crate::support::cluster_load::{
    body, cluster_env, denied_ids, diagnose, first_dispatch_after, from_node, node_connection,
    outcomes, quorum_sink, record_ids, worker_node, Load, MAX_GAP,
};
use crate::support::private::PrivateRabbitCluster;
use crate::support::{local, request, TempFile};

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

    let mut load = Load::start(&cluster, &env, &names, steady).await;
    let seen = load.seen.clone();

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
        tokio::task::block_in_place(|| diagnose(&cluster, steady, &[&names.requests, &load.sink]));
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
    let messages = load.finish(&env).await;
    env.stop_worker().await;
    let report = outcomes(&seen, &env, messages, stopping, stopped).await;
    eprintln!(
        "rabbit cluster report: {}; gap after the follower's stop {:.2} s, after the worker's \
         node's {:.2} s (crash window: first copy within 1 s of the worker's node stopping)",
        report.summary(),
        follower_gap.as_secs_f64(),
        gap.as_secs_f64(),
    );
    report.assert_exact("");
    assert!(
        gap < MAX_GAP,
        "decisions resumed {gap:?} after the worker's node stopped"
    );
    assert!(
        follower_gap < MAX_GAP,
        "decisions resumed {follower_gap:?} after the follower stopped"
    );
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
