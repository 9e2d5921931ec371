//! Decisions per second of the limiter path (policy + one script call per scope, no broker),
//! per kind, each kind alone in a policy, against local Redis; and, from Redis's
//! `INFO commandstats`, the time Redis spent inside the decision script and the commands the
//! script ran, per decision: the figures to compare when a kind's script changes (Redis's own
//! counters, so they do not depend on how busy the client side is).
//!
//! Then the headline path, `--versus N` decisions, `--versus-concurrency C` in flight (50), each
//! to a new recipient (all allowed): as the row above decides (`Limiter::evaluate`: the calendar
//! quota and the dispatch-mark read in one EVALSHA) and as the worker decides
//! (`Limiter::evaluate_claimed`: with the in-flight claim too), against the six commands that
//! call runs with its keys and arguments and no logic (its floor), against rate-limiter-flexible's
//! fixed-window counter script (no Node here: the same three commands over this bench's redis-rs
//! client) and against a bare script of three commands (SET, PEXPIRE, GET), in alternating
//! slices: decisions per second, and what each call costs Redis (its process's CPU time, when it
//! runs on this machine, and its time inside EVALSHA).
//! Run it against a private Redis (`deploy/local/redis-private.sh single DIR`, then
//! `SENDQUOTA_REDIS_URL=<the URL it prints>`): Redis's figures are server-wide.
//!
//! Last, the first messages of `--hostile` distinct recipients whose ids are hostile to key
//! building (braces, colons, percent signs, emoji), each allowed and given one key, against
//! the budget of 30 s for 100,000 that the suite once asserted.
//!
//! `cargo bench --bench decisions -- [--decisions N] [--concurrency C] [--recipients R]
//! [--versus N] [--versus-concurrency C] [--hostile N] [--threads N]`

#[allow(dead_code)]
mod common;
#[path = "../tests/it/support/mod.rs"]
#[allow(dead_code)] // Each bench uses a part of the tests' harness.
mod support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use chrono::{DateTime, Duration, Utc};
use futures_util::StreamExt;
use sendquota::config::Settings;
use sendquota::internals::claim::Claim;
use sendquota::internals::limiter::Limiter;
use sendquota::internals::message::SendRequest;
use sendquota::internals::policy::Policy;
use sendquota::internals::store::RedisConn;

const KINDS: [(&str, &str); 11] = [
    ("calendar_quota (headline)", "kind = \"calendar_quota\""),
    ("fixed_window", "kind = \"fixed_window\"\nlimit = 5\nwindow = \"1h\""),
    ("sliding_window hash", "kind = \"sliding_window\"\nlimit = 5\nwindow = \"1h\"\nsub_window = \"1m\""),
    ("sliding_window list", "kind = \"sliding_window\"\nlimit = 5\nwindow = \"1h\"\nsub_window = \"1m\"\nstorage = \"list\""),
    ("sliding_log", "kind = \"sliding_log\"\nsub_window = \"1m\"\npolicies = [{ limit = 3, window = \"10m\" }, { limit = 5, window = \"1h\" }]"),
    ("leaky_bucket", "kind = \"leaky_bucket\"\ncapacity = 5\nrate = 1\nperiod = \"1m\""),
    ("token_bucket", "kind = \"token_bucket\"\ncapacity = 5\nrate = 1\nperiod = \"1m\""),
    ("gcra", "kind = \"gcra\"\nrate = 5\nperiod = \"1h\"\nburst = 5"),
    ("zset_window", "kind = \"zset_window\"\nlimit = 5\nwindow = \"1h\""),
    ("quiet_hours", "kind = \"quiet_hours\"\nstart = \"22:00\"\nend = \"08:00\""),
    ("send_window", "kind = \"send_window\"\nwindows = { mon = [\"09:00-17:30\"], sat = [\"10:00-14:00\"] }"),
];

/// rate-limiter-flexible's fixed-window counter as the stand-in the headline path is compared
/// with: add the points to the window's counter, give a new window its expiry, read the time
/// left; three commands, one key, two arguments, as its Redis store's script.
const FIXED_WINDOW_COUNTER: &str = "\
local n = redis.call('INCRBY', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2], 'NX')
return {n, redis.call('PTTL', KEYS[1])}";

