//! quiet_hours: no sends between two local times of day, in the message's zone. The script is
//! `lua/kinds/quiet_hours.lua`; when the period ends is computed here, with chrono-tz.

use chrono::{DateTime, Duration, NaiveTime, Utc};
use chrono_tz::Tz;
use serde::Serialize;

use super::params::{as_hh_mm, Params};

/// Quiet hours in the recipient's zone: quiet from `start` (inclusive) to `end` (exclusive),
/// wrapping midnight when `end` is earlier than `start`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct QuietHours {
    /// Local time the quiet period starts.
    #[serde(serialize_with = "as_hh_mm")]
    pub start: NaiveTime,
    /// Local time it ends.
    #[serde(serialize_with = "as_hh_mm")]
    pub end: NaiveTime,
}

/// The kind's script.
pub(super) const LUA: &str = include_str!("../../lua/kinds/quiet_hours.lua");

/// A start and an end, as HH:MM local times, not the same.
pub(super) fn parse(p: &mut Params<'_>) -> Result<QuietHours, String> {
    let mut time = |name: &'static str| -> Result<NaiveTime, String> {
        let text = p
            .string(name)?
            .ok_or_else(|| format!("{name} is required (a local time such as \"22:00\")"))?;
        NaiveTime::parse_from_str(&text, "%H:%M")
            .map_err(|_| format!("{name} \"{text}\" is not a time of day as HH:MM"))
    };
    let q = QuietHours {
        start: time("start")?,
        end: time("end")?,
    };
    if q.start == q.end {
        return Err("start and end are the same time: the quiet period would be empty".to_owned());
    }
    Ok(q)
}

/// The script's arguments: whether `now` is quiet in `zone`, and until when.
pub(super) fn args(q: &QuietHours, now: DateTime<Utc>, zone: Tz) -> Vec<i64> {
    match quiet_until(q, now, zone) {
        Some(end) => vec![1, end.timestamp_millis()],
        None => vec![0, -1],
    }
}

/// Whether local wall time `time` falls in the quiet period.
fn is_quiet(q: &QuietHours, time: NaiveTime) -> bool {
    if q.start < q.end {
        q.start <= time && time < q.end
    } else {
        time >= q.start || time < q.end
    }
}

/// The longest a quiet period can last, wall-clock changes included.
const MAX_QUIET_MINUTES: i64 = 48 * 60;

/// When the quiet period `now` falls in ends, or `None` when `now` is not quiet.
///
/// The end is the first instant at or after `now` whose local time is outside the period: the
/// local end time, or earlier when the clocks fall back out of the period, or later when a
/// clock change skips the open time. Offsets and transitions fall on whole minutes in every
/// zone's current rules, so whole UTC minutes are the only candidates.
pub fn quiet_until(q: &QuietHours, now: DateTime<Utc>, zone: Tz) -> Option<DateTime<Utc>> {
    let local_time = |t: DateTime<Utc>| t.with_timezone(&zone).time();
    if !is_quiet(q, local_time(now)) {
        return None;
    }
    let minute = now.timestamp().div_euclid(60) * 60;
    let first = DateTime::from_timestamp(minute, 0).unwrap_or(now) + Duration::minutes(1);
    (0..MAX_QUIET_MINUTES)
        .map(|m| first + Duration::minutes(m))
        .find(|&t| !is_quiet(q, local_time(t)))
        .or(Some(now + Duration::minutes(MAX_QUIET_MINUTES)))
}

/// Why it refused.
pub(super) fn reason(q: &QuietHours) -> String {
    format!(
        "quiet hours {} to {} local time",
        q.start.format("%H:%M"),
        q.end.format("%H:%M")
    )
}
