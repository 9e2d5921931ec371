//! What became of a message, in one place: the one list of outcome names (as `check`, the API
//! and the `outcome` metric label spell them), what its rules' verdicts decided ([`Outcome`],
//! made by [`crate::decide::decision::decide`]), what a handled delivery came to ([`Handled`]), and
//! what the worker does after an attempt that failed. Pure: the pipeline produces these, the
//! worker acts on them (ack, retry, quarantine).

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::rules::policy::OnDeny;

/// One rule's verdict on one message.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Verdict {
    /// The rule's name.
    pub rule: String,
    /// The rule's kind.
    pub kind: &'static str,
    /// What the rule's refusal does.
    #[serde(skip)]
    pub on_deny: OnDeny,
    /// Whether the message's priority is exempt from the rule, which still counts it: its
    /// refusal (the rule had no room) neither holds the message back nor is recorded.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub exempt: bool,
    /// Until when the rule's last slots were kept from this message (its priority is below
    /// the reservation's): it was decided with them taken off.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reserved_until: Option<DateTime<Utc>>,
    /// Whether the rule admits the message.
    pub allowed: bool,
    /// Whether the message id had been admitted before (nothing consumed again).
    #[serde(skip)]
    pub already: bool,
    /// What the rule still allows after this decision (`None` for kinds that do not count,
    /// such as quiet hours).
    pub remaining: Option<i64>,
    /// When the rule would next admit a send; `None` when it admits this one, or when it never
    /// will (a cost above a bucket's capacity).
    pub retry_after: Option<DateTime<Utc>>,
    /// Why it refused (empty when it allowed).
    #[serde(skip)]
    pub reason: String,
}

/// Every outcome a message can have.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OutcomeName {
    /// Dispatched.
    Allow,
    /// Denied and recorded.
    Deny,
    /// Parked until retry_after.
    Delay,
    /// Dispatched, with would-be denials recorded.
    Shadow,
    /// Its id was dispatched before (a redelivery or a producer's retry): nothing done.
    Duplicate,
    /// Another delivery of its id is in flight: decided again once that one is done.
    InFlight,
    /// Not a valid request: sent to the invalid queue.
    Invalid,
    /// Past its deadline, or held by a delay past it: recorded as a denial (reason
    /// `expired`) and never sent. See [`crate::decide::deadline`].
    Expired,
    /// Dispatched without a decision: Redis was unavailable and every rule matching it has
    /// `on_unavailable = "allow"`; recorded as a row marked `unchecked`.
    Unchecked,
    /// Refused by a `digest` rule: held, to be sent with the others it holds to the recipient
    /// in one digest once the rule has room. See [`crate::act::digest`].
    Digested,
}

impl OutcomeName {
    /// Every outcome, for registering one metric series each.
    pub const ALL: [OutcomeName; 10] = [
        OutcomeName::Allow,
        OutcomeName::Deny,
        OutcomeName::Delay,
        OutcomeName::Shadow,
        OutcomeName::Duplicate,
        OutcomeName::InFlight,
        OutcomeName::Invalid,
        OutcomeName::Expired,
        OutcomeName::Unchecked,
        OutcomeName::Digested,
    ];

    /// The outcomes recorded under a rule (a denial row, or a row of a dispatch the rule let
    /// out): the console's rules page has a column for each. A new outcome of an `on_deny`
    /// action is added here, and the page follows.
    pub const RULES_MAKE: &'static [OutcomeName] = &[
        OutcomeName::Deny,
        OutcomeName::Delay,
        OutcomeName::Shadow,
        OutcomeName::Expired,
        OutcomeName::Digested,
        OutcomeName::Unchecked,
    ];

    /// The outcome's place in [`OutcomeName::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// The name as printed and used as a metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            OutcomeName::Allow => "allow",
            OutcomeName::Deny => "deny",
            OutcomeName::Delay => "delay",
            OutcomeName::Shadow => "shadow",
            OutcomeName::Duplicate => "duplicate",
            OutcomeName::InFlight => "in_flight",
            OutcomeName::Invalid => "invalid",
            OutcomeName::Expired => "expired",
            OutcomeName::Unchecked => "unchecked",
            OutcomeName::Digested => "digested",
        }
    }
}

