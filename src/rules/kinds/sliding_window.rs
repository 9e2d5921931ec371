//! sliding_window: at most `limit` sends per sliding window, counted in sub-windows (a hash
//! or a list). The script is `lua/kinds/sliding_window.lua`.

use serde::Serialize;

use super::fixed_window::{self, Window};
use super::params::{as_duration, human_ms, Params};

/// Most sub-windows per window: each is a counter read on every decision.
const MAX_SUB_WINDOWS: i64 = 1_000;

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

/// The kind's script.
pub(super) const LUA: &str = include_str!("../../../lua/kinds/sliding_window.lua");

/// A window with sub-windows that divide it (a tenth of it by default) and a storage layout.
pub(super) fn parse(p: &mut Params<'_>) -> Result<SlidingWindow, String> {
    let Window { limit, window_ms } = fixed_window::parse(p)?;
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

/// Checks that sub-windows of `sub` ms divide `window` ms and are not too many (`what` names
/// the window in the error); the sliding log's policies are held to the same.
pub(super) fn check_sub_window(sub: i64, window: i64, what: &str) -> Result<(), String> {
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

/// The script's arguments.
pub(super) fn args(s: &SlidingWindow) -> Vec<i64> {
    vec![
        i64::from(s.limit),
        s.window_ms,
        s.sub_window_ms,
        match s.storage {
            Storage::Hash => 0,
            Storage::List => 1,
        },
    ]
}

/// Why it refused.
pub(super) fn reason(s: &SlidingWindow) -> String {
    format!("at most {} per sliding {}", s.limit, human_ms(s.window_ms))
}
