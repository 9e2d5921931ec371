//! Request attributes and rules that count per attribute (`per_attributes`), through the real
//! worker at default settings: bad attributes go to the invalid queue with a reason naming the
//! key and take no quota; a per-campaign cap admits one message per campaign per recipient
//! (copies in flight, the deny cache on); a global per-campaign cap counts each campaign across
//! recipients, on one Redis server and on a cluster, with refunds across hash tags; `check`
//! says which rules a message lacks the attributes of.

use crate::support;

use std::collections::HashMap;

use sendquota::clock::ManualClock;
use sendquota::internals::broker;
use support::fixtures::policy;
use support::{local, request, TestEnv};

/// At most one message per campaign to each recipient in 30 local days. A calendar quota, the
/// kind the deny cache answers for, so a cached denial of one campaign would show as a refusal
/// of another.
const ONE_PER_CAMPAIGN: &str = policy!("one_per_campaign_per_recipient_in_30_days");

/// At most three messages per campaign in an hour, whoever receives them.
const CAMPAIGN_TOTAL: &str = policy!("three_per_campaign_an_hour");

/// A request to `recipient` with `attributes` (a JSON object, or `None` for none).
fn with_attributes(
    id: &str,
    recipient: &str,
    attributes: Option<serde_json::Value>,
) -> serde_json::Value {
    let mut body = request(id, recipient, "UTC");
    if let Some(attributes) = attributes {
        body["attributes"] = attributes;
    }
    body
}

fn campaign(id: &str, recipient: &str, name: &str) -> serde_json::Value {
    with_attributes(id, recipient, Some(serde_json::json!({"campaign": name})))
}

