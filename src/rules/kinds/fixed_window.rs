//! fixed_window: at most `limit` sends per window that starts at the first send. Its
//! parameters, [`Window`], are also the zset window's. The script is
//! `lua/kinds/fixed_window.lua`.

use serde::Serialize;

use super::params::{as_duration, human_ms, Params};

/// A limit per window (fixed or exact sliding).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Window {
    /// Sends allowed per window.
    pub limit: u32,
    /// Window length in milliseconds.
    #[serde(rename = "window", serialize_with = "as_duration")]
    pub window_ms: i64,
}

/// The kind's script.
pub(super) const LUA: &str = include_str!("../../../lua/kinds/fixed_window.lua");

/// A limit and a window, both required.
pub(super) fn parse(p: &mut Params<'_>) -> Result<Window, String> {
    Ok(Window {
        limit: p.positive("limit", None)?,
        window_ms: p.duration("window", None)?,
    })
}

/// The script's arguments (the zset window takes the same).
pub(super) fn args(w: &Window) -> Vec<i64> {
    vec![i64::from(w.limit), w.window_ms]
}

/// Why it refused.
pub(super) fn reason(w: &Window) -> String {
    format!(
        "at most {} per {} fixed window",
        w.limit,
        human_ms(w.window_ms)
    )
}
