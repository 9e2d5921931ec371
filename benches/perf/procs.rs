//! Where the time goes, from /proc: the CPU time of this process, Redis (and, from INFO
//! commandstats, the part of it inside scripts), RabbitMQ, Postgres, the worker and everything
//! else on the machine over a phase, per operation; and the worker's own figures (peak RSS,
//! context switches, CPU by thread, TCP segments sent). On a small shared machine a rate alone
//! does not say whether the code or a neighbour was slow.

use std::collections::BTreeMap;
use std::process::Command;
use std::time::Duration;

use redis::aio::MultiplexedConnection;

use crate::common::{self, clock_ticks_per_second, cpu_ticks, machine_ticks, pids_named};

/// The first number after `field` in /proc/PID/`file` (VmHWM in status is in KiB), 0 if the
/// process or the field is gone.
pub fn proc_number(pid: u32, file: &str, field: &str) -> u64 {
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
pub struct Procs {
    /// For INFO commandstats.
    pub conn: MultiplexedConnection,
    redis: String,
    rabbit: Vec<String>,
    pub tick_us: f64,
}

#[derive(Clone, Copy, Default)]
pub struct CpuSnap {
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
    pub async fn find(conn: &mut MultiplexedConnection) -> Procs {
        let redis = common::local_redis_pid(conn).await.unwrap_or_default();
        Procs {
            conn: conn.clone(),
            redis,
            rabbit: pids_named("beam.smp"),
            tick_us: 1e6 / clock_ticks_per_second(),
        }
    }

    pub async fn snap(&self, worker: Option<u32>) -> CpuSnap {
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
            postgres: common::postgres_ticks(),
            worker: worker.and_then(|p| cpu_ticks(&p.to_string())).unwrap_or(0),
        }
    }
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
pub struct Tally {
    pub ops: usize,
    pub allowed: usize,
    pub wall: Duration,
    cpu: CpuSnap,
}

impl Tally {
    pub fn add(
        &mut self,
        before: CpuSnap,
        after: CpuSnap,
        ops: usize,
        allowed: usize,
        wall: Duration,
    ) {
        self.ops += ops;
        self.allowed += allowed;
        self.wall += wall;
        self.cpu = self.cpu.plus(before.until(after));
    }

    pub fn rate(&self) -> f64 {
        self.ops as f64 / self.wall.as_secs_f64()
    }

    pub fn allowed_pct(&self) -> f64 {
        100.0 * self.allowed as f64 / self.ops.max(1) as f64
    }
}

/// CPU microseconds per operation of one phase, per process; `other` is every other process
/// on the machine (another build, say), `idle` what no process used.
pub struct CpuUse {
    pub phase: String,
    pub ops: usize,
    pub wall: f64,
    pub bench: f64,
    pub redis: f64,
    pub rabbit: f64,
    pub postgres: f64,
    pub worker: f64,
    pub other: f64,
    pub idle: f64,
    pub lua: f64,
    /// Redis main-thread context switches per operation.
    pub redis_switches: f64,
}

pub fn cpu_use(procs: &Procs, phase: &str, t: &Tally) -> CpuUse {
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

/// TCP data segments sent so far over every established socket of `pid` (`ss`'s
/// `data_segs_out`): each socket write of the worker's clients leaves as at least one segment.
/// System-call counters (`syscw` in /proc/PID/io) miss them: they count write and writev, and
/// the clients write with send. 0 when `ss` cannot be run.
pub fn segments_sent(pid: u32) -> u64 {
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
pub fn context_switches(pid: u32) -> (u64, usize) {
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
pub fn thread_ticks(pid: u32) -> BTreeMap<String, (u64, u64)> {
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
