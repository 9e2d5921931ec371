//! The worker's clock, injectable so tests and simulations decide at chosen instants.
//!
//! This is the one clock of the process: the worker, the digest flusher, the admin API, the
//! console and every command take their instants from a `Clock` (the system clock unless
//! `--now` fixes it); nothing else reads the system time. Every instant a decision uses comes
//! from here, in milliseconds, and is passed to the limiter scripts, so all workers agree as
//! long as their clocks do (skew against Redis `TIME` is measured at start-up and reported).
//!
//! One thing runs on the Redis server's clock by design: the lease of an in-flight claim (a key
//! Redis expires, `lua/decide.lua`). A lease bounds how long one worker keeps every other off
//! a message id, so it must be measured on the clock every worker shares: a worker whose clock
//! is skewed, or simulated with `--now`, would otherwise hold a claim that never runs out.
//!
//! It also owns the range of instants the worker decides at ([`in_range`]): every instant
//! that comes from outside (`--now`, `--at`, `?at=`, `--since`, the system clock at start) is
//! checked against it, so every `retry_after` a decision names can be written in RFC 3339.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

use chrono::{DateTime, Duration, SecondsFormat, Utc};

/// A source of the current instant.
pub trait Clock: Send + Sync + 'static {
    /// The current instant.
    fn now(&self) -> DateTime<Utc>;
}

/// The system clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> DateTime<Utc> {
        Utc::now()
    }
}

/// A clock that says what it was last set to: `--now` uses it fixed, tests move it.
#[derive(Debug, Clone)]
pub struct ManualClock(Arc<AtomicI64>);

impl ManualClock {
    /// A clock standing at `at` (millisecond precision).
    pub fn new(at: DateTime<Utc>) -> ManualClock {
        ManualClock(Arc::new(AtomicI64::new(at.timestamp_millis())))
    }

    /// Moves the clock to `at`; every clone sees the change.
    pub fn set(&self, at: DateTime<Utc>) {
        self.0.store(at.timestamp_millis(), Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> DateTime<Utc> {
        DateTime::from_timestamp_millis(self.0.load(Ordering::SeqCst))
            .expect("a ManualClock only holds instants it was given")
    }
}

/// The first instant of the supported range, 1970-01-01T00:00:00Z (the Unix epoch): the
/// scripts count milliseconds and local day numbers from it, and a clock before it is wrong.
pub const EARLIEST_MS: i64 = 0;

/// The first instant past the supported range, 9000-01-01T00:00:00Z. RFC 3339 writes years
/// up to 9999 only; rules make a message wait at most [`MAX_WAIT_DAYS`] (configuration refuses
/// a rule that could wait longer), so a `retry_after` named from an instant in range falls
/// before 10000-01-01, where it can be written (and read back by `--at`).
pub const END_MS: i64 = 221_845_392_000_000;

/// The longest a rule may make a message wait, in days: about 999 years, which
/// 9000-01-01 plus stays inside year 9999 (9999-05-04), with room for a chain of quiet periods
/// after it. Calendar and window kinds reach 366 days at most; a token bucket refilling a
/// large cost slowly is the one that could go further, and is refused at load.
pub const MAX_WAIT_DAYS: i64 = 365_000;

/// An instant the worker does not decide at: outside its range, or a leap second.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OutOfRange {
    /// Before the epoch or from the year 9000 on.
    #[error(
        "{at} is outside the supported range of instants, 1970-01-01T00:00:00Z up to (not \
         including) 9000-01-01T00:00:00Z"
    )]
    Range {
        /// The refused instant, in RFC 3339 (years past 9999 with a sign, as chrono writes
        /// them).
        at: String,
    },
    /// A 60th second (`23:59:60Z`), which RFC 3339 can write and chrono reads, but Unix time,
    /// the worker's clock, does not have: read as it is, it would be compared as the second
    /// before and counted as the second after, and echoed back as written.
    #[error(
        "{at} is a leap second, which the worker's clock (Unix time) does not have: write the \
         second before or after it"
    )]
    LeapSecond {
        /// The refused instant, in RFC 3339.
        at: String,
    },
}

/// `at` when it is an instant the worker decides at: in the supported range ([`EARLIEST_MS`]
/// up to [`END_MS`]) and not a leap second. Every instant from outside passes here, so
/// all are read by one rule.
pub fn in_range(at: DateTime<Utc>) -> Result<DateTime<Utc>, OutOfRange> {
    let written = || at.to_rfc3339_opts(SecondsFormat::AutoSi, true);
    if at.timestamp_subsec_nanos() >= 1_000_000_000 {
        return Err(OutOfRange::LeapSecond { at: written() });
    }
    if (EARLIEST_MS..END_MS).contains(&at.timestamp_millis()) {
        Ok(at)
    } else {
        Err(OutOfRange::Range { at: written() })
    }
}

