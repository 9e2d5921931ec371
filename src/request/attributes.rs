//! A send request's `attributes`: a flat object of short string keys to short string values
//! (a campaign, a workflow, a template...), decoded and validated at the edge, which rules can
//! count by (`per_attributes`, see [`crate::rules::policy`]).
//!
//! The limits keep every attribute usable where it goes: keys are names of the grammar of
//! channels and categories (they appear in configuration, Redis keys and tables), values are
//! short text without control or format characters (they appear in Redis keys, logs and the
//! denial history), and a request holds few of them (each rule that counts by one reads it, and
//! the denial history stores them all).

use std::fmt;

use serde::de::{MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::value::RawValue;

use crate::request::names::{self, NameFault, MAX_NAME_CHARS, NAME_GRAMMAR};

/// Most attributes one request may carry.
pub const MAX_ATTRIBUTES: usize = 16;
/// Longest attribute key, in characters (keys are names, as channels and categories are).
pub const MAX_KEY_CHARS: usize = MAX_NAME_CHARS;
/// Longest attribute value, in characters.
pub const MAX_VALUE_CHARS: usize = 128;

/// A request's attributes, sorted by key, keys unique: two requests with the same attributes
/// written in another order are equal, and a rule finds a key by binary search. Empty (and
/// allocation-free) for a request without any.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Attributes(Vec<(String, String)>);

/// Why a request's `attributes` are refused; shown after "field `attributes`: " in the reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AttributeError {
    /// `attributes` is not a JSON object.
    #[error("must be an object of string values, got {0}")]
    NotAnObject(&'static str),
    /// More than [`MAX_ATTRIBUTES`] entries.
    #[error("has {0} entries, more than the limit of {MAX_ATTRIBUTES}")]
    TooMany(usize),
    /// One key appears twice (JSON parsers differ on which one wins, so none does); holds
    /// the key as a reason repeats it ([`names::echo`]).
    #[error("key {0} appears more than once")]
    Duplicate(String),
    /// A key is not a name of [`NAME_GRAMMAR`].
    #[error("key {key} {fault}: {NAME_GRAMMAR}")]
    KeyNotAName {
        /// The key, as a reason repeats it ([`names::echo`]).
        key: String,
        /// What breaks the grammar.
        fault: NameFault,
    },
    /// A key is longer than [`MAX_KEY_CHARS`].
    #[error("key {key} is {len} characters, more than the limit of {MAX_KEY_CHARS}")]
    KeyTooLong {
        /// The key, as a reason repeats it ([`names::echo`]).
        key: String,
        /// Its length in characters.
        len: usize,
    },
    /// A value breaks the limits of attribute values.
    #[error("value of key {key} {fault}")]
    Value {
        /// The key whose value it is, as a reason repeats it ([`names::echo`]).
        key: String,
        /// What is wrong with the value.
        fault: ValueFault,
    },
}

/// What is wrong with one attribute value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ValueFault {
    /// Not a string: nested objects, arrays, numbers, booleans and null are refused.
    NotAString(&'static str),
    /// The empty string.
    Empty,
    /// Longer than [`MAX_VALUE_CHARS`] characters.
    TooLong(usize),
    /// Holds a control character.
    ControlCharacter,
    /// Holds a format character or line separator ([`names::format_character`]).
    FormatCharacter(char),
}

impl fmt::Display for ValueFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ValueFault::NotAString(got) => write!(f, "must be a string, got {got}"),
            ValueFault::Empty => f.write_str("is empty"),
            ValueFault::TooLong(len) => write!(
                f,
                "is {len} characters, more than the limit of {MAX_VALUE_CHARS}"
            ),
            ValueFault::ControlCharacter => f.write_str("contains a control character"),
            ValueFault::FormatCharacter(c) => write!(
                f,
                "contains U+{:04X}, a format character or line separator",
                u32::from(*c)
            ),
        }
    }
}

