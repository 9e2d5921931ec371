//! The limiter kinds: one module per kind, each beside its script in `lua/kinds/`, holding its
//! validated parameters, how they are read from configuration, the arguments its script takes,
//! what its reply means and why it refuses. This module lists the kinds and hands each call to
//! the kind's own module.
//!
//! Everything is checked at load so that an invalid limiter cannot be built: zero windows, a
//! sliding log whose shorter window allows more than its longer one, a fixed cost above a
//! bucket's capacity, rates too fine for exact integer arithmetic in the scripts.

pub mod calendar;
mod calendar_quota;
mod fixed_window;
mod gcra;
mod leaky_bucket;
mod local_windows;
mod params;
mod quiet_hours;
mod send_window;
mod sliding_log;
mod sliding_window;
mod token_bucket;
mod zset_window;

use chrono::{DateTime, Utc};
use chrono_tz::Tz;
use serde::Serialize;

pub use calendar_quota::{CalendarQuota, RoomAhead};
pub use fixed_window::Window;
pub use gcra::Gcra;
pub use leaky_bucket::Bucket;
pub use params::{as_hh_mm, human_ms, parse_duration_ms};
pub use quiet_hours::QuietHours;
pub use send_window::SendWindow;
pub use sliding_log::SlidingLog;
pub use sliding_window::{SlidingWindow, Storage};
pub use token_bucket::TokenBucket;

/// A limiter kind with parameters that have passed validation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Kind {
    /// N per local calendar day and M per rolling D local days.
    CalendarQuota(CalendarQuota),
    /// N per window that starts at the first send.
    FixedWindow(Window),
    /// N per sliding window, counted in sub-windows.
    SlidingWindow(SlidingWindow),
    /// Several (limit, window) policies over one log of sub-window counters.
    SlidingLog(SlidingLog),
    /// A level that leaks at a rate; refuse at capacity.
    LeakyBucket(Bucket),
    /// Tokens refilled at a rate; a send takes its cost.
    TokenBucket(TokenBucket),
    /// The generic cell rate algorithm: a rate with a burst, exact, one key.
    Gcra(Gcra),
    /// N per sliding window, exactly, one entry per admitted send.
    ZsetWindow(Window),
    /// No sends between two local times of day.
    QuietHours(QuietHours),
    /// Sends only inside local windows per weekday.
    SendWindow(SendWindow),
}

/// Every kind name the configuration accepts, for error messages: the names of [`SOURCES`].
pub const KIND_NAMES: [&str; SOURCES.len()] = {
    let mut names = [""; SOURCES.len()];
    let mut i = 0;
    while i < SOURCES.len() {
        names[i] = SOURCES[i].0;
        i += 1;
    }
    names
};

/// Every kind's script, by the name its rules carry, in the order scripts compose them.
pub const SOURCES: [(&str, &str); 10] = [
    ("calendar_quota", calendar_quota::LUA),
    ("fixed_window", fixed_window::LUA),
    ("sliding_window", sliding_window::LUA),
    ("sliding_log", sliding_log::LUA),
    ("leaky_bucket", leaky_bucket::LUA),
    ("token_bucket", token_bucket::LUA),
    ("gcra", gcra::LUA),
    ("zset_window", zset_window::LUA),
    ("quiet_hours", quiet_hours::LUA),
    ("send_window", send_window::LUA),
];

