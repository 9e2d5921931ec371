//! Per-kind mapping between validated parameters and the scripts: the arguments each kind's
//! Lua takes, and what its raw reply means (retry instant, remaining, reason).

use chrono::{DateTime, Duration, NaiveTime, Utc};
use chrono_tz::Tz;

use super::calendar::{self, day_number, day_start};
use crate::policy::{human_ms, Kind, QuietHours, Storage};

/// The kind's slice of ARGV for a decision at `now` in `zone`.
pub(super) fn args(kind: &Kind, now: DateTime<Utc>, zone: Tz) -> Vec<i64> {
    match kind {
        Kind::CalendarQuota(q) => {
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
            ]
        }
        Kind::FixedWindow(w) | Kind::ZsetWindow(w) => vec![i64::from(w.limit), w.window_ms],
        Kind::SlidingWindow(s) => vec![
            i64::from(s.limit),
            s.window_ms,
            s.sub_window_ms,
            match s.storage {
                Storage::Hash => 0,
                Storage::List => 1,
            },
        ],
        Kind::SlidingLog(l) => {
            let mut out = vec![l.sub_window_ms, l.policies.len() as i64];
            for &(limit, window) in &l.policies {
                out.extend([i64::from(limit), window]);
            }
            out
        }
        Kind::LeakyBucket(b) => {
            let (unit, leak) = b.units();
            vec![i64::from(b.capacity) * unit, unit, leak]
        }
        Kind::TokenBucket(t) => {
            let (unit, refill) = t.bucket.units();
            vec![
                i64::from(t.bucket.capacity) * unit,
                unit,
                refill,
                i64::from(t.cost.unwrap_or(0)),
            ]
        }
        Kind::Gcra(g) => {
            let (t, ticks_per_ms) = g.ticks();
            vec![t, t * i64::from(g.burst), ticks_per_ms]
        }
        Kind::QuietHours(q) => match quiet_until(q, now, zone) {
            Some(end) => vec![1, end.timestamp_millis()],
            None => vec![0, -1],
        },
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

/// The instant a refusal's raw retry value (and `detail`) stands for, for a message in `zone`
/// decided at `now` (`None` for "never").
pub(super) fn retry_after(
    kind: &Kind,
    raw: i64,
    detail: i64,
    now: DateTime<Utc>,
    zone: Tz,
) -> Option<DateTime<Utc>> {
    match kind {
        Kind::CalendarQuota(q) => Some(day_start(
            calendar::first_day_with_room(q, raw, detail == 1, now, zone),
            zone,
        )),
        _ if raw < 0 => None,
        _ => DateTime::from_timestamp_millis(raw),
    }
}

/// What a rule still allows, for kinds that count (quiet hours do not).
pub(super) fn remaining(kind: &Kind, raw: i64) -> Option<i64> {
    match kind {
        Kind::QuietHours(_) => None,
        _ => Some(raw),
    }
}

/// Why a rule refused, for denial rows; `detail` is the kind-specific reply field (the
/// refusing policy of a sliding log).
pub fn reason(kind: &Kind, detail: i64, cost: u32) -> String {
    match kind {
        Kind::CalendarQuota(q) => format!(
            "at most {} per local day and {} per {} local days",
            q.per_day, q.per_window, q.window_days
        ),
        Kind::FixedWindow(w) => format!(
            "at most {} per {} fixed window",
            w.limit,
            human_ms(w.window_ms)
        ),
        Kind::ZsetWindow(w) => format!("at most {} per {}", w.limit, human_ms(w.window_ms)),
        Kind::SlidingWindow(s) => {
            format!("at most {} per sliding {}", s.limit, human_ms(s.window_ms))
        }
        Kind::SlidingLog(l) => {
            let index = usize::try_from(detail)
                .unwrap_or(1)
                .clamp(1, l.policies.len());
            let (limit, window) = l.policies[index - 1];
            format!(
                "at most {limit} per {} (policy {index} of {})",
                human_ms(window),
                l.policies.len()
            )
        }
        Kind::LeakyBucket(b) => format!(
            "bucket full: capacity {} leaking {} per {}",
            b.capacity,
            b.rate,
            human_ms(b.period_ms)
        ),
        Kind::TokenBucket(t) => {
            let need = t.cost.unwrap_or(cost);
            if need > t.bucket.capacity {
                format!(
                    "cost {need} is more than the bucket's capacity {}",
                    t.bucket.capacity
                )
            } else {
                format!(
                    "not enough tokens for cost {need}: capacity {} refilled {} per {}",
                    t.bucket.capacity,
                    t.bucket.rate,
                    human_ms(t.bucket.period_ms)
                )
            }
        }
        Kind::Gcra(g) => format!(
            "rate {} per {} with bursts of {}",
            g.rate,
            human_ms(g.period_ms),
            g.burst
        ),
        Kind::QuietHours(q) => format!(
            "quiet hours {} to {} local time",
            q.start.format("%H:%M"),
            q.end.format("%H:%M")
        ),
    }
}
