//! Spans of the local week, for the kinds that refuse by the wall clock alone (quiet_hours,
//! send_window): their configuration's weekdays and times of day, whether a local wall time
//! falls in a span, and when, in a zone, the wall clock next enters or leaves the spans.
//!
//! Both kinds are defined by the wall clock: an instant is in a span when the local date and
//! time it reads in the message's zone are. So a span whose start a spring-forward skips opens
//! at the first instant after the gap (if the span is not over by then), a span wholly inside
//! the gap does not happen that day, and local times that a fall-back repeats are in the span
//! both times. A weekday a zone skipped (Pacific/Apia, Friday 2011-12-30) has no spans that
//! week.

use chrono::{DateTime, Datelike, Duration, NaiveDateTime, Offset, TimeZone, Timelike, Utc};
use chrono_tz::Tz;

/// Minutes in a day, and the end of the day as a time of day (`24:00`).
pub(super) const DAY_MINUTES: u32 = 24 * 60;

const DAY_MS: i64 = 86_400_000;
const WEEK_MS: i64 = 7 * DAY_MS;

/// The weekday names configuration takes, Monday first (index = chrono's
/// `num_days_from_monday`).
pub(super) const WEEKDAYS: [&str; 7] = ["mon", "tue", "wed", "thu", "fri", "sat", "sun"];

/// How configuration's weekday errors end: the names it takes.
const WEEKDAYS_EXPECTED: &str = "expected mon, tue, wed, thu, fri, sat or sun";

/// The index (Monday = 0) of a weekday as configuration writes it: three lowercase letters.
pub(super) fn weekday(name: &str) -> Option<usize> {
    WEEKDAYS.iter().position(|d| *d == name)
}

/// The error for a name that is not a weekday, in `field`.
pub(super) fn not_a_weekday(field: &str, name: &str) -> String {
    format!("{field}: unknown weekday \"{name}\" ({WEEKDAYS_EXPECTED})")
}

/// A time of day written `HH:MM` (two digits each), as minutes since midnight; `24:00`, the
/// end of the day, only when `end_of_day` allows it (the end of a send window).
pub(super) fn parse_hh_mm(text: &str, end_of_day: bool) -> Option<u32> {
    let (h, m) = text.split_once(':')?;
    let two_digits = |s: &str| s.len() == 2 && s.bytes().all(|b| b.is_ascii_digit());
    if !two_digits(h) || !two_digits(m) {
        return None;
    }
    let (h, m): (u32, u32) = (h.parse().ok()?, m.parse().ok()?);
    let minutes = h * 60 + m;
    let fits = m < 60 && (minutes < DAY_MINUTES || (end_of_day && minutes == DAY_MINUTES));
    fits.then_some(minutes)
}

/// Minutes since midnight written `HH:MM` (`24:00` for the end of the day).
pub(super) fn hh_mm(minutes: u32) -> String {
    format!("{:02}:{:02}", minutes / 60, minutes % 60)
}

/// Spans of the local week in milliseconds from Monday 00:00: sorted, disjoint and not
/// touching (touching spans are one), so that each start is where the wall clock enters the
/// spans and each end where it leaves them, except an end at the week's end that the first
/// span, starting at Monday 00:00, continues.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WeekSpans(Vec<(i64, i64)>);

impl WeekSpans {
    /// The union of `spans`, each (weekday index, start minute, end minute) on that weekday;
    /// an end at or before the start is on the next day (a span across midnight).
    pub(super) fn new(spans: impl IntoIterator<Item = (usize, u32, u32)>) -> WeekSpans {
        let mut pieces = Vec::new();
        for (day, start, end) in spans {
            let day_ms = day as i64 * DAY_MS;
            let start_ms = day_ms + i64::from(start) * 60_000;
            let mut end_ms = day_ms + i64::from(end) * 60_000;
            if end <= start {
                end_ms += DAY_MS;
            }
            if end_ms > WEEK_MS {
                pieces.push((start_ms, WEEK_MS));
                pieces.push((0, end_ms - WEEK_MS));
            } else {
                pieces.push((start_ms, end_ms));
            }
        }
        pieces.sort_unstable();
        let mut merged: Vec<(i64, i64)> = Vec::with_capacity(pieces.len());
        for (start, end) in pieces {
            match merged.last_mut() {
                Some(last) if start <= last.1 => last.1 = last.1.max(end),
                _ => merged.push((start, end)),
            }
        }
        WeekSpans(merged)
    }

