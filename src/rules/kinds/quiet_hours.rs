//! quiet_hours: no sends between two local times of day, in the message's zone, every day or
//! on the weekdays `days` lists. The script is `lua/kinds/quiet_hours.lua`; whether now is
//! quiet and when the period ends are computed here, over [`super::local_windows`].

use chrono::{DateTime, Duration, NaiveTime, TimeZone, Timelike, Utc};
use chrono_tz::Tz;
use serde::Serialize;

use super::local_windows::{self, WeekSpans, WEEKDAYS};
use super::params::{as_hh_mm, Params};

/// Quiet hours in the recipient's zone: quiet from `start` (inclusive) to `end` (exclusive),
/// wrapping midnight when `end` is earlier than `start`. A quiet period belongs to the local
/// weekday on which it starts: 22:00 to 07:00 on `fri` is quiet from Friday 22:00 to Saturday
/// 07:00.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct QuietHours {
    /// Local time the quiet period starts.
    #[serde(serialize_with = "as_hh_mm")]
    pub start: NaiveTime,
    /// Local time it ends.
    #[serde(serialize_with = "as_hh_mm")]
    pub end: NaiveTime,
    /// The weekdays (Monday = 0) on which a quiet period starts, when the rule names them
    /// (printed back in week order); every day when `None`.
    #[serde(
        skip_serializing_if = "Option::is_none",
        serialize_with = "as_weekdays"
    )]
    pub days: Option<Vec<usize>>,
    /// The quiet periods of a week, made of the above.
    #[serde(skip)]
    spans: WeekSpans,
}

fn as_weekdays<S: serde::Serializer>(days: &Option<Vec<usize>>, s: S) -> Result<S::Ok, S::Error> {
    let names: Vec<&str> = days.iter().flatten().map(|&d| WEEKDAYS[d]).collect();
    s.collect_seq(names)
}

/// The kind's script.
pub(super) const LUA: &str = include_str!("../../../lua/kinds/quiet_hours.lua");

/// A start and an end, as HH:MM local times, not the same; optionally the weekdays, each once.
pub(super) fn parse(p: &mut Params<'_>) -> Result<QuietHours, String> {
    let mut time = |name: &'static str| -> Result<NaiveTime, String> {
        let text = p
            .string(name)?
            .ok_or_else(|| format!("{name} is required (a local time such as \"22:00\")"))?;
        NaiveTime::parse_from_str(&text, "%H:%M")
            .map_err(|_| format!("{name} \"{text}\" is not a time of day as HH:MM"))
    };
    let (start, end) = (time("start")?, time("end")?);
    if start == end {
        return Err("start and end are the same time: the quiet period would be empty".to_owned());
    }
    let days = match p.value("days") {
        None => None,
        Some(value) => Some(parse_days(value)?),
    };
    let minutes = |t: NaiveTime| t.num_seconds_from_midnight() / 60;
    let every_day: Vec<usize> = (0..WEEKDAYS.len()).collect();
    let spans = WeekSpans::new(
        days.as_ref()
            .unwrap_or(&every_day)
            .iter()
            .map(|&d| (d, minutes(start), minutes(end))),
    );
    Ok(QuietHours {
        start,
        end,
        days,
        spans,
    })
}

/// `days = ["fri", "sat"]`: weekday names, each once, at least one; in week order.
fn parse_days(value: &toml::Value) -> Result<Vec<usize>, String> {
    let shape = || "days must be an array of weekday names such as [\"fri\", \"sat\"]";
    let toml::Value::Array(names) = value else {
        return Err(format!("{}, got {}", shape(), value.type_str()));
    };
    if names.is_empty() {
        return Err("days is empty: leave it out for quiet hours every day".to_owned());
    }
    let mut days = Vec::with_capacity(names.len());
    for name in names {
        let toml::Value::String(name) = name else {
            return Err(format!(
                "{}, got an entry of type {}",
                shape(),
                name.type_str()
            ));
        };
        let day = local_windows::weekday(name)
            .ok_or_else(|| local_windows::not_a_weekday("days", name))?;
        if days.contains(&day) {
            return Err(format!("days lists \"{name}\" twice"));
        }
        days.push(day);
    }
    days.sort_unstable();
    Ok(days)
}

