//! Security properties end to end: secrets stay out of errors and logs, message content cannot
//! steer Redis keys or SQL, Lua comes only from lua/, and the admin token must match exactly.

use crate::support;

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use redis::AsyncCommands;
use sendquota::clock::ManualClock;
use sendquota::internals::denials::{DenialFilter, DenialStore};
use sendquota::internals::keys::{encode, rule_key, scope_tag};
use sendquota::internals::policy::ScopeValue;
use support::http::http;
use support::private::free_port;
use support::process::{run_for, Run};
use support::{local, TestEnv};

// ---------------------------------------------------------------------------------------------
// Secrets never appear in errors or logs
// ---------------------------------------------------------------------------------------------

const REDIS_SECRET: &str = "S3cretRedisPw";
const AMQP_SECRET: &str = "S3cretAmqpPw";
const PG_SECRET: &str = "S3cretPgPw";
const ADMIN_SECRET: &str = "S3cretAdminToken-0123456789";
const SECRETS: [&str; 4] = [REDIS_SECRET, AMQP_SECRET, PG_SECRET, ADMIN_SECRET];

const CLOSED_REDIS: &str = "redis://:S3cretRedisPw@127.0.0.1:1";
const CLOSED_AMQP: &str = "amqp://guest:S3cretAmqpPw@127.0.0.1:1/%2f";
const CLOSED_PG: &str = "postgres://postgres:S3cretPgPw@127.0.0.1:1/x";

impl Run {
    /// Fails when any secret appears on stdout or stderr.
    fn assert_no_secret(&self, what: &str) {
        for secret in SECRETS {
            assert!(
                !self.stdout.contains(secret) && !self.stderr.contains(secret),
                "{what}: {secret} leaked:\n--- stdout\n{}\n--- stderr\n{}",
                self.stdout,
                self.stderr
            );
        }
    }
}

/// The binary with no SENDQUOTA_* setting inherited from the test process, debug logging, and
/// every connection URL and the admin token carrying a secret.
fn with_secrets() -> Command {
    let mut cmd = support::process::sendquota();
    cmd.env("SENDQUOTA_LOG", "debug")
        .env("SENDQUOTA_NAMESPACE", support::unique("sqsec"))
        .env("SENDQUOTA_REDIS_URL", CLOSED_REDIS)
        .env("SENDQUOTA_AMQP_URL", CLOSED_AMQP)
        .env("SENDQUOTA_DATABASE_URL", CLOSED_PG)
        .env("SENDQUOTA_ADMIN_TOKEN", ADMIN_SECRET)
        .env("SENDQUOTA_ADMIN_LISTEN", "127.0.0.1:0");
    cmd
}

/// Inserts `password` into a URL whose user-info names a user without one.
fn with_password(url: &str, password: &str) -> String {
    let Some(scheme_end) = url.find("://") else {
        return url.to_owned();
    };
    let rest = &url[scheme_end + 3..];
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    match rest[..authority_end].find('@') {
        Some(at) if !rest[..at].contains(':') => format!(
            "{}{}:{password}{}",
            &url[..scheme_end + 3],
            &rest[..at],
            &rest[at..]
        ),
        _ => url.to_owned(),
    }
}

const VALID_LINE: &str = r#"{"id":"m-sec-1","recipient":"alice","channel":"sms"}"#;

