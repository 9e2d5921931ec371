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
            Some(toml::Value::Integer(n)) => Err(format!(
                "{name} must be between 1 and {}, got {n}",
                u32::MAX
            )),
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

    /// A parameter of a shape of its own (an array, a table), for the kind to read.
    pub(super) fn value(&mut self, name: &'static str) -> Option<&toml::Value> {
        self.used.push(name);
        self.table.get(name)
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
        // Digits beyond i64 are a duration too long to count, not a malformed one.
        let too_long = text.starts_with(|c: char| c.is_ascii_digit())
            && parse_duration_ms(&text).is_none()
            && ["ms", "s", "m", "h", "d"]
                .iter()
                .any(|unit| text.strip_suffix(unit).is_some_and(all_digits));
        match parse_duration_ms(&text) {
            Some(ms) if ms > 0 && ms <= MAX_WINDOW_MS => Ok(ms),
            Some(ms) if ms > MAX_WINDOW_MS => Err(format!("{name} \"{text}\" is longer than 366d")),
            None if too_long => Err(format!("{name} \"{text}\" is longer than 366d")),
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

fn all_digits(text: &str) -> bool {
    !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit())
}

pub(super) fn as_duration<S: serde::Serializer>(ms: &i64, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&human_ms(*ms))
}

pub fn as_hh_mm<S: serde::Serializer>(t: &NaiveTime, s: S) -> Result<S::Ok, S::Error> {
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
        assert_eq!(parse_duration_ms("99999999999999999999s"), None);
        assert_eq!(parse_duration_ms("-1s"), None);
    }

    /// Asserts that each kind's parameters are refused with the reason given.
    fn refused<const N: usize>(cases: [(&str, &str, String); N]) {
        for (kind, params, expected) in cases {
            let table: toml::Table = params.parse().expect("TOML");
            let refused = crate::rules::kinds::Kind::from_params(kind, &table);
            assert_eq!(refused, Err(expected), "{kind}: {params}");
        }
    }

    #[test]
    fn limits_at_zero_negative_or_beyond_their_type_are_refused() {
        let max = u32::MAX;
        refused([
            (
                "fixed_window",
                "limit = 0\nwindow = \"1m\"",
                format!("limit must be between 1 and {max}, got 0"),
            ),
            (
                "fixed_window",
                "limit = -1\nwindow = \"1m\"",
                format!("limit must be between 1 and {max}, got -1"),
            ),
            (
                "fixed_window",
                "limit = 4294967296\nwindow = \"1m\"",
                format!("limit must be between 1 and {max}, got 4294967296"),
            ),
            (
                "fixed_window",
                "limit = 1e30\nwindow = \"1m\"",
                "limit must be a whole number, got float".to_owned(),
            ),
        ]);
    }

    #[test]
    fn windows_at_zero_negative_or_beyond_366_days_are_refused() {
        refused([
            (
                "fixed_window",
                "limit = 1\nwindow = \"0s\"",
                "window must be longer than zero, got \"0s\"".to_owned(),
            ),
            (
                "fixed_window",
                "limit = 1\nwindow = \"-1s\"",
                "window \"-1s\" is not a duration (a whole number followed by ms, s, m, h or d)"
                    .to_owned(),
            ),
            (
                "fixed_window",
                "limit = 1\nwindow = \"367d\"",
                "window \"367d\" is longer than 366d".to_owned(),
            ),
            (
                "fixed_window",
                "limit = 1\nwindow = \"99999999999999999999s\"",
                "window \"99999999999999999999s\" is longer than 366d".to_owned(),
            ),
        ]);
    }

    #[test]
    fn rates_bursts_capacities_costs_and_days_at_zero_negative_or_beyond_are_refused() {
        let max = u32::MAX;
        refused([
            (
                "gcra",
                "rate = 0",
                format!("rate must be between 1 and {max}, got 0"),
            ),
            (
                "gcra",
                "rate = 1\nburst = -3",
                format!("burst must be between 1 and {max}, got -3"),
            ),
            (
                "leaky_bucket",
                "capacity = 0\nrate = 1",
                format!("capacity must be between 1 and {max}, got 0"),
            ),
            (
                "token_bucket",
                "capacity = 5\nrate = 1\ncost = 0",
                format!("cost must be between 1 and {max}, got 0"),
            ),
            (
                "calendar_quota",
                "window_days = 0",
                format!("window_days must be between 1 and {max}, got 0"),
            ),
            (
                "calendar_quota",
                "window_days = 367",
                "window_days (367) is more than 366".to_owned(),
            ),
        ]);
    }
}
