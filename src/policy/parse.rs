//! Building a [`Policy`] from the `[[rules]]` of the configuration, with exact errors.

use std::collections::HashSet;

use chrono_tz::Tz;
use serde::Deserialize;

use super::{Match, OnDeny, Policy, Rule, Scope};
use crate::attributes::MAX_ATTRIBUTES;
use crate::kinds::Kind;
use crate::message::{name_fault, one_line, MAX_NAME_CHARS, NAME_GRAMMAR};

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
    #[serde(flatten)]
    params: toml::Table,
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

impl<'de> Deserialize<'de> for OnDeny {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match String::deserialize(d)?.as_str() {
            "drop" => Ok(OnDeny::Drop),
            "delay" => Ok(OnDeny::Delay),
            "shadow" => Ok(OnDeny::Shadow),
            other => Err(serde::de::Error::custom(format!(
                "unknown on_deny \"{}\" (expected drop, delay or shadow)",
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
/// cause ([`crate::clock::MAX_WAIT_DAYS`]), so a deadline counted from any instant in range can
/// be written.
const MAX_DELAY_MS: i64 = 366 * 86_400_000;

/// A rule's `max_delay` in ms: a duration, on a `delay` rule only (a rule that drops or shadows
/// holds no message, so a limit on how long it holds one would silently do nothing).
fn max_delay(value: Option<&toml::Value>, on_deny: OnDeny) -> Result<Option<i64>, String> {
    let Some(value) = value else {
        return Ok(None);
    };
    if on_deny != OnDeny::Delay {
        let on_deny = match on_deny {
            OnDeny::Drop => "drop",
            OnDeny::Shadow => "shadow",
            OnDeny::Delay => "delay",
        };
        return Err(format!(
            "max_delay limits how long a rule holds a message, so it needs on_deny = \"delay\" \
             (this rule's on_deny is \"{on_deny}\")"
        ));
    }
    let toml::Value::String(text) = value else {
        return Err(format!(
            "max_delay must be a duration such as \"2h\", got {}",
            value.type_str()
        ));
    };
    match crate::kinds::parse_duration_ms(text) {
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
