//! Test harness: every test gets its own namespace (Redis keys, exchanges, queues) and its own
//! Postgres database, talks to the real services, and removes everything it made when it ends,
//! even when it fails. A service that does not answer fails the test with the command that
//! starts it.
//!
//! By concern: [`env`] makes and removes a test's world ([`TestEnv`]); [`worker`] runs the
//! worker in process or as the binary (its commands and their configuration file); [`queues`]
//! publishes requests and reads what the worker routed; [`denials`] reads and breaks the denial
//! history in Postgres; [`redis_keys`] holds the Redis deployments and the keys a test leaves;
//! [`fixtures`] reads the policies under tests/fixtures/policies.

pub mod browser;
pub mod cluster_load;
pub mod denials;
pub mod drill;
pub mod env;
pub mod fixtures;
pub mod http;
pub mod model;
pub mod private;
pub mod process;
pub mod queues;
pub mod redis_keys;
pub mod scale_out;
pub mod worker;

pub use env::TestEnv;
// The helpers free of a test environment, where they were before the harness had files: the
// tests use some, the benches (which include this harness) others.
#[allow(unused_imports)]
pub use {
    denials::refuse_denials_of,
    queues::{declare_sink, drain, lapin_connect},
    redis_keys::{
        all_keys, cluster_settings, cluster_tag, cluster_urls, connect_redis, delete_keys,
        first_message_to_hostile_id, redis_targets, single_settings, zset_members,
    },
};

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use sendquota::config::{DEFAULT_AMQP_URL, DEFAULT_DATABASE_URL, DEFAULT_REDIS_URL};

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
