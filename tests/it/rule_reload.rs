//! Live rule changes through the real worker binary: `POST /v1/rules/reload` and SIGHUP read
//! the configuration file again; a bad file keeps the running rules; unchanged rules keep their
//! counters; every applied change is in `sendquota rules history`; and messages in flight
//! during a reload are each decided under one policy, never a mix.

use crate::support;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use sendquota::internals::reload::policy_hash;
use support::fixtures::policy;
use support::http::{http, wait_until_ready};
use support::process::Running;
use support::{request, TempFile, TestEnv};

const TOKEN: &str = "reload-token-0123456789abcdef";

/// The queue type the test environment declared its queues with: the worker must agree.
const CLASSIC: &str = "[amqp]\nqueue_type = \"classic\"\n";

const HEADLINE: &str = policy!("headline");

/// A rule that no sms or email message meets: adding it changes nothing for them.
const PUSH_ONLY: &str = policy!("push_burst_only");

/// The `sendquota worker` binary at a fixed instant, reading its rules from a file the test
/// rewrites, with its admin API (token named `env`) on a free port.
struct Worker {
    process: Running,
    port: u16,
    file: TempFile,
}

impl Worker {
    async fn start(env: &TestEnv, rules: &str) -> Worker {
        let file = TempFile::new(&format!("{CLASSIC}{rules}"));
        let port = support::private::free_port();
        let mut cmd = env.worker_command();
        cmd.args([
            "--config",
            file.path(),
            "worker",
            "--now",
            "2026-02-02T09:00:00Z",
        ])
        .env("SENDQUOTA_ADMIN_LISTEN", format!("127.0.0.1:{port}"))
        .env("SENDQUOTA_ADMIN_TOKEN", TOKEN);
        let process = Running::spawn(cmd);
        wait_until_ready(port).await;
        Worker {
            process,
            port,
            file,
        }
    }

    /// Replaces the rules in the worker's file (nothing is applied until a reload).
    fn write_rules(&self, rules: &str) {
        std::fs::write(self.file.path(), format!("{CLASSIC}{rules}")).expect("rewrite config");
    }

    async fn reload(&self, token: Option<&str>) -> support::http::Reply {
        http(self.port, "POST", "/v1/rules/reload", token, "").await
    }
}

/// The hash `config check` and the audit name `rules` by.
fn hash_of(rules: &str) -> String {
    let settings = sendquota::config::Settings::from_toml(rules, |_| None).expect("valid rules");
    policy_hash(&settings.policy)
}

async fn policy_changes(env: &TestEnv) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM policy_changes")
        .fetch_one(&env.pool)
        .await
        .expect("count policy changes")
}

/// Alice's first message takes the day's slot. A reload that adds an unrelated rule keeps the
/// headline rule's counter: her second message is still denied by it. A reload that raises the
/// headline rule's daily cap to 2 keeps today's count too: her third message is the day's
/// second and goes out, her fourth is denied.
#[tokio::test]
async fn an_api_reload_changes_the_next_decisions_and_unchanged_rules_keep_their_counters() {
    let env = TestEnv::new().await;
    let worker = Worker::start(&env, HEADLINE).await;
    let mut seen = HashMap::new();
    env.publish(&request("a1", "alice", "UTC")).await;
    assert!(
        env.outcome("a1", &mut seen).await,
        "the day's first message"
    );

    let added = format!("{HEADLINE}\n{PUSH_ONLY}");
    worker.write_rules(&added);
    let reply = worker.reload(Some(TOKEN)).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let applied = reply.json();
    assert_eq!(applied["status"], "applied", "{applied}");
    assert_eq!(applied["old_hash"], hash_of(HEADLINE).as_str());
    assert_eq!(applied["new_hash"], hash_of(&added).as_str());
    let diff = applied["diff"].as_array().expect("diff lines");
    assert_eq!(diff.len(), 1, "{applied}");
    assert!(
        diff[0]
            .as_str()
            .is_some_and(|l| l.starts_with("+ rule push-burst: kind = \"fixed_window\"")),
        "{applied}"
    );
    assert_eq!(applied["restart_needed"], serde_json::json!([]));

    env.publish(&request("a2", "alice", "UTC")).await;
    assert!(
        !env.outcome("a2", &mut seen).await,
        "the unchanged headline rule still counts the first message"
    );

    let raised = format!("{}\n{PUSH_ONLY}", policy!("headline_two_a_day"));
    worker.write_rules(&raised);
    let reply = worker.reload(Some(TOKEN)).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(
        reply.json()["diff"],
        serde_json::json!(["~ rule headline: per_day 1 -> 2"])
    );
    env.publish(&request("a3", "alice", "UTC")).await;
    assert!(
        env.outcome("a3", &mut seen).await,
        "the raised cap admits a second message today"
    );
    env.publish(&request("a4", "alice", "UTC")).await;
    assert!(!env.outcome("a4", &mut seen).await, "but not a third");

    let rules: Vec<(String, String)> = env
        .denials()
        .await
        .into_iter()
        .map(|d| (d.message_id.clone(), d.rule.clone()))
        .collect();
    assert_eq!(
        rules,
        [
            ("a2".to_owned(), "headline".to_owned()),
            ("a4".to_owned(), "headline".to_owned())
        ]
    );
    let sources: Vec<String> = sqlx::query_scalar("SELECT source FROM policy_changes ORDER BY id")
        .fetch_all(&env.pool)
        .await
        .expect("read policy changes");
    assert_eq!(sources, ["api:env", "api:env"]);
    drop(worker);
}