/// An RFC3339 instant, or an age (`7d`, `36h`, `90m`, `30s`) counted back from `now`: how
/// operators write `--since`, `--until` and API filters.
pub fn parse_instant_or_age(s: &str, now: DateTime<Utc>) -> Result<DateTime<Utc>, String> {
    let unit = s.chars().last().unwrap_or(' ');
    let amount = s[..s.len() - unit.len_utf8().min(s.len())].parse::<i64>();
    let age = match (amount, unit) {
        (Ok(n), 'd') if n >= 0 => Duration::try_days(n),
        (Ok(n), 'h') if n >= 0 => Duration::try_hours(n),
        (Ok(n), 'm') if n >= 0 => Duration::try_minutes(n),
        (Ok(n), 's') if n >= 0 => Duration::try_seconds(n),
        _ => {
            let at = DateTime::parse_from_rfc3339(s).map_err(|_| {
                format!(
                    "{s:?} is neither an RFC3339 instant nor an age such as 7d, 36h, 90m or 30s"
                )
            })?;
            return in_range(at.with_timezone(&Utc)).map_err(|e| e.to_string());
        }
    };
    let at = age
        .and_then(|a| now.checked_sub_signed(a))
        .ok_or_else(|| format!("{s:?} reaches too far back"))?;
    in_range(at).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(text: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(text)
            .expect("an instant")
            .with_timezone(&Utc)
    }

    #[test]
    fn the_range_runs_from_the_epoch_up_to_the_year_9000() {
        assert_eq!(
            DateTime::from_timestamp_millis(EARLIEST_MS),
            Some(at("1970-01-01T00:00:00Z"))
        );
        assert_eq!(
            DateTime::from_timestamp_millis(END_MS),
            Some(at("9000-01-01T00:00:00Z"))
        );
        for inside in [
            "1970-01-01T00:00:00Z",
            "2026-05-01T09:00:00Z",
            "8999-12-31T23:59:59.999Z",
        ] {
            assert_eq!(in_range(at(inside)), Ok(at(inside)));
        }
        for outside in [
            "1969-12-31T23:59:59.999Z",
            "9000-01-01T00:00:00Z",
            "9999-12-31T11:00:00Z",
        ] {
            assert_eq!(
                in_range(at(outside)).map_err(|e| e.to_string()),
                Err(format!(
                    "{outside} is outside the supported range of instants, 1970-01-01T00:00:00Z \
                     up to (not including) 9000-01-01T00:00:00Z"
                ))
            );
        }
    }

    #[test]
    fn the_longest_wait_from_the_last_instant_in_range_can_still_be_written() {
        let last = DateTime::from_timestamp_millis(END_MS - 1).expect("an instant");
        let latest = last + Duration::days(MAX_WAIT_DAYS) + Duration::days(30);
        let text = latest.to_rfc3339_opts(SecondsFormat::AutoSi, true);
        assert!(text.starts_with("9999-"), "{text}");
        assert_eq!(at(&text), latest);
    }

    #[test]
    fn a_leap_second_is_refused_wherever_an_instant_comes_from() {
        let now = at("2026-05-01T09:00:00Z");
        for text in ["2016-12-31T23:59:60Z", "2017-01-01T05:29:60.5+05:30"] {
            let leap = at(text);
            let refused = in_range(leap).map_err(|e| e.to_string());
            assert!(
                refused
                    .as_ref()
                    .is_err_and(|e| e.contains("is a leap second")),
                "{text}: {refused:?}"
            );
            let refused = parse_instant_or_age(text, now).expect_err(text);
            assert!(refused.contains("is a leap second"), "{refused}");
        }
        assert!(in_range(at("2016-12-31T23:59:59.999Z")).is_ok());
        assert!(in_range(at("2017-01-01T00:00:00Z")).is_ok());
    }

    #[test]
    fn an_age_or_instant_before_the_epoch_is_refused() {
        let now = at("2026-05-01T09:00:00Z");
        assert_eq!(
            parse_instant_or_age("7d", now),
            Ok(at("2026-04-24T09:00:00Z"))
        );
        for text in ["1969-12-31T00:00:00Z", "30000d", "9500-01-01T00:00:00Z"] {
            let refused = parse_instant_or_age(text, now).expect_err(text);
            assert!(refused.contains("outside the supported range"), "{refused}");
        }
    }
}
