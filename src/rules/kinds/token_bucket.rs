//! token_bucket: tokens refilled `rate` per `period`; a send takes its cost (fixed, or the
//! message's). The script is `lua/kinds/token_bucket.lua`.

use serde::Serialize;

use super::leaky_bucket::{self, Bucket};
use super::params::{human_ms, Params};
use crate::base::clock::MAX_WAIT_DAYS;
use crate::request::message::MAX_COST;

/// A token bucket: `capacity` tokens, refilled `rate` per `period_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct TokenBucket {
    /// Bucket size and rate.
    #[serde(flatten)]
    pub bucket: Bucket,
    /// Tokens every send takes; `None` means the message's `cost`.
    pub cost: Option<u32>,
}

/// The kind's script.
pub(super) const LUA: &str = include_str!("../../../lua/kinds/token_bucket.lua");

/// A bucket and a cost no larger than its capacity.
pub(super) fn parse(p: &mut Params<'_>) -> Result<TokenBucket, String> {
    let bucket = leaky_bucket::parse(p)?;
    let cost = p.optional_positive("cost")?;
    if let Some(cost) = cost.filter(|&c| c > bucket.capacity) {
        return Err(format!(
            "cost ({cost}) is larger than capacity ({}): no send could ever pass",
            bucket.capacity
        ));
    }
    // The longest wait: a send of the largest cost that can pass, from an empty bucket.
    let need = cost.unwrap_or(MAX_COST).min(bucket.capacity);
    let period_ms = u128::from(bucket.period_ms.unsigned_abs());
    let longest_ms = (u128::from(need) * period_ms).div_ceil(u128::from(bucket.rate));
    let longest_days = longest_ms.div_ceil(86_400_000);
    if longest_days > u128::from(MAX_WAIT_DAYS.unsigned_abs()) {
        return Err(format!(
            "a send of cost {need} could wait {longest_days} days for its tokens (capacity {} \
             refilled {} per {}), more than the {MAX_WAIT_DAYS} days any rule may make a \
             message wait",
            bucket.capacity,
            bucket.rate,
            human_ms(bucket.period_ms)
        ));
    }
    Ok(TokenBucket { bucket, cost })
}

/// The script's arguments: capacity and refill in integer units, and the fixed cost (0: the
/// message's).
pub(super) fn args(t: &TokenBucket) -> Vec<i64> {
    let (unit, refill) = t.bucket.units();
    vec![
        i64::from(t.bucket.capacity) * unit,
        unit,
        refill,
        i64::from(t.cost.unwrap_or(0)),
    ]
}

/// Why it refused a message of `cost`.
pub(super) fn reason(t: &TokenBucket, cost: u32) -> String {
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
