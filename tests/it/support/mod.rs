//! Test harness: every test gets its own namespace (Redis keys, exchanges, queues) and its own
//! Postgres database, talks to the real services, and removes everything it made when it ends,
//! even when it fails. A service that does not answer fails the test with the command that
//! starts it.

pub mod browser;
pub mod http;
pub mod model;
pub mod private;
pub mod process;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, TimeZone, Utc};
use lapin::options::{
    BasicGetOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection};
use redis::AsyncCommands;
use sendquota::clock::ManualClock;
use sendquota::config::{
    RedisSettings, Settings, DEFAULT_AMQP_URL, DEFAULT_DATABASE_URL, DEFAULT_REDIS_URL,
};
use sendquota::internals::broker::{self, Names, Publisher, DELAY_TIERS_MS};
use sendquota::internals::denials::{Denial, DenialFilter, DenialStore};
use sendquota::internals::store::RedisConn;
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;
use tokio::sync::oneshot;

/// How to bring the services up, quoted in every connection failure.
pub const START_HINT: &str = "start them with `deploy/local/services.sh` (the test command \
                              `deploy/local/test.sh` does this itself)";

/// The admin token [`TestEnv::start_admin_worker`] accepts.
pub const ADMIN_TOKEN: &str = "test-token-0123456789abcdef";

/// The name of [`ADMIN_TOKEN`]: what audit rows record.
pub const ADMIN_TOKEN_NAME: &str = "ops-alice";

/// Why a test that arms a failpoint cannot run in this build.
pub const NEEDS_FAILPOINTS: &str =
    "this test arms a failpoint: build with --features failpoints (deploy/local/test.sh does)";

/// Longest wait for a message's outcome.
pub const OUTCOME_TIMEOUT: Duration = Duration::from_secs(15);

