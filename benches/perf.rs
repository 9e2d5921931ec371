//! One run that measures sendquota against its ceilings and prints every figure with its ratio
//! to the ceiling or target:
//!
//! - (a1) ceiling: the calendar_quota decision script driven by a bare pipelined redis-rs loop
//!   (the exact EVALSHA the limiter sends for the headline rule), decisions/s;
//! - (a2) ceiling: a no-work relay through RabbitMQ from a quorum queue to the dispatch
//!   exchange (prefetch 1000, publisher confirms and acks handled concurrently), msgs/s. It
//!   keeps its own prefetch whatever the worker's: it is the broker's and the client's best,
//!   and a ceiling lowered to the worker's setting would flatter (c)'s ratio;
//! - (b) the decision path (`Limiter::evaluate`, commit, no broker): the headline rule alone and
//!   with two more kinds, against (a1);
//! - (c) the worker binary end to end (quorum queue, half dispatched and half denied), at its
//!   DEFAULT settings (prefetch and concurrency from src/config.rs; `--worker-prefetch N` sets
//!   both to N to measure a candidate default), against (a2), with p50/p99 decision latency
//!   from its /metrics histogram; run twice like the relay, each run timed from the worker's
//!   readiness as the relay times itself from its open channels. The binary is this package's,
//!   or the one `SENDQUOTA_PERF_WORKER_BIN=/path/to/sendquota` names (another build of the
//!   worker, an older commit's), so that one bench binary drives both sides of an A/B;
//! - (d) the worker's CPU per message and peak RSS, beside the floor under it: the same broker
//!   work (the worker's publisher and settler, half the messages published, coalesced acks, the
//!   worker's prefetch and concurrency) with nothing decided, run in this process between the
//!   two runs of (c);
//! - (e) Redis memory per active recipient, and the decision rate over 1,000,000 recipients
//!   against 10,000 (both pools drawn from 1,000,000 pre-populated recipients' keys);
//! - (f) a hot-recipient workload: new messages to 100 recipients whose whole window is full,
//!   so every one is denied, decided by the decision path without and with the in-process deny
//!   cache, against each other (target: over 1.5x) and against the bare pipelined EVALSHA loop
//!   on the same denials (the Redis ceiling for denials, which the cache should exceed);
//! - (g) publish-to-dispatch latency at half the maximum rate: the worker (same binary and
//!   settings as (c)) on an empty namespace, requests published at half of (c)'s rate, paced
//!   every 2 ms, for `--latency-seconds` (after a 1 s warm-up that is not counted), each
//!   carrying its publish instant in its payload (`sent_ns`) and each admitted (distinct
//!   recipients); a consumer on the dispatch sink takes receive minus publish instant: p50,
//!   p99 and max against 20 ms for the p99. Before it, the same with the relay of (a2) in the
//!   worker's place: the broker's (and this process's) share of that latency.
//!
//! Besides, every phase reports the CPU time each process spent per operation (this process,
//! Redis and the part of it executing scripts, RabbitMQ, Postgres, the worker, everything
//! else, idle) so it shows where the time goes on a small machine. The machine may be shared:
//! figures compared with each other ((a1) and (b), the two pools of (e), the three sides of
//! (f)) run in alternating slices, (a2) and (c) run twice each in the order a2 c c a2 (the
//! floor of (d) between the two runs of (c)), and a phase during which
//! other processes took more than 15% of the machine is named in a warning.
//!
//! `cargo bench --bench perf -- [--decisions N] [--concurrency C] [--pipeline P] [--in-flight F]
//! [--messages M] [--recipients R] [--small-recipients S] [--pool-decisions D] [--sample K]
//! [--hot-recipients H] [--hot-decisions N] [--worker-prefetch N] [--latency-seconds S]`
//! (cargo runs the bench executable as `perf-HASH --bench ARGS`; it can be run so directly).

#[allow(dead_code)]
mod common;
#[path = "../tests/it/support/mod.rs"]
#[allow(dead_code)] // Each bench uses a part of the tests' harness.
mod support;

use std::collections::BTreeMap;
use std::ops::Range;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use futures_util::stream::FuturesUnordered;
use futures_util::StreamExt;
use lapin::options::{QueueDeclareOptions, QueuePurgeOptions};
use lapin::types::FieldTable;
use lapin::BasicProperties;
use redis::aio::MultiplexedConnection;
use redis::Value;
use sendquota::acks::Settler;
use sendquota::broker::{Names, Publisher};
use sendquota::config::{QueueType, Settings};
use sendquota::dedup::recipient_sent_key;
use sendquota::deny_cache::DenyCache;
use sendquota::kinds::calendar::{day_number, day_start, window_reach};
use sendquota::limiter::keys::{ids_key, rule_key, scope_tag};
use sendquota::limiter::script::{script_for, source_for, KindSet};
use sendquota::limiter::Limiter;
use sendquota::message::SendRequest;
use sendquota::policy::{Policy, ScopeValue};
use support::{request, TestEnv};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::Semaphore;

/// The worker's allocator, so that the broker floor of (d), run in this process, pays what the
/// worker pays for its allocations.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The instant every decision phase is anchored on. Decision `i` is simulated at `+i` ms, and
/// from noon up to 43 million decisions stay on one UTC day.
const BASE: &str = "2026-04-01T12:00:00Z";
/// The worker's fixed clock in the end-to-end phase.
const WORKER_NOW: &str = "2026-02-02T12:00:00Z";
/// Days between pre-populated state and the measured decisions in (e): inside the 7-day
/// window, so every measured recipient has one earlier send in its window.
const PREPOPULATE_DAYS_BEFORE: i64 = 4;

/// The headline rule plus a channel-scope GCRA that never refuses at the simulated rate and a
/// recipient-scope sliding window that two sends never fill: two script calls per decision,
/// two rules in the first.
const THREE_RULES: &str = r#"
[[rules]]
name = "headline"
kind = "calendar_quota"

[[rules]]
name = "sms_rate"
kind = "gcra"
rate = 100000
period = "1s"
scope = "channel"

[[rules]]
name = "burst"
kind = "sliding_window"
limit = 5
window = "1h"
sub_window = "1m"
"#;

// Targets.
const DECISION_PATH_MIN_RATIO: f64 = 0.90;
const END_TO_END_MIN_RATIO: f64 = 0.80;
const CPU_MAX_US_PER_MSG: f64 = 25.0;
const RSS_MAX_MIB: f64 = 100.0;
const BYTES_MAX_PER_RECIPIENT: f64 = 200.0;
const SCALE_MAX_LOSS: f64 = 0.10;
const DENY_CACHE_MIN_SPEEDUP: f64 = 1.5;
/// Prefetch of the relay ceiling (a2). The worker of (c) runs at its own settings.
const E2E_PREFETCH: u16 = 1000;
const LATENCY_MAX_P99_MS: f64 = 20.0;
/// (g) publishes every PACE, as many requests as are due by then.
const PACE: Duration = Duration::from_millis(2);
/// (g) publishes this long at its rate before the counted part.
const LATENCY_WARM_UP: Duration = Duration::from_secs(1);
/// How often (c) asks the starting worker whether it is ready.
const READY_POLL: Duration = Duration::from_millis(1);

struct Args {
    decisions: usize,
    concurrency: usize,
    pipeline: usize,
    in_flight: usize,
    messages: usize,
    recipients: usize,
    small_recipients: usize,
    pool_decisions: usize,
    sample: usize,
    hot_recipients: usize,
    hot_decisions: usize,
    /// 0: the worker's defaults.
    worker_prefetch: usize,
    latency_seconds: usize,
}

fn args() -> Args {
    let mut out = Args {
        decisions: 200_000,
        concurrency: 256,
        pipeline: 256,
        in_flight: 4,
        messages: 60_000,
        recipients: 1_000_000,
        small_recipients: 10_000,
        pool_decisions: 100_000,
        sample: 1_000,
        hot_recipients: 100,
        hot_decisions: 200_000,
        worker_prefetch: 0,
        latency_seconds: 10,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let slot = match a.as_str() {
            "--decisions" => &mut out.decisions,
            "--concurrency" => &mut out.concurrency,
            "--pipeline" => &mut out.pipeline,
            "--in-flight" => &mut out.in_flight,
            "--messages" => &mut out.messages,
            "--recipients" => &mut out.recipients,
            "--small-recipients" => &mut out.small_recipients,
            "--pool-decisions" => &mut out.pool_decisions,
            "--sample" => &mut out.sample,
            "--hot-recipients" => &mut out.hot_recipients,
            "--hot-decisions" => &mut out.hot_decisions,
            "--worker-prefetch" => &mut out.worker_prefetch,
            "--latency-seconds" => &mut out.latency_seconds,
            "--bench" => continue,
            other => {
                eprintln!(
                    "unknown argument {other}; flags: --decisions --concurrency --pipeline \
                     --in-flight --messages --recipients --small-recipients --pool-decisions \
                     --sample --hot-recipients --hot-decisions --worker-prefetch \
                     --latency-seconds (each takes a whole number)"
                );
                std::process::exit(2)
            }
        };
        *slot = match it.next().and_then(|v| v.parse().ok()) {
            Some(v) if v > 0 => v,
            _ => {
                eprintln!("{a} takes a whole number above zero");
                std::process::exit(2)
            }
        };
    }
    // Two decisions per recipient, in SLICES equal slices; the pools of (e) are disjoint
    // (the small one at most half the recipients) and a pool run is whole rounds of the small
    // pool.
    out.decisions = out.decisions.div_ceil(2 * SLICES) * 2 * SLICES;
    out.messages = out.messages.div_ceil(2) * 2;
    out.recipients = out.recipients.max(2);
    out.small_recipients = out.small_recipients.min(out.recipients / 2);
    let round = 2 * out.small_recipients;
    let cap = 2 * (out.recipients - out.small_recipients);
    out.pool_decisions = (out.pool_decisions.min(cap) / round).max(1) * round;
    // Each side of (f) decides in SLICES equal slices.
    out.hot_decisions = out.hot_decisions.div_ceil(SLICES) * SLICES;
    if u16::try_from(out.worker_prefetch).is_err() {
        eprintln!("--worker-prefetch takes at most {}", u16::MAX);
        std::process::exit(2)
    }
    out
}

fn instant(s: &str) -> DateTime<Utc> {
    s.parse().expect("instant")
}

/// Prints a progress line on stderr at most once a second.
struct Progress {
    label: String,
    total: usize,
    done: usize,
    began: Instant,
    last: Instant,
}

impl Progress {
    fn new(label: &str, total: usize) -> Progress {
        eprintln!("[{label}] {total} to go");
        Progress {
            label: label.to_owned(),
            total,
            done: 0,
            began: Instant::now(),
            last: Instant::now(),
        }
    }

    /// Counts `k` more done.
    fn add(&mut self, k: usize) {
        self.done += k;
        if self.last.elapsed() >= Duration::from_secs(1) {
            self.last = Instant::now();
            eprintln!(
                "[{}] {}/{} after {:.1} s",
                self.label,
                self.done,
                self.total,
                self.began.elapsed().as_secs_f64()
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// CPU accounting from /proc: where the time goes.

fn clock_ticks_per_second() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100.0)
}

/// utime + stime of `pid` in clock ticks.
fn cpu_ticks(pid: &str) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // Fields after the command name start at field 3 (state); utime is 14, stime 15.
    Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
}

/// Process ids whose command name is `comm`.
fn pids_named(comm: &str) -> Vec<String> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(Result::ok)
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|name| name.bytes().all(|b| b.is_ascii_digit()))
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .map(|c| c.trim() == comm)
                .unwrap_or(false)
        })
        .collect()
}