#[test]
fn secrets_in_connection_urls_and_the_admin_token_never_reach_stdout_or_stderr() {
    let limit = Duration::from_secs(30);
    let commands: [(&str, Vec<&str>, Option<&str>, i32); 8] = [
        (
            "check",
            vec![
                "check",
                "--message",
                VALID_LINE,
                "--at",
                "2026-05-01T09:00:00Z",
            ],
            None,
            1,
        ),
        ("denials", vec!["denials"], None, 1),
        (
            "denials with filters",
            vec!["denials", "--recipient", "alice", "--format", "json"],
            None,
            1,
        ),
        ("publish", vec!["publish"], Some(VALID_LINE), 1),
        ("migrate", vec!["migrate"], None, 1),
        ("replay", vec!["replay", "--due", "--dry-run"], None, 1),
        ("prune", vec!["prune", "--older-than", "90d"], None, 1),
        ("worker", vec!["worker"], None, 1),
    ];
    // In parallel: the Postgres commands each wait out the pool's acquire timeout.
    let runs: Vec<_> = commands
        .into_iter()
        .map(|(what, args, stdin, expected)| {
            let mut cmd = with_secrets();
            cmd.args(&args);
            let stdin = stdin.map(str::to_owned);
            let run = std::thread::spawn(move || run_for(cmd, stdin.as_deref(), limit));
            (what, run, expected)
        })
        .collect();
    for (what, run, expected) in runs {
        let run = run.join().expect("run the binary");
        run.assert_no_secret(what);
        assert_eq!(
            run.code,
            Some(expected),
            "{what} did not exit {expected} by itself within {limit:?}: {run:?}"
        );
        let last = run.stderr.lines().last().unwrap_or_default();
        assert!(last.starts_with("sendquota: "), "{what}: {}", run.stderr);
        eprintln!(
            "{what}: exit {:?} after {:?}: {last}",
            run.code, run.elapsed
        );
    }

    let mut cmd = with_secrets();
    cmd.args(["config", "check"]);
    let run = run_for(cmd, None, limit);
    run.assert_no_secret("config check");
    assert_eq!(run.code, Some(0), "{run:?}");
    for redacted in [
        "url = \"redis://:***@127.0.0.1:1\"",
        "url = \"amqp://guest:***@127.0.0.1:1/%2f\"",
        "url = \"postgres://postgres:***@127.0.0.1:1/x\"",
        "token = \"***\"",
    ] {
        assert!(
            run.stdout.contains(redacted),
            "no {redacted} in\n{}",
            run.stdout
        );
    }
}

