//! gcra: the generic cell rate algorithm, `rate` per `period` with bursts of `burst`, exact,
//! one key. The script is `lua/kinds/gcra.lua`.

use serde::Serialize;

use super::params::{as_duration, gcd, human_ms, Params};

/// Largest GCRA ticks per millisecond, so that `now_ms * ticks` stays below 2^53 for
/// centuries and the script's arithmetic is exact.
const MAX_TICKS_PER_MS: i64 = 1_000;

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

impl Gcra {
    /// (emission interval T in ticks, ticks per ms), reduced so both are integers.
    pub fn ticks(&self) -> (i64, i64) {
        let g = gcd(i64::from(self.rate), self.period_ms);
        (self.period_ms / g, i64::from(self.rate) / g)
    }
}

/// The kind's script.
pub(super) const LUA: &str = include_str!("../../../lua/kinds/gcra.lua");

/// A rate (per second by default) and a burst (the rate by default), fine enough and small
/// enough for exact arithmetic.
pub(super) fn parse(p: &mut Params<'_>) -> Result<Gcra, String> {
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

/// The script's arguments: the emission interval and the burst tolerance in ticks, and ticks
/// per ms.
pub(super) fn args(g: &Gcra) -> Vec<i64> {
    let (t, ticks_per_ms) = g.ticks();
    vec![t, t * i64::from(g.burst), ticks_per_ms]
}

/// Why it refused.
pub(super) fn reason(g: &Gcra) -> String {
    format!(
        "rate {} per {} with bursts of {}",
        g.rate,
        human_ms(g.period_ms),
        g.burst
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_reduce_to_integer_ticks() {
        let g = Gcra {
            rate: 7,
            period_ms: 1_000,
            burst: 1,
        };
        assert_eq!(g.ticks(), (1_000, 7));
    }
}
