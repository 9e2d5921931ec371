//! The one place an outcome is made: from the policy, the request, its receipt and every
//! rule's verdict to what happens to the message ([`decide`]), and, before any rule is asked,
//! whether it is already past its deadline ([`before_rules`]). Pure: no I/O, no clock; the
//! limiter produces the verdicts, the worker, the digest flusher, `check` and `POST /v1/check`
//! call these same functions, so they cannot tell a message different outcomes or instants.

use chrono::{DateTime, Utc};

use crate::decide::deadline::{self, Receipt};
use crate::decide::outcome::{Outcome, OutcomeName, Verdict};
use crate::request::message::SendRequest;
use crate::rules::kinds::Kind;
use crate::rules::policy::{OnDeny, Policy};

/// What deciding a message came to: its outcome, and the deadline it is held to (the one the
/// denial row, the delay queue's headers and a digest item keep).
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// What happens to the message.
    pub outcome: Outcome,
    /// The instant past which it is never sent, if it has one (see [`crate::decide::deadline`]).
    pub deadline: Option<DateTime<Utc>>,
}

/// The decision on `message` when it is already past its deadline at `now`, before any rule
/// is asked (so it takes no quota and no claim): [`Outcome::Expired`]; `None` when its rules
/// must decide it.
pub fn before_rules(
    message: &SendRequest,
    receipt: &Receipt,
    now: DateTime<Utc>,
) -> Option<Decision> {
    let outcome = deadline::before_decision(message, receipt, now)?;
    Some(Decision {
        outcome,
        deadline: receipt.deadline(message),
    })
}

/// Decides `message` from its rules' `verdicts` (in policy order): [`by_verdicts`], with a
/// denial's `retry_after` and a delay's end moved past the closed periods of the wall-clock
/// rules matching it ([`admissible_after`]: a rule that admits now can refuse then), and a
/// delay that would outlast the message's deadline (from `receipt` and the refusing delay
/// rules' `max_delay`) made [`Outcome::Expired`].
pub fn decide(
    policy: &Policy,
    message: &SendRequest,
    receipt: &Receipt,
    verdicts: &[Verdict],
) -> Decision {
    let deadline = receipt.deadline_after(message, policy, verdicts);
    let outcome = by_verdicts(verdicts).postponed(|t| admissible_after(policy, message, t));
    Decision {
        outcome: deadline::enforce(outcome, deadline),
        deadline,
    }
}

/// The first instant at or after `t` that no enforcing rule matching `message` that refuses
/// by the wall clock (quiet hours, send windows) keeps closed, in the message's zone. Counting
/// rules only free up as time passes (when nothing else is sent meanwhile), so past the
/// refusing rules' `retry_after` the closed periods are what can still refuse.
pub fn admissible_after(
    policy: &Policy,
    message: &SendRequest,
    mut t: DateTime<Utc>,
) -> DateTime<Utc> {
    let zone = message.zone(policy.default_zone);
    let clock: Vec<&Kind> = policy
        .rules_for(message)
        .into_iter()
        .filter(|r| r.on_deny != OnDeny::Shadow)
        .filter(|r| matches!(r.kind, Kind::QuietHours(_) | Kind::SendWindow(_)))
        .map(|r| &r.kind)
        .collect();
    // Each step leaves a closed period; a quiet period and a send window can hand the
    // message back and forth a few times at most.
    for _ in 0..=2 * clock.len() {
        let ends = clock.iter().filter_map(|k| k.closed_until(t, zone)).max();
        match ends {
            Some(end) => t = end,
            None => break,
        }
    }
    t
}