/// TLS settings are file paths: `config check` prints the paths, and neither it nor a refused
/// file ever prints what the files hold.
#[test]
fn certificate_files_are_named_but_their_key_material_is_never_printed() {
    const KEY_SECRET: &str = "S3cretKeyMaterial";
    let dir = std::env::temp_dir().join(support::unique("sqtlsfiles"));
    std::fs::create_dir_all(&dir).expect("dir");
    let write = |name: &str, text: String| {
        let path = dir.join(name);
        std::fs::write(&path, text).expect("write");
        path.to_str().expect("utf-8").to_owned()
    };
    let cert = write(
        "client.pem",
        format!("-----BEGIN CERTIFICATE-----\n{KEY_SECRET}\n-----END CERTIFICATE-----\n"),
    );
    let key = write(
        "client.key",
        format!("-----BEGIN PRIVATE KEY-----\n{KEY_SECRET}\n-----END PRIVATE KEY-----\n"),
    );
    let not_pem = write("bad.key", format!("{KEY_SECRET}\n"));
    let with_files = |key: &str| {
        let mut cmd = with_secrets();
        for service in ["REDIS", "AMQP", "DATABASE"] {
            cmd.env(format!("SENDQUOTA_{service}_TLS_CA_FILE"), &cert)
                .env(format!("SENDQUOTA_{service}_TLS_CLIENT_CERT_FILE"), &cert)
                .env(format!("SENDQUOTA_{service}_TLS_CLIENT_KEY_FILE"), key);
        }
        cmd.args(["config", "check"]);
        let run = run_for(cmd, None, Duration::from_secs(30));
        run.assert_no_secret("config check with TLS files");
        assert!(
            !run.stdout.contains(KEY_SECRET) && !run.stderr.contains(KEY_SECRET),
            "key material printed: {run:?}"
        );
        run
    };
    let run = with_files(&key);
    assert_eq!(run.code, Some(0), "{run:?}");
    for section in ["[redis.tls]", "[amqp.tls]", "[database.tls]"] {
        assert!(run.stdout.contains(section), "{section} in {}", run.stdout);
    }
    assert!(run.stdout.contains(&format!("client_key_file = \"{key}\"")));
    let run = with_files(&not_pem);
    assert_eq!(run.code, Some(2), "{run:?}");
    assert_eq!(
        run.stderr.trim(),
        format!("sendquota: redis.tls: client_key_file {not_pem} holds no PEM private key")
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn malformed_urls_with_passwords_are_refused_without_repeating_them() {
    for (var, url) in [
        (
            "SENDQUOTA_REDIS_URL",
            "redis://:S3cretRedisPw@127.0.0.1:notaport",
        ),
        (
            "SENDQUOTA_REDIS_CLUSTER_URLS",
            "redis://:S3cretRedisPw@127.0.0.1:1,redis://:S3cretRedisPw@h:x",
        ),
        (
            "SENDQUOTA_AMQP_URL",
            "amqp://guest:S3cretAmqpPw@127.0.0.1:notaport/%2f",
        ),
        (
            "SENDQUOTA_DATABASE_URL",
            "postgres://postgres:S3cretPgPw@127.0.0.1:notaport/x",
        ),
    ] {
        let mut cmd = with_secrets();
        cmd.env(var, url).args(["config", "check"]);
        let run = run_for(cmd, None, Duration::from_secs(30));
        run.assert_no_secret(var);
        assert_eq!(run.code, Some(2), "{var}: {run:?}");
        assert_eq!(run.stdout, "", "{var}");
    }
}

/// `redact_url` only knows `scheme://user:password@host` and `password=`; `check_urls` trusts
/// the parsers not to repeat a URL. Neither holds for these URLs (found by the config fuzz in
/// tests/it/input_fuzz.rs): lapin refuses a URL without a scheme with `Invalid URL: '<the URL>'`,
/// and lapin and sqlx accept `scheme:/user:password@host`, which `config check` then prints
/// unredacted.
#[test]
fn urls_the_redactor_does_not_recognise_never_print_their_password() {
    let mut leaks = Vec::new();
    for (var, url) in [
        (
            "SENDQUOTA_AMQP_URL",
            "guest:S3cretAmqpPw@127.0.0.1:5672/%2f",
        ),
        (
            "SENDQUOTA_AMQP_URL",
            "amqp:/guest:S3cretAmqpPw@127.0.0.1:5672/%2f",
        ),
        (
            "SENDQUOTA_DATABASE_URL",
            "postgres:/postgres:S3cretPgPw@127.0.0.1/x",
        ),
        ("SENDQUOTA_DATABASE_URL", "postgres:S3cretPgPw@127.0.0.1/x"),
    ] {
        let mut cmd = with_secrets();
        cmd.env(var, url).args(["config", "check"]);
        let run = run_for(cmd, None, Duration::from_secs(30));
        if SECRETS
            .iter()
            .any(|s| run.stdout.contains(s) || run.stderr.contains(s))
        {
            leaks.push((url, run.code, run.stderr.trim().to_owned()));
        }
    }
    assert!(leaks.is_empty(), "passwords printed: {leaks:#?}");
}

#[test]
fn wrong_passwords_against_the_live_services_are_not_repeated() {
    let live_redis = support::redis_url().replacen("://", "://:S3cretRedisPw@", 1);
    let live_amqp = support::amqp_url().replacen("guest:guest@", "guest:S3cretAmqpPw@", 1);

    // Redis without requirepass refuses AUTH with a password.
    let mut cmd = with_secrets();
    cmd.env("SENDQUOTA_REDIS_URL", &live_redis)
        .args(["check", "--message", VALID_LINE]);
    let run = run_for(cmd, None, Duration::from_secs(30));
    run.assert_no_secret("check against live redis");
    assert_eq!(run.code, Some(1), "{run:?}");

    // RabbitMQ refuses the login.
    let mut cmd = with_secrets();
    cmd.env("SENDQUOTA_AMQP_URL", &live_amqp).arg("publish");
    let run = run_for(cmd, Some(VALID_LINE), Duration::from_secs(30));
    run.assert_no_secret("publish against live rabbitmq");
    assert_eq!(run.code, Some(1), "{run:?}");
}

/// The worker with Redis and Postgres up (Postgres trusts local connections, so the password
/// in its URL is accepted and ignored) and the broker down. With debug logs, what it prints on
/// the way to exiting 1 must not hold a secret.
#[tokio::test]
async fn a_worker_that_cannot_reach_the_broker_logs_no_secret() {
    let env = TestEnv::new().await;
    let database_url = with_password(&env.database_url, PG_SECRET);
    let mut cmd = with_secrets();
    cmd.env("SENDQUOTA_NAMESPACE", &env.namespace)
        .env("SENDQUOTA_REDIS_URL", support::redis_url())
        .env("SENDQUOTA_DATABASE_URL", &database_url)
        .args(["worker", "--now", "2026-02-02T09:00:00Z"]);
    let run = tokio::task::spawn_blocking(move || run_for(cmd, None, Duration::from_secs(8)))
        .await
        .expect("run the worker");
    run.assert_no_secret("worker with the broker down");
    assert!(
        run.stderr.contains("sendquota: rabbitmq: "),
        "the worker reached the broker step: {run:?}"
    );
    assert_eq!(run.code, Some(1), "{run:?}");
    eprintln!(
        "worker with the broker down: exit {:?} after {:?} ({} log lines)",
        run.code,
        run.elapsed,
        run.stderr.lines().count()
    );
}

/// README: "`worker` ... 1 if a service is unreachable at start". Redis, Postgres and the
/// broker are all checked at start: a worker that never got a session exits 1.
#[tokio::test]
async fn the_worker_exits_1_when_the_broker_is_unreachable_at_start() {
    let env = TestEnv::new().await;
    let mut cmd = with_secrets();
    cmd.env("SENDQUOTA_NAMESPACE", &env.namespace)
        .env("SENDQUOTA_REDIS_URL", support::redis_url())
        .env("SENDQUOTA_DATABASE_URL", &env.database_url)
        .args(["worker", "--now", "2026-02-02T09:00:00Z"]);
    let run = support::process::run_to_end(cmd).await;
    assert_eq!(run.code, Some(1), "{run:?}");
}

#[test]
fn the_worker_exits_1_when_postgres_is_unreachable_or_redis_refuses_the_password() {
    let live_redis = support::redis_url().replacen("://", "://:S3cretRedisPw@", 1);
    for (what, redis) in [
        ("postgres down", support::redis_url()),
        ("redis refuses the password", live_redis),
    ] {
        let mut cmd = with_secrets();
        cmd.env("SENDQUOTA_REDIS_URL", redis).arg("worker");
        let run = run_for(cmd, None, Duration::from_secs(30));
        run.assert_no_secret(what);
        assert_eq!(run.code, Some(1), "{what}: {run:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// Message content cannot steer a Redis key
// ---------------------------------------------------------------------------------------------

/// The inverse of `encode`, or `None` when `s` is not an encoding.
fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s.get(i + 1..i + 3)?;
            if hex.chars().any(|c| c.is_ascii_lowercase()) {
                return None;
            }
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

fn hostile_string() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>(),
        "[{}:%a-zA-Z0-9 ._@+-]{0,24}",
        "[{}:%\\u{80}-\\u{10ffff}]{0,8}",
        "(\\{r:[a-z]{0,3}\\}|:|%[0-9A-Fa-f]{2}|[a-z]{1,3}|\\}|\\{)*",
        "\\PC{0,40}",
    ]
}

/// A pair of different strings that a naive encoder could map to one key.
fn lookalike_pair() -> impl Strategy<Value = (String, String)> {
    prop_oneof![
        (hostile_string(), hostile_string()),
        // A string and its own encoding ("a:b" and "a%3Ab").
        hostile_string().prop_map(|s| {
            let e = encode(&s);
            (s, e)
        }),
        // A string and the same with one character replaced by its escape, in either case.
        (
            hostile_string(),
            any::<prop::sample::Index>(),
            any::<bool>()
        )
            .prop_map(|(s, i, lower)| {
                let chars: Vec<char> = s.chars().collect();
                if chars.is_empty() {
                    return (s, "%".to_owned());
                }
                let at = i.index(chars.len());
                let mut escaped = encode(&chars[at].to_string());
                if escaped == chars[at].to_string() {
                    escaped = format!("%{:02X}", u32::from(chars[at]) & 0xff);
                }
                if lower {
                    escaped = escaped.to_lowercase();
                }
                let other: String = chars[..at].iter().collect::<String>()
                    + &escaped
                    + &chars[at + 1..].iter().collect::<String>();
                (s, other)
            }),
    ]
}

/// Runs `property` on `cases` values of `strategy` (no regression files), prints how many
/// times it ran, and fails the test with proptest's minimal input when it fails.
fn fuzz<S: Strategy>(
    name: &str,
    cases: u32,
    strategy: S,
    property: impl Fn(S::Value) -> Result<(), TestCaseError>,
) {
    let executions = AtomicUsize::new(0);
    let result = support::property_runner(cases).run(&strategy, |value| {
        executions.fetch_add(1, Ordering::Relaxed);
        property(value)
    });
    eprintln!(
        "fuzz {name}: {} executions",
        executions.load(Ordering::Relaxed)
    );
    if let Err(e) = result {
        panic!("{name}: {e}");
    }
}

#[test]
fn a_recipient_cannot_steer_its_key_outside_its_own_hash_tag() {
    fuzz("key shape", 10_000, hostile_string(), |recipient| {
        let encoded = encode(&recipient);
        let tag = scope_tag(&ScopeValue::Recipient(&recipient));
        let key = rule_key("ns", &tag, "headline", "calendar_quota");
        prop_assert_eq!(key.matches('{').count(), 1, "{}", key);
        prop_assert_eq!(key.matches('}').count(), 1, "{}", key);
        prop_assert_eq!(support::cluster_tag(&key), format!("r:{encoded}"));
        prop_assert_eq!(&key, &format!("ns:{{r:{encoded}}}:headline:calendar_quota"));
        prop_assert_eq!(key.matches(':').count(), 4, "{}", key);
        prop_assert!(
            encoded.is_ascii() && !encoded.contains(['{', '}', ':']),
            "{}",
            encoded
        );
        prop_assert!(!encoded.chars().any(|c| c.is_whitespace() || c.is_control()));
        prop_assert_eq!(percent_decode(&encoded), Some(recipient.clone()));
        Ok(())
    });
}

#[test]
fn different_recipients_never_share_an_encoding() {
    fuzz("encode injective", 10_000, lookalike_pair(), |(a, b)| {
        if a != b {
            prop_assert_ne!(encode(&a), encode(&b), "{:?} and {:?}", a, b);
            prop_assert_ne!(
                scope_tag(&ScopeValue::Recipient(&a)),
                scope_tag(&ScopeValue::Recipient(&b))
            );
        }
        Ok(())
    });
}

// ---------------------------------------------------------------------------------------------
// SQL only with bound parameters
// ---------------------------------------------------------------------------------------------

const INJECTION: &str = "'); DROP TABLE denials; --\"\\";

#[tokio::test]
async fn sql_metacharacters_in_a_denied_message_are_stored_and_listed_back_verbatim() {
    let mut env = TestEnv::new().await;
    let clock = ManualClock::new(local("UTC", "2026-02-02 09:00"));
    env.start_worker(&clock);
    let recipient = format!("r{INJECTION}");
    // Channels and categories are names (dot-separated words), which hold no metacharacters;
    // the filters below still hand them the injection.
    let channel = "sms".to_owned();
    let category = "k".to_owned();
    let first = format!("m1{INJECTION}");
    let second = format!("m2{INJECTION}");
    let message = |id: &str| {
        serde_json::json!({
            "id": id,
            "recipient": recipient,
            "channel": channel,
            "category": category,
            "timezone": "UTC",
            "payload": {"text": INJECTION, INJECTION: INJECTION},
        })
    };
    let mut seen = HashMap::new();
    env.publish(&message(&first)).await;
    assert!(env.outcome(&first, &mut seen).await, "first is dispatched");
    env.publish(&message(&second)).await;
    assert!(!env.outcome(&second, &mut seen).await, "second is denied");
    env.stop_worker().await;

    let rows = env.denials().await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    let row = &rows[0];
    assert_eq!(row.message_id, second);
    assert_eq!(row.recipient, recipient);
    assert_eq!(row.channel, channel);
    assert_eq!(row.category, category);
    assert_eq!(row.rule, "headline");
    let message = row.message.value();
    assert_eq!(message["id"], second.as_str());
    assert_eq!(message["recipient"], recipient.as_str());
    assert_eq!(message["payload"][INJECTION], INJECTION);

    // Every text filter binds its value.
    let store = DenialStore::from_pool(env.pool.clone());
    let filter = DenialFilter {
        limit: 100,
        ..DenialFilter::default()
    };
    for (what, filter, expected) in [
        (
            "recipient",
            DenialFilter {
                recipient: Some(recipient.clone()),
                ..filter.clone()
            },
            1,
        ),
        (
            "channel",
            DenialFilter {
                channel: Some(channel.clone()),
                ..filter.clone()
            },
            1,
        ),
        (
            "category",
            DenialFilter {
                category: Some(category.clone()),
                ..filter.clone()
            },
            1,
        ),
        (
            "channel injected",
            DenialFilter {
                channel: Some(format!("{channel}{INJECTION}")),
                ..filter.clone()
            },
            0,
        ),
        (
            "category OR",
            DenialFilter {
                category: Some(format!("{category}' OR '1'='1")),
                ..filter.clone()
            },
            0,
        ),
        (
            "rule",
            DenialFilter {
                rule: Some(INJECTION.to_owned()),
                ..filter.clone()
            },
            0,
        ),
        (
            "recipient OR",
            DenialFilter {
                recipient: Some("x' OR '1'='1".to_owned()),
                ..filter.clone()
            },
            0,
        ),
    ] {
        let rows = store.list(&filter).await.expect("list denials");
        assert_eq!(rows.len(), expected, "{what}: {rows:?}");
    }

    // The CLI filter too.
    let mut cmd = env.cli(&["denials", "--recipient", &recipient, "--format", "json"]);
    cmd.env("SENDQUOTA_LOG", "off");
    let run = support::process::run_to_end(cmd).await;
    assert_eq!(run.code, Some(0), "{run:?}");
    let listed: Vec<serde_json::Value> = run
        .stdout
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    assert_eq!(listed.len(), 1, "{}", run.stdout);
    assert_eq!(listed[0]["message_id"], second.as_str());
    assert_eq!(listed[0]["recipient"], recipient.as_str());

    let exists: bool = sqlx::query_scalar("SELECT to_regclass('denials') IS NOT NULL")
        .fetch_one(&env.pool)
        .await
        .expect("query the catalog");
    assert!(exists, "the denials table still exists");
    assert_eq!(env.denial_rows().await, 1);
}

// ---------------------------------------------------------------------------------------------
// Lua only from lua/
// ---------------------------------------------------------------------------------------------

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read src dir") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn lua_reaches_redis_only_from_the_files_in_lua() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    rust_files(&root.join("src"), &mut files);
    assert!(files.len() > 10, "found the sources: {files:?}");

    let script_path = root.join("src/decide/limiter/script.rs");
    let mut with_script_new = Vec::new();
    for path in &files {
        let text = std::fs::read_to_string(path).expect("read source");
        let rel = path
            .strip_prefix(root)
            .expect("under the crate")
            .display()
            .to_string();
        if text.contains("Script::new") {
            with_script_new.push(rel.clone());
        }
        assert!(!text.contains("EVAL "), "{rel} builds an EVAL command");
        let lower = text.to_ascii_lowercase();
        // The decision scripts are sent by one EVALSHA, built where the scripts are
        // composed, with the hash of a script from `source_for`.
        if *path == script_path {
            assert_eq!(lower.matches("\"evalsha\"").count(), 1, "{rel}");
        } else {
            assert!(
                !lower.contains("\"evalsha\""),
                "{rel} names the command EVALSHA"
            );
        }
        for command in [
            "\"eval\"",
            "\"eval_ro\"",
            "\"evalsha_ro\"",
            "\"script\"",
            "\"fcall\"",
            "\"fcall_ro\"",
            "\"function\"",
        ] {
            assert!(
                !lower.contains(command),
                "{rel} names the command {command}"
            );
        }
        assert!(
            !text.contains("redis.call(") || *path == script_path,
            "{rel} holds Lua"
        );
    }
    assert_eq!(with_script_new, ["src/decide/limiter/script.rs"]);

    let script_rs = std::fs::read_to_string(&script_path).expect("read script.rs");
    assert_eq!(script_rs.matches("Script::new").count(), 1);
    assert!(script_rs.contains("redis::Script::new(&source_for(kinds))"));
    // Every piece a script is composed of is a file of lua/ (a kind's, of lua/kinds/), compiled
    // in verbatim, and every such file is one piece.
    use sendquota::internals::kinds::SOURCES;
    use sendquota::internals::limiter::script::{
        prelude_for, source_for, KindSet, DRIVER, PRELUDE,
    };
    let lua = |name: &str| {
        std::fs::read_to_string(root.join("lua").join(format!("{name}.lua"))).expect("read lua")
    };
    assert_eq!(PRELUDE, lua("prelude"));
    assert_eq!(DRIVER, lua("decide"));
    let kind_lua = |kind: &str| lua(&format!("kinds/{kind}"));
    for (kind, source) in SOURCES {
        assert_eq!(source, kind_lua(kind), "{kind}");
    }
    let mut pieces: Vec<String> = SOURCES
        .iter()
        .map(|(k, _)| format!("kinds/{k}.lua"))
        .collect();
    pieces.extend(["prelude.lua".to_owned(), "decide.lua".to_owned()]);
    let pieces_set: BTreeSet<String> = pieces.iter().cloned().collect();
    assert_eq!(pieces_set.len(), pieces.len(), "a file is a piece twice");
    let lua_files = |dir: &str, prefix: &str| -> Vec<String> {
        std::fs::read_dir(root.join(dir))
            .expect("read lua dir")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".lua"))
            .map(|n| format!("{prefix}{n}"))
            .collect()
    };
    let on_disk: BTreeSet<String> = lua_files("lua", "")
        .into_iter()
        .chain(lua_files("lua/kinds", "kinds/"))
        .collect();
    assert_eq!(pieces_set, on_disk);
    // A composed script is exactly the prelude (less the helpers nothing in it calls), the
    // kinds asked for and the driver.
    let headline = source_for(KindSet::of(["calendar_quota"]));
    let body = format!("{}\n{}", kind_lua("calendar_quota"), lua("decide"));
    assert_eq!(headline, format!("{}\n{body}", prelude_for(&body)));
    let prelude = lua("prelude");
    let paragraphs: Vec<&str> = prelude.split("\n\n").collect();
    assert!(prelude_for(&body)
        .split("\n\n")
        .all(|kept| paragraphs.contains(&kept)));
    let all = source_for(KindSet::ALL);
    let every_kind: String = SOURCES.iter().map(|(k, _)| kind_lua(k) + "\n").collect();
    assert_eq!(
        all,
        format!("{}\n{every_kind}{}", lua("prelude"), lua("decide"))
    );
}

