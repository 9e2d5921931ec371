//! What every kind's parameters are read with: typed reads from a rule's table that remember
//! what was read (so a misspelt parameter is an error), durations as configuration writes them,
//! and the serializers that print parameters back the same way.
//!
//! Durations are written `500ms`, `10s`, `5m`, `2h` or `1d`; rates as `rate` per `period`.

use chrono::NaiveTime;
use serde::Serialize;

/// Longest time window accepted: 366 days.
pub(super) const MAX_WINDOW_MS: i64 = 366 * 86_400_000;

pub(super) fn gcd(a: i64, b: i64) -> i64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// A duration in milliseconds, written the way configuration takes it.
pub fn human_ms(ms: i64) -> String {
    const UNITS: [(i64, &str); 4] = [
        (86_400_000, "d"),
        (3_600_000, "h"),
        (60_000, "m"),
        (1_000, "s"),
    ];
    for (size, unit) in UNITS {
        if ms >= size && ms % size == 0 {
            return format!("{}{unit}", ms / size);
        }
    }
    format!("{ms}ms")
}

/// Parses `500ms`, `10s`, `5m`, `2h`, `1d` into milliseconds.
pub fn parse_duration_ms(text: &str) -> Option<i64> {
    let split = text.find(|c: char| !c.is_ascii_digit())?;
    let (digits, unit) = text.split_at(split);
    let n: i64 = digits.parse().ok()?;
    let size = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return None,
    };
    n.checked_mul(size)
}

/// Reads typed parameters from a rule's table and remembers which ones were read, so that a
/// misspelt parameter is an error instead of a silently ignored default.
pub(super) struct Params<'t> {
    pub(super) table: &'t toml::Table,
    pub(super) used: Vec<&'static str>,
}

impl Params<'_> {
    pub(super) fn positive(
        &mut self,
        name: &'static str,
        default: Option<u32>,
    ) -> Result<u32, String> {
        self.optional_positive(name)?
            .or(default)
            .ok_or_else(|| format!("{name} is required"))
    }

    pub(super) fn optional_positive(&mut self, name: &'static str) -> Result<Option<u32>, String> {
        self.used.push(name);
        match self.table.get(name) {
            None => Ok(None),
            Some(toml::Value::Integer(n)) if *n >= 1 && *n <= i64::from(u32::MAX) => {
                Ok(Some(*n as u32))
            }
            Some(toml::Value::Integer(n)) => Err(format!("{name} must be at least 1, got {n}")),
            Some(other) => Err(format!(
                "{name} must be a whole number, got {}",
                other.type_str()
            )),
        }
    }

    pub(super) fn string(&mut self, name: &'static str) -> Result<Option<String>, String> {
        self.used.push(name);
        match self.table.get(name) {
            None => Ok(None),
            Some(toml::Value::String(s)) => Ok(Some(s.clone())),
            Some(other) => Err(format!("{name} must be a string, got {}", other.type_str())),
        }
    }

    pub(super) fn duration(
        &mut self,
        name: &'static str,
        default: Option<i64>,
    ) -> Result<i64, String> {
        let Some(text) = self.string(name)? else {
            return default
                .ok_or_else(|| format!("{name} is required (a duration such as \"1m\")"));
        };
        match parse_duration_ms(&text) {
            Some(ms) if ms > 0 && ms <= MAX_WINDOW_MS => Ok(ms),
            Some(ms) if ms > MAX_WINDOW_MS => Err(format!("{name} \"{text}\" is longer than 366d")),
            Some(_) => Err(format!("{name} must be longer than zero, got \"{text}\"")),
            None => Err(format!(
                "{name} \"{text}\" is not a duration (a whole number followed by ms, s, m, h or d)"
            )),
        }
    }

    pub(super) fn reject_unused(&self, kind: &str) -> Result<(), String> {
        match self.table.keys().find(|k| !self.used.contains(&k.as_str())) {
            Some(k) => Err(format!("unknown parameter `{k}` for kind {kind}")),
            None => Ok(()),
        }
    }
}

pub(super) fn as_duration<S: serde::Serializer>(ms: &i64, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&human_ms(*ms))
}

pub(super) fn as_hh_mm<S: serde::Serializer>(t: &NaiveTime, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&t.format("%H:%M").to_string())
}

pub(super) fn as_policies<S: serde::Serializer>(
    policies: &[(u32, i64)],
    s: S,
) -> Result<S::Ok, S::Error> {
    use serde::ser::{SerializeMap, SerializeSeq};
    struct Policy(u32, i64);
    impl Serialize for Policy {
        fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            let mut m = s.serialize_map(Some(2))?;
            m.serialize_entry("limit", &self.0)?;
            m.serialize_entry("window", &human_ms(self.1))?;
            m.end()
        }
    }
    let mut seq = s.serialize_seq(Some(policies.len()))?;
    for &(limit, window) in policies {
        seq.serialize_element(&Policy(limit, window))?;
    }
    seq.end()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_and_print_back() {
        for (text, ms) in [
            ("500ms", 500),
            ("10s", 10_000),
            ("5m", 300_000),
            ("2h", 7_200_000),
        ] {
            assert_eq!(parse_duration_ms(text), Some(ms));
            assert_eq!(human_ms(ms), text);
        }
        assert_eq!(parse_duration_ms("1.5s"), None);
        assert_eq!(parse_duration_ms("-1s"), None);
    }
}
