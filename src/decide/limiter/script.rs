//! The decision scripts: composed from the files in lua/ (compiled in), one EVALSHA per scope.

use std::sync::OnceLock;

use redis::{FromRedisValue, ParsingError, Value};

use crate::rules::kinds::SOURCES;

/// Helpers shared by every kind; first in every composed script.
pub const PRELUDE: &str = include_str!("../../../lua/prelude.lua");

/// The driver that runs a scope's rules all-or-nothing; last in every composed script.
pub const DRIVER: &str = include_str!("../../../lua/decide.lua");

/// A set of kinds: bit `i` stands for `SOURCES[i]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KindSet(u16);

impl KindSet {
    /// Every kind.
    pub const ALL: KindSet = KindSet((1 << SOURCES.len()) - 1);

    /// The set of the named kinds; unknown names are left out (the driver then refuses the
    /// call with "unknown limiter kind", as it would for any script without that kind).
    pub fn of<'a>(names: impl IntoIterator<Item = &'a str>) -> KindSet {
        KindSet(names.into_iter().fold(0, |bits, name| {
            bits | SOURCES
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
/// definitions on every call, so a script carrying all nine kinds would spend Redis CPU on every
/// call creating functions the scope never calls (docs/performance.md): a headline-only scope
/// carries the calendar quota alone. The prelude's helper
/// functions are left out in the same way when nothing in the script calls them (see
/// [`prelude_for`]).
pub fn source_for(kinds: KindSet) -> String {
    let mut body = String::new();
    for (index, (_, kind)) in SOURCES.iter().enumerate() {
        if kinds.contains(index) {
            body.push_str(kind);
            body.push('\n');
        }
    }
    body.push_str(DRIVER);
    let mut source = prelude_for(&body);
    source.push('\n');
    source.push_str(&body);
    source
}

/// The prelude for a script whose kinds and driver are `body`: every paragraph of
/// `lua/prelude.lua` (blocks between blank lines) except the helpers (`local function NAME(`,
/// or a value, `local NAME =`) that neither `body` nor another helper kept uses: a helper
/// defined but never used costs Redis CPU on every call of the script, as unused kinds do
/// (docs/performance.md), and so does a value converted but never read (docs/redis-time.md).
pub fn prelude_for(body: &str) -> String {
    let paragraphs: Vec<(Option<&str>, &str)> = PRELUDE
        .split("\n\n")
        .map(|text| (helper_name(text), text))
        .collect();
    let mut kept: Vec<bool> = paragraphs.iter().map(|(name, _)| name.is_none()).collect();
    // Helpers use helpers: keep adding until nothing more is used.
    loop {
        let mut text = String::from(body);
        for ((_, paragraph), keep) in paragraphs.iter().zip(&kept) {
            if *keep {
                text.push_str(paragraph);
            }
        }
        // One pass over the text finds every name it uses, rather than one search of the
        // whole text per helper: the first decision composes its script while it waits.
        let mut unused: Vec<(&str, &mut bool)> = paragraphs
            .iter()
            .zip(kept.iter_mut())
            .filter_map(|((name, _), keep)| name.filter(|_| !*keep).map(|name| (name, keep)))
            .collect();
        let mut grew = false;
        let mut search = |used: &str| {
            for (name, keep) in unused.iter_mut() {
                if !**keep && *name == used {
                    **keep = true;
                    grew = true;
                }
            }
        };
        names_used(&text).for_each(&mut search);
        // A name that is not one word is never one token: searched for as before.
        for (name, keep) in unused.iter_mut() {
            if !**keep && !name.chars().all(word_char) && uses(&text, name) {
                **keep = true;
                grew = true;
            }
        }
        if !grew {
            break;
        }
    }
    paragraphs
        .iter()
        .zip(&kept)
        .filter(|(_, keep)| **keep)
        .map(|((_, text), _)| *text)
        .collect::<Vec<_>>()
        .join("\n\n")
}

/// The name of the helper a prelude paragraph defines, if it defines one: a function, or a
/// single value (`local NAME = ...`; a paragraph defining several at once is always kept).
fn helper_name(paragraph: &str) -> Option<&str> {
    paragraph.lines().find_map(|line| {
        if let Some(rest) = line.strip_prefix("local function ") {
            return rest.split('(').next().map(str::trim);
        }
        let (name, _) = line.strip_prefix("local ")?.split_once(" = ")?;
        name.chars()
            .all(|c| c.is_alphanumeric() || c == '_')
            .then_some(name)
    })
}

/// A character of a Lua name, as [`uses`] and [`names_used`] tell words apart.
fn word_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// Every name the code of Lua `text` uses, by the rule of [`uses`] (a whole word, not a field,
/// not a definition, not in a comment), once per use: for a name of one word,
/// `names_used(text).any(|n| n == name)` is `uses(text, name)`.
fn names_used(text: &str) -> impl Iterator<Item = &str> {
    text.lines()
        .map(|line| line.split("--").next().unwrap_or_default())
        .flat_map(|code| {
            let mut rest = code.char_indices().peekable();
            std::iter::from_fn(move || loop {
                let (start, c) = rest.next()?;
                if !word_char(c) {
                    continue;
                }
                let mut end = start + c.len_utf8();
                while let Some(&(at, c)) = rest.peek().filter(|(_, c)| word_char(*c)) {
                    end = at + c.len_utf8();
                    rest.next();
                }
                let (before, after) = (&code[..start], &code[end..]);
                let field = before.ends_with(['.', ':']);
                let definition = before.ends_with("function ")
                    || (before.ends_with("local ") && after.starts_with(" ="));
                if !field && !definition {
                    return Some(&code[start..end]);
                }
            })
        })
}

/// Whether the code of Lua `text` uses `name`: as a whole word, not as a field (`t.name`,
/// `t:name`) and not where it is defined (`local function name(`, `local name =`). Comments
/// (`--` to the end of the line; no Lua string of lua/ holds `--`) are not code.
fn uses(text: &str, name: &str) -> bool {
    let word = word_char;
    text.lines()
        .map(|line| line.split("--").next().unwrap_or_default())
        .any(|code| {
            code.match_indices(name).any(|(at, _)| {
                let (before, after) = (&code[..at], &code[at + name.len()..]);
                let longer_or_field = before
                    .chars()
                    .next_back()
                    .is_some_and(|c| word(c) || c == '.' || c == ':')
                    || after.chars().next().is_some_and(word);
                let definition = before.ends_with("function ")
                    || (before.ends_with("local ") && after.starts_with(" ="));
                !longer_or_field && !definition
            })
        })
}

/// The script for `kinds`, composed and hashed once per set.
pub fn script_for(kinds: KindSet) -> &'static redis::Script {
    static SCRIPTS: [OnceLock<redis::Script>; 1 << SOURCES.len()] =
        [const { OnceLock::new() }; 1 << SOURCES.len()];
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

/// How many times one call loads its script again after NOSCRIPT before it gives up: a Redis
/// can forget the script again between the load and the retry (a second `SCRIPT FLUSH`, a
/// failover to a replica that never ran it), and one load then failed the call.
const NOSCRIPT_LOADS: usize = 3;

/// Sends `cmd`, an [`evalsha`] of `script`. On NOSCRIPT (a restarted or failed-over Redis
/// forgot the script) it loads `script` and sends `cmd` again, as
/// `redis::ScriptInvocation::invoke_async` does, up to [`NOSCRIPT_LOADS`] times; on a cluster
/// the load reaches every master. A call in a `mode` that writes waits for the replicas
/// `redis.wait_replicas` asks for ([`crate::base::store::RedisConn::query_committing`]).
pub async fn call<T: FromRedisValue>(
    script: &redis::Script,
    cmd: &redis::Cmd,
    mode: Mode,
    conn: &mut crate::base::store::RedisConn,
) -> redis::RedisResult<T> {
    let mut loads = 0;
    loop {
        match send(cmd, mode, conn).await {
            Err(e)
                if loads < NOSCRIPT_LOADS
                    && e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) =>
            {
                loads += 1;
                script.load_async(conn).await?;
            }
            reply => return reply,
        }
    }
}

async fn send<T: FromRedisValue>(
    cmd: &redis::Cmd,
    mode: Mode,
    conn: &mut crate::base::store::RedisConn,
) -> redis::RedisResult<T> {
    if mode == Mode::Check {
        cmd.query_async(conn).await
    } else {
        conn.query_committing(cmd).await
    }
}

/// What the driver does with a scope's rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Evaluate only; nothing is written.
    Check,
    /// Evaluate and, unless an enforcing rule refuses, consume.
    Commit,
    /// Give back what the message took, and the caller's claim on it.
    Refund,
    /// Take the message's in-flight claim alone (no rules).
    Claim,
    /// Extend the caller's claim.
    Renew,
    /// Drop the caller's claim.
    Release,
}

impl Mode {
    pub(super) fn arg(self) -> &'static str {
        match self {
            Mode::Check => "check",
            Mode::Commit => "commit",
            Mode::Refund => "refund",
            Mode::Claim => "claim",
            Mode::Renew => "renew",
            Mode::Release => "release",
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

/// The first number of every reply of lua/decide.lua (see its header), named once here.
pub mod code {
    /// The rules were checked and nothing was consumed (an enforcing rule refused, or the mode
    /// only checks); for `renew` and `release`, the caller's token does not hold the claim.
    pub const NOT_DONE: i64 = 0;
    /// The rules consumed (`commit`), the refund was made, or the claim was taken, renewed or
    /// released.
    pub const DONE: i64 = 1;
    /// The message id holds an unexpired dispatch mark: nothing was checked.
    pub const DISPATCHED: i64 = 2;
    /// Another delivery holds a live claim on the message id; the wait in ms follows.
    pub const IN_FLIGHT: i64 = 3;
}

/// A reply of the decision script, whatever its mode: the one place its numbers are read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// [`code::DONE`] or [`code::NOT_DONE`], with each rule's result in the order the rules
    /// were passed (none for the claim-only modes and for `refund`).
    Ran {
        /// Whether it was done: the scope's rules consumed, or the claim operation succeeded.
        done: bool,
        /// Each rule's result.
        results: Vec<RawResult>,
    },
    /// [`code::DISPATCHED`]: the message id holds an unexpired dispatch mark.
    Dispatched,
    /// [`code::IN_FLIGHT`]: another delivery holds a live claim on the message id, for this
    /// many more ms.
    InFlight {
        /// How long the other delivery's claim still runs.
        wait_ms: i64,
    },
}

impl FromRedisValue for Reply {
    fn from_redis_value(v: Value) -> Result<Self, ParsingError> {
        let Value::BulkString(text) = v else {
            return Err(format!("decision script replied {v:?}, expected a string").into());
        };
        Reply::parse(&text)
    }
}

impl Reply {
    /// Reads a reply's numbers (lua/decide.lua: whole numbers separated by spaces, with a
    /// space before the first in a decision's reply).
    fn parse(text: &[u8]) -> Result<Reply, ParsingError> {
        let bad = |why: &str| -> ParsingError {
            format!(
                "decision script replied {:?}: {why}",
                String::from_utf8_lossy(text)
            )
            .into()
        };
        let mut numbers = Numbers(text);
        let done = match numbers
            .next()
            .transpose()
            .map_err(|()| bad("not numbers"))?
        {
            Some(code::DISPATCHED) => return Ok(Reply::Dispatched),
            Some(code::IN_FLIGHT) => {
                return match numbers.next() {
                    Some(Ok(wait_ms)) => Ok(Reply::InFlight { wait_ms }),
                    _ => Err(bad("3 without a wait")),
                }
            }
            Some(c) => c == code::DONE,
            None => return Err(bad("no reply code")),
        };
        let mut results = Vec::with_capacity(1);
        let mut rule = [0i64; 5];
        let mut filled = 0;
        for n in numbers {
            rule[filled] = n.map_err(|()| bad("not numbers"))?;
            filled += 1;
            if filled == rule.len() {
                results.push(RawResult {
                    allowed: rule[0] == 1,
                    already: rule[1] == 1,
                    remaining: rule[2],
                    retry: rule[3],
                    detail: rule[4],
                });
                filled = 0;
            }
        }
        // Five numbers per rule, one rule after another (lua/decide.lua).
        if filled != 0 {
            return Err(bad("not five numbers per rule"));
        }
        Ok(Reply::Ran { done, results })
    }
}

/// The whole numbers of a reply, read straight from its bytes: a reply is read for every
/// decision, and a string of six numbers is short.
struct Numbers<'a>(&'a [u8]);

impl Iterator for Numbers<'_> {
    type Item = Result<i64, ()>;

    fn next(&mut self) -> Option<Self::Item> {
        let start = self.0.iter().position(|&b| b != b' ')?;
        let rest = &self.0[start..];
        let end = rest.iter().position(|&b| b == b' ').unwrap_or(rest.len());
        self.0 = &rest[end..];
        let (negative, digits) = match rest[..end].split_first() {
            Some((b'-', digits)) => (true, digits),
            _ => (false, &rest[..end]),
        };
        if digits.is_empty() {
            return Some(Err(()));
        }
        let mut n: i64 = 0;
        for &d in digits {
            if !d.is_ascii_digit() {
                return Some(Err(()));
            }
            let digit = i64::from(d - b'0');
            n = match n.checked_mul(10).and_then(|n| {
                if negative {
                    n.checked_sub(digit)
                } else {
                    n.checked_add(digit)
                }
            }) {
                Some(n) => n,
                None => return Some(Err(())),
            };
        }
        Some(Ok(n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn helpers(source: &str) -> Vec<&str> {
        PRELUDE
            .split("\n\n")
            .filter_map(helper_name)
            .filter(|name| source.contains(&format!("local function {name}(")))
            .collect()
    }

    #[test]
    fn a_script_defines_only_the_prelude_helpers_something_in_it_uses() {
        // The driver itself needs no helper (claims are keys Redis expires): a script keeps
        // only what its kinds use.
        let headline = source_for(KindSet::of(["calendar_quota"]));
        assert_eq!(helpers(&headline), ["int", "expire_in_at_least"]);
        // gcra calls remember, which calls expire_in_at_least: kept through remember.
        let (_, gcra_file) = SOURCES
            .iter()
            .find(|(kind, _)| *kind == "gcra")
            .expect("gcra is a kind");
        assert!(!uses(gcra_file, "expire_in_at_least") && uses(gcra_file, "remember"));
        let gcra = source_for(KindSet::of(["gcra"]));
        assert_eq!(
            helpers(&gcra),
            [
                "int",
                "expire_in_at_least",
                "ceil_div",
                "mul_div",
                "admitted_at",
                "remember"
            ]
        );
        assert!(helpers(&source_for(KindSet::of(["quiet_hours"]))).is_empty());
        assert!(source_for(KindSet::ALL).starts_with(PRELUDE));
    }

    #[test]
    fn a_use_is_the_whole_name_in_code_not_a_longer_name_a_field_a_definition_or_a_comment() {
        assert!(uses("local x = int(3)", "int"));
        assert!(uses("return {int(a), 1}", "int"));
        assert!(uses("local t = NOW * tpm", "NOW"));
        assert!(!uses("local x = tonumber(3) print(1)", "int"));
        assert!(!uses("local function int(x)", "int"));
        assert!(!uses("t.int(1) t:int(2)", "int"));
        assert!(!uses("local NOW = NOW_ARG + 0", "NOW"));
        assert!(!uses("redis.call('ZADD', k, NOW_ARG, ID) -- at NOW", "NOW"));
    }

    #[test]
    fn the_names_a_text_uses_are_the_names_uses_finds() {
        let mut names: Vec<&str> = PRELUDE.split("\n\n").filter_map(helper_name).collect();
        names.extend(["x", "t", "local", "end", "KINDS", "int(", "a.b"]);
        let mut texts: Vec<String> = SOURCES.iter().map(|(_, s)| (*s).to_owned()).collect();
        texts.extend([PRELUDE, DRIVER].map(str::to_owned));
        texts.push(source_for(KindSet::ALL));
        texts.extend(
            [
                "local x = int(3)",
                "t.int(1) t:int(2) local function int(x)",
                "local NOW = NOW_ARG + 0 -- NOW",
                "é_int int·x inté local int =1 local  int = 2",
            ]
            .map(str::to_owned),
        );
        for text in &texts {
            for name in &names {
                let by_tokens =
                    name.chars().all(word_char) && names_used(text).any(|used| used == *name);
                let by_search = !name.is_empty() && uses(text, name);
                if name.chars().all(word_char) {
                    assert_eq!(
                        by_tokens,
                        by_search,
                        "{name:?} in {:?}",
                        &text[..40.min(text.len())]
                    );
                }
            }
        }
        let used = names_used("a.b c:d(e) -- f\nlocal function g(h) local i = j end");
        let one_letter: Vec<&str> = used.filter(|name| name.len() == 1).collect();
        assert_eq!(one_letter, ["a", "c", "e", "h", "j"]);
    }

    #[test]
    fn a_value_of_the_prelude_is_converted_only_in_scripts_that_read_it() {
        let defines = |source: &str, name: &str| source.contains(&format!("\nlocal {name} = "));
        // The calendar quota and the driver read the message's instant as the worker wrote it.
        let headline = source_for(KindSet::of(["calendar_quota"]));
        assert!(!defines(&headline, "NOW") && !defines(&headline, "COST"));
        let gcra = source_for(KindSet::of(["gcra"]));
        assert!(defines(&gcra, "NOW") && !defines(&gcra, "COST"));
        let token_bucket = source_for(KindSet::of(["token_bucket"]));
        assert!(defines(&token_bucket, "NOW") && defines(&token_bucket, "COST"));
    }

    #[test]
    fn a_reply_is_the_committed_flag_then_five_numbers_per_rule() {
        let text = |t: &str| Reply::from_redis_value(Value::BulkString(t.as_bytes().to_vec()));
        let reply = text(" 1 1 0 2 -1 0 0 0 0 20545 1").expect("a flat reply");
        let Reply::Ran { done, results } = reply else {
            panic!("a decision, not {reply:?}");
        };
        assert!(done);
        assert_eq!(
            results,
            [
                RawResult {
                    allowed: true,
                    already: false,
                    remaining: 2,
                    retry: -1,
                    detail: 0
                },
                RawResult {
                    allowed: false,
                    already: false,
                    remaining: 0,
                    retry: 20545,
                    detail: 1
                },
            ]
        );
        assert!(matches!(text("2"), Ok(Reply::Dispatched)));
        assert!(matches!(
            text("3 1500"),
            Ok(Reply::InFlight { wait_ms: 1500 })
        ));
        assert!(matches!(
            text(" 0"),
            Ok(Reply::Ran { done: false, results }) if results.is_empty()
        ));
        assert!(matches!(
            text(" 0 0 0 0 -9223372036854775808 9223372036854775807"),
            Ok(Reply::Ran { results, .. })
                if results[0].retry == i64::MIN && results[0].detail == i64::MAX
        ));
        for bad in [
            "0 1 0",
            "3",
            "",
            "1 x 0 0 0 0",
            " 1 1 0 2.5 -1 0",
            " 1 1 0 - -1 0",
            " 1 1 0 1 -1 9223372036854775808",
        ] {
            assert!(text(bad).is_err(), "{bad:?}");
        }
        let array = Reply::from_redis_value(Value::Array(vec![Value::Int(1)]));
        assert!(array.is_err(), "{array:?}");
    }
}
