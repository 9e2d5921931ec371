//! Building a [`Policy`] from the `[[rules]]` of the configuration, with exact errors.

use std::collections::HashSet;

use chrono::NaiveTime;
use chrono_tz::Tz;
use serde::Deserialize;

use super::{Match, OnDeny, OnUnavailable, Policy, Rule, Scope};
use crate::request::attributes::MAX_ATTRIBUTES;
use crate::request::message::one_line;
use crate::request::names::{name_fault, MAX_NAME_CHARS, NAME_GRAMMAR};
use crate::request::priority::Priority;
use crate::rules::kinds::Kind;
use crate::rules::priority::{PriorityRules, Reserve};

/// Longest rule name; names are part of Redis keys and denial rows.
const MAX_RULE_NAME: usize = 64;

/// Why a policy was refused. Messages name the rule and the parameter at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// A rule's kind or parameters are invalid.
    #[error("rule \"{rule}\": {message}")]
    Rule {
        /// Name of the rule at fault.
        rule: String,
        /// What is wrong with it.
        message: String,
    },
    /// Two rules share a name.
    #[error("duplicate rule name \"{0}\"")]
    DuplicateName(String),
}

/// A rule as written in configuration, before validation.
#[derive(Debug, Clone, Deserialize)]
pub struct RawRule {
    name: String,
    kind: String,
    #[serde(default)]
    scope: Option<Scope>,
    #[serde(default)]
    on_deny: Option<OnDeny>,
    #[serde(default, rename = "match")]
    matcher: Option<RawMatch>,
    #[serde(default)]
    per_attributes: Vec<String>,
    #[serde(default)]
    max_delay: Option<toml::Value>,
    #[serde(default)]
    exempt: Vec<Priority>,
    #[serde(default)]
    exempt_counts: Option<bool>,
    #[serde(default)]
    reserve: Option<RawReserve>,
    #[serde(default)]
    on_unavailable: Option<OnUnavailable>,
    digest_by: Option<String>,
    #[serde(flatten)]
    params: toml::Table,
}

/// `reserve = { slots = 1, for = "high", until = "18:00" }` as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawReserve {
    slots: u32,
    #[serde(rename = "for")]
    for_at_least: Priority,
    until: String,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMatch {
    #[serde(default)]
    channels: Vec<String>,
    #[serde(default)]
    categories: Vec<String>,
}

impl<'de> Deserialize<'de> for Scope {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match String::deserialize(d)?.as_str() {
            "recipient" => Ok(Scope::Recipient),
            "channel" => Ok(Scope::Channel),
            "category" => Ok(Scope::Category),
            "global" => Ok(Scope::Global),
            other => Err(serde::de::Error::custom(format!(
                "unknown scope \"{}\" (expected recipient, channel, category or global)",
                one_line(other)
            ))),
        }
    }
}

impl<'de> Deserialize<'de> for Priority {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        Priority::parse(&name).ok_or_else(|| {
            serde::de::Error::custom(format!(
                "unknown priority \"{}\" (expected {})",
                one_line(&name),
                Priority::names()
            ))
        })
    }
}

impl<'de> Deserialize<'de> for OnDeny {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match String::deserialize(d)?.as_str() {
            "drop" => Ok(OnDeny::Drop),
            "delay" => Ok(OnDeny::Delay),
            "shadow" => Ok(OnDeny::Shadow),
            "digest" => Ok(OnDeny::Digest),
            other => Err(serde::de::Error::custom(format!(
                "unknown on_deny \"{}\" (expected drop, delay, shadow or digest)",
                one_line(other)
            ))),
        }
    }
}

impl<'de> Deserialize<'de> for OnUnavailable {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match String::deserialize(d)?.as_str() {
            "wait" => Ok(OnUnavailable::Wait),
            "allow" => Ok(OnUnavailable::Allow),
            other => Err(serde::de::Error::custom(format!(
                "unknown on_unavailable \"{}\" (expected wait or allow)",
                one_line(other)
            ))),
        }
    }
}