/// The first number after `field` in /proc/PID/`file` (VmHWM in status is in KiB), 0 if the
/// process or the field is gone.
fn proc_number(pid: u32, file: &str, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/{file}"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l[field.len()..].split_whitespace().next())
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

/// The processes whose CPU time each phase reports.
struct Procs {
    /// For INFO commandstats.
    conn: MultiplexedConnection,
    redis: String,
    rabbit: Vec<String>,
    tick_us: f64,
}

#[derive(Clone, Copy, Default)]
struct CpuSnap {
    /// The whole machine: busy and idle ticks over every core (from /proc/stat).
    busy: u64,
    idle: u64,
    bench: u64,
    redis: u64,
    rabbit: u64,
    postgres: u64,
    worker: u64,
    /// Microseconds Redis spent executing EVALSHA (the scripts), from INFO commandstats.
    lua_us: u64,
    /// Context switches of Redis's main thread: how often it went to sleep and woke up.
    redis_switches: u64,
}

impl Procs {
    async fn find(conn: &mut MultiplexedConnection) -> Procs {
        let info: String = redis::cmd("INFO")
            .arg("server")
            .query_async(conn)
            .await
            .expect("INFO server");
        let redis = info
            .lines()
            .find_map(|l| l.strip_prefix("process_id:"))
            .map(|p| p.trim().to_owned())
            .unwrap_or_default();
        Procs {
            conn: conn.clone(),
            redis,
            rabbit: pids_named("beam.smp"),
            tick_us: 1e6 / clock_ticks_per_second(),
        }
    }

    async fn snap(&self, worker: Option<u32>) -> CpuSnap {
        let lua_us = common::command_stats(&mut self.conn.clone())
            .await
            .get("evalsha")
            .map_or(0, |&(_, us)| us);
        let (busy, idle) = machine_ticks();
        CpuSnap {
            lua_us,
            redis_switches: std::fs::read_to_string(format!("/proc/{}/status", self.redis))
                .unwrap_or_default()
                .lines()
                .filter(|l| l.contains("ctxt_switches:"))
                .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                .sum(),
            busy,
            idle,
            bench: cpu_ticks("self").unwrap_or(0),
            redis: cpu_ticks(&self.redis).unwrap_or(0),
            rabbit: self.rabbit.iter().filter_map(|p| cpu_ticks(p)).sum(),
            // Backends come and go; what exited during the phase is missed (a little).
            postgres: pids_named("postgres")
                .iter()
                .filter_map(|p| cpu_ticks(p))
                .sum(),
            worker: worker.and_then(|p| cpu_ticks(&p.to_string())).unwrap_or(0),
        }
    }
}

/// Busy and idle ticks of the whole machine since boot, summed over cores.
fn machine_ticks() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let Some(cpu) = stat.lines().find(|l| l.starts_with("cpu ")) else {
        return (0, 0);
    };
    // user nice system idle iowait irq softirq steal (guest time is inside user).
    let v: Vec<u64> = cpu
        .split_whitespace()
        .skip(1)
        .take(8)
        .map(|x| x.parse().unwrap_or(0))
        .collect();
    let at = |i: usize| v.get(i).copied().unwrap_or(0);
    (at(0) + at(1) + at(2) + at(5) + at(6) + at(7), at(3) + at(4))
}

impl CpuSnap {
    /// `later - self`, field by field.
    fn until(self, later: CpuSnap) -> CpuSnap {
        CpuSnap {
            busy: later.busy.saturating_sub(self.busy),
            idle: later.idle.saturating_sub(self.idle),
            bench: later.bench.saturating_sub(self.bench),
            redis: later.redis.saturating_sub(self.redis),
            rabbit: later.rabbit.saturating_sub(self.rabbit),
            postgres: later.postgres.saturating_sub(self.postgres),
            worker: later.worker.saturating_sub(self.worker),
            lua_us: later.lua_us.saturating_sub(self.lua_us),
            redis_switches: later.redis_switches.saturating_sub(self.redis_switches),
        }
    }

    fn plus(self, o: CpuSnap) -> CpuSnap {
        CpuSnap {
            busy: self.busy + o.busy,
            idle: self.idle + o.idle,
            bench: self.bench + o.bench,
            redis: self.redis + o.redis,
            rabbit: self.rabbit + o.rabbit,
            postgres: self.postgres + o.postgres,
            worker: self.worker + o.worker,
            lua_us: self.lua_us + o.lua_us,
            redis_switches: self.redis_switches + o.redis_switches,
        }
    }
}

/// What one measured phase did, summed over its slices.
#[derive(Default)]
struct Tally {
    ops: usize,
    allowed: usize,
    wall: Duration,
    cpu: CpuSnap,
}

impl Tally {
    fn add(&mut self, before: CpuSnap, after: CpuSnap, ops: usize, allowed: usize, wall: Duration) {
        self.ops += ops;
        self.allowed += allowed;
        self.wall += wall;
        self.cpu = self.cpu.plus(before.until(after));
    }

    fn rate(&self) -> f64 {
        self.ops as f64 / self.wall.as_secs_f64()
    }

    fn allowed_pct(&self) -> f64 {
        100.0 * self.allowed as f64 / self.ops.max(1) as f64
    }
}

/// CPU microseconds per operation of one phase, per process; `other` is every other process
/// on the machine (another build, say), `idle` what no process used.
struct CpuUse {
    phase: String,
    ops: usize,
    wall: f64,
    bench: f64,
    redis: f64,
    rabbit: f64,
    postgres: f64,
    worker: f64,
    other: f64,
    idle: f64,
    lua: f64,
    /// Redis main-thread context switches per operation.
    redis_switches: f64,
}

fn cpu_use(procs: &Procs, phase: &str, t: &Tally) -> CpuUse {
    let per = |ticks: u64| ticks as f64 * procs.tick_us / t.ops.max(1) as f64;
    let c = t.cpu;
    let known = per(c.bench) + per(c.redis) + per(c.rabbit) + per(c.postgres) + per(c.worker);
    CpuUse {
        phase: phase.to_owned(),
        ops: t.ops,
        wall: t.wall.as_secs_f64() * 1e6 / t.ops.max(1) as f64,
        bench: per(c.bench),
        redis: per(c.redis),
        rabbit: per(c.rabbit),
        postgres: per(c.postgres),
        worker: per(c.worker),
        other: (per(c.busy) - known).max(0.0),
        idle: per(c.idle),
        lua: c.lua_us as f64 / t.ops.max(1) as f64,
        redis_switches: c.redis_switches as f64 / t.ops.max(1) as f64,
    }
}

// ---------------------------------------------------------------------------------------------
// Redis helpers.

async fn multiplexed() -> MultiplexedConnection {
    redis::Client::open(support::redis_url())
        .expect("redis url")
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| panic!("redis not reachable: {e}; {}", support::START_HINT))
}

/// Removes every key matching `pattern` with SCAN and batched UNLINK; returns how many.
async fn purge(conn: &mut MultiplexedConnection, pattern: &str, label: &str) -> usize {
    let mut cursor: u64 = 0;
    let mut removed = 0usize;
    let mut last = Instant::now();
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(10_000)
            .query_async(conn)
            .await
            .expect("SCAN");
        if !keys.is_empty() {
            removed += redis::cmd("UNLINK")
                .arg(&keys)
                .query_async::<usize>(conn)
                .await
                .expect("UNLINK");
        }
        if last.elapsed() >= Duration::from_secs(1) {
            eprintln!("[{label}] unlinked {removed} keys so far");
            last = Instant::now();
        }
        cursor = next;
        if cursor == 0 {
            return removed;
        }
    }
}

