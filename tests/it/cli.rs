//! The `sendquota` binary end to end: exit codes, stdout and stderr as scripts see them.

use crate::support;

use std::collections::HashMap;
use std::future::Future;
use std::io::Write;
use std::process::{Command, Stdio};

use chrono::{Duration, SecondsFormat, SubsecRound, Utc};
use sendquota::clock::ManualClock;
use sendquota::internals::dedup::DispatchMarks;
use serde_json::{json, Value};
use support::fixtures::policy;
use support::{request, TempFile, TestEnv};

/// What one run of the binary left behind.
struct Out {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Out {
    /// Exit code, stdout and stderr, to compare at once.
    fn all(&self) -> (i32, &str, &str) {
        (self.code, &self.stdout, &self.stderr)
    }
}

/// The binary with no SENDQUOTA_* setting inherited from the test process and logging off.
fn bare() -> Command {
    let mut cmd = support::process::sendquota();
    cmd.env("SENDQUOTA_LOG", "off");
    cmd
}

/// The binary on `env`'s namespace and services ([`TestEnv::cli`]: its configuration file names
/// the queue type they were declared with), logging off.
fn on(env: &TestEnv) -> Command {
    let mut cmd = env.cli(&[]);
    cmd.env("SENDQUOTA_LOG", "off");
    cmd
}

/// Runs `cmd` with `args` (and `stdin`, if any) off the async runtime and collects the output.
fn run(mut cmd: Command, args: &[&str], stdin: Option<&str>) -> impl Future<Output = Out> {
    cmd.args(args);
    let input = stdin.map(str::to_owned);
    let task = tokio::task::spawn_blocking(move || output(cmd, input.as_deref()));
    async move { task.await.expect("run the binary") }
}

fn output(mut cmd: Command, stdin: Option<&str>) -> Out {
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("start the sendquota binary");
    let mut pipe = child.stdin.take().expect("stdin pipe");
    if let Some(text) = stdin {
        pipe.write_all(text.as_bytes()).expect("write stdin");
    }
    drop(pipe);
    let out = child.wait_with_output().expect("wait for the binary");
    Out {
        code: out.status.code().expect("exited, not killed"),
        stdout: String::from_utf8(out.stdout).expect("utf-8 stdout"),
        stderr: String::from_utf8(out.stderr).expect("utf-8 stderr"),
    }
}

fn config_check(config: Option<&TempFile>) -> Out {
    let mut cmd = bare();
    if let Some(c) = config {
        cmd.args(["--config", c.path()]);
    }
    cmd.args(["config", "check"]);
    output(cmd, None)
}

fn message(id: &str, recipient: &str) -> String {
    request(id, recipient, "UTC").to_string()
}

/// `sendquota check` of `message` at `at`, with `--commit` when `commit`.
fn check_at(env: &TestEnv, message: &str, at: &str, commit: bool) -> impl Future<Output = Out> {
    let mut args = vec!["check", "--message", message, "--at", at];
    args.extend(commit.then_some("--commit"));
    run(on(env), &args, None)
}

#[test]
fn config_check_without_a_file_prints_the_headline_rule_and_exits_0() {
    let out = config_check(None);
    assert_eq!((out.code, out.stderr.as_str()), (0, ""));
    let effective: toml::Table = toml::from_str(&out.stdout).expect("the output is TOML");
    let rules = effective["rules"].as_array().expect("rules");
    let headline: toml::Table = toml::from_str(
        "name = \"headline\"\nkind = \"calendar_quota\"\nper_day = 1\nper_window = 3\n\
         window_days = 7\nscope = \"recipient\"\non_deny = \"drop\"\n\
         match = { channels = [], categories = [] }\n",
    )
    .expect("expected rule");
    assert_eq!(rules, &vec![toml::Value::Table(headline)]);
    assert_eq!(effective["default_timezone"].as_str(), Some("UTC"));
}

#[test]
fn config_check_output_is_a_config_that_loads_to_the_same_output() {
    let config = TempFile::new(policy!("every_option_config_check_prints"));
    let first = config_check(Some(&config));
    assert_eq!(first.code, 0, "{}", first.stderr);
    assert!(
        first.stdout.contains("max_delay = \"2h\""),
        "{}",
        first.stdout
    );
    for printed in [
        "on_deny = \"digest\"\n",
        "digest_by = \"campaign\"\n",
        "exempt = [\"critical\", \"high\"]\nexempt_counts = true\n",
        "[rules.reserve]\nslots = 1\nfor = \"high\"\nuntil = \"18:00\"\n",
    ] {
        assert!(
            first.stdout.contains(printed),
            "{printed}: {}",
            first.stdout
        );
    }
    // Said only where it is not the default (wait), as the other options.
    assert_eq!(
        first.stdout.matches("on_unavailable").count(),
        1,
        "{}",
        first.stdout
    );
    assert!(
        first.stdout.contains("on_unavailable = \"allow\""),
        "{}",
        first.stdout
    );
    assert!(
        first
            .stdout
            .contains("per_attributes = [\"campaign\", \"step\"]"),
        "{}",
        first.stdout
    );
    // Days and windows come back in week order, days only where given.
    for printed in [
        "days = [\"fri\", \"sat\"]",
        "mon = [\"09:00-12:00\", \"13:00-17:30\"]\ntue = [\"09:00-17:30\"]\nsat = \
         [\"22:00-24:00\"]\nsun = [\"00:00-02:00\"]\n",
    ] {
        assert!(
            first.stdout.contains(printed),
            "{printed}: {}",
            first.stdout
        );
    }
    assert_eq!(
        first.stdout.matches("\ndays = ").count(),
        1,
        "{}",
        first.stdout
    );
    let again = TempFile::new(&first.stdout);
    let second = config_check(Some(&again));
    assert_eq!(second.code, 0, "{}", second.stderr);
    assert_eq!(first.stdout, second.stdout);
}

#[test]
fn malformed_connection_urls_are_config_errors_with_exit_2() {
    for (var, message) in [
        ("SENDQUOTA_REDIS_URL", "sendquota: redis url is not valid: "),
        ("SENDQUOTA_AMQP_URL", "sendquota: amqp url is not valid: "),
        (
            "SENDQUOTA_DATABASE_URL",
            "sendquota: database url is not valid: ",
        ),
    ] {
        let mut cmd = bare();
        cmd.args(["config", "check"]).env(var, "garbage");
        let out = output(cmd, None);
        assert_eq!(out.code, 2, "{var}: {}", out.stderr);
        assert!(out.stderr.starts_with(message), "{var}: {}", out.stderr);
        assert!(!out.stderr.contains("garbage"), "the URL is not echoed");
    }
}

/// A URL that parses but cannot be used is refused at start (exit 2, before connecting) with
/// its real cause, by `config check` and by the worker alike: an unknown `sslmode`, a Redis
/// Cluster whose seeds mix TLS and plaintext.
#[test]
fn unusable_connection_settings_are_config_errors_naming_the_cause() {
    for (var, value, expected) in [
        (
            "SENDQUOTA_DATABASE_URL",
            "postgres://postgres:s3cret@127.0.0.1:5432/sendquota?sslmode=bogus",
            "sendquota: database url: sslmode \"bogus\" is not one of disable, allow, prefer, \
             require, verify-ca, verify-full\n",
        ),
        (
            "SENDQUOTA_REDIS_CLUSTER_URLS",
            "redis://127.0.0.1:7000,rediss://127.0.0.1:7001",
            "sendquota: redis cluster_urls mix redis:// and rediss:// seeds: a cluster's nodes \
             are reached all with TLS or all without\n",
        ),
    ] {
        for args in [&["config", "check"][..], &["worker"][..]] {
            let mut cmd = bare();
            cmd.args(args).env(var, value);
            let started = std::time::Instant::now();
            let out = output(cmd, None);
            assert_eq!(
                (out.code, out.stdout.as_str(), out.stderr.as_str()),
                (2, "", expected),
                "{var} {args:?}"
            );
            assert!(started.elapsed() < std::time::Duration::from_secs(2));
        }
    }
}

#[test]
fn config_check_redacts_the_amqp_password() {
    let config = TempFile::new("[amqp]\nurl = \"amqp://guest:s3cret@127.0.0.1:5672/%2f\"\n");
    let out = config_check(Some(&config));
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(out
        .stdout
        .contains("url = \"amqp://guest:***@127.0.0.1:5672/%2f\"\n"));
    assert!(!out.stdout.contains("s3cret") && !out.stderr.contains("s3cret"));
}

/// Runs `config check` on `text`, which must be refused: exit 2, nothing on stdout, one line
/// on stderr, which is returned without the file's path.
fn refused(text: &str) -> String {
    let config = TempFile::new(text);
    let out = config_check(Some(&config));
    assert_eq!((out.code, out.stdout.as_str()), (2, ""), "{text}");
    assert_eq!(out.stderr.lines().count(), 1, "{}", out.stderr);
    out.stderr.replace(config.path(), "FILE")
}

#[test]
fn bad_config_files_exit_2_with_one_line_naming_the_problem() {
    let rule = |params: &str| policy!("calendar_quota_a_with_params", params = params);
    assert_eq!(
        refused(policy!("unknown_kind_nope")),
        "sendquota: rule \"x\": unknown kind \"nope\" (known kinds: calendar_quota, \
         fixed_window, sliding_window, sliding_log, leaky_bucket, token_bucket, gcra, \
         zset_window, quiet_hours, send_window)\n"
    );
    let valid = "per_day = 1\nper_window = 3\nwindow_days = 7\n";
    assert_eq!(
        refused(&rule(valid).repeat(2)),
        "sendquota: duplicate rule name \"a\"\n"
    );
    assert_eq!(
        refused(&rule("per_day = 5\nper_window = 3\nwindow_days = 7\n")),
        "sendquota: rule \"a\": per_day (5) is larger than per_window (3)\n"
    );
    assert_eq!(
        refused("default_timezone = \"Mars/Olympus\"\n"),
        "sendquota: default_timezone: unknown time zone \"Mars/Olympus\"\n"
    );
    assert_eq!(
        refused(&rule("per_dya = 1\nper_window = 3\nwindow_days = 7\n")),
        "sendquota: rule \"a\": unknown parameter `per_dya` for kind calendar_quota\n"
    );
    assert_eq!(
        refused("colour = \"blue\"\n"),
        "sendquota: config file FILE: line 1: unknown field `colour`, expected one of \
         `namespace`, `default_timezone`, `redis`, `amqp`, `intake`, `database`, `worker`, \
         `admin`, `log`, `telemetry`, `rules`\n"
    );
}

#[test]
fn with_json_logs_a_refused_config_is_reported_as_one_json_object() {
    let config = TempFile::new("[worker]\nthreads = 100000\n");
    let mut cmd = bare();
    cmd.env("SENDQUOTA_LOG_FORMAT", "json")
        .args(["--config", config.path(), "config", "check"]);
    let out = output(cmd, None);
    assert_eq!((out.code, out.stdout.as_str()), (2, ""));
    let line: serde_json::Value = serde_json::from_str(out.stderr.trim_end())
        .unwrap_or_else(|e| panic!("not one JSON object ({e}): {}", out.stderr));
    assert_eq!(line["level"], "ERROR");
    assert_eq!(
        line["message"],
        "sendquota: [worker] threads must be between 0 and 1024 (got 100000)"
    );
}

#[tokio::test]
async fn check_decides_without_consuming_unless_commit_and_a_deny_names_the_next_midnight() {
    let env = TestEnv::new().await;
    let check = |id: &str, at: &str, commit: bool| {
        let out = check_at(&env, &message(id, "alice"), at, commit);
        async move {
            let out = out.await;
            let lines = out.stdout.lines().count();
            assert_eq!((out.code, lines, out.stderr.as_str()), (0, 1, ""));
            serde_json::from_str::<Value>(&out.stdout).expect("one JSON object")
        }
    };
    let allow = json!({
        "outcome": "allow", "rule": null, "retry_after": null,
        "rules": [{"rule": "headline", "kind": "calendar_quota", "allowed": true,
                   "remaining": 0, "retry_after": null}],
    });
    assert_eq!(check("m1", "2026-02-02T09:00:00Z", false).await, allow);
    assert_eq!(check("m2", "2026-02-02T09:00:00Z", false).await, allow);
    assert!(env.keys().await.is_empty(), "nothing consumed");
    assert_eq!(check("m1", "2026-02-02T09:00:00Z", true).await, allow);
    let deny = check("m2", "2026-02-02T23:59:59Z", false).await;
    assert_eq!(
        deny,
        json!({
            "outcome": "deny", "rule": "headline", "retry_after": "2026-02-03T00:00:00Z",
            "rules": [{"rule": "headline", "kind": "calendar_quota", "allowed": false,
                       "remaining": 0, "retry_after": "2026-02-03T00:00:00Z"}],
        })
    );
    // Once m1 is dispatched (the worker marks it), committing it again decides nothing.
    let marks = DispatchMarks::new(env.redis.clone(), &env.namespace, 3600);
    let at = "2026-02-02T10:00:00Z";
    marks
        .mark("alice", "m1", at.parse().expect("instant"))
        .await
        .expect("mark");
    let duplicate = json!({"outcome": "duplicate", "rule": null, "retry_after": null, "rules": []});
    assert_eq!(check("m1", at, true).await, duplicate);
    assert_eq!(
        check("m1", at, false).await["outcome"],
        "allow",
        "a dry run reads no marks"
    );
}

/// The supported instants run from 1970-01-01 up to 9000-01-01: a decision on the last day in
/// range names a retry_after that RFC 3339 can write, and every option that takes an instant
/// refuses one outside the range with exit 2 and one line, before any service is asked.
/// (Near the end of year 9999, `check` printed `+10000-01-01T00:00:00Z`.)
#[tokio::test]
async fn instants_outside_the_supported_range_exit_2_and_the_last_day_in_it_gets_a_valid_answer() {
    let env = TestEnv::new().await;
    let check = |id: &str, at: &str, commit: bool| check_at(&env, &message(id, "zoe"), at, commit);
    for day in ["8999-12-31", "9999-12-31"] {
        let first = check("z1", &format!("{day}T09:00:00Z"), true).await;
        let second = check("z2", &format!("{day}T11:00:00Z"), false).await;
        if day == "8999-12-31" {
            assert_eq!((first.code, second.code), (0, 0), "{}", second.stderr);
            let answer: Value = serde_json::from_str(&second.stdout).expect("one JSON object");
            assert_eq!(answer["retry_after"], "9000-01-01T00:00:00Z", "{answer}");
            continue;
        }
        let refused = format!(
            "sendquota: --at: {day}T11:00:00Z is outside the supported range of instants, \
             1970-01-01T00:00:00Z up to (not including) 9000-01-01T00:00:00Z\n"
        );
        assert_eq!(second.all(), (2, "", refused.as_str()));
        assert_eq!(first.code, 2, "{}", first.stderr);
    }
    let valid = message("z3", "zoe");
    let outside = [
        vec!["check", "--message", &valid, "--at", "1969-12-31T23:59:59Z"],
        vec!["worker", "--now", "9000-01-01T00:00:00Z"],
        vec!["denials", "--since", "1969-12-31T00:00:00Z"],
        vec!["denials", "--until", "9500-01-01T00:00:00Z"],
        vec!["denials", "--since", "3000000d"],
        vec!["replay", "--dry-run", "--until", "9999-12-31T23:59:59Z"],
    ];
    for args in outside {
        let mut cmd = on(&env);
        // A service asked would answer: exit 2 shows the instant was refused first.
        cmd.env("SENDQUOTA_REDIS_URL", "redis://127.0.0.1:1");
        let out = run(cmd, &args, None).await;
        assert_eq!(out.code, 2, "{args:?}: {}", out.stderr);
        assert!(
            out.stderr
                .contains("outside the supported range of instants")
                && out.stderr.lines().count() == 1,
            "{args:?}: {}",
            out.stderr
        );
    }
}

#[tokio::test]
async fn check_exits_2_on_an_invalid_message_and_1_when_redis_is_unreachable() {
    let env = TestEnv::new().await;
    let bad = r#"{"id":"m1","channel":"sms"}"#;
    let bad = run(on(&env), &["check", "--message", bad], None).await;
    let stderr = "sendquota: invalid message: missing field `recipient`\n";
    assert_eq!(bad.all(), (2, "", stderr));
    let mut cmd = on(&env);
    cmd.env("SENDQUOTA_REDIS_URL", "redis://127.0.0.1:1");
    let down = run(cmd, &["check", "--message", &message("m1", "alice")], None).await;
    let lines = down.stderr.lines().count();
    assert_eq!((down.code, down.stdout.as_str(), lines), (1, "", 1));
    assert!(
        down.stderr.starts_with("sendquota: redis: "),
        "{}",
        down.stderr
    );
}

async fn queued_ids(env: &TestEnv) -> Vec<String> {
    let mut ids: Vec<String> = env
        .drain(&env.names.requests)
        .await
        .iter()
        .map(|m| {
            let v: Value = serde_json::from_slice(&m.delivery.data).expect("JSON body");
            v["id"].as_str().expect("an id").to_owned()
        })
        .collect();
    ids.sort();
    ids
}

#[tokio::test]
async fn publish_sends_every_line_of_a_file_or_stdin_and_nothing_when_a_line_is_invalid() {
    let env = TestEnv::new().await;
    let lines = [message("p1", "a"), message("p2", "b"), message("p3", "c")];
    let file = TempFile::new(&format!("{}\n{}\n\n{}\n", lines[0], lines[1], lines[2]));
    let out = run(on(&env), &["publish", file.path()], None).await;
    let published = format!("published 3 messages to {}.requests\n", env.namespace);
    assert_eq!(out.all(), (0, published.as_str(), ""));
    assert_eq!(queued_ids(&env).await, ["p1", "p2", "p3"]);

    let broken = TempFile::new(&format!("{}\n{{\"id\":\"p2\"}}\n{}\n", lines[0], lines[2]));
    let out = run(on(&env), &["publish", broken.path()], None).await;
    let stderr = "sendquota: line 2: missing field `recipient`\n";
    assert_eq!(out.all(), (2, "", stderr));
    assert!(queued_ids(&env).await.is_empty(), "nothing published");

    let stdin = format!("{}\n{}\n{}\n", lines[0], lines[1], lines[2]);
    let out = run(on(&env), &["publish", "-"], Some(&stdin)).await;
    assert_eq!(out.all(), (0, published.as_str(), ""));
    assert_eq!(queued_ids(&env).await, ["p1", "p2", "p3"]);
}

#[tokio::test]
async fn denials_lists_a_worker_denial_as_json_table_and_csv_with_filters() {
    let mut env = TestEnv::new().await;
    let now = Utc::now().trunc_subsecs(0);
    let clock = ManualClock::new(now);
    env.start_worker(&clock);
    env.publish(&request("first", "alice", "UTC")).await;
    let mut seen = HashMap::new();
    assert!(env.outcome("first", &mut seen).await);
    env.publish(&request("second", "alice", "UTC")).await;
    assert!(!env.outcome("second", &mut seen).await);
    env.stop_worker().await;

    let at = |t: chrono::DateTime<Utc>| t.to_rfc3339_opts(SecondsFormat::AutoSi, true);
    let midnight = (now.date_naive() + Duration::days(1))
        .and_hms_opt(0, 0, 0)
        .expect("midnight")
        .and_utc();
    let denials = |args: &[&str]| {
        let mut all = vec!["denials"];
        all.extend(args);
        run(on(&env), &all, None)
    };
    let out = denials(&["--format", "json", "--recipient", "alice"]).await;
    assert_eq!((out.code, out.stderr.as_str()), (0, ""));
    assert_eq!(out.stdout.lines().count(), 1, "{}", out.stdout);
    let row: Value = serde_json::from_str(&out.stdout).expect("a JSON line");
    let reason = "at most 1 per local day and 3 per 7 local days";
    // The stored message is the request as decoded, defaults (category, cost) left out.
    let stored = request("second", "alice", "UTC");
    assert!(row["id"].is_i64(), "{row}");
    assert_eq!(
        row,
        json!({
            "id": row["id"], "message_id": "second", "recipient": "alice", "channel": "sms",
            "category": "default", "rule": "headline", "kind": "calendar_quota",
            "reason": reason, "shadow": false, "unchecked": false, "denied_at": at(now),
            "retry_after": at(midnight), "replayed_at": null, "replay_of": null,
            "expires_at": null, "message": stored,
        })
    );

    let out = denials(&["--format", "table"]).await;
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!((out.code, lines.len()), (0, 2), "{}", out.stdout);
    assert!(lines[0].starts_with("id  "), "{}", lines[0]);
    let words = |l: &str| l.split_whitespace().map(str::to_owned).collect::<Vec<_>>();
    let columns = "id denied_at recipient channel category rule kind retry_after replayed_at";
    assert_eq!(words(lines[0]), words(columns));
    let (id, denied_at, retry_after) = (row["id"].to_string(), at(now), at(midnight));
    let cells = format!("{id} {denied_at} alice sms default headline calendar_quota {retry_after}");
    assert_eq!(words(lines[1]), words(&cells));
    let column = lines[0].find("retry_after");
    assert_eq!(lines[1].find(&retry_after), column, "columns are aligned");

    let out = denials(&["--format", "csv"]).await;
    assert_eq!(out.code, 0);
    assert_eq!(
        out.stdout,
        format!(
            "id,denied_at,recipient,channel,category,rule,kind,retry_after,replayed_at,\
             reason,message_id\n{id},{denied_at},alice,sms,default,headline,calendar_quota,\
             {retry_after},,{reason},second\n"
        )
    );

    let out = denials(&["--format", "json", "--recipient", "other"]).await;
    assert_eq!((out.code, out.stdout.as_str()), (0, ""));
    let out = denials(&["--format", "json", "--since", "7d"]).await;
    assert_eq!((out.code, out.stdout.lines().count()), (0, 1));
    let out = denials(&["--since", "yesterday"]).await;
    assert_eq!(out.code, 2);
    assert_eq!(
        out.stderr,
        "sendquota: --since \"yesterday\" is neither an RFC3339 instant nor an age such as 7d, 36h, 90m or 30s\n"
    );
}
