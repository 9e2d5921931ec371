//! Which rules apply to a message, and what each rule's denial does.
//!
//! A [`Policy`] is built once from configuration and validated completely before the worker
//! takes its first message; an invalid rule cannot be constructed. At decision time the policy
//! only answers "which rules match this message", grouped by the scope their state lives in.

mod parse;

use chrono_tz::Tz;
use serde::Serialize;

use crate::kinds::{CalendarQuota, Kind};
use crate::message::SendRequest;

pub use parse::{PolicyError, RawRule};

/// The whole validated rule set plus the zone used for messages that name none.
#[derive(Debug, Clone, Serialize)]
pub struct Policy {
    /// Zone for recipients whose messages carry no `timezone`.
    #[serde(serialize_with = "serialize_zone")]
    pub default_zone: Tz,
    /// Rules in configuration order; names are unique.
    pub rules: Vec<Rule>,
}

/// One limit: a limiter kind with its parameters, the messages it applies to, where its state
/// is kept, and what happens when it refuses.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Rule {
    /// Unique name; part of the Redis key and of every denial row.
    pub name: String,
    /// The limiter and its parameters.
    #[serde(flatten)]
    pub kind: Kind,
    /// Which messages the rule applies to.
    #[serde(rename = "match")]
    pub matcher: Match,
    /// Whose state the rule counts in.
    pub scope: Scope,
    /// What a refusal by this rule does to the message.
    pub on_deny: OnDeny,
}

/// Message filter of a rule; an empty list means "every value".
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Match {
    /// Channels the rule applies to; empty for all.
    pub channels: Vec<String>,
    /// Categories the rule applies to; empty for all.
    pub categories: Vec<String>,
}

/// Whose sends a rule counts together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Scope {
    /// Each recipient separately (the default).
    Recipient,
    /// Everything sent on one channel.
    Channel,
    /// Everything of one category.
    Category,
    /// Everything.
    Global,
}

/// A scope together with the message's value for it: the thing state is kept per.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ScopeValue<'a> {
    /// Keyed by recipient id.
    Recipient(&'a str),
    /// Keyed by channel name.
    Channel(&'a str),
    /// Keyed by category name.
    Category(&'a str),
    /// One state for all messages.
    Global,
}

/// What a refusal does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OnDeny {
    /// Deny and record the denial; the message can be replayed later.
    Drop,
    /// Park the message until the rule would allow it, then decide again.
    Delay,
    /// Record a would-be denial but dispatch anyway (a rule on trial).
    Shadow,
}

impl Policy {
    /// The policy that applies when no config file is given: the headline rule alone.
    pub fn headline(default_zone: Tz) -> Policy {
        Policy {
            default_zone,
            rules: vec![Rule {
                name: "headline".to_owned(),
                kind: Kind::CalendarQuota(CalendarQuota::HEADLINE),
                matcher: Match::default(),
                scope: Scope::Recipient,
                on_deny: OnDeny::Drop,
            }],
        }
    }

    /// The rules that apply to `message`, in configuration order.
    pub fn rules_for<'p>(&'p self, message: &SendRequest) -> Vec<&'p Rule> {
        self.rules.iter().filter(|r| r.matches(message)).collect()
    }

    /// The rules of `scope` that some message with `channel` and `category` would match
    /// (`None`: any value), in configuration order: what a quota peek shows.
    pub fn rules_that_may_match<'p>(
        &'p self,
        scope: Scope,
        channel: Option<&str>,
        category: Option<&str>,
    ) -> Vec<&'p Rule> {
        self.rules
            .iter()
            .filter(|r| r.scope == scope && r.matcher.admits(channel, category))
            .collect()
    }

    /// Looks a rule up by name.
    pub fn rule(&self, name: &str) -> Option<&Rule> {
        self.rules.iter().find(|r| r.name == name)
    }
}

impl Rule {
    /// Whether the rule applies to `message`: the one test of a rule against a message.
    pub fn matches(&self, message: &SendRequest) -> bool {
        self.matcher.matches(message)
    }

    /// Whether the rule applies to every message: then two messages to one recipient always
    /// meet the same rules of it. Compared with the empty filter, so a match field added to
    /// [`Match`] cannot be forgotten here.
    pub fn matches_everything(&self) -> bool {
        self.matcher == Match::default()
    }
}

impl Match {
    /// Whether a message falls under this filter.
    pub fn matches(&self, message: &SendRequest) -> bool {
        self.admits(Some(&message.channel), Some(&message.category))
    }

    /// Whether some message with these values (`None`: any value) falls under this filter.
    fn admits(&self, channel: Option<&str>, category: Option<&str>) -> bool {
        fn one(values: &[String], value: Option<&str>) -> bool {
            value.is_none_or(|v| values.is_empty() || values.iter().any(|x| x == v))
        }
        one(&self.channels, channel) && one(&self.categories, category)
    }
}

impl Scope {
    /// The message's value for this scope.
    pub fn of(self, message: &SendRequest) -> ScopeValue<'_> {
        match self {
            Scope::Recipient => ScopeValue::Recipient(&message.recipient),
            Scope::Channel => ScopeValue::Channel(&message.channel),
            Scope::Category => ScopeValue::Category(&message.category),
            Scope::Global => ScopeValue::Global,
        }
    }
}

fn serialize_zone<S: serde::Serializer>(zone: &Tz, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(zone.name())
}
