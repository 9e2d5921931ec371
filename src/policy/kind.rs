//! Limiter kinds and their validated parameters.

use serde::Serialize;

/// A limiter kind with parameters that have passed validation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Kind {
    /// N per local calendar day and M per rolling D local days.
    CalendarQuota(CalendarQuota),
}

/// Parameters of the calendar quota (the headline rule is 1 per day, 3 per 7 days).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct CalendarQuota {
    /// Sends allowed per local calendar day.
    pub per_day: u32,
    /// Sends allowed per `window_days` consecutive local days (today included).
    pub per_window: u32,
    /// Length of the rolling window, in local days.
    pub window_days: u32,
}

/// The longest calendar window accepted; a year keeps day arithmetic and key lifetimes sane.
const MAX_WINDOW_DAYS: u32 = 366;

impl CalendarQuota {
    /// The headline rule: one message per calendar day and three per seven days.
    pub const HEADLINE: CalendarQuota = CalendarQuota {
        per_day: 1,
        per_window: 3,
        window_days: 7,
    };
}

/// Every kind name the configuration accepts, for error messages.
pub const KIND_NAMES: &[&str] = &["calendar_quota"];

impl Kind {
    /// The kind's name as written in configuration, keys and denial rows.
    pub fn name(&self) -> &'static str {
        match self {
            Kind::CalendarQuota(_) => "calendar_quota",
        }
    }

    /// Builds a kind from its name and the rule's remaining parameters. Errors are messages
    /// that name the offending parameter; the caller adds the rule name.
    pub(super) fn from_params(kind: &str, params: &toml::Table) -> Result<Kind, String> {
        let mut p = Params {
            table: params,
            used: Vec::new(),
        };
        let built = match kind {
            "calendar_quota" => {
                let d = CalendarQuota::HEADLINE;
                let q = CalendarQuota {
                    per_day: p.positive("per_day", d.per_day)?,
                    per_window: p.positive("per_window", d.per_window)?,
                    window_days: p.positive("window_days", d.window_days)?,
                };
                if q.per_day > q.per_window {
                    return Err(format!(
                        "per_day ({}) is larger than per_window ({})",
                        q.per_day, q.per_window
                    ));
                }
                if q.window_days > MAX_WINDOW_DAYS {
                    return Err(format!(
                        "window_days ({}) is more than {MAX_WINDOW_DAYS}",
                        q.window_days
                    ));
                }
                Kind::CalendarQuota(q)
            }
            other => {
                return Err(format!(
                    "unknown kind \"{other}\" (known kinds: {})",
                    KIND_NAMES.join(", ")
                ))
            }
        };
        p.reject_unused(kind)?;
        Ok(built)
    }
}

/// Reads typed parameters from a rule's table and remembers which ones were read, so that a
/// misspelt parameter is an error instead of a silently ignored default.
struct Params<'t> {
    table: &'t toml::Table,
    used: Vec<&'static str>,
}

impl Params<'_> {
    fn positive(&mut self, name: &'static str, default: u32) -> Result<u32, String> {
        self.used.push(name);
        match self.table.get(name) {
            None => Ok(default),
            Some(toml::Value::Integer(n)) if *n >= 1 && *n <= i64::from(u32::MAX) => Ok(*n as u32),
            Some(toml::Value::Integer(n)) => Err(format!("{name} must be at least 1, got {n}")),
            Some(other) => Err(format!(
                "{name} must be a whole number, got {}",
                other.type_str()
            )),
        }
    }

    fn reject_unused(&self, kind: &str) -> Result<(), String> {
        match self.table.keys().find(|k| !self.used.contains(&k.as_str())) {
            Some(k) => Err(format!("unknown parameter `{k}` for kind {kind}")),
            None => Ok(()),
        }
    }
}