impl Attributes {
    /// Attributes built in code (tools, tests), validated as a request's are.
    pub fn from_pairs<K: Into<String>, V: Into<String>>(
        pairs: impl IntoIterator<Item = (K, V)>,
    ) -> Result<Attributes, AttributeError> {
        let pairs = pairs.into_iter().map(|(k, v)| (k.into(), v.into()));
        let mut entries = Vec::new();
        for (key, value) in pairs {
            check_key(&key)?;
            check_value(&key, &value)?;
            entries.push((key, value));
        }
        Attributes::sorted(entries)
    }

    /// `entries` as attributes, sorted by key; refused when there are too many or a key
    /// appears twice.
    pub(crate) fn sorted(mut entries: Vec<(String, String)>) -> Result<Attributes, AttributeError> {
        if entries.len() > MAX_ATTRIBUTES {
            return Err(AttributeError::TooMany(entries.len()));
        }
        entries.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        if let Some(twice) = entries.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(AttributeError::Duplicate(names::echo(&twice[0].0)));
        }
        Ok(Attributes(entries))
    }

    /// The value of `key`, when the request carries it.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.0
            .binary_search_by(|(k, _)| k.as_str().cmp(key))
            .ok()
            .map(|at| self.0[at].1.as_str())
    }

    /// Whether the request carries no attributes.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Every (key, value), sorted by key.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }
}

/// Whether `key` may be an attribute key: a name of [`NAME_GRAMMAR`] of at most
/// [`MAX_KEY_CHARS`] characters. Also what a rule's `per_attributes` entries must be, so that
/// a rule cannot name a key no request can carry.
pub fn check_key(key: &str) -> Result<(), AttributeError> {
    if let Some(fault) = names::name_fault(key) {
        return Err(AttributeError::KeyNotAName {
            key: names::echo(key),
            fault,
        });
    }
    let len = key.chars().count();
    if len > MAX_KEY_CHARS {
        return Err(AttributeError::KeyTooLong {
            key: names::echo(key),
            len,
        });
    }
    Ok(())
}

pub(crate) fn check_value(key: &str, value: &str) -> Result<(), AttributeError> {
    let len = value.chars().count();
    let fault = if len == 0 {
        Some(ValueFault::Empty)
    } else if len > MAX_VALUE_CHARS {
        Some(ValueFault::TooLong(len))
    } else if value.chars().any(char::is_control) {
        Some(ValueFault::ControlCharacter)
    } else {
        value
            .chars()
            .find(|&c| names::format_character(c))
            .map(ValueFault::FormatCharacter)
    };
    match fault {
        Some(fault) => Err(AttributeError::Value {
            key: names::echo(key),
            fault,
        }),
        None => Ok(()),
    }
}

/// Stored and shown as a JSON object, in key order.
impl Serialize for Attributes {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.iter())
    }
}

/// The entries of the object as written, duplicates kept (a map would keep one silently).
pub(crate) struct Entries<'a>(pub(crate) Vec<(String, &'a RawValue)>);

impl<'de: 'a, 'a> Deserialize<'de> for Entries<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Collect<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for Collect<'a> {
            type Value = Entries<'a>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object of string values")
            }
            fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<Entries<'a>, M::Error> {
                let mut entries = Vec::new();
                // Bounded by the body's size limit; counted against MAX_ATTRIBUTES after.
                while let Some(entry) = map.next_entry::<String, &'a RawValue>()? {
                    entries.push(entry);
                }
                Ok(Entries(entries))
            }
        }
        d.deserialize_map(Collect(std::marker::PhantomData))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_sorted_and_found_and_order_does_not_matter() {
        let a = crate::request::message::decode_attributes(r#"{"b":"2","a":"1"}"#).expect("valid");
        let b = Attributes::from_pairs([("a", "1"), ("b", "2")]).expect("valid");
        assert_eq!(a, b);
        assert_eq!(a.get("a"), Some("1"));
        assert_eq!(a.get("c"), None);
        assert_eq!(
            serde_json::to_string(&a).expect("json"),
            r#"{"a":"1","b":"2"}"#
        );
    }
}
