//! TLS to all three services, against servers that speak nothing else: one Redis, a 3-master
//! Redis Cluster, a RabbitMQ node and a PostgreSQL, started once for the whole test run by
//! `deploy/local/tls-servers.sh` (the test command does it and exports `SENDQUOTA_TEST_TLS_*`),
//! with a throwaway CA made at start. Tests share them through namespaces and databases of
//! their own. The worker runs as its binary, as in production: the crypto provider, the
//! settings from the environment and the start-up errors are all the real ones.

use crate::support;

use std::collections::HashMap;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use lapin::options::BasicGetOptions;
use sendquota::config::{AmqpSettings, DatabaseSettings, QueueType, RedisSettings};
use sendquota::internals::broker::{self, Names, Publisher};
use sendquota::internals::denials::{DenialFilter, DenialStore};
use sendquota::internals::store::RedisConn;
use sendquota::internals::tls::TlsFiles;
use support::process::{run_for, Run};

/// The TLS-only servers of this test run and their certificates.
struct Servers {
    ca: String,
    wrong_ca: String,
    client_cert: String,
    client_key: String,
    redis: String,
    redis_cluster: String,
    amqp: String,
    database: String,
}

fn var(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        panic!(
            "{name} is not set: the TLS tests need the TLS-only servers that the test command \
             deploy/local/test.sh starts (by hand: eval \"$(deploy/local/tls-servers.sh start \
             /tmp/sqtls)\")"
        )
    })
}

impl Servers {
    fn from_env() -> Servers {
        sendquota::internals::tls::install_crypto_provider();
        Servers {
            ca: var("SENDQUOTA_TEST_TLS_CA"),
            wrong_ca: var("SENDQUOTA_TEST_TLS_WRONG_CA"),
            client_cert: var("SENDQUOTA_TEST_TLS_CLIENT_CERT"),
            client_key: var("SENDQUOTA_TEST_TLS_CLIENT_KEY"),
            redis: var("SENDQUOTA_TEST_TLS_REDIS_URL"),
            redis_cluster: var("SENDQUOTA_TEST_TLS_REDIS_CLUSTER_URLS"),
            amqp: var("SENDQUOTA_TEST_TLS_AMQP_URL"),
            database: var("SENDQUOTA_TEST_TLS_DATABASE_URL"),
        }
    }

    /// The CA of the test servers, with the client certificate when `mutual`.
    fn files(&self, mutual: bool) -> TlsFiles {
        TlsFiles {
            ca_file: self.ca.clone(),
            client_cert_file: if mutual {
                self.client_cert.clone()
            } else {
                String::new()
            },
            client_key_file: if mutual {
                self.client_key.clone()
            } else {
                String::new()
            },
        }
    }

    /// The URL of database `name` on the TLS Postgres, `sslmode` kept.
    fn database_url(&self, name: &str) -> String {
        let (base, query) = self
            .database
            .split_once('?')
            .unwrap_or((&self.database, ""));
        let server = &base[..base.rfind('/').expect("a database in the URL")];
        format!("{server}/{name}?{query}")
    }
}

/// How the worker reaches the three services in one test: URLs and certificate files, as
/// `SENDQUOTA_*` environment variables.
#[derive(Clone)]
struct Connections {
    vars: Vec<(String, String)>,
}

impl Connections {
    /// Every service over TLS, verified against the test CA; with the client certificate on
    /// every connection when `mutual` (RabbitMQ then logs in by it, through EXTERNAL).
    fn tls(
        servers: &Servers,
        namespace: &str,
        database: &str,
        mutual: bool,
        cluster: bool,
    ) -> Self {
        let amqp = if mutual {
            // No password: the broker takes the user from the certificate's CN.
            let url = servers.amqp.replacen("guest:guest@", "", 1);
            format!("{url}?auth_mechanism=external")
        } else {
            servers.amqp.clone()
        };
        let mut vars = vec![
            ("SENDQUOTA_NAMESPACE".to_owned(), namespace.to_owned()),
            ("SENDQUOTA_AMQP_URL".to_owned(), amqp),
            (
                "SENDQUOTA_DATABASE_URL".to_owned(),
                servers.database_url(database),
            ),
        ];
        if cluster {
            vars.push((
                "SENDQUOTA_REDIS_CLUSTER_URLS".to_owned(),
                servers.redis_cluster.clone(),
            ));
        } else {
            vars.push(("SENDQUOTA_REDIS_URL".to_owned(), servers.redis.clone()));
        }
        let files = servers.files(mutual);
        for service in ["REDIS", "AMQP", "DATABASE"] {
            vars.push((Self::ca_var(service), files.ca_file.clone()));
            if mutual {
                vars.push((
                    format!("SENDQUOTA_{service}_TLS_CLIENT_CERT_FILE"),
                    files.client_cert_file.clone(),
                ));
                vars.push((
                    format!("SENDQUOTA_{service}_TLS_CLIENT_KEY_FILE"),
                    files.client_key_file.clone(),
                ));
            }
        }
        Connections { vars }
    }

