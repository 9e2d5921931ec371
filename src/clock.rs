//! The worker's clock, injectable so tests and simulations decide at chosen instants.
//!
//! Limiter scripts never read the Redis server's clock: every time they use comes from here, in
//! milliseconds, so all workers agree as long as their clocks do (skew against Redis `TIME` is
//! measured at start-up and reported).

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

use chrono::{DateTime, Duration, Utc};

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
            return DateTime::parse_from_rfc3339(s)
                .map(|t| t.with_timezone(&Utc))
                .map_err(|_| {
                    format!(
                        "{s:?} is neither an RFC3339 instant nor an age such as 7d, 36h, 90m or 30s"
                    )
                })
        }
    };
    age.and_then(|a| now.checked_sub_signed(a))
        .ok_or_else(|| format!("{s:?} reaches too far back"))
}
