//! Limiter kinds and their validated parameters.
//!
//! Durations are written `500ms`, `10s`, `5m`, `2h` or `1d`; rates as `rate` per `period`.
//! Everything is checked here so that an invalid limiter cannot be built: zero windows, a
//! sliding log whose shorter window allows more than its longer one, a fixed cost above a
//! bucket's capacity, rates too fine for exact integer arithmetic in the scripts.

use chrono::NaiveTime;
use serde::Serialize;

/// A limiter kind with parameters that have passed validation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Kind {
    /// N per local calendar day and M per rolling D local days.
    CalendarQuota(CalendarQuota),
    /// N per window that starts at the first send.
    FixedWindow(Window),
    /// N per sliding window, counted in sub-windows.
    SlidingWindow(SlidingWindow),
    /// Several (limit, window) policies over one log of sub-window counters.
    SlidingLog(SlidingLog),
    /// A level that leaks at a rate; refuse at capacity.
    LeakyBucket(Bucket),
    /// Tokens refilled at a rate; a send takes its cost.
    TokenBucket(TokenBucket),
    /// The generic cell rate algorithm: a rate with a burst, exact, one key.
    Gcra(Gcra),
    /// N per sliding window, exactly, one entry per admitted send.
    ZsetWindow(Window),
    /// No sends between two local times of day.
    QuietHours(QuietHours),
}

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

/// A limit per window (fixed or exact sliding).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Window {
    /// Sends allowed per window.
    pub limit: u32,
    /// Window length in milliseconds.
    #[serde(rename = "window", serialize_with = "as_duration")]
    pub window_ms: i64,
}

/// Where a sliding window keeps its sub-window counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Storage {
    /// A hash of sub-window index to count.
    Hash,
    /// A list of (index, count) pairs behind a running total.
    List,
}

/// A sliding window counted in sub-windows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct SlidingWindow {
    /// Sends allowed per window.
    pub limit: u32,
    /// Window length in milliseconds.
    #[serde(rename = "window", serialize_with = "as_duration")]
    pub window_ms: i64,
    /// Sub-window length in milliseconds; divides the window.
    #[serde(rename = "sub_window", serialize_with = "as_duration")]
    pub sub_window_ms: i64,
    /// Storage layout.
    pub storage: Storage,
}

/// Several policies over one log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SlidingLog {
    /// Sub-window length in milliseconds; divides every window.
    #[serde(rename = "sub_window", serialize_with = "as_duration")]
    pub sub_window_ms: i64,
    /// (limit, window ms), windows strictly increasing, limits strictly increasing.
    #[serde(serialize_with = "as_policies")]
    pub policies: Vec<(u32, i64)>,
}

/// A leaky bucket: `capacity` sends, leaking `rate` per `period_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Bucket {
    /// Largest level.
    pub capacity: u32,
    /// Sends leaked per period.
    pub rate: u32,
    /// The period in milliseconds.
    #[serde(rename = "period", serialize_with = "as_duration")]
    pub period_ms: i64,
}

/// A token bucket: `capacity` tokens, refilled `rate` per `period_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct TokenBucket {
    /// Bucket size and rate.
    #[serde(flatten)]
    pub bucket: Bucket,
    /// Tokens every send takes; `None` means the message's `cost`.
    pub cost: Option<u32>,
}

/// GCRA: `rate` per `period_ms`, bursts of up to `burst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Gcra {
    /// Sends per period.
    pub rate: u32,
    /// The period in milliseconds.
    #[serde(rename = "period", serialize_with = "as_duration")]
    pub period_ms: i64,
    /// Sends allowed at once.
    pub burst: u32,
}

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

/// The longest calendar window accepted; a year keeps day arithmetic and key lifetimes sane.
const MAX_WINDOW_DAYS: u32 = 366;
/// Longest time window accepted: 366 days.
const MAX_WINDOW_MS: i64 = 366 * 86_400_000;
/// Most sub-windows per window: each is a counter read on every decision.
const MAX_SUB_WINDOWS: i64 = 1_000;
/// Largest limit of a zset window: it keeps one entry per admitted send.
const MAX_ZSET_LIMIT: u32 = 10_000;
/// Largest GCRA ticks per millisecond, so that `now_ms * ticks` stays below 2^53 for
/// centuries and the script's arithmetic is exact.
const MAX_TICKS_PER_MS: i64 = 1_000;