/// The outcome the verdicts of every rule that applies (in policy order) make by themselves,
/// before the wall clock and the deadline have their say (see [`decide`]).
pub fn by_verdicts(verdicts: &[Verdict]) -> Outcome {
    let refusals = || verdicts.iter().filter(|v| !v.allowed && !v.exempt);
    let latest = |on_deny: &dyn Fn(OnDeny) -> bool| {
        refusals()
            .filter(|v| on_deny(v.on_deny))
            .filter_map(|v| v.retry_after)
            .max()
    };
    if let Some(first) = refusals().find(|v| v.on_deny == OnDeny::Drop) {
        return Outcome::Deny {
            rule: first.clone(),
            retry_after: latest(&|d| d != OnDeny::Shadow),
        };
    }
    // Held like a drop rule's refusal is recorded: a delay rule would only hold it again.
    if let Some(first) = refusals().find(|v| v.on_deny == OnDeny::Digest) {
        return Outcome::Digest {
            rule: first.clone(),
        };
    }
    let delayed = refusals()
        .filter(|v| v.on_deny == OnDeny::Delay)
        .max_by_key(|v| v.retry_after);
    if let Some(rule) = delayed {
        return match rule.retry_after {
            Some(until) => Outcome::Delay {
                rule: rule.clone(),
                until,
            },
            // A refusal that cannot say when it ends cannot be waited for: deny instead.
            None => Outcome::Deny {
                rule: rule.clone(),
                retry_after: None,
            },
        };
    }
    Outcome::Allow {
        shadow_refusals: refusals().cloned().collect(),
    }
}

/// Every rule's verdict and the outcome made of them, as `check` and `POST /v1/check` print
/// them.
pub fn report(verdicts: &[Verdict], outcome: &Outcome) -> serde_json::Value {
    serde_json::json!({
        "outcome": outcome.name(),
        "rule": outcome.rule().map(|v| v.rule.clone()),
        "retry_after": outcome.retry_after().map(rfc3339),
        "rules": rules_report(verdicts),
    })
}

/// `report` (of [`report`] or [`duplicate_report`]) with, when there are some, the rules that
/// do not apply to `message` only because it lacks attributes they count per (`not_matched`:
/// each rule with its `missing_attributes`) or because they exempt its priority without
/// counting it (each rule with its `exempt_priority`), so that `check` says why a cap was not
/// met.
pub fn explain_unmatched(
    mut report: serde_json::Value,
    policy: &Policy,
    message: &SendRequest,
) -> serde_json::Value {
    let mut unmatched: Vec<serde_json::Value> = policy
        .unmatched_for_attributes(message)
        .into_iter()
        .map(
            |(rule, missing)| serde_json::json!({"rule": rule.name, "missing_attributes": missing}),
        )
        .collect();
    unmatched.extend(policy.exempting(message).into_iter().map(
        |rule| serde_json::json!({"rule": rule.name, "exempt_priority": message.priority.as_str()}),
    ));
    if !unmatched.is_empty() {
        report["not_matched"] = unmatched.into();
    }
    report
}

/// `report` with the message's `deadline` (see [`crate::decide::deadline`]), when it has one: the
/// instant past which it is not sent, which `check` shows beside an outcome `expired`.
pub fn explain_deadline(
    mut report: serde_json::Value,
    deadline: Option<DateTime<Utc>>,
) -> serde_json::Value {
    if let Some(deadline) = deadline {
        report["deadline"] = rfc3339(deadline).into();
    }
    report
}

/// `report` with what the worker does with `message` while Redis is unavailable
/// (`on_unavailable`: `allow`, dispatched unchecked, or `wait`), when some rule matching it
/// sets `on_unavailable = "allow"` (see [`Policy::on_unavailable`]): said only where a rule
/// changed it from waiting, as every message did before the option.
pub fn explain_unavailable(
    mut report: serde_json::Value,
    policy: &Policy,
    message: &SendRequest,
) -> serde_json::Value {
    if let Some(then) = policy.on_unavailable(message) {
        report["on_unavailable"] = serde_json::json!(then);
    }
    report
}

