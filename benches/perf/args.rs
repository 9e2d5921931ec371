//! The bench's flags, each a whole number above zero. Unlike `common::flag`, an unknown flag is
//! an error too (exit code 2): a typo must not cost a run of several minutes at the default
//! sizes. After parsing, sizes are rounded so every phase divides into whole slices and rounds.

use crate::phases::SLICES;

/// The sizes of the phases; see the bench's doc for which flag feeds which phase.
#[derive(Clone)]
pub struct Args {
    pub decisions: usize,
    pub concurrency: usize,
    pub pipeline: usize,
    pub in_flight: usize,
    pub messages: usize,
    pub recipients: usize,
    pub small_recipients: usize,
    pub pool_decisions: usize,
    /// (e): how many headline keys MEMORY USAGE is averaged over.
    pub sample: usize,
    pub hot_recipients: usize,
    pub hot_decisions: usize,
    /// 0: the worker's defaults.
    pub worker_prefetch: usize,
    pub latency_seconds: usize,
    /// Rounds of the relay-shape comparison; when set it is the only thing run.
    pub relay_shapes: usize,
    /// `--decision-phases-only 1`: the warm-up, (a1) and (b) only, no broker, no worker.
    pub decision_phases_only: usize,
    /// `--latency-rate N`: (g) alone, at N msgs/s (instead of half of (c)'s rate).
    pub latency_rate: usize,
    /// `--end-to-end-only 1`: (a2), (c) and (d) only, for A/B of the worker.
    pub end_to_end_only: usize,
    /// `--relay-prefetch N`: (a2) and (g)'s relay consume with prefetch N instead of
    /// [`crate::relay::RELAY_PREFETCH`]; at the worker's own prefetch it shows how much of (c)'s
    /// distance to (a2) is the window alone.
    pub relay_prefetch: usize,
    /// `--relay-shapes-short ROUNDS`: only (a2) in the shapes of
    /// [`crate::relay::RelayShape::short_list`], alternating; when set it is the only thing run.
    pub relay_shapes_short: usize,
    /// `--relay-shape K`: (a2) in the K-th shape (from 1) of the short list instead of
    /// [`crate::relay::RelayShape::CEILING`].
    pub relay_shape: usize,
    /// `--series PAIRS`: issue 39's series alone (`phases::series`).
    pub series: usize,
    /// `--work-relay-runtimes ROUNDS`: only (a3) on each of
    /// [`crate::phases::work_relay::WORK_RELAY_RUNTIMES`], alternating; when set it is the only
    /// thing run.
    pub work_relay_runtimes: usize,
    /// `--work-relay-runtime K`: (a3) on the K-th (from 1) of those runtimes instead of
    /// [`crate::phases::work_relay::WORK_RELAY_RUNTIME`].
    pub work_relay_runtime: usize,
}

impl Args {
    /// `--relay-prefetch`, checked by [`parse`] to fit a prefetch.
    pub fn relay_prefetch(&self) -> u16 {
        u16::try_from(self.relay_prefetch).unwrap_or(u16::MAX)
    }

    /// The shape (a2) runs in: `--relay-shape K` of the short list, else the default ceiling.
    pub fn relay_shape(&self) -> crate::relay::RelayShape {
        let prefetch = self.relay_prefetch();
        match self.relay_shape {
            0 => crate::relay::RelayShape::ceiling_at(prefetch),
            k => crate::relay::RelayShape::short_list(prefetch)[k - 1],
        }
    }

    /// The runtime (a3) runs on: `--work-relay-runtime K`, else the default.
    pub fn work_relay_runtime(&self) -> crate::queues::Runtime {
        use crate::phases::work_relay::{WORK_RELAY_RUNTIME, WORK_RELAY_RUNTIMES};
        match self.work_relay_runtime {
            0 => WORK_RELAY_RUNTIME,
            k => WORK_RELAY_RUNTIMES[k - 1],
        }
    }
}

/// The flags, normalised so that every phase divides into whole slices and rounds.
pub fn parse() -> Args {
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
        relay_shapes: 0,
        decision_phases_only: 0,
        latency_rate: 0,
        end_to_end_only: 0,
        relay_prefetch: crate::relay::RELAY_PREFETCH as usize,
        relay_shapes_short: 0,
        relay_shape: 0,
        series: 0,
        work_relay_runtimes: 0,
        work_relay_runtime: 0,
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
            "--relay-shapes" => &mut out.relay_shapes,
            "--decision-phases-only" => &mut out.decision_phases_only,
            "--latency-rate" => &mut out.latency_rate,
            "--end-to-end-only" => &mut out.end_to_end_only,
            "--relay-prefetch" => &mut out.relay_prefetch,
            "--relay-shapes-short" => &mut out.relay_shapes_short,
            "--relay-shape" => &mut out.relay_shape,
            "--series" => &mut out.series,
            "--work-relay-runtimes" => &mut out.work_relay_runtimes,
            "--work-relay-runtime" => &mut out.work_relay_runtime,
            "--bench" => continue,
            other => {
                eprintln!(
                    "unknown argument {other}; flags: --decisions --concurrency --pipeline \
                     --in-flight --messages --recipients --small-recipients --pool-decisions \
                     --sample --hot-recipients --hot-decisions --worker-prefetch \
                     --latency-seconds --relay-shapes --decision-phases-only --latency-rate \
                     --end-to-end-only --relay-prefetch --relay-shapes-short --relay-shape \
                     --series --work-relay-runtimes --work-relay-runtime (each takes a whole \
                     number)"
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
    let shapes = crate::relay::RelayShape::short_list(crate::relay::RELAY_PREFETCH).len();
    if out.relay_shape > shapes {
        eprintln!("--relay-shape takes 1 to {shapes}");
        std::process::exit(2)
    }
    let runtimes = crate::phases::work_relay::WORK_RELAY_RUNTIMES.len();
    if out.work_relay_runtime > runtimes {
        eprintln!("--work-relay-runtime takes 1 to {runtimes}");
        std::process::exit(2)
    }
    for (flag, value) in [
        ("--worker-prefetch", out.worker_prefetch),
        ("--relay-prefetch", out.relay_prefetch),
    ] {
        if u16::try_from(value).is_err() {
            eprintln!("{flag} takes at most {}", u16::MAX);
            std::process::exit(2)
        }
    }
    out
}