impl CalendarQuota {
    /// The headline rule: one message per calendar day and three per seven days.
    pub const HEADLINE: CalendarQuota = CalendarQuota {
        per_day: 1,
        per_window: 3,
        window_days: 7,
    };
}

/// Every kind name the configuration accepts, for error messages.
pub const KIND_NAMES: &[&str] = &[
    "calendar_quota",
    "fixed_window",
    "sliding_window",
    "sliding_log",
    "leaky_bucket",
    "token_bucket",
    "gcra",
    "zset_window",
    "quiet_hours",
];

fn gcd(a: i64, b: i64) -> i64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

impl Bucket {
    /// (units per send, units leaked or refilled per ms), reduced so both are integers.
    pub fn units(&self) -> (i64, i64) {
        let g = gcd(i64::from(self.rate), self.period_ms);
        (self.period_ms / g, i64::from(self.rate) / g)
    }
}

impl Gcra {
    /// (emission interval T in ticks, ticks per ms), reduced so both are integers.
    pub fn ticks(&self) -> (i64, i64) {
        let g = gcd(i64::from(self.rate), self.period_ms);
        (self.period_ms / g, i64::from(self.rate) / g)
    }
}

impl Kind {
    /// The kind's name as written in configuration, keys and denial rows.
    pub fn name(&self) -> &'static str {
        match self {
            Kind::CalendarQuota(_) => "calendar_quota",
            Kind::FixedWindow(_) => "fixed_window",
            Kind::SlidingWindow(_) => "sliding_window",
            Kind::SlidingLog(_) => "sliding_log",
            Kind::LeakyBucket(_) => "leaky_bucket",
            Kind::TokenBucket(_) => "token_bucket",
            Kind::Gcra(_) => "gcra",
            Kind::ZsetWindow(_) => "zset_window",
            Kind::QuietHours(_) => "quiet_hours",
        }
    }

    /// Builds a kind from its name and the rule's remaining parameters. Errors are messages
    /// that name the offending parameter; the caller adds the rule name.
    pub(super) fn from_params(kind: &str, params: &toml::Table) -> Result<Kind, String> {
        let mut p = Params {
            table: params,
            used: Vec::new(),
        };
        let built = match kind {
            "calendar_quota" => Kind::CalendarQuota(calendar(&mut p)?),
            "fixed_window" => Kind::FixedWindow(window(&mut p)?),
            "zset_window" => {
                let w = window(&mut p)?;
                if w.limit > MAX_ZSET_LIMIT {
                    return Err(format!(
                        "limit ({}) is more than {MAX_ZSET_LIMIT}: zset_window keeps one entry per \
                         send; use sliding_window or gcra for large limits",
                        w.limit
                    ));
                }
                Kind::ZsetWindow(w)
            }
            "sliding_window" => Kind::SlidingWindow(sliding(&mut p)?),
            "sliding_log" => Kind::SlidingLog(sliding_log(&mut p)?),
            "leaky_bucket" => Kind::LeakyBucket(bucket(&mut p)?),
            "token_bucket" => {
                let bucket = bucket(&mut p)?;
                let cost = p.optional_positive("cost")?;
                if let Some(cost) = cost.filter(|&c| c > bucket.capacity) {
                    return Err(format!(
                        "cost ({cost}) is larger than capacity ({}): no send could ever pass",
                        bucket.capacity
                    ));
                }
                Kind::TokenBucket(TokenBucket { bucket, cost })
            }
            "gcra" => Kind::Gcra(gcra(&mut p)?),
            "quiet_hours" => Kind::QuietHours(quiet_hours(&mut p)?),
            other => {
                return Err(format!(
                    "unknown kind \"{other}\" (known kinds: {})",
                    KIND_NAMES.join(", ")
                ))
            }
        };
        p.reject_unused(kind)?;
        Ok(built)
    }
}

