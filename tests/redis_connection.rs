//! The worker's own single-server Redis connection (`sendquota::resp`), against a real Redis:
//! it must answer every command, pipeline and transaction exactly as redis-rs's own
//! connection does, give each of many concurrent requests its own reply, and survive a killed
//! link, a restarted server and a server that stops answering.

mod support;

use std::time::Duration;

use redis::aio::ConnectionLike;
use redis::AsyncCommands;
use sendquota::resp::Connection;
use support::private::PrivateRedis;
use support::{unique, START_HINT};

const TIMEOUT: Duration = Duration::from_secs(5);

async fn lean(url: &str) -> Connection {
    Connection::connect(url, TIMEOUT)
        .await
        .unwrap_or_else(|e| panic!("redis not reachable at {url}: {e}; {START_HINT}"))
}

async fn reference(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .expect("redis url")
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| panic!("redis not reachable at {url}: {e}; {START_HINT}"))
}

async fn delete(conn: &mut impl ConnectionLike, keys: &[&str]) {
    let _: i64 = redis::cmd("DEL")
        .arg(keys)
        .query_async(conn)
        .await
        .expect("DEL");
}

async fn client_id(conn: &mut impl ConnectionLike) -> i64 {
    redis::cmd("CLIENT")
        .arg("ID")
        .query_async(conn)
        .await
        .expect("CLIENT ID")
}

