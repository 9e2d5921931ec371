//! sliding_log: several (limit, window) policies over one log of sub-window counters. The
//! script is `lua/kinds/sliding_log.lua`.

use serde::Serialize;

use super::fixed_window;
use super::params::{as_duration, as_policies, human_ms, Params};
use super::sliding_window::check_sub_window;

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

/// The kind's script.
pub(super) const LUA: &str = include_str!("../../../lua/kinds/sliding_log.lua");

/// A sub-window and policies whose windows it divides, longer windows allowing more.
pub(super) fn parse(p: &mut Params<'_>) -> Result<SlidingLog, String> {
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
        let w = fixed_window::parse(&mut q).map_err(|e| format!("policies[{i}]: {e}"))?;
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

/// The script's arguments: the sub-window, then each policy's limit and window.
pub(super) fn args(l: &SlidingLog) -> Vec<i64> {
    let mut out = vec![l.sub_window_ms, l.policies.len() as i64];
    for &(limit, window) in &l.policies {
        out.extend([i64::from(limit), window]);
    }
    out
}

/// Why it refused: `detail` is the refusing policy's number (from 1).
pub(super) fn reason(l: &SlidingLog, detail: i64) -> String {
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
