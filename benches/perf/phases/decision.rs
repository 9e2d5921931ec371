//! (a1) and (b): the decision path, `Limiter::evaluate` with commit and no broker, against the
//! bare pipelined EVALSHA loop doing the same decisions, in alternating slices; then the
//! decision path with two more rule kinds. Beside them, in the same slices, a script of three
//! plain commands sent as (a1) sends its decisions (`common::BARE_SCRIPT`): the reference for
//! Redis's time per decision. Before them a warm-up, discarded: the first keys Redis and this
//! process allocate fault their pages in, which on a VM costs more than the decisions.

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use redis::Value;
use sendquota::internals::message::SendRequest;

use super::{Bench, SLICES};
use crate::ceilings::LuaLoop;
use crate::common::BARE_SCRIPT;
use crate::decision_path::{decode, evaluate_all, policy};
use crate::keyspace::purge;
use crate::procs::{Procs, Tally};
use crate::progress::Progress;
use crate::report::Report;

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

const DECISION_PATH_MIN_RATIO: f64 = 0.90;

/// One slice of each side, then its keys removed.
pub async fn warm_up(bench: &mut Bench) {
    let slice = bench.args.decisions / SLICES;
    let warm_messages: Vec<SendRequest> = (0..slice)
        .map(|i| decode(&format!("xm{i}"), &format!("x{}", i / 2)))
        .collect();
    let mut warm = Progress::new("warm-up, discarded", 2 * slice);
    bench
        .lua
        .run(&mut warm, 0..slice, "w", bench.base, |i| i / 2)
        .await;
    evaluate_all(
        &mut warm,
        &bench.limiter,
        &bench.headline,
        &warm_messages,
        0..slice,
        bench.at(),
        bench.args.concurrency,
    )
    .await;
    drop(warm_messages);
    purge(&mut bench.plain, &bench.pattern, "warm-up cleanup").await;
}

/// One slice of the bare script of [`BARE_SCRIPT`], added to `tally`.
async fn bare_slice(
    bench: &Bench,
    sha: &str,
    progress: &mut Progress,
    range: Range<usize>,
    tally: &mut Tally,
) {
    let ops = range.len();
    let before = bench.procs.snap(None).await;
    let took = bare_script(&bench.lua, sha, progress, range).await;
    tally.add(before, bench.procs.snap(None).await, ops, ops, took);
}

/// The bare script over `lua`'s connection, pipelines and namespace, as `lua` sends decisions:
/// call `i` writes the key of recipient `i / 2` (each key twice, as (a1) decides two messages
/// per recipient). Returns the elapsed time.
async fn bare_script(
    lua: &LuaLoop,
    sha: &str,
    progress: &mut Progress,
    range: Range<usize>,
) -> Duration {
    let end = range.end;
    let began = Instant::now();
    let mut replies = futures_util::stream::iter(range.step_by(lua.pipeline))
        .map(|first| {
            let mut pipe = redis::pipe();
            for i in first..(first + lua.pipeline).min(end) {
                pipe.cmd("EVALSHA")
                    .arg(sha)
                    .arg(1)
                    .arg(format!("{}:bare:{}", lua.namespace, i / 2))
                    .arg("v")
                    .arg(3_600_000);
            }
            let mut conn = lua.conn.clone();
            async move { pipe.query_async::<Vec<Value>>(&mut conn).await }
        })
        .buffer_unordered(lua.in_flight);
    while let Some(reply) = replies.next().await {
        progress.add(reply.expect("bare script pipeline").len());
    }
    began.elapsed()
}

/// (a1) and (b) with the headline rule in alternating slices, then (b) with three rules.
pub async fn run(bench: &mut Bench, report: &mut Report) {
    let n = bench.args.decisions;
    let messages: Vec<SendRequest> = (0..n)
        .map(|i| decode(&format!("bm{i}"), &format!("b{}", i / 2)))
        .collect();
    let a1_rate = headline(bench, report, &messages).await;
    purge(&mut bench.plain, &bench.pattern, "b cleanup").await;
    three_rules(bench, report, &messages, a1_rate).await;
    purge(&mut bench.plain, &bench.pattern, "b cleanup").await;
}

