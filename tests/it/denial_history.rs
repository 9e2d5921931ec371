//! The denial history at scale: monthly partitions dropped whole by `prune`, and the operator
//! queries answered from indexes on a table of 1,000,000 rows.

use crate::support;

use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, Instant};

use chrono::Utc;
use sendquota::internals::denials::{DenialFilter, DenialRow, DenialStore, MIGRATOR};
use support::TestEnv;

async fn partitions(env: &TestEnv) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
         WHERE i.inhparent = 'denials'::regclass ORDER BY 1",
    )
    .fetch_all(&env.pool)
    .await
    .expect("partitions")
}

/// Inserts `n` generated rows spread evenly over the last `months` months (10,000 recipients,
/// 5 rules, one in ten shadow, half of the rest replayed).
async fn generate(env: &TestEnv, n: i64, months: i32) {
    for m in 0..=months {
        sqlx::query("SELECT denials_ensure_partition(now() - make_interval(months => $1))")
            .bind(m)
            .execute(&env.pool)
            .await
            .expect("partition");
    }
    sqlx::query(
        "INSERT INTO denials (message_id, recipient, channel, category, rule, kind, reason, \
         shadow, retry_after, message, denied_at, replayed_at) \
         SELECT 'gen-' || g, 'user-' || (g % 10000), 'sms', 'default', 'rule-' || (g % 5), \
         'calendar_quota', 'generated', g % 10 = 0, t + interval '1 day', \
         jsonb_build_object('id', 'gen-' || g), t, \
         CASE WHEN g % 2 = 0 THEN t + interval '2 days' END \
         FROM generate_series(1, $1) AS g, \
         LATERAL (SELECT now() - make_interval(secs => ($2::float8 * 30 * 86400) * (1 - g::float8 / $1)) AS t) AS x",
    )
    .bind(n)
    .bind(months)
    .execute(&env.pool)
    .await
    .expect("generate rows");
    sqlx::query("ANALYZE denials")
        .execute(&env.pool)
        .await
        .expect("analyze");
}

/// The plan of `sql` as text, after running it once to time it.
async fn plan(env: &TestEnv, sql: &str) -> (String, Duration) {
    let started = Instant::now();
    sqlx::query(sqlx::AssertSqlSafe(sql.to_owned()))
        .execute(&env.pool)
        .await
        .expect("query");
    let took = started.elapsed();
    let lines: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("EXPLAIN {sql}")))
        .fetch_all(&env.pool)
        .await
        .expect("explain");
    (lines.join("\n"), took)
}

#[tokio::test]
async fn operator_queries_on_a_million_rows_use_indexes_and_answer_in_well_under_a_second() {
    let env = TestEnv::new().await;
    let started = Instant::now();
    generate(&env, 1_000_000, 12).await;
    eprintln!(
        "generated 1,000,000 rows in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let queries = [
        (
            "recipient + time",
            "SELECT * FROM denials WHERE recipient = 'user-4242' \
             AND denied_at >= now() - interval '30 days' ORDER BY id DESC LIMIT 100",
        ),
        (
            "rule + time",
            "SELECT * FROM denials WHERE rule = 'rule-3' \
             AND denied_at >= now() - interval '7 days' ORDER BY id DESC LIMIT 100",
        ),
        (
            "unreplayed + due",
            "SELECT * FROM denials WHERE replayed_at IS NULL AND NOT shadow \
             AND retry_after <= now() ORDER BY id LIMIT 100",
        ),
    ];
    for (name, sql) in queries {
        let (plan, took) = plan(&env, sql).await;
        eprintln!("{name}: {:.1} ms\n{plan}", took.as_secs_f64() * 1000.0);
        assert!(!plan.contains("Seq Scan"), "{name} scans a table:\n{plan}");
        assert!(plan.contains("Index"), "{name} uses no index:\n{plan}");
        assert!(took < Duration::from_millis(250), "{name} took {took:?}");
    }
    // The store's own filters produce the same shapes.
    let store = DenialStore::from_pool(env.pool.clone());
    let started = Instant::now();
    let page = store
        .list(&DenialFilter {
            recipient: Some("user-4242".to_owned()),
            since: Some(Utc::now() - chrono::Duration::days(30)),
            limit: 100,
            ..DenialFilter::default()
        })
        .await
        .expect("list");
    assert!(!page.is_empty());
    assert!(started.elapsed() < Duration::from_millis(250));
}