/// A file that does not validate is refused with start-up's one line (400), counted in the
/// failure metric, and recorded nowhere; the running rules decide on. A reload of unchanged
/// rules answers `unchanged` and records nothing. Without the right token nothing happens.
#[tokio::test]
async fn a_bad_file_is_refused_with_its_error_and_the_running_rules_stay() {
    let env = TestEnv::new().await;
    let worker = Worker::start(&env, HEADLINE).await;

    worker.write_rules(policy!("headline_misspelt_kind"));
    let reply = worker.reload(Some(TOKEN)).await;
    assert_eq!(reply.status, 400, "{}", reply.body);
    let error = reply.json()["error"].as_str().expect("error").to_owned();
    assert!(
        error.contains("headline") && error.contains("calendar_qouta") && !error.contains('\n'),
        "one line naming the rule and the kind: {error}"
    );
    let metrics = http(worker.port, "GET", "/metrics", None, "").await.body;
    assert!(
        metrics
            .lines()
            .any(|l| l == "sendquota_policy_reload_failures_total 1"),
        "the failure is counted:\n{metrics}"
    );
    assert!(
        worker
            .process
            .lines()
            .iter()
            .any(|l| l.contains("rules not reloaded") && l.contains("calendar_qouta")),
        "the failure is logged: {:?}",
        worker.process.lines()
    );

    for token in [None, Some("not-the-token-0123456789")] {
        let refused = worker.reload(token).await;
        assert_eq!(refused.status, 401, "{}", refused.body);
    }

    let mut seen = HashMap::new();
    env.publish(&request("b1", "bob", "UTC")).await;
    assert!(env.outcome("b1", &mut seen).await);
    env.publish(&request("b2", "bob", "UTC")).await;
    assert!(
        !env.outcome("b2", &mut seen).await,
        "the running headline rule still decides"
    );

    worker.write_rules(HEADLINE);
    let reply = worker.reload(Some(TOKEN)).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(
        reply.json(),
        serde_json::json!({"status": "unchanged", "hash": hash_of(HEADLINE), "restart_needed": []})
    );
    assert_eq!(policy_changes(&env).await, 0, "nothing was applied");
}