/// What happens to a message, decided from its rules' verdicts.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Every enforcing rule allowed it: dispatch. Shadow rules that would have refused are
    /// listed so they can be recorded.
    Allow {
        /// Verdicts of shadow rules that refused.
        shadow_refusals: Vec<Verdict>,
    },
    /// A `drop` rule refused it: record the denial.
    Deny {
        /// The first refusing `drop` rule, in policy order: the rule the denial is recorded under.
        rule: Verdict,
        /// When every refusing rule would allow again (the latest of their `retry_after`).
        retry_after: Option<DateTime<Utc>>,
    },
    /// Only `delay` rules refused it: park it until they would allow.
    Delay {
        /// The refusing delay rule that allows last.
        rule: Verdict,
        /// When to decide again.
        until: DateTime<Utc>,
    },
    /// Past its deadline, or refused by delay rules until after it: record it as expired and
    /// never send it (made by [`crate::decide::deadline`]).
    Expired {
        /// The delay rule whose wait would outlast the deadline; `None` when the deadline had
        /// passed before any rule was asked.
        rule: Option<Verdict>,
        /// The deadline it reached or would pass.
        deadline: DateTime<Utc>,
    },
    /// A `digest` rule refused it and no `drop` rule did: hold it for the rule's next digest
    /// to the recipient.
    Digest {
        /// The first refusing `digest` rule, in policy order: the rule it is held under.
        rule: Verdict,
    },
}

impl Outcome {
    /// This outcome with its `retry_after` (deny) or `until` (delay) moved to `admissible(t)`:
    /// the refusing rules say when they would admit again, but a rule that admits now can
    /// refuse then (a quiet period beginning at midnight), and a replay or a delayed message
    /// sent at that instant would only be refused again.
    pub fn postponed(self, admissible: impl Fn(DateTime<Utc>) -> DateTime<Utc>) -> Outcome {
        match self {
            Outcome::Deny { rule, retry_after } => Outcome::Deny {
                rule,
                retry_after: retry_after.map(admissible),
            },
            Outcome::Delay { rule, until } => Outcome::Delay {
                rule,
                until: admissible(until),
            },
            other => other,
        }
    }

    /// The name printed for this outcome.
    pub fn name(&self) -> OutcomeName {
        match self {
            Outcome::Allow { shadow_refusals } if shadow_refusals.is_empty() => OutcomeName::Allow,
            Outcome::Allow { .. } => OutcomeName::Shadow,
            Outcome::Deny { .. } => OutcomeName::Deny,
            Outcome::Delay { .. } => OutcomeName::Delay,
            Outcome::Expired { .. } => OutcomeName::Expired,
            Outcome::Digest { .. } => OutcomeName::Digested,
        }
    }

    /// The rule that decided the outcome, if any refused.
    pub fn rule(&self) -> Option<&Verdict> {
        match self {
            Outcome::Allow { shadow_refusals } => shadow_refusals.first(),
            Outcome::Deny { rule, .. } | Outcome::Delay { rule, .. } | Outcome::Digest { rule } => {
                Some(rule)
            }
            Outcome::Expired { rule, .. } => rule.as_ref(),
        }
    }

    /// The name of [`Outcome::rule`], for logs and spans.
    pub fn rule_name(&self) -> Option<&str> {
        self.rule().map(|v| v.rule.as_str())
    }

    /// When the message could go out, for outcomes that hold it back.
    pub fn retry_after(&self) -> Option<DateTime<Utc>> {
        match self {
            Outcome::Allow { .. } | Outcome::Expired { .. } => None,
            Outcome::Deny { retry_after, .. } => *retry_after,
            Outcome::Delay { until, .. } => Some(*until),
            // When the digest could go out, the earliest.
            Outcome::Digest { rule } => rule.retry_after,
        }
    }
}

/// What handling one delivery came to, once its outcome is durable: the worker acks it.
#[derive(Debug, Clone, PartialEq)]
pub enum Handled {
    /// Published to the dispatch exchange; `shadow` rules would have refused it.
    Dispatched {
        /// Shadow rules that would have refused.
        shadow: Vec<String>,
    },
    /// Denied by `rule`; a denial row was written.
    Denied {
        /// The rule the denial is recorded under.
        rule: String,
    },
    /// Parked until `until` by `rule`.
    Delayed {
        /// When it will be decided again.
        until: DateTime<Utc>,
        /// The refusing delay rule that allows last.
        rule: String,
    },
    /// Past its deadline (see [`crate::decide::deadline`]): recorded as a denial with reason
    /// `expired` under `rule`, not sent.
    Expired {
        /// The rule the row is recorded under ([`crate::decide::deadline::DEADLINE_RULE`] when no rule
        /// held it).
        rule: String,
    },
    /// Redis was unavailable and the message's rules let it out unchecked (see
    /// [`crate::rules::policy::OnUnavailable`]): published to the dispatch exchange without a
    /// decision, a dispatch mark or a claim, and recorded under `rule` as a row marked
    /// `unchecked`.
    Unchecked {
        /// The first rule matching the message, the row is recorded under.
        rule: String,
    },
    /// Held by the `digest` rule `rule` for its next digest to the recipient (see
    /// [`crate::act::digest`]); no denial row is written.
    Digested {
        /// The rule it is held under.
        rule: String,
    },
    /// Not a valid request; sent to the invalid queue.
    Invalid {
        /// Why.
        reason: String,
    },
    /// Already dispatched earlier (a redelivery); nothing done.
    Duplicate,
    /// Another delivery of the same message id is in flight (see [`crate::decide::claim`]): sent
    /// through the shortest delay queue to be decided again once that one is done.
    InFlight,
}

