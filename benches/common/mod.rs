//! What the benches share beyond the tests' harness: their command-line flags, Redis's
//! per-command statistics and the CPU time of processes (of the Redis server, say).

/// About the least a script that writes a key costs Redis: three plain commands (SET, PEXPIRE,
/// GET). The benches send it beside the decision script, as the reference for Redis's time per
/// decision (docs/redis-time.md). KEYS: the key; ARGV: a value and an expiry in ms.
pub const BARE_SCRIPT: &str = "\
redis.call('SET', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return redis.call('GET', KEYS[1])";

/// A bench's `--name VALUE` argument, or `default`; exits 2 with a clear line on a bad value.
pub fn flag<T: std::str::FromStr>(name: &str, default: T) -> T {
    let args: Vec<String> = std::env::args().collect();
    match args.iter().position(|a| a == name) {
        Some(i) => args
            .get(i + 1)
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| {
                eprintln!("{name} takes a number");
                std::process::exit(2)
            }),
        None => default,
    }
}

/// `INFO commandstats`: command -> (calls, microseconds executing it), server-wide (every
/// client of the server counts). Commands a script runs are counted too, and their time is also
/// inside the script's. The benches read it before and after a phase.
pub async fn command_stats(
    conn: &mut impl redis::aio::ConnectionLike,
) -> std::collections::BTreeMap<String, (u64, u64)> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .unwrap_or_default();
    info.lines()
        .filter_map(|l| {
            let (name, rest) = l.strip_prefix("cmdstat_")?.split_once(':')?;
            let field = |f: &str| -> u64 {
                rest.split(',')
                    .find_map(|kv| kv.strip_prefix(f))
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0)
            };
            Some((name.to_owned(), (field("calls="), field("usec="))))
        })
        .collect()
}

/// Clock ticks per second of /proc's CPU times.
pub fn clock_ticks_per_second() -> f64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100.0)
}

/// utime + stime of `pid` in clock ticks.
pub fn cpu_ticks(pid: &str) -> Option<u64> {
    proc_stat(pid).map(|f| own_ticks(&f))
}

/// The Redis server's process id (INFO server), when that process is on this machine: its CPU
/// time is then readable from /proc.
pub async fn local_redis_pid(conn: &mut impl redis::aio::ConnectionLike) -> Option<String> {
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query_async(conn)
        .await
        .ok()?;
    let pid = info
        .lines()
        .find_map(|l| l.strip_prefix("process_id:"))?
        .trim()
        .to_owned();
    cpu_ticks(&pid).map(|_| pid)
}

/// The Redis server's own CPU time so far (`used_cpu_user` + `used_cpu_sys` of `INFO cpu`),
/// in microseconds: what a phase cost Redis, read before and after it, whatever the client's
/// speed (benches/node/rlf.js reads the same for rate-limiter-flexible). Server-wide.
pub async fn redis_cpu_us(conn: &mut impl redis::aio::ConnectionLike) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("cpu")
        .query_async(conn)
        .await
        .unwrap_or_default();
    let field = |name: &str| -> f64 {
        info.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':')?.trim().parse().ok())
            .unwrap_or(0.0)
    };
    ((field("used_cpu_user") + field("used_cpu_sys")) * 1e6) as u64
}

/// Process ids whose command name is `comm`.
pub fn pids_named(comm: &str) -> Vec<String> {
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

/// CPU ticks of Postgres: every Postgres server (postmaster) running here, as
/// [`postgres_ticks_of`] counts one; the benches run one.
pub fn postgres_ticks() -> u64 {
    postgres_ticks_among(None)
}

/// The parent of a process: a backend's postmaster, say.
pub fn parent_of(pid: &str) -> Option<String> {
    proc_stat(pid).and_then(|f| ppid(&f)).map(|p| p.to_string())
}

/// CPU ticks of one Postgres server: its postmaster, every child alive now, and what its exited
/// children (backends, autovacuum workers) spent, which the kernel adds to the postmaster's
/// children's time when it reaps them. Without the latter a phase in which a busy backend of
/// an earlier phase exits would lose that backend's whole lifetime and read as next to none.
pub fn postgres_ticks_of(postmaster: &str) -> u64 {
    postgres_ticks_among(Some(postmaster))
}

/// [`postgres_ticks_of`] `server`, or of every server: one pass over the `postgres` processes
/// (a postmaster is one whose parent is not among them), then the postmasters' children's
/// time, read last: a backend that exits meanwhile is then counted twice at worst, never lost.
fn postgres_ticks_among(server: Option<&str>) -> u64 {
    let server = server.map(|s| s.parse::<u64>().unwrap_or(0));
    let procs: Vec<(u64, Vec<u64>)> = pids_named("postgres")
        .into_iter()
        .filter_map(|pid| Some((pid.parse().ok()?, proc_stat(&pid)?)))
        .collect();
    let pids: std::collections::HashSet<u64> = procs.iter().map(|(p, _)| *p).collect();
    let (mut live, mut postmasters) = (0, Vec::new());
    for (pid, f) in &procs {
        let parent = ppid(f).unwrap_or(0);
        let postmaster = !pids.contains(&parent);
        let of = if postmaster { *pid } else { parent };
        if server.is_some_and(|s| s != of) {
            continue;
        }
        live += own_ticks(f);
        if postmaster {
            postmasters.push(pid);
        }
    }
    let reaped: u64 = postmasters
        .iter()
        .filter_map(|pm| proc_stat(&pm.to_string()))
        .map(|f| f.get(13).unwrap_or(&0) + f.get(14).unwrap_or(&0))
        .sum();
    live + reaped
}

/// The parent's pid from [`proc_stat`]'s fields.
fn ppid(fields: &[u64]) -> Option<u64> {
    fields.get(1).copied()
}

/// utime + stime from [`proc_stat`]'s fields.
fn own_ticks(fields: &[u64]) -> u64 {
    fields.get(11).unwrap_or(&0) + fields.get(12).unwrap_or(&0)
}

/// The numeric fields of /proc/PID/stat after the command name: state (0, read as 0), ppid
/// (1), ..., utime (11), stime (12), cutime (13), cstime (14).
fn proc_stat(pid: &str) -> Option<Vec<u64>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    Some(
        rest.split_whitespace()
            .map(|f| f.parse().unwrap_or(0))
            .collect(),
    )
}

/// Busy and idle ticks of the whole machine since boot, summed over cores.
pub fn machine_ticks() -> (u64, u64) {
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
