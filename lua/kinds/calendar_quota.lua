-- calendar_quota.lua: at most PER_DAY sends per local calendar day and PER_WINDOW sends per
-- WINDOW_DAYS local days (the window ends today, inclusive), judged in the zone of the message
-- being decided.
--
-- KEYS: the rule's key, a sorted set: member = message id, score = the instant (worker ms) the
--       message was admitted at (it holds the ids itself; the ids key is unused). Sends are
--       kept as instants, not as day numbers of the zone they were decided in, so one
--       recipient has one history whichever zones its messages carry: a message counts every
--       earlier send that falls on its own local day and window.
--       Keys written before instants were kept score a local day number instead (below
--       LEGACY_BELOW); those entries count on that day number in every zone until they expire.
-- ARGV (this rule's slice): TODAY (local day number, for legacy entries), DAY_BEGIN (ms, the
--       first instant of today in the message's zone), WINDOW_BEGIN (ms, the first instant of
--       the window's first day), PER_DAY, PER_WINDOW, WINDOW_DAYS, FORGET_BEFORE (ms: no
--       zone's window reaches an entry older than this), KEEP_MS (how long the key must live
--       after an admission: until FORGET_BEFORE passes the new entry), DAY_END (ms, the first
--       instant of tomorrow in the message's zone).
--       Then, only for a message a reservation keeps out of the rule's last slots
--       (src/rules/priority.rs): OFF, the slots taken off both limits for this decision (the
--       reservation's before its lapse, 0 after), and KEPT, the reservation's slots.
-- Reply: {allowed, already, remaining, retry, day_full}: remaining = sends still allowed
--       after this one (or now, when denied or already admitted). When denied: retry = the
--       score of the in-window entry whose leaving the window makes room (-1 when the window
--       has room), day_full = 1 when today is full; the worker turns these into the first
--       instant with room in the message's zone (src/rules/kinds/calendar_quota.rs).
--       With KEPT, a denial says what the days ahead need instead, for both sets of limits (a
--       reservation applies again every morning): retry = the entry whose leaving makes room
--       under the limits less KEPT, and detail = today_open + 2 * (full_entry + 1), where
--       today_open = 1 when the full limits have room today and full_entry is the entry whose
--       leaving makes room under them (-1 when none has to).
--
-- Entries no zone still counts are removed when committing, never one some zone still counts,
-- and an id is recognised as already admitted exactly while its entry is inside the window. A
-- denied attempt writes nothing.
--
-- Today's count and the window's end with today: an entry from tomorrow on (seen by a what-if
-- at an instant before later sends, or by a worker whose clock lags the one that wrote it)
-- counts on its own day and in the windows holding it, not today.

-- Scores below this are local day numbers (legacy entries), above it instants in ms: a day
-- number this large is 270,000 years away, an instant this small is 1970-01-02.
local LEGACY_BELOW = 100000000

-- Whether an entry scored `s` counts in the window and on today: instants from the window's
-- and the day's first instants to the day's end, legacy day numbers from the window's first
-- day to today.
local function counts(s, first, today, window_begin, day_begin, day_end)
  if s < LEGACY_BELOW then
    return s >= first and s <= today, s == today
  end
  return s >= window_begin and s < day_end, s >= day_begin and s < day_end
end

-- The score of the k-th oldest entry counted in the window (oldest first, as below), -1 when
-- k < 1 (the window has room).
local function kth_in_window(entries, k, first, today, window_begin, day_begin, day_end)
  if k < 1 then
    return -1
  end
  for i = 1, #entries, 2 do
    local s = entries[i + 1] + 0
    if counts(s, first, today, window_begin, day_begin, day_end) then
      k = k - 1
      if k == 0 then
        return s
      end
    end
  end
  return -1
end

-- The check reads the key in one pass without copying it and hands commit what it learnt in
-- its own result table (array slots past the reply's five); an empty key, a recipient's first
-- send, needs none of the window's bounds, so they are converted only when there are entries
-- (each conversion is a strtod); ARGV strings are passed to Redis as they came.
KINDS.calendar_quota = {
  check = function(key, _, today, day_begin, window_begin, per_day, per_window, days,
                   forget_before, _, day_end, off, kept)
    off, kept = off and off + 0 or 0, kept and kept + 0 or 0
    per_day, per_window = per_day - off, per_window - off
    -- The set holds at most a window's admissions plus a few stale ones, so reading all of
    -- it is the cheapest read.
    local entries = redis.call('ZRANGE', key, '0', '-1', 'WITHSCORES')
    if #entries == 0 and per_day > 0 and per_window > 0 then
      -- Slots 6 and 7 for commit: no stale entry, and the key is created anew.
      return {1, 0, math.min(per_day, per_window) - 1, -1, 0, 0, true}
    end
    today, day_begin, window_begin = today + 0, day_begin + 0, window_begin + 0
    forget_before, day_end = forget_before + 0, day_end + 0
    local first = today - days + 1
    -- Legacy entries are forgotten a day later than the window's first day: local dates on
    -- Earth differ by up to two days at one instant.
    local forget_day = first - 2
    local on_day, in_window, stale, admitted = 0, 0, 0, false
    for i = 1, #entries, 2 do
      local s = entries[i + 1] + 0
      local in_w, on_d = counts(s, first, today, window_begin, day_begin, day_end)
      if in_w then
        in_window = in_window + 1
        if on_d then on_day = on_day + 1 end
        if entries[i] == ID then admitted = true end
      end
      if (s < LEGACY_BELOW and s < forget_day) or (s >= LEGACY_BELOW and s < forget_before) then
        stale = stale + 1
      end
    end
    local left = math.min(per_day - on_day, per_window - in_window)
    if admitted then
      return {1, 1, math.max(left, 0), -1, 0}
    end
    if left > 0 then
      -- Slots 6 and 7 for commit (which decide.lua runs only after check): how many entries
      -- are stale, and whether the key is created anew (every entry it holds is stale).
      return {1, 0, left - 1, -1, 0, stale, stale * 2 == #entries}
    end
    if kept > 0 then
      -- Under a limit of n, room opens when the (in_window - n + 1)-th oldest in-window entry
      -- leaves the window.
      local full_day, full_window = per_day + off, per_window + off
      local today_open = (on_day < full_day and in_window < full_window) and 1 or 0
      local full_entry = kth_in_window(entries, in_window - full_window + 1, first, today,
        window_begin, day_begin, day_end)
      local kept_entry = kth_in_window(entries, in_window - full_window + kept + 1, first, today,
        window_begin, day_begin, day_end)
      return {0, 0, 0, kept_entry, today_open + 2 * (full_entry + 1)}
    end
    local retry = -1
    if in_window >= per_window then
      -- Entries come oldest first (legacy day numbers sort before instants, and were written
      -- before them): room opens when the k-th oldest in-window entry leaves the window.
      local k = in_window - per_window + 1
      for i = 1, #entries, 2 do
        local s = entries[i + 1] + 0
        if counts(s, first, today, window_begin, day_begin, day_end) then
          k = k - 1
          if k == 0 then
            retry = s
            break
          end
        end
      end
    end
    return {0, 0, 0, retry, on_day >= per_day and 1 or 0}
  end,

  commit = function(key, _, seen, today, _, _, _, _, days, forget_before, keep_ms)
    if seen[6] > 0 then
      redis.call('ZREMRANGEBYSCORE', key, '-inf', '(' .. int(today - days - 1))
      redis.call('ZREMRANGEBYSCORE', key, LEGACY_BELOW, '(' .. forget_before)
    end
    redis.call('ZADD', key, NOW_ARG, ID)
    expire_in_at_least(key, keep_ms, seen[7])
  end,

  refund = function(key)
    redis.call('ZREM', key, ID)
  end,
}
