-- send_window.lua: sends only inside local windows per weekday (for example Monday 09:00 to
-- 17:30) in the recipient's zone. Whether now is inside a window, when the next one opens and
-- at what local weekday and time are computed by the worker with chrono-tz (a window whose
-- start a clock change skips opens at the first instant after the gap). Keeps no state.
--
-- KEYS: unused.
-- ARGV (this rule's slice): OPEN (1 = now is inside a window), NEXT_MS (when the next one
--       opens, -1 if none ever does), NEXT_LOCAL (its local weekday * 1440 + minute of the day,
--       Monday = 0; -1 if none).
-- Reply: {allowed, 0, -1, retry_ms, detail}: remaining is -1 (not counted); when outside a
--        window retry_ms = NEXT_MS and detail = NEXT_LOCAL, else -1 and 0.

KINDS.send_window = {
  check = function(_, _, open, next_ms, next_local)
    if open == '1' then
      return {1, 0, -1, -1, 0}
    end
    return {0, 0, -1, next_ms + 0, next_local + 0}
  end,
  commit = function() end,
  refund = function() end,
}