#[tokio::test]
async fn prune_drops_whole_partitions_older_than_the_age_and_keeps_the_rest() {
    let env = TestEnv::new().await;
    generate(&env, 1_300, 12).await;
    let before = partitions(&env).await;
    assert_eq!(before.len(), 13, "{before:?}");
    let out = env
        .cli(&["prune", "--older-than", "90d"])
        .env("SENDQUOTA_LOG", "off")
        .output()
        .expect("run prune");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let after = partitions(&env).await;
    let dropped: Vec<&String> = before.iter().filter(|p| !after.contains(p)).collect();
    let stdout = String::from_utf8(out.stdout).expect("utf-8");
    let summary = stdout.lines().last().expect("a summary line");
    assert!(
        summary.starts_with(&format!("pruned {} partitions older than ", dropped.len())),
        "{stdout}"
    );
    // Months that ended more than 90 days ago are gone (9 or 10 of them, by day of month);
    // the last three months and the current one stay.
    assert!((9..=10).contains(&dropped.len()), "dropped {dropped:?}");
    let cutoff = Utc::now() - chrono::Duration::days(90);
    let oldest_kept: chrono::DateTime<Utc> =
        sqlx::query_scalar("SELECT min(denied_at) FROM denials")
            .fetch_one(&env.pool)
            .await
            .expect("min");
    assert!(
        oldest_kept >= cutoff - chrono::Duration::days(31),
        "{oldest_kept}"
    );
    for name in &dropped {
        assert!(stdout.contains(&format!("dropped {name}\n")), "{stdout}");
    }
}

/// A denial of message `id` by `rule` at `denied_at` (a replay's denial with `replay_of`).
fn row(
    id: &str,
    rule: &str,
    replay_of: Option<i64>,
    denied_at: chrono::DateTime<Utc>,
) -> DenialRow {
    DenialRow {
        message_id: id.to_owned(),
        recipient: "alice".to_owned(),
        channel: "sms".to_owned(),
        category: "default".to_owned(),
        rule: rule.to_owned(),
        kind: "calendar_quota".to_owned(),
        reason: "test".to_owned(),
        message: serde_json::json!({ "id": id }).to_string().into(),
        denied_at,
        replay_of,
        ..DenialRow::default()
    }
}

#[tokio::test]
async fn a_batch_records_each_event_once_even_when_it_holds_the_event_twice() {
    let env = TestEnv::new().await;
    let store = DenialStore::from_pool(env.pool.clone());
    let now = Utc::now();
    let first = store
        .insert_batch(&[
            row("m1", "a", None, now),
            row("m1", "a", None, now),
            row("m1", "b", None, now),
            row("m1", "a", Some(7), now),
        ])
        .await
        .expect("batch");
    assert_eq!(first, [true, false, true, true]);
    let again = store
        .insert_batch(&[row("m1", "a", None, now), row("m2", "a", None, now)])
        .await
        .expect("batch");
    assert_eq!(
        again,
        [false, true],
        "a redelivery in a later batch is recognised"
    );
    assert_eq!(env.denial_rows().await, 4);
}

#[tokio::test]
async fn batches_racing_over_the_same_events_record_each_event_exactly_once() {
    let env = TestEnv::new().await;
    // Two workers: separate pools, so the batches really run in concurrent transactions.
    let other = sqlx::PgPool::connect(&env.database_url)
        .await
        .expect("second pool");
    let (a, b) = (
        DenialStore::from_pool(env.pool.clone()),
        DenialStore::from_pool(other.clone()),
    );
    let now = Utc::now();
    let mut events = 0;
    for round in 0..20 {
        // The same 200 events, in opposite orders, half of them also in the other batch.
        let ids: Vec<String> = (0..200).map(|i| format!("r{round}m{i}")).collect();
        let forward: Vec<DenialRow> = ids.iter().map(|id| row(id, "a", None, now)).collect();
        let backward: Vec<DenialRow> = ids
            .iter()
            .rev()
            .take(100)
            .map(|id| row(id, "a", None, now))
            .collect();
        let (x, y) = tokio::join!(a.insert_batch(&forward), b.insert_batch(&backward));
        let (x, y) = (x.expect("batch a"), y.expect("batch b"));
        events += 200;
        let recorded = x.iter().chain(&y).filter(|&&new| new).count();
        assert_eq!(
            recorded, 200,
            "round {round}: every event is new exactly once"
        );
        assert_eq!(env.denial_rows().await, events, "round {round}");
    }
    other.close().await;
}

