//! Priority: how urgent a message is, and what a rule does about it. A request carries a
//! [`Priority`]; a rule may exempt some priorities (they pass it, counted or not) and may
//! reserve its last slots for the higher ones until a local time of day ([`Reserve`]). This
//! module says, for one message and one rule, which of those applies ([`Treatment`]); the
//! limiter carries it out in the rule's script call. Pure: no I/O.

use chrono::{DateTime, NaiveTime, Utc};
use chrono_tz::Tz;
use serde::Serialize;

use crate::kinds::calendar;

/// How urgent a message is. Ordered: `Low < Normal < High < Critical`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Priority {
    /// Can wait, or be dropped first (a digest, a newsletter).
    Low,
    /// Everything not marked otherwise.
    #[default]
    Normal,
    /// Should not be held back by routine traffic (a reminder the user asked for).
    High,
    /// Must never be eaten by a cap (a password reset, a security alert).
    Critical,
}

impl Priority {
    /// Every priority, lowest first: the values a request and a rule may name.
    pub const ALL: [Priority; 4] = [
        Priority::Low,
        Priority::Normal,
        Priority::High,
        Priority::Critical,
    ];

    /// The name a request and configuration use.
    pub fn as_str(self) -> &'static str {
        match self {
            Priority::Low => "low",
            Priority::Normal => "normal",
            Priority::High => "high",
            Priority::Critical => "critical",
        }
    }

    /// The priority named `name`, if it is one.
    pub fn parse(name: &str) -> Option<Priority> {
        Priority::ALL.into_iter().find(|p| p.as_str() == name)
    }

    /// The names of [`Priority::ALL`], for error messages: `critical, high, normal or low`.
    pub fn names() -> String {
        let names: Vec<&str> = Priority::ALL.iter().rev().map(|p| p.as_str()).collect();
        format!(
            "{} or {}",
            names[..names.len() - 1].join(", "),
            names[names.len() - 1]
        )
    }
}

/// What a rule does about priorities: empty (the default) treats every message alike.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct PriorityRules {
    /// Priorities that pass the rule: it never refuses or delays them.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub exempt: Vec<Priority>,
    /// Whether an exempt message still counts against the rule (it takes a slot when one is
    /// free, so later messages see it); otherwise the rule ignores exempt messages entirely.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub exempt_counts: bool,
    /// The last slots of each period kept for the higher priorities until a local time.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reserve: Option<Reserve>,
}

/// The last `slots` of every limit of a rule kept for messages of priority `for_at_least` or
/// above, each local day until `until`, after which anyone may take them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Reserve {
    /// How many of the last slots are kept (taken off each limit for the others).
    pub slots: u32,
    /// The lowest priority that may take them.
    #[serde(rename = "for")]
    pub for_at_least: Priority,
    /// Local time of day at which the reservation lapses, until midnight.
    #[serde(serialize_with = "crate::kinds::as_hh_mm")]
    pub until: NaiveTime,
}

/// What one rule does with one message, by its priority.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Treatment {
    /// Decided like any message.
    Normal,
    /// Never refused; counted when the rule has room.
    ExemptCounted,
    /// Not decided by the rule at all.
    ExemptUncounted,
    /// Decided with `slots` fewer on every limit; a refusal ends by `lapse` at the latest.
    Reserved {
        /// Slots taken off each limit.
        slots: u32,
        /// When the reservation lapses (the next instant the local clock reads `until`).
        lapse: DateTime<Utc>,
    },
}

impl PriorityRules {
    /// Whether the rules treat messages by priority at all.
    pub fn is_empty(&self) -> bool {
        self.exempt.is_empty() && self.reserve.is_none()
    }

    /// Whether the rule leaves messages of `priority` out entirely (exempt, not counted).
    pub fn ignores(&self, priority: Priority) -> bool {
        !self.exempt_counts && self.exempt.contains(&priority)
    }

