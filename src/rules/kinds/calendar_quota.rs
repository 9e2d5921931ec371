//! calendar_quota: at most `per_day` sends per local calendar day and `per_window` per
//! `window_days` local days, in the zone of the message being decided (the headline rule is 1
//! and 3 in 7). The script is `lua/kinds/calendar_quota.lua`; local days are
//! [`super::calendar`]'s.

use chrono::{DateTime, Utc};
use chrono_tz::Tz;
use serde::Serialize;

use super::calendar::{self, day_number, day_start, DayNumber};
use super::params::Params;

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

/// The kind's script.
pub(super) const LUA: &str = include_str!("../../../lua/kinds/calendar_quota.lua");

/// The parameters from a rule's table (the headline rule's by default), per_day no larger
/// than per_window and the window at most a year.
pub(super) fn parse(p: &mut Params<'_>) -> Result<CalendarQuota, String> {
    let d = CalendarQuota::HEADLINE;
    let q = CalendarQuota {
        per_day: p.positive("per_day", Some(d.per_day))?,
        per_window: p.positive("per_window", Some(d.per_window))?,
        window_days: p.positive("window_days", Some(d.window_days))?,
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
    Ok(q)
}

/// The script's arguments for a decision at `now` in `zone`: today's day number (for entries
/// kept as day numbers), the first instants of today and of the window in `zone`, the limits,
/// the instants before which no zone's window reaches (entries are forgotten, the key
/// expires), and the first instant of tomorrow: today's count and the window's end there, so
/// that a decision (a what-if above all) at an instant before later sends does not count them.
pub(super) fn args(q: &CalendarQuota, now: DateTime<Utc>, zone: Tz) -> Vec<i64> {
    let today = day_number(now, zone);
    let days = i64::from(q.window_days);
    let reach = calendar::window_reach(q.window_days);
    vec![
        today,
        day_start(today, zone).timestamp_millis(),
        day_start(today - days + 1, zone).timestamp_millis(),
        i64::from(q.per_day),
        i64::from(q.per_window),
        days,
        (now - reach).timestamp_millis(),
        reach.num_milliseconds(),
        day_start(today + 1, zone).timestamp_millis(),
    ]
}

/// The first instant with room, from a refusal's reply (see
/// [`calendar::first_day_with_room`]).
pub(super) fn retry_after(
    q: &CalendarQuota,
    raw: i64,
    detail: i64,
    now: DateTime<Utc>,
    zone: Tz,
) -> DateTime<Utc> {
    day_start(
        calendar::first_day_with_room(q, raw, detail == 1, now, zone),
        zone,
    )
}

/// [`args`] for a message a reservation of `kept` slots keeps out of the rule's last ones,
/// decided with `off` slots taken off both limits (`kept` before the day's lapse, none after):
/// the script then also says, on a refusal, what the days ahead need under the full limits and
/// under the reduced ones ([`room_ahead`]), since the reservation applies again every morning.
pub(super) fn reserved_args(
    q: &CalendarQuota,
    off: u32,
    kept: u32,
    now: DateTime<Utc>,
    zone: Tz,
) -> Vec<i64> {
    let mut args = args(q, now, zone);
    args.extend([i64::from(off), i64::from(kept)]);
    args
}

/// When a calendar quota that keeps slots from a message has room for it, as a refusal's reply
/// to [`reserved_args`] says, nothing else being sent meanwhile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoomAhead {
    /// Whether the full limits have room today (the rest of today after the lapse is open).
    pub today: bool,
    /// The first day after today on which the full limits have room.
    pub full_from: DayNumber,
    /// The first day after today on which the limits less the kept slots have room; `None`
    /// when they never do (the kept slots are the whole daily limit).
    pub reduced_from: Option<DayNumber>,
}

/// [`RoomAhead`] from a refusal's reply to [`reserved_args`] with `kept` slots: `raw` is the
/// entry whose leaving makes room under the reduced limits, `detail` packs whether today has
/// room under the full limits and the entry whose leaving makes room under them (see
/// `lua/kinds/calendar_quota.lua`). Later days hold no send yet, so only the window decides
/// them.
pub(super) fn room_ahead(
    q: &CalendarQuota,
    kept: u32,
    raw: i64,
    detail: i64,
    now: DateTime<Utc>,
    zone: Tz,
) -> RoomAhead {
    let full_entry = detail.div_euclid(2) - 1;
    RoomAhead {
        today: detail.rem_euclid(2) == 1,
        full_from: calendar::first_day_with_room(q, full_entry, false, now, zone),
        reduced_from: (q.per_day > kept)
            .then(|| calendar::first_day_with_room(q, raw, false, now, zone)),
    }
}

/// Why it refused.
pub(super) fn reason(q: &CalendarQuota) -> String {
    format!(
        "at most {} per local day and {} per {} local days",
        q.per_day, q.per_window, q.window_days
    )
}