impl Kind {
    /// The kind's name as written in configuration, keys and denial rows.
    pub fn name(&self) -> &'static str {
        match self {
            Kind::CalendarQuota(_) => "calendar_quota",
            Kind::FixedWindow(_) => "fixed_window",
            Kind::SlidingWindow(_) => "sliding_window",
            Kind::SlidingLog(_) => "sliding_log",
            Kind::LeakyBucket(_) => "leaky_bucket",
            Kind::TokenBucket(_) => "token_bucket",
            Kind::Gcra(_) => "gcra",
            Kind::ZsetWindow(_) => "zset_window",
            Kind::QuietHours(_) => "quiet_hours",
            Kind::SendWindow(_) => "send_window",
        }
    }

    /// Builds a kind from its name and the rule's remaining parameters. Errors are messages
    /// that name the offending parameter; the caller adds the rule name.
    pub fn from_params(kind: &str, params: &toml::Table) -> Result<Kind, String> {
        let mut p = params::Params {
            table: params,
            used: Vec::new(),
        };
        let built = match kind {
            "calendar_quota" => Kind::CalendarQuota(calendar_quota::parse(&mut p)?),
            "fixed_window" => Kind::FixedWindow(fixed_window::parse(&mut p)?),
            "zset_window" => Kind::ZsetWindow(zset_window::parse(&mut p)?),
            "sliding_window" => Kind::SlidingWindow(sliding_window::parse(&mut p)?),
            "sliding_log" => Kind::SlidingLog(sliding_log::parse(&mut p)?),
            "leaky_bucket" => Kind::LeakyBucket(leaky_bucket::parse(&mut p)?),
            "token_bucket" => Kind::TokenBucket(token_bucket::parse(&mut p)?),
            "gcra" => Kind::Gcra(gcra::parse(&mut p)?),
            "quiet_hours" => Kind::QuietHours(quiet_hours::parse(&mut p)?),
            "send_window" => Kind::SendWindow(send_window::parse(&mut p)?),
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

    /// The kinds whose limits a rule's `reserve` may keep slots of: the calendar quota, whose
    /// periods are local days, as the reservation's lapse is a local time of day.
    pub const RESERVABLE: [&'static str; 1] = ["calendar_quota"];

    /// The smallest of the kind's limits, for a kind of [`Kind::RESERVABLE`]: the most slots a
    /// reservation can keep.
    pub fn smallest_limit(&self) -> Option<u32> {
        match self {
            Kind::CalendarQuota(q) => Some(q.per_day.min(q.per_window)),
            _ => None,
        }
    }

    /// The kind's slice of the script's ARGV for a message a reservation of `kept` slots keeps
    /// out of the rule's last ones, decided with `off` of them taken off every limit (`kept`
    /// before the reservation lapses, none after): a refusal then also says when the message
    /// has room ([`Kind::room_ahead`]). The state is the rule's own, so the message sees every
    /// send the others made. Kinds without a reservation take their usual arguments.
    pub fn reserved_args(&self, off: u32, kept: u32, now: DateTime<Utc>, zone: Tz) -> Vec<i64> {
        match self {
            Kind::CalendarQuota(q) => calendar_quota::reserved_args(q, off, kept, now, zone),
            other => other.args(now, zone),
        }
    }

    /// When the rule has room again for a message it refused under a reservation of `kept`
    /// slots, from the refusal's raw retry value and `detail` (for a kind of
    /// [`Kind::RESERVABLE`]; `None` for the others).
    pub fn room_ahead(
        &self,
        kept: u32,
        raw: i64,
        detail: i64,
        now: DateTime<Utc>,
        zone: Tz,
    ) -> Option<RoomAhead> {
        match self {
            Kind::CalendarQuota(q) => {
                Some(calendar_quota::room_ahead(q, kept, raw, detail, now, zone))
            }
            _ => None,
        }
    }

    /// The kind's slice of the script's ARGV for a decision at `now` in `zone`.
    pub fn args(&self, now: DateTime<Utc>, zone: Tz) -> Vec<i64> {
        match self {
            Kind::CalendarQuota(q) => calendar_quota::args(q, now, zone),
            Kind::FixedWindow(w) | Kind::ZsetWindow(w) => fixed_window::args(w),
            Kind::SlidingWindow(s) => sliding_window::args(s),
            Kind::SlidingLog(l) => sliding_log::args(l),
            Kind::LeakyBucket(b) => leaky_bucket::args(b),
            Kind::TokenBucket(t) => token_bucket::args(t),
            Kind::Gcra(g) => gcra::args(g),
            Kind::QuietHours(q) => quiet_hours::args(q, now, zone),
            Kind::SendWindow(w) => send_window::args(w, now, zone),
        }
    }

    /// The instant a refusal's raw retry value (and `detail`) stands for, for a message in
    /// `zone` decided at `now` (`None` for "never").
    pub fn retry_after(
        &self,
        raw: i64,
        detail: i64,
        now: DateTime<Utc>,
        zone: Tz,
    ) -> Option<DateTime<Utc>> {
        match self {
            Kind::CalendarQuota(q) => Some(calendar_quota::retry_after(q, raw, detail, now, zone)),
            _ if raw < 0 => None,
            _ => DateTime::from_timestamp_millis(raw),
        }
    }

    /// What the rule still allows, for kinds that count (quiet hours and send windows do not).
    pub fn remaining(&self, raw: i64) -> Option<i64> {
        match self {
            Kind::QuietHours(_) | Kind::SendWindow(_) => None,
            _ => Some(raw),
        }
    }

    /// Why the rule refused, for denial rows; `detail` is the kind-specific reply field (the
    /// refusing policy of a sliding log), `cost` the message's.
    pub fn reason(&self, detail: i64, cost: u32) -> String {
        match self {
            Kind::CalendarQuota(q) => calendar_quota::reason(q),
            Kind::FixedWindow(w) => fixed_window::reason(w),
            Kind::ZsetWindow(w) => zset_window::reason(w),
            Kind::SlidingWindow(s) => sliding_window::reason(s),
            Kind::SlidingLog(l) => sliding_log::reason(l, detail),
            Kind::LeakyBucket(b) => leaky_bucket::reason(b),
            Kind::TokenBucket(t) => token_bucket::reason(t, cost),
            Kind::Gcra(g) => gcra::reason(g),
            Kind::QuietHours(q) => quiet_hours::reason(q),
            Kind::SendWindow(_) => send_window::reason(detail),
        }
    }

    /// For the kinds that refuse by the local wall clock alone (quiet hours, send windows):
    /// when the closed period `t` falls in ends in `zone`; `None` when `t` is open, and for
    /// the kinds that count, which time alone does not close. A refusal's `retry_after` is
    /// moved past these (`Evaluation::outcome`), as a rule that admits now can refuse then.
    pub fn closed_until(&self, t: DateTime<Utc>, zone: Tz) -> Option<DateTime<Utc>> {
        match self {
            Kind::QuietHours(q) => quiet_hours::quiet_until(q, t, zone),
            Kind::SendWindow(w) => send_window::closed_until(w, t, zone),
            _ => None,
        }
    }
}
