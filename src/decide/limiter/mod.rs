//! Checking and consuming quota in Redis.
//!
//! The rules that apply to a message are grouped by scope. Each scope is one script call that
//! checks every rule of the scope and then commits all of them or none. Scopes are called one
//! after another; if a later scope refuses, what earlier scopes took for this message id is
//! refunded, so a message that is not dispatched leaves no quota consumed. Deciding is in
//! `evaluate`, a scope's call in `calls`, claims and refunds in `claims`, what operators ask
//! (peek, reset) in `peek`.

mod calls;
mod claims;
mod evaluate;
mod peek;
pub mod script;

use std::sync::Arc;

use crate::base::failpoint::Failpoint;
use crate::base::store::RedisConn;
use crate::decide::deny_cache::{self, DenyCache};
use crate::decide::outcome::Verdict;

/// Failures talking to Redis. Any of them means "decide this message again later".
#[derive(Debug, thiserror::Error)]
pub enum LimiterError {
    /// Redis was unreachable, timed out, or the script failed.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// Redis failed after a script had decided the message or taken its claim (a later
    /// scope's call, the refunds of a refused message, the deny cache): Redis holds part of a
    /// decision, so the message is decided there again, never let out unchecked.
    #[error("redis, after the message was decided: {0}")]
    AfterDecision(redis::RedisError),
}

impl LimiterError {
    /// This failure, raised once part of the message's decision was made in Redis.
    fn after_decision(self) -> LimiterError {
        match self {
            LimiterError::Redis(e) => LimiterError::AfterDecision(e),
            after => after,
        }
    }

    /// Whether Redis is away rather than failing this call: unreachable, the connection
    /// refused, dropped or timed out (all I/O errors), no node to serve the slot, or a server
    /// that cannot take the call now (loading its data, cluster down, master down, a
    /// failover's TRYAGAIN, a demoted replica's READONLY). A rule with `on_unavailable =
    /// "allow"` lets a message out unchecked only then; a script error, a reply the worker
    /// cannot read, or a refusal of the call itself (permissions, configuration) are not
    /// unavailability and keep their retries and quarantine; nor is Redis going away once
    /// part of the decision was made ([`LimiterError::AfterDecision`]).
    pub fn is_unavailable(&self) -> bool {
        use redis::{ErrorKind, ServerErrorKind};
        let LimiterError::Redis(e) = self else {
            return false;
        };
        matches!(
            e.kind(),
            ErrorKind::Io
                | ErrorKind::ClusterConnectionNotFound
                | ErrorKind::Server(
                    ServerErrorKind::BusyLoading
                        | ServerErrorKind::ClusterDown
                        | ServerErrorKind::MasterDown
                        | ServerErrorKind::TryAgain
                        | ServerErrorKind::ReadOnly
                )
        )
    }
}

/// What deciding a message in Redis came to.
#[derive(Debug, Clone, PartialEq)]
pub enum Evaluation {
    /// Every applicable rule was checked.
    Decided {
        /// Verdicts in policy order.
        verdicts: Vec<Verdict>,
        /// True when every scope committed (the message may be dispatched); always false for
        /// a dry run.
        committed: bool,
    },
    /// The message id holds an unexpired dispatch mark (see [`crate::decide::dedup`]): it went out
    /// before, and nothing was decided. Only a committing evaluation looks.
    Dispatched,
    /// Another delivery of the message id holds its in-flight claim (see [`crate::decide::claim`]):
    /// nothing was decided. Only a claimed evaluation looks.
    InFlight {
        /// How much longer that claim runs, in ms.
        wait_ms: i64,
    },
}

/// Runs policy rules against Redis state.
#[derive(Clone)]
pub struct Limiter {
    conn: RedisConn,
    namespace: String,
    cache: Option<Arc<DenyCache>>,
    /// A deliberate fault for tests; `None` in production.
    failpoint: Option<Failpoint>,
}

impl Limiter {
    /// A limiter keeping its keys under `namespace`.
    pub fn new(conn: RedisConn, namespace: impl Into<String>) -> Limiter {
        Limiter {
            conn,
            namespace: namespace.into(),
            cache: None,
            failpoint: None,
        }
    }

    /// This limiter with the fault `failpoint` armed (crash tests only).
    pub fn with_failpoint(mut self, failpoint: Option<Failpoint>) -> Limiter {
        self.failpoint = failpoint;
        self
    }

    /// This limiter, answering repeat denials of full recipients from `cache`.
    pub fn with_deny_cache(mut self, cache: Arc<DenyCache>) -> Limiter {
        self.cache = Some(cache);
        self
    }

