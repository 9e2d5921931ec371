//! Arguments and results of `lua/calendar_quota.lua`: day numbers in, day starts out.

use chrono::{DateTime, Utc};
use chrono_tz::Tz;

use super::calendar::{day_number, day_start};
use crate::policy::CalendarQuota;

/// The script's arguments for a decision at `now` in `zone`: today's day number, the limits,
/// and how long from `now` today's entry matters (until the first instant of day today +
/// window).
pub fn args(q: &CalendarQuota, now: DateTime<Utc>, zone: Tz) -> [i64; 5] {
    let today = day_number(now, zone);
    let expire_in = day_start(today + i64::from(q.window_days), zone) - now;
    [
        today,
        i64::from(q.per_day),
        i64::from(q.per_window),
        i64::from(q.window_days),
        expire_in.num_milliseconds(),
    ]
}

/// The instant the script's retry day begins.
pub fn retry_after(retry_day: i64, zone: Tz) -> Option<DateTime<Utc>> {
    (retry_day >= 0).then(|| day_start(retry_day, zone))
}

/// The denial reason for this rule.
pub fn reason(q: &CalendarQuota) -> String {
    format!(
        "at most {} per local day and {} per {} local days",
        q.per_day, q.per_window, q.window_days
    )
}