/// Retries `attempt` every 20 ms until it succeeds or `within` has passed.
async fn eventually<T, F, Fut>(within: Duration, mut attempt: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = redis::RedisResult<T>>,
{
    let began = std::time::Instant::now();
    loop {
        match attempt().await {
            Ok(v) => return v,
            Err(_) if began.elapsed() < within => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("still failing after {within:?}: {e}"),
        }
    }
}

#[tokio::test]
async fn commands_pipelines_and_transactions_answer_as_redis_rs_answers_them() {
    let url = support::redis_url();
    let (mut ours, mut theirs) = (lean(&url).await, reference(&url).await);
    let p = unique("resp");
    let (a, b, z) = (format!("{p}:a"), format!("{p}:b"), format!("{p}:z"));
    for (conn, label) in [
        (&mut ours as &mut dyn Probe, "ours"),
        (&mut theirs, "redis-rs"),
    ] {
        let got = conn.probe(&a, &b, &z).await;
        assert_eq!(
            got,
            vec![
                "set:()".to_owned(),
                "get:Some(\"v\")".into(),
                "missing:None".into(),
                "incr:[1, 2, 3]".into(),
                "pipeline:(\"v\", 3, [\"m1\", \"m2\"])".into(),
                "transaction:(4, 5)".into(),
                "wrongtype:WRONGTYPE".into(),
                "refused transaction:Server(ExecAbort)".into(),
                "empty pipeline:Client".into(),
                "after errors:\"v\"".into(),
            ],
            "{label}"
        );
    }
    delete(&mut ours, &[&a, &b, &z]).await;
}

/// The same sequence of commands on either connection, each outcome as text.
trait Probe {
    fn probe<'a>(
        &'a mut self,
        a: &'a str,
        b: &'a str,
        z: &'a str,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Vec<String>> + 'a>>;
}

impl<C: ConnectionLike + Send> Probe for C {
    fn probe<'a>(
        &'a mut self,
        a: &'a str,
        b: &'a str,
        z: &'a str,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Vec<String>> + 'a>> {
        Box::pin(async move {
            let conn = self;
            delete(conn, &[a, b, z]).await;
            let mut out = Vec::new();
            let set: () = redis::cmd("SET")
                .arg(a)
                .arg("v")
                .query_async(conn)
                .await
                .expect("SET");
            out.push(format!("set:{set:?}"));
            let get: Option<String> = redis::cmd("GET")
                .arg(a)
                .query_async(conn)
                .await
                .expect("GET");
            out.push(format!("get:{get:?}"));
            let missing: Option<String> = redis::cmd("GET")
                .arg(b)
                .query_async(conn)
                .await
                .expect("GET");
            out.push(format!("missing:{missing:?}"));
            let mut incrs = Vec::new();
            for _ in 0..3 {
                let n: i64 = redis::cmd("INCR")
                    .arg(b)
                    .query_async(conn)
                    .await
                    .expect("INCR");
                incrs.push(n);
            }
            out.push(format!("incr:{incrs:?}"));
            let got: (String, i64, Vec<String>) = redis::pipe()
                .cmd("GET")
                .arg(a)
                .cmd("ZADD")
                .arg(z)
                .arg(1)
                .arg("m1")
                .ignore()
                .cmd("ZADD")
                .arg(z)
                .arg(2)
                .arg("m2")
                .ignore()
                .cmd("GET")
                .arg(b)
                .cmd("ZRANGE")
                .arg(z)
                .arg(0)
                .arg(-1)
                .query_async(conn)
                .await
                .expect("pipeline");
            out.push(format!("pipeline:{got:?}"));
            let tx: (i64, i64) = redis::pipe()
                .atomic()
                .cmd("INCR")
                .arg(b)
                .cmd("INCR")
                .arg(b)
                .query_async(conn)
                .await
                .expect("transaction");
            out.push(format!("transaction:{tx:?}"));
            let wrong: redis::RedisResult<i64> = redis::cmd("INCR").arg(z).query_async(conn).await;
            out.push(format!(
                "wrongtype:{}",
                wrong
                    .expect_err("INCR of a sorted set")
                    .code()
                    .unwrap_or("?")
            ));
            // A command the server refuses to queue (wrong arity) aborts the transaction.
            let refused: redis::RedisResult<(i64, i64)> = redis::pipe()
                .atomic()
                .cmd("INCR")
                .arg(b)
                .cmd("INCR")
                .query_async(conn)
                .await;
            out.push(format!(
                "refused transaction:{:?}",
                refused.expect_err("EXECABORT").kind()
            ));
            let empty: redis::RedisResult<Vec<String>> = redis::pipe().query_async(conn).await;
            out.push(format!(
                "empty pipeline:{:?}",
                empty.expect_err("nothing to send").kind()
            ));
            let after: String = redis::cmd("GET")
                .arg(a)
                .query_async(conn)
                .await
                .expect("GET");
            out.push(format!("after errors:{after:?}"));
            out
        })
    }
}

#[tokio::test]
async fn thousands_of_concurrent_requests_each_get_their_own_reply() {
    let url = support::redis_url();
    let conn = lean(&url).await;
    let p = unique("resp-many");
    let tasks: Vec<_> = (0..2000)
        .map(|i| {
            let (mut conn, key) = (conn.clone(), format!("{p}:{i}"));
            tokio::spawn(async move {
                let () = redis::cmd("SET")
                    .arg(&key)
                    .arg(i)
                    .arg("EX")
                    .arg(60)
                    .query_async(&mut conn)
                    .await
                    .expect("SET");
                let (got, len): (i64, i64) = redis::pipe()
                    .cmd("GET")
                    .arg(&key)
                    .cmd("STRLEN")
                    .arg(&key)
                    .query_async(&mut conn)
                    .await
                    .expect("pipeline");
                (i, got, len)
            })
        })
        .collect();
    for task in tasks {
        let (i, got, len) = task.await.expect("task");
        assert_eq!(got, i);
        assert_eq!(len, i.to_string().len() as i64);
    }
    let mut conn = conn;
    let keys: Vec<String> = conn.keys(format!("{p}:*")).await.expect("KEYS");
    assert_eq!(keys.len(), 2000);
    let _: i64 = conn.del(keys).await.expect("DEL");
}

#[tokio::test]
async fn a_killed_link_fails_its_requests_then_reconnects_by_itself() {
    let url = support::redis_url();
    let mut conn = lean(&url).await;
    let mut admin = reference(&url).await;
    let id = client_id(&mut conn).await;
    let killed: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("ID")
        .arg(id)
        .query_async(&mut admin)
        .await
        .expect("CLIENT KILL");
    assert_eq!(killed, 1);
    // The next requests may fail while the link is down; none may hang or get another's reply.
    let new_id: i64 = eventually(Duration::from_secs(5), || {
        let mut c = conn.clone();
        async move { redis::cmd("CLIENT").arg("ID").query_async(&mut c).await }
    })
    .await;
    assert_ne!(new_id, id, "a new link");
    let pong: String = redis::cmd("PING")
        .query_async(&mut conn)
        .await
        .expect("PING");
    assert_eq!(pong, "PONG");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_server_is_reached_again_and_forgotten_scripts_are_loaded_again() {
    let redis = tokio::task::spawn_blocking(PrivateRedis::start)
        .await
        .expect("private redis");
    let mut conn = lean(&redis.url()).await;
    let script = redis::Script::new("return tonumber(ARGV[1]) + 1");
    let two: i64 = script.arg(1).invoke_async(&mut conn).await.expect("script");
    assert_eq!(two, 2);
    tokio::task::block_in_place(|| redis.restart());
    let fresh = reference(&redis.url()).await;
    // A restarted server answers LOADING until it has read its data back.
    let known: Vec<bool> = eventually(Duration::from_secs(10), || {
        let mut fresh = fresh.clone();
        let hash = script.get_hash().to_owned();
        async move {
            redis::cmd("SCRIPT")
                .arg("EXISTS")
                .arg(hash)
                .query_async(&mut fresh)
                .await
        }
    })
    .await;
    assert_eq!(known, [false], "the restarted server forgot the script");
    let three: i64 = eventually(Duration::from_secs(10), || {
        let (mut c, s) = (conn.clone(), script.clone());
        async move { s.arg(2).invoke_async(&mut c).await }
    })
    .await;
    assert_eq!(
        three, 3,
        "NOSCRIPT on the new server loads the script again"
    );
}

#[tokio::test]
async fn a_server_that_stops_answering_fails_the_waiting_request_after_the_timeout() {
    // A peer that accepts the link and never answers: what a hung server looks like.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let held = tokio::spawn(async move {
        let mut links = Vec::new();
        loop {
            match listener.accept().await {
                Ok((s, _)) => links.push(s),
                Err(_) => return,
            }
        }
    });
    let timeout = Duration::from_millis(300);
    let mut conn = Connection::connect(&format!("redis://{addr}"), timeout)
        .await
        .expect("the link opens");
    let began = std::time::Instant::now();
    let reply: redis::RedisResult<String> = redis::cmd("PING").query_async(&mut conn).await;
    let waited = began.elapsed();
    let err = reply.expect_err("no answer");
    assert!(err.is_io_error(), "{err}");
    assert!(err.to_string().contains("no reply within 300 ms"), "{err}");
    assert!(
        waited >= timeout && waited < timeout * 3,
        "failed after {waited:?}"
    );
    held.abort();
}