    /// Tells every worker's deny cache that `recipient`'s state changed in a way a cached
    /// denial did not foresee (quota freed, or a partial re-admission).
    async fn announce_changed(&self, recipient: &str) -> Result<(), LimiterError> {
        if let Some(cache) = &self.cache {
            cache.invalidate(recipient);
        }
        deny_cache::announce(&self.conn, &self.namespace, recipient).await?;
        Ok(())
    }

    /// The connection, for callers that share it (sent marks, health checks).
    pub fn conn(&self) -> &RedisConn {
        &self.conn
    }

    /// The deny cache, if the limiter has one: a rule reload turns it off while the replaced
    /// rules may still be deciding.
    pub fn deny_cache(&self) -> Option<&Arc<DenyCache>> {
        self.cache.as_ref()
    }
}

impl Evaluation {
    /// Every applicable rule's verdict, in policy order; none when nothing was decided.
    pub fn verdicts(&self) -> &[Verdict] {
        match self {
            Evaluation::Decided { verdicts, .. } => verdicts,
            Evaluation::Dispatched | Evaluation::InFlight { .. } => &[],
        }
    }

    /// [`Evaluation::verdicts`], owned.
    pub fn into_verdicts(self) -> Vec<Verdict> {
        match self {
            Evaluation::Decided { verdicts, .. } => verdicts,
            Evaluation::Dispatched | Evaluation::InFlight { .. } => Vec::new(),
        }
    }

    /// Whether every scope committed: the message may be dispatched.
    pub fn committed(&self) -> bool {
        matches!(
            self,
            Evaluation::Decided {
                committed: true,
                ..
            }
        )
    }

    /// Whether the message id was dispatched before (nothing decided).
    pub fn dispatched(&self) -> bool {
        matches!(self, Evaluation::Dispatched)
    }

    /// How much longer another delivery holds the message id, when one does (nothing decided).
    pub fn in_flight(&self) -> Option<i64> {
        match self {
            Evaluation::InFlight { wait_ms } => Some(*wait_ms),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::LimiterError;

    /// The error redis-rs makes of a server's error reply `reply` (`-LOADING ...`).
    fn replied(reply: &str) -> LimiterError {
        let value = redis::parse_redis_value(format!("-{reply}\r\n").as_bytes())
            .expect("an error reply parses");
        match value.extract_error() {
            Err(e) => LimiterError::Redis(e),
            Ok(v) => panic!("{reply} is not an error: {v:?}"),
        }
    }

    fn io(kind: std::io::ErrorKind) -> LimiterError {
        LimiterError::Redis(std::io::Error::from(kind).into())
    }

    #[test]
    fn redis_away_is_unavailable() {
        for kind in [
            std::io::ErrorKind::ConnectionRefused,
            std::io::ErrorKind::ConnectionReset,
            std::io::ErrorKind::BrokenPipe,
            std::io::ErrorKind::UnexpectedEof,
            std::io::ErrorKind::TimedOut,
        ] {
            assert!(io(kind).is_unavailable(), "{kind:?}");
        }
        for reply in [
            "LOADING Redis is loading the dataset in memory",
            "CLUSTERDOWN The cluster is down",
            "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
            "TRYAGAIN Multiple keys request during rehashing of slot",
            "READONLY You can't write against a read only replica.",
        ] {
            assert!(replied(reply).is_unavailable(), "{reply}");
        }
        let no_node =
            redis::RedisError::from((redis::ErrorKind::ClusterConnectionNotFound, "no connection"));
        assert!(LimiterError::Redis(no_node).is_unavailable());
    }

    #[test]
    fn a_failing_call_to_a_redis_that_is_there_is_not_unavailable() {
        for reply in [
            "ERR user_script:12: attempt to compare nil with number",
            "NOSCRIPT No matching script. Please use EVAL.",
            "NOPERM User worker has no permissions to run the 'evalsha' command",
            "CROSSSLOT Keys in request don't hash to the same slot",
            "WRONGTYPE Operation against a key holding the wrong kind of value",
        ] {
            assert!(!replied(reply).is_unavailable(), "{reply}");
        }
        let unreadable = redis::RedisError::from((
            redis::ErrorKind::UnexpectedReturnType,
            "reply is not a decision",
        ));
        assert!(!LimiterError::Redis(unreadable).is_unavailable());
    }

    #[test]
    fn redis_going_away_once_part_of_a_decision_was_made_is_not_unavailable() {
        let away = io(std::io::ErrorKind::ConnectionReset);
        assert!(away.is_unavailable());
        let after = away.after_decision();
        assert!(!after.is_unavailable());
        assert!(
            after
                .to_string()
                .starts_with("redis, after the message was decided: "),
            "{after}"
        );
    }
}
