//! A worker stopped with SIGTERM says what became of the deliveries it had in flight: one
//! info line with how many it drained (finished and acked within the shutdown timeout) and how
//! many went back to the queue unacked.

use crate::support;

use std::collections::HashMap;
use std::process::Command;
use std::time::{Duration, Instant};

use sendquota::failpoint::SLOW_IDS_HOLD;
use support::process::Running;
use support::{request, TestEnv};

/// The shutdown timeout of the worker under test: long enough for a delivery that has a
/// second of its hold left, far too short for one that has all of it left.
const SHUTDOWN_TIMEOUT_MS: u64 = 2_500;

/// Waits until nothing is ready in the requests queue: the worker took what was published.
async fn taken(env: &TestEnv) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while env.ready(&env.names.requests).await > 0 {
        assert!(Instant::now() < deadline, "the worker took the message");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Two deliveries are held by a slow service (`slow-` ids, held 6 s each) when SIGTERM
/// comes: one a second from done, which finishes inside the 2.5 s shutdown timeout and is
/// dispatched, and one just begun, which goes back to the queue. The worker's last words say
/// so: drained 1, returned 1.
#[tokio::test]
async fn sigterm_logs_how_many_deliveries_were_drained_and_how_many_returned_to_the_queue() {
    let env = TestEnv::new().await;
    let mut cmd = env.cli_with(
        &format!("[worker]\nshutdown_timeout_ms = {SHUTDOWN_TIMEOUT_MS}\n"),
        &["worker"],
    );
    cmd.env("SENDQUOTA_FAILPOINT", "slow-ids")
        .env("SENDQUOTA_LOG", "info,lapin=off")
        .env("SENDQUOTA_LOG_FORMAT", "json");
    let worker = Running::spawn(cmd);
    worker
        .wait_for("the worker consumes", Duration::from_secs(20), |lines| {
            lines.iter().any(|l| l.contains("\"consuming\""))
        })
        .await;

    env.publish(&request("slow-1", "r1", "UTC")).await;
    let first = Instant::now();
    taken(&env).await;
    tokio::time::sleep(
        (first + SLOW_IDS_HOLD - Duration::from_secs(1)).duration_since(Instant::now()),
    )
    .await;
    env.publish(&request("slow-2", "r2", "UTC")).await;
    taken(&env).await;
    let signalled = Command::new("kill")
        .args(["-TERM", &worker.id().to_string()])
        .status()
        .expect("kill");
    assert!(signalled.success(), "SIGTERM sent to the worker");

    let stopped = |lines: &[String]| {
        lines.iter().find_map(|l| {
            let line: serde_json::Value = serde_json::from_str(l).ok()?;
            line["message"]
                .as_str()?
                .starts_with("stopped:")
                .then_some(line)
        })
    };
    worker
        .wait_for("the shutdown line", Duration::from_secs(15), |lines| {
            stopped(lines).is_some()
        })
        .await;
    let lines = worker.lines();
    let line = stopped(&lines).expect("the shutdown line");
    assert_eq!(line["level"], "INFO", "{line}");
    assert_eq!(
        (line["drained"].as_u64(), line["returned"].as_u64()),
        (Some(1), Some(1)),
        "{line}"
    );

    let mut seen = HashMap::new();
    env.dispatched("slow-1", &mut seen).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while env.ready(&env.names.requests).await != 1 {
        assert!(
            Instant::now() < deadline,
            "slow-2 is back in the requests queue"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!seen.contains_key("slow-2"), "slow-2 was not dispatched");
    drop(worker);
}