    fn ca_var(service: &str) -> String {
        format!("SENDQUOTA_{service}_TLS_CA_FILE")
    }

    /// The same, with `name` set to `value`.
    fn with(mut self, name: &str, value: &str) -> Self {
        self.vars.retain(|(k, _)| k != name);
        self.vars.push((name.to_owned(), value.to_owned()));
        self
    }

    fn get(&self, name: &str) -> &str {
        self.vars
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
            .unwrap_or_else(|| panic!("{name} set"))
    }

    /// The worker binary with these connections and the default log filter (what an operator
    /// sees when nothing is configured).
    fn worker(&self) -> Command {
        let mut cmd = support::process::sendquota();
        cmd.env_remove("SENDQUOTA_LOG")
            .envs(self.vars.iter().map(|(k, v)| (k, v)))
            .args(["worker", "--now", "2026-04-01T09:00:00Z"]);
        cmd
    }

    fn redis(&self) -> RedisSettings {
        RedisSettings {
            url: self.vars_get_or("SENDQUOTA_REDIS_URL", ""),
            cluster_urls: self
                .vars_get_or("SENDQUOTA_REDIS_CLUSTER_URLS", "")
                .split(',')
                .filter(|u| !u.is_empty())
                .map(str::to_owned)
                .collect(),
            tls: self.files("REDIS"),
            ..RedisSettings::default()
        }
    }

    fn amqp(&self) -> AmqpSettings {
        AmqpSettings {
            url: self.get("SENDQUOTA_AMQP_URL").to_owned(),
            tls: self.files("AMQP"),
            ..AmqpSettings::default()
        }
    }

    fn database(&self) -> DatabaseSettings {
        DatabaseSettings {
            url: self.get("SENDQUOTA_DATABASE_URL").to_owned(),
            tls: self.files("DATABASE"),
            ..DatabaseSettings::default()
        }
    }

    fn vars_get_or(&self, name: &str, default: &str) -> String {
        self.vars
            .iter()
            .find(|(k, _)| k == name)
            .map_or(default.to_owned(), |(_, v)| v.clone())
    }

    fn files(&self, service: &str) -> TlsFiles {
        TlsFiles {
            ca_file: self.vars_get_or(&Self::ca_var(service), ""),
            client_cert_file: self
                .vars_get_or(&format!("SENDQUOTA_{service}_TLS_CLIENT_CERT_FILE"), ""),
            client_key_file: self
                .vars_get_or(&format!("SENDQUOTA_{service}_TLS_CLIENT_KEY_FILE"), ""),
        }
    }
}

/// A worker process, killed when the test ends however it ends.
struct Worker(Child);

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A fresh database on the TLS Postgres, reached over TLS, with the migrations applied.
async fn create_database(servers: &Servers, name: &str) -> DenialStore {
    let admin = DatabaseSettings {
        url: servers.database_url("postgres"),
        tls: servers.files(false),
        ..DatabaseSettings::default()
    };
    let admin = DenialStore::connect(&admin)
        .await
        .expect("the TLS postgres answers over TLS");
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE \"{name}\"")))
        .execute(admin.pool())
        .await
        .expect("create the test database");
    admin.pool().close().await;
    let store = DenialStore::connect(&DatabaseSettings {
        url: servers.database_url(name),
        tls: servers.files(false),
        ..DatabaseSettings::default()
    })
    .await
    .expect("connect the test database over TLS");
    store.migrate().await.expect("migrate");
    store
}