/// SIGHUP reloads as the API does, recorded with source `signal`; `rules history` shows the
/// change with both hashes and the difference, in JSON and as a table. The new global rule
/// decides the next messages: Carol's goes out, Dave's is the hour's second and is denied.
#[tokio::test]
async fn sighup_reloads_and_rules_history_shows_the_change() {
    let env = TestEnv::new().await;
    let worker = Worker::start(&env, HEADLINE).await;
    let global = policy!("global_one_an_hour");
    let rules = format!("{HEADLINE}\n{global}");
    worker.write_rules(&rules);
    let hup = std::process::Command::new("kill")
        .args(["-HUP", &worker.process.id().to_string()])
        .status()
        .expect("send SIGHUP");
    assert!(hup.success());
    let deadline = Instant::now() + Duration::from_secs(10);
    while policy_changes(&env).await == 0 {
        assert!(Instant::now() < deadline, "the SIGHUP reload was recorded");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let mut seen = HashMap::new();
    env.publish(&request("c1", "carol", "UTC")).await;
    assert!(env.outcome("c1", &mut seen).await);
    env.publish(&request("d1", "dave", "UTC")).await;
    assert!(!env.outcome("d1", &mut seen).await);
    let denials = env.denials().await;
    assert_eq!(denials.len(), 1);
    assert_eq!(denials[0].rule, "global-one");

    let history = |format: &'static str| env.run_cli("", &["rules", "history", "--format", format]);
    let json = history("json").await;
    assert_eq!(json.code, Some(0), "{json:?}");
    let rows: Vec<serde_json::Value> = json
        .stdout
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect();
    assert_eq!(rows.len(), 1, "{}", json.stdout);
    let (old, new) = (hash_of(HEADLINE), hash_of(&rules));
    assert_eq!(
        (
            &rows[0]["source"],
            &rows[0]["old_hash"],
            &rows[0]["new_hash"]
        ),
        (&"signal".into(), &old.clone().into(), &new.clone().into())
    );
    let diff = rows[0]["diff"].as_array().expect("diff lines");
    assert!(
        diff.len() == 1
            && diff[0]
                .as_str()
                .is_some_and(|l| l.starts_with("+ rule global-one:") && l.contains("\"global\"")),
        "{}",
        rows[0]
    );
    let table = history("table").await;
    assert_eq!(table.code, Some(0), "{table:?}");
    let lines: Vec<&str> = table.stdout.lines().collect();
    assert!(
        lines[0].contains(" signal ")
            && lines[0].ends_with(&format!("{} -> {}", &old[..12], &new[..12])),
        "{}",
        table.stdout
    );
    assert!(
        lines[1].starts_with("    + rule global-one:"),
        "{}",
        table.stdout
    );
}

/// Messages in flight while the rules change are each decided under one policy. The old
/// policy's only rule and the new one's are shadow rules that refuse every message (quiet
/// around the clock), so each message leaves exactly one shadow row, naming the rule of the
/// policy that decided it, and is dispatched: a decision that mixed the policies would leave
/// two rows, or none. A first batch is published, the rules are reloaded as soon as the worker
/// has dispatched one of it (the rest of it in flight or waiting), then a second batch follows,
/// which only the new policy can decide.
#[tokio::test]
async fn messages_in_flight_during_a_reload_are_each_decided_under_one_policy() {
    const BATCH: usize = 200;
    let shadow = |name: &str| policy!("shadow_quiet_around_the_clock", name = name);
    let env = TestEnv::new().await;
    let worker = Worker::start(&env, &shadow("old-policy")).await;
    let id = |i: usize| format!("m{i}");
    for i in 0..BATCH {
        env.publish(&request(&id(i), &format!("user-{i}"), "UTC"))
            .await;
    }
    let mut seen: HashMap<String, usize> = HashMap::new();
    let deadline = Instant::now() + support::OUTCOME_TIMEOUT;
    while seen.is_empty() {
        for d in env.take_dispatched().await {
            *seen.entry(d).or_default() += 1;
        }
        assert!(
            Instant::now() < deadline,
            "the first batch is being decided"
        );
    }
    worker.write_rules(&shadow("new-policy"));
    let reply = worker.reload(Some(TOKEN)).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.json()["status"], "applied");
    for i in BATCH..2 * BATCH {
        env.publish(&request(&id(i), &format!("user-{i}"), "UTC"))
            .await;
    }
    for i in 0..2 * BATCH {
        env.dispatched(&id(i), &mut seen).await;
    }
    assert!(seen.values().all(|&n| n == 1), "each dispatched once");
    // A shadow row is written before its dispatch: every row is in by now.
    let mut rules: HashMap<String, Vec<String>> = HashMap::new();
    for d in env.denials().await {
        assert!(d.shadow, "{d:?}");
        rules
            .entry(d.message_id.clone())
            .or_default()
            .push(d.rule.clone());
    }
    for i in 0..2 * BATCH {
        let decided = rules.get(&id(i)).map(Vec::as_slice).unwrap_or_default();
        assert!(
            decided == ["old-policy"] || decided == ["new-policy"],
            "message {} was decided under {decided:?}",
            id(i)
        );
        if i >= BATCH {
            assert_eq!(decided, ["new-policy"], "published after the reload");
        }
    }
    let old = rules.values().filter(|r| r[..] == ["old-policy"]).count();
    assert!(old >= 1, "some messages were decided before the reload");
    drop(worker);
}

/// A rule of each kind whose state is counted in units of its parameters, each on a channel of
/// its own: a token and a leaky bucket of 10 at 1 an hour, a GCRA of 5 an hour with bursts of 10,
/// and two sliding windows of 5 an hour; `changed` doubles the rates and changes the sliding
/// windows' sub-windows (6 to 1 minute) or storage (hash to list).
fn unit_rules(changed: bool) -> String {
    let (rate, cells, sub, storage) = if changed {
        (2, 10, "1m", "list")
    } else {
        (1, 5, "6m", "hash")
    };
    policy!(
        "bucket_and_window_units",
        rate = rate,
        cells = cells,
        sub = sub,
        storage = storage
    )
}

