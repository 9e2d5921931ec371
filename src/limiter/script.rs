//! The decision script: composed from lua/ when the crate is built, called once per scope.

use std::sync::LazyLock;

use redis::{FromRedisValue, ParsingError, Value};

/// The composed source: shared helpers, every kind, then the driver that runs a scope's rules
/// all-or-nothing. One script means one EVALSHA per scope whatever the kinds involved.
pub const SOURCE: &str = concat!(
    include_str!("../../lua/prelude.lua"),
    "\n",
    include_str!("../../lua/calendar_quota.lua"),
    "\n",
    include_str!("../../lua/fixed_window.lua"),
    "\n",
    include_str!("../../lua/sliding_window.lua"),
    "\n",
    include_str!("../../lua/sliding_log.lua"),
    "\n",
    include_str!("../../lua/leaky_bucket.lua"),
    "\n",
    include_str!("../../lua/token_bucket.lua"),
    "\n",
    include_str!("../../lua/gcra.lua"),
    "\n",
    include_str!("../../lua/zset_window.lua"),
    "\n",
    include_str!("../../lua/quiet_hours.lua"),
    "\n",
    include_str!("../../lua/decide.lua"),
);

/// The script, hashed once.
pub static SCRIPT: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(SOURCE));

/// What the driver does with a scope's rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Evaluate only; nothing is written.
    Check,
    /// Evaluate and, unless an enforcing rule refuses, consume.
    Commit,
    /// Give back what the message took.
    Refund,
}

impl Mode {
    pub(super) fn arg(self) -> &'static str {
        match self {
            Mode::Check => "check",
            Mode::Commit => "commit",
            Mode::Refund => "refund",
        }
    }
}

/// One rule's raw result, as the kind script returned it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawResult {
    /// The rule would admit the message.
    pub allowed: bool,
    /// The message id was admitted before and consumed nothing now.
    pub already: bool,
    /// What the rule still allows (kind-specific unit: sends, tokens).
    pub remaining: i64,
    /// Kind-specific retry value (a day number or epoch ms), -1 for none.
    pub retry: i64,
    /// Kind-specific detail (the refusing policy of a sliding log), 0 otherwise.
    pub detail: i64,
}

/// The driver's reply for one scope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScopeReply {
    /// Whether the scope's rules consumed.
    pub committed: bool,
    /// Each rule's result, in the order the rules were passed.
    pub results: Vec<RawResult>,
}

impl FromRedisValue for ScopeReply {
    fn from_redis_value(v: Value) -> Result<Self, ParsingError> {
        let Value::Array(items) = v else {
            return Err(format!("decision script replied {v:?}, expected an array").into());
        };
        let mut items = items.into_iter();
        let committed = match items.next() {
            Some(Value::Int(c)) => c == 1,
            other => return Err(format!("decision script: bad committed flag {other:?}").into()),
        };
        let results = items
            .map(|item| {
                let [allowed, already, remaining, retry, detail]: [i64; 5] =
                    <Vec<i64>>::from_redis_value(item)?
                        .try_into()
                        .map_err(|v| {
                            format!("decision script: rule result {v:?} is not 5 numbers")
                        })?;
                Ok(RawResult {
                    allowed: allowed == 1,
                    already: already == 1,
                    remaining,
                    retry,
                    detail,
                })
            })
            .collect::<Result<_, ParsingError>>()?;
        Ok(ScopeReply { committed, results })
    }
}
