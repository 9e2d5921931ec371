//! (e): scale. Redis memory per active recipient, and whether the decision rate holds over
//! many recipients: the recipients' headline keys pre-populated with the bare loop, one send
//! each [`PREPOPULATE_DAYS_BEFORE`] days before the measured day; then the decision path over
//! two disjoint pools drawn from them, in alternating slices: the small pool in rounds
//! [`PREPOPULATE_DAYS_BEFORE`] days apart (each recipient twice per round), the large pool once
//! (each recipient twice). Every measured recipient has one earlier send in its window and gets
//! one admitted and one denied message, so both pools take the same script paths.

use sendquota::internals::message::SendRequest;

use super::Bench;
use crate::decision_path::{decode, evaluate_all};
use crate::keyspace::{headline_key, purge, used_memory};
use crate::procs::Tally;
use crate::progress::Progress;
use crate::report::Report;

const BYTES_MAX_PER_RECIPIENT: f64 = 200.0;
const SCALE_MAX_LOSS: f64 = 0.10;

/// Days between pre-populated state and the measured decisions in (e): inside the 7-day
/// window, so every measured recipient has one earlier send in its window.
const PREPOPULATE_DAYS_BEFORE: i64 = 4;

/// (e): pre-population and memory, then the two pools; the keys removed after.
pub async fn run(bench: &mut Bench, report: &mut Report) {
    let big = bench.args.recipients;
    let stride = scatter_stride(big);
    let drawn = move |j: usize| format!("u{}", j * stride % big);
    prepopulate(bench, report, &drawn).await;
    pools(bench, report, &drawn).await;
    let removed = purge(&mut bench.plain, &bench.pattern, "e cleanup").await;
    eprintln!("[e cleanup] unlinked {removed} keys");
}

/// Writes one send for each of the recipients with the bare loop, and reports Redis's memory
/// per recipient: MEMORY USAGE over a sample of the keys (`drawn` from the end, so not the
/// pools'), and the growth of INFO used_memory.
async fn prepopulate(bench: &mut Bench, report: &mut Report, drawn: &impl Fn(usize) -> String) {
    let big = bench.args.recipients;
    let prepop_at = bench.base - chrono::Duration::days(PREPOPULATE_DAYS_BEFORE);
    let memory_before = used_memory(&mut bench.plain).await;
    let mut progress = Progress::new("e pre-populate (bare loop)", big);
    let before = bench.procs.snap(None).await;
    let (_, took) = bench
        .lua
        .run(&mut progress, 0..big, "u", prepop_at, |i| i)
        .await;
    let mut prepopulate = Tally::default();
    prepopulate.add(before, bench.procs.snap(None).await, big, big, took);
    report.cpu(
        &bench.procs,
        "e pre-populate (bare EVALSHA, all admitted)",
        &prepopulate,
    );
    let memory_after = used_memory(&mut bench.plain).await;
    // MEMORY USAGE over a sample of the headline keys, each with one admitted send.
    let sample = bench.args.sample.min(big);
    let mut pipe = redis::pipe();
    for j in 0..sample {
        pipe.cmd("MEMORY")
            .arg("USAGE")
            .arg(headline_key(&bench.env.namespace, &drawn(big - 1 - j)))
            .arg("SAMPLES")
            .arg(0);
    }
    let sizes: Vec<Option<u64>> = pipe
        .query_async(&mut bench.plain)
        .await
        .expect("MEMORY USAGE");
    let found: Vec<u64> = sizes.into_iter().flatten().collect();
    let bytes = found.iter().sum::<u64>() as f64 / found.len().max(1) as f64;
    report.figure(
        "(e) Redis MEMORY USAGE per active recipient",
        format!("{bytes:.0} B"),
        "target",
        Some(bytes / BYTES_MAX_PER_RECIPIENT),
        &format!(
            "<= {BYTES_MAX_PER_RECIPIENT:.0} B (mean of {} keys, 1 send each)",
            found.len()
        ),
        Some(bytes <= BYTES_MAX_PER_RECIPIENT),
    );
    report.note(format!(
        "(e) INFO used_memory grew {:.1} MiB for {big} recipients: {:.0} B per recipient, \
         counting the keyspace and expires dictionaries that MEMORY USAGE leaves out",
        (memory_after - memory_before) as f64 / 1048576.0,
        (memory_after - memory_before) as f64 / big as f64
    ));
}

/// The decision path over the small pool and the large one, in alternating rounds of the
/// small pool's size.
async fn pools(bench: &Bench, report: &mut Report, drawn: &impl Fn(usize) -> String) {
    let (big, small) = (bench.args.recipients, bench.args.small_recipients);
    let (pool_n, concurrency) = (bench.args.pool_decisions, bench.args.concurrency);
    let (procs, base) = (&bench.procs, bench.base);
    let round = 2 * small;
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
            &bench.limiter,
            &bench.headline,
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
            &bench.limiter,
            &bench.headline,
            &large_messages,
            range,
            bench.at(),
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
    report.cpu(procs, &format!("e evaluate, pool of {small}"), &e_small);
    report.cpu(procs, &format!("e evaluate, pool of {big}"), &e_large);
    pool_figures(bench, report, &e_small, &e_large);
}

/// The small pool's rate, and the large one's against it.
fn pool_figures(bench: &Bench, report: &mut Report, e_small: &Tally, e_large: &Tally) {
    let (big, small) = (bench.args.recipients, bench.args.small_recipients);
    let round = 2 * small;
    let pool_n = bench.args.pool_decisions;
    let (small_rate, large_rate) = (e_small.rate(), e_large.rate());
    report.figure(
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
    );
    report.figure(
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
    );
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
