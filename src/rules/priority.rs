//! Priority: how urgent a message is, and what a rule does about it. A request carries a
//! [`Priority`]; a rule may exempt some priorities (they pass it, counted or not) and may
//! reserve its last slots for the higher ones until a local time of day ([`Reserve`]). This
//! module says, for one message and one rule, which of those applies ([`Treatment`]), and when
//! a refusal under a reservation ends ([`Kept::first_admitted`]); the limiter carries it out in
//! the rule's script call. Pure: no I/O.

use chrono::{DateTime, NaiveTime, Utc};
use chrono_tz::Tz;
use serde::Serialize;

use crate::request::priority::Priority;
use crate::rules::kinds::calendar::{self, DayNumber};
use crate::rules::kinds::{Kind, RoomAhead};

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
    #[serde(serialize_with = "crate::rules::kinds::as_hh_mm")]
    pub until: NaiveTime,
}

/// What one rule does with one message, by its priority.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Treatment {
    /// Decided like any message.
    Normal,
    /// Never refused; counted when the rule has room for it: not in the slots a reservation
    /// keeps from its priority (`Some`), which are not free for it.
    ExemptCounted(Option<Kept>),
    /// Not decided by the rule at all.
    ExemptUncounted,
    /// Below the reservation's priority: decided with the kept slots off every limit until
    /// today's lapse, and a refusal lasts until the first instant that admits it, the
    /// reservation holding again every morning.
    Reserved(Kept),
}

/// A rule's reservation as it bears on one message below its priority.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kept {
    /// Slots kept from the message: off every limit until the lapse, each day.
    pub slots: u32,
    /// Local time of day at which the reservation lapses.
    pub until: NaiveTime,
    /// Today's lapse while it is ahead (the slots are off the limits now); `None` once it has
    /// passed, when the full limits decide the rest of the day.
    pub lapse: Option<DateTime<Utc>>,
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
        let kept = self
            .reserve
            .filter(|r| priority < r.for_at_least)
            .map(|r| Kept {
                slots: r.slots,
                until: r.until,
                lapse: lapse(r.until, now, zone),
            });
        match (self.exempt.contains(&priority), self.exempt_counts, kept) {
            (true, true, kept) => Treatment::ExemptCounted(kept),
            (true, false, _) => Treatment::ExemptUncounted,
            (false, _, Some(kept)) => Treatment::Reserved(kept),
            (false, _, None) => Treatment::Normal,
        }
    }
}

impl Treatment {
    /// The reservation that keeps slots from the message, if one does.
    pub fn kept(&self) -> Option<Kept> {
        match *self {
            Treatment::ExemptCounted(kept) => kept,
            Treatment::Reserved(kept) => Some(kept),
            Treatment::Normal | Treatment::ExemptUncounted => None,
        }
    }

    /// Whether the rule's refusal holds the message back: not for an exempt message that
    /// counts, which the script decides as a shadow rule's (taken when there is room).
    pub fn enforced(&self) -> bool {
        !matches!(self, Treatment::ExemptCounted(_))
    }

    /// Whether the message is exempt from the rule, which still counts it.
    pub fn exempt_counted(&self) -> bool {
        matches!(self, Treatment::ExemptCounted(_))
    }

    /// Until when the kept slots are off the limits for this message (today's lapse, while
    /// ahead).
    pub fn reserved_until(&self) -> Option<DateTime<Utc>> {
        self.kept().and_then(|k| k.lapse)
    }

    /// The rule's script arguments for this message: `kind`'s, with the kept slots off its
    /// limits while they are kept.
    pub fn args(&self, kind: &Kind, now: DateTime<Utc>, zone: Tz) -> Vec<i64> {
        match self.kept() {
            Some(k) => kind.reserved_args(k.off(), k.slots, now, zone),
            None => kind.args(now, zone),
        }
    }

    /// When a rule of `kind` that refused the message at `now` admits it, from the refusal's
    /// raw retry value and `detail` (`None` for never): the kind's own answer, or, when a
    /// reservation keeps slots from the message, [`Kept::first_admitted`].
    pub fn retry_after(
        &self,
        kind: &Kind,
        raw: i64,
        detail: i64,
        now: DateTime<Utc>,
        zone: Tz,
    ) -> Option<DateTime<Utc>> {
        match self.kept() {
            Some(k) => match kind.room_ahead(k.slots, raw, detail, now, zone) {
                Some(room) => Some(k.first_admitted(room, zone)),
                None => kind.retry_after(raw, detail, now, zone),
            },
            None => kind.retry_after(raw, detail, now, zone),
        }
    }
}

impl Kept {
    /// The slots off the limits now: all of them before today's lapse, none after.
    pub fn off(&self) -> u32 {
        if self.lapse.is_some() {
            self.slots
        } else {
            0
        }
    }