/// The script's arguments: whether `now` is quiet in `zone`, and until when.
pub(super) fn args(q: &QuietHours, now: DateTime<Utc>, zone: Tz) -> Vec<i64> {
    match quiet_until(q, now, zone) {
        Some(end) => vec![1, end.timestamp_millis()],
        None => vec![0, -1],
    }
}

/// The longest a quiet period can last, wall-clock changes included.
const MAX_QUIET_MINUTES: i64 = 48 * 60;

/// When the quiet period `now` falls in ends, or `None` when `now` is not quiet.
///
/// The end is the first instant at or after `now` whose local wall time is outside the
/// period: the local end time, or earlier when the clocks fall back out of the period, or
/// later when a clock change skips the open time (see [`local_windows`]).
pub fn quiet_until(q: &QuietHours, now: DateTime<Utc>, zone: Tz) -> Option<DateTime<Utc>> {
    if !q
        .spans
        .contains(zone.from_utc_datetime(&now.naive_utc()).naive_local())
    {
        return None;
    }
    // A quiet period is shorter than a day of wall time, so it always ends; the bound is for
    // a zone whose rules say otherwise.
    let bound = now + Duration::minutes(MAX_QUIET_MINUTES);
    Some(q.spans.next(now, zone, false).unwrap_or(bound))
}

/// Why it refused.
pub(super) fn reason(q: &QuietHours) -> String {
    let days = match &q.days {
        Some(days) => {
            let names: Vec<&str> = days.iter().map(|&d| WEEKDAYS[d]).collect();
            format!(" starting on {}", names.join(", "))
        }
        None => String::new(),
    };
    format!(
        "quiet hours {} to {} local time{days}",
        q.start.format("%H:%M"),
        q.end.format("%H:%M")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::kinds::Kind;

    fn quiet(params: &str) -> Result<Kind, String> {
        let table: toml::Table = params.parse().expect("TOML");
        Kind::from_params("quiet_hours", &table)
    }

    #[test]
    fn days_are_weekday_names_each_once_and_not_none() {
        let hours = "start = \"22:00\"\nend = \"07:00\"\n";
        let cases = [
            ("days = \"fri\"", "days must be an array of weekday names such as [\"fri\", \"sat\"], got string"),
            ("days = [5]", "days must be an array of weekday names such as [\"fri\", \"sat\"], got an entry of type integer"),
            ("days = []", "days is empty: leave it out for quiet hours every day"),
            ("days = [\"friday\"]", "days: unknown weekday \"friday\" (expected mon, tue, wed, thu, fri, sat or sun)"),
            ("days = [\"Fri\"]", "days: unknown weekday \"Fri\" (expected mon, tue, wed, thu, fri, sat or sun)"),
            ("days = [\"fri\", \"sat\", \"fri\"]", "days lists \"fri\" twice"),
        ];
        for (days, expected) in cases {
            assert_eq!(
                quiet(&format!("{hours}{days}")),
                Err(expected.to_owned()),
                "{days}"
            );
        }
    }

    #[test]
    fn a_quiet_period_belongs_to_the_weekday_it_starts_on() {
        let Ok(Kind::QuietHours(q)) =
            quiet("start = \"22:00\"\nend = \"07:00\"\ndays = [\"sat\", \"fri\"]")
        else {
            panic!("valid");
        };
        let at = |s: &str| s.parse::<DateTime<Utc>>().expect("instant");
        let zone = chrono_tz::UTC;
        // 2026-03-13 is a Friday.
        for (now, until) in [
            ("2026-03-12T23:00:00Z", None), // Thursday night
            ("2026-03-13T06:00:00Z", None), // Friday morning
            ("2026-03-13T22:00:00Z", Some("2026-03-14T07:00:00Z")), // Friday night
            ("2026-03-14T23:30:00Z", Some("2026-03-15T07:00:00Z")), // Saturday night
            ("2026-03-15T06:59:00Z", Some("2026-03-15T07:00:00Z")), // Sunday morning
            ("2026-03-15T22:00:00Z", None), // Sunday night
        ] {
            assert_eq!(quiet_until(&q, at(now), zone), until.map(at), "{now}");
        }
        assert_eq!(q.days, Some(vec![4, 5]), "kept in week order");
        assert_eq!(
            reason(&q),
            "quiet hours 22:00 to 07:00 local time starting on fri, sat"
        );
    }
}
