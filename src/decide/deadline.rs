//! Deadlines: a message past its deadline is never sent.
//!
//! A message's deadline is the earliest of its `expires_at` (the producer's) and, for each
//! `delay` rule with a `max_delay` that refused it, the instant the worker first received it
//! plus that `max_delay`. The instant of first receipt and the deadline set so far travel with
//! the message whenever the worker republishes it (a delay, a wait for a copy in flight, a
//! yielded slot) in two headers ([`Receipt`]), so a delay round trip does not restart the
//! clock; a replay carries the deadline its denial row kept.
//!
//! Where it is checked, in this order, by the functions here (pure; the pipeline, `check`,
//! `POST /v1/check` and the digest to come call them):
//! - before the rules are asked ([`before_decision`]): a message already past its deadline
//!   takes no quota; it is recorded as expired;
//! - once they have answered ([`enforce`]): a delay whose end is at or past the deadline is
//!   not parked (the message could never be sent), it is recorded as expired at once.
//!
//! A deny whose `retry_after` lies past the deadline stays a deny; its row keeps the deadline
//! (column `expires_at`) so that `replay` skips it once the deadline has passed.

use chrono::{DateTime, Duration, Utc};

use crate::decide::outcome::{Outcome, Verdict};
use crate::request::message::SendRequest;
use crate::rules::policy::{OnDeny, Policy};

/// The rule an expired row is recorded under when no rule held the message: its deadline had
/// passed before its rules were asked. Rule names may be `deadline` too; the kind, also
/// `deadline`, tells such a row apart.
pub const DEADLINE_RULE: &str = "deadline";

/// The reason of every expired row, whichever rule it is recorded under.
pub const EXPIRED_REASON: &str = "expired";

/// What the worker knows of a delivery beyond its body: when it first received the message,
/// the deadline delay rules with a `max_delay` have set so far, and the denial it replays. A
/// message the worker has not republished has none of these: it is first received now. Read
/// from the delivery's headers once, at intake (`broker::receipt`); a plain value here, so
/// that deciding never reads the broker's properties.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Receipt {
    /// When the worker first received the message.
    pub first_received: DateTime<Utc>,
    /// The message's deadline as the worker last set it: when it parked the message (the
    /// `max_delay` of the delay rules that refused it, and its `expires_at`), or as a replay
    /// carries it from its denial row; `None` when none was set.
    pub held_until: Option<DateTime<Utc>>,
    /// The denial row this delivery replays (`sendquota replay`), carried on whenever it is
    /// republished and written on its own denial rows.
    pub replay_of: Option<i64>,
}

impl Receipt {
    /// A message received for the first time at `now` (and what `check` decides).
    pub fn new(now: DateTime<Utc>) -> Receipt {
        Receipt {
            first_received: now,
            held_until: None,
            replay_of: None,
        }
    }

    /// The message's deadline before its rules are asked: the earliest of its `expires_at` and
    /// the deadline carried so far.
    pub fn deadline(&self, message: &SendRequest) -> Option<DateTime<Utc>> {
        earliest(message.expires_at.as_ref().map(|e| e.at()), self.held_until)
    }

    /// The message's deadline once its rules have answered: [`Receipt::deadline`], and for
    /// each refusing `delay` rule with a `max_delay`, the first receipt plus it.
    pub fn deadline_after(
        &self,
        message: &SendRequest,
        policy: &Policy,
        verdicts: &[Verdict],
    ) -> Option<DateTime<Utc>> {
        verdicts
            .iter()
            .filter(|v| !v.allowed && v.on_deny == OnDeny::Delay)
            .filter_map(|v| policy.rules.iter().find(|r| r.name == v.rule)?.max_delay)
            .filter_map(|ms| {
                self.first_received
                    .checked_add_signed(Duration::milliseconds(ms))
            })
            .fold(self.deadline(message), |deadline, at| {
                earliest(deadline, Some(at))
            })
    }
}

/// Whether a message whose deadline is `deadline` is past it at `now`: the one test, so every
/// path (decision, delay, digest) draws the line at the same instant. At the deadline itself
/// it is past.
pub fn passed(deadline: Option<DateTime<Utc>>, now: DateTime<Utc>) -> bool {
    deadline.is_some_and(|at| now >= at)
}

/// The outcome of a message already past its deadline at `now`, before any rule is asked;
/// `None` when it may still be decided.
pub fn before_decision(
    message: &SendRequest,
    receipt: &Receipt,
    now: DateTime<Utc>,
) -> Option<Outcome> {
    let deadline = receipt.deadline(message)?;
    passed(Some(deadline), now).then_some(Outcome::Expired {
        rule: None,
        deadline,
    })
}

/// `outcome` held to `deadline`: a delay that would end at or past it becomes
/// [`Outcome::Expired`] under the delaying rule, since the message could never be sent after
/// it. Other outcomes are kept.
pub fn enforce(outcome: Outcome, deadline: Option<DateTime<Utc>>) -> Outcome {
    match (outcome, deadline) {
        (Outcome::Delay { rule, until }, Some(deadline)) if passed(Some(deadline), until) => {
            Outcome::Expired {
                rule: Some(rule),
                deadline,
            }
        }
        (outcome, _) => outcome,
    }
}