/// The worker's call with no logic: the six commands `Limiter::evaluate_claimed` makes Redis
/// run for a new recipient (the dispatch mark and the claim read, the calendar quota read and
/// written with its expiry, the claim taken), on the same four keys with the same nineteen
/// arguments. What the call cannot cost less than without fewer keys, arguments or commands:
/// the floor the worker's call is held to beside rate-limiter-flexible's.
const COMMANDS_FLOOR: &str = "\
redis.call('ZSCORE', KEYS[3], ARGV[2])
redis.call('GET', KEYS[4])
redis.call('ZRANGE', KEYS[1], '0', '-1', 'WITHSCORES')
redis.call('ZADD', KEYS[1], ARGV[1], ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[16])
redis.call('SET', KEYS[4], ARGV[18], 'PX', ARGV[19])
return ' 1 1 0 0 -1 0'";

/// The sides of the comparison, in the order each round runs them.
#[derive(Clone, Copy)]
enum Side {
    Headline,
    HeadlineClaimed,
    CommandsFloor,
    FixedWindow,
    Bare,
}

impl Side {
    const ALL: [Side; 5] = [
        Side::Headline,
        Side::HeadlineClaimed,
        Side::CommandsFloor,
        Side::FixedWindow,
        Side::Bare,
    ];

    fn name(self) -> &'static str {
        match self {
            Side::Headline => "headline: evaluate (quota, mark)",
            Side::HeadlineClaimed => "headline: evaluate_claimed (+ claim)",
            Side::CommandsFloor => "its six commands alone (no logic)",
            Side::FixedWindow => "fixed-window counter script",
            Side::Bare => "bare script: SET, PEXPIRE, GET",
        }
    }
}

/// What one side cost over its slices.
#[derive(Default, Clone, Copy)]
struct Cost {
    calls: usize,
    allowed: usize,
    secs: f64,
    /// The Redis server's CPU time, in microseconds (`INFO cpu`).
    redis_us: u64,
    /// Microseconds inside EVALSHA and commands run by scripts, from INFO commandstats.
    evalsha_us: u64,
    inner_commands: u64,
}

fn policy(rule: &str) -> Policy {
    Settings::from_toml(&format!("[[rules]]\nname = \"r\"\n{rule}\n"), |_| None)
        .expect("bench policy is valid")
        .policy
}

/// Runs `n` committed decisions over `recipients` recipients, `concurrency` at a time, one
/// simulated millisecond apart; returns decisions per second and the share allowed.
async fn run(
    limiter: &Limiter,
    policy: &Arc<Policy>,
    n: usize,
    concurrency: usize,
    recipients: usize,
) -> (f64, f64) {
    let start: DateTime<Utc> = "2026-04-01T12:00:00Z".parse().expect("instant");
    let messages: Vec<SendRequest> = (0..n)
        .map(|i| {
            let body = support::request(&format!("m{i}"), &format!("r{}", i % recipients), "UTC");
            SendRequest::decode(body.to_string().as_bytes(), 1 << 16).expect("valid")
        })
        .collect();
    let began = Instant::now();
    let allowed: usize = futures_util::stream::iter(messages.iter().enumerate())
        .map(|(i, m)| {
            let policy = policy.clone();
            async move {
                let at = start + Duration::milliseconds(i as i64);
                let e = limiter
                    .evaluate(&policy, m, at, true)
                    .await
                    .expect("evaluate");
                usize::from(e.committed())
            }
        })
        .buffer_unordered(concurrency)
        .fold(0, |a, b| async move { a + b })
        .await;
    let secs = began.elapsed().as_secs_f64();
    (n as f64 / secs, allowed as f64 / n as f64)
}

/// Microseconds inside EVALSHA and commands run by the scripts, per decision, between two
/// snapshots of `common::command_stats`.
fn script_cost(
    before: &BTreeMap<String, (u64, u64)>,
    after: &BTreeMap<String, (u64, u64)>,
    n: usize,
) -> (f64, f64) {
    let (evalsha_us, inner) = script_totals(before, after);
    (evalsha_us as f64 / n as f64, inner as f64 / n as f64)
}