// ---------------------------------------------------------------------------------------------
// The admin token must match exactly
// ---------------------------------------------------------------------------------------------

const TOKEN: &str = "test-token-0123456789abcdef";
const OTHER_TOKEN: &str = "Second-Token-ZYXWVUTSRQ9876";

/// Flips the case of the character at `at`.
fn flip_case_at(token: &str, at: usize) -> String {
    token
        .chars()
        .enumerate()
        .map(|(i, c)| {
            if i != at {
                c
            } else if c.is_ascii_lowercase() {
                c.to_ascii_uppercase()
            } else {
                c.to_ascii_lowercase()
            }
        })
        .collect()
}

#[tokio::test]
async fn v1_accepts_only_an_exact_token_not_a_prefix_extension_or_case_variant() {
    let mut env = TestEnv::new().await;
    let port = free_port();
    env.settings.admin.listen = format!("127.0.0.1:{port}");
    env.settings.admin.tokens = vec![
        sendquota::config::AdminToken {
            name: "ops".to_owned(),
            token: TOKEN.to_owned(),
        },
        sendquota::config::AdminToken {
            name: "ci".to_owned(),
            token: OTHER_TOKEN.to_owned(),
        },
    ];
    let clock = ManualClock::new(local("UTC", "2026-04-01 09:00"));
    env.start_worker(&clock);
    support::http::wait_until_ready(port).await;

    // alice has state, so a reset that got through would show.
    let mut seen = HashMap::new();
    env.publish(&support::request("m1", "alice", "UTC")).await;
    assert!(env.outcome("m1", &mut seen).await);
    let key = format!("{}:{{r:alice}}:headline:calendar_quota", env.namespace);
    let mut redis = env.redis.clone();

    for right in [TOKEN, OTHER_TOKEN] {
        let n = right.len();
        let mut wrong = vec![
            right[..n - 1].to_owned(),
            right[..1].to_owned(),
            right[..n / 2].to_owned(),
            format!("{right}x"),
            format!("{right}{right}"),
            format!("x{right}"),
            right[1..].to_owned(),
            right.to_uppercase(),
            right.to_lowercase(),
            flip_case_at(right, 0),
            flip_case_at(right, n - 1),
            format!(
                "{}{}",
                &right[..n - 1],
                char::from(right.as_bytes()[n - 1] ^ 1)
            ),
            String::new(),
        ];
        wrong.retain(|w| w != TOKEN && w != OTHER_TOKEN);
        assert!(wrong.len() >= 11);
        for token in &wrong {
            for (method, path) in [
                ("GET", "/v1/denials"),
                ("POST", "/v1/check"),
                ("GET", "/v1/recipients/alice/quota"),
                ("DELETE", "/v1/recipients/alice/quota"),
            ] {
                let body = r#"{"id":"c1","recipient":"bob","channel":"sms"}"#;
                let reply = http(port, method, path, Some(token), body).await;
                assert_eq!(reply.status, 401, "{method} {path} with {token:?}");
                assert!(reply
                    .headers
                    .to_ascii_lowercase()
                    .contains("www-authenticate: bearer"));
                assert!(
                    token.len() < 8 || !reply.body.contains(token.as_str()),
                    "the presented token {token:?} is echoed: {}",
                    reply.body
                );
                assert_eq!(
                    reply.body, r#"{"error":"missing or wrong bearer token"}"#,
                    "{method} {path} with {token:?}"
                );
            }
        }
        let ok = http(port, "GET", "/v1/denials", Some(right), "").await;
        assert_eq!(ok.status, 200, "{}", ok.body);
    }
    let exists: bool = redis.exists(&key).await.expect("exists");
    assert!(exists, "no rejected DELETE reset alice");
    let reset = http(
        port,
        "DELETE",
        "/v1/recipients/alice/quota",
        Some(TOKEN),
        "",
    )
    .await;
    assert_eq!(reset.status, 200, "{}", reset.body);
    let exists: bool = redis.exists(&key).await.expect("exists");
    assert!(!exists, "the exact token reset alice");
}

