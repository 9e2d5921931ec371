//! What operators read from a real worker besides its metrics: JSON log lines, each decision
//! with its message id, recipient (hashed, by setting), rule and outcome.

use std::time::Duration;

use hmac::{KeyInit, Mac};
use sendquota::internals::telemetry::DECISION_LOG;
use serde_json::Value;

use crate::support::process::Running;
use crate::support::TestEnv;

const RECIPIENT_KEY: &str = "log-test-key-0123456789";

/// HMAC-SHA256 of `recipient` under [`RECIPIENT_KEY`], in hex, as an operator computes it
/// (`printf %s alice | openssl dgst -sha256 -hmac KEY`).
fn hashed(recipient: &str) -> String {
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(RECIPIENT_KEY.as_bytes())
        .expect("any key length");
    mac.update(recipient.as_bytes());
    mac.finalize()
        .into_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[tokio::test]
async fn json_logs_are_one_object_per_line_and_each_decision_names_message_recipient_rule_and_outcome(
) {
    let env = TestEnv::new().await;
    let mut cmd = env.cli_with(
        "[log]\nrecipient = \"hash\"\n",
        &["worker", "--now", "2026-02-02T09:00:00Z"],
    );
    cmd.env("SENDQUOTA_LOG_FORMAT", "json")
        .env("SENDQUOTA_LOG", "info,lapin=off,sendquota::decisions=debug")
        .env("SENDQUOTA_LOG_RECIPIENT_KEY", RECIPIENT_KEY);
    let worker = Running::spawn(cmd);
    env.publish_allowed_denied_invalid().await;
    let decided = |lines: &[String]| lines.iter().filter(|l| l.contains(DECISION_LOG)).count() >= 3;
    worker
        .wait_for("three decision logs", Duration::from_secs(10), decided)
        .await;
    let lines = worker.stop();
    let objects: Vec<Value> = lines
        .iter()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON object ({e}): {l}")))
        .collect();
    assert!(objects.iter().all(Value::is_object), "{lines:#?}");
    assert!(
        objects.iter().any(|o| o["message"] == "consuming"),
        "the worker's own lines are JSON too: {lines:#?}"
    );
    let decision = |id: &str| {
        objects
            .iter()
            .find(|o| o["target"] == DECISION_LOG && o["message_id"] == id)
            .unwrap_or_else(|| panic!("no decision log for {id} in {lines:#?}"))
    };
    let allowed = decision("allowed");
    assert_eq!(allowed["level"], "DEBUG");
    assert_eq!(allowed["outcome"], "allow");
    assert_eq!(allowed["recipient"], hashed("alice").as_str());
    assert_eq!(
        (&allowed["channel"], &allowed["category"]),
        (&Value::from("sms"), &Value::from("default"))
    );
    assert_eq!(
        allowed["rule"],
        Value::Null,
        "no rule decided an allowed message"
    );
    let denied = decision("denied");
    assert_eq!(denied["outcome"], "deny");
    assert_eq!(denied["rule"], "headline");
    assert_eq!(denied["recipient"], hashed("alice").as_str());
    let invalid = decision("invalid");
    assert_eq!(
        invalid["level"], "WARN",
        "an invalid body is a producer's bug"
    );
    assert_eq!(invalid["outcome"], "invalid");
    assert!(
        invalid["reason"]
            .as_str()
            .is_some_and(|r| r.starts_with("not a valid send request")),
        "{invalid}"
    );
    assert!(
        lines.iter().all(|l| !l.contains("alice")),
        "the recipient is only ever hashed: {lines:#?}"
    );
}