    /// The first instant at which a rule that refused the message admits it, with `room` as
    /// its refusal said, nothing else being sent meanwhile. The rule has room for the message
    /// on a day from its first instant when the reduced limits have room, from the lapse when
    /// only the full limits do: so today's lapse when the full limits have room today, else
    /// the first later day on which the full limits have room, from its first instant if the
    /// reduced ones have room then too, from its lapse otherwise (the reduced limits have
    /// room on no earlier day than the full ones).
    pub fn first_admitted(&self, room: RoomAhead, zone: Tz) -> DateTime<Utc> {
        if let (Some(lapse), true) = (self.lapse, room.today) {
            return lapse;
        }
        let day = room.full_from;
        if room.reduced_from.is_some_and(|d| d <= day) {
            return calendar::day_start(day, zone);
        }
        lapse_on(day, self.until, zone)
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

/// When the reservation lapses on local day `day` of `zone`: the first instant of the day at
/// which the local time reaches `until` (the day's first instant when no time of it does).
fn lapse_on(day: DayNumber, until: NaiveTime, zone: Tz) -> DateTime<Utc> {
    let start = calendar::day_start(day, zone);
    let date = start.with_timezone(&zone).date_naive();
    calendar::first_instant_from(date.and_time(until), zone).map_or(start, |at| at.max(start))
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
        let until = NaiveTime::from_hms_opt(18, 0, 0).expect("time");
        let morning_treatment = rules.treatment(Priority::Normal, morning, zone);
        assert_eq!(
            morning_treatment,
            Treatment::Reserved(Kept {
                slots: 1,
                until,
                lapse: Some(t("2026-06-01T16:00:00Z"))
            })
        );
        assert_eq!(morning_treatment.kept().map(|k| k.off()), Some(1));
        assert_eq!(
            rules.treatment(Priority::High, morning, zone),
            Treatment::Normal
        );
        // After the lapse the full limits decide, and the reservation is still known: it
        // holds again tomorrow morning.
        let evening = t("2026-06-01T16:30:00Z");
        let evening_treatment = rules.treatment(Priority::Low, evening, zone);
        assert_eq!(
            evening_treatment,
            Treatment::Reserved(Kept {
                slots: 1,
                until,
                lapse: None
            })
        );
        assert_eq!(evening_treatment.kept().map(|k| k.off()), Some(0));
        assert_eq!(evening_treatment.reserved_until(), None);
    }

    #[test]
    fn a_lapse_skipped_by_the_clocks_going_forward_comes_after_the_gap() {
        // New York, 2026-03-08: 02:00 local does not exist; the day's 02:30 is 03:30 EDT.
        let zone: Tz = "America/New_York".parse().expect("zone");
        let until = NaiveTime::from_hms_opt(2, 30, 0).expect("time");
        let at = lapse(until, t("2026-03-08T05:00:00Z"), zone).expect("lapse ahead");
        assert_eq!(at, t("2026-03-08T07:00:00Z"));
    }

    fn headline_reserve(lapse: Option<&str>) -> Kept {
        Kept {
            slots: 1,
            until: NaiveTime::from_hms_opt(18, 0, 0).expect("time"),
            lapse: lapse.map(t),
        }
    }

    #[test]
    fn a_refusal_under_a_reservation_ends_at_the_first_instant_that_admits() {
        let zone = chrono_tz::UTC;
        let today = calendar::day_number(t("2026-06-01T10:00:00Z"), zone);
        let room = |today_open, full_from, reduced_from| RoomAhead {
            today: today_open,
            full_from,
            reduced_from,
        };
        let before = headline_reserve(Some("2026-06-01T18:00:00Z"));
        // The full limits have room today: the lapse.
        assert_eq!(
            before.first_admitted(room(true, today + 1, Some(today + 1)), zone),
            t("2026-06-01T18:00:00Z")
        );
        // Today is full, tomorrow's reduced limits have room: tomorrow's first instant.
        assert_eq!(
            before.first_admitted(room(false, today + 1, Some(today + 1)), zone),
            t("2026-06-02T00:00:00Z")
        );
        // The kept slot is the day's only one: tomorrow's lapse (the README's headline rule).
        assert_eq!(
            before.first_admitted(room(false, today + 1, None), zone),
            t("2026-06-02T18:00:00Z")
        );
        // The window frees one slot in three days: that day's lapse, whether decided before
        // or after today's.
        let after = headline_reserve(None);
        for kept in [before, after] {
            assert_eq!(
                kept.first_admitted(room(false, today + 3, Some(today + 4)), zone),
                t("2026-06-04T18:00:00Z")
            );
        }
    }

    #[test]
    fn an_exempt_message_that_counts_is_kept_out_of_the_reserved_slots_too() {
        let rules = PriorityRules {
            exempt: vec![Priority::High],
            exempt_counts: true,
            reserve: Some(Reserve {
                slots: 1,
                for_at_least: Priority::Critical,
                until: NaiveTime::from_hms_opt(9, 0, 0).expect("time"),
            }),
        };
        let (now, zone) = (t("2026-06-01T07:00:00Z"), chrono_tz::UTC);
        let high = rules.treatment(Priority::High, now, zone);
        assert!(!high.enforced() && high.exempt_counted());
        assert_eq!(high.kept().map(|k| k.off()), Some(1));
        assert_eq!(high.reserved_until(), Some(t("2026-06-01T09:00:00Z")));
        assert_eq!(
            rules.treatment(Priority::Critical, now, zone),
            Treatment::Normal
        );
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
            Treatment::ExemptCounted(None)
        );
        assert!(!rules.treatment(Priority::Critical, now, zone).enforced());
        assert!(!rules.ignores(Priority::Critical));
        assert_eq!(
            rules.treatment(Priority::High, now, zone),
            Treatment::Normal
        );
    }
}