// ---------------------------------------------------------------------------------------------
// A payload Postgres cannot store
// ---------------------------------------------------------------------------------------------

/// A string with U+0000 is valid JSON and passes `SendRequest::decode` (the payload is not
/// checked), but Postgres `jsonb` refuses `\u0000`. When such a message is denied, writing its
/// denial row fails, and the failure is treated as a service failure: the message is retried
/// forever and never acked.
#[tokio::test]
async fn a_denied_message_with_a_nul_in_its_payload_still_gets_an_outcome() {
    let mut env = TestEnv::new().await;
    let clock = ManualClock::new(local("UTC", "2026-02-02 09:00"));
    env.start_worker(&clock);
    let mut seen = HashMap::new();
    for (id, recipient) in [("a1", "alice"), ("b1", "bob")] {
        env.publish(&support::request(id, recipient, "UTC")).await;
        assert!(env.outcome(id, &mut seen).await);
    }
    let mut poison = support::request("a2", "alice", "UTC");
    poison["payload"] = serde_json::json!({"text": "nul \u{0} here"});
    env.publish(&poison).await;
    env.publish(&support::request("b2", "bob", "UTC")).await;
    // An ordinary denial next to the poison one is still recorded...
    assert!(!env.outcome("b2", &mut seen).await);
    // ...and the poison one gets an outcome too (a denial row, or the invalid queue).
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        if env.denial_count("a2").await > 0 || !env.drain(&env.names.invalid).await.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "a2 has no outcome after 15 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