/// Publishes messages `first..last` on `channel` (to a recipient of the channel's name) and
/// returns how many of them went out.
async fn sent_of(env: &TestEnv, channel: &str, range: std::ops::Range<usize>) -> usize {
    let mut seen = HashMap::new();
    let mut sent = 0;
    for i in range {
        let id = format!("{channel}-{i}");
        let mut message = request(&id, channel, "UTC");
        message["channel"] = channel.into();
        env.publish(&message).await;
        if env.outcome(&id, &mut seen).await {
            sent += 1;
        }
    }
    sent
}

/// Issue 38, item 1: the worker's clock stands still (nothing refills or leaks), 5 messages go
/// out on each bucket (3 on each sliding window), then a reload doubles the rates and changes
/// the sliding windows' sub-window or storage. What each rule held is carried over: the token
/// bucket has 5 of its 10 tokens left (not 10: 15 within the hour), the leaky bucket room for 5
/// (not none), the GCRA 5 of its burst of 10 (not none), each sliding window room for 2.
#[tokio::test]
async fn a_reload_that_changes_a_rate_or_a_sub_window_carries_each_rules_level_over() {
    let env = TestEnv::new().await;
    let before = unit_rules(false);
    let worker = Worker::start(&env, &before).await;
    let channels = ["token", "leaky", "gcra", "sub", "storage"];
    let mut first = Vec::new();
    for channel in channels {
        let n = if channel == "sub" || channel == "storage" {
            3
        } else {
            5
        };
        first.push(sent_of(&env, channel, 0..n).await);
    }
    assert_eq!(first, [5, 5, 5, 3, 3], "{channels:?} before the reload");

    let after = unit_rules(true);
    worker.write_rules(&after);
    let reply = worker.reload(Some(TOKEN)).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.json()["status"], "applied", "{}", reply.body);

    let mut then = Vec::new();
    for channel in &channels[..4] {
        then.push(sent_of(&env, channel, 10..20).await);
    }
    assert_eq!(
        then,
        [5, 5, 5, 2],
        "{:?}: of 10 more after the reload",
        &channels[..4]
    );
    // A state kept in the other storage is read (it was an error: WRONGTYPE).
    assert_eq!(sent_of(&env, "storage", 10..20).await, 2, "storage");
    drop(worker);
}

/// A reload's caller learns what is wrong with the file, not where the worker keeps it: a
/// file that does not parse, or cannot be read, is refused (400) with an error that names
/// neither the file's absolute path nor its name; the log line names the file.
#[tokio::test]
async fn a_reload_error_does_not_reveal_the_config_file_s_path_to_the_caller() {
    let env = TestEnv::new().await;
    let worker = Worker::start(&env, HEADLINE).await;
    let path = worker.file.path().to_owned();
    let name = std::path::Path::new(&path)
        .file_name()
        .and_then(|n| n.to_str())
        .expect("a file name")
        .to_owned();

    worker.write_rules(policy!("headline_unclosed_table_header"));
    let reply = worker.reload(Some(TOKEN)).await;
    assert_eq!(reply.status, 400, "{}", reply.body);
    let error = reply.json()["error"].as_str().expect("error").to_owned();
    assert!(
        error.starts_with("config file: line 3:"),
        "what and where in the file: {error}"
    );
    assert!(
        !error.contains(&name) && !error.contains(&path),
        "the file's path is not the caller's: {error}"
    );

    std::fs::remove_file(&path).expect("remove the config file");
    let reply = worker.reload(Some(TOKEN)).await;
    assert_eq!(reply.status, 400, "{}", reply.body);
    let error = reply.json()["error"].as_str().expect("error").to_owned();
    assert!(
        error.starts_with("cannot read the config file: "),
        "{error}"
    );
    assert!(
        !error.contains(&name) && !error.contains(&path),
        "the file's path is not the caller's: {error}"
    );
    let logged = worker
        .process
        .lines()
        .into_iter()
        .filter(|l| l.contains("rules not reloaded"))
        .collect::<Vec<_>>();
    assert_eq!(logged.len(), 2, "{logged:?}");
    assert!(
        logged.iter().all(|l| l.contains(&path)),
        "the log names the file: {logged:?}"
    );
}
