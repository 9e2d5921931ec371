//! A test's own world on the shared services: its namespace (Redis keys, exchanges, queues) and
//! its database, made by [`TestEnv`]'s constructors and removed by [`Cleanup`] when the test
//! ends, even when it fails.

use std::time::Duration;

use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
use lapin::{Channel, Connection};
use sendquota::config::Settings;
use sendquota::internals::broker::{self, Names, Publisher, DELAY_TIERS_MS};
use sendquota::internals::denials::DenialStore;
use sendquota::internals::store::RedisConn;
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;
use tokio::sync::oneshot;

use super::queues::{declare_sink, lapin_connect};
use super::redis_keys::{cluster_settings, cluster_urls, delete_keys, single_settings};
use super::worker::cli_config_path;
use super::{admin_database_url, amqp_url, database_url, redis_url, unique, START_HINT};

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
    pub(super) worker_stop: Option<oneshot::Sender<()>>,
    pub(super) worker_task: Option<tokio::task::JoinHandle<()>>,
    /// Declared last so it drops last: removes the namespace's queues, keys and database.
    cleanup: Cleanup,
}

/// Removes everything a test made on the shared services when dropped, even while panicking.
pub struct Cleanup {
    namespace: String,
    database: String,
    cluster: bool,
    /// The request shards the namespace was declared with, whose queues go too.
    shards: u16,
    /// The queue type the namespace was declared with, which names its delay queues.
    queue_type: sendquota::config::QueueType,
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
        let mut guard = Cleanup {
            namespace: namespace.clone(),
            database: database.clone(),
            cluster,
            shards: 1,
            queue_type,
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
        let names = Names::of(&namespace, queue_type).sharded(settings.intake.shards);
        guard.shards = settings.intake.shards;
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
        let names = Names::of(&namespace, self.queue_type).sharded(self.shards);
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
            if names.shards > 1 {
                queues.extend(names.intake_queues());
            }
            queues.extend(sinks);
            queues.extend(DELAY_TIERS_MS.iter().map(|t| names.delay_queue(*t)));
            for q in queues {
                let _ = ch
                    .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                    .await;
            }
            for x in [&names.requests, &names.dispatch, &names.shard_exchange()] {
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