/// (a1) the script's ceiling and (b) the decision path, in alternating slices. Returns (a1)'s
/// rate.
async fn headline(bench: &Bench, report: &mut Report, messages: &[SendRequest]) -> f64 {
    let (n, concurrency) = (bench.args.decisions, bench.args.concurrency);
    let slice = n / SLICES;
    let (procs, base) = (&bench.procs, bench.base);
    let mut progress_a1 = Progress::new("a1 bare pipelined EVALSHA", n);
    let mut progress_b = Progress::new("b decision path, headline", n);
    let mut progress_bare = Progress::new("a1's reference: bare 3-command script", n);
    let (mut a1, mut b_headline) = (Tally::default(), Tally::default());
    let mut bare = Tally::default();
    let bare_sha: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(BARE_SCRIPT)
        .query_async(&mut bench.plain.clone())
        .await
        .expect("SCRIPT LOAD");
    for k in 0..SLICES {
        let range = k * slice..(k + 1) * slice;
        bare_slice(
            bench,
            &bare_sha,
            &mut progress_bare,
            range.clone(),
            &mut bare,
        )
        .await;
        let before = procs.snap(None).await;
        let (allowed, took) = bench
            .lua
            .run(&mut progress_a1, range.clone(), "a", base, |i| i / 2)
            .await;
        let middle = procs.snap(None).await;
        a1.add(before, middle, slice, allowed, took);
        let (allowed, took) = evaluate_all(
            &mut progress_b,
            &bench.limiter,
            &bench.headline,
            messages,
            range,
            bench.at(),
            concurrency,
        )
        .await;
        b_headline.add(middle, procs.snap(None).await, slice, allowed, took);
    }
    // The loop's keys and arguments are the limiter's: the limiter reads what the loop wrote.
    let seen = bench
        .limiter
        .evaluate(&bench.headline, &decode("probe", "a0"), base, false)
        .await
        .expect("probe");
    assert!(
        !seen.verdicts()[0].allowed && seen.verdicts()[0].remaining == Some(0),
        "the bare loop's state is not what the limiter reads: {seen:?}"
    );
    let a1_rate = a1.rate();
    let b_rate = b_headline.rate();
    report.figure(
        "(a1) ceiling: pipelined EVALSHA, headline",
        format!("{a1_rate:.0} dec/s"),
        "",
        None,
        &format!(
            "{:.0}% allowed; pipelines of {}, {} in flight",
            a1.allowed_pct(),
            bench.args.pipeline,
            bench.args.in_flight
        ),
        None,
    );
    redis_per_decision(report, procs, &a1, &bare);
    report.cpu(procs, "b Limiter::evaluate, headline", &b_headline);
    report.figure(
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
    );
    a1_rate
}

/// (a1)'s and the bare script's CPU rows, and the figure comparing what each call costs Redis:
/// its process's CPU time, and its time inside EVALSHA ('(lua)').
fn redis_per_decision(report: &mut Report, procs: &Procs, a1: &Tally, bare: &Tally) {
    let u = report.cpu(procs, "a1 bare pipelined EVALSHA", a1);
    let (a1_redis, a1_lua) = (u.redis, u.lua);
    let u = report.cpu(procs, "a1's reference: bare 3-command script", bare);
    let (bare_redis, bare_lua) = (u.redis, u.lua);
    report.figure(
        "(a1) Redis CPU per decision",
        format!("{a1_redis:.1} us"),
        "bare",
        Some(a1_redis / bare_redis),
        &format!(
            "info: bare 3-command script {bare_redis:.1} us; inside EVALSHA {a1_lua:.1} \
             against {bare_lua:.1} us ({:.2}x)",
            a1_lua / bare_lua
        ),
        None,
    );
}

/// (b) with the headline rule, a channel GCRA and a sliding window, against (a1).
async fn three_rules(bench: &Bench, report: &mut Report, messages: &[SendRequest], a1_rate: f64) {
    let n = bench.args.decisions;
    let three = Arc::new(policy(THREE_RULES));
    let mut progress = Progress::new("b decision path, headline + gcra + sliding_window", n);
    let mut b_three = Tally::default();
    let before = bench.procs.snap(None).await;
    let (allowed, took) = evaluate_all(
        &mut progress,
        &bench.limiter,
        &three,
        messages,
        0..n,
        bench.at(),
        bench.args.concurrency,
    )
    .await;
    b_three.add(before, bench.procs.snap(None).await, n, allowed, took);
    report.cpu(&bench.procs, "b Limiter::evaluate, 3 rules", &b_three);
    report.figure(
        "(b) decision path, + channel gcra + sliding_window",
        format!("{:.0} dec/s", b_three.rate()),
        "(a1)",
        Some(b_three.rate() / a1_rate),
        &format!(
            "info ({:.0}% allowed, 2 script calls/decision)",
            b_three.allowed_pct()
        ),
        None,
    );
}
