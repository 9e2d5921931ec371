//! The benches' own measurements, where a wrong one would mislead a performance claim
//! (docs/performance.md). They read the services' processes from /proc, so the services must
//! run on this machine, as `deploy/local/test.sh` starts them.

use std::time::{Duration, Instant};

use sqlx::{Connection, PgConnection};

use crate::support::{admin_database_url, START_HINT};

#[allow(dead_code)]
#[path = "../../benches/common/mod.rs"]
mod common;

/// A Postgres backend that did its work and exited during a phase still counts for Postgres:
/// its CPU moves into the postmaster's reaped children's time instead of leaving the total,
/// which would charge a phase its whole lifetime as a negative.
#[tokio::test]
async fn the_cpu_of_a_postgres_backend_that_exited_stays_in_postgres_cpu() {
    let mut conn = PgConnection::connect(&admin_database_url())
        .await
        .unwrap_or_else(|e| panic!("connect to Postgres ({e}); {START_HINT}"));
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut conn)
        .await
        .expect("backend pid");
    // Its server only: the suite starts and stops private Postgres servers meanwhile.
    let postmaster = common::parent_of(&pid.to_string()).unwrap_or_else(|| {
        panic!(
            "backend {pid} not readable in /proc: the benches need a local Postgres; {START_HINT}"
        )
    });
    let before = common::postgres_ticks_of(&postmaster);
    // What the backend had spent by then (its start) is in `before` already.
    let started = common::cpu_ticks(&pid.to_string()).unwrap_or(0);
    assert!(
        before > 0,
        "no CPU readable for Postgres server {postmaster}"
    );
    // About a second of one core in the backend.
    sqlx::query("SELECT sum(x) FROM generate_series(1, 10000000) AS x")
        .execute(&mut conn)
        .await
        .expect("busy query");
    let spent = common::cpu_ticks(&pid.to_string()).expect("the backend's /proc entry");
    assert!(
        spent >= 10,
        "the backend spent {spent} ticks, too few to tell"
    );
    conn.close().await.expect("close");
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::path::Path::new(&format!("/proc/{pid}")).exists() {
        assert!(
            Instant::now() < deadline,
            "backend {pid} did not exit in 10 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let after = common::postgres_ticks_of(&postmaster);
    assert!(
        after >= before + spent - started,
        "Postgres CPU went from {before} to {after} ticks while a backend that spent {spent} \
         ticks exited"
    );
}