fn calendar(p: &mut Params<'_>) -> Result<CalendarQuota, String> {
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

fn window(p: &mut Params<'_>) -> Result<Window, String> {
    Ok(Window {
        limit: p.positive("limit", None)?,
        window_ms: p.duration("window", None)?,
    })
}

fn sliding(p: &mut Params<'_>) -> Result<SlidingWindow, String> {
    let Window { limit, window_ms } = window(p)?;
    let sub_window_ms = p.duration("sub_window", Some(window_ms / 10).filter(|s| *s > 0))?;
    check_sub_window(sub_window_ms, window_ms, "window")?;
    let storage = match p.string("storage")?.as_deref() {
        None | Some("hash") => Storage::Hash,
        Some("list") => Storage::List,
        Some(other) => {
            return Err(format!(
                "storage must be \"hash\" or \"list\", got \"{other}\""
            ))
        }
    };
    Ok(SlidingWindow {
        limit,
        window_ms,
        sub_window_ms,
        storage,
    })
}

fn check_sub_window(sub: i64, window: i64, what: &str) -> Result<(), String> {
    if window % sub != 0 {
        return Err(format!(
            "{what} ({}) is not a multiple of sub_window ({})",
            human_ms(window),
            human_ms(sub)
        ));
    }
    if window / sub > MAX_SUB_WINDOWS {
        return Err(format!(
            "{what} ({}) holds more than {MAX_SUB_WINDOWS} sub_windows of {}",
            human_ms(window),
            human_ms(sub)
        ));
    }
    Ok(())
}

fn sliding_log(p: &mut Params<'_>) -> Result<SlidingLog, String> {
    let sub_window_ms = p.duration("sub_window", None)?;
    p.used.push("policies");
    let Some(toml::Value::Array(items)) = p.table.get("policies") else {
        return Err("policies must be a list such as [{ limit = 10, window = \"1m\" }]".to_owned());
    };
    if items.is_empty() {
        return Err("policies must not be empty".to_owned());
    }
    let mut policies = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let toml::Value::Table(t) = item else {
            return Err(format!("policies[{i}] must be a table {{ limit, window }}"));
        };
        let mut q = Params {
            table: t,
            used: Vec::new(),
        };
        let w = window(&mut q).map_err(|e| format!("policies[{i}]: {e}"))?;
        q.reject_unused("sliding_log policy")
            .map_err(|e| format!("policies[{i}]: {e}"))?;
        check_sub_window(sub_window_ms, w.window_ms, &format!("policies[{i}].window"))?;
        policies.push((w.limit, w.window_ms));
    }
    policies.sort_by_key(|&(_, window)| window);
    for pair in policies.windows(2) {
        let ((short_limit, short), (long_limit, long)) = (pair[0], pair[1]);
        if short == long {
            return Err(format!(
                "two policies have the same window ({})",
                human_ms(short)
            ));
        }
        if short_limit >= long_limit {
            return Err(format!(
                "the policy over {} allows {short_limit}, not fewer than the policy over the \
                 longer {} ({long_limit}): a shorter window must have a smaller limit",
                human_ms(short),
                human_ms(long)
            ));
        }
    }
    Ok(SlidingLog {
        sub_window_ms,
        policies,
    })
}

fn bucket(p: &mut Params<'_>) -> Result<Bucket, String> {
    let b = Bucket {
        capacity: p.positive("capacity", None)?,
        rate: p.positive("rate", None)?,
        period_ms: p.duration("period", Some(1_000))?,
    };
    let (unit, _) = b.units();
    if i64::from(b.capacity).saturating_mul(unit) > 1 << 50 {
        return Err("capacity times period is too large for exact arithmetic".to_owned());
    }
    Ok(b)
}

fn gcra(p: &mut Params<'_>) -> Result<Gcra, String> {
    let rate = p.positive("rate", None)?;
    let g = Gcra {
        rate,
        period_ms: p.duration("period", Some(1_000))?,
        burst: p.positive("burst", Some(rate))?,
    };
    let (t, ticks_per_ms) = g.ticks();
    if ticks_per_ms > MAX_TICKS_PER_MS {
        return Err(format!(
            "rate {} per {} is too fine for exact arithmetic: write it over a period of whole \
             milliseconds per {MAX_TICKS_PER_MS} sends or fewer",
            g.rate,
            human_ms(g.period_ms)
        ));
    }
    if t.saturating_mul(i64::from(g.burst)) > 1 << 50 {
        return Err("burst times period is too large for exact arithmetic".to_owned());
    }
    Ok(g)
}

fn quiet_hours(p: &mut Params<'_>) -> Result<QuietHours, String> {
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

fn as_duration<S: serde::Serializer>(ms: &i64, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&human_ms(*ms))
}

fn as_hh_mm<S: serde::Serializer>(t: &NaiveTime, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&t.format("%H:%M").to_string())
}