impl Policy {
    /// Validates configured rules. No rules at all means the headline rule alone.
    pub fn from_raw(default_zone: Tz, raw: Vec<RawRule>) -> Result<Policy, PolicyError> {
        if raw.is_empty() {
            return Ok(Policy::headline(default_zone));
        }
        let mut seen = HashSet::new();
        let mut rules = Vec::with_capacity(raw.len());
        for r in raw {
            let fail = |message: String| PolicyError::Rule {
                rule: one_line(&r.name),
                message: one_line(&message),
            };
            check_name(&r.name).map_err(fail)?;
            if !seen.insert(r.name.clone()) {
                return Err(PolicyError::DuplicateName(one_line(&r.name)));
            }
            let kind = Kind::from_params(&r.kind, &r.params).map_err(fail)?;
            let matcher = r.matcher.unwrap_or_default();
            check_names("match channels", &matcher.channels).map_err(fail)?;
            check_names("match categories", &matcher.categories).map_err(fail)?;
            let scope = r.scope.unwrap_or(Scope::Recipient);
            check_per_attributes(scope, &r.per_attributes).map_err(fail)?;
            let on_deny = r.on_deny.unwrap_or(OnDeny::Drop);
            let max_delay = max_delay(r.max_delay.as_ref(), on_deny).map_err(fail)?;
            let priority = priority_rules(&kind, on_deny, r.exempt, r.exempt_counts, r.reserve)
                .map_err(fail)?;
            let digest_by = digest_by(r.digest_by, on_deny).map_err(fail)?;
            rules.push(Rule {
                kind,
                matcher: Match {
                    channels: matcher.channels,
                    categories: matcher.categories,
                },
                scope,
                per_attributes: r.per_attributes,
                on_deny,
                max_delay,
                priority,
                on_unavailable: r.on_unavailable.unwrap_or_default(),
                digest_by,
                name: r.name,
            });
        }
        Ok(Policy {
            default_zone,
            rules,
        })
    }
}

/// Refuses a `match` or `per_attributes` entry no request could carry (a message with it is
/// invalid), which would make the rule silently apply to nothing. Attribute keys are names of
/// the same grammar and length as channels and categories.
fn check_names(list: &str, names: &[String]) -> Result<(), String> {
    for name in names {
        let fault = match name_fault(name) {
            Some(fault) => fault.to_string(),
            None if name.chars().count() > MAX_NAME_CHARS => {
                format!("is longer than {MAX_NAME_CHARS} characters")
            }
            None => continue,
        };
        return Err(format!(
            "{list} entry {name:?} {fault}, so no request can carry it: {NAME_GRAMMAR}"
        ));
    }
    Ok(())
}

/// Refuses `per_attributes` no request could carry, named twice, or with a scope that has no
/// key shape for them (a channel or category scope: counting per attribute is kept per
/// recipient or for everyone).
fn check_per_attributes(scope: Scope, keys: &[String]) -> Result<(), String> {
    if keys.is_empty() {
        return Ok(());
    }
    if !matches!(scope, Scope::Recipient | Scope::Global) {
        return Err(
            "per_attributes needs scope \"recipient\" or \"global\" (per attribute value, \
             for each recipient or for everyone)"
                .to_owned(),
        );
    }
    if keys.len() > MAX_ATTRIBUTES {
        return Err(format!(
            "per_attributes lists {} keys, more than a request can carry ({MAX_ATTRIBUTES})",
            keys.len()
        ));
    }
    check_names("per_attributes", keys)?;
    for (at, key) in keys.iter().enumerate() {
        if keys[..at].contains(key) {
            return Err(format!("per_attributes lists {key:?} twice"));
        }
    }
    Ok(())
}

/// Longest `max_delay`: as long as the longest window, far below the longest wait a rule may
/// cause ([`crate::base::clock::MAX_WAIT_DAYS`]), so a deadline counted from any instant in range can
/// be written.
const MAX_DELAY_MS: i64 = 366 * 86_400_000;