fn earliest(a: Option<DateTime<Utc>>, b: Option<DateTime<Utc>>) -> Option<DateTime<Utc>> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::message::DEFAULT_MAX_BODY_BYTES;

    fn at(text: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(text)
            .expect("an instant")
            .with_timezone(&Utc)
    }

    fn message(expires_at: Option<&str>) -> SendRequest {
        let mut body = serde_json::json!({"id": "m", "recipient": "u", "channel": "sms"});
        if let Some(e) = expires_at {
            body["expires_at"] = e.into();
        }
        SendRequest::decode(body.to_string().as_bytes(), DEFAULT_MAX_BODY_BYTES).expect("valid")
    }

    fn policy(max_delay: &str) -> Policy {
        crate::base::config::Settings::from_toml(
            &format!(
                "[[rules]]\nname = \"pace\"\nkind = \"gcra\"\nrate = 1\nperiod = \"1h\"\n\
                 on_deny = \"delay\"\nmax_delay = \"{max_delay}\"\n\
                 [[rules]]\nname = \"slow\"\nkind = \"gcra\"\nrate = 1\nperiod = \"1d\"\n\
                 on_deny = \"delay\"\n"
            ),
            |_| None,
        )
        .expect("valid")
        .policy
    }

    fn refusal(rule: &str, until: &str) -> Verdict {
        Verdict {
            rule: rule.to_owned(),
            kind: "gcra",
            on_deny: OnDeny::Delay,
            exempt: false,
            reserved_until: None,
            allowed: false,
            already: false,
            remaining: Some(0),
            retry_after: Some(at(until)),
            reason: String::new(),
        }
    }

    #[test]
    fn the_deadline_is_the_earliest_of_expires_at_the_carried_one_and_each_max_delay() {
        let received = Receipt::new(at("2026-05-01T09:00:00Z"));
        let policy = policy("2h");
        let pace = [refusal("pace", "2026-05-01T12:00:00Z")];
        assert_eq!(received.deadline(&message(None)), None);
        assert_eq!(
            received.deadline_after(&message(None), &policy, &pace),
            Some(at("2026-05-01T11:00:00Z")),
            "first receipt + max_delay"
        );
        assert_eq!(
            received.deadline_after(&message(Some("2026-05-01T10:00:00+01:00")), &policy, &pace),
            Some(at("2026-05-01T09:00:00Z")),
            "expires_at, earlier"
        );
        let slow = [refusal("slow", "2026-05-02T09:00:00Z")];
        assert_eq!(
            received.deadline_after(&message(None), &policy, &slow),
            None,
            "a delay rule without max_delay sets no deadline"
        );
        let carried = Receipt {
            held_until: Some(at("2026-05-01T10:30:00Z")),
            ..received
        };
        assert_eq!(
            carried.deadline_after(&message(None), &policy, &pace),
            Some(at("2026-05-01T10:30:00Z")),
            "a deadline an earlier delay set still holds"
        );
    }

    #[test]
    fn a_message_is_past_its_deadline_from_the_deadline_on() {
        let deadline = Some(at("2026-05-01T09:00:00Z"));
        assert!(!passed(deadline, at("2026-05-01T08:59:59.999Z")));
        assert!(passed(deadline, at("2026-05-01T09:00:00Z")));
        assert!(!passed(None, at("8999-01-01T00:00:00Z")));
        let m = message(Some("2026-05-01T09:00:00Z"));
        let receipt = Receipt::new(at("2026-05-01T09:00:00Z"));
        assert_eq!(
            before_decision(&m, &receipt, at("2026-05-01T09:00:00Z")),
            Some(Outcome::Expired {
                rule: None,
                deadline: at("2026-05-01T09:00:00Z")
            })
        );
        assert_eq!(
            before_decision(&m, &receipt, at("2026-05-01T08:00:00Z")),
            None
        );
    }

    #[test]
    fn a_delay_ending_at_or_past_the_deadline_expires_and_an_earlier_one_is_kept() {
        let delay = |until: &str| Outcome::Delay {
            rule: refusal("pace", until),
            until: at(until),
        };
        let deadline = Some(at("2026-05-01T11:00:00Z"));
        assert_eq!(
            enforce(delay("2026-05-01T10:59:59Z"), deadline),
            delay("2026-05-01T10:59:59Z")
        );
        assert_eq!(
            enforce(delay("2026-05-01T11:00:00Z"), deadline),
            Outcome::Expired {
                rule: Some(refusal("pace", "2026-05-01T11:00:00Z")),
                deadline: at("2026-05-01T11:00:00Z")
            }
        );
        let deny = Outcome::Deny {
            rule: refusal("pace", "2026-05-02T00:00:00Z"),
            retry_after: Some(at("2026-05-02T00:00:00Z")),
        };
        assert_eq!(enforce(deny.clone(), deadline), deny, "a deny stays a deny");
    }
}