pub fn redis_url() -> String {
    std::env::var("SENDQUOTA_REDIS_URL").unwrap_or_else(|_| DEFAULT_REDIS_URL.to_owned())
}
pub fn amqp_url() -> String {
    std::env::var("SENDQUOTA_AMQP_URL").unwrap_or_else(|_| DEFAULT_AMQP_URL.to_owned())
}
/// The URL of database `name` on the shared server.
pub fn database_url(name: &str) -> String {
    let url =
        std::env::var("SENDQUOTA_DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.to_owned());
    let base = url.split('?').next().unwrap_or(&url);
    match base.rfind('/') {
        Some(slash) => format!("{}/{name}", &base[..slash]),
        None => base.to_owned(),
    }
}

/// The shared server's maintenance database, where test databases are created.
pub fn admin_database_url() -> String {
    database_url("postgres")
}

/// A proptest runner for `cases` cases that writes no regression files and gives up shrinking
/// a failure after 30 s or 256 steps. These properties call the real services at every step:
/// with proptest's unbounded shrink time, one failure (a service that stopped answering, say)
/// shrank for longer than CI's whole budget instead of being reported.
pub fn property_runner(cases: u32) -> proptest::test_runner::TestRunner {
    proptest::test_runner::TestRunner::new(proptest::test_runner::Config {
        cases,
        failure_persistence: None,
        max_shrink_time: 30_000,
        max_shrink_iters: 256,
        ..proptest::test_runner::Config::default()
    })
}

/// A name no other test (in this or another process) uses.
pub fn unique(prefix: &str) -> String {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let n = COUNTER.fetch_add(1, Ordering::SeqCst);
    let nanos = Utc::now().timestamp_subsec_nanos();
    format!("{prefix}_{}_{n}_{nanos}", std::process::id())
}

/// A file in the temp directory (a config or a batch of requests), removed on drop.
pub struct TempFile(std::path::PathBuf);

impl TempFile {
    pub fn new(text: &str) -> TempFile {
        let path = std::env::temp_dir().join(format!("{}.toml", unique("sqtmp")));
        std::fs::write(&path, text).expect("write temp file");
        TempFile(path)
    }

    pub fn path(&self) -> &str {
        self.0.to_str().expect("utf-8 path")
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// One test's private world on the shared services.
pub struct TestEnv {
    pub namespace: String,
    pub database_url: String,
    pub settings: Settings,
    pub names: Names,
    pub redis: RedisConn,
    pub pool: PgPool,
    /// The tests' own connection, through lapin: an AMQP client independent of the worker's.
    pub amqp: Connection,
    pub channel: Channel,
    /// A publishing connection opened as the worker opens its own, for its [`Publisher`].
    pub broker: Connection,
    pub publisher: Publisher,
    /// A queue bound to the dispatch exchange with `#`: every dispatched message lands here.
    pub dispatched_queue: String,
    worker_stop: Option<oneshot::Sender<()>>,
    worker_task: Option<tokio::task::JoinHandle<()>>,
    /// Declared last so it drops last: removes the namespace's queues, keys and database.
    cleanup: Cleanup,
}

/// Removes everything a test made on the shared services when dropped, even while panicking.
pub struct Cleanup {
    namespace: String,
    database: String,
    cluster: bool,
    /// The sink queues [`TestEnv::sink`] declared: queues the worker's topology does not name.
    sinks: std::sync::Mutex<Vec<String>>,
}

impl TestEnv {
    /// A fresh environment with the default (headline) policy.
    pub async fn new() -> TestEnv {
        TestEnv::with_config("").await
    }

    /// A fresh environment whose settings come from `toml` (connections and namespace are
    /// always the test's own).
    pub async fn with_config(toml: &str) -> TestEnv {
        TestEnv::with_queue_type(toml, sendquota::config::QueueType::Classic).await
    }

    /// Like [`TestEnv::with_config`], with the given type for the requests and invalid queues
    /// (tests use classic queues; the benchmark measures the production default, quorum).
    pub async fn with_queue_type(toml: &str, queue_type: sendquota::config::QueueType) -> TestEnv {
        TestEnv::build(toml, queue_type, false).await
    }

    /// A fresh environment whose worker and limiter use the test Redis Cluster.
    pub async fn on_cluster(toml: &str) -> TestEnv {
        TestEnv::build(toml, sendquota::config::QueueType::Classic, true).await
    }

    async fn build(toml: &str, queue_type: sendquota::config::QueueType, cluster: bool) -> TestEnv {
        let cluster_urls = if cluster {
            cluster_urls().join(",")
        } else {
            String::new()
        };
        let namespace = unique("sqt");
        let database = namespace.to_lowercase();
        let guard = Cleanup {
            namespace: namespace.clone(),
            database: database.clone(),
            cluster,
            sinks: std::sync::Mutex::new(Vec::new()),
        };
        let admin = PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(Duration::from_secs(5))
            .connect(&admin_database_url())
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "postgres not reachable at {}: {e}; {START_HINT}",
                    admin_database_url()
                )
            });
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE DATABASE \"{database}\""
        )))
        .execute(&admin)
        .await
        .expect("create test database");
        admin.close().await;
        let database_url = database_url(&database);
        let env = |k: &str| match k {
            "SENDQUOTA_NAMESPACE" => Some(namespace.clone()),
            "SENDQUOTA_REDIS_URL" => Some(redis_url()),
            "SENDQUOTA_AMQP_URL" => Some(amqp_url()),
            "SENDQUOTA_DATABASE_URL" => Some(database_url.clone()),
            "SENDQUOTA_REDIS_CLUSTER_URLS" if cluster => Some(cluster_urls.clone()),
            _ => None,
        };
        let mut settings = Settings::from_toml(toml, env).expect("test config is valid");
        settings.amqp.queue_type = queue_type;
        settings.worker.retry_initial_ms = 20;
        settings.worker.retry_max_ms = 500;
        settings.worker.shutdown_timeout_ms = 2_000;
        // Tests that use the admin API pick a free port themselves.
        settings.admin.listen = String::new();
        let redis = RedisConn::connect(&settings.redis)
            .await
            .unwrap_or_else(|e| {
                panic!("redis not reachable at {}: {e}; {START_HINT}", redis_url())
            });
        let store = DenialStore::connect(&settings.database)
            .await
            .expect("connect test database");
        store.migrate().await.expect("migrate test database");
        let pool = PgPoolOptions::new()
            .max_connections(2)
            .connect(&database_url)
            .await
            .expect("connect test database");
        let unreachable = |e: &dyn std::fmt::Display| -> ! {
            panic!(
                "rabbitmq not reachable at {}: {e}; {START_HINT}",
                amqp_url()
            )
        };
        let amqp = lapin_connect("sendquota-test")
            .await
            .unwrap_or_else(|e| unreachable(&e));
        let channel = amqp.create_channel().await.expect("amqp channel");
        let broker = broker::connect(&settings.amqp, "sendquota-test")
            .await
            .unwrap_or_else(|e| unreachable(&e));
        let publisher = Publisher::open(&broker).await.expect("amqp publisher");
        let names = Names::new(&namespace);
        broker::declare(&publisher.channel(), &names, settings.amqp.queue_type)
            .await
            .expect("declare topology");
        let dispatched_queue = format!("{namespace}.test.dispatched");
        declare_sink(&channel, &dispatched_queue, &names.dispatch).await;
        guard.owns_sink(&dispatched_queue);
        TestEnv {
            namespace,
            database_url,
            settings,
            names,
            redis,
            pool,
            amqp,
            channel,
            broker,
            publisher,
            dispatched_queue,
            worker_stop: None,
            worker_task: None,
            cleanup: guard,
        }
    }

    /// Declares `<namespace>.test.<name>`, bound to `exchange` with `#`, and deletes it with the
    /// rest of the namespace: a queue for what the test reads besides the dispatched messages.
    pub async fn sink(&self, name: &str, exchange: &str) -> String {
        let queue = format!("{}.test.{name}", self.namespace);
        declare_sink(&self.channel, &queue, exchange).await;
        self.cleanup.owns_sink(&queue);
        queue
    }

    /// Starts the worker in this process with `clock`.
    pub fn start_worker(&mut self, clock: &ManualClock) {
        self.start_worker_with(clock, None);
    }

    /// Starts the worker with a failpoint armed.
    pub fn start_worker_with(
        &mut self,
        clock: &ManualClock,
        failpoint: Option<sendquota::failpoint::Failpoint>,
    ) {
        assert!(
            failpoint.is_none() || sendquota::failpoint::enabled(),
            "{NEEDS_FAILPOINTS}"
        );
        let (stop, stopped) = oneshot::channel::<()>();
        let settings = self.settings.clone();
        let clock = Arc::new(clock.clone());
        self.worker_task = Some(tokio::spawn(async move {
            sendquota::startup::run(&settings, clock, failpoint, async {
                let _ = stopped.await;
            })
            .await
            .expect("worker runs");
        }));
        self.worker_stop = Some(stop);
    }

    /// Starts the worker with `clock` and its admin API on a free port, accepting
    /// [`ADMIN_TOKEN`] (named [`ADMIN_TOKEN_NAME`]); returns the port once the API is ready.
    pub async fn start_admin_worker(&mut self, clock: &ManualClock) -> u16 {
        let port = private::free_port();
        self.settings.admin.listen = format!("127.0.0.1:{port}");
        self.settings.admin.tokens = vec![sendquota::config::AdminToken {
            name: ADMIN_TOKEN_NAME.to_owned(),
            token: ADMIN_TOKEN.to_owned(),
        }];
        self.start_worker(clock);
        http::wait_until_ready(port).await;
        port
    }

    /// Stops the in-process worker and waits for it to drain.
    pub async fn stop_worker(&mut self) {
        if let Some(stop) = self.worker_stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.worker_task.take() {
            tokio::time::timeout(Duration::from_secs(10), task)
                .await
                .expect("worker stops within 10 s")
                .expect("worker task ends cleanly");
        }
    }

    /// Makes Postgres refuse every denial row of `recipient` for its data (SQLSTATE 22023,
    /// "<recipient> refuses", through [`refuse_denials_of`]): a denied message to `recipient`
    /// is poison and goes to the quarantine queue. [`TestEnv::accept_denials_to`] undoes it.
    pub async fn refuse_denials_to(&self, recipient: &str) {
        refuse_denials_of(
            &self.pool,
            recipient,
            "22023",
            &format!("{recipient} refuses"),
        )
        .await;
    }

    /// Starts the worker (at 2026-02-02 09:00 UTC) with the denials of recipient `picky`
    /// refused ([`TestEnv::refuse_denials_to`]) and picky's day used by message `p1`, which it
    /// waits for: the next message to picky is denied, its row refused, and it is quarantined.
    /// Returns the worker's clock and the ids dispatched so far.
    pub async fn start_worker_quarantining_picky(
        &mut self,
    ) -> (ManualClock, HashMap<String, usize>) {
        self.refuse_denials_to("picky").await;
        let clock = ManualClock::new(local("UTC", "2026-02-02 09:00"));
        self.start_worker(&clock);
        let mut seen = HashMap::new();
        self.publish(&request("p1", "picky", "UTC")).await;
        assert!(self.outcome("p1", &mut seen).await, "p1 uses picky's day");
        (clock, seen)
    }

    /// Undoes [`TestEnv::refuse_denials_to`] (and [`refuse_denials_of`]): the cause of the
    /// quarantine is fixed.
    pub async fn accept_denials(&self) {
        sqlx::raw_sql("DROP TRIGGER refuse_rows ON denials")
            .execute(&self.pool)
            .await
            .expect("drop the refusing trigger");
    }

    /// Unbinds the test's own dispatched queue from the dispatch exchange: no queue receives
    /// a dispatch, as before any sender ran.
    pub async fn unbind_dispatched(&self) {
        self.channel
            .queue_unbind(
                self.dispatched_queue.as_str().into(),
                self.names.dispatch.as_str().into(),
                "#".into(),
                FieldTable::default(),
            )
            .await
            .expect("unbind the sender queue");
    }

    /// Binds the test's own dispatched queue to the dispatch exchange with `routing_key`, as a
    /// sender would.
    pub async fn bind_dispatched(&self, routing_key: &str) {
        self.channel
            .queue_bind(
                self.dispatched_queue.as_str().into(),
                self.names.dispatch.as_str().into(),
                routing_key.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("bind the sender queue");
    }

    /// The message ids in the quarantine queue, oldest first, left there (as `sendquota
    /// quarantine list` shows them).
    pub async fn quarantined(&self) -> Vec<Option<String>> {
        let listed = sendquota::internals::quarantine::list_held(
            &self.settings.amqp,
            &self.names,
            "sendquota-test",
            1_000,
        )
        .await
        .expect("list the quarantine");
        listed.into_iter().map(|q| q.message_id).collect()
    }

    /// Messages ready (not counting deliveries in progress) in `queue`.
    pub async fn ready(&self, queue: &str) -> u32 {
        let passive = lapin::options::QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        self.channel
            .queue_declare(queue.into(), passive, lapin::types::FieldTable::default())
            .await
            .expect("passive declare")
            .message_count()
    }

    /// The worker binary with this environment's services and namespace (a clean environment
    /// otherwise, see [`process::sendquota`]); the caller adds the arguments.
    pub fn worker_command(&self) -> std::process::Command {
        self.worker_command_at(env!("CARGO_BIN_EXE_sendquota"))
    }

    /// [`TestEnv::worker_command`] with the binary at `bin` (see [`process::sendquota_at`]).
    pub fn worker_command_at(&self, bin: impl AsRef<std::ffi::OsStr>) -> std::process::Command {
        let mut cmd = process::sendquota_at(bin);
        cmd.env("SENDQUOTA_NAMESPACE", &self.namespace)
            .env("SENDQUOTA_REDIS_URL", redis_url())
            .env("SENDQUOTA_AMQP_URL", amqp_url())
            .env("SENDQUOTA_DATABASE_URL", &self.database_url);
        cmd
    }

    /// A `sendquota` command line (`args`) for this environment, as an operator runs one: its
    /// services and namespace, and a configuration file naming the queue type its queues were
    /// declared with (a declaration of another type would be refused). The file is removed with
    /// the environment.
    pub fn cli(&self, args: &[&str]) -> std::process::Command {
        self.cli_with("", args)
    }

    /// [`TestEnv::cli`] with `config` (rules, say) added to the configuration file.
    pub fn cli_with(&self, config: &str, args: &[&str]) -> std::process::Command {
        let queue_type = match self.settings.amqp.queue_type {
            sendquota::config::QueueType::Classic => "classic",
            sendquota::config::QueueType::Quorum => "quorum",
        };
        let path = cli_config_path(&self.namespace);
        std::fs::write(
            &path,
            format!("[amqp]\nqueue_type = \"{queue_type}\"\n{config}"),
        )
        .expect("write the command's configuration");
        let mut cmd = self.worker_command();
        cmd.arg("--config").arg(&path).args(args);
        cmd
    }

    /// What `sendquota check --at <at>` prints for `message` under the rules of `config`
    /// (without committing), which must succeed.
    pub fn check(&self, config: &str, at: &str, message: &serde_json::Value) -> serde_json::Value {
        let out = self
            .cli_with(
                config,
                &["check", "--at", at, "--message", &message.to_string()],
            )
            .output()
            .expect("run check");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("check prints JSON")
    }

    /// Publishes a raw body to the requests exchange, as a producer would.
    pub async fn publish_raw(&self, body: &[u8]) {
        self.publisher
            .publish(&self.names.requests, "", body, BasicProperties::default())
            .await
            .expect("publish request");
    }

    /// Publishes a JSON request.
    pub async fn publish(&self, request: &serde_json::Value) {
        self.publish_raw(request.to_string().as_bytes()).await;
    }

    /// Publishes `n` headline requests `m0`, `m1`, ... two per recipient (`user-0`, `user-0`,
    /// `user-1`, ...): under the headline rule on one day, half are dispatched, half denied.
    pub async fn publish_two_per_recipient(&self, n: usize) {
        for i in 0..n {
            self.publish(&request(
                &format!("m{i}"),
                &format!("user-{}", i / 2),
                "UTC",
            ))
            .await;
        }
    }

    /// Publishes one message of each kind an operator watches and waits until each has its
    /// outcome: `allowed` (alice's first today under the headline rule), `denied` (her second)
    /// and a body that is not a request, with message id `invalid`.
    pub async fn publish_allowed_denied_invalid(&self) {
        let mut seen = HashMap::new();
        self.publish(&request("allowed", "alice", "UTC")).await;
        assert!(
            self.outcome("allowed", &mut seen).await,
            "allowed is dispatched"
        );
        self.publish(&request("denied", "alice", "UTC")).await;
        assert!(!self.outcome("denied", &mut seen).await, "denied is denied");
        let properties = BasicProperties::default().with_message_id("invalid".into());
        self.publisher
            .publish(&self.names.requests, "", b"not json", properties)
            .await
            .expect("publish request");
        let deadline = Instant::now() + OUTCOME_TIMEOUT;
        while self.drain(&self.names.invalid).await.is_empty() {
            assert!(Instant::now() < deadline, "the invalid body was routed");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Takes every message waiting in `queue`.
    pub async fn drain(&self, queue: &str) -> Vec<lapin::message::BasicGetMessage> {
        drain(&self.channel, queue).await
    }

    /// Ids of the messages dispatched since the last call.
    pub async fn take_dispatched(&self) -> Vec<String> {
        self.drain(&self.dispatched_queue)
            .await
            .iter()
            .map(|m| {
                let v: serde_json::Value =
                    serde_json::from_slice(&m.delivery.data).expect("dispatched body is JSON");
                v["id"]
                    .as_str()
                    .expect("dispatched body has an id")
                    .to_owned()
            })
            .collect()
    }

    /// Every denial row, oldest first.
    pub async fn denials(&self) -> Vec<Denial> {
        let store = DenialStore::from_pool(self.pool.clone());
        let mut rows = store
            .list(&DenialFilter {
                limit: 10_000,
                ..DenialFilter::default()
            })
            .await
            .expect("list denials");
        rows.reverse();
        rows
    }

    /// Number of denial rows in the whole history.
    pub async fn denial_rows(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM denials")
            .fetch_one(&self.pool)
            .await
            .expect("count denials")
    }

    /// Number of denial rows for one message id.
    pub async fn denial_count(&self, message_id: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM denials WHERE message_id = $1")
            .bind(message_id)
            .fetch_one(&self.pool)
            .await
            .expect("count denials")
    }

    /// Waits until every copy of the messages published so far has been decided: nothing
    /// waits in the requests queue or in the shortest delay queue (where a copy that found
    /// another in flight waits its turn) for longer than a copy's trip through that queue.
    pub async fn copies_decided(&self) {
        let delay = self.names.delay_queue(DELAY_TIERS_MS[0]);
        let deadline = Instant::now() + OUTCOME_TIMEOUT;
        let mut idle_since = Instant::now();
        while idle_since.elapsed() < Duration::from_millis(2_500) {
            assert!(Instant::now() < deadline, "the copies were all decided");
            if self.ready(&self.names.requests).await + self.ready(&delay).await > 0 {
                idle_since = Instant::now();
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until message `id` has an outcome: dispatched (returns true) or denied (false).
    /// Dispatched ids seen meanwhile are kept in `seen`.
    pub async fn outcome(&self, id: &str, seen: &mut HashMap<String, usize>) -> bool {
        let deadline = Instant::now() + OUTCOME_TIMEOUT;
        loop {
            for d in self.take_dispatched().await {
                *seen.entry(d).or_default() += 1;
            }
            if seen.contains_key(id) {
                return true;
            }
            if self.denial_count(id).await > 0 {
                return false;
            }
            assert!(
                Instant::now() < deadline,
                "no outcome for message {id} within {OUTCOME_TIMEOUT:?}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Waits until message `id` is dispatched, whatever rows it leaves (a shadow rule records
    /// its row before the dispatch). Dispatched ids seen meanwhile are kept in `seen`.
    pub async fn dispatched(&self, id: &str, seen: &mut HashMap<String, usize>) {
        let deadline = Instant::now() + OUTCOME_TIMEOUT;
        while !seen.contains_key(id) {
            for d in self.take_dispatched().await {
                *seen.entry(d).or_default() += 1;
            }
            assert!(
                Instant::now() < deadline,
                "message {id} not dispatched within {OUTCOME_TIMEOUT:?}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Every Redis key of this test's namespace (on every master of a cluster).
    pub async fn keys(&self) -> Vec<String> {
        all_keys(&self.redis, &format!("{}:*", self.namespace))
            .await
            .expect("scan keys")
    }

    /// Keys of this namespace that have no expiry: a test fails on any.
    pub async fn keys_without_expiry(&self) -> Vec<String> {
        let mut out = Vec::new();
        let mut conn = self.redis.clone();
        for key in self.keys().await {
            let ttl: i64 = redis::cmd("PTTL")
                .arg(&key)
                .query_async(&mut conn)
                .await
                .expect("pttl");
            if ttl == -1 {
                out.push(key);
            }
        }
        out
    }
}

impl Drop for TestEnv {
    fn drop(&mut self) {
        if let Some(stop) = self.worker_stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.worker_task.take() {
            task.abort();
        }
    }
}

/// Where [`TestEnv::cli`] writes the configuration of `namespace`'s commands.
fn cli_config_path(namespace: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("{namespace}.toml"))
}

impl Cleanup {
    /// `queue` is deleted with the namespace.
    fn owns_sink(&self, queue: &str) {
        let mut sinks = self.sinks.lock().unwrap_or_else(|e| e.into_inner());
        sinks.push(queue.to_owned());
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(cli_config_path(&self.namespace));
        let namespace = self.namespace.clone();
        let database = self.database.clone();
        let names = Names::new(&namespace);
        let sinks = std::mem::take(self.sinks.get_mut().unwrap_or_else(|e| e.into_inner()));
        let cluster = self.cluster;
        // Cleanup needs async I/O but Drop is sync (and may run while panicking): do it on a
        // thread with its own runtime and wait for it.
        let cleanup = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("cleanup runtime");
            rt.block_on(cleanup(namespace, database, names, sinks, cluster));
        });
        let _ = cleanup.join();
    }
}

async fn cleanup(
    namespace: String,
    database: String,
    names: Names,
    sinks: Vec<String>,
    cluster: bool,
) {
    if let Ok(conn) = lapin_connect("sendquota-test-cleanup").await {
        if let Ok(ch) = conn.create_channel().await {
            let mut queues = vec![
                names.requests.clone(),
                names.invalid.clone(),
                names.quarantine.clone(),
            ];
            queues.extend(sinks);
            queues.extend(DELAY_TIERS_MS.iter().map(|t| names.delay_queue(*t)));
            for q in queues {
                let _ = ch
                    .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                    .await;
            }
            for x in [&names.requests, &names.dispatch] {
                let _ = ch
                    .exchange_delete(x.as_str().into(), ExchangeDeleteOptions::default())
                    .await;
            }
        }
        let _ = conn.close(200, "cleanup".into()).await;
    }
    let settings = if cluster {
        cluster_settings()
    } else {
        single_settings()
    };
    if let Ok(mut conn) = RedisConn::connect(&settings).await {
        delete_keys(&mut conn, &format!("{namespace}:*")).await;
    }
    if let Ok(admin) = PgPoolOptions::new()
        .max_connections(1)
        .connect(&admin_database_url())
        .await
    {
        let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS \"{database}\" WITH (FORCE)"
        )))
        .execute(&admin)
        .await;
        admin.close().await;
    }
}

/// Makes Postgres refuse every denial row of a recipient matching `recipients` (a `LIKE`
/// pattern) with SQLSTATE `sqlstate` (class 22, a data error) and `message`, as it refuses data
/// it cannot hold: how tests and the trust bench make a message whose denial cannot be
/// recorded, which the worker quarantines. The worker refuses up front every payload the
/// denial history could not store, so no request body does it. `DROP TRIGGER refuse_rows ON
/// denials` fixes the cause.
pub async fn refuse_denials_of(pool: &PgPool, recipients: &str, sqlstate: &str, message: &str) {
    let quote = |s: &str| s.replace('\'', "''");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE FUNCTION refuse_rows() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
         IF NEW.recipient LIKE '{}' THEN RAISE EXCEPTION '{}' USING ERRCODE = '{}'; \
         END IF; RETURN NEW; END $$; \
         CREATE TRIGGER refuse_rows BEFORE INSERT ON denials FOR EACH ROW \
         EXECUTE FUNCTION refuse_rows();",
        quote(recipients),
        quote(message),
        quote(sqlstate)
    )))
    .execute(pool)
    .await
    .expect("the refusing trigger");
}

/// Every message waiting in `queue` on `channel`, taken off it (on any broker).
pub async fn drain(channel: &Channel, queue: &str) -> Vec<lapin::message::BasicGetMessage> {
    let mut out = Vec::new();
    let get = BasicGetOptions { no_ack: true };
    while let Some(m) = channel
        .basic_get(queue.into(), get)
        .await
        .expect("basic_get")
    {
        out.push(m);
    }
    out
}

/// Declares `queue` (durable) and binds it to `exchange` with `#`: every message published there
/// lands in it, for a test to read.
pub async fn declare_sink(channel: &Channel, queue: &str, exchange: &str) {
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(queue.into(), durable, FieldTable::default())
        .await
        .expect("declare the sink queue");
    channel
        .queue_bind(
            queue.into(),
            exchange.into(),
            "#".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("bind the sink queue");
}

/// A lapin connection to the test broker, named `name`.
pub async fn lapin_connect(name: &str) -> lapin::Result<Connection> {
    let properties = lapin::ConnectionProperties::default().with_connection_name(name.into());
    Connection::connect(&amqp_url(), properties).await
}

/// The earliest instant at which the local wall time in `zone` reads `local`
/// (`YYYY-MM-DD HH:MM` or with seconds).
pub fn local(zone: &str, local: &str) -> DateTime<Utc> {
    let tz: chrono_tz::Tz = zone.parse().expect("zone");
    let fmt = if local.len() > 16 {
        "%Y-%m-%d %H:%M:%S"
    } else {
        "%Y-%m-%d %H:%M"
    };
    let naive = chrono::NaiveDateTime::parse_from_str(local, fmt).expect("local time");
    tz.from_local_datetime(&naive)
        .earliest()
        .unwrap_or_else(|| panic!("{local} does not exist in {zone}"))
        .with_timezone(&Utc)
}

/// A send request for `recipient` with id `id` in `zone`.
pub fn request(id: &str, recipient: &str, zone: &str) -> serde_json::Value {
    serde_json::json!({
        "id": id,
        "recipient": recipient,
        "channel": "sms",
        "timezone": zone,
        "payload": {"template": "t"},
    })
}

/// Settings for the shared single Redis server.
pub fn single_settings() -> RedisSettings {
    RedisSettings {
        url: redis_url(),
        ..RedisSettings::default()
    }
}

/// Seed URLs of the private Redis Cluster the test script starts.
pub fn cluster_urls() -> Vec<String> {
    match std::env::var("SENDQUOTA_TEST_REDIS_CLUSTER_URLS") {
        Ok(urls) if !urls.trim().is_empty() => urls.split(',').map(str::to_owned).collect(),
        _ => panic!(
            "SENDQUOTA_TEST_REDIS_CLUSTER_URLS is not set: run the suite with \
             `deploy/local/test.sh`, which starts a private 3-master Redis Cluster, or start one \
             with `deploy/local/redis-cluster.sh start DIR` and export the URLs it prints"
        ),
    }
}

/// Settings for the test Redis Cluster.
pub fn cluster_settings() -> RedisSettings {
    RedisSettings {
        cluster_urls: cluster_urls(),
        ..RedisSettings::default()
    }
}

/// The Redis deployments limiter tests run against: the single server and the cluster.
pub fn redis_targets() -> Vec<(&'static str, RedisSettings)> {
    vec![
        ("single", single_settings()),
        ("cluster", cluster_settings()),
    ]
}

/// Connects to a target, failing with the way to start it.
pub async fn connect_redis(settings: &RedisSettings) -> RedisConn {
    RedisConn::connect(settings).await.unwrap_or_else(|e| {
        panic!(
            "redis not reachable ({:?} / {:?}): {e}; {START_HINT}",
            settings.url, settings.cluster_urls
        )
    })
}

/// Every member of the sorted set at `key`, lowest score first (quota entries, dispatch marks).
pub async fn zset_members(conn: &mut impl redis::aio::ConnectionLike, key: &str) -> Vec<String> {
    redis::cmd("ZRANGE")
        .arg(key)
        .arg(0)
        .arg(-1)
        .query_async(conn)
        .await
        .expect("zrange")
}

/// Keys matching `pattern`, on every master when `conn` is a cluster (SCAN on a cluster
/// connection would only visit one node).
pub async fn all_keys(conn: &RedisConn, pattern: &str) -> redis::RedisResult<Vec<String>> {
    match conn {
        RedisConn::Single(c) => {
            let mut c = c.clone();
            let mut iter = c.scan_match::<_, String>(pattern).await?;
            let mut keys = Vec::new();
            while let Some(k) = iter.next_item().await {
                keys.push(k?);
            }
            Ok(keys)
        }
        RedisConn::Cluster(c) => {
            use redis::cluster_routing::{
                MultipleNodeRoutingInfo, RoutingInfo, SingleNodeRoutingInfo,
            };
            let mut c = c.connection();
            let all = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
            let redis::Value::Map(nodes) = c.route_command(redis::cmd("DBSIZE"), all).await? else {
                return Ok(Vec::new());
            };
            let mut keys = Vec::new();
            for (addr, _) in nodes {
                let addr: String = redis::from_redis_value(addr)?;
                let Some((host, port)) = addr.rsplit_once(':') else {
                    continue;
                };
                let Ok(port) = port.parse::<u16>() else {
                    continue;
                };
                let mut cursor = 0u64;
                loop {
                    let route = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                        host: host.to_owned(),
                        port,
                    });
                    let mut cmd = redis::cmd("SCAN");
                    cmd.arg(cursor)
                        .arg("MATCH")
                        .arg(pattern)
                        .arg("COUNT")
                        .arg(500);
                    let (next, found): (u64, Vec<String>) =
                        redis::from_redis_value(c.route_command(cmd, route).await?)?;
                    keys.extend(found);
                    cursor = next;
                    if cursor == 0 {
                        break;
                    }
                }
            }
            Ok(keys)
        }
    }
}

/// Deletes every key matching `pattern` (one DEL per key, so cluster slots never mix).
pub async fn delete_keys(conn: &mut RedisConn, pattern: &str) {
    if let Ok(keys) = all_keys(conn, pattern).await {
        for key in keys {
            let _: redis::RedisResult<()> = conn.del(key).await;
        }
    }
}

/// Suffixes that make recipient ids hostile to key building; the numeric prefix keeps every
/// id distinct.
const HOSTILE_SUFFIXES: &[&str] = &[
    "", "{", "}", ":", "%", "%7B", "a}{b:c", " ", "\u{2028}", "é", "中", "😀", "\u{200b}", "\"",
    "\\",
];

/// Message `m-<i>` (sms, no zone) to recipient `<i><suffix>`, with suffixes hostile to key
/// building (braces, colons, percent signs, spaces, emoji): every id distinct.
pub fn first_message_to_hostile_id(i: usize) -> sendquota::internals::message::SendRequest {
    sendquota::internals::message::SendRequest {
        id: format!("m-{i}"),
        recipient: format!("{i}{}", HOSTILE_SUFFIXES[i % HOSTILE_SUFFIXES.len()]),
        channel: "sms".to_owned(),
        category: "default".to_owned(),
        timezone: None,
        cost: 1,
        payload: None,
        attributes: Default::default(),
        expires_at: None,
        priority: Default::default(),
    }
}

/// The part of a key Redis Cluster hashes: the first `{...}` with content, else the key.
pub fn cluster_tag(key: &str) -> &str {
    if let Some(open) = key.find('{') {
        if let Some(len) = key[open + 1..].find('}') {
            if len > 0 {
                return &key[open + 1..open + 1 + len];
            }
        }
    }
    key
}
