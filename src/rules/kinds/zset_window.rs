//! zset_window: at most `limit` sends per sliding window, exactly, one entry per admitted
//! send (so the limit is bounded). The script is `lua/kinds/zset_window.lua`.

use super::fixed_window::{self, Window};
use super::params::{human_ms, Params};

/// Largest limit of a zset window: it keeps one entry per admitted send.
const MAX_ZSET_LIMIT: u32 = 10_000;

/// The kind's script.
pub(super) const LUA: &str = include_str!("../../../lua/kinds/zset_window.lua");

/// A window whose limit the sorted set can hold.
pub(super) fn parse(p: &mut Params<'_>) -> Result<Window, String> {
    let w = fixed_window::parse(p)?;
    if w.limit > MAX_ZSET_LIMIT {
        return Err(format!(
            "limit ({}) is more than {MAX_ZSET_LIMIT}: zset_window keeps one entry per \
             send; use sliding_window or gcra for large limits",
            w.limit
        ));
    }
    Ok(w)
}

/// Why it refused.
pub(super) fn reason(w: &Window) -> String {
    format!("at most {} per {}", w.limit, human_ms(w.window_ms))
}