/// Removes this run's keys when the bench is interrupted (Ctrl-C or SIGTERM), then exits 130.
/// Phase (e) alone leaves a million recipients' keys; left in a shared Redis they slowed every
/// later SCAN, and a whole test suite once ran out of time on them.
async fn purge_on_interrupt() {
    let Ok(mut term) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
    else {
        return;
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    eprintln!("perf: interrupted; removing this run's keys");
    let pattern = format!("sqt_{}_*", std::process::id());
    let removed = purge(&mut multiplexed().await, &pattern, "interrupted").await;
    eprintln!("perf: removed {removed} keys");
    std::process::exit(130);
}

async fn used_memory(conn: &mut MultiplexedConnection) -> i64 {
    let info: String = redis::cmd("INFO")
        .arg("memory")
        .query_async(conn)
        .await
        .expect("INFO memory");
    info.lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// The headline rule's key for a recipient, as the limiter names it.
fn headline_key(namespace: &str, recipient: &str) -> String {
    rule_key(
        namespace,
        &scope_tag(&ScopeValue::Recipient(recipient)),
        "headline",
        "calendar_quota",
    )
}

/// The bare decision loop: the limiter's exact EVALSHA for the headline rule, sent in
/// pipelines over one multiplexed connection, several pipelines in flight.
struct LuaLoop {
    conn: MultiplexedConnection,
    sha: String,
    namespace: String,
    pipeline: usize,
    in_flight: usize,
}

impl LuaLoop {
    /// Decides messages `range` at `at` (+1 ms per decision index); decision `i` is message
    /// `<prefix>m<i>` for recipient `<prefix><recipient(i)>`. Returns how many were admitted
    /// and the elapsed time.
    async fn run(
        &self,
        progress: &mut Progress,
        range: Range<usize>,
        prefix: &str,
        at: DateTime<Utc>,
        recipient: impl Fn(usize) -> usize,
    ) -> (usize, Duration) {
        // The worker's arguments for the headline rule (lua/kinds/calendar_quota.lua) in UTC.
        let today = day_number(at, chrono_tz::UTC);
        let at_ms = at.timestamp_millis();
        let day_begin = day_start(today, chrono_tz::UTC)
            .timestamp_millis()
            .to_string();
        let window_begin = day_start(today - 6, chrono_tz::UTC)
            .timestamp_millis()
            .to_string();
        let reach = window_reach(7).num_milliseconds();
        let today = today.to_string();
        let end = range.end;
        let began = Instant::now();
        let mut replies = futures_util::stream::iter(range.step_by(self.pipeline))
            .map(|first| {
                let mut pipe = redis::pipe();
                for i in first..(first + self.pipeline).min(end) {
                    let who = format!("{prefix}{}", recipient(i));
                    let key = headline_key(&self.namespace, &who);
                    let ids = ids_key(&key);
                    let marks = recipient_sent_key(&self.namespace, &who);
                    pipe.cmd("EVALSHA")
                        .arg(&self.sha)
                        .arg(3)
                        .arg(key)
                        .arg(ids)
                        .arg(marks)
                        .arg(at_ms + i as i64)
                        .arg(format!("{prefix}m{i}"))
                        .arg("commit")
                        .arg(1)
                        .arg(1)
                        .arg("calendar_quota")
                        .arg("1")
                        .arg("8")
                        .arg(&today)
                        .arg(&day_begin)
                        .arg(&window_begin)
                        .arg(1)
                        .arg(3)
                        .arg(7)
                        .arg(at_ms + i as i64 - reach)
                        .arg(reach);
                }
                let mut conn = self.conn.clone();
                async move { pipe.query_async::<Vec<Value>>(&mut conn).await }
            })
            .buffer_unordered(self.in_flight);
        let mut allowed = 0usize;
        while let Some(reply) = replies.next().await {
            let reply = reply.expect("EVALSHA pipeline");
            let k = reply.len();
            for v in reply {
                match v {
                    Value::Array(items) => {
                        allowed += usize::from(matches!(items.first(), Some(Value::Int(1))));
                    }
                    other => panic!("decision script replied {other:?}"),
                }
            }
            progress.add(k);
        }
        (allowed, began.elapsed())
    }
}

// ---------------------------------------------------------------------------------------------
// The decision path.

fn policy(toml: &str) -> Policy {
    Settings::from_toml(toml, |_| None)
        .expect("bench policy is valid")
        .policy
}

fn decode(id: &str, recipient: &str) -> SendRequest {
    SendRequest::decode(
        request(id, recipient, "UTC").to_string().as_bytes(),
        1 << 16,
    )
    .expect("valid request")
}

/// Runs `messages[range]` through `Limiter::evaluate` (commit), `concurrency` at a time,
/// message `i` at `at(i)`. Returns how many were admitted and the elapsed time.
#[allow(clippy::too_many_arguments)]
async fn evaluate_all(
    progress: &mut Progress,
    limiter: &Limiter,
    policy: &Arc<Policy>,
    messages: &[SendRequest],
    range: Range<usize>,
    at: impl Fn(usize) -> DateTime<Utc>,
    concurrency: usize,
) -> (usize, Duration) {
    let began = Instant::now();
    let mut results = futures_util::stream::iter(range.map(|i| (i, &messages[i])))
        .map(|(i, m)| {
            let when = at(i);
            async move {
                limiter
                    .evaluate(policy, m, when, true)
                    .await
                    .expect("evaluate")
                    .committed
            }
        })
        .buffer_unordered(concurrency);
    let (mut done, mut allowed) = (0usize, 0usize);
    while let Some(committed) = results.next().await {
        done += 1;
        allowed += usize::from(committed);
        if done.is_multiple_of(1024) {
            progress.add(1024);
        }
    }
    progress.add(done % 1024);
    (allowed, began.elapsed())
}

// ---------------------------------------------------------------------------------------------
// RabbitMQ helpers.

async fn queued(env: &TestEnv, queue: &str) -> usize {
    env.channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .map(|q| q.message_count() as usize)
        .unwrap_or(0)
}

/// Messages of (c) with an outcome: dispatched ones waiting in the sink plus denial rows. Polled
/// every 20 ms while the worker runs, so it must cost the measured services next to nothing: a
/// `count(*)` of the denials, scanning every row written so far, took Postgres 1-6 ms a call,
/// about a quarter of what the worker's own denial writes cost it. Denial ids drawn from the
/// sequence count instead; they can run ahead of committed rows (a batch in flight), so the
/// exact count is taken only once they say all `n` are done.
async fn outcomes(env: &TestEnv, n: usize) -> usize {
    let dispatched = queued(env, &env.dispatched_queue).await;
    let drawn: i64 = sqlx::query_scalar(
        "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM denials_id_seq",
    )
    .fetch_one(&env.pool)
    .await
    .expect("read the denial id sequence");
    let estimate = dispatched + usize::try_from(drawn).unwrap_or(0);
    if estimate < n {
        return estimate;
    }
    dispatched + env.denial_rows().await as usize
}

/// Request bodies: two per recipient on one day, so half are dispatched and half denied.
fn bodies(n: usize) -> Vec<Vec<u8>> {
    (0..n)
        .map(|i| {
            request(&format!("m{i}"), &format!("r{}", i / 2), "UTC")
                .to_string()
                .into_bytes()
        })
        .collect()
}

/// Publishes `bodies` to the requests exchange (publisher-confirmed, 512 in flight) and waits
/// until the requests queue holds them all.
async fn prepublish(env: &TestEnv, bodies: &[Vec<u8>], label: &str) {
    let mut progress = Progress::new(label, bodies.len());
    let mut confirms = futures_util::stream::iter(bodies.iter())
        .map(|b| {
            env.publisher
                .publish(&env.names.requests, "", b, BasicProperties::default())
        })
        .buffer_unordered(512);
    while let Some(r) = confirms.next().await {
        r.expect("publish request");
        progress.add(1);
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while queued(env, &env.names.requests).await < bodies.len() {
        assert!(Instant::now() < deadline, "requests queue never filled");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A channel on `conn` with prefetch `prefetch`, for consuming.
async fn prefetching_channel(conn: &lapin::Connection, prefetch: u16) -> lapin::Channel {
    let channel = conn.create_channel().await.expect("channel");
    channel
        .basic_qos(prefetch, lapin::options::BasicQosOptions::default())
        .await
        .expect("qos");
    channel
}

/// Starts consuming the requests queue of `names` on `channel`.
async fn consume_requests(channel: &lapin::Channel, names: &Names) -> lapin::Consumer {
    channel
        .basic_consume(
            names.requests.as_str().into(),
            "sendquota-perf".into(),
            lapin::options::BasicConsumeOptions::default(),
            lapin::types::FieldTable::default(),
        )
        .await
        .expect("consume")
}

/// A consuming and a publishing connection to the test broker, as the worker opens them.
async fn connection_pair(role: &str) -> (lapin::Connection, lapin::Connection) {
    let settings = sendquota::config::AmqpSettings {
        url: support::amqp_url(),
        ..Default::default()
    };
    let consume = sendquota::broker::connect(&settings, &format!("{role}-consume"))
        .await
        .expect("amqp connect");
    let publish = sendquota::broker::connect(&settings, &format!("{role}-publish"))
        .await
        .expect("amqp connect");
    (consume, publish)
}

/// One relayed message: publish, wait for its confirm, ack.
type RelayOne = std::pin::Pin<Box<dyn std::future::Future<Output = lapin::Result<()>> + Send>>;

/// (a2): consumes the requests queue (quorum) with prefetch 1000 and republishes every
/// delivery to the dispatch exchange, publisher-confirmed and mandatory as the worker does,
/// acking after the confirm; all of it concurrently, through lapin, the worker's AMQP client,
/// on two connections as the worker uses (so the ceiling is the broker's and the client's,
/// not extra work). Spawned on a runtime shaped like the worker's (see [`on_worker_runtime`]).
/// Returns the elapsed time.
async fn relay(names: Names, n: usize) -> Duration {
    let (conn, publish_conn) = connection_pair("sendquota-perf-relay").await;
    let consume = prefetching_channel(&conn, E2E_PREFETCH).await;
    let publish = publish_conn.create_channel().await.expect("channel");
    publish
        .confirm_select(lapin::options::ConfirmSelectOptions::default())
        .await
        .expect("confirm mode");
    let mut progress = Progress::new("a2 relay", n);
    let began = Instant::now();
    let mut consumer = consume_requests(&consume, &names).await;
    let mut in_flight: FuturesUnordered<RelayOne> = FuturesUnordered::new();
    let mut done = 0usize;
    let props = BasicProperties::default()
        .with_content_type("application/json".into())
        .with_delivery_mode(2);
    while done < n {
        tokio::select! {
            biased;
            Some(r) = in_flight.next(), if !in_flight.is_empty() => {
                r.expect("relay one message");
                done += 1;
                progress.add(1);
            }
            d = consumer.next() => {
                let delivery = d.expect("consumer ended").expect("delivery");
                let (publish, consume) = (publish.clone(), consume.clone());
                let (exchange, props) = (names.dispatch.clone(), props.clone());
                in_flight.push(Box::pin(async move {
                    let options = lapin::options::BasicPublishOptions {
                        mandatory: true,
                        ..Default::default()
                    };
                    let confirm = publish
                        .basic_publish(exchange.as_str().into(), "sms".into(), options, &delivery.data, props)
                        .await?
                        .await?;
                    assert_eq!(
                        confirm,
                        lapin::Confirmation::Ack(None),
                        "relay publish not confirmed and routed"
                    );
                    consume
                        .basic_ack(delivery.delivery_tag, lapin::options::BasicAckOptions::default())
                        .await
                }));
            }
        }
    }
    let elapsed = began.elapsed();
    drop(consumer);
    // Close the consuming channel first so the broker has its acks before the connection goes.
    let _ = consume.close(200, "relay done".into()).await;
    let _ = conn.close(200, "relay done".into()).await;
    let _ = publish_conn.close(200, "relay done".into()).await;
    elapsed
}

/// (d) floor: the worker's broker work with nothing decided. The worker's own [`Publisher`] and
/// [`Settler`], one task per delivery under a semaphore of the worker's concurrency, every
/// other delivery published (publisher-confirmed, mandatory) to the dispatch exchange as the
/// worker dispatches half in (c), every delivery acked through the settler once its outcome
/// is done; the prefetch and concurrency those of the worker in (c) (`(prefetch, concurrency)`).
/// No Redis, no Postgres, no decoding: what is left of (d) once the decisions, the
/// denial rows and the dispatch marks are taken away. Runs on a runtime like [`relay`].
/// Returns the elapsed time.
async fn broker_floor(names: Names, n: usize, (prefetch, concurrency): (u16, usize)) -> Duration {
    let (conn, publish_conn) = connection_pair("sendquota-perf-floor").await;
    let publisher = Publisher::open(&publish_conn)
        .await
        .expect("publisher channel");
    let consume = prefetching_channel(&conn, prefetch).await;
    let (settler, settling) = Settler::spawn(consume.clone());
    let slots = Arc::new(Semaphore::new(concurrency));
    let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel::<()>();
    let mut progress = Progress::new("d floor: broker work alone", n);
    let began = Instant::now();
    let mut consumer = consume_requests(&consume, &names).await;
    let mut done = 0usize;
    while done < n {
        tokio::select! {
            biased;
            Some(()) = done_rx.recv() => {
                done += 1;
                progress.add(1);
            }
            d = consumer.next() => {
                let delivery = d.expect("consumer ended").expect("delivery");
                let slot = slots.clone().acquire_owned().await.expect("semaphore open");
                let (publisher, settler, done_tx) =
                    (publisher.clone(), settler.clone(), done_tx.clone());
                let exchange = names.dispatch.clone();
                tokio::spawn(async move {
                    if delivery.delivery_tag % 2 == 1 {
                        let props = sendquota::broker::json_properties(None, &[]);
                        publisher
                            .publish(&exchange, "sms", &delivery.data, props)
                            .await
                            .expect("floor publish confirmed and routed");
                    }
                    settler.ack(delivery.delivery_tag);
                    drop(slot);
                    let _ = done_tx.send(());
                });
            }
        }
    }
    settler.finish();
    settling.await.expect("settler");
    let elapsed = began.elapsed();
    drop(consumer);
    let _ = consume.close(200, "floor done".into()).await;
    let _ = conn.close(200, "floor done".into()).await;
    let _ = publish_conn.close(200, "floor done".into()).await;
    elapsed
}

/// (d) floor once: [`broker_phase`] with [`broker_floor`] at `worker`'s prefetch and
/// concurrency; half the bodies must reach the sink.
async fn floor_run(
    env: &TestEnv,
    bodies: &[Vec<u8>],
    procs: &Procs,
    tally: &mut Tally,
    worker: &WorkerChoice,
) {
    let m = bodies.len();
    let shape = worker.in_progress();
    let floor = move |names, n| broker_floor(names, n, shape);
    let (_, routed) = broker_phase(env, bodies, procs, tally, "d floor", m / 2, floor).await;
    assert!(
        routed >= m / 2,
        "the floor run lost messages: {routed} of {} routed",
        m / 2
    );
    empty_broker_queues(env).await;
}

/// Queues `bodies`, runs `phase` on them with [`on_worker_runtime`] and charges the CPU
/// used meanwhile to `tally` (`published` of the bodies count as sent on). Returns the time
/// `phase` took and how many messages reached the sink.
async fn broker_phase<F>(
    env: &TestEnv,
    bodies: &[Vec<u8>],
    procs: &Procs,
    tally: &mut Tally,
    label: &str,
    published: usize,
    phase: impl FnOnce(Names, usize) -> F,
) -> (Duration, usize)
where
    F: std::future::Future<Output = Duration> + Send + 'static,
{
    let m = bodies.len();
    prepublish(env, bodies, &format!("{label} pre-publish")).await;
    let before = procs.snap(None).await;
    let took = on_worker_runtime(phase(env.names.clone(), m))
        .await
        .unwrap_or_else(|e| panic!("{label}: {e}"));
    tally.add(before, procs.snap(None).await, m, published, took);
    (took, queued(env, &env.dispatched_queue).await)
}

/// Runs `phase` as a task on a runtime of its own with as many threads as the worker runs on by
/// default (`worker.threads`), on a thread of its own: the relay and the floor then pay for
/// their threads what the worker pays for its, not what this process's runtime would.
async fn on_worker_runtime<F>(phase: F) -> Result<Duration, String>
where
    F: std::future::Future<Output = Duration> + Send + 'static,
{
    let threads = sendquota::config::WorkerSettings::default().threads;
    let (done, finished) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let ran = sendquota::cli::runtime(threads)
            .map_err(|e| format!("runtime: {e}"))
            .and_then(|rt| {
                rt.block_on(async move { tokio::spawn(phase).await })
                    .map_err(|e| format!("task: {e}"))
            });
        let _ = done.send(ran);
    });
    finished
        .await
        .map_err(|_| "its thread ended without a result".to_owned())?
}

/// Purges the sink and the requests queue after a broker phase.
async fn empty_broker_queues(env: &TestEnv) {
    for queue in [&env.dispatched_queue, &env.names.requests] {
        env.channel
            .queue_purge(queue.as_str().into(), QueuePurgeOptions::default())
            .await
            .expect("purge");
    }
}

// ---------------------------------------------------------------------------------------------
// The worker binary.

/// The worker binary (c), (d) and (g) run, and its settings.
struct WorkerChoice {
    /// `SENDQUOTA_PERF_WORKER_BIN` when set, else this package's binary.
    bin: String,
    /// `--worker-prefetch`: amqp.prefetch and worker.concurrency; `None` = the worker's defaults.
    prefetch: Option<u16>,
}

impl WorkerChoice {
    fn new(args: &Args) -> WorkerChoice {
        WorkerChoice {
            bin: std::env::var("SENDQUOTA_PERF_WORKER_BIN")
                .ok()
                .filter(|bin| !bin.is_empty())
                .unwrap_or_else(|| env!("CARGO_BIN_EXE_sendquota").to_owned()),
            prefetch: u16::try_from(args.worker_prefetch).ok().filter(|&p| p > 0),
        }
    }

    /// The worker's prefetch and concurrency: `--worker-prefetch`, else the defaults of this
    /// build's src/config.rs (another binary's are assumed the same).
    fn in_progress(&self) -> (u16, usize) {
        match self.prefetch {
            Some(p) => (p, usize::from(p)),
            None => (
                sendquota::config::AmqpSettings::default().prefetch,
                sendquota::config::WorkerSettings::default().concurrency,
            ),
        }
    }

    fn describe(&self) -> String {
        let (prefetch, concurrency) = self.in_progress();
        let whence = if self.prefetch.is_some() {
            "--worker-prefetch"
        } else {
            "defaults"
        };
        format!("prefetch {prefetch}, concurrency {concurrency} ({whence})")
    }

    /// Starts the worker on `env`'s namespace, its clock fixed at [`WORKER_NOW`], and waits
    /// until it is ready (consuming, with Redis and Postgres reachable: `/readyz` answers).
    /// Returns it and its admin port.
    async fn start(&self, env: &TestEnv) -> (WorkerProcess, u16) {
        let config = std::env::temp_dir().join(format!("{}-perf.toml", env.namespace));
        // The default queue type, said anyway: (a2) and the floor use a quorum queue.
        let mut toml = "[amqp]\nqueue_type = \"quorum\"\n".to_owned();
        if let Some(p) = self.prefetch {
            toml += &format!("prefetch = {p}\n\n[worker]\nconcurrency = {p}\n");
        }
        std::fs::write(&config, toml).expect("write config");
        let port = free_port();
        let child = Command::new(&self.bin)
            .args([
                "--config",
                config.to_str().expect("utf-8 path"),
                "worker",
                "--now",
                WORKER_NOW,
            ])
            .env("SENDQUOTA_NAMESPACE", &env.namespace)
            .env("SENDQUOTA_REDIS_URL", support::redis_url())
            .env("SENDQUOTA_AMQP_URL", support::amqp_url())
            .env("SENDQUOTA_DATABASE_URL", &env.database_url)
            .env("SENDQUOTA_ADMIN_LISTEN", format!("127.0.0.1:{port}"))
            .env("SENDQUOTA_LOG", "warn")
            .stdout(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("start the worker binary {}: {e}", self.bin));
        let worker = WorkerProcess { child, config };
        let deadline = Instant::now() + Duration::from_secs(30);
        while http_get(port, "/readyz").await.is_none() {
            assert!(
                Instant::now() < deadline,
                "the worker was not ready after 30 s"
            );
            tokio::time::sleep(READY_POLL).await;
        }
        (worker, port)
    }
}

/// Stops the child worker and removes its config file when dropped (also on panic).
struct WorkerProcess {
    child: Child,
    config: std::path::PathBuf,
}

impl WorkerProcess {
    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGTERM, then wait for it to drain and exit.
    fn stop(mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        let _ = std::fs::remove_file(&self.config);
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

async fn http_get(port: u16, path: &str) -> Option<String> {
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    let req = format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    stream.write_all(req.as_bytes()).await.ok()?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await.ok()?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.")
        .then(|| head.contains(" 200 "))
        .filter(|ok| *ok)
        .map(|_| body.to_owned())
}

/// A Prometheus histogram's cumulative buckets (upper bound, count), summed over label sets.
struct Histogram {
    buckets: Vec<(f64, f64)>,
    sum: f64,
    count: f64,
}

fn histogram(metrics: &str, name: &str) -> Histogram {
    let mut buckets = Vec::new();
    let (mut sum, mut count) = (0.0, 0.0);
    let value = |line: &str| -> f64 {
        line.rsplit(' ')
            .next()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0.0)
    };
    for line in metrics.lines() {
        if let Some(rest) = line.strip_prefix(&format!("{name}_bucket")) {
            let le = rest
                .split("le=\"")
                .nth(1)
                .and_then(|s| s.split('"').next())
                .map(|s| {
                    if s == "+Inf" {
                        f64::INFINITY
                    } else {
                        s.parse().unwrap_or(f64::INFINITY)
                    }
                })
                .unwrap_or(f64::INFINITY);
            buckets.push((le, value(line)));
        } else if line.starts_with(&format!("{name}_sum")) {
            sum += value(line);
        } else if line.starts_with(&format!("{name}_count")) {
            count += value(line);
        }
    }
    Histogram::summed(buckets, sum, count)
}

impl Histogram {
    /// A histogram from (upper bound, cumulative count) pairs, the counts of equal bounds added
    /// (several label sets of one scrape, or two scrapes).
    fn summed(pairs: impl IntoIterator<Item = (f64, f64)>, sum: f64, count: f64) -> Histogram {
        let mut buckets: BTreeMap<u64, (f64, f64)> = BTreeMap::new();
        for (le, n) in pairs {
            // Non-negative floats order like their bit patterns.
            buckets.entry(le.to_bits()).or_insert((le, 0.0)).1 += n;
        }
        Histogram {
            buckets: buckets.into_values().collect(),
            sum,
            count,
        }
    }

    /// Two scrapes' histograms as one: counts added bucket by bucket.
    fn plus(self, o: Histogram) -> Histogram {
        Histogram::summed(
            self.buckets.into_iter().chain(o.buckets),
            self.sum + o.sum,
            self.count + o.count,
        )
    }

    /// The q-quantile, interpolated linearly inside its bucket (as PromQL's
    /// histogram_quantile); the last finite bound when it falls in the +Inf bucket.
    fn quantile(&self, q: f64) -> Option<f64> {
        let total = self.buckets.last()?.1;
        if total <= 0.0 {
            return None;
        }
        let rank = q * total;
        let (mut lower, mut below) = (0.0, 0.0);
        for &(le, cumulative) in &self.buckets {
            if cumulative >= rank {
                if le.is_infinite() {
                    return Some(lower);
                }
                let share = if cumulative > below {
                    (rank - below) / (cumulative - below)
                } else {
                    0.0
                };
                return Some(lower + (le - lower) * share);
            }
            lower = le;
            below = cumulative;
        }
        Some(lower)
    }
}

struct EndToEnd {
    /// From the worker's spawn to the last outcome.
    elapsed: Duration,
    /// From the worker's spawn to its first ready answer on `/readyz`.
    ready: Duration,
    /// Each run's rate from readiness, msgs/s.
    runs: Vec<f64>,
    dispatched: usize,
    denied: usize,
    hwm_kib: u64,
    decision: Histogram,
    dispatch: Histogram,
    denial_write: Histogram,
    /// Context switches of the worker's threads per message, and how many threads it has.
    switches_per_msg: f64,
    /// Write system calls of the worker per message (start-up included).
    segments_per_msg: f64,
    threads: usize,
    /// Redis commands during the run: (command, calls per message, microseconds per message).
    commands: Vec<(String, f64, f64)>,
    /// The worker's CPU by thread name: (name, user us per message, system us per message).
    threads_cpu: Vec<(String, f64, f64)>,
    /// Ack frames the worker sent: (multiple, single).
    ack_frames: (f64, f64),
    /// Denial batches the worker committed.
    denial_batches: f64,
}

impl EndToEnd {
    /// Two runs of `n` messages each as one: times and counts added, per-message figures
    /// averaged, the peak RSS the larger.
    fn merge(self, o: EndToEnd) -> EndToEnd {
        let mean = |a: f64, b: f64| (a + b) / 2.0;
        EndToEnd {
            elapsed: self.elapsed + o.elapsed,
            ready: self.ready + o.ready,
            runs: [self.runs, o.runs].concat(),
            dispatched: self.dispatched + o.dispatched,
            denied: self.denied + o.denied,
            hwm_kib: self.hwm_kib.max(o.hwm_kib),
            decision: self.decision.plus(o.decision),
            dispatch: self.dispatch.plus(o.dispatch),
            denial_write: self.denial_write.plus(o.denial_write),
            switches_per_msg: mean(self.switches_per_msg, o.switches_per_msg),
            segments_per_msg: mean(self.segments_per_msg, o.segments_per_msg),
            threads: self.threads.max(o.threads),
            commands: mean_by_name(self.commands, o.commands),
            threads_cpu: mean_by_name(self.threads_cpu, o.threads_cpu),
            ack_frames: (
                self.ack_frames.0 + o.ack_frames.0,
                self.ack_frames.1 + o.ack_frames.1,
            ),
            denial_batches: self.denial_batches + o.denial_batches,
        }
    }
}

/// Two runs' per-message figures by name, averaged (a name missing from a run counts 0 there),
/// largest second figure first.
fn mean_by_name(a: Vec<(String, f64, f64)>, b: Vec<(String, f64, f64)>) -> Vec<(String, f64, f64)> {
    let mut sums: BTreeMap<String, (f64, f64)> = BTreeMap::new();
    for (name, x, y) in a.into_iter().chain(b) {
        let sum = sums.entry(name).or_default();
        sum.0 += x;
        sum.1 += y;
    }
    let mut out: Vec<(String, f64, f64)> = sums
        .into_iter()
        .map(|(name, (x, y))| (name, x / 2.0, y / 2.0))
        .collect();
    out.sort_by(|a, b| b.2.total_cmp(&a.2));
    out
}

/// TCP data segments sent so far over every established socket of `pid` (`ss`'s
/// `data_segs_out`): each socket write of the worker's clients leaves as at least one segment.
/// System-call counters (`syscw` in /proc/PID/io) miss them: they count write and writev, and
/// the clients write with send. 0 when `ss` cannot be run.
fn segments_sent(pid: u32) -> u64 {
    let Ok(out) = Command::new("ss")
        .args(["-tinpH", "state", "established"])
        .output()
    else {
        return 0;
    };
    let text = String::from_utf8_lossy(&out.stdout);
    let owner = format!("pid={pid},");
    let mut total = 0;
    let mut ours = false;
    for line in text.lines() {
        if !line.starts_with(char::is_whitespace) {
            ours = line.contains(&owner);
        } else if ours {
            total += line
                .split_whitespace()
                .find_map(|f| f.strip_prefix("data_segs_out:")?.parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    total
}

/// Voluntary plus involuntary context switches over every thread of `pid`, and the threads.
fn context_switches(pid: u32) -> (u64, usize) {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return (0, 0);
    };
    let mut total = 0;
    let mut threads = 0;
    for task in tasks.filter_map(Result::ok) {
        threads += 1;
        let status = std::fs::read_to_string(task.path().join("status")).unwrap_or_default();
        total += status
            .lines()
            .filter(|l| l.contains("ctxt_switches:"))
            .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
            .sum::<u64>();
    }
    (total, threads)
}

/// User and system CPU ticks of every thread of `pid`, summed by thread name, since each
/// thread started: where in the worker (its runtime threads, its other threads) the time goes.
fn thread_ticks(pid: u32) -> BTreeMap<String, (u64, u64)> {
    let mut by_name = BTreeMap::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return by_name;
    };
    for task in tasks.filter_map(Result::ok) {
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else {
            continue;
        };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let fields: Vec<&str> = stat[close + 1..].split_whitespace().collect();
        let tick = |i: usize| {
            fields
                .get(i)
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
        };
        let entry = by_name
            .entry(stat[open + 1..close].to_owned())
            .or_insert((0, 0));
        entry.0 += tick(11);
        entry.1 += tick(12);
    }
    by_name
}

/// (c)/(d): the worker binary decides `n` queued requests.
async fn end_to_end(
    env: &TestEnv,
    n: usize,
    procs: &Procs,
    tally: &mut Tally,
    choice: &WorkerChoice,
) -> EndToEnd {
    let commands_before = common::command_stats(&mut procs.conn.clone()).await;
    let before = procs.snap(None).await;
    let began = Instant::now();
    // Ready: the point the relay's own timer starts from (its connection and channels open,
    // about to consume).
    let (worker, port) = choice.start(env).await;
    let pid = worker.pid();
    let ready = began.elapsed();
    let mut progress = Progress::new("c worker end to end", n);
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let done = outcomes(env, n).await;
        if done >= n {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "only {done}/{n} messages have an outcome after 300 s"
        );
        progress.add(done - progress.done);
        // Close to the end the poll is frequent, so the end is seen a few ms late at most.
        let nearly = done.saturating_mul(10) >= n.saturating_mul(9);
        tokio::time::sleep(Duration::from_millis(if nearly { 2 } else { 20 })).await;
    }
    let elapsed = began.elapsed();
    let after = procs.snap(Some(pid)).await;
    let commands_after = common::command_stats(&mut procs.conn.clone()).await;
    let hwm_kib = proc_number(pid, "status", "VmHWM:");
    let (switches, threads) = context_switches(pid);
    // How well the worker's clients batch what they send: a Redis command, a publish or an ack
    // written alone is one segment.
    let segments = segments_sent(pid);
    let threads_cpu = thread_ticks(pid)
        .into_iter()
        .map(|(name, (user, system))| {
            let per = |ticks: u64| ticks as f64 * procs.tick_us / n as f64;
            (name, per(user), per(system))
        })
        .collect();
    let mut commands: Vec<(String, f64, f64)> = commands_after
        .iter()
        .map(|(name, &(calls, us))| {
            let (calls0, us0) = commands_before.get(name).copied().unwrap_or((0, 0));
            (
                name.clone(),
                calls.saturating_sub(calls0) as f64 / n as f64,
                us.saturating_sub(us0) as f64 / n as f64,
            )
        })
        .filter(|(_, calls, _)| *calls >= 0.01)
        .collect();
    commands.sort_by(|a, b| b.2.total_cmp(&a.2));
    let metrics = http_get(port, "/metrics").await.unwrap_or_default();
    worker.stop();
    tally.add(before, after, n, 0, elapsed);
    if metrics.is_empty() {
        eprintln!("[c] warning: could not scrape /metrics on port {port}");
    }
    EndToEnd {
        elapsed,
        ready,
        dispatched: queued(env, &env.dispatched_queue).await,
        denied: env.denial_rows().await as usize,
        runs: vec![rate(n, elapsed.saturating_sub(ready))],
        hwm_kib,
        decision: histogram(&metrics, sendquota::telemetry::DECISION_SECONDS),
        dispatch: histogram(&metrics, sendquota::telemetry::DISPATCH_SECONDS),
        denial_write: histogram(&metrics, sendquota::telemetry::DENIAL_WRITE_SECONDS),
        switches_per_msg: switches as f64 / n as f64,
        segments_per_msg: segments as f64 / n as f64,
        threads,
        commands,
        threads_cpu,
        ack_frames: (
            counter(&metrics, sendquota::telemetry::ACK_FRAMES, Some("multiple")),
            counter(&metrics, sendquota::telemetry::ACK_FRAMES, Some("single")),
        ),
        denial_batches: counter(&metrics, sendquota::telemetry::DENIAL_BATCHES, None),
    }
}

/// The value of counter `name` with label `kind` in a Prometheus scrape; 0 when absent.
fn counter(metrics: &str, name: &str, kind: Option<&str>) -> f64 {
    let series = match kind {
        Some(kind) => format!("{name}{{kind=\"{kind}\"}} "),
        None => format!("{name} "),
    };
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(&series))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

// ---------------------------------------------------------------------------------------------
// Report.

struct Line {
    figure: String,
    value: String,
    against: String,
    ratio: String,
    target: String,
    verdict: &'static str,
}

fn line(
    figure: &str,
    value: String,
    against: &str,
    ratio: Option<f64>,
    target: &str,
    ok: Option<bool>,
) -> Line {
    Line {
        figure: figure.to_owned(),
        value,
        against: against.to_owned(),
        ratio: ratio.map_or_else(|| "-".to_owned(), |r| format!("{:.0}%", r * 100.0)),
        target: target.to_owned(),
        verdict: match ok {
            Some(true) => "ok",
            Some(false) => "MISS",
            None => "",
        },
    }
}

fn rate(n: usize, d: Duration) -> f64 {
    n as f64 / d.as_secs_f64()
}

fn ms(seconds: Option<f64>) -> String {
    seconds.map_or_else(|| "n/a".to_owned(), |s| format!("{:.2} ms", s * 1e3))
}

/// Greatest common divisor, for a stride that visits every pool index once.
fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// A stride near 0.618 * n that is coprime to n: `j * stride % n` scatters j over the pool
/// without repeats.
fn scatter_stride(n: usize) -> usize {
    let mut s = (n as f64 * 0.618) as usize | 1;
    while gcd(s, n) != 1 {
        s += 2;
    }
    s.max(1)
}

/// The ceiling (a1) and the decision path (b) run in this many alternating slices, and so do
/// the two pools of (e), so that background load on a shared machine hits both sides alike.
const SLICES: usize = 4;

/// (c) once: a fresh namespace, the bodies queued, the worker binary run over them until each
/// has its outcome, the namespace's keys purged.
async fn worker_run(
    bodies: &[Vec<u8>],
    procs: &Procs,
    tally: &mut Tally,
    worker: &WorkerChoice,
) -> EndToEnd {
    let env = TestEnv::with_queue_type("", QueueType::Quorum).await;
    prepublish(&env, bodies, "c pre-publish").await;
    let e2e = end_to_end(&env, bodies.len(), procs, tally, worker).await;
    purge_namespace(&env, "c cleanup").await;
    e2e
}

/// What (g) measured.
struct Latency {
    /// Publish-to-dispatch latency of each counted message that reached the sink, in
    /// nanoseconds, sorted.
    samples: Vec<u64>,
    /// Counted messages published, and per second while they were.
    counted: usize,
    achieved: f64,
}

impl Latency {
    /// The q-quantile of the samples (nearest rank), in seconds.
    fn quantile(&self, q: f64) -> Option<f64> {
        let rank = ((q * self.samples.len() as f64).ceil() as usize).max(1);
        self.samples.get(rank - 1).map(|&ns| ns as f64 / 1e9)
    }
}

/// What passes (g)'s requests from the requests queue to the dispatch exchange.
enum Hop<'a> {
    /// The worker binary.
    Worker(&'a WorkerChoice),
    /// The no-work relay of (a2), in this process: the broker's and the client's share of the
    /// latency, the floor under the worker's.
    Relay,
}

/// (g) once: `hop` on a fresh namespace, requests published at `rate` msgs/s (paced every
/// [`PACE`], publisher-confirmed, on this process's connection) for [`LATENCY_WARM_UP`] and
/// then `seconds` more, each to a new recipient (so each is dispatched) and carrying in its
/// payload its sequence number and its publish instant (`sent_ns`, since `origin`); a consumer
/// of the dispatch sink takes each arrival's instant minus that. The CPU used meanwhile is
/// charged to `tally`.
async fn latency_run(
    hop: Hop<'_>,
    rate: f64,
    seconds: usize,
    procs: &Procs,
    tally: &mut Tally,
) -> Latency {
    let env = TestEnv::with_queue_type("", QueueType::Quorum).await;
    let warm = (rate * LATENCY_WARM_UP.as_secs_f64()).ceil() as usize;
    let total = warm + (rate * seconds as f64).ceil() as usize;
    let origin = Instant::now();
    let arrivals = sink_latencies(&env, origin, total).await;
    let (process, relaying) = match hop {
        Hop::Worker(worker) => (Some(worker.start(&env).await.0), None),
        Hop::Relay => {
            let relaying = on_worker_runtime(relay(env.names.clone(), total));
            (None, Some(tokio::spawn(relaying)))
        }
    };
    let pid = process.as_ref().map(WorkerProcess::pid);
    let before = procs.snap(pid).await;
    let mut progress = Progress::new(&format!("g publish at {rate:.0} msgs/s"), total);
    let mut ticks = tokio::time::interval(PACE);
    let mut confirms = FuturesUnordered::new();
    let (mut sent, mut counted_from, mut last_sent) = (0usize, None, Instant::now());
    let began = Instant::now();
    while sent < total || !confirms.is_empty() {
        tokio::select! {
            Some(confirm) = confirms.next(), if !confirms.is_empty() => {
                let confirm: Result<(), sendquota::broker::BrokerError> = confirm;
                confirm.expect("publish request");
            }
            _ = ticks.tick(), if sent < total => {
                let due = ((began.elapsed().as_secs_f64() * rate) as usize).min(total);
                for i in sent..due {
                    if i == warm {
                        counted_from = Some(Instant::now());
                    }
                    let mut body = request(&format!("g{i}"), &format!("g{i}"), "UTC");
                    body["payload"] = serde_json::json!({
                        "template": "t",
                        "seq": i,
                        "sent_ns": origin.elapsed().as_nanos() as u64,
                    });
                    let publisher = env.publisher.clone();
                    let exchange = env.names.requests.clone();
                    confirms.push(async move {
                        let body = body.to_string().into_bytes();
                        publisher
                            .publish(&exchange, "", &body, BasicProperties::default())
                            .await
                    });
                }
                last_sent = Instant::now();
                progress.add(due - sent);
                sent = due;
            }
        }
    }
    let arrived = arrivals.await.expect("sink consumer");
    let after = procs.snap(pid).await;
    tally.add(before, after, total, arrived.len(), began.elapsed());
    if let Some(relaying) = relaying {
        let relayed = relaying.await.expect("relay task");
        relayed.unwrap_or_else(|e| panic!("g relay: {e}"));
    }
    if let Some(process) = process {
        process.stop();
    }
    purge_namespace(&env, "g cleanup").await;
    let mut samples: Vec<u64> = arrived
        .into_iter()
        .filter(|&(seq, _)| seq >= warm)
        .map(|(_, ns)| ns)
        .collect();
    samples.sort_unstable();
    let counted = total - warm;
    let publishing = counted_from.map_or(Duration::ZERO, |t| last_sent.duration_since(t));
    Latency {
        samples,
        counted,
        achieved: counted as f64 / publishing.as_secs_f64().max(PACE.as_secs_f64()),
    }
}

/// Consumes `env`'s dispatch sink (no acks) until `total` requests arrived or none came for
/// 10 s; yields each one's (`seq`, arrival minus `sent_ns`) from its payload, in nanoseconds
/// since `origin`.
async fn sink_latencies(
    env: &TestEnv,
    origin: Instant,
    total: usize,
) -> tokio::task::JoinHandle<Vec<(usize, u64)>> {
    let channel = env.amqp.create_channel().await.expect("channel");
    let mut consumer = channel
        .basic_consume(
            env.dispatched_queue.as_str().into(),
            "sendquota-perf-latency".into(),
            lapin::options::BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("consume the sink");
    tokio::spawn(async move {
        let mut arrived = Vec::with_capacity(total);
        let mut progress = Progress::new("g dispatched", total);
        while arrived.len() < total {
            let Ok(Some(delivery)) =
                tokio::time::timeout(Duration::from_secs(10), consumer.next()).await
            else {
                eprintln!("[g] the sink received {} of {total}", arrived.len());
                break;
            };
            let now = origin.elapsed().as_nanos() as u64;
            let delivery = delivery.expect("sink delivery");
            let body: serde_json::Value =
                serde_json::from_slice(&delivery.data).expect("dispatched body is JSON");
            let field = |name: &str| body["payload"][name].as_u64().expect("payload field");
            arrived.push((field("seq") as usize, now.saturating_sub(field("sent_ns"))));
            progress.add(1);
        }
        drop(channel);
        arrived
    })
}

/// Removes the Redis keys of `env`'s namespace.
async fn purge_namespace(env: &TestEnv, label: &str) {
    let mut conn = multiplexed().await;
    purge(&mut conn, &format!("{}:*", env.namespace), label).await;
}

/// (a2) once: queue the bodies, relay them, check they all reached the sink, empty it and
/// the requests queue. Returns the rate, how many messages the broker put back in the
/// requests queue after the relay closed its channel although every delivery had been acked,
/// and how many more than `bodies` reached the sink (deliveries seen twice).
async fn relay_run(
    env: &TestEnv,
    bodies: &[Vec<u8>],
    procs: &Procs,
    tally: &mut Tally,
) -> (f64, usize, usize) {
    let m = bodies.len();
    let (took, routed) = broker_phase(env, bodies, procs, tally, "a2", 0, relay).await;
    assert!(
        routed >= m,
        "the relay lost messages: {routed} of {m} routed"
    );
    let mut returned = 0;
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        returned = queued(env, &env.names.requests).await;
        if returned > 0 {
            break;
        }
    }
    empty_broker_queues(env).await;
    (rate(m, took), returned, routed - m)
}

#[tokio::main]
async fn main() {
    let args = args();
    let started = Instant::now();
    eprintln!(
        "perf: {} decisions per decision phase, {} messages per broker phase, {} recipients' \
         keys, pools of {} and {} recipients ({} decisions each), {} decisions per side to {} \
         hot recipients",
        args.decisions,
        args.messages,
        args.recipients,
        args.small_recipients,
        args.recipients,
        args.pool_decisions,
        args.hot_decisions,
        args.hot_recipients
    );
    let worker = WorkerChoice::new(&args);
    eprintln!("perf: worker binary {}, {}", worker.bin, worker.describe());
    let mut lines: Vec<Line> = Vec::new();
    let mut usage: Vec<CpuUse> = Vec::new();
    let mut notes: Vec<String> = Vec::new();
    let base = instant(BASE);
    let at = |i: usize| base + chrono::Duration::milliseconds(i as i64);
    let concurrency = args.concurrency;

    let mut plain = multiplexed().await;
    tokio::spawn(purge_on_interrupt());
    let procs = Procs::find(&mut plain).await;
    let env = TestEnv::with_queue_type("", QueueType::Quorum).await;
    let ns = env.namespace.clone();
    let pattern = format!("{ns}:*");
    // The script the limiter sends for a scope holding the headline rule alone.
    let headline_kinds = KindSet::of(["calendar_quota"]);
    let sha: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(source_for(headline_kinds))
        .query_async(&mut plain)
        .await
        .expect("SCRIPT LOAD");
    assert_eq!(
        sha,
        script_for(headline_kinds).get_hash(),
        "source_for and script_for disagree"
    );
    let lua = LuaLoop {
        conn: plain.clone(),
        sha,
        namespace: ns.clone(),
        pipeline: args.pipeline,
        in_flight: args.in_flight,
    };
    let limiter = Limiter::new(env.redis.clone(), &ns);
    let headline = Arc::new(policy(""));
    let n = args.decisions;
    let slice = n / SLICES;

    // Warm-up: the first keys Redis (and this process) allocate fault their pages in, which on
    // a VM costs more than the decisions themselves. One slice of each side, then dropped.
    let warm_messages: Vec<SendRequest> = (0..slice)
        .map(|i| decode(&format!("xm{i}"), &format!("x{}", i / 2)))
        .collect();
    let mut warm = Progress::new("warm-up, discarded", 2 * slice);
    lua.run(&mut warm, 0..slice, "w", base, |i| i / 2).await;
    evaluate_all(
        &mut warm,
        &limiter,
        &headline,
        &warm_messages,
        0..slice,
        at,
        concurrency,
    )
    .await;
    drop(warm_messages);
    purge(&mut plain, &pattern, "warm-up cleanup").await;

    // (a1) the script's ceiling and (b) the decision path, in alternating slices.
    let messages: Vec<SendRequest> = (0..n)
        .map(|i| decode(&format!("bm{i}"), &format!("b{}", i / 2)))
        .collect();
    let mut progress_a1 = Progress::new("a1 bare pipelined EVALSHA", n);
    let mut progress_b = Progress::new("b decision path, headline", n);
    let (mut a1, mut b_headline) = (Tally::default(), Tally::default());
    for k in 0..SLICES {
        let range = k * slice..(k + 1) * slice;
        let before = procs.snap(None).await;
        let (allowed, took) = lua
            .run(&mut progress_a1, range.clone(), "a", base, |i| i / 2)
            .await;
        let middle = procs.snap(None).await;
        a1.add(before, middle, slice, allowed, took);
        let (allowed, took) = evaluate_all(
            &mut progress_b,
            &limiter,
            &headline,
            &messages,
            range,
            at,
            concurrency,
        )
        .await;
        b_headline.add(middle, procs.snap(None).await, slice, allowed, took);
    }
    // The loop's keys and arguments are the limiter's: the limiter reads what the loop wrote.
    let seen = limiter
        .evaluate(&headline, &decode("probe", "a0"), base, false)
        .await
        .expect("probe");
    assert!(
        !seen.verdicts[0].allowed && seen.verdicts[0].remaining == Some(0),
        "the bare loop's state is not what the limiter reads: {seen:?}"
    );
    usage.push(cpu_use(&procs, "a1 bare pipelined EVALSHA", &a1));
    usage.push(cpu_use(
        &procs,
        "b Limiter::evaluate, headline",
        &b_headline,
    ));
    let a1_rate = a1.rate();
    let b_rate = b_headline.rate();
    lines.push(line(
        "(a1) ceiling: pipelined EVALSHA, headline",
        format!("{a1_rate:.0} dec/s"),
        "",
        None,
        &format!(
            "{:.0}% allowed; pipelines of {}, {} in flight",
            a1.allowed_pct(),
            args.pipeline,
            args.in_flight
        ),
        None,
    ));
    lines.push(line(
        "(b) decision path, headline alone",
        format!("{b_rate:.0} dec/s"),
        "(a1)",
        Some(b_rate / a1_rate),
        &format!(
            ">= {:.0}% ({:.0}% allowed, {concurrency} concurrent)",
            DECISION_PATH_MIN_RATIO * 100.0,
            b_headline.allowed_pct()
        ),
        Some(b_rate / a1_rate >= DECISION_PATH_MIN_RATIO),
    ));
    purge(&mut plain, &pattern, "b cleanup").await;

    let three = Arc::new(policy(THREE_RULES));
    let mut progress = Progress::new("b decision path, headline + gcra + sliding_window", n);
    let mut b_three = Tally::default();
    let before = procs.snap(None).await;
    let (allowed, took) = evaluate_all(
        &mut progress,
        &limiter,
        &three,
        &messages,
        0..n,
        at,
        concurrency,
    )
    .await;
    b_three.add(before, procs.snap(None).await, n, allowed, took);
    usage.push(cpu_use(&procs, "b Limiter::evaluate, 3 rules", &b_three));
    lines.push(line(
        "(b) decision path, + channel gcra + sliding_window",
        format!("{:.0} dec/s", b_three.rate()),
        "(a1)",
        Some(b_three.rate() / a1_rate),
        &format!(
            "info ({:.0}% allowed, 2 script calls/decision)",
            b_three.allowed_pct()
        ),
        None,
    ));
    purge(&mut plain, &pattern, "b cleanup").await;
    drop(messages);

    // (a2) the broker's ceiling, on the worker's topology (quorum requests queue -> dispatch
    // exchange -> the sink queue) in its own namespace, run before and after (c).
    let m = args.messages;
    let bodies = bodies(m);
    let relay_env = TestEnv::with_queue_type("", QueueType::Quorum).await;
    let mut a2 = Tally::default();
    let (first_relay, returned_first, extra_first) =
        relay_run(&relay_env, &bodies, &procs, &mut a2).await;

    // (c) and (d), the worker binary end to end, run twice like the relay, in the order a2 c
    // floor floor c a2: drifting background load falls on the ceiling and on (c) alike.
    let mut c_tally = Tally::default();
    let first_worker = worker_run(&bodies, &procs, &mut c_tally, &worker).await;
    let mut floor = Tally::default();
    floor_run(&relay_env, &bodies, &procs, &mut floor, &worker).await;
    floor_run(&relay_env, &bodies, &procs, &mut floor, &worker).await;
    let second_worker = worker_run(&bodies, &procs, &mut c_tally, &worker).await;
    let e2e = first_worker.merge(second_worker);
    let (second_relay, returned_second, extra_second) =
        relay_run(&relay_env, &bodies, &procs, &mut a2).await;
    if returned_first + returned_second + extra_first + extra_second > 0 {
        notes.push(format!(
            "(a2) after each relay acked all {m} deliveries and closed its channel, the broker \
             put {returned_first} and {returned_second} messages back in the quorum queue \
             (purged); the sink received {extra_first} and {extra_second} more than {m}"
        ));
    }
    drop(relay_env);
    drop(bodies);
    usage.push(cpu_use(&procs, "a2 no-work relay (quorum), 2 runs", &a2));
    let floor = cpu_use(&procs, "d floor: broker work alone, 2 runs", &floor);
    let floor_us = floor.bench;
    usage.push(floor);
    let c_cpu = cpu_use(&procs, "c worker end to end, 2 runs", &c_tally);
    let cpu_us_per_msg = c_cpu.worker;
    usage.push(c_cpu);
    let a2_rate = a2.rate();
    // Timed from readiness, as the relay times itself from its open channels; from spawn
    // shown beside it.
    let c = rate(2 * m, e2e.elapsed.saturating_sub(e2e.ready));
    let c_spawn = rate(2 * m, e2e.elapsed);
    lines.push(line(
        "(a2) ceiling: no-work relay, quorum queue",
        format!("{a2_rate:.0} msgs/s"),
        "",
        None,
        &format!("runs before/after (c): {first_relay:.0} / {second_relay:.0} msgs/s"),
        None,
    ));
    lines.push(line(
        "(c) worker binary end to end",
        format!("{c:.0} msgs/s"),
        "(a2)",
        Some(c / a2_rate),
        &format!(
            ">= {:.0}% (runs: {}; {} dispatched, {} denied; {}; from readiness; from spawn \
             {c_spawn:.0} msgs/s, {:.0}%)",
            END_TO_END_MIN_RATIO * 100.0,
            e2e.runs
                .iter()
                .map(|r| format!("{r:.0}"))
                .collect::<Vec<_>>()
                .join(" / "),
            e2e.dispatched,
            e2e.denied,
            worker.describe(),
            c_spawn / a2_rate * 100.0
        ),
        Some(c / a2_rate >= END_TO_END_MIN_RATIO),
    ));
    lines.push(line(
        "(c) decision latency p50 / p99",
        format!(
            "{} / {}",
            ms(e2e.decision.quantile(0.5)),
            ms(e2e.decision.quantile(0.99))
        ),
        "",
        None,
        &format!(
            "mean {}, {} samples",
            ms((e2e.decision.count > 0.0).then(|| e2e.decision.sum / e2e.decision.count)),
            e2e.decision.count
        ),
        None,
    ));
    lines.push(line(
        "(d) worker CPU per message",
        format!("{:.1} us", cpu_us_per_msg),
        "target",
        Some(cpu_us_per_msg / CPU_MAX_US_PER_MSG),
        &format!("<= {CPU_MAX_US_PER_MSG:.0} us"),
        Some(cpu_us_per_msg <= CPU_MAX_US_PER_MSG),
    ));
    lines.push(line(
        "(d) floor: the worker's broker work alone",
        format!("{floor_us:.1} us"),
        "target",
        Some(floor_us / CPU_MAX_US_PER_MSG),
        &format!(
            "info: the worker's AMQP client, Publisher and Settler, half published; the worker's \
             other work costs {:.1} us",
            cpu_us_per_msg - floor_us
        ),
        None,
    ));
    let rss_mib = e2e.hwm_kib as f64 / 1024.0;
    lines.push(line(
        "(d) worker peak RSS (VmHWM)",
        format!("{rss_mib:.1} MiB"),
        "target",
        Some(rss_mib / RSS_MAX_MIB),
        &format!("<= {RSS_MAX_MIB:.0} MiB"),
        Some(rss_mib <= RSS_MAX_MIB),
    ));
    notes.push(format!(
        "(d) the worker's {} threads made {:.1} context switches per message and its sockets sent \
         {:.2} TCP data segments per message (Redis, broker and Postgres, start-up included); \
         its CPU per message by thread (user + system us, start-up included): {}",
        e2e.threads,
        e2e.switches_per_msg,
        e2e.segments_per_msg,
        e2e.threads_cpu
            .iter()
            .map(|(name, user, system)| format!("{name} {user:.1} + {system:.1}"))
            .collect::<Vec<_>>()
            .join("; ")
    ));
    notes.push(format!(
        "(c) over both runs the worker sent {:.0} multiple and {:.0} single acks for {} messages, \
         and wrote its {} denials in {:.0} batches ({:.0} rows each)",
        e2e.ack_frames.0,
        e2e.ack_frames.1,
        2 * m,
        e2e.denied,
        e2e.denial_batches,
        e2e.denied as f64 / e2e.denial_batches.max(1.0)
    ));
    notes.push(format!(
        "(c) Redis commands per message, server-wide (calls, us executing; EVALSHA's time \
         includes the commands its script runs, listed too): {}",
        e2e.commands
            .iter()
            .map(|(name, calls, us)| format!("{name} {calls:.2} x, {us:.1} us"))
            .collect::<Vec<_>>()
            .join("; ")
    ));
    notes.push(format!(
        "(c) the worker was ready (consuming, Redis and Postgres reachable) {:.0} ms after \
         spawn, both runs together: process start, connections, topology. Its rate is timed from then, as (a2) times \
         itself from its open channels; the table's (c) row and (d) count from spawn. \
         Dispatch publish+confirm p50/p99 {} / {}; denial write p50/p99 {} / {}",
        e2e.ready.as_secs_f64() * 1e3,
        ms(e2e.dispatch.quantile(0.5)),
        ms(e2e.dispatch.quantile(0.99)),
        ms(e2e.denial_write.quantile(0.5)),
        ms(e2e.denial_write.quantile(0.99)),
    ));

    // (g) Latency at half the rate (c) reached: the worker not saturated, as in service; the
    // relay of (a2) at the same rate first, the broker's share of it.
    let mut g_relay = Tally::default();
    let floor = latency_run(
        Hop::Relay,
        c / 2.0,
        args.latency_seconds,
        &procs,
        &mut g_relay,
    )
    .await;
    usage.push(cpu_use(
        &procs,
        "g relay at half (c)'s rate, paced",
        &g_relay,
    ));
    let mut g = Tally::default();
    let hop = Hop::Worker(&worker);
    let latency = latency_run(hop, c / 2.0, args.latency_seconds, &procs, &mut g).await;
    usage.push(cpu_use(&procs, "g worker at half (c)'s rate, paced", &g));
    let p99 = latency.quantile(0.99);
    let complete = latency.samples.len() == latency.counted;
    let detail = |l: &Latency| {
        format!(
            "max {}; {} of {} dispatched at {:.0} msgs/s = {:.0}% of (c), {} s after {} s \
             warm-up",
            ms(l.quantile(1.0)),
            l.samples.len(),
            l.counted,
            l.achieved,
            l.achieved / c * 100.0,
            args.latency_seconds,
            LATENCY_WARM_UP.as_secs()
        )
    };
    lines.push(line(
        "(g) publish-to-dispatch latency p50 / p99",
        format!("{} / {}", ms(latency.quantile(0.5)), ms(p99)),
        "target",
        p99.map(|p| p * 1e3 / LATENCY_MAX_P99_MS),
        &format!("p99 <= {LATENCY_MAX_P99_MS:.0} ms ({})", detail(&latency)),
        Some(complete && p99.is_some_and(|p| p * 1e3 <= LATENCY_MAX_P99_MS)),
    ));
    lines.push(line(
        "(g) floor: the no-work relay, p50 / p99",
        format!("{} / {}", ms(floor.quantile(0.5)), ms(floor.quantile(0.99))),
        "",
        None,
        &format!("info: the broker's share ({})", detail(&floor)),
        None,
    ));

    // (e) Scale. Pre-populate the recipients' headline keys with the bare loop, one send each
    // PREPOPULATE_DAYS_BEFORE days before the measured day; then run the decision path over
    // two disjoint pools drawn from them, in alternating slices: the small pool in rounds
    // PREPOPULATE_DAYS_BEFORE days apart (each recipient twice per round), the large pool
    // once (each recipient twice). Every measured recipient has one earlier send in its window
    // and gets one admitted and one denied message, so both pools take the same script paths.
    let big = args.recipients;
    let small = args.small_recipients;
    let pool_n = args.pool_decisions;
    let round = 2 * small;
    let prepop_at = base - chrono::Duration::days(PREPOPULATE_DAYS_BEFORE);
    let memory_before = used_memory(&mut plain).await;
    let mut progress = Progress::new("e pre-populate (bare loop)", big);
    let before = procs.snap(None).await;
    let (_, took) = lua.run(&mut progress, 0..big, "u", prepop_at, |i| i).await;
    let mut prepopulate = Tally::default();
    prepopulate.add(before, procs.snap(None).await, big, big, took);
    usage.push(cpu_use(
        &procs,
        "e pre-populate (bare EVALSHA, all admitted)",
        &prepopulate,
    ));
    let memory_after = used_memory(&mut plain).await;
    let stride = scatter_stride(big);
    let drawn = |j: usize| format!("u{}", j * stride % big);
    // MEMORY USAGE over a sample of the headline keys, each with one admitted send.
    let sample = args.sample.min(big);
    let mut pipe = redis::pipe();
    for j in 0..sample {
        pipe.cmd("MEMORY")
            .arg("USAGE")
            .arg(headline_key(&ns, &drawn(big - 1 - j)))
            .arg("SAMPLES")
            .arg(0);
    }
    let sizes: Vec<Option<u64>> = pipe.query_async(&mut plain).await.expect("MEMORY USAGE");
    let found: Vec<u64> = sizes.into_iter().flatten().collect();
    let bytes = found.iter().sum::<u64>() as f64 / found.len().max(1) as f64;
    lines.push(line(
        "(e) Redis MEMORY USAGE per active recipient",
        format!("{bytes:.0} B"),
        "target",
        Some(bytes / BYTES_MAX_PER_RECIPIENT),
        &format!(
            "<= {BYTES_MAX_PER_RECIPIENT:.0} B (mean of {} keys, 1 send each)",
            found.len()
        ),
        Some(bytes <= BYTES_MAX_PER_RECIPIENT),
    ));
    notes.push(format!(
        "(e) INFO used_memory grew {:.1} MiB for {big} recipients: {:.0} B per recipient, \
         counting the keyspace and expires dictionaries that MEMORY USAGE leaves out",
        (memory_after - memory_before) as f64 / 1048576.0,
        (memory_after - memory_before) as f64 / big as f64
    ));

    let half = pool_n / 2;
    let large_messages: Vec<SendRequest> = (0..pool_n)
        .map(|i| decode(&format!("ue{i}"), &drawn(i / 2)))
        .collect();
    let small_messages: Vec<SendRequest> = (0..pool_n)
        .map(|i| {
            decode(
                &format!("s{}m{i}", i / round),
                &drawn(half + (i % round) / 2),
            )
        })
        .collect();
    let small_at = |i: usize| {
        base + chrono::Duration::days(PREPOPULATE_DAYS_BEFORE * (i / round) as i64)
            + chrono::Duration::milliseconds((i % round) as i64)
    };
    let mut progress_small = Progress::new("e decision path, small pool", pool_n);
    let mut progress_large = Progress::new("e decision path, large pool", pool_n);
    let (mut e_small, mut e_large) = (Tally::default(), Tally::default());
    for k in 0..pool_n / round {
        let range = k * round..(k + 1) * round;
        let before = procs.snap(None).await;
        let (allowed, took) = evaluate_all(
            &mut progress_small,
            &limiter,
            &headline,
            &small_messages,
            range.clone(),
            small_at,
            concurrency,
        )
        .await;
        let middle = procs.snap(None).await;
        e_small.add(before, middle, round, allowed, took);
        let (allowed, took) = evaluate_all(
            &mut progress_large,
            &limiter,
            &headline,
            &large_messages,
            range,
            at,
            concurrency,
        )
        .await;
        e_large.add(middle, procs.snap(None).await, round, allowed, took);
    }
    drop(small_messages);
    drop(large_messages);
    assert_eq!(
        e_small.allowed, e_large.allowed,
        "the two pools took different script paths"
    );
    usage.push(cpu_use(
        &procs,
        &format!("e evaluate, pool of {small}"),
        &e_small,
    ));
    usage.push(cpu_use(
        &procs,
        &format!("e evaluate, pool of {big}"),
        &e_large,
    ));
    let (small_rate, large_rate) = (e_small.rate(), e_large.rate());
    lines.push(line(
        &format!("(e) decision path, {small} recipients"),
        format!("{small_rate:.0} dec/s"),
        "",
        None,
        &format!(
            "{:.0}% allowed, {} rounds of 2 per recipient",
            e_small.allowed_pct(),
            pool_n / round
        ),
        None,
    ));
    lines.push(line(
        &format!("(e) decision path, {big} recipients"),
        format!("{large_rate:.0} dec/s"),
        "small",
        Some(large_rate / small_rate),
        &format!(
            ">= {:.0}% ({:.0}% allowed, {} keys in Redis)",
            (1.0 - SCALE_MAX_LOSS) * 100.0,
            e_large.allowed_pct(),
            big
        ),
        Some(large_rate / small_rate >= 1.0 - SCALE_MAX_LOSS),
    ));
    let removed = purge(&mut plain, &pattern, "e cleanup").await;
    eprintln!("[e cleanup] unlinked {removed} keys");

    // (f) Hot recipients and the deny cache. The hot recipients are full for the whole window:
    // the headline rule (one send a day, three in seven days) holds one send on each of the
    // last three days, so no zone has room for them until the oldest leaves the window, and
    // the cache may answer for them. (One send today is not enough: a zone already on
    // tomorrow could still admit one, so such a recipient is never cached.)
    let hot = args.hot_recipients;
    let hot_n = args.hot_decisions;
    let hot_slice = hot_n / SLICES;
    let hot_recipient = |i: usize| format!("h{}", i % hot);
    for days_before in (0..3).rev() {
        let day = base - chrono::Duration::days(days_before);
        let primes: Vec<SendRequest> = (0..hot)
            .map(|r| decode(&format!("hp{days_before}r{r}"), &hot_recipient(r)))
            .collect();
        let mut progress = Progress::new(&format!("f prime, {days_before} days before"), hot);
        let (allowed, _) = evaluate_all(
            &mut progress,
            &limiter,
            &headline,
            &primes,
            0..hot,
            |_| day,
            concurrency,
        )
        .await;
        assert_eq!(
            allowed, hot,
            "priming {days_before} days before admitted {allowed}"
        );
    }
    // A worker enables its cache once its pub/sub invalidation subscription listens. Here
    // nothing else writes these recipients' keys (no resets, refunds or partial
    // re-admissions, so nothing would be announced): enabling it directly is exact.
    let cache = Arc::new(DenyCache::new());
    cache.enable(true);
    let cached = Limiter::new(env.redis.clone(), &ns).with_deny_cache(cache.clone());
    // One denial per recipient fills the cache (each one a miss: its recipient is not cached
    // yet), outside the measurement; every measured decision with the cache is then a hit.
    let fills: Vec<SendRequest> = (0..hot)
        .map(|r| decode(&format!("hf{r}"), &hot_recipient(r)))
        .collect();
    let mut progress = Progress::new("f fill the deny cache", hot);
    let (allowed, _) = evaluate_all(
        &mut progress,
        &cached,
        &headline,
        &fills,
        0..hot,
        at,
        concurrency,
    )
    .await;
    assert_eq!(
        (allowed, cache.hits()),
        (0, 0),
        "filling the cache: (admitted, cache hits)"
    );
    drop(fills);

    // New ids to the hot recipients round robin, distinct per side, at base + i ms (one day):
    // without the cache, with it, and the bare loop (ids hm<i>), in alternating slices.
    let uncached_messages: Vec<SendRequest> = (0..hot_n)
        .map(|i| decode(&format!("hn{i}"), &hot_recipient(i)))
        .collect();
    let cached_messages: Vec<SendRequest> = (0..hot_n)
        .map(|i| decode(&format!("hc{i}"), &hot_recipient(i)))
        .collect();
    let mut progress_plain = Progress::new("f hot recipients, no cache", hot_n);
    let mut progress_cached = Progress::new("f hot recipients, deny cache", hot_n);
    let mut progress_ceiling = Progress::new("f bare pipelined EVALSHA, hot denials", hot_n);
    let (mut f_plain, mut f_cached, mut f_ceiling) =
        (Tally::default(), Tally::default(), Tally::default());
    for k in 0..SLICES {
        let range = k * hot_slice..(k + 1) * hot_slice;
        let before = procs.snap(None).await;
        let (allowed, took) = evaluate_all(
            &mut progress_plain,
            &limiter,
            &headline,
            &uncached_messages,
            range.clone(),
            at,
            concurrency,
        )
        .await;
        let middle = procs.snap(None).await;
        f_plain.add(before, middle, hot_slice, allowed, took);
        let (allowed, took) = evaluate_all(
            &mut progress_cached,
            &cached,
            &headline,
            &cached_messages,
            range.clone(),
            at,
            concurrency,
        )
        .await;
        let after = procs.snap(None).await;
        f_cached.add(middle, after, hot_slice, allowed, took);
        let (allowed, took) = lua
            .run(&mut progress_ceiling, range, "h", base, |i| i % hot)
            .await;
        f_ceiling.add(after, procs.snap(None).await, hot_slice, allowed, took);
    }
    drop(uncached_messages);
    drop(cached_messages);
    assert_eq!(
        (f_plain.allowed, f_cached.allowed, f_ceiling.allowed),
        (0, 0, 0),
        "new ids to full recipients admitted (no cache, deny cache, bare loop)"
    );
    let measured_hits = cache.hits();
    assert_eq!(
        measured_hits, hot_n as u64,
        "the cache answered {measured_hits} of {hot_n} decisions after it was filled (more \
         hot recipients than it holds?)"
    );

    // Exactness on a sample (tests/it/deny_cache.rs checks it in full): a cached verdict equals
    // an uncached one for the same recipient and instant (another new id each); and a
    // redelivery of an id admitted today is admitted again by Redis, not refused from the
    // cache.
    let sample = args.sample.min(hot_n);
    let stride = scatter_stride(hot_n);
    let view = |e: &sendquota::limiter::Evaluation| {
        (
            e.committed,
            e.verdicts
                .iter()
                .map(|v| {
                    (
                        v.rule.clone(),
                        v.kind,
                        v.allowed,
                        v.remaining,
                        v.retry_after,
                    )
                })
                .collect::<Vec<_>>(),
        )
    };
    let pairs: Vec<_> = futures_util::stream::iter(0..sample)
        .map(|j| {
            let i = j * stride % hot_n;
            let (cached, limiter, headline) = (&cached, &limiter, &headline);
            async move {
                let a = cached
                    .evaluate(
                        headline,
                        &decode(&format!("hq{j}"), &hot_recipient(i)),
                        at(i),
                        true,
                    )
                    .await
                    .expect("evaluate");
                let b = limiter
                    .evaluate(
                        headline,
                        &decode(&format!("hs{j}"), &hot_recipient(i)),
                        at(i),
                        true,
                    )
                    .await
                    .expect("evaluate");
                (i, a, b)
            }
        })
        .buffer_unordered(concurrency)
        .collect()
        .await;
    for (i, a, b) in &pairs {
        assert!(
            !a.committed && view(a) == view(b),
            "decision {i}: the cache's verdicts {a:?} differ from Redis' {b:?}"
        );
    }
    assert_eq!(
        cache.hits() - measured_hits,
        sample as u64,
        "the sampled cached decisions did not all come from the cache"
    );
    let redelivered = sample.min(hot);
    let hits_before = cache.hits();
    let redeliveries: Vec<_> = futures_util::stream::iter(0..redelivered)
        .map(|r| {
            let (cached, limiter, headline) = (&cached, &limiter, &headline);
            async move {
                let m = decode(&format!("hp0r{r}"), &hot_recipient(r));
                let a = cached
                    .evaluate(headline, &m, at(r), true)
                    .await
                    .expect("evaluate");
                let b = limiter
                    .evaluate(headline, &m, at(r), true)
                    .await
                    .expect("evaluate");
                (r, a, b)
            }
        })
        .buffer_unordered(concurrency)
        .collect()
        .await;
    for (r, a, b) in &redeliveries {
        assert!(
            a.committed && a.verdicts.iter().all(|v| v.already) && view(a) == view(b),
            "redelivery to {}: {a:?} with the cache, {b:?} without",
            hot_recipient(*r)
        );
    }
    assert_eq!(
        cache.hits(),
        hits_before,
        "a redelivery was answered from the cache"
    );

    usage.push(cpu_use(
        &procs,
        "f evaluate, hot recipients, no cache",
        &f_plain,
    ));
    usage.push(cpu_use(
        &procs,
        "f evaluate, hot recipients, deny cache",
        &f_cached,
    ));
    usage.push(cpu_use(
        &procs,
        "f bare pipelined EVALSHA, hot denials",
        &f_ceiling,
    ));
    let (plain_rate, cached_rate, ceiling_rate) =
        (f_plain.rate(), f_cached.rate(), f_ceiling.rate());
    lines.push(line(
        "(f) hot recipients, no cache",
        format!("{plain_rate:.0} dec/s"),
        "(f) ceil",
        Some(plain_rate / ceiling_rate),
        &format!(
            "info ({:.0}% allowed, {hot} full recipients, {concurrency} concurrent)",
            f_plain.allowed_pct()
        ),
        None,
    ));
    lines.push(line(
        "(f) hot recipients, deny cache",
        format!("{cached_rate:.0} dec/s"),
        "no cache",
        Some(cached_rate / plain_rate),
        &format!(
            "> {:.0}% ({:.0}% allowed, {measured_hits} of {hot_n} from the cache)",
            DENY_CACHE_MIN_SPEEDUP * 100.0,
            f_cached.allowed_pct()
        ),
        Some(cached_rate / plain_rate > DENY_CACHE_MIN_SPEEDUP),
    ));
    lines.push(line(
        "(f) ceiling: pipelined EVALSHA, denials",
        format!("{ceiling_rate:.0} dec/s"),
        "",
        None,
        &format!(
            "info: the deny cache at {:.0}% of it ({})",
            cached_rate / ceiling_rate * 100.0,
            if cached_rate > ceiling_rate {
                "exceeds the Redis ceiling for denials"
            } else {
                "below the Redis ceiling for denials"
            }
        ),
        None,
    ));
    notes.push(format!(
        "(f) {hot} hot recipients primed with a send on each of the last 3 days (full for the \
         7-day window); {hot} denials filled the cache before the measured slices, then it \
         answered {measured_hits} of {hot_n} measured decisions; {sample} sampled cached \
         verdicts equal uncached ones for the same recipient and instant; {redelivered} \
         redeliveries of ids admitted today were admitted (already) by Redis, not refused \
         from the cache"
    ));
    let removed = purge(&mut plain, &pattern, "f cleanup").await;
    eprintln!("[f cleanup] unlinked {removed} keys");
    drop(env);

    // Report.
    println!();
    println!(
        "sendquota perf ({} s): {n} decisions per decision phase, {m} messages per broker \
         phase, {big} recipients' keys, {hot_n} decisions per side of (f) to {hot} hot \
         recipients",
        started.elapsed().as_secs()
    );
    println!("worker: {} ({})", worker.bin, worker.describe());
    println!(
        "{:<50} {:>18} {:>9} {:>6}  target / detail",
        "figure", "value", "vs", "ratio"
    );
    for l in &lines {
        println!(
            "{:<50} {:>18} {:>9} {:>6}  {:<50} {}",
            l.figure, l.value, l.against, l.ratio, l.target, l.verdict
        );
    }
    println!();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "Microseconds per operation: wall time, then CPU time by process ({cores} cores = \
         {cores} CPU-us per wall-us; 'other' = every other process, e.g. a build; 'idle' = \
         unused); '(lua)' = time Redis spent inside EVALSHA (INFO commandstats: elapsed, so it \
         exceeds redis' CPU when Redis is descheduled); redis minus (lua) is protocol and \
         socket work; 'r-sw' = Redis context switches per operation (how often it sleeps and \
         wakes). Redis figures are server-wide: other clients of this Redis count too."
    );
    println!(
        "{:<46} {:>8} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7} {:>6}",
        "phase",
        "ops",
        "wall",
        "bench",
        "redis",
        "(lua)",
        "rabbit",
        "pg",
        "worker",
        "other",
        "idle",
        "r-sw"
    );
    for u in &usage {
        println!(
            "{:<46} {:>8} {:>7.1} {:>7.1} {:>7.1} {:>7.1} {:>7.1} {:>7.1} {:>7.1} {:>7.1} {:>7.1} \
             {:>6.2}",
            u.phase,
            u.ops,
            u.wall,
            u.bench,
            u.redis,
            u.lua,
            u.rabbit,
            u.postgres,
            u.worker,
            u.other,
            u.idle,
            u.redis_switches
        );
    }
    let disturbed: Vec<&str> = usage
        .iter()
        .filter(|u| u.other > 0.15 * u.wall * cores as f64)
        .map(|u| u.phase.as_str())
        .collect();
    if !disturbed.is_empty() {
        println!(
            "warning: other processes used over 15% of the machine during: {}; those figures \
             are understated",
            disturbed.join(", ")
        );
    }
    println!();
    for note in &notes {
        println!("{note}");
    }
}