/// Microseconds inside EVALSHA, and how many commands the scripts ran, between two snapshots
/// of `common::command_stats`.
fn script_totals(
    before: &BTreeMap<String, (u64, u64)>,
    after: &BTreeMap<String, (u64, u64)>,
) -> (u64, u64) {
    let delta = |name: &str| {
        let (c0, u0) = before.get(name).copied().unwrap_or((0, 0));
        let (c1, u1) = after.get(name).copied().unwrap_or((0, 0));
        (c1.saturating_sub(c0), u1.saturating_sub(u0))
    };
    let inner: u64 = after
        .keys()
        .filter(|name| !matches!(name.as_str(), "evalsha" | "info" | "script|load"))
        .map(|name| delta(name).0)
        .sum();
    (delta("evalsha").1, inner)
}

/// On the worker's runtime (`worker.threads`, current-thread by default), so the rates are the
/// worker's; `--threads N` runs it on the runtime of `worker.threads = N` instead (0: one
/// worker thread per CPU, the multi-thread runtime earlier sessions measured on).
fn main() {
    let threads = common::flag(
        "--threads",
        sendquota::config::WorkerSettings::default().threads,
    );
    sendquota::cli::runtime(threads)
        .expect("tokio runtime")
        .block_on(bench());
}

async fn bench() {
    let n = common::flag("--decisions", 50_000);
    let concurrency = common::flag("--concurrency", 128);
    let recipients = common::flag("--recipients", 10_000);
    let redis = support::connect_redis(&support::single_settings()).await;
    let namespace = support::unique("sqtbench");
    let limiter = Limiter::new(redis.clone(), &namespace);
    println!(
        "{n} decisions per kind, {concurrency} concurrent, {recipients} recipients, local Redis"
    );
    println!(
        "{:<28} {:>12} {:>9} {:>14} {:>14}",
        "kind", "decisions/s", "allowed", "script us/dec", "commands/dec"
    );
    for (name, rule) in KINDS {
        let policy = Arc::new(policy(rule));
        let before = common::command_stats(&mut redis.clone()).await;
        let (rate, allowed) = run(&limiter, &policy, n, concurrency, recipients).await;
        let (script_us, commands) =
            script_cost(&before, &common::command_stats(&mut redis.clone()).await, n);
        println!(
            "{name:<28} {rate:>12.0} {:>8.0}% {script_us:>14.2} {commands:>14.2}",
            allowed * 100.0
        );
        support::delete_keys(&mut redis.clone(), &format!("{namespace}:*")).await;
    }
    versus(
        &redis,
        &limiter,
        common::flag("--versus", 60_000),
        common::flag("--versus-concurrency", 50),
    )
    .await;
    support::delete_keys(&mut redis.clone(), &format!("{namespace}:*")).await;
    let hostile = common::flag("--hostile", 100_000);
    let policy = Arc::new(Policy::headline(chrono_tz::UTC));
    let started = Instant::now();
    let allowed = first_messages_to_hostile_ids(&limiter, &policy, hostile, concurrency).await;
    let took = started.elapsed();
    support::delete_keys(&mut redis.clone(), &format!("{namespace}:*")).await;
    let budget = 30.0 * hostile as f64 / 100_000.0;
    println!(
        "{hostile} first messages to hostile recipient ids: {allowed} allowed in {:.1} s \
         ({:.0}/s); budget {budget:.1} s: {}",
        took.as_secs_f64(),
        hostile as f64 / took.as_secs_f64(),
        if took.as_secs_f64() <= budget {
            "ok"
        } else {
            "SLOW"
        }
    );
}

/// Decides the first message of each of `n` recipients with hostile ids; returns how many
/// were allowed (all of them, when the key building is right).
async fn first_messages_to_hostile_ids(
    limiter: &Limiter,
    policy: &Arc<Policy>,
    n: usize,
    concurrency: usize,
) -> usize {
    let now: DateTime<Utc> = "2026-03-02T09:00:00Z".parse().expect("instant");
    futures_util::stream::iter(0..n)
        .map(|i| async move {
            let request = support::first_message_to_hostile_id(i);
            let evaluation = limiter
                .evaluate(policy, &request, now, true)
                .await
                .expect("redis answers");
            usize::from(evaluation.committed())
        })
        .buffer_unordered(concurrency)
        .fold(0, |sum, one| async move { sum + one })
        .await
}

