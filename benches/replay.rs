//! Replay throughput: N generated denials published again through `sendquota::internals::replay`, with
//! one row per transaction (the default: a crash republishes at most one) and in batches.
//!
//! `cargo bench --bench replay -- [--denials N]`

#[allow(dead_code)]
mod common;
#[path = "../tests/it/support/mod.rs"]
#[allow(dead_code)] // Each bench uses a part of the tests' harness.
mod support;

use sendquota::internals::denials::{DenialFilter, DenialStore};
use sendquota::internals::replay::{replay, ReplayOptions};
use support::TestEnv;

#[tokio::main]
async fn main() {
    let n: i64 = common::flag("--denials", 5_000);
    println!("{n} denials per run, local Postgres and RabbitMQ (classic queue)");
    for batch in [1i64, 100] {
        let env = TestEnv::new().await;
        sqlx::query("SELECT denials_ensure_partition(now())")
            .execute(&env.pool)
            .await
            .expect("partition");
        sqlx::query(
            "INSERT INTO denials (message_id, recipient, channel, category, rule, kind, reason, \
             message, denied_at) SELECT 'm' || g, 'r' || g, 'sms', 'default', 'headline', \
             'calendar_quota', 'generated', jsonb_build_object('id', 'm' || g, 'recipient', \
             'r' || g, 'channel', 'sms'), now() FROM generate_series(1, $1) g",
        )
        .bind(n)
        .execute(&env.pool)
        .await
        .expect("generate denials");
        let store = DenialStore::from_pool(env.pool.clone());
        let options = ReplayOptions {
            filter: DenialFilter::default(),
            limit: None,
            rate: None,
            batch,
        };
        let step = (n as usize / 10).max(1);
        let report = replay(
            &store,
            &env.publisher,
            &env.names,
            &options,
            chrono::Utc::now,
            |done| {
                if done % step == 0 {
                    eprintln!("batch {batch}: {done}/{n}");
                }
            },
        )
        .await
        .expect("replay");
        println!(
            "batch {batch:>3}: replayed {} in {:.2} s: {:.0} denials/s",
            report.replayed,
            report.elapsed.as_secs_f64(),
            report.replayed as f64 / report.elapsed.as_secs_f64()
        );
    }
}
