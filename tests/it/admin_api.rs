//! The admin HTTP API served by the real worker: every route end to end, 401s, pagination,
//! quota peek and audited reset, and the OpenAPI document matching the routes.

use crate::support;

use std::collections::{BTreeSet, HashMap, HashSet};
use std::time::{Duration, Instant};

use sendquota::clock::ManualClock;
use serde_json::Value;
use support::fixtures::policy;
use support::http::http;
use support::{local, request, TestEnv};

use support::ADMIN_TOKEN as TOKEN;

/// A worker with the admin API on a free port and one token, ready.
async fn admin_env() -> (TestEnv, ManualClock, u16) {
    admin_env_with(|_| {}).await
}

/// [`admin_env`] with its settings changed by `configure` before the worker starts.
async fn admin_env_with(
    configure: impl FnOnce(&mut sendquota::config::Settings),
) -> (TestEnv, ManualClock, u16) {
    let mut env = TestEnv::new().await;
    configure(&mut env.settings);
    let clock = ManualClock::new(local("UTC", "2026-04-01 09:00"));
    let port = env.start_admin_worker(&clock).await;
    (env, clock, port)
}

#[tokio::test]
async fn health_readiness_and_metrics_need_no_token_and_report_the_worker() {
    let (env, _clock, port) = admin_env().await;
    let health = http(port, "GET", "/healthz", None, "").await;
    assert_eq!((health.status, health.body.as_str()), (200, "ok\n"));
    let ready = http(port, "GET", "/readyz", None, "").await;
    assert_eq!(ready.status, 200);
    assert_eq!(
        ready.json(),
        serde_json::json!({"ready": true, "redis": true, "postgres": true, "consuming": true,
            "blocked": null})
    );
    let mut seen = HashMap::new();
    env.publish(&request("m1", "alice", "UTC")).await;
    assert!(env.outcome("m1", &mut seen).await);
    env.publish(&request("m2", "alice", "UTC")).await;
    assert!(!env.outcome("m2", &mut seen).await);
    env.publish_raw(b"not json").await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while env.drain(&env.names.invalid).await.is_empty() {
        assert!(Instant::now() < deadline, "the invalid message was routed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Series that must have counted (every family is exported from the start, at zero).
    let counted = [
        // No rule names a channel or a category: every value is counted as "other".
        "sendquota_decisions_total{outcome=\"allow\",channel=\"other\",category=\"other\"}",
        "sendquota_decisions_total{outcome=\"deny\",channel=\"other\",category=\"other\"}",
        "sendquota_decisions_total{outcome=\"invalid\",channel=\"other\",category=\"other\"}",
        "sendquota_rule_verdicts_total{rule=\"headline\",verdict=\"deny\"}",
        "sendquota_decision_seconds_count",
        "sendquota_dispatch_seconds_count",
        "sendquota_denial_write_seconds_count",
        "sendquota_denial_batches_total",
        "sendquota_invalid_messages_total",
        "sendquota_ready",
    ];
    let value = |body: &str, series: &str| -> Option<f64> {
        body.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    };
    // The invalid message is counted just after it reaches its queue: scrape until it shows.
    loop {
        let metrics = http(port, "GET", "/metrics", None, "").await;
        assert_eq!(metrics.status, 200);
        let missing: Vec<&str> = counted
            .iter()
            .copied()
            .filter(|series| value(&metrics.body, series).is_none_or(|v| v < 1.0))
            .collect();
        if missing.is_empty() && value(&metrics.body, "sendquota_clock_skew_seconds").is_some() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not counted: {missing:?} in\n{}",
            metrics.body
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn v1_routes_refuse_a_missing_or_wrong_token_with_401() {
    let (_env, _clock, port) = admin_env().await;
    let routes = [
        ("GET", "/v1/denials"),
        ("POST", "/v1/check"),
        ("GET", "/v1/recipients/alice/quota"),
        ("DELETE", "/v1/recipients/alice/quota"),
    ];
    for (method, path) in routes {
        for token in [
            None,
            Some("wrong-token-0123456789"),
            Some(&TOKEN[..TOKEN.len() - 1]),
        ] {
            let reply = http(port, method, path, token, "{}").await;
            assert_eq!(reply.status, 401, "{method} {path} with {token:?}");
            assert!(reply
                .headers
                .to_ascii_lowercase()
                .contains("www-authenticate: bearer"));
            assert_eq!(reply.json()["error"], "missing or wrong bearer token");
        }
    }
}

#[tokio::test]
async fn denials_page_through_with_no_duplicates_and_no_gaps() {
    let (env, clock, port) = admin_env().await;
    let mut seen = HashMap::new();
    // 23 recipients, two messages each on one day: 23 denials.
    for r in 0..23 {
        for m in 0..2 {
            let id = format!("m{m}-{r}");
            env.publish(&request(&id, &format!("user-{r}"), "UTC"))
                .await;
            env.outcome(&id, &mut seen).await;
        }
    }
    let _ = clock;
    let mut ids = Vec::new();
    let mut after: Option<i64> = None;
    let mut pages = 0;
    loop {
        let path = match after {
            Some(a) => format!("/v1/denials?limit=10&after={a}"),
            None => "/v1/denials?limit=10".to_owned(),
        };
        let page = http(port, "GET", &path, Some(TOKEN), "").await;
        assert_eq!(page.status, 200, "{}", page.body);
        let page = page.json();
        pages += 1;
        for d in page["denials"].as_array().expect("denials") {
            ids.push(d["id"].as_i64().expect("id"));
        }
        match page["next_after"].as_i64() {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    assert_eq!(pages, 3);
    let all: Vec<i64> = env.denials().await.iter().rev().map(|d| d.id).collect();
    assert_eq!(ids, all, "every denial once, newest first");
    let unique: HashSet<i64> = ids.iter().copied().collect();
    assert_eq!(unique.len(), 23);
    let filtered = http(port, "GET", "/v1/denials?recipient=user-7", Some(TOKEN), "").await;
    let rows = filtered.json()["denials"]
        .as_array()
        .expect("denials")
        .clone();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0]["message_id"], "m1-7");
    let bad = http(port, "GET", "/v1/denials?since=yesterday", Some(TOKEN), "").await;
    assert_eq!(bad.status, 400);
}

#[tokio::test]
async fn check_explains_every_rule_and_consumes_nothing() {
    let (env, _clock, port) = admin_env().await;
    let body = request("probe", "carol", "UTC").to_string();
    for _ in 0..2 {
        let reply = http(
            port,
            "POST",
            "/v1/check?at=2026-04-01T10:00:00Z",
            Some(TOKEN),
            &body,
        )
        .await;
        assert_eq!(reply.status, 200, "{}", reply.body);
        assert_eq!(
            reply.json(),
            serde_json::json!({"outcome": "allow", "rule": null, "retry_after": null, "rules": [
                {"rule": "headline", "kind": "calendar_quota", "allowed": true, "remaining": 0,
                 "retry_after": null}]})
        );
    }
    assert!(env.keys().await.is_empty(), "a dry run writes nothing");
    let invalid = http(port, "POST", "/v1/check", Some(TOKEN), "{\"id\":1}").await;
    assert_eq!(invalid.status, 400);
}

/// `?at=` outside the supported instants (1970-01-01 up to 9000-01-01) is a 400 naming the
/// range, on both routes that take it; the last instant in range is answered.
#[tokio::test]
async fn an_at_outside_the_supported_range_is_a_400() {
    let (_env, _clock, port) = admin_env().await;
    let body = request("probe", "erin", "UTC").to_string();
    for at in [
        "9999-12-31T11:00:00Z",
        "9000-01-01T00:00:00Z",
        "1969-12-31T23:59:59Z",
    ] {
        for (method, path, body) in [
            ("POST", format!("/v1/check?at={at}"), body.as_str()),
            ("GET", format!("/v1/recipients/erin/quota?at={at}"), ""),
        ] {
            let reply = http(port, method, &path, Some(TOKEN), body).await;
            assert_eq!(reply.status, 400, "{path}: {}", reply.body);
            assert!(
                reply.body.contains(&format!(
                    "at: {at} is outside the supported range of instants, \
                     1970-01-01T00:00:00Z up to (not including) 9000-01-01T00:00:00Z"
                )),
                "{path}: {}",
                reply.body
            );
        }
    }
    let last = "8999-12-31T23:59:59.999Z";
    let check = http(
        port,
        "POST",
        &format!("/v1/check?at={last}"),
        Some(TOKEN),
        &body,
    )
    .await;
    assert_eq!(check.status, 200, "{}", check.body);
    let peek = http(
        port,
        "GET",
        &format!("/v1/recipients/erin/quota?at={last}"),
        Some(TOKEN),
        "",
    )
    .await;
    assert_eq!(peek.status, 200, "{}", peek.body);
}

#[tokio::test]
async fn quota_peek_shows_usage_and_reset_frees_it_with_an_audit_row() {
    let (env, _clock, port) = admin_env().await;
    let mut seen = HashMap::new();
    env.publish(&request("m1", "dave", "UTC")).await;
    assert!(env.outcome("m1", &mut seen).await);
    let peek = http(port, "GET", "/v1/recipients/dave/quota", Some(TOKEN), "").await;
    assert_eq!(peek.status, 200, "{}", peek.body);
    let peek = peek.json();
    assert_eq!(peek["recipient"], "dave");
    assert_eq!(
        peek["rules"],
        serde_json::json!([{"rule": "headline", "kind": "calendar_quota", "allowed": false,
            "remaining": 0, "retry_after": "2026-04-02T00:00:00Z"}])
    );
    let reset = http(port, "DELETE", "/v1/recipients/dave/quota", Some(TOKEN), "").await;
    assert_eq!(reset.status, 200, "{}", reset.body);
    let reset = reset.json();
    assert_eq!(reset["rules"], serde_json::json!(["headline"]));
    assert_eq!(reset["keys_removed"], 1);
    assert_eq!(reset["actor"], "ops-alice");
    let audit: (String, String, i32, String) =
        sqlx::query_as("SELECT recipient, actor, keys_removed, status FROM quota_resets")
            .fetch_one(&env.pool)
            .await
            .expect("one audit row");
    assert_eq!(
        audit,
        (
            "dave".to_owned(),
            "ops-alice".to_owned(),
            1,
            "done".to_owned()
        )
    );
    env.publish(&request("m2", "dave", "UTC")).await;
    assert!(
        env.outcome("m2", &mut seen).await,
        "after the reset dave can be sent to again"
    );
}

/// The audit row is written before anything is deleted: when it cannot be (the table is
/// locked past the statement timeout), the API answers 503 and the quota is untouched.
#[tokio::test]
async fn a_reset_that_cannot_be_audited_resets_nothing() {
    let (env, _clock, port) = admin_env_with(|s| s.database.statement_timeout_ms = 300).await;
    let mut seen = HashMap::new();
    env.publish(&request("e1", "erin", "UTC")).await;
    assert!(env.outcome("e1", &mut seen).await);
    let mut lock = env.pool.begin().await.expect("transaction");
    sqlx::query("LOCK TABLE quota_resets IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *lock)
        .await
        .expect("lock the audit table");
    let reset = http(port, "DELETE", "/v1/recipients/erin/quota", Some(TOKEN), "").await;
    lock.rollback().await.expect("release the lock");
    assert_eq!(reset.status, 503, "{}", reset.body);
    assert!(reset.body.contains("nothing was reset"), "{}", reset.body);
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM quota_resets")
        .fetch_one(&env.pool)
        .await
        .expect("count");
    assert_eq!(rows, 0, "no audit row");
    env.publish(&request("e2", "erin", "UTC")).await;
    assert!(
        !env.outcome("e2", &mut seen).await,
        "erin's quota is still used: e2 is denied"
    );
}

#[tokio::test]
async fn the_openapi_document_lists_exactly_the_routes_that_exist() {
    let (_env, _clock, port) = admin_env().await;
    let doc: Value =
        serde_json::from_str(sendquota::internals::admin::OPENAPI).expect("OpenAPI is JSON");
    let mut documented = BTreeSet::new();
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for method in ["get", "post", "put", "delete", "patch"] {
            if item.get(method).is_some() {
                documented.insert((method.to_owned(), path.clone()));
            }
        }
    }
    let routed: BTreeSet<(String, String)> = sendquota::internals::admin::ROUTES
        .iter()
        .map(|(m, p)| ((*m).to_owned(), (*p).to_owned()))
        .collect();
    assert_eq!(
        documented, routed,
        "openapi.json and the router list the same routes"
    );
    for (method, path) in &routed {
        let concrete = path.replace("{id}", "someone");
        let reply = http(port, &method.to_uppercase(), &concrete, Some(TOKEN), "{}").await;
        assert!(
            reply.status != 404 && reply.status != 405,
            "{method} {path} answered {}",
            reply.status
        );
    }
    let served = http(port, "GET", "/openapi.json", None, "").await;
    assert_eq!(served.json(), doc);
    let missing = http(port, "GET", "/v1/nothing", Some(TOKEN), "").await;
    assert_eq!(missing.status, 404);
}

/// `POST /v1/check` takes a request's attributes and names the rules it lacks them for; the
/// quota peek shows a rule counting per attributes when given their values (a URL-encoded JSON
/// object), and refuses bad ones with the request's reason.
#[tokio::test]
async fn check_and_the_quota_peek_take_attributes() {
    let (env, _clock, port) = admin_env_with(|s| {
        let config = policy!("one_per_campaign_in_30_days");
        s.policy = sendquota::config::Settings::from_toml(config, |_| None)
            .expect("valid")
            .policy;
    })
    .await;
    let mut spring = request("m1", "dave", "UTC");
    spring["attributes"] = serde_json::json!({"campaign": "spring"});
    env.publish(&spring).await;
    assert!(env.outcome("m1", &mut HashMap::new()).await);
    let check = |body: Value| async move {
        let reply = http(port, "POST", "/v1/check", Some(TOKEN), &body.to_string()).await;
        assert_eq!(reply.status, 200, "{}", reply.body);
        reply.json()
    };
    spring["id"] = "m2".into();
    let spent = check(spring.clone()).await;
    assert_eq!(spent["outcome"], "deny");
    assert_eq!(spent["rule"], "one-per-campaign");
    let without = check(request("m3", "dave", "UTC")).await;
    assert_eq!(without["outcome"], "allow");
    assert_eq!(
        without["not_matched"],
        serde_json::json!([{"rule": "one-per-campaign", "missing_attributes": ["campaign"]}])
    );
    let peek = |query: &'static str| async move {
        http(
            port,
            "GET",
            &format!("/v1/recipients/dave/quota{query}"),
            Some(TOKEN),
            "",
        )
        .await
    };
    let bare = peek("").await;
    assert_eq!(bare.status, 200, "{}", bare.body);
    assert_eq!(bare.json()["rules"], serde_json::json!([]));
    let given = peek("?attributes=%7B%22campaign%22%3A%22spring%22%7D").await;
    assert_eq!(given.status, 200, "{}", given.body);
    let rules = &given.json()["rules"];
    assert_eq!(rules[0]["rule"], "one-per-campaign", "{rules}");
    assert_eq!(rules[0]["allowed"], false, "{rules}");
    let other = peek("?attributes=%7B%22campaign%22%3A%22autumn%22%7D").await;
    assert_eq!(other.json()["rules"][0]["allowed"], true);
    let bad = peek("?attributes=%5B1%5D").await;
    assert_eq!(bad.status, 400);
    assert!(
        bad.body.contains("field `attributes`: must be an object"),
        "{}",
        bad.body
    );
}
