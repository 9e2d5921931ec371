//! Which rules apply to a message, and what each rule's denial does.
//!
//! A [`Policy`] is built once from configuration and validated completely before the worker
//! takes its first message; an invalid rule cannot be constructed. At decision time the policy
//! only answers "which rules match this message", grouped by the scope their state lives in.

mod parse;

use chrono_tz::Tz;
use serde::Serialize;

use crate::request::attributes::Attributes;
use crate::request::message::SendRequest;
use crate::rules::kinds::{CalendarQuota, Kind};
use crate::rules::priority::PriorityRules;

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
    /// Attribute keys the state is also kept per, with the scope: `["campaign"]` with scope
    /// `recipient` counts each campaign to each recipient apart, with scope `global` each
    /// campaign apart. A message lacking one of them is not matched by the rule. Empty for a
    /// rule that counts by its scope alone.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub per_attributes: Vec<String>,
    /// What a refusal by this rule does to the message.
    pub on_deny: OnDeny,
    /// The longest a `delay` rule may hold a message, in ms, counted from when the worker first
    /// received it: a message it would hold longer is recorded as expired instead (see
    /// [`crate::decide::deadline`]). `None` for no limit, and always for other rules.
    #[serde(
        skip_serializing_if = "Option::is_none",
        serialize_with = "serialize_max_delay"
    )]
    pub max_delay: Option<i64>,
    /// Which priorities pass the rule, and the slots it keeps for the higher ones.
    #[serde(flatten)]
    pub priority: PriorityRules,
    /// What a message the rule matches comes to while Redis cannot decide it. Printed only
    /// when it is not the default, as the other options added since (`max_delay`, `exempt`).
    #[serde(skip_serializing_if = "OnUnavailable::is_wait")]
    pub on_unavailable: OnUnavailable,
    /// The attribute key a `digest` rule groups held messages by, beside the recipient and
    /// the rule (see [`crate::act::digest`]): one digest per campaign, say. `None` groups by
    /// recipient and rule alone, and always for other rules.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub digest_by: Option<String>,
}

/// `max_delay` written as configuration takes it (`"2h"`), so `config check` prints a rule
/// that loads back the same.
fn serialize_max_delay<S: serde::Serializer>(ms: &Option<i64>, s: S) -> Result<S::Ok, S::Error> {
    match ms {
        Some(ms) => s.serialize_str(&crate::rules::kinds::human_ms(*ms)),
        None => s.serialize_none(),
    }
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
    /// Hold the message, and send every message it held to the recipient as one digest once
    /// the rule has room again (see [`crate::act::digest`]).
    Digest,
}

impl OnDeny {
    /// The name as configuration writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            OnDeny::Drop => "drop",
            OnDeny::Delay => "delay",
            OnDeny::Shadow => "shadow",
            OnDeny::Digest => "digest",
        }
    }
}

/// What a rule lets happen to a message while Redis is unavailable (see
/// `LimiterError::is_unavailable`): the rule cannot be checked then, and an operator chooses
/// per rule between holding the message and sending it unchecked.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OnUnavailable {
    /// Keep the message and decide it once Redis is back (the worker retries it; nothing is
    /// sent unchecked): a cap that must hold whatever happens.
    #[default]
    Wait,
    /// Fail open: dispatch it unchecked (no quota taken, no duplicate protection), record a
    /// row marked `unchecked` and count it, when every rule matching the message says so.
    Allow,
}

