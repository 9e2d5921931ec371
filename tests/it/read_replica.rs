//! `database.read_url`: operator reads (`denials`, `GET /v1/denials`, the console, `replay
//! --dry-run`, `rules history`, `digests`) go to a real streaming replica, writes (the worker's
//! rows, replays, resets) to the primary, and a replica that is away fails the reads, naming
//! the setting, while the worker goes on.

use crate::support;

use std::net::{IpAddr, Ipv4Addr};
use std::process::Command;
use std::time::{Duration, Instant};

use sendquota::clock::ManualClock;
use sendquota::internals::denials::MIGRATOR;
use support::http::{http, Console};
use support::private::PrivatePostgresReplica;
use support::process::{run_to_end, Run};
use support::{local, TestEnv, ADMIN_TOKEN};

/// The database the worker writes on the private primary.
const DATABASE: &str = "sendquota";

/// How long a write may take to reach the replica here (it takes milliseconds).
const LAG: Duration = Duration::from_secs(15);

/// A test environment whose worker (admin API on `port`) writes to a private primary and
/// reads for operators from its streaming replica.
struct Replicated {
    env: TestEnv,
    pg: PrivatePostgresReplica,
    port: u16,
}

impl Replicated {
    async fn start() -> Replicated {
        let pg = tokio::task::spawn_blocking(|| PrivatePostgresReplica::start(DATABASE))
            .await
            .expect("private primary and replica");
        let primary = sqlx::PgPool::connect(&pg.primary.url(DATABASE))
            .await
            .expect("the private primary");
        MIGRATOR.run(&primary).await.expect("migrations");
        let mut env = TestEnv::new().await;
        // The primary is this environment's database: the harness reads outcomes there.
        env.pool = primary;
        env.database_url = pg.primary.url(DATABASE);
        env.settings.database.url = pg.primary.url(DATABASE);
        env.settings.database.read_url = pg.url(DATABASE);
        // A replica that is away fails a read this soon.
        env.settings.database.acquire_timeout_ms = 1_000;
        let clock = ManualClock::new(local("UTC", "2026-04-01 09:00"));
        let port = env.start_admin_worker(&clock).await;
        Replicated { env, pg, port }
    }

    /// [`Replicated::start`], then message `denied` denied and its row on the replica.
    async fn with_a_denial() -> Replicated {
        let r = Replicated::start().await;
        r.env.publish_allowed_denied_invalid().await;
        r.until_printed(&["denials", "--format", "json"], DENIED_JSON)
            .await;
        r
    }

    /// `sendquota <args>` as an operator runs it with `read_url` set: this environment's
    /// services, the private primary and the replica.
    fn cli(&self, args: &[&str]) -> Command {
        let mut cmd = self.env.cli(args);
        cmd.env("SENDQUOTA_DATABASE_URL", self.pg.primary.url(DATABASE))
            .env("SENDQUOTA_DATABASE_READ_URL", self.pg.url(DATABASE));
        cmd
    }

    async fn run(&self, args: &[&str]) -> Run {
        run_to_end(self.cli(args)).await
    }

