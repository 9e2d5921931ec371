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

-- The key's entries: scores of those inside the window ending today, whether ctx.id is among
-- them, and how many entries are older than the window (the set is sorted by score, and holds
-- at most a window's admissions plus a few stale ones, so one read of all of it is the cheapest).
local function calendar_read(key, args, ctx)
  local today, days = tonumber(args[1]), tonumber(args[4])
  local first = today - days + 1
  local entries = redis.call('ZRANGE', key, 0, -1, 'WITHSCORES')
  local scores, stale, admitted = {}, 0, false
  for i = 1, #entries, 2 do
    local s = tonumber(entries[i + 1])
    if s < first then
      stale = stale + 1
    else
      scores[#scores + 1] = s
      if entries[i] == ctx.id then admitted = true end
    end
  end
  return scores, stale, admitted, today
end

-- Sends counted against day `day`: {entries on that day, entries in the window ending that day}
local function calendar_usage(scores, day, days)
  local on_day, in_window = 0, 0
  for _, s in ipairs(scores) do
    if s == day then on_day = on_day + 1 end
    if s > day - days then in_window = in_window + 1 end
  end
  return on_day, in_window
end

KINDS.calendar_quota = {
  check = function(key, _, args, ctx)
    local per_day, per_window, days = tonumber(args[2]), tonumber(args[3]), tonumber(args[4])
    local scores, stale, admitted, today = calendar_read(key, args, ctx)
    local on_day, in_window = calendar_usage(scores, today, days)
    local left = math.min(per_day - on_day, per_window - in_window)
    if admitted then
      return {1, 1, math.max(left, 0), -1, 0}
    end
    local newest = today
    for _, s in ipairs(scores) do
      if s > newest then newest = s end
    end
    -- For commit (which decide.lua runs only after check): the newest day once today's entry
    -- is in, since entries before the window only ever leave; and whether the key is created
    -- anew (it is when no entry stays inside the window).
    ctx.calendar = ctx.calendar or {}
    ctx.calendar[key] = {newest = newest, stale = stale, fresh = #scores == 0}
    if left > 0 then
      return {1, 0, left - 1, -1, 0}
    end
    -- Walk forward day by day until both limits have room; entries never leave the set on
    -- their own, so the walk ends once the newest entry is outside the window.
    for day = today + 1, newest + days do
      local d, w = calendar_usage(scores, day, days)
      if d < per_day and w < per_window then
        return {0, 0, 0, day, 0}
      end
    end
    return {0, 0, 0, newest + days, 0}
  end,

  commit = function(key, _, args, ctx)
    local today, days = tonumber(args[1]), tonumber(args[4])
    local seen = ctx.calendar[key]
    if seen.stale > 0 then
      redis.call('ZREMRANGEBYSCORE', key, '-inf', '(' .. (today - days + 1))
    end
    redis.call('ZADD', key, today, ctx.id)
    -- An entry scored after today (the recipient's zone moved west) keeps the key one more
    -- day of UTC-12 (24 hours) per day it is ahead.
    local ahead = math.max(seen.newest - today, 0)
    expire_in_at_least(key, tonumber(args[5]) + ahead * 86400000, seen.fresh)
  end,

  refund = function(key, _, _, ctx)
    redis.call('ZREM', key, ctx.id)
  end,
}