    /// Whether local wall time `local` is in a span.
    pub(super) fn contains(&self, local: NaiveDateTime) -> bool {
        let at = week_ms(local);
        self.0.iter().any(|&(start, end)| start <= at && at < end)
    }

    /// How long the wall clock, running on from `at` (ms into the week) with no clock change,
    /// takes to enter the spans (`enter`) or leave the one it is in; `None` when it never does
    /// (no spans, or one covering the whole week).
    fn wait(&self, at: i64, enter: bool) -> Option<i64> {
        let (first, last) = (self.0.first()?, self.0.last()?);
        if enter {
            let next = self
                .0
                .iter()
                .map(|&(start, _)| start)
                .find(|&start| start >= at)
                .unwrap_or(first.0 + WEEK_MS);
            return Some(next - at);
        }
        let &(start, end) = self.0.iter().find(|&&(s, e)| s <= at && at < e)?;
        let wraps = end == WEEK_MS && first.0 == 0;
        if wraps && start == 0 && last == first {
            return None;
        }
        Some(if wraps { WEEK_MS + first.1 } else { end } - at)
    }

    /// The first instant at or after `now` at which the wall clock in `zone` is in a span
    /// (`enter`) or out of every span; `None` when it never is (no spans, or the whole week).
    ///
    /// Between two clock changes the wall clock runs with the instant, so the wait is
    /// arithmetic; a clock change on the way is found and the wall clock read again after it.
    pub(super) fn next(&self, now: DateTime<Utc>, zone: Tz, enter: bool) -> Option<DateTime<Utc>> {
        let mut t = now;
        // Each turn is at a clock change or at the answer: a few turns reach weeks ahead.
        for _ in 0..MAX_TURNS {
            let local = zone.from_utc_datetime(&t.naive_utc()).naive_local();
            if self.contains(local) == enter {
                return Some(t);
            }
            let reach = t + Duration::milliseconds(self.wait(week_ms(local), enter)?);
            t = next_offset_change(t, reach, zone).unwrap_or(reach);
        }
        None
    }
}

/// Clock changes [`WeekSpans::next`] looks past before giving up: zones change their clocks
/// at most a few times in the two weeks a span is at most away.
const MAX_TURNS: usize = 16;

/// Milliseconds from Monday 00:00 to `local` in its week.
fn week_ms(local: NaiveDateTime) -> i64 {
    let day = i64::from(local.weekday().num_days_from_monday());
    let time = local.time();
    day * DAY_MS
        + i64::from(time.num_seconds_from_midnight()) * 1_000
        + i64::from(time.nanosecond() / 1_000_000)
}

/// How far apart [`next_offset_change`] looks at the offset: shorter than the time between two
/// clock changes of any zone, which is months.
const PROBE: Duration = Duration::hours(1);

