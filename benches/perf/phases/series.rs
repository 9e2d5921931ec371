//! `--series PAIRS`: issue 39's series in one run. PAIRS alternating rounds of (a2) the no-work
//! relay, (a3) the work relay and (c) the worker from spawn (the order turns every round:
//! a2 a3 c, c a3 a2, ...), each on the same backlog; after each round's sides, in the same
//! minutes, the floors each process is held to: the worker's (d) floor, the worker's own Redis
//! calls in (a1)'s bare pipelined loop (Redis CPU per message) and the worker's denial
//! statement alone in batches of the worker's size (Postgres CPU per denial row). Prints each
//! run, the medians of (c)/(a3) and (c)/(a2) over the rounds, and each process's CPU per
//! message, over all rounds, against its floor's over all rounds.

use std::sync::Arc;

use futures_util::StreamExt;
use redis::Value;
use sendquota::config::QueueType;
use sendquota::internals::claim::Claim;
use sendquota::internals::dedup::DispatchMarks;
use sendquota::internals::denials::{DenialRow, DenialStore};

use super::end_to_end::worker_run;
use super::floor::floor_run;
use super::work_relay::work_relay_run;
use super::Bench;
use crate::ceilings::{committed, relay_run};
use crate::decision_path::{decode, policy};
use crate::procs::Tally;
use crate::progress::Progress;
use crate::queues::bodies;
use crate::relay::RelayShape;
use crate::report::{rate, Report};
use crate::support::TestEnv;
use crate::worker::WorkerChoice;

/// Target of (c) against (a3), issue 39.
const C_OVER_A3_MIN: f64 = 0.85;

/// Each round's rates and the CPU tallies of every side.
#[derive(Default)]
struct Sides {
    a2: Vec<f64>,
    a3: Vec<f64>,
    c: Vec<f64>,
    a2_cpu: Tally,
    a3_cpu: Tally,
    c_cpu: Tally,
    /// Redis reply writes (`total_writes_processed`: one per client per event-loop turn, so a
    /// pipeline, or requests multiplexed on one connection, count once) per message: (a3)'s and (c)'s, summed over the rounds.
    a3_requests: f64,
    c_requests: f64,
}

/// The series; see the module's doc. Adds its figures and CPU rows to `report`.
pub async fn run(bench: &Bench, worker: &WorkerChoice, pairs: usize, report: &mut Report) {
    let m = bench.args.messages;
    let body = bodies(m);
    let shape = bench.args.relay_shape();
    let a3_runtime = bench.args.work_relay_runtime();
    let relay_env = TestEnv::with_queue_type("", QueueType::Quorum).await;
    let headline = Arc::new(policy(""));
    let procs = &bench.procs;
    let mut s = Sides::default();
    let (mut floor, mut script, mut insert) =
        (Tally::default(), Tally::default(), Tally::default());
    for round in 0..pairs {
        let mut order = ["a2", "a3", "c"];
        if round % 2 == 1 {
            order.reverse();
        }
        for side in order {
            eprintln!("[series] round {}/{pairs}: {side}", round + 1);
            let before = replies_written(bench).await;
            match side {
                "a2" => {
                    let (r, _, _) = relay_run(&relay_env, &body, procs, &mut s.a2_cpu, shape).await;
                    s.a2.push(r);
                }
                "a3" => {
                    let (cpu, policy) = (&mut s.a3_cpu, headline.clone());
                    let r = work_relay_run(&body, procs, cpu, policy, a3_runtime).await;
                    s.a3_requests += (replies_written(bench).await - before) / m as f64;
                    s.a3.push(r);
                }
                _ => {
                    let e2e = worker_run(&body, procs, &mut s.c_cpu, worker).await;
                    s.c_requests += (replies_written(bench).await - before) / m as f64;
                    s.c.push(rate(m, e2e.elapsed));
                }
            }
            eprintln!("[series]   {side} {:.0} msgs/s", last(&s, side));
        }
        // The floors once a round, in the same minutes as the round's sides: each figure is
        // then a mean over the rounds, as (c)'s is, not one run's.
        eprintln!("[series] round {}/{pairs}: the floors", round + 1);
        floor_run(&relay_env, &body, procs, &mut floor, worker).await;
        redis_floor(bench, round, &mut script).await;
        insert_floor(bench, m / 2, &mut insert).await;
    }
    drop(relay_env);
    figures(report, bench, &s, pairs, shape);
    floors(report, bench, &s, &floor, &script, &insert);
}