fn as_policies<S: serde::Serializer>(policies: &[(u32, i64)], s: S) -> Result<S::Ok, S::Error> {
    use serde::ser::{SerializeMap, SerializeSeq};
    struct Policy(u32, i64);
    impl Serialize for Policy {
        fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            let mut m = s.serialize_map(Some(2))?;
            m.serialize_entry("limit", &self.0)?;
            m.serialize_entry("window", &human_ms(self.1))?;
            m.end()
        }
    }
    let mut seq = s.serialize_seq(Some(policies.len()))?;
    for &(limit, window) in policies {
        seq.serialize_element(&Policy(limit, window))?;
    }
    seq.end()
}

/// A duration in milliseconds, written the way configuration takes it.
pub fn human_ms(ms: i64) -> String {
    const UNITS: [(i64, &str); 4] = [
        (86_400_000, "d"),
        (3_600_000, "h"),
        (60_000, "m"),
        (1_000, "s"),
    ];
    for (size, unit) in UNITS {
        if ms >= size && ms % size == 0 {
            return format!("{}{unit}", ms / size);
        }
    }
    format!("{ms}ms")
}

/// Parses `500ms`, `10s`, `5m`, `2h`, `1d` into milliseconds.
pub fn parse_duration_ms(text: &str) -> Option<i64> {
    let split = text.find(|c: char| !c.is_ascii_digit())?;
    let (digits, unit) = text.split_at(split);
    let n: i64 = digits.parse().ok()?;
    let size = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return None,
    };
    n.checked_mul(size)
}

/// Reads typed parameters from a rule's table and remembers which ones were read, so that a
/// misspelt parameter is an error instead of a silently ignored default.
struct Params<'t> {
    table: &'t toml::Table,
    used: Vec<&'static str>,
}

impl Params<'_> {
    fn positive(&mut self, name: &'static str, default: Option<u32>) -> Result<u32, String> {
        self.optional_positive(name)?
            .or(default)
            .ok_or_else(|| format!("{name} is required"))
    }

    fn optional_positive(&mut self, name: &'static str) -> Result<Option<u32>, String> {
        self.used.push(name);
        match self.table.get(name) {
            None => Ok(None),
            Some(toml::Value::Integer(n)) if *n >= 1 && *n <= i64::from(u32::MAX) => {
                Ok(Some(*n as u32))
            }
            Some(toml::Value::Integer(n)) => Err(format!("{name} must be at least 1, got {n}")),
            Some(other) => Err(format!(
                "{name} must be a whole number, got {}",
                other.type_str()
            )),
        }
    }

    fn string(&mut self, name: &'static str) -> Result<Option<String>, String> {
        self.used.push(name);
        match self.table.get(name) {
            None => Ok(None),
            Some(toml::Value::String(s)) => Ok(Some(s.clone())),
            Some(other) => Err(format!("{name} must be a string, got {}", other.type_str())),
        }
    }

    fn duration(&mut self, name: &'static str, default: Option<i64>) -> Result<i64, String> {
        let Some(text) = self.string(name)? else {
            return default
                .ok_or_else(|| format!("{name} is required (a duration such as \"1m\")"));
        };
        match parse_duration_ms(&text) {
            Some(ms) if ms > 0 && ms <= MAX_WINDOW_MS => Ok(ms),
            Some(ms) if ms > MAX_WINDOW_MS => Err(format!("{name} \"{text}\" is longer than 366d")),
            Some(_) => Err(format!("{name} must be longer than zero, got \"{text}\"")),
            None => Err(format!(
                "{name} \"{text}\" is not a duration (a whole number followed by ms, s, m, h or d)"
            )),
        }
    }

    fn reject_unused(&self, kind: &str) -> Result<(), String> {
        match self.table.keys().find(|k| !self.used.contains(&k.as_str())) {
            Some(k) => Err(format!("unknown parameter `{k}` for kind {kind}")),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_and_print_back() {
        for (text, ms) in [
            ("500ms", 500),
            ("10s", 10_000),
            ("5m", 300_000),
            ("2h", 7_200_000),
        ] {
            assert_eq!(parse_duration_ms(text), Some(ms));
            assert_eq!(human_ms(ms), text);
        }
        assert_eq!(parse_duration_ms("1.5s"), None);
        assert_eq!(parse_duration_ms("-1s"), None);
    }

    #[test]
    fn rates_reduce_to_integer_units() {
        let b = Bucket {
            capacity: 5,
            rate: 10,
            period_ms: 1_000,
        };
        assert_eq!(b.units(), (100, 1));
        let g = Gcra {
            rate: 7,
            period_ms: 1_000,
            burst: 1,
        };
        assert_eq!(g.ticks(), (1_000, 7));
    }
}