/// The first instant in (`from`, `to`] at which `zone`'s offset from UTC differs from the one
/// at `from`, to the millisecond; `None` when there is none.
fn next_offset_change(from: DateTime<Utc>, to: DateTime<Utc>, zone: Tz) -> Option<DateTime<Utc>> {
    let offset = |t: DateTime<Utc>| zone.offset_from_utc_datetime(&t.naive_utc()).fix();
    let here = offset(from);
    let mut lo = from;
    while lo < to {
        let mut hi = (lo + PROBE).min(to);
        if offset(hi) != here {
            while hi - lo > Duration::milliseconds(1) {
                let mid = lo + (hi - lo) / 2;
                if offset(mid) == here {
                    lo = mid;
                } else {
                    hi = mid;
                }
            }
            return Some(hi);
        }
        lo = hi;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono_tz::{America, Pacific};

    fn utc(s: &str) -> DateTime<Utc> {
        s.parse().unwrap()
    }

    #[test]
    fn times_of_day_are_two_digit_hours_and_minutes() {
        assert_eq!(parse_hh_mm("09:30", false), Some(570));
        assert_eq!(parse_hh_mm("24:00", true), Some(DAY_MINUTES));
        for bad in [
            "24:00", "9:30", "09:3", "09:60", "25:00", "0930", "+9:30", "09:30 ",
        ] {
            assert_eq!(parse_hh_mm(bad, false), None, "{bad}");
        }
        assert_eq!(parse_hh_mm("24:01", true), None);
        assert_eq!(hh_mm(DAY_MINUTES), "24:00");
    }

    #[test]
    fn a_span_across_the_end_of_the_week_is_left_at_its_end_on_monday() {
        // Sunday 22:00 to Monday 07:00, and Monday 07:00 to 08:00 touching it.
        let spans = WeekSpans::new([(6, 22 * 60, 7 * 60), (0, 7 * 60, 8 * 60)]);
        let sunday_night = utc("2026-03-15T23:00:00Z");
        assert_eq!(
            spans.next(sunday_night, chrono_tz::UTC, false),
            Some(utc("2026-03-16T08:00:00Z"))
        );
        assert_eq!(
            spans.next(utc("2026-03-16T08:00:00Z"), chrono_tz::UTC, true),
            Some(utc("2026-03-22T22:00:00Z"))
        );
    }

    #[test]
    fn a_span_whose_start_a_spring_forward_skips_opens_when_the_gap_ends() {
        // New York, Sunday 2026-03-08: 02:00 EST becomes 03:00 EDT at 07:00Z.
        let spans = WeekSpans::new([(6, 2 * 60 + 30, 4 * 60)]);
        let before = utc("2026-03-08T06:00:00Z"); // 01:00 EST
        assert_eq!(
            spans.next(before, America::New_York, true),
            Some(utc("2026-03-08T07:00:00Z"))
        );
        // A span wholly inside the gap waits a week.
        let inside_gap = WeekSpans::new([(6, 2 * 60 + 10, 2 * 60 + 50)]);
        assert_eq!(
            inside_gap.next(before, America::New_York, true),
            Some(utc("2026-03-15T06:10:00Z"))
        );
    }

    #[test]
    fn a_fall_back_into_a_span_opens_it_again() {
        // New York, Sunday 2026-11-01: 02:00 EDT becomes 01:00 EST at 06:00Z; at 01:45 EDT a
        // span of 00:30 to 01:30 is over, and open again from the fall-back.
        let spans = WeekSpans::new([(6, 30, 90)]);
        assert_eq!(
            spans.next(utc("2026-11-01T05:45:00Z"), America::New_York, true),
            Some(utc("2026-11-01T06:00:00Z"))
        );
    }

    #[test]
    fn a_weekday_a_zone_skipped_has_no_spans_that_week() {
        // Apia skipped Friday 2011-12-30: from Thursday noon, a Friday span opens a week on.
        let spans = WeekSpans::new([(4, 9 * 60, 17 * 60)]);
        let thursday = utc("2011-12-29T22:00:00Z"); // 12:00 on the 29th, UTC-10
        assert_eq!(
            spans.next(thursday, Pacific::Apia, true),
            Some(utc("2012-01-05T19:00:00Z")) // 09:00 on Friday 01-06, UTC+14
        );
    }

    #[test]
    fn spans_covering_the_whole_week_are_never_left() {
        let all = WeekSpans::new((0..7).map(|d| (d, 0, DAY_MINUTES)));
        assert_eq!(
            all.next(utc("2026-03-08T06:00:00Z"), chrono_tz::UTC, false),
            None
        );
        assert_eq!(
            WeekSpans::default().next(utc("2026-03-08T06:00:00Z"), chrono_tz::UTC, true),
            None
        );
    }
}