/// Each rule's verdict as [`report`] lists it: also what the quota route shows.
pub fn rules_report(verdicts: &[Verdict]) -> serde_json::Value {
    verdicts
        .iter()
        .map(|v| {
            let mut rule = serde_json::json!({
                "rule": v.rule,
                "kind": v.kind,
                "allowed": v.allowed,
                "remaining": v.remaining,
                "retry_after": v.retry_after.map(rfc3339),
            });
            // Said only where a priority changed what the rule did.
            if v.exempt {
                rule["exempt"] = true.into();
            }
            if let Some(until) = v.reserved_until {
                rule["reserved_until"] = rfc3339(until).into();
            }
            rule
        })
        .collect()
}

fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true)
}

/// The report of a message whose id was dispatched before: nothing was decided, so no outcome
/// of [`decide`] applies. Same fields as [`report`], for callers that print either.
pub fn duplicate_report() -> serde_json::Value {
    serde_json::json!({"outcome": OutcomeName::Duplicate, "rule": null, "retry_after": null, "rules": []})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn verdict(rule: &str, on_deny: OnDeny, allowed: bool, retry_hour: Option<u32>) -> Verdict {
        Verdict {
            rule: rule.to_owned(),
            kind: "calendar_quota",
            on_deny,
            exempt: false,
            reserved_until: None,
            allowed,
            already: false,
            remaining: Some(0),
            reason: String::new(),
            retry_after: retry_hour.map(|h| format!("2026-01-01T{h:02}:00:00Z").parse().unwrap()),
        }
    }

    #[test]
    fn all_allowed_is_allow() {
        let v = [verdict("a", OnDeny::Drop, true, None)];
        assert_eq!(by_verdicts(&v).name(), OutcomeName::Allow);
    }

    #[test]
    fn a_drop_refusal_wins_over_delay_and_waits_for_the_latest_rule() {
        let v = [
            verdict("d", OnDeny::Delay, false, Some(9)),
            verdict("x", OnDeny::Drop, false, Some(5)),
            verdict("s", OnDeny::Shadow, false, Some(23)),
        ];
        match by_verdicts(&v) {
            Outcome::Deny { rule, retry_after } => {
                assert_eq!(rule.rule, "x");
                assert_eq!(retry_after, v[0].retry_after);
            }
            other => panic!("expected deny, got {other:?}"),
        }
    }

    #[test]
    fn only_delay_refusals_delay_until_the_latest() {
        let v = [
            verdict("d1", OnDeny::Delay, false, Some(3)),
            verdict("d2", OnDeny::Delay, false, Some(4)),
            verdict("ok", OnDeny::Drop, true, None),
        ];
        assert_eq!(by_verdicts(&v).retry_after(), v[1].retry_after);
        assert_eq!(by_verdicts(&v).rule().map(|r| r.rule.as_str()), Some("d2"));
    }

    #[test]
    fn a_digest_refusal_holds_unless_a_drop_rule_refuses_too() {
        let held = [
            verdict("d", OnDeny::Delay, false, Some(9)),
            verdict("g", OnDeny::Digest, false, Some(5)),
        ];
        let outcome = by_verdicts(&held);
        assert_eq!(outcome.name(), OutcomeName::Digested);
        assert_eq!(outcome.rule().map(|r| r.rule.as_str()), Some("g"));
        let dropped = [
            verdict("g", OnDeny::Digest, false, Some(5)),
            verdict("x", OnDeny::Drop, false, Some(7)),
        ];
        assert_eq!(by_verdicts(&dropped).name(), OutcomeName::Deny);
    }

    #[test]
    fn shadow_refusals_alone_dispatch_as_shadow() {
        let v = [
            verdict("ok", OnDeny::Drop, true, None),
            verdict("trial", OnDeny::Shadow, false, Some(1)),
        ];
        let outcome = by_verdicts(&v);
        assert_eq!(outcome.name(), OutcomeName::Shadow);
        assert_eq!(outcome.rule().map(|r| r.rule.as_str()), Some("trial"));
    }
}