impl OnUnavailable {
    /// Whether this is the default, which `config check` leaves out.
    pub fn is_wait(&self) -> bool {
        *self == OnUnavailable::Wait
    }
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
                per_attributes: Vec::new(),
                on_deny: OnDeny::Drop,
                max_delay: None,
                priority: PriorityRules::default(),
                on_unavailable: OnUnavailable::Wait,
                digest_by: None,
            }],
        }
    }

    /// The rules that apply to `message`, in configuration order.
    pub fn rules_for<'p>(&'p self, message: &SendRequest) -> Vec<&'p Rule> {
        self.rules.iter().filter(|r| r.matches(message)).collect()
    }

    /// The rules of `scope` that some message with `channel` and `category` (`None`: any
    /// value) and `attributes` would match, in configuration order: what a quota peek shows.
    /// A rule counting per attributes the peek was not given is left out: without their values
    /// there is no state of it to show.
    pub fn rules_that_may_match<'p>(
        &'p self,
        scope: Scope,
        channel: Option<&str>,
        category: Option<&str>,
        attributes: &Attributes,
    ) -> Vec<&'p Rule> {
        self.rules
            .iter()
            .filter(|r| {
                r.scope == scope
                    && r.matcher.admits(channel, category)
                    && r.carries_attributes(attributes)
            })
            .collect()
    }

    /// The rules whose filter admits `message` but which do not match it because it lacks
    /// attributes they count per, each with the keys it lacks: what `check` explains.
    pub fn unmatched_for_attributes<'p>(
        &'p self,
        message: &SendRequest,
    ) -> Vec<(&'p Rule, Vec<&'p str>)> {
        self.rules
            .iter()
            .filter(|r| r.matcher.matches(message))
            .map(|r| (r, r.missing_attributes(&message.attributes)))
            .filter(|(_, missing)| !missing.is_empty())
            .collect()
    }

    /// The rules whose filter admits `message` but which leave it out because they exempt its
    /// priority without counting it: what `check` explains beside missing attributes.
    pub fn exempting(&self, message: &SendRequest) -> Vec<&Rule> {
        self.rules
            .iter()
            .filter(|r| {
                r.matcher.matches(message)
                    && r.carries_attributes(&message.attributes)
                    && r.priority.ignores(message.priority)
            })
            .collect()
    }

    /// The rule a message fails open under while Redis is unavailable: the first rule matching
    /// `message` when every one of them has `on_unavailable = "allow"`; `None` when one of them
    /// waits (the strictest rule wins: a cap that must hold is not bypassed because another
    /// rule would tolerate it) or none matches (nothing asked for it).
    pub fn fails_open(&self, message: &SendRequest) -> Option<&Rule> {
        let rules = self.rules_for(message);
        if rules
            .iter()
            .all(|r| r.on_unavailable == OnUnavailable::Allow)
        {
            rules.first().copied()
        } else {
            None
        }
    }

    /// What the worker does with `message` while Redis is unavailable, when some rule matching
    /// it sets `on_unavailable = "allow"`: `allow` when it fails open, `wait` when another
    /// matching rule keeps it waiting; `None` when no matching rule sets it (nothing to
    /// explain: it waits, as always). What `check` explains.
    pub fn on_unavailable(&self, message: &SendRequest) -> Option<OnUnavailable> {
        let rules = self.rules_for(message);
        if !rules
            .iter()
            .any(|r| r.on_unavailable == OnUnavailable::Allow)
        {
            return None;
        }
        Some(match self.fails_open(message) {
            Some(_) => OnUnavailable::Allow,
            None => OnUnavailable::Wait,
        })
    }

    /// Looks a rule up by name.
    pub fn rule(&self, name: &str) -> Option<&Rule> {
        self.rules.iter().find(|r| r.name == name)
    }
}

impl Rule {
    /// Whether the rule applies to `message`: the one test of a rule against a message. A
    /// rule leaves out messages of the priorities it exempts without counting them.
    pub fn matches(&self, message: &SendRequest) -> bool {
        self.matcher.matches(message)
            && self.carries_attributes(&message.attributes)
            && !self.priority.ignores(message.priority)
    }

    /// Whether `attributes` hold every key of [`Rule::per_attributes`].
    fn carries_attributes(&self, attributes: &Attributes) -> bool {
        self.per_attributes
            .iter()
            .all(|key| attributes.get(key).is_some())
    }

    /// The keys of [`Rule::per_attributes`] that `attributes` lack.
    fn missing_attributes(&self, attributes: &Attributes) -> Vec<&str> {
        self.per_attributes
            .iter()
            .map(String::as_str)
            .filter(|key| attributes.get(key).is_none())
            .collect()
    }

