-- quiet_hours.lua: no sends between two local times of day (for example 22:00 to 08:00) in the
-- recipient's zone. Whether now is quiet, and when the quiet period ends, are computed by the
-- worker with chrono-tz (a quiet end that a clock change skips is the first instant after it).
-- Keeps no state.
--
-- KEYS: unused.
-- ARGV (this rule's slice): QUIET (1 = now is inside the quiet period), END_MS (when it ends).
-- Reply: {allowed, 0, -1, retry_ms, 0}: remaining is -1 (not counted); retry_ms = END_MS when
--        quiet, else -1.

KINDS.quiet_hours = {
  check = function(_, _, quiet, end_ms)
    if quiet == '1' then
      return {0, 0, -1, end_ms + 0, 0}
    end
    return {1, 0, -1, -1, 0}
  end,
  commit = function() end,
  refund = function() end,
}
