//! `sendquota check --at T` asks what a decision at T would be: it counts only the sends that
//! lie in T's windows, not the sends made after them (issue 38, item 6: after the README's
//! example ran on 2026-11-28, a check at 2026-05-01 was denied by the November send). Sends are
//! placed after T with `check --commit --at` a later instant, as an operator can, and every
//! counting kind is asked at T through the binary.

use crate::support;

use serde_json::{json, Value};
use support::fixtures::policy;
use support::TestEnv;

/// One rule of each counting kind, each allowing one send in the hour (the calendar quota the
/// headline rule: one a local day, three in seven), named after its kind.
const ONE_EACH: &str = policy!("one_an_hour_of_each_counting_kind");

/// `check --commit` of `message` at `at`, which must admit it under `config`.
fn commit(env: &TestEnv, config: &str, at: &str, message: &Value) {
    let out = env
        .cli_with(
            config,
            &[
                "check",
                "--commit",
                "--at",
                at,
                "--message",
                &message.to_string(),
            ],
        )
        .output()
        .expect("run check --commit");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_slice(&out.stdout).expect("check prints JSON");
    assert_eq!(
        report["outcome"], "allow",
        "placing a send at {at}: {report}"
    );
}

/// Each rule's (allowed, remaining) in a report, by rule name.
fn verdicts(report: &Value) -> Vec<(String, bool, i64)> {
    report["rules"]
        .as_array()
        .expect("rules")
        .iter()
        .map(|r| {
            (
                r["rule"].as_str().expect("rule").to_owned(),
                r["allowed"].as_bool().expect("allowed"),
                r["remaining"].as_i64().expect("remaining"),
            )
        })
        .collect()
}

fn all(allowed: bool, remaining: [i64; 6]) -> Vec<(String, bool, i64)> {
    [
        "calendar_quota",
        "fixed_window",
        "sliding_window_hash",
        "sliding_window_list",
        "sliding_log",
        "zset_window",
    ]
    .into_iter()
    .zip(remaining)
    .map(|(rule, remaining)| (rule.to_owned(), allowed, remaining))
    .collect()
}

#[tokio::test]
async fn a_check_at_an_earlier_instant_counts_none_of_the_sends_made_after_its_windows() {
    let env = TestEnv::new().await;
    let alice = |id: &str| support::request(id, "alice", "UTC");
    commit(&env, ONE_EACH, "2026-11-28T09:00:00Z", &alice("m-1"));

    // Months before, and the day before: the November send lies in none of their windows.
    for at in ["2026-05-01T09:00:00Z", "2026-11-27T09:00:00Z"] {
        let report = env.check(ONE_EACH, at, &alice("m-2"));
        assert_eq!(
            (&report["outcome"], &report["retry_after"]),
            (&json!("allow"), &Value::Null),
            "at {at}: {report}"
        );
        // The calendar quota's remaining is the day's (one a day, this send included).
        assert_eq!(verdicts(&report), all(true, [0, 0, 0, 0, 0, 0]), "at {at}");
    }

    // Half an hour before it, on its day: the day's count ends with the day, so the calendar
    // quota counts the later send; the hour's windows before 09:00 do not hold it.
    let report = env.check(ONE_EACH, "2026-11-28T08:30:00Z", &alice("m-2"));
    let mut expected = all(true, [0, 0, 0, 0, 0, 0]);
    expected[0].1 = false;
    assert_eq!(verdicts(&report), expected, "{report}");
    assert_eq!(report["rule"], "calendar_quota", "{report}");

    // After it, every rule counts it, as before.
    let report = env.check(ONE_EACH, "2026-11-28T09:30:00Z", &alice("m-2"));
    assert_eq!(
        verdicts(&report),
        all(false, [0, 0, 0, 0, 0, 0]),
        "{report}"
    );
}

/// The README's example: m-1 dispatched to user-42 on 2026-11-28 (Asia/Shanghai), then
/// `check` of m-3 (no zone: UTC) at a May morning and on the day before.
#[tokio::test]
async fn the_readme_check_at_a_may_morning_is_allowed_after_a_november_send() {
    let env = TestEnv::new().await;
    let sent = json!({"id": "m-1", "recipient": "user-42", "channel": "sms",
                      "timezone": "Asia/Shanghai"});
    commit(&env, "", "2026-11-28T09:00:00Z", &sent);
    let asked = json!({"id": "m-3", "recipient": "user-42", "channel": "sms"});
    for at in ["2026-05-01T09:00:00Z", "2026-11-27T09:00:00Z"] {
        let report = env.check("", at, &asked);
        assert_eq!(
            (&report["outcome"], &report["rule"], &report["retry_after"]),
            (&json!("allow"), &Value::Null, &Value::Null),
            "at {at}: {report}"
        );
    }
    let report = env.check("", "2026-11-28T10:00:00Z", &asked);
    assert_eq!(report["outcome"], "deny", "the same day: {report}");
}
