//! send_window: sends only inside local windows per weekday, in the message's zone (business
//! hours, say). The script is `lua/kinds/send_window.lua`; whether now is inside a window and
//! when the next one opens are computed here, over [`super::local_windows`].

use chrono::{DateTime, Datelike, TimeZone, Timelike, Utc};
use chrono_tz::Tz;
use serde::Serialize;

use super::local_windows::{self, hh_mm, parse_hh_mm, WeekSpans, DAY_MINUTES, WEEKDAYS};
use super::params::Params;

/// Send windows in the recipient's zone: each weekday's windows, from a start (inclusive) to
/// an end (exclusive, `24:00` at the latest) on that day. A day without windows admits nothing;
/// windows of consecutive days that meet at midnight are one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SendWindow {
    /// Each weekday's windows (Monday first), as (start, end) minutes of the day, in order.
    #[serde(serialize_with = "as_windows")]
    pub windows: [Vec<(u32, u32)>; 7],
    /// The open spans of a week, made of the above.
    #[serde(skip)]
    spans: WeekSpans,
}

/// Prints `windows` as configuration takes it: `{ mon = ["09:00-17:30"], ... }`, in week
/// order, days without windows left out.
fn as_windows<S: serde::Serializer>(
    windows: &[Vec<(u32, u32)>; 7],
    s: S,
) -> Result<S::Ok, S::Error> {
    s.collect_map(
        windows
            .iter()
            .zip(WEEKDAYS)
            .filter(|(spans, _)| !spans.is_empty())
            .map(|(spans, day)| {
                (
                    day,
                    spans
                        .iter()
                        .map(|&(a, b)| window_text(a, b))
                        .collect::<Vec<_>>(),
                )
            }),
    )
}

fn window_text(start: u32, end: u32) -> String {
    format!("{}-{}", hh_mm(start), hh_mm(end))
}

/// The kind's script.
pub(super) const LUA: &str = include_str!("../../../lua/kinds/send_window.lua");

/// `windows = { mon = ["09:00-12:00", "13:00-17:30"], ... }`: weekday names, each with a
/// non-empty array of `HH:MM-HH:MM` windows that start before they end and do not overlap; at
/// least one day.
pub(super) fn parse(p: &mut Params<'_>) -> Result<SendWindow, String> {
    let example = "such as windows = { mon = [\"09:00-17:30\"] }";
    let days = match p.value("windows") {
        None => {
            return Err(format!(
                "windows is required (a table of weekdays, {example})"
            ))
        }
        Some(toml::Value::Table(days)) => days,
        Some(other) => {
            return Err(format!(
                "windows must be a table of weekdays, {example}, got {}",
                other.type_str()
            ))
        }
    };
    if days.is_empty() {
        return Err(format!(
            "windows has no day: a send window must open on some day, {example}"
        ));
    }
    let mut windows: [Vec<(u32, u32)>; 7] = Default::default();
    for (name, value) in days {
        let day = local_windows::weekday(name)
            .ok_or_else(|| local_windows::not_a_weekday("windows", name))?;
        windows[day] = parse_day(&format!("windows.{name}"), value)?;
    }
    let spans = WeekSpans::new(
        windows
            .iter()
            .enumerate()
            .flat_map(|(day, spans)| spans.iter().map(move |&(a, b)| (day, a, b))),
    );
    Ok(SendWindow { windows, spans })
}

/// One day's windows, sorted, from a non-empty array of `HH:MM-HH:MM` strings.
fn parse_day(field: &str, value: &toml::Value) -> Result<Vec<(u32, u32)>, String> {
    let shape = "must be an array of windows such as [\"09:00-12:00\", \"13:00-17:30\"]";
    let toml::Value::Array(entries) = value else {
        return Err(format!("{field} {shape}, got {}", value.type_str()));
    };
    if entries.is_empty() {
        return Err(format!("{field} is empty: leave the day out for no window"));
    }
    let mut windows = Vec::with_capacity(entries.len());
    for entry in entries {
        let toml::Value::String(text) = entry else {
            return Err(format!(
                "{field} {shape}, got an entry of type {}",
                entry.type_str()
            ));
        };
        let parsed = text
            .split_once('-')
            .and_then(|(a, b)| Some((parse_hh_mm(a, false)?, parse_hh_mm(b, true)?)));
        let Some((start, end)) = parsed else {
            return Err(format!(
                "{field} entry \"{text}\" is not a window HH:MM-HH:MM (such as \"09:00-17:30\")"
            ));
        };
        if end <= start {
            return Err(format!(
                "{field} entry \"{text}\" does not end after it starts: a window ends on its own \
                 day, by 24:00 (run past midnight with \"22:00-24:00\" and \"00:00-02:00\" on the \
                 next day)"
            ));
        }
        windows.push((start, end));
    }
    windows.sort_unstable();
    if let Some(pair) = windows.windows(2).find(|pair| pair[1].0 < pair[0].1) {
        return Err(format!(
            "{field} entries \"{}\" and \"{}\" overlap",
            window_text(pair[0].0, pair[0].1),
            window_text(pair[1].0, pair[1].1)
        ));
    }
    Ok(windows)
}

/// The script's arguments: whether `now` is inside a window in `zone`; if not, when the next
/// one opens, and the local weekday and minute it opens at (`weekday * 1440 + minute`, for
/// the reason); -1 for either when no window ever opens.
pub(super) fn args(w: &SendWindow, now: DateTime<Utc>, zone: Tz) -> Vec<i64> {
    match w.spans.next(now, zone, true) {
        Some(open) if open == now => vec![1, -1, -1],
        Some(open) => {
            let local = zone.from_utc_datetime(&open.naive_utc()).naive_local();
            let weekday = i64::from(local.weekday().num_days_from_monday());
            let minute = i64::from(local.time().num_seconds_from_midnight() / 60);
            vec![
                0,
                open.timestamp_millis(),
                weekday * i64::from(DAY_MINUTES) + minute,
            ]
        }
        None => vec![0, -1, -1],
    }
}