impl Handled {
    /// The outcome's name.
    pub fn name(&self) -> OutcomeName {
        match self {
            Handled::Dispatched { shadow } if shadow.is_empty() => OutcomeName::Allow,
            Handled::Dispatched { .. } => OutcomeName::Shadow,
            Handled::Denied { .. } => OutcomeName::Deny,
            Handled::Delayed { .. } => OutcomeName::Delay,
            Handled::Invalid { .. } => OutcomeName::Invalid,
            Handled::Expired { .. } => OutcomeName::Expired,
            Handled::Unchecked { .. } => OutcomeName::Unchecked,
            Handled::Digested { .. } => OutcomeName::Digested,
            Handled::Duplicate => OutcomeName::Duplicate,
            Handled::InFlight => OutcomeName::InFlight,
        }
    }

    /// The rules that made the outcome what it is: the denying or delaying rule, the shadow
    /// rules that would have refused a dispatch, or the rule an unchecked dispatch is recorded
    /// under; none for the other outcomes.
    pub fn rules(&self) -> &[String] {
        match self {
            Handled::Denied { rule }
            | Handled::Delayed { rule, .. }
            | Handled::Expired { rule }
            | Handled::Unchecked { rule }
            | Handled::Digested { rule } => std::slice::from_ref(rule),
            Handled::Dispatched { shadow } => shadow,
            Handled::Invalid { .. } | Handled::Duplicate | Handled::InFlight => &[],
        }
    }
}

/// How an attempt at a message failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// A service was away, slow or failing (an outage, a timeout): retrying outlasts it.
    Transient,
    /// A service refused this message's own data (Postgres SQLSTATE class 22 for its denial
    /// row, RabbitMQ a body over its `max_message_size`): retrying cannot cure it.
    Refused,
}

/// Refusals in a row after which a message is poison: a couple of retries rule out a refusal
/// that was the service's passing state, and a poison message holds its slot only that long.
pub const QUARANTINE_AFTER: u32 = 3;

/// What the worker does after a failed attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Try again after a backoff (and, once it has failed long enough, from a delay queue).
    Retry,
    /// Move it to the quarantine queue, give back what it took, and ack it.
    Quarantine,
}

/// What follows a failed attempt, given how many attempts in a row ended in a refusal (this
/// one included).
pub fn after_failure(refused_in_a_row: u32) -> Next {
    if refused_in_a_row >= QUARANTINE_AFTER {
        Next::Quarantine
    } else {
        Next::Retry
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_outcome_is_at_its_index_in_all() {
        for (i, name) in OutcomeName::ALL.into_iter().enumerate() {
            assert_eq!(name.index(), i, "{name:?}");
        }
    }

    #[test]
    fn names_serialize_as_their_labels() {
        for name in OutcomeName::ALL {
            assert_eq!(
                serde_json::to_value(name).expect("serializes"),
                serde_json::Value::from(name.as_str())
            );
        }
    }

    #[test]
    fn a_dispatch_that_shadow_rules_refused_is_a_shadow_outcome() {
        let shadow = Handled::Dispatched {
            shadow: vec!["night".to_owned()],
        };
        assert_eq!(shadow.name(), OutcomeName::Shadow);
        assert_eq!(
            Handled::Dispatched { shadow: vec![] }.name(),
            OutcomeName::Allow
        );
    }

    #[test]
    fn only_repeated_refusals_quarantine() {
        assert_eq!(after_failure(0), Next::Retry);
        assert_eq!(after_failure(QUARANTINE_AFTER - 1), Next::Retry);
        assert_eq!(after_failure(QUARANTINE_AFTER), Next::Quarantine);
    }
}