/// The worker at its default settings, over TLS to all three services, dispatches the first
/// message of a recipient's day and records a denial for the second; on a single Redis its deny
/// cache keeps its pub/sub subscription over TLS.
async fn dispatch_and_deny_over_tls(mutual: bool, cluster: bool) {
    let servers = Servers::from_env();
    let namespace = support::unique("sqtls");
    let database = namespace.to_lowercase();
    let store = create_database(&servers, &database).await;
    let connections = Connections::tls(&servers, &namespace, &database, mutual, cluster);

    // The tests' own view of the broker, over TLS with the same settings as the worker.
    let names = Names::new(&namespace);
    let amqp = connections.amqp();
    let conn = broker::connect(&amqp, "sendquota-test-tls")
        .await
        .expect("the TLS broker answers over TLS");
    let publisher = Publisher::open(&conn).await.expect("publisher");
    broker::declare(&publisher.channel(), &names, QueueType::Quorum)
        .await
        .expect("declare");
    let sink = format!("{namespace}.test.dispatched");
    let channel = conn.create_channel().await.expect("channel");
    support::declare_sink(&channel, &sink, &names.dispatch).await;

    let worker = Worker(
        connections
            .worker()
            .env("SENDQUOTA_LOG", "error")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the worker"),
    );
    for id in ["tls-1", "tls-2"] {
        let body = format!(r#"{{"id":"{id}","recipient":"tls-alice","channel":"sms"}}"#);
        publisher
            .publish(
                &names.requests,
                "",
                body.as_bytes(),
                broker::json_properties(Some(id), &[]),
            )
            .await
            .expect("publish over TLS");
    }

    let deadline = Instant::now() + Duration::from_secs(30);
    let mut dispatched = Vec::new();
    let mut denied = Vec::new();
    while dispatched.is_empty() || denied.is_empty() {
        assert!(
            Instant::now() < deadline,
            "over TLS: dispatched {dispatched:?}, denied {denied:?} after 30 s"
        );
        if let Some(m) = channel
            .basic_get(sink.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .expect("basic.get")
        {
            let request: serde_json::Value =
                serde_json::from_slice(&m.delivery.data).expect("json");
            dispatched.push(request["id"].as_str().expect("id").to_owned());
        }
        denied = store
            .list(&DenialFilter::default())
            .await
            .expect("denials over TLS")
            .into_iter()
            .map(|d| (d.row.message_id, d.row.rule))
            .collect();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Both are decided at once (default concurrency): either may be the day's one message.
    assert_eq!(dispatched.len(), 1, "one dispatched: {dispatched:?}");
    let other = if dispatched[0] == "tls-1" {
        "tls-2"
    } else {
        "tls-1"
    };
    assert_eq!(denied, [(other.to_owned(), "headline".to_owned())]);

    let redis = RedisConn::connect(&connections.redis())
        .await
        .expect("the TLS redis answers over TLS");
    if !cluster {
        let channel = sendquota::internals::keys::deny_cache_channel(&namespace);
        let subscribers: HashMap<String, i64> = redis::cmd("PUBSUB")
            .arg("NUMSUB")
            .arg(&channel)
            .query_async(&mut redis.clone())
            .await
            .expect("PUBSUB NUMSUB");
        assert_eq!(
            subscribers.get(&channel),
            Some(&1),
            "the worker's deny cache is subscribed over TLS"
        );
    }
    drop(worker);
    let _ = conn.close(200, "done".into()).await;
}

#[tokio::test]
async fn the_worker_dispatches_and_records_denials_over_tls_to_all_three_services() {
    dispatch_and_deny_over_tls(false, false).await;
}

#[tokio::test]
async fn with_client_certificates_everywhere_rabbitmq_logs_the_worker_in_through_external() {
    dispatch_and_deny_over_tls(true, false).await;
}

#[tokio::test]
async fn the_worker_decides_on_a_redis_cluster_over_tls() {
    dispatch_and_deny_over_tls(false, true).await;
}

/// A namespace and database on the TLS servers, and settings with which each server has just
/// answered over TLS: a refusal of other settings in the same test is then the server's TLS
/// at work, not a server that is down.
async fn answering_over_tls() -> (Servers, Connections) {
    let servers = Servers::from_env();
    let namespace = support::unique("sqtls");
    let database = namespace.to_lowercase();
    create_database(&servers, &database).await;
    let connections = Connections::tls(&servers, &namespace, &database, false, false);
    RedisConn::connect(&connections.redis())
        .await
        .expect("redis answers over TLS");
    DenialStore::connect(&connections.database())
        .await
        .expect("postgres answers over TLS");
    let conn = broker::connect(&connections.amqp(), "sendquota-test-tls")
        .await
        .expect("rabbitmq answers over TLS");
    let _ = conn.close(200, "done".into()).await;
    (servers, connections)
}

/// Runs the worker with `connections` until it exits (at most 30 s).
fn start_up(connections: &Connections) -> Run {
    run_for(connections.worker(), None, Duration::from_secs(30))
}

/// The worker stopped at start with exit 1 and exactly one line of error, which names
/// `service` and says `reason`.
fn assert_fails_at_start(run: &Run, what: &str, service: &str, reason: &str) {
    assert_eq!(run.code, Some(1), "{what}: {run:?}");
    let errors: Vec<&str> = run
        .stderr
        .lines()
        .filter(|l| l.starts_with("sendquota:") || l.contains("ERROR"))
        .collect();
    assert_eq!(errors.len(), 1, "{what}: one line of error: {run:?}");
    assert!(
        errors[0].starts_with(&format!("sendquota: {service}: ")) && errors[0].contains(reason),
        "{what}: {:?} names {service} and says {reason:?}",
        errors[0]
    );
}

#[tokio::test]
async fn a_certificate_signed_by_another_ca_fails_start_up_naming_the_service() {
    let (servers, good) = answering_over_tls().await;
    for (service, name) in [
        ("REDIS", "redis"),
        ("DATABASE", "postgres"),
        ("AMQP", "rabbitmq"),
    ] {
        let wrong = good
            .clone()
            .with(&Connections::ca_var(service), &servers.wrong_ca);
        let run = tokio::task::spawn_blocking(move || start_up(&wrong))
            .await
            .expect("run");
        assert_fails_at_start(&run, &format!("{service} wrong CA"), name, "UnknownIssuer");
    }
}

#[tokio::test]
async fn plaintext_against_a_tls_only_server_fails_start_up_naming_the_service() {
    let (_, good) = answering_over_tls().await;
    let plain = [
        (
            "SENDQUOTA_REDIS_URL",
            "redis",
            good.get("SENDQUOTA_REDIS_URL")
                .replacen("rediss://", "redis://", 1),
            "(if the server accepts TLS only, use rediss://)",
        ),
        (
            "SENDQUOTA_DATABASE_URL",
            "postgres",
            good.get("SENDQUOTA_DATABASE_URL").replacen(
                "sslmode=verify-full",
                "sslmode=disable",
                1,
            ),
            "no encryption",
        ),
        (
            // The broker resets the connection or answers with a TLS alert, which the AMQP
            // client fails to parse: either way the hint follows.
            "SENDQUOTA_AMQP_URL",
            "rabbitmq",
            good.get("SENDQUOTA_AMQP_URL")
                .replacen("amqps://", "amqp://", 1),
            "(if the server accepts TLS only, use amqps://)",
        ),
    ];
    for (variable, service, url, reason) in plain {
        let connections = good.clone().with(variable, &url);
        let run = tokio::task::spawn_blocking(move || start_up(&connections))
            .await
            .expect("run");
        assert_fails_at_start(&run, variable, service, reason);
    }
}

/// `rediss://` against the suite's plaintext Redis, a single server and every seed of its
/// cluster, with a 1 s connect timeout: the worker stops at start with exit 1 within that
/// timeout (and a second for starting the process), in one line that names Redis, the address
/// and the cause; it does not retry the handshake for tens of seconds.
#[test]
fn tls_against_a_plaintext_redis_fails_start_up_within_the_connect_timeout_naming_the_cause() {
    let tls = |url: &str| url.replacen("redis://", "rediss://", 1);
    let single = support::redis_url();
    let seeds = support::cluster_urls();
    let cluster: Vec<String> = seeds.iter().map(|u| tls(u)).collect();
    for (variable, urls, address) in [
        ("SENDQUOTA_REDIS_URL", tls(&single), single),
        (
            "SENDQUOTA_REDIS_CLUSTER_URLS",
            cluster.join(","),
            seeds[0].clone(),
        ),
    ] {
        let address = address.trim_start_matches("redis://").trim_end_matches('/');
        let config = support::TempFile::new("[redis]\nresponse_timeout_ms = 1000\n");
        let mut worker = support::process::sendquota();
        worker
            .env_remove("SENDQUOTA_LOG")
            .env(variable, &urls)
            .arg("--config")
            .arg(config.path())
            .args(["worker", "--now", "2026-04-01T09:00:00Z"]);
        let run = run_for(worker, None, Duration::from_secs(30));
        assert_fails_at_start(
            &run,
            variable,
            "redis",
            "the server speaks plaintext Redis, not TLS (use redis://)",
        );
        let handshake = format!("sendquota: redis: TLS handshake with {address} failed (");
        assert!(
            run.stderr.lines().any(|l| l.starts_with(&handshake)),
            "{variable}: {run:?}"
        );
        assert!(
            run.elapsed < Duration::from_secs(2),
            "{variable}: failed after {:?}",
            run.elapsed
        );
    }
}