/// What the comparison's calls share: the limiter and policy of the headline sides, the two
/// scripts, and a request per call (a new recipient each).
struct Versus<'a> {
    limiter: &'a Limiter,
    headline: Policy,
    at: DateTime<Utc>,
    prefix: String,
    /// One slice per side and round: call `i` of side `s` decides `messages[s * n + i]`.
    messages: Vec<SendRequest>,
    n: usize,
    fixed_window: redis::Script,
    bare: redis::Script,
    floor: redis::Script,
}

impl Versus<'_> {
    /// The commands floor's call for `message`: the worker's own EVALSHA for it
    /// (`Limiter::claimed_commands`, the same keys and arguments byte for byte) sent to the floor
    /// script instead of the decision script.
    fn floor_call(&self, message: &SendRequest, claim: &Claim) -> redis::Cmd {
        let worker = self
            .limiter
            .claimed_commands(&self.headline, message, self.at, claim);
        let [worker] = worker.as_slice() else {
            panic!("the headline rule is decided in one call");
        };
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(self.floor.get_hash());
        // After EVALSHA and the decision script's hash: the key count, keys and arguments.
        for arg in worker.args_iter().skip(2) {
            if let redis::Arg::Simple(bytes) = arg {
                cmd.arg(bytes);
            }
        }
        cmd
    }

    /// Call `i` of `side`; whether it was allowed.
    async fn call(&self, side: Side, i: usize, mut conn: RedisConn) -> bool {
        let message = &self.messages[side as usize * self.n + i];
        let key = |what: &str| format!("{}:{what}:{}", self.prefix, message.recipient);
        match side {
            Side::Headline => {
                let e = self
                    .limiter
                    .evaluate(&self.headline, message, self.at, true);
                e.await.expect("evaluate").committed()
            }
            Side::HeadlineClaimed => {
                let claim = Claim::new(30_000);
                let e = (self.limiter).evaluate_claimed(&self.headline, message, self.at, &claim);
                e.await.expect("evaluate_claimed").committed()
            }
            Side::CommandsFloor => {
                let claim = Claim::new(30_000);
                let _: String = self
                    .floor_call(message, &claim)
                    .query_async(&mut conn)
                    .await
                    .expect("commands floor script");
                true
            }
            Side::FixedWindow => {
                let (count, _ttl): (i64, i64) = self
                    .fixed_window
                    .key(key("fw"))
                    .arg(1)
                    .arg(3_600_000)
                    .invoke_async(&mut conn)
                    .await
                    .expect("fixed-window script");
                count <= 3
            }
            Side::Bare => {
                let _: String = (self.bare.key(key("bare")).arg("v").arg(3_600_000))
                    .invoke_async(&mut conn)
                    .await
                    .expect("bare script");
                true
            }
        }
    }
}

