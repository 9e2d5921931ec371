//! leaky_bucket: a level that leaks `rate` per `period`; a send is refused at `capacity`. Its
//! parameters, [`Bucket`], are also the token bucket's. The script is
//! `lua/kinds/leaky_bucket.lua`.

use serde::Serialize;

use super::params::{as_duration, gcd, human_ms, Params};

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

impl Bucket {
    /// (units per send, units leaked or refilled per ms), reduced so both are integers.
    pub fn units(&self) -> (i64, i64) {
        let g = gcd(i64::from(self.rate), self.period_ms);
        (self.period_ms / g, i64::from(self.rate) / g)
    }
}

/// The kind's script.
pub(super) const LUA: &str = include_str!("../../../lua/kinds/leaky_bucket.lua");

/// A capacity and a rate (per second by default) small enough for exact arithmetic.
pub(super) fn parse(p: &mut Params<'_>) -> Result<Bucket, String> {
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

/// The script's arguments: capacity and leak in integer units.
pub(super) fn args(b: &Bucket) -> Vec<i64> {
    let (unit, leak) = b.units();
    vec![i64::from(b.capacity) * unit, unit, leak]
}

/// Why it refused.
pub(super) fn reason(b: &Bucket) -> String {
    format!(
        "bucket full: capacity {} leaking {} per {}",
        b.capacity,
        b.rate,
        human_ms(b.period_ms)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_reduce_to_integer_units() {
        let b = Bucket {
            capacity: 5,
            rate: 10,
            period_ms: 1_000,
        };
        assert_eq!(b.units(), (100, 1));
    }
}