    /// Runs `args` until it succeeds with `expected` in its output (the replica catching up),
    /// or fails the test saying what it printed last.
    async fn until_printed(&self, args: &[&str], expected: &str) -> Run {
        let deadline = Instant::now() + LAG;
        loop {
            let run = self.run(args).await;
            if run.code == Some(0) && run.stdout.contains(expected) {
                return run;
            }
            assert!(
                Instant::now() < deadline,
                "`sendquota {}` never printed {expected} (exit {:?}):\n{}{}",
                args.join(" "),
                run.code,
                run.stdout,
                run.stderr
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The body of `GET /v1/denials` once it lists `message_id`.
    async fn api_lists(&self, message_id: &str) -> String {
        let deadline = Instant::now() + LAG;
        loop {
            let reply = http(self.port, "GET", "/v1/denials", Some(ADMIN_TOKEN), "").await;
            let ids: Vec<String> = if reply.status == 200 {
                reply.json()["denials"]
                    .as_array()
                    .expect("denials")
                    .iter()
                    .map(|d| d["message_id"].as_str().unwrap_or("").to_owned())
                    .collect()
            } else {
                Vec::new()
            };
            if ids.iter().any(|id| id == message_id) {
                return reply.body;
            }
            assert!(
                Instant::now() < deadline,
                "GET /v1/denials never listed {message_id}: {} {}",
                reply.status,
                reply.body
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The console's denial list, logged in.
    async fn console_denials(&self) -> (u16, String) {
        let mut console = Console::new(self.port, IpAddr::V4(Ipv4Addr::LOCALHOST));
        let login = console.log_in(ADMIN_TOKEN).await;
        assert_eq!(login.status, 303, "logged in: {}", login.body);
        let page = console.get("/ui/denials").await;
        (page.status, page.body)
    }
}

const DENIED_JSON: &str = "\"message_id\":\"denied\"";

#[tokio::test]
async fn operator_reads_come_from_the_replica_and_go_on_while_the_primary_is_down() {
    let mut r = Replicated::with_a_denial().await;
    r.api_lists("denied").await;
    let (status, page) = r.console_denials().await;
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("denied"), "{page}");

    // With the primary stopped, only the replica can answer.
    let pg = &r.pg;
    pg.primary.stop();
    let listed = r.run(&["denials", "--format", "json"]).await;
    assert_eq!(listed.code, Some(0), "{}", listed.stderr);
    assert!(listed.stdout.contains(DENIED_JSON), "{}", listed.stdout);
    r.api_lists("denied").await;
    let (status, page) = r.console_denials().await;
    assert_eq!((status, page.contains("denied")), (200, true), "{page}");
    for read in [
        &["replay", "--dry-run"][..],
        &["rules", "history"],
        &["digests"],
    ] {
        let run = r.run(read).await;
        assert_eq!(run.code, Some(0), "{read:?}: {}", run.stderr);
    }
    assert!(
        r.run(&["replay", "--dry-run"])
            .await
            .stdout
            .contains("would replay 1 denials"),
        "the dry run lists the replica's row"
    );
    // Without read_url the same command reads the primary, which is down.
    let mut primary_only = r.env.cli(&["denials"]);
    primary_only.env("SENDQUOTA_DATABASE_URL", r.pg.primary.url(DATABASE));
    let failed = run_to_end(primary_only).await;
    assert_eq!(failed.code, Some(1), "{}", failed.stdout);
    r.env.stop_worker().await;
}

#[tokio::test]
async fn writes_go_to_the_primary_when_reads_go_to_the_replica() {
    let mut r = Replicated::with_a_denial().await;
    // A replay claims (SELECT ... FOR UPDATE) and marks its rows: on the replica, a read-only
    // transaction, both would fail.
    let replayed = r.run(&["replay"]).await;
    assert_eq!(replayed.code, Some(0), "{}", replayed.stderr);
    assert!(
        replayed.stdout.contains("replayed 1 denials"),
        "{}",
        replayed.stdout
    );
    // The mark reaches the replica a moment later.
    r.until_printed(
        &["denials", "--replayed", "true", "--format", "json"],
        DENIED_JSON,
    )
    .await;
    // A reset writes its audit row first.
    let reset = http(
        r.port,
        "DELETE",
        "/v1/recipients/alice/quota",
        Some(ADMIN_TOKEN),
        "",
    )
    .await;
    assert_eq!(reset.status, 200, "{}", reset.body);
    r.env.stop_worker().await;
}

#[tokio::test]
async fn with_the_replica_down_reads_fail_naming_read_url_and_the_worker_goes_on() {
    let mut r = Replicated::start().await;
    let pg = &r.pg;
    pg.stop();
    let listed = r.run(&["denials"]).await;
    assert_eq!(listed.code, Some(1), "{}", listed.stdout);
    assert!(
        listed.stderr.contains("database.read_url"),
        "{}",
        listed.stderr
    );
    let api = http(r.port, "GET", "/v1/denials", Some(ADMIN_TOKEN), "").await;
    assert_eq!(api.status, 503, "{}", api.body);
    assert!(api.body.contains("database.read_url"), "{}", api.body);
    // The worker decides and records on the primary meanwhile.
    r.env.publish_allowed_denied_invalid().await;
    assert_eq!(
        r.env.denial_count("denied").await,
        1,
        "recorded on the primary"
    );
    r.env.stop_worker().await;
}

#[test]
fn config_check_redacts_read_url_and_refuses_a_malformed_one() {
    let check = |read_url: &str| {
        let mut cmd = support::process::sendquota();
        cmd.args(["config", "check"])
            .env("SENDQUOTA_DATABASE_READ_URL", read_url);
        support::process::run_for(cmd, None, Duration::from_secs(30))
    };
    let printed = check("postgres://reader:s3cret@replica.internal:5432/sendquota");
    assert_eq!(printed.code, Some(0), "{}", printed.stderr);
    assert!(
        printed
            .stdout
            .contains("read_url = \"postgres://reader:***@replica.internal:5432/sendquota\""),
        "{}",
        printed.stdout
    );
    assert!(!printed.stdout.contains("s3cret"));
    let refused = check("mysql://replica.internal/sendquota");
    assert_eq!(refused.code, Some(2));
    assert!(
        refused.stderr.contains(
            "database read_url is not valid: expected postgres://user[:password]@host:port/database"
        ),
        "{}",
        refused.stderr
    );
}
