//! Local calendar days as plain numbers, and the instants they begin at.
//!
//! The calendar quota keeps each admitted send under the number of the recipient's local day
//! (days since 1970-01-01 in that zone's calendar). Windows of N days are ranges of day numbers,
//! never multiples of 86,400 seconds, so a 23- or 25-hour day is still one day. Turning a day
//! number back into an instant goes through chrono-tz and handles days whose midnight does not
//! exist (a clock change at 00:00) or happens twice.

use chrono::{DateTime, Duration, NaiveDate, NaiveDateTime, NaiveTime, TimeZone, Utc};
use chrono_tz::Tz;

use super::CalendarQuota;

/// Scores below this in a calendar quota's key are local day numbers, written before sends
/// were kept as instants; above it they are instants in ms. The same constant is in
/// `lua/kinds/calendar_quota.lua`.
pub const LEGACY_BELOW: i64 = 100_000_000;

/// How far back from now a window of `window_days` local days can reach in any zone: that many
/// days of 24 hours, plus two for the clock changes a window can hold (an hour each at most in
/// today's rules) and for today, which began up to a day ago. Entries older than this count in
/// no zone and are forgotten; a key lives this long after its newest entry.
pub fn window_reach(window_days: u32) -> Duration {
    Duration::days(i64::from(window_days) + 2)
}

/// The first local day in `zone` on which a calendar quota that refused a message at `now`
/// has room, from the script's reply: `window_entry` is the score of the entry whose leaving
/// the window makes room (-1 when the window has room), `day_full` whether today is full.
///
/// Every send is at or before `now`, so no later day holds one: the window has room from the
/// day after that entry's local day plus the window, and the day from tomorrow.
pub fn first_day_with_room(
    q: &CalendarQuota,
    window_entry: i64,
    day_full: bool,
    now: DateTime<Utc>,
    zone: Tz,
) -> DayNumber {
    let today = day_number(now, zone);
    let by_day = if day_full { today + 1 } else { today };
    let by_window = match window_entry {
        e if e < 0 => today,
        day if day < LEGACY_BELOW => day + i64::from(q.window_days),
        ms => {
            let at = DateTime::from_timestamp_millis(ms).unwrap_or(now);
            day_number(at, zone) + i64::from(q.window_days)
        }
    };
    by_day.max(by_window).max(today + 1)
}

/// A local calendar day, counted from 1970-01-01 in the zone's own calendar.
pub type DayNumber = i64;

fn epoch() -> NaiveDate {
    NaiveDate::from_ymd_opt(1970, 1, 1).expect("1970-01-01 is a valid date")
}

/// The local day number of `at` in `zone`.
pub fn day_number(at: DateTime<Utc>, zone: Tz) -> DayNumber {
    let local = zone.from_utc_datetime(&at.naive_utc()).date_naive();
    (local - epoch()).num_days()
}

/// The first instant at which the local date in `zone` is `day`.
///
/// Normally local midnight; where a clock change skips midnight it is the end of the gap (for
/// example 01:00 in America/Santiago on the day DST starts); where midnight happens twice it is
/// the earlier one. A day that a zone skipped entirely (Pacific/Apia, 2011-12-30) begins when
/// the next day does.
pub fn day_start(day: DayNumber, zone: Tz) -> DateTime<Utc> {
    // Every calendar decision asks for today's and the window's first day's start, mostly of
    // a few zones and days: remembered per thread (a few hundred instructions of zone
    // arithmetic each otherwise). A pure function, so a slot holding another key is simply
    // overwritten.
    const SLOTS: usize = 64;
    thread_local! {
        static STARTS: [std::cell::Cell<(u32, DayNumber, i64)>; SLOTS] =
            const { [const { std::cell::Cell::new((u32::MAX, 0, 0)) }; SLOTS] };
    }
    let key = (zone as u32, day);
    let slot = (key.0 as usize).wrapping_mul(31).wrapping_add(day as usize) % SLOTS;
    let cached = STARTS.with(|s| s[slot].get());
    if (cached.0, cached.1) == key {
        if let Some(start) = DateTime::from_timestamp_millis(cached.2) {
            return start;
        }
    }
    let start = compute_day_start(day, zone);
    STARTS.with(|s| s[slot].set((key.0, key.1, start.timestamp_millis())));
    start
}