/// Several workers writing the first denials of a month at once each find its partition
/// missing and create it: every one of them succeeds, none retries on an error, and the month
/// has one partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_creating_a_months_partition_at_once_all_succeed() {
    const WORKERS: usize = 8;
    let env = TestEnv::new().await;
    let mut pools = Vec::new();
    for _ in 0..WORKERS {
        let pool = sqlx::PgPool::connect(&env.database_url)
            .await
            .expect("a worker's pool");
        pools.push(pool);
    }
    for month in 1..=6 {
        // A month no partition holds yet, the same for every worker.
        let at = chrono::TimeZone::with_ymd_and_hms(&Utc, 2031, month, 15, 12, 0, 0).unwrap();
        let writes = pools.iter().enumerate().map(|(w, pool)| {
            let store = DenialStore::from_pool(pool.clone());
            async move {
                let rows = [row(&format!("p{month}w{w}"), "a", None, at)];
                store.insert_batch(&rows).await
            }
        });
        for (w, written) in futures_util::future::join_all(writes)
            .await
            .into_iter()
            .enumerate()
        {
            assert_eq!(
                written.map_err(|e| e.to_string()),
                Ok(vec![true]),
                "month {month}: worker {w} recorded its denial"
            );
        }
    }
    let created = partitions(&env).await;
    let in_2031: Vec<&String> = created.iter().filter(|p| p.contains("y2031")).collect();
    assert_eq!(in_2031.len(), 6, "one partition a month: {created:?}");
    assert_eq!(env.denial_rows().await, (6 * WORKERS) as i64);
    for pool in pools {
        pool.close().await;
    }
}

#[tokio::test]
async fn prune_forgets_the_events_of_the_months_it_drops_and_keeps_the_others() {
    let env = TestEnv::new().await;
    let store = DenialStore::from_pool(env.pool.clone());
    let now = Utc::now();
    let old = now - chrono::Duration::days(200);
    let batch = [row("old", "a", None, old), row("new", "a", None, now)];
    assert_eq!(
        store.insert_batch(&batch).await.expect("batch"),
        [true, true]
    );
    let dropped = store
        .prune(now - chrono::Duration::days(90))
        .await
        .expect("prune");
    assert_eq!(dropped.len(), 1, "{dropped:?}");
    let events: Vec<String> = sqlx::query_scalar("SELECT message_id FROM denial_events")
        .fetch_all(&env.pool)
        .await
        .expect("events");
    assert_eq!(events, ["new"]);
    // The pruned month's event is history no longer: recorded anew. The kept one is not.
    assert_eq!(
        store.insert_batch(&batch).await.expect("batch"),
        [true, false]
    );
    assert_eq!(env.denial_rows().await, 2);
}

/// Message ids are unique per recipient: `shared-7` to carol and `shared-7` to dave are two
/// messages, and each denial gets its row (keyed without the recipient, dave's was taken for a
/// repeat of carol's and acked with no row at all).
#[tokio::test]
async fn two_recipients_denied_under_the_same_message_id_get_a_row_each() {
    let mut env = TestEnv::new().await;
    let clock = sendquota::clock::ManualClock::new(support::local("UTC", "2026-04-01 09:00"));
    env.start_worker(&clock);
    let mut seen = std::collections::HashMap::new();
    for recipient in ["carol", "dave"] {
        let first = format!("first-{recipient}");
        env.publish(&support::request(&first, recipient, "UTC"))
            .await;
        assert!(env.outcome(&first, &mut seen).await, "{first} dispatched");
    }
    for recipient in ["carol", "dave"] {
        env.publish(&support::request("shared-7", recipient, "UTC"))
            .await;
    }
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut recipients = Vec::new();
    while recipients.len() < 2 {
        assert!(
            Instant::now() < deadline,
            "a denial row per recipient: {recipients:?}"
        );
        recipients = env
            .denials()
            .await
            .into_iter()
            .filter(|d| d.message_id == "shared-7")
            .map(|d| d.row.recipient)
            .collect();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    recipients.sort();
    assert_eq!(recipients, ["carol", "dave"]);
    env.stop_worker().await;
    assert!(
        env.take_dispatched().await.is_empty(),
        "neither is dispatched"
    );
}

/// The build embeds every migration in `migrations/`, and no other: `sqlx::migrate!` reads the
/// directory when the crate compiles, and a build that missed a file added since (cargo did not
/// know the macro read the directory until build.rs said so) starts without it and never
/// creates what it adds.
#[test]
fn the_embedded_migrations_are_the_files_in_migrations() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations");
    let on_disk: BTreeSet<i64> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.expect("directory entry").file_name())
        .filter_map(|name| {
            let name = name.to_str()?.to_owned();
            name.strip_suffix(".sql")?.split_once('_')?.0.parse().ok()
        })
        .collect();
    let embedded: BTreeSet<i64> = MIGRATOR.iter().map(|m| m.version).collect();
    assert!(!on_disk.is_empty(), "no migrations in {}", dir.display());
    assert_eq!(
        embedded, on_disk,
        "embedded migrations against the files on disk"
    );
}
