//! The harness of the model tests: a limiter on a Redis (the shared server or the test
//! cluster) under a namespace of its own, driven from synchronous property-test closures, with
//! every key of the namespace removed when it is dropped (also when a test fails).

use chrono::{DateTime, Utc};
use sendquota::config::RedisSettings;
use sendquota::internals::claim::Claim;
use sendquota::internals::limiter::{Evaluation, Limiter};
use sendquota::internals::message::SendRequest;
use sendquota::internals::policy::Policy;
use sendquota::internals::store::RedisConn;

/// A runtime, a connection, a limiter and the namespace they work in.
pub struct LimiterHarness {
    pub rt: tokio::runtime::Runtime,
    pub conn: RedisConn,
    pub limiter: Limiter,
    pub namespace: String,
}

impl LimiterHarness {
    /// A harness on the shared single server, its namespace starting with `prefix`.
    pub fn single(prefix: &str) -> LimiterHarness {
        LimiterHarness::on(prefix, &super::single_settings())
    }

    /// A harness on `settings` (the single server or the cluster).
    pub fn on(prefix: &str, settings: &RedisSettings) -> LimiterHarness {
        let rt = tokio::runtime::Runtime::new().expect("runtime");
        let namespace = super::unique(prefix);
        let conn = rt.block_on(super::connect_redis(settings));
        let limiter = Limiter::new(conn.clone(), &namespace);
        LimiterHarness {
            rt,
            conn,
            limiter,
            namespace,
        }
    }

    /// Decides `message` under `policy` at `now`, committing when `commit`.
    pub fn evaluate(
        &self,
        policy: &Policy,
        message: &SendRequest,
        now: DateTime<Utc>,
        commit: bool,
    ) -> Evaluation {
        self.rt
            .block_on(self.limiter.evaluate(policy, message, now, commit))
            .unwrap_or_else(|e| panic!("evaluate: {e}; {}", super::START_HINT))
    }

    /// Decides and commits `message` under `policy` at `now` for the delivery holding `claim`,
    /// as the worker does.
    pub fn evaluate_claimed(
        &self,
        policy: &Policy,
        message: &SendRequest,
        now: DateTime<Utc>,
        claim: &Claim,
    ) -> Evaluation {
        self.rt
            .block_on(self.limiter.evaluate_claimed(policy, message, now, claim))
            .unwrap_or_else(|e| panic!("evaluate_claimed: {e}; {}", super::START_HINT))
    }

    /// Runs `cmd` on the harness's connection.
    pub fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> T {
        self.rt
            .block_on(cmd.query_async(&mut self.conn.clone()))
            .expect("redis command")
    }

    /// Every key of the namespace whose name contains `part`, with its PTTL.
    pub fn keys_with_ttl(&self, part: &str) -> Vec<(String, i64)> {
        let keys = self
            .rt
            .block_on(super::all_keys(
                &self.conn,
                &format!("{}:*", self.namespace),
            ))
            .expect("scan keys");
        keys.into_iter()
            .filter(|k| k.contains(part))
            .map(|k| {
                let ttl: i64 = self.query(redis::cmd("PTTL").arg(&k));
                (k, ttl)
            })
            .collect()
    }
}

/// The policy of configuration `toml`, built and validated as the worker builds it.
pub fn policy(toml: &str) -> Policy {
    sendquota::config::Settings::from_toml(toml, |_| None)
        .unwrap_or_else(|e| panic!("config {toml:?} is valid: {e}"))
        .policy
}

/// [`super::request`], decoded as the worker decodes it.
pub fn decoded(id: &str, recipient: &str, zone: &str) -> SendRequest {
    let body = super::request(id, recipient, zone).to_string();
    SendRequest::decode(body.as_bytes(), 1 << 16).expect("valid request")
}

impl Drop for LimiterHarness {
    fn drop(&mut self) {
        let pattern = format!("{}:*", self.namespace);
        let mut conn = self.conn.clone();
        self.rt
            .block_on(async move { super::delete_keys(&mut conn, &pattern).await });
    }
}

/// A property-test runner of `cases` cases drawn from `seed`: the same cases every run, so a
/// figure measured with it (how many of them agree) can be measured again.
pub fn seeded_runner(cases: u32, seed: u8) -> proptest::test_runner::TestRunner {
    use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
    let config = Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    };
    TestRunner::new_with_rng(
        config,
        TestRng::from_seed(RngAlgorithm::ChaCha, &[seed; 32]),
    )
}