/// A rule's `max_delay` in ms: a duration, on a `delay` rule only (a rule that drops or shadows
/// holds no message, so a limit on how long it holds one would silently do nothing).
fn max_delay(value: Option<&toml::Value>, on_deny: OnDeny) -> Result<Option<i64>, String> {
    let Some(value) = value else {
        return Ok(None);
    };
    if on_deny != OnDeny::Delay {
        return Err(format!(
            "max_delay limits how long a rule holds a message, so it needs on_deny = \"delay\" \
             (this rule's on_deny is \"{}\")",
            on_deny.as_str()
        ));
    }
    let toml::Value::String(text) = value else {
        return Err(format!(
            "max_delay must be a duration such as \"2h\", got {}",
            value.type_str()
        ));
    };
    match crate::rules::kinds::parse_duration_ms(text) {
        Some(ms) if ms > MAX_DELAY_MS => Err(format!("max_delay \"{text}\" is longer than 366d")),
        Some(ms) if ms > 0 => Ok(Some(ms)),
        Some(_) => Err(format!(
            "max_delay must be longer than zero, got \"{text}\""
        )),
        None => Err(format!(
            "max_delay \"{}\" is not a duration (a whole number followed by ms, s, m, h or d)",
            one_line(text)
        )),
    }
}

/// A rule's priority options, checked: exempt priorities named once, `exempt_counts` only
/// beside `exempt`, and a reservation only on a kind with limits to take slots off, for a
/// priority above the lowest, of at most the smallest limit, and not beside a shadow rule
/// (which refuses nothing, so keeps nothing).
fn priority_rules(
    kind: &Kind,
    on_deny: OnDeny,
    exempt: Vec<Priority>,
    exempt_counts: Option<bool>,
    reserve: Option<RawReserve>,
) -> Result<PriorityRules, String> {
    for (at, p) in exempt.iter().enumerate() {
        if exempt[..at].contains(p) {
            return Err(format!("exempt lists \"{}\" twice", p.as_str()));
        }
    }
    if exempt_counts.is_some() && exempt.is_empty() {
        return Err("exempt_counts needs exempt (the priorities it is about)".to_owned());
    }
    let reserve = match reserve {
        None => None,
        Some(r) => {
            let Some(smallest) = kind.smallest_limit() else {
                return Err(format!(
                    "reserve needs a kind with limits to keep slots of ({}), not {}",
                    Kind::RESERVABLE.join(", "),
                    kind.name()
                ));
            };
            if on_deny == OnDeny::Shadow {
                return Err("reserve on a shadow rule keeps nothing: it refuses no one".to_owned());
            }
            if r.slots == 0 || r.slots > smallest {
                return Err(format!(
                    "reserve slots must be from 1 to the rule's smallest limit ({smallest}), got {}",
                    r.slots
                ));
            }
            if r.for_at_least == Priority::Low {
                return Err(
                    "reserve for \"low\" keeps nothing: every message is low or above".to_owned(),
                );
            }
            let until = NaiveTime::parse_from_str(&r.until, "%H:%M").map_err(|_| {
                format!(
                    "reserve until \"{}\" is not a time of day as HH:MM",
                    one_line(&r.until)
                )
            })?;
            Some(Reserve {
                slots: r.slots,
                for_at_least: r.for_at_least,
                until,
            })
        }
    };
    Ok(PriorityRules {
        exempt,
        exempt_counts: exempt_counts.unwrap_or(false),
        reserve,
    })
}

/// A rule's `digest_by`: an attribute key a request can carry, on a `digest` rule only (other
/// rules hold no messages to group, so it would silently do nothing).
fn digest_by(key: Option<String>, on_deny: OnDeny) -> Result<Option<String>, String> {
    let Some(key) = key else {
        return Ok(None);
    };
    if on_deny != OnDeny::Digest {
        return Err(format!(
            "digest_by groups held messages, so it needs on_deny = \"digest\" \
             (this rule's on_deny is \"{}\")",
            on_deny.as_str()
        ));
    }
    check_names("digest_by", std::slice::from_ref(&key))?;
    Ok(Some(key))
}

fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > MAX_RULE_NAME {
        return Err(format!("name must be 1 to {MAX_RULE_NAME} characters"));
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
    {
        return Err("name may hold only letters, digits, '_', '-' and '.'".to_owned());
    }
    Ok(())
}
