//! The report: one table of figures (value, what it is measured against, the ratio, the target
//! or detail, ok or MISS), one table of CPU time per operation by process for every phase, a
//! warning naming the phases another process disturbed, and notes. Figure names and columns are
//! quoted by docs/performance.md: change them there too.

use std::time::Duration;

use crate::args::Args;
use crate::procs::{cpu_use, CpuUse, Procs, Tally};
use crate::worker::WorkerChoice;

/// What the phases found, in the order they found it.
#[derive(Default)]
pub struct Report {
    lines: Vec<Line>,
    usage: Vec<CpuUse>,
    notes: Vec<String>,
}

impl Report {
    /// Adds a row to the figures' table (see [`line`]).
    pub fn figure(
        &mut self,
        figure: &str,
        value: String,
        against: &str,
        ratio: Option<f64>,
        target: &str,
        ok: Option<bool>,
    ) {
        self.lines
            .push(line(figure, value, against, ratio, target, ok));
    }

    /// Adds `phase`'s row to the CPU table, and returns it.
    pub fn cpu(&mut self, procs: &Procs, phase: &str, tally: &Tally) -> &CpuUse {
        self.usage.push(cpu_use(procs, phase, tally));
        self.usage.last().expect("just pushed")
    }

    pub fn note(&mut self, note: String) {
        self.notes.push(note);
    }

    /// Prints the report on stdout: a heading with the run's sizes and `elapsed`, the worker
    /// measured, the figures, the CPU table and the notes.
    pub fn print(&self, args: &Args, worker: &WorkerChoice, elapsed: Duration) {
        println!();
        println!(
            "sendquota perf ({} s): {} decisions per decision phase, {} messages per broker \
             phase, {} recipients' keys, {} decisions per side of (f) to {} hot recipients",
            elapsed.as_secs(),
            args.decisions,
            args.messages,
            args.recipients,
            args.hot_decisions,
            args.hot_recipients,
        );
        println!("worker: {} ({})", worker.bin, worker.describe());
        self.print_figures();
        println!();
        self.print_cpu();
        println!();
        for note in &self.notes {
            println!("{note}");
        }
    }

    fn print_figures(&self) {
        println!(
            "{:<50} {:>18} {:>9} {:>6}  target / detail",
            "figure", "value", "vs", "ratio"
        );
        for l in &self.lines {
            println!(
                "{:<50} {:>18} {:>9} {:>6}  {:<50} {}",
                l.figure, l.value, l.against, l.ratio, l.target, l.verdict
            );
        }
    }

    /// The CPU table, and the warning naming the phases other processes disturbed.
    fn print_cpu(&self) {
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
        for u in &self.usage {
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
        let disturbed: Vec<&str> = self
            .usage
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
    }
}

struct Line {
    figure: String,
    value: String,
    against: String,
    ratio: String,
    target: String,
    verdict: &'static str,
}

/// A row of the table: `value` of `figure`, its `ratio` to what it is measured `against`,
/// the target or detail, and a verdict when there is a target (`ok`).
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

/// `n` operations over `d`, per second.
pub fn rate(n: usize, d: Duration) -> f64 {
    n as f64 / d.as_secs_f64()
}

/// Seconds as milliseconds, `n/a` when there were none.
pub fn ms(seconds: Option<f64>) -> String {
    seconds.map_or_else(|| "n/a".to_owned(), |s| format!("{:.2} ms", s * 1e3))
}

/// How a ceiling's shape or runtime is chosen: `run(i)` (a rate, msgs/s) for each candidate
/// `names[i]` in turn, `rounds` alternating rounds, progress on stderr under `label`; then
/// [`print_fastest`] with `title`.
pub async fn compare_alternating<F, Fut>(
    label: &str,
    title: &str,
    names: &[String],
    rounds: usize,
    mut run: F,
) where
    F: FnMut(usize) -> Fut,
    Fut: std::future::Future<Output = f64>,
{
    let mut rates = vec![Vec::new(); names.len()];
    for round in 0..rounds {
        for (i, name) in names.iter().enumerate() {
            eprintln!("[{label}] round {}/{rounds}: {name}", round + 1);
            let r = run(i).await;
            eprintln!("[{label}]   {r:.0} msgs/s");
            rates[i].push(r);
        }
    }
    print_fastest(title, names, rates);
}

/// Prints each candidate's rates over alternating rounds, its median and the fastest, as
/// `fastest: K. at R msgs/s: NAME` (benches/perf/issue39.sh reads K). `names[i]` ran at
/// `rates[i]`.
fn print_fastest(title: &str, names: &[String], rates: Vec<Vec<f64>>) {
    println!("{title}:");
    let mut best = (0.0, 0);
    for (i, (name, mut r)) in names.iter().zip(rates).enumerate() {
        let runs = r
            .iter()
            .map(|x| format!("{x:.0}"))
            .collect::<Vec<_>>()
            .join(" / ");
        r.sort_by(f64::total_cmp);
        let median = r.get(r.len() / 2).copied().unwrap_or(0.0);
        if median > best.0 {
            best = (median, i);
        }
        println!(
            "  {:>2}. median {median:>6.0} msgs/s  ({runs})  {name}",
            i + 1
        );
    }
    let fastest = names.get(best.1).map_or("", String::as_str);
    println!(
        "fastest: {}. at {:.0} msgs/s: {fastest}",
        best.1 + 1,
        best.0
    );
}
