//! The decision scripts: composed from the files in lua/ (compiled in), one EVALSHA per scope.

use std::sync::OnceLock;

use redis::{FromRedisValue, ParsingError, Value};

/// Helpers shared by every kind; first in every composed script.
pub const PRELUDE: &str = include_str!("../../lua/prelude.lua");

/// Every kind's file, by the name its rules carry, in the order scripts compose them.
pub const KIND_SOURCES: [(&str, &str); 9] = [
    (
        "calendar_quota",
        include_str!("../../lua/calendar_quota.lua"),
    ),
    ("fixed_window", include_str!("../../lua/fixed_window.lua")),
    (
        "sliding_window",
        include_str!("../../lua/sliding_window.lua"),
    ),
    ("sliding_log", include_str!("../../lua/sliding_log.lua")),
    ("leaky_bucket", include_str!("../../lua/leaky_bucket.lua")),
    ("token_bucket", include_str!("../../lua/token_bucket.lua")),
    ("gcra", include_str!("../../lua/gcra.lua")),
    ("zset_window", include_str!("../../lua/zset_window.lua")),
    ("quiet_hours", include_str!("../../lua/quiet_hours.lua")),
];

/// The driver that runs a scope's rules all-or-nothing; last in every composed script.
pub const DRIVER: &str = include_str!("../../lua/decide.lua");

/// A set of kinds: bit `i` stands for `KIND_SOURCES[i]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KindSet(u16);

impl KindSet {
    /// Every kind.
    pub const ALL: KindSet = KindSet((1 << KIND_SOURCES.len()) - 1);

    /// The set of the named kinds; unknown names are left out (the driver then refuses the
    /// call with "unknown limiter kind", as it would for any script without that kind).
    pub fn of<'a>(names: impl IntoIterator<Item = &'a str>) -> KindSet {
        KindSet(names.into_iter().fold(0, |bits, name| {
            bits | KIND_SOURCES
                .iter()
                .position(|(kind, _)| *kind == name)
                .map_or(0, |i| 1 << i)
        }))
    }

    fn contains(self, index: usize) -> bool {
        self.0 & (1 << index) != 0
    }
}

/// The source of the script for a scope whose rules use `kinds`: the prelude, those kinds'
/// files and the driver. Each kind's file only defines functions, but Lua runs those
/// definitions on every call, so a script carrying all nine kinds spends about 5 us per call
/// (measured with redis-benchmark on this machine's Redis 7.0) creating functions the scope
/// never calls: a headline-only scope carries the calendar quota alone.
pub fn source_for(kinds: KindSet) -> String {
    let mut source = String::from(PRELUDE);
    source.push('\n');
    for (index, (_, kind)) in KIND_SOURCES.iter().enumerate() {
        if kinds.contains(index) {
            source.push_str(kind);
            source.push('\n');
        }
    }
    source.push_str(DRIVER);
    source
}

/// The script for `kinds`, composed and hashed once per set.
pub fn script_for(kinds: KindSet) -> &'static redis::Script {
    static SCRIPTS: [OnceLock<redis::Script>; 1 << KIND_SOURCES.len()] =
        [const { OnceLock::new() }; 1 << KIND_SOURCES.len()];
    SCRIPTS[usize::from(kinds.0)].get_or_init(|| redis::Script::new(&source_for(kinds)))
}

/// The start of an EVALSHA of `script` with `keys` keys; the caller appends the keys and the
/// arguments, then sends it with [`call`]. Written directly rather than through
/// `redis::ScriptInvocation`, which copies every key and argument once more per call. This is
/// the one place that names the command: every hash sent is that of a script composed from
/// lua/.
pub fn evalsha(script: &redis::Script, keys: usize, args: usize, bytes: usize) -> redis::Cmd {
    let mut cmd = redis::Cmd::with_capacity(3 + keys + args, 64 + bytes);
    cmd.arg("EVALSHA").arg(script.get_hash()).arg(keys);
    cmd
}

/// Sends `cmd`, an [`evalsha`] of `script`. On NOSCRIPT (a restarted or failed-over Redis
/// forgot the script) it loads `script` and sends `cmd` again, as
/// `redis::ScriptInvocation::invoke_async` does; on a cluster the load reaches every master.
pub async fn call<T: FromRedisValue>(
    script: &redis::Script,
    cmd: &redis::Cmd,
    conn: &mut crate::store::RedisConn,
) -> redis::RedisResult<T> {
    match cmd.query_async(conn).await {
        Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
            script.load_async(conn).await?;
            cmd.query_async(conn).await
        }
        reply => reply,
    }
}

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
    /// The message id holds an unexpired dispatch mark: nothing was checked (no results).
    pub dispatched: bool,
    /// Each rule's result, in the order the rules were passed.
    pub results: Vec<RawResult>,
}

impl FromRedisValue for ScopeReply {
    fn from_redis_value(v: Value) -> Result<Self, ParsingError> {
        let Value::Array(items) = v else {
            return Err(format!("decision script replied {v:?}, expected an array").into());
        };
        let mut items = items.into_iter();
        let (committed, dispatched) = match items.next() {
            Some(Value::Int(2)) => (false, true),
            Some(Value::Int(c)) => (c == 1, false),
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
        Ok(ScopeReply {
            committed,
            dispatched,
            results,
        })
    }
}
