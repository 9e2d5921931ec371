-- calendar_quota.lua: at most PER_DAY sends per local calendar day and PER_WINDOW sends per
-- WINDOW_DAYS local days (the window ends today, inclusive).
--
-- KEYS: the rule's key, a sorted set: member = message id, score = local day number of the
--       day the message was admitted on (it holds the ids itself; the ids key is unused).
-- ARGV (this rule's slice): TODAY (local day number, computed by the worker with chrono-tz),
--       PER_DAY, PER_WINDOW, WINDOW_DAYS, EXPIRE_IN (ms from now until day TODAY + WINDOW_DAYS
--       begins in UTC-12, the last zone to reach it: when today's entry stops mattering in
--       every zone the recipient may move to).
-- Reply: {allowed, already, remaining, retry_day, 0}: remaining = sends still allowed after
--       this one (or now, when denied or already admitted); retry_day = the first local day
--       number on which a send would be allowed, -1 when allowed.
--
-- Entries older than the window are ignored when reading and removed when committing, so an id
-- is recognised as already admitted exactly while its entry is inside the window. A denied
-- attempt writes nothing.

-- Sends counted against day `day` among `entries`, the key's ZRANGE WITHSCORES reply: {entries
-- on that day, entries in the window ending that day}. Entries older than today's window never
-- count: every day asked about is today or later.
local function calendar_usage(entries, day, days)
  local on_day, in_window = 0, 0
  for i = 2, #entries, 2 do
    local s = tonumber(entries[i])
    if s == day then on_day = on_day + 1 end
    if s > day - days then in_window = in_window + 1 end
  end
  return on_day, in_window
end

-- Redis's Lua is an interpreter that allocates every table and formats every number handed to
-- redis.call, and those costs are a large part of a decision: the check reads the key in one
-- pass without copying it, hands commit what it learnt in its own result table (fields past
-- the reply's five), and passes ARGV strings to Redis as they came.
KINDS.calendar_quota = {
  check = function(key, _, args, ctx)
    local today, per_day, per_window, days =
      tonumber(args[1]), tonumber(args[2]), tonumber(args[3]), tonumber(args[4])
    local first = today - days + 1
    -- The set holds at most a window's admissions plus a few stale ones, so reading all of
    -- it is the cheapest read.
    local entries = redis.call('ZRANGE', key, '0', '-1', 'WITHSCORES')
    local on_day, in_window, stale, newest, admitted = 0, 0, 0, today, false
    for i = 1, #entries, 2 do
      local s = tonumber(entries[i + 1])
      if s < first then
        stale = stale + 1
      else
        in_window = in_window + 1
        if s == today then on_day = on_day + 1 end
        if s > newest then newest = s end
        if entries[i] == ctx.id then admitted = true end
      end
    end
    local left = math.min(per_day - on_day, per_window - in_window)
    if admitted then
      return {1, 1, math.max(left, 0), -1, 0}
    end
    if left > 0 then
      -- For commit (which decide.lua runs only after check): the newest day once today's
      -- entry is in, since entries before the window only ever leave; how many entries are
      -- stale; and whether the key is created anew (no entry stays inside the window).
      -- Redis replies with the array part only, so these fields stay out of the reply.
      return {1, 0, left - 1, -1, 0, newest = newest, stale = stale, fresh = in_window == 0}
    end
    -- Walk forward day by day until both limits have room; entries never leave the set on
    -- their own, so the walk ends once the newest entry is outside the window.
    for day = today + 1, newest + days do
      local d, w = calendar_usage(entries, day, days)
      if d < per_day and w < per_window then
        return {0, 0, 0, day, 0}
      end
    end
    return {0, 0, 0, newest + days, 0}
  end,

  commit = function(key, _, args, ctx, seen)
    local today = tonumber(args[1])
    if seen.stale > 0 then
      redis.call('ZREMRANGEBYSCORE', key, '-inf', '(' .. (today - tonumber(args[4]) + 1))
    end
    redis.call('ZADD', key, args[1], ctx.id)
    -- An entry scored after today (the recipient's zone moved west) keeps the key one more
    -- day of UTC-12 (24 hours) per day it is ahead.
    local ahead = seen.newest - today
    if ahead > 0 then
      expire_in_at_least(key, tonumber(args[5]) + ahead * 86400000, seen.fresh)
    else
      expire_in_at_least(key, args[5], seen.fresh)
    end
  end,

  refund = function(key, _, _, ctx)
    redis.call('ZREM', key, ctx.id)
  end,
}