    /// What the rule does with a message of `priority` decided at `now` in `zone`.
    pub fn treatment(&self, priority: Priority, now: DateTime<Utc>, zone: Tz) -> Treatment {
        if self.exempt.contains(&priority) {
            return if self.exempt_counts {
                Treatment::ExemptCounted
            } else {
                Treatment::ExemptUncounted
            };
        }
        match self.reserve {
            Some(r) if priority < r.for_at_least => match lapse(r.until, now, zone) {
                Some(lapse) => Treatment::Reserved {
                    slots: r.slots,
                    lapse,
                },
                None => Treatment::Normal,
            },
            _ => Treatment::Normal,
        }
    }
}

/// When today's reservation lapses for a message decided at `now` in `zone`: the first instant
/// of the local day at which the local time reaches `until` (after the gap, when a clock change
/// skips it), or `None` when that instant has passed (the rest of the day is open to all).
pub fn lapse(until: NaiveTime, now: DateTime<Utc>, zone: Tz) -> Option<DateTime<Utc>> {
    let day = now.with_timezone(&zone).date_naive();
    let at = calendar::first_instant_from(day.and_time(until), zone)?;
    (at > now).then_some(at)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: &str) -> DateTime<Utc> {
        s.parse().expect("instant")
    }

    #[test]
    fn priorities_order_low_to_critical_and_parse_their_names() {
        assert!(Priority::Low < Priority::Normal);
        assert!(Priority::High < Priority::Critical);
        for p in Priority::ALL {
            assert_eq!(Priority::parse(p.as_str()), Some(p));
        }
        assert_eq!(Priority::parse("urgent"), None);
        assert_eq!(Priority::names(), "critical, high, normal or low");
    }

    #[test]
    fn a_reservation_holds_before_its_local_time_and_lapses_after() {
        let rules = PriorityRules {
            reserve: Some(Reserve {
                slots: 1,
                for_at_least: Priority::High,
                until: NaiveTime::from_hms_opt(18, 0, 0).expect("time"),
            }),
            ..PriorityRules::default()
        };
        let zone: Tz = "Europe/Paris".parse().expect("zone");
        let morning = t("2026-06-01T07:00:00Z"); // 09:00 in Paris
        assert_eq!(
            rules.treatment(Priority::Normal, morning, zone),
            Treatment::Reserved {
                slots: 1,
                lapse: t("2026-06-01T16:00:00Z")
            }
        );
        assert_eq!(
            rules.treatment(Priority::High, morning, zone),
            Treatment::Normal
        );
        let evening = t("2026-06-01T16:30:00Z");
        assert_eq!(
            rules.treatment(Priority::Low, evening, zone),
            Treatment::Normal
        );
    }

    #[test]
    fn a_lapse_skipped_by_the_clocks_going_forward_comes_after_the_gap() {
        // New York, 2026-03-08: 02:00 local does not exist; the day's 02:30 is 03:30 EDT.
        let zone: Tz = "America/New_York".parse().expect("zone");
        let until = NaiveTime::from_hms_opt(2, 30, 0).expect("time");
        let at = lapse(until, t("2026-03-08T05:00:00Z"), zone).expect("lapse ahead");
        assert_eq!(at, t("2026-03-08T07:00:00Z"));
    }

    #[test]
    fn exempt_priorities_pass_counted_or_not() {
        let mut rules = PriorityRules {
            exempt: vec![Priority::Critical],
            ..PriorityRules::default()
        };
        let (now, zone) = (t("2026-06-01T07:00:00Z"), chrono_tz::UTC);
        assert_eq!(
            rules.treatment(Priority::Critical, now, zone),
            Treatment::ExemptUncounted
        );
        assert!(rules.ignores(Priority::Critical));
        rules.exempt_counts = true;
        assert_eq!(
            rules.treatment(Priority::Critical, now, zone),
            Treatment::ExemptCounted
        );
        assert!(!rules.ignores(Priority::Critical));
        assert_eq!(
            rules.treatment(Priority::High, now, zone),
            Treatment::Normal
        );
    }
}