/// The headline path against the fixed-window counter and the bare script: `n` calls a side,
/// `concurrency` in flight, in rounds of alternating slices, each call to a key of its own.
async fn versus(redis: &RedisConn, limiter: &Limiter, n: usize, concurrency: usize) {
    const ROUNDS: usize = 4;
    let slice = n.div_ceil(ROUNDS);
    let n = slice * ROUNDS;
    let prefix = support::unique("vs");
    let versus = Versus {
        limiter,
        headline: Policy::headline(chrono_tz::UTC),
        at: "2026-04-01T12:00:00Z".parse().expect("instant"),
        messages: (0..Side::ALL.len() * n)
            .map(|i| {
                let body = support::request(&format!("m{i}"), &format!("{prefix}r{i}"), "UTC");
                SendRequest::decode(body.to_string().as_bytes(), 1 << 16).expect("valid")
            })
            .collect(),
        prefix,
        n,
        fixed_window: redis::Script::new(FIXED_WINDOW_COUNTER),
        bare: redis::Script::new(common::BARE_SCRIPT),
        floor: redis::Script::new(COMMANDS_FLOOR),
    };
    // Loaded first, so that no side's first calls are refused and sent again.
    for script in [&versus.fixed_window, &versus.bare, &versus.floor] {
        let loaded = script.load_async(&mut redis.clone()).await;
        loaded.expect("SCRIPT LOAD");
    }
    let mut costs = [Cost::default(); Side::ALL.len()];
    for round in 0..ROUNDS {
        let range = round * slice..(round + 1) * slice;
        for (side, cost) in Side::ALL.into_iter().zip(costs.iter_mut()) {
            let before = (
                common::command_stats(&mut redis.clone()).await,
                common::redis_cpu_us(&mut redis.clone()).await,
            );
            let began = Instant::now();
            let allowed: usize = futures_util::stream::iter(range.clone())
                .map(|i| versus.call(side, i, redis.clone()))
                .buffer_unordered(concurrency)
                .fold(0, |a, b| async move { a + usize::from(b) })
                .await;
            let secs = began.elapsed().as_secs_f64();
            let after = (
                common::command_stats(&mut redis.clone()).await,
                common::redis_cpu_us(&mut redis.clone()).await,
            );
            let (evalsha_us, inner) = script_totals(&before.0, &after.0);
            *cost = Cost {
                calls: cost.calls + range.len(),
                allowed: cost.allowed + allowed,
                secs: cost.secs + secs,
                redis_us: cost.redis_us + after.1.saturating_sub(before.1),
                evalsha_us: cost.evalsha_us + evalsha_us,
                inner_commands: cost.inner_commands + inner,
            };
        }
    }
    support::delete_keys(&mut redis.clone(), &format!("{}*", versus.prefix)).await;
    println!();
    println!(
        "{n} calls a side, {concurrency} in flight, each to a new key (all allowed), {ROUNDS} \
         rounds of alternating slices; Redis's CPU per call from INFO cpu (server-wide)"
    );
    print_versus(&costs);
}

/// The comparison's table, and the headline sides against the fixed-window counter (decisions
/// per second) and the bare script (Redis's time per call).
fn print_versus(costs: &[Cost; Side::ALL.len()]) {
    println!(
        "{:<40} {:>12} {:>8} {:>14} {:>16} {:>14} {:>13}",
        "side",
        "calls/s",
        "allowed",
        "redis CPU us",
        "calls/Redis-core-s",
        "evalsha us",
        "commands"
    );
    let redis_us = |c: &Cost| c.redis_us as f64 / c.calls.max(1) as f64;
    let evalsha_us = |c: &Cost| c.evalsha_us as f64 / c.calls.max(1) as f64;
    let rate = |c: &Cost| c.calls as f64 / c.secs;
    for (side, c) in Side::ALL.iter().zip(costs) {
        println!(
            "{:<40} {:>12.0} {:>7.0}% {:>14.2} {:>16.0} {:>14.2} {:>13.2}",
            side.name(),
            rate(c),
            100.0 * c.allowed as f64 / c.calls.max(1) as f64,
            redis_us(c),
            1e6 / redis_us(c),
            evalsha_us(c),
            c.inner_commands as f64 / c.calls.max(1) as f64
        );
    }
    let [headline, claimed, floor, fixed, bare] = costs;
    for (name, side) in [("evaluate", headline), ("evaluate_claimed", claimed)] {
        println!(
            "headline {name}: {:.2}x the fixed-window counter's decisions per second, {:.2}x \
             its decisions per Redis core-second; Redis's time per call {:.2}x the bare \
             script's CPU, {:.2}x inside EVALSHA",
            rate(side) / rate(fixed),
            redis_us(fixed) / redis_us(side),
            redis_us(side) / redis_us(bare),
            evalsha_us(side) / evalsha_us(bare)
        );
    }
    println!(
        "headline evaluate_claimed: Redis's CPU per call {:.2}x its six commands' alone (the \
         floor of a call with its keys, arguments and commands); those alone {:.2}x the \
         fixed-window counter's",
        redis_us(claimed) / redis_us(floor),
        redis_us(floor) / redis_us(fixed)
    );
}