    /// The message's value of each of [`Rule::per_attributes`], in the rule's order: the
    /// tuple its state is kept per (with the scope's value). Only for a message the rule
    /// matches, which carries them all.
    pub fn attribute_values<'m>(
        &'m self,
        message: &'m SendRequest,
    ) -> impl Iterator<Item = (&'m str, &'m str)> + 'm {
        self.per_attributes
            .iter()
            .filter_map(|key| Some((key.as_str(), message.attributes.get(key)?)))
    }

    /// Whether the rule applies to every message: then two messages to one recipient always
    /// meet the same rules of it. Compared with the empty filter, so a match field added to
    /// [`Match`] cannot be forgotten here.
    pub fn matches_everything(&self) -> bool {
        self.matcher == Match::default()
            && self.per_attributes.is_empty()
            && self.priority.is_empty()
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

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(toml: &str) -> Policy {
        #[derive(serde::Deserialize)]
        struct File {
            rules: Vec<RawRule>,
        }
        let file: File = toml::from_str(toml).expect("TOML");
        Policy::from_raw(chrono_tz::UTC, file.rules).expect("valid policy")
    }

    fn message(attributes: serde_json::Value) -> SendRequest {
        let body = serde_json::json!({"id": "m", "recipient": "u", "channel": "sms",
            "attributes": attributes});
        SendRequest::decode(body.to_string().as_bytes(), 4096).expect("valid")
    }

    #[test]
    fn a_rule_counting_per_attributes_matches_only_messages_carrying_them_all() {
        let p = policy(
            "[[rules]]\nname = \"c\"\nkind = \"fixed_window\"\nlimit = 1\nwindow = \"1d\"\n\
             per_attributes = [\"campaign\", \"step\"]\n\
             [[rules]]\nname = \"all\"\nkind = \"fixed_window\"\nlimit = 1\nwindow = \"1d\"\n",
        );
        let both = message(serde_json::json!({"step": "1", "campaign": "a", "x": "y"}));
        let one = message(serde_json::json!({"campaign": "a"}));
        let names = |m: &SendRequest| -> Vec<String> {
            p.rules_for(m).iter().map(|r| r.name.clone()).collect()
        };
        assert_eq!(names(&both), ["c", "all"]);
        assert_eq!(names(&one), ["all"]);
        assert_eq!(
            p.rules[0].attribute_values(&both).collect::<Vec<_>>(),
            [("campaign", "a"), ("step", "1")]
        );
        let unmatched = p.unmatched_for_attributes(&one);
        assert_eq!(unmatched.len(), 1);
        assert_eq!(
            (unmatched[0].0.name.as_str(), unmatched[0].1.clone()),
            ("c", vec!["step"])
        );
        assert!(p.unmatched_for_attributes(&both).is_empty());
        assert!(!p.rules[0].matches_everything());
        assert!(p.rules[1].matches_everything());
        let peeked = |a: &Attributes| -> Vec<String> {
            p.rules_that_may_match(Scope::Recipient, None, None, a)
                .iter()
                .map(|r| r.name.clone())
                .collect()
        };
        assert_eq!(peeked(&Attributes::default()), ["all"]);
        assert_eq!(peeked(&both.attributes), ["c", "all"]);
    }

    #[test]
    fn a_message_fails_open_only_when_every_rule_matching_it_allows() {
        let p = policy(
            "[[rules]]\nname = \"open\"\nkind = \"fixed_window\"\nlimit = 1\nwindow = \"1d\"\n\
             on_unavailable = \"allow\"\n\
             [[rules]]\nname = \"push-cap\"\nkind = \"fixed_window\"\nlimit = 1\n\
             window = \"1d\"\nmatch = { channels = [\"push\"] }\n\
             [[rules]]\nname = \"mail-open\"\nkind = \"fixed_window\"\nlimit = 1\n\
             window = \"1d\"\nmatch = { channels = [\"mail\"] }\non_unavailable = \"allow\"\n",
        );
        let on = |channel: &str| {
            let body = serde_json::json!({"id": "m", "recipient": "u", "channel": channel});
            SendRequest::decode(body.to_string().as_bytes(), 4096).expect("valid")
        };
        let open = |m: &SendRequest| p.fails_open(m).map(|r| r.name.clone());
        assert_eq!(open(&on("sms")), Some("open".to_owned()));
        assert_eq!(open(&on("mail")), Some("open".to_owned()), "the first rule");
        assert_eq!(open(&on("push")), None, "push-cap waits");
        assert_eq!(p.on_unavailable(&on("sms")), Some(OnUnavailable::Allow));
        assert_eq!(p.on_unavailable(&on("push")), Some(OnUnavailable::Wait));
        let waiting = Policy::headline(chrono_tz::UTC);
        assert_eq!(waiting.fails_open(&on("sms")), None);
        assert_eq!(
            waiting.on_unavailable(&on("sms")),
            None,
            "nothing to explain"
        );
        let none = policy(
            "[[rules]]\nname = \"mail-only\"\nkind = \"fixed_window\"\nlimit = 1\n\
             window = \"1d\"\nmatch = { channels = [\"mail\"] }\non_unavailable = \"allow\"\n",
        );
        assert_eq!(none.fails_open(&on("sms")), None, "no rule asked for it");
    }
}