/// [`day_start`], computed.
fn compute_day_start(day: DayNumber, zone: Tz) -> DateTime<Utc> {
    let mut day = day;
    loop {
        if let Some(start) = first_instant_of(epoch() + Duration::days(day), zone) {
            return start;
        }
        day += 1;
    }
}

fn first_instant_of(date: NaiveDate, zone: Tz) -> Option<DateTime<Utc>> {
    first_instant_from(date.and_time(NaiveTime::MIN), zone)
        .filter(|t| zone.from_utc_datetime(&t.naive_utc()).date_naive() == date)
}

/// The first instant at which the local wall time in `zone` reads `local` or later: `local`
/// itself when it exists, the end of the gap when a clock change skips it, the earlier one
/// when it happens twice. `None` only if no local time within a day of `local` exists.
pub fn first_instant_from(local: NaiveDateTime, zone: Tz) -> Option<DateTime<Utc>> {
    // Scan local minutes until one exists: gaps begin and end on whole minutes in every zone's
    // modern rules, and are at most a day long.
    for minute in 0..24 * 60 {
        let naive = local + Duration::minutes(minute);
        if let Some(found) = zone.from_local_datetime(&naive).earliest() {
            let found = found.with_timezone(&Utc);
            return Some(if minute == 0 {
                found
            } else {
                end_of_gap(found, local, zone)
            });
        }
    }
    None
}

/// Narrows the instant where a gap ends (the zone's transition) to the millisecond, for gaps
/// of historic zones whose offsets had seconds: the result is the earliest instant within the
/// minute before `found` whose local wall time is at least `local`.
fn end_of_gap(found: DateTime<Utc>, local: NaiveDateTime, zone: Tz) -> DateTime<Utc> {
    let reached = |t: DateTime<Utc>| zone.from_utc_datetime(&t.naive_utc()).naive_local() >= local;
    let (mut lo, mut hi) = (found - Duration::minutes(1), found);
    if reached(lo) {
        return lo;
    }
    while hi - lo > Duration::milliseconds(1) {
        let mid = lo + (hi - lo) / 2;
        if reached(mid) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    hi
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono_tz::{America, Australia, Pacific, UTC};

    fn utc(s: &str) -> DateTime<Utc> {
        s.parse().unwrap()
    }

    #[test]
    fn one_minute_before_and_after_local_midnight_are_different_days() {
        let zone = America::New_York;
        let before = day_number(utc("2026-03-08T04:59:00Z"), zone); // 23:59 EST on 03-07
        let after = day_number(utc("2026-03-08T05:01:00Z"), zone); // 00:01 EST on 03-08
        assert_eq!(after - before, 1);
    }

    #[test]
    fn a_23_hour_day_is_one_day() {
        let zone = America::New_York;
        let start = day_start(day_number(utc("2026-03-08T12:00:00Z"), zone), zone);
        let next = day_start(day_number(utc("2026-03-09T12:00:00Z"), zone), zone);
        assert_eq!(start, utc("2026-03-08T05:00:00Z"));
        assert_eq!(next - start, Duration::hours(23));
    }

    #[test]
    fn a_day_whose_midnight_is_skipped_starts_at_one_in_the_morning() {
        // Santiago moves from -04 to -03 at 24:00 on Saturday 2026-09-05.
        let zone = America::Santiago;
        let day = day_number(utc("2026-09-06T12:00:00Z"), zone);
        assert_eq!(day_start(day, zone), utc("2026-09-06T04:00:00Z"));
    }

    #[test]
    fn lord_howe_days_change_by_thirty_minutes() {
        let zone = Australia::Lord_Howe;
        let day = day_number(utc("2026-10-04T12:00:00Z"), zone);
        let a = day_start(day, zone);
        let b = day_start(day + 1, zone);
        assert_eq!(b - a, Duration::minutes(24 * 60 - 30));
    }

    #[test]
    fn a_skipped_day_begins_with_the_next_one() {
        let zone = Pacific::Apia;
        let dec29 = day_number(utc("2011-12-29T12:00:00Z"), zone);
        assert_eq!(day_start(dec29 + 1, zone), day_start(dec29 + 2, zone));
    }

    #[test]
    fn utc_day_numbers_count_from_the_epoch() {
        assert_eq!(day_number(utc("1970-01-02T00:00:00Z"), UTC), 1);
        assert_eq!(day_start(1, UTC), utc("1970-01-02T00:00:00Z"));
    }
}