fn last(s: &Sides, side: &str) -> f64 {
    let runs = match side {
        "a2" => &s.a2,
        "a3" => &s.a3,
        _ => &s.c,
    };
    runs.last().copied().unwrap_or(0.0)
}

/// Redis's `total_writes_processed` (INFO stats): reply writes, one per client per event-loop
/// turn however many commands it answered (commandstats counts commands, not round trips).
async fn replies_written(bench: &Bench) -> f64 {
    let info: String = redis::cmd("INFO")
        .arg("stats")
        .query_async(&mut bench.plain.clone())
        .await
        .unwrap_or_default();
    info.lines()
        .find_map(|l| l.strip_prefix("total_writes_processed:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

fn median(runs: &[f64]) -> f64 {
    let mut r = runs.to_vec();
    r.sort_by(f64::total_cmp);
    r.get(r.len() / 2).copied().unwrap_or(0.0)
}

fn joined(runs: &[f64], digits: usize) -> String {
    runs.iter()
        .map(|r| format!("{r:.digits$}"))
        .collect::<Vec<_>>()
        .join(" / ")
}

/// The rates and the ratios per round, with their medians.
fn figures(report: &mut Report, bench: &Bench, s: &Sides, pairs: usize, shape: RelayShape) {
    let ratio = |over: &[f64]| -> Vec<f64> { s.c.iter().zip(over).map(|(c, x)| c / x).collect() };
    let (c_a3, c_a2) = (ratio(&s.a3), ratio(&s.a2));
    for (name, runs) in [
        ("(a2) no-work relay, median", &s.a2),
        ("(a3) work relay, median", &s.a3),
        ("(c) worker from spawn, median", &s.c),
    ] {
        report.figure(
            name,
            format!("{:.0} msgs/s", median(runs)),
            "",
            None,
            &format!("runs {}", joined(runs, 0)),
            None,
        );
    }
    report.figure(
        "(c)/(a3), median of the rounds",
        format!("{:.2}", median(&c_a3)),
        "",
        None,
        &format!(
            ">= {C_OVER_A3_MIN} ({}; {pairs} rounds of {} messages; (a3) on the {})",
            joined(&c_a3, 2),
            bench.args.messages,
            bench.args.work_relay_runtime().describe()
        ),
        Some(median(&c_a3) >= C_OVER_A3_MIN),
    );
    report.figure(
        "(c)/(a2), median of the rounds",
        format!("{:.2}", median(&c_a2)),
        "",
        None,
        &format!("{}; (a2): {}", joined(&c_a2, 2), shape.describe()),
        None,
    );
    let rounds = pairs.max(1) as f64;
    report.note(format!(
        "Redis reply writes per message (server-wide, cleanup included): (a3) {:.2}, (c) {:.2}",
        s.a3_requests / rounds,
        s.c_requests / rounds
    ));
}

/// The worker's own Redis work in (a1)'s bare pipelined loop, on as many messages as a run
/// has, two per recipient (the first admitted, the second refused, as in (c)): per message the
/// exact EVALSHA the worker sends (`Limiter::claimed_commands`: its keys, arguments and claim),
/// and for each admitted one the worker's dispatch mark (`DispatchMarks::add_mark`), in
/// pipelines of `--pipeline`, `--in-flight` at a time. Redis's CPU per message with nothing of
/// the worker around its calls: the floor of (c)'s Redis CPU. Each `round` has recipients of
/// its own; added to `tally`.
async fn redis_floor(bench: &Bench, round: usize, tally: &mut Tally) {
    let m = bench.args.messages;
    // Fresh recipients every round: a second run on the same keys would find their day taken.
    let prefix = format!("s39-{}-{round}-", std::process::id());
    let messages: Vec<_> = (0..m)
        .map(|i| decode(&format!("{prefix}m{i}"), &format!("{prefix}r{}", i / 2)))
        .collect();
    let settings = &bench.env.settings;
    let marks = DispatchMarks::new(
        bench.env.redis.clone(),
        &bench.env.namespace,
        settings.worker.dedup_ttl_secs,
    );
    let claim = Claim::new(settings.worker.claim_lease_ms);
    let at = bench.at();
    let mut progress = Progress::new("series: Redis floor", m);
    let before = bench.procs.snap(None).await;
    let began = std::time::Instant::now();
    // Even, so both messages of a recipient go in one pipeline, in order.
    let size = bench.args.pipeline.max(2) & !1;
    let mut replies = futures_util::stream::iter(messages.chunks(size).enumerate())
        .map(|(c, chunk)| {
            let now = at(c * size);
            let mut decisions = redis::pipe();
            for message in chunk {
                for cmd in bench
                    .limiter
                    .claimed_commands(&bench.headline, message, now, &claim)
                {
                    decisions.add_command(cmd);
                }
            }
            let (marks, mut conn) = (&marks, bench.plain.clone());
            async move {
                let replies: Vec<Value> = decisions.query_async(&mut conn).await.expect("EVALSHA");
                let mut pipe = redis::pipe();
                let mut admitted = 0;
                for (message, reply) in chunk.iter().zip(&replies) {
                    if committed(reply) {
                        marks.add_mark(&mut pipe, &message.recipient, &message.id, now);
                        admitted += 1;
                    }
                }
                if admitted > 0 {
                    let () = pipe.query_async(&mut conn).await.expect("marks");
                }
                (chunk.len(), admitted)
            }
        })
        .buffer_unordered(bench.args.in_flight.max(1));
    let mut admitted = 0;
    while let Some((n, a)) = replies.next().await {
        admitted += a;
        progress.add(n);
    }
    assert_eq!(
        admitted,
        m.div_ceil(2),
        "the floor admits the first of each pair"
    );
    tally.add(
        before,
        bench.procs.snap(None).await,
        m,
        admitted,
        began.elapsed(),
    );
}

/// The worker's denial statement alone (`DenialStore::insert_batch`, the statement its writer
/// sends), `n` rows in batches of the worker's size into a fresh namespace's table: Postgres's
/// CPU per denial row with nothing else of the worker's around it.
async fn insert_floor(bench: &Bench, n: usize, tally: &mut Tally) {
    let env = TestEnv::with_queue_type("", QueueType::Quorum).await;
    let store = DenialStore::from_pool(env.pool.clone());
    let batch = env.settings.worker.denial_batch_size.max(1);
    let now = chrono::Utc::now();
    let rows: Vec<DenialRow> = (0..n)
        .map(|i| DenialRow {
            rule: "headline".to_owned(),
            kind: "calendar_quota".to_owned(),
            reason: "quota reached".to_owned(),
            ..DenialRow::for_message(&decode(&format!("m{i}"), &format!("r{i}")), now)
        })
        .collect();
    let mut progress = Progress::new("series: insert floor", n);
    let before = bench.procs.snap(None).await;
    let began = std::time::Instant::now();
    for chunk in rows.chunks(batch) {
        store.insert_batch(chunk).await.expect("insert denials");
        progress.add(chunk.len());
    }
    tally.add(before, bench.procs.snap(None).await, n, 0, began.elapsed());
}

/// Each process's CPU per message in (c) against its floor.
fn floors(
    report: &mut Report,
    bench: &Bench,
    s: &Sides,
    floor: &Tally,
    script: &Tally,
    insert: &Tally,
) {
    let procs = &bench.procs;
    report.cpu(procs, "series a2 no-work relay", &s.a2_cpu);
    report.cpu(procs, "series a3 work relay", &s.a3_cpu);
    let c = report.cpu(procs, "series c worker", &s.c_cpu);
    let (c_worker, c_redis, c_postgres) = (c.worker, c.redis, c.postgres);
    let floor_us = report.cpu(procs, "series d floor", floor).bench;
    let script_us = report
        .cpu(procs, "series Redis floor (the worker's calls)", script)
        .redis;
    let insert_us = report
        .cpu(procs, "series bare insert (per row)", insert)
        .postgres;
    // (c): one decision a message; a denial row for half of them.
    let c_pg_per_row = c_postgres * 2.0;
    for (name, value, against, target) in [
        (
            "(d) worker CPU per message / its floor",
            c_worker,
            floor_us,
            Some(1.5),
        ),
        (
            "Redis CPU per message (c) / its calls in (a1)'s loop",
            c_redis,
            script_us,
            Some(1.5),
        ),
        (
            "Postgres CPU per denial row (c) / bare insert",
            c_pg_per_row,
            insert_us,
            None,
        ),
    ] {
        let ratio = value / against.max(f64::MIN_POSITIVE);
        report.figure(
            name,
            format!("{value:.1} / {against:.1} us"),
            "floor",
            Some(ratio),
            &target.map_or("report".to_owned(), |t| format!("<= {t}x")),
            target.map(|t| ratio <= t),
        );
    }
}