#[tokio::test]
async fn bad_attributes_go_to_the_invalid_queue_with_a_reason_naming_the_key() {
    let mut env = TestEnv::new().await;
    env.start_worker(&ManualClock::new(local("UTC", "2026-02-02 09:00")));
    let base = r#""id":"bad","recipient":"alice","channel":"sms""#;
    let grammar = "a name is one or more words of letters, digits, `_` and `-` joined by single \
                   dots, such as `sms` or `push.ios`";
    let seventeen: Vec<String> = (0..17).map(|i| format!(r#""k{i}":"v""#)).collect();
    let long_key = "k".repeat(65);
    let table: Vec<(String, String)> = vec![
        (
            r#"["spring"]"#.into(),
            "must be an object of string values, got an array".into(),
        ),
        (
            r#""spring""#.into(),
            "must be an object of string values, got a string".into(),
        ),
        (
            r#"{"campaign":{"id":"x"}}"#.into(),
            r#"value of key "campaign" must be a string, got an object"#.into(),
        ),
        (
            r#"{"campaign":["x"]}"#.into(),
            r#"value of key "campaign" must be a string, got an array"#.into(),
        ),
        (
            r#"{"campaign":7}"#.into(),
            r#"value of key "campaign" must be a string, got a number"#.into(),
        ),
        (
            r#"{"campaign":true}"#.into(),
            r#"value of key "campaign" must be a string, got a boolean"#.into(),
        ),
        (
            r#"{"campaign":""}"#.into(),
            r#"value of key "campaign" is empty"#.into(),
        ),
        (
            format!(r#"{{"campaign":"{}"}}"#, "v".repeat(129)),
            r#"value of key "campaign" is 129 characters, more than the limit of 128"#.into(),
        ),
        (
            r#"{"campaign":"a\u0007b"}"#.into(),
            r#"value of key "campaign" contains a control character"#.into(),
        ),
        (
            r#"{"campaign":"a\u202eb"}"#.into(),
            r#"value of key "campaign" contains U+202E, a format character or line separator"#
                .into(),
        ),
        (
            r#"{"camp aign":"x"}"#.into(),
            format!(r#"key "camp aign" holds U+0020: {grammar}"#),
        ),
        (
            r#"{"":"x"}"#.into(),
            format!(r#"key "" has an empty word (a leading, trailing or doubled dot): {grammar}"#),
        ),
        (
            format!(r#"{{"{long_key}":"x"}}"#),
            format!(
                r#"key "{}..." is 65 characters, more than the limit of 64"#,
                &long_key[..40]
            ),
        ),
        (
            r#"{"campaign":"a","campaign":"b"}"#.into(),
            r#"key "campaign" appears more than once"#.into(),
        ),
        (
            format!("{{{}}}", seventeen.join(",")),
            "has 17 entries, more than the limit of 16".into(),
        ),
        (
            r#"{"campaign":"\ud800"}"#.into(),
            r"lone surrogate \ud800 in a string is not valid Unicode".into(),
        ),
    ];
    let mut expected = HashMap::new();
    for (attributes, reason) in &table {
        let body = format!("{{{base},\"attributes\":{attributes}}}");
        env.publish_raw(body.as_bytes()).await;
        expected.insert(body, format!("field `attributes`: {reason}"));
    }
    // A typo of the field stays an unknown field.
    let typo = format!("{{{base},\"attribute\":{{\"campaign\":\"x\"}}}}");
    env.publish_raw(typo.as_bytes()).await;
    // None of them took alice's day (the headline rule): this one is dispatched, and carries
    // attributes at their limits.
    let mut full: serde_json::Map<String, serde_json::Value> = (0..15)
        .map(|i| (format!("k.{i}"), "\u{e9}".repeat(128).into()))
        .collect();
    full.insert("k".repeat(64), "x".into());
    env.publish(&with_attributes("valid", "alice", Some(full.into())))
        .await;
    let mut seen = HashMap::new();
    assert!(env.outcome("valid", &mut seen).await, "no quota was taken");
    env.stop_worker().await;
    let mut reasons = HashMap::new();
    for m in env.drain(&env.names.invalid).await {
        let reason =
            broker::header(&m.delivery.properties, broker::REASON_HEADER).expect("reason header");
        reasons.insert(String::from_utf8(m.delivery.data).expect("utf-8"), reason);
    }
    let typo_reason = reasons.remove(&typo).expect("the typo was refused");
    assert!(
        typo_reason.contains("unknown field \"attribute\""),
        "{typo_reason}"
    );
    assert_eq!(reasons, expected);
    assert!(env.denials().await.is_empty());
}

/// Two campaigns to one recipient, several messages each and a copy of one, published back to
/// back (all in flight at once at the default prefetch): each campaign gets exactly its first
/// message dispatched, the others are denied by the rule with their attributes in the row, and
/// messages without a campaign are not counted by it. Before the deny cache left rules
/// counting per attributes alone, b-1 was refused from a2's cached denial.
#[tokio::test]
async fn one_per_campaign_admits_each_campaigns_first_message_to_a_recipient() {
    let mut env = TestEnv::with_config(ONE_PER_CAMPAIGN).await;
    env.start_worker(&ManualClock::new(local("UTC", "2026-02-02 09:00")));
    let order = [
        ("a-1", Some("a")),
        ("a-1", Some("a")),
        ("a-2", Some("a")),
        ("b-1", Some("b")),
        ("a-3", Some("a")),
        ("b-2", Some("b")),
        ("n-1", None),
        ("b-3", Some("b")),
        ("n-2", None),
    ];
    for (id, name) in order {
        let attributes = name.map(|n| serde_json::json!({"campaign": n, "step": id}));
        env.publish(&with_attributes(id, "alice", attributes)).await;
    }
    let mut seen = HashMap::new();
    let mut dispatched = Vec::new();
    for id in ["a-1", "a-2", "b-1", "a-3", "b-2", "n-1", "b-3", "n-2"] {
        if env.outcome(id, &mut seen).await {
            dispatched.push(id);
        }
    }
    env.stop_worker().await;
    for d in env.take_dispatched().await {
        *seen.entry(d).or_default() += 1;
    }
    assert_eq!(dispatched, ["a-1", "b-1", "n-1", "n-2"]);
    assert_eq!(
        seen.get("a-1"),
        Some(&1),
        "the copy of a-1 was not dispatched again"
    );
    let denials = env.denials().await;
    let mut denied: Vec<(&str, &str)> = denials
        .iter()
        .map(|d| (d.row.message_id.as_str(), d.row.rule.as_str()))
        .collect();
    denied.sort_unstable();
    assert_eq!(
        denied,
        [
            ("a-2", "one-per-campaign"),
            ("a-3", "one-per-campaign"),
            ("b-2", "one-per-campaign"),
            ("b-3", "one-per-campaign"),
        ]
    );
    for d in &denials {
        let stored = d.row.message.value();
        let name = &d.row.message_id[..1];
        assert_eq!(
            stored["attributes"],
            serde_json::json!({"campaign": name, "step": d.row.message_id}),
            "the denial keeps the attributes"
        );
    }
    // `check` explains: campaign a is spent, c is not, and without a campaign the rule does
    // not apply.
    let check =
        |message: serde_json::Value| env.check(ONE_PER_CAMPAIGN, "2026-02-03T09:00:00Z", &message);
    let spent = check(campaign("a-9", "alice", "a"));
    assert_eq!(
        (spent["outcome"].as_str(), spent["rule"].as_str()),
        (Some("deny"), Some("one-per-campaign"))
    );
    assert_eq!(spent.get("not_matched"), None);
    let fresh = check(campaign("c-1", "alice", "c"));
    assert_eq!(fresh["outcome"], "allow");
    assert_eq!(fresh["rules"][0]["rule"], "one-per-campaign");
    let none = check(with_attributes(
        "x-1",
        "alice",
        Some(serde_json::json!({"step": "1"})),
    ));
    assert_eq!(none["outcome"], "allow");
    assert_eq!(none["rules"], serde_json::json!([]));
    assert_eq!(
        none["not_matched"],
        serde_json::json!([{"rule": "one-per-campaign", "missing_attributes": ["campaign"]}])
    );
}

/// Publishes campaign `a` to six recipients and campaign `b` to two, back to back, under the
/// one-per-campaign and campaign-total rules, and checks: three of `a` are dispatched, three
/// denied by campaign-total, whose recipient quota was given back (refund across hash tags);
/// both of `b` are dispatched; every key of the global rule is under its campaign's own tag.
async fn global_cap_per_campaign(mut env: TestEnv) {
    env.start_worker(&ManualClock::new(local("UTC", "2026-04-01 09:00")));
    let mut ids = Vec::new();
    for r in 0..6 {
        let id = format!("a-{r}");
        env.publish(&campaign(&id, &format!("user-{r}"), "a")).await;
        ids.push(id);
    }
    for r in 0..2 {
        let id = format!("b-{r}");
        env.publish(&campaign(&id, &format!("user-{r}"), "b")).await;
        ids.push(id);
    }
    let mut seen = HashMap::new();
    let mut sent = Vec::new();
    for id in &ids {
        if env.outcome(id, &mut seen).await {
            sent.push(id.clone());
        }
    }
    env.stop_worker().await;
    let sent_a: Vec<&String> = sent.iter().filter(|id| id.starts_with("a-")).collect();
    assert_eq!(
        sent_a.len(),
        3,
        "campaign-total admits three of a: {sent:?}"
    );
    assert!(
        sent.contains(&"b-0".to_owned()) && sent.contains(&"b-1".to_owned()),
        "{sent:?}"
    );
    let denials = env.denials().await;
    assert_eq!(denials.len(), 3);
    assert!(
        denials.iter().all(|d| d.row.rule == "campaign-total"),
        "{denials:?}"
    );
    let keys = env.keys().await;
    let per_recipient: Vec<&String> = keys
        .iter()
        .filter(|k| k.ends_with(":one-per-campaign:calendar_quota:campaign=a"))
        .collect();
    assert_eq!(
        per_recipient.len(),
        3,
        "the refused were refunded: {keys:?}"
    );
    for tag in ["{a:campaign=a}", "{a:campaign=b}"] {
        let key = format!("{}:{tag}:campaign-total:fixed_window", env.namespace);
        assert!(keys.contains(&key), "{key} in {keys:?}");
    }
    assert_eq!(env.keys_without_expiry().await, Vec::<String>::new());
}

#[tokio::test]
async fn a_global_cap_per_campaign_counts_each_campaign_across_recipients() {
    let config = format!("{ONE_PER_CAMPAIGN}\n{CAMPAIGN_TOTAL}");
    global_cap_per_campaign(TestEnv::with_config(&config).await).await;
}

#[tokio::test]
async fn a_global_cap_per_campaign_counts_each_campaign_on_a_redis_cluster() {
    let config = format!("{ONE_PER_CAMPAIGN}\n{CAMPAIGN_TOTAL}");
    global_cap_per_campaign(TestEnv::on_cluster(&config).await).await;
}