/// When the closed period `now` falls in ends (the next window opens), or `None` when `now` is
/// inside a window.
pub(super) fn closed_until(w: &SendWindow, now: DateTime<Utc>, zone: Tz) -> Option<DateTime<Utc>> {
    w.spans.next(now, zone, true).filter(|&open| open > now)
}

/// Why it refused, from the local weekday and minute the next window opens at (`detail`).
pub(super) fn reason(detail: i64) -> String {
    let day = usize::try_from(detail / i64::from(DAY_MINUTES)).ok();
    let minute = u32::try_from(detail % i64::from(DAY_MINUTES)).ok();
    match (day.and_then(|d| WEEKDAYS.get(d)), minute) {
        (Some(day), Some(minute)) if detail >= 0 => {
            format!(
                "outside send windows (next opens {day} {} local time)",
                hh_mm(minute)
            )
        }
        _ => "outside send windows".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use crate::rules::kinds::Kind;

    fn refused(params: &str) -> String {
        let table: toml::Table = params.parse().expect("TOML");
        match Kind::from_params("send_window", &table) {
            Ok(kind) => panic!("{params} was accepted: {kind:?}"),
            Err(e) => e,
        }
    }

    #[test]
    fn malformed_windows_are_refused_naming_the_day_and_the_entry() {
        let cases = [
            ("", "windows is required (a table of weekdays, such as windows = { mon = [\"09:00-17:30\"] })"),
            ("windows = [\"09:00-17:00\"]", "windows must be a table of weekdays, such as windows = { mon = [\"09:00-17:30\"] }, got array"),
            ("windows = {}", "windows has no day: a send window must open on some day, such as windows = { mon = [\"09:00-17:30\"] }"),
            ("windows = { monday = [\"09:00-17:00\"] }", "windows: unknown weekday \"monday\" (expected mon, tue, wed, thu, fri, sat or sun)"),
            ("windows = { Mon = [\"09:00-17:00\"] }", "windows: unknown weekday \"Mon\" (expected mon, tue, wed, thu, fri, sat or sun)"),
            ("windows = { mon = \"09:00-17:00\" }", "windows.mon must be an array of windows such as [\"09:00-12:00\", \"13:00-17:30\"], got string"),
            ("windows = { mon = [9] }", "windows.mon must be an array of windows such as [\"09:00-12:00\", \"13:00-17:30\"], got an entry of type integer"),
            ("windows = { mon = [] }", "windows.mon is empty: leave the day out for no window"),
            ("windows = { tue = [\"9:00-17:00\"] }", "windows.tue entry \"9:00-17:00\" is not a window HH:MM-HH:MM (such as \"09:00-17:30\")"),
            ("windows = { tue = [\"09:00\"] }", "windows.tue entry \"09:00\" is not a window HH:MM-HH:MM (such as \"09:00-17:30\")"),
            ("windows = { tue = [\"24:00-24:00\"] }", "windows.tue entry \"24:00-24:00\" is not a window HH:MM-HH:MM (such as \"09:00-17:30\")"),
            ("windows = { tue = [\"09:00-24:30\"] }", "windows.tue entry \"09:00-24:30\" is not a window HH:MM-HH:MM (such as \"09:00-17:30\")"),
            ("windows = { sat = [\"22:00-02:00\"] }", "windows.sat entry \"22:00-02:00\" does not end after it starts: a window ends on its own day, by 24:00 (run past midnight with \"22:00-24:00\" and \"00:00-02:00\" on the next day)"),
            ("windows = { sat = [\"10:00-10:00\"] }", "windows.sat entry \"10:00-10:00\" does not end after it starts: a window ends on its own day, by 24:00 (run past midnight with \"22:00-24:00\" and \"00:00-02:00\" on the next day)"),
            ("windows = { wed = [\"13:00-17:00\", \"09:00-13:30\"] }", "windows.wed entries \"09:00-13:30\" and \"13:00-17:00\" overlap"),
            ("windows = { mon = [\"09:00-17:00\"] }\nstart = \"09:00\"", "unknown parameter `start` for kind send_window"),
        ];
        for (params, expected) in cases {
            assert_eq!(refused(params), expected, "{params}");
        }
    }

    #[test]
    fn windows_that_touch_are_accepted_and_printed_back_in_week_order() {
        let table: toml::Table =
            "windows = { sun = [\"00:00-02:00\"], mon = [\"13:00-17:30\", \"09:00-13:00\"], sat = [\"22:00-24:00\"] }"
                .parse()
                .expect("TOML");
        let kind = Kind::from_params("send_window", &table).expect("valid");
        let printed = toml::to_string(&kind).expect("TOML");
        assert_eq!(
            printed,
            "kind = \"send_window\"\n\n[windows]\nmon = [\"09:00-13:00\", \"13:00-17:30\"]\n\
             sat = [\"22:00-24:00\"]\nsun = [\"00:00-02:00\"]\n"
        );
    }

    #[test]
    fn the_reason_names_the_next_opening_in_local_time() {
        assert_eq!(
            super::reason(9 * 60),
            "outside send windows (next opens mon 09:00 local time)"
        );
        assert_eq!(
            super::reason(6 * 1440 + 3 * 60),
            "outside send windows (next opens sun 03:00 local time)"
        );
        assert_eq!(super::reason(-1), "outside send windows");
    }
}