#[tokio::test]
async fn the_url_selects_the_database_and_a_refused_login_fails_the_connect() {
    let url = support::redis_url();
    let base = url.trim_end_matches('/').to_owned();
    let base = match base.rsplit_once('/') {
        Some((head, db)) if db.parse::<u32>().is_ok() => head.to_owned(),
        _ => base,
    };
    let mut on_db3 = lean(&format!("{base}/3")).await;
    assert_eq!(on_db3.get_db(), 3);
    let key = unique("resp-db");
    let _: () = on_db3.set_ex(&key, "three", 60).await.expect("SET on db 3");
    let mut reference_db3 = reference(&format!("{base}/3")).await;
    let got: Option<String> = reference_db3.get(&key).await.expect("GET");
    assert_eq!(got.as_deref(), Some("three"));
    let mut reference_db0 = reference(&format!("{base}/0")).await;
    let absent: Option<String> = reference_db0.get(&key).await.expect("GET");
    assert_eq!(absent, None);
    let _: i64 = on_db3.del(&key).await.expect("DEL");

    let with_password = base.replacen("redis://", "redis://:not-the-password@", 1);
    let refused = Connection::connect(&with_password, TIMEOUT).await;
    let err = refused.err().expect("AUTH refused");
    assert!(err.to_string().contains("AUTH"), "{err}");
}

#[tokio::test]
async fn dropping_the_last_clone_closes_the_link() {
    let url = support::redis_url();
    let mut conn = lean(&url).await;
    let mut admin = reference(&url).await;
    let id = client_id(&mut conn).await;
    let clone = conn.clone();
    drop(conn);
    let listed = |admin: &mut redis::aio::MultiplexedConnection| {
        let mut admin = admin.clone();
        async move {
            let list: String = redis::cmd("CLIENT")
                .arg("LIST")
                .arg("ID")
                .arg(id)
                .query_async(&mut admin)
                .await
                .expect("CLIENT LIST");
            !list.trim().is_empty()
        }
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(listed(&mut admin).await, "a clone still holds the link");
    drop(clone);
    let began = std::time::Instant::now();
    while listed(&mut admin).await {
        assert!(
            began.elapsed() < Duration::from_secs(5),
            "link {id} still open"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
