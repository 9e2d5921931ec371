-- leaky_bucket.lua: each send adds one to a level that leaks at a constant rate; a send that
-- would lift the level above CAPACITY is refused.
--
-- Integer units: one send = UNIT units, and the level leaks LEAK units per millisecond (the
-- worker reduces "RATE per PERIOD" to these so that all arithmetic is exact). CAP = capacity
-- in units.
-- KEYS: state hash {level (units), last (ms of the last update), unit, leak (the parameters
--       the level was counted under)}; ids = admitted ids, kept for the time a full bucket
--       takes to drain.
-- ARGV (this rule's slice): CAP, UNIT, LEAK.
-- Reply: {allowed, already, remaining, retry_ms, 0}: remaining = whole sends that still fit
--        after this one; retry_ms = when enough has leaked for one more send (nothing leaks
--        before `last`, so after the clock went back that is counted from `last`, not now).
-- Where common leaky buckets go wrong, this one does not: millisecond time, not whole seconds;
-- a clock that goes back leaks nothing (elapsed time is clamped at zero and `last` never moves
-- back).
--
-- Parameters that change (a rule reloaded with another capacity or rate, same name and kind)
-- keep the level: state written under other parameters drains under those until it is next
-- written, and a decision converts its level at that instant to the new units, rounded up
-- (retry_ms is the first instant whose converted level lets the send in). A level above the
-- new capacity refuses until it has drained below it. State without the parameters (written
-- before they were kept) was counted under the rule's current ones. Draining under the
-- parameters it was written with, the state lives exactly as long as it matters: its expiry
-- was set under them.

-- The level and last update as of `now`, whether the key is absent, whether the parameters
-- must be written with the next update (absent, not kept, or others), and the state as read
-- (numbers) when it was kept under other parameters. Parameters are compared as the strings
-- the worker wrote, which the state keeps as they came.
local function leaky_level(key, unit_arg, leak_arg, unit, leak, now)
  local v = redis.call('HMGET', key, 'level', 'last', 'unit', 'leak')
  if not v[1] then
    return 0, now, true, true
  end
  local level, last = v[1] + 0, v[2] and v[2] + 0 or now
  local elapsed = math.max(now - last, 0)
  if not v[3] or (v[3] == unit_arg and v[4] == leak_arg) then
    return math.max(level - elapsed * leak, 0), math.max(last, now), false, not v[3]
  end
  local kept = {level = level, last = last, unit = v[3] + 0, leak = v[4] + 0}
  level = math.max(level - elapsed * kept.leak, 0)
  return mul_div(level, unit, kept.unit, true, LEVEL_LIMIT), math.max(last, now), false,
    true, kept
end

-- Writes the level, with the parameters when `stamp`.
local function leaky_write(key, level, last, stamp, unit, leak)
  if stamp then
    redis.call('HSET', key, 'level', int(level), 'last', int(last), 'unit', unit, 'leak', leak)
  else
    redis.call('HSET', key, 'level', int(level), 'last', int(last))
  end
end

KINDS.leaky_bucket = {
  check = function(key, ids, cap, unit_arg, leak_arg)
    local unit, leak = unit_arg + 0, leak_arg + 0
    local level, last, absent, stamp, kept = leaky_level(key, unit_arg, leak_arg, unit, leak, NOW)
    cap = cap + 0
    if admitted_at(ids, ceil_div(cap, leak)) then
      return {1, 1, math.max(math.floor((cap - level) / unit), 0), -1, 0}
    end
    if level + unit <= cap then
      return {1, 0, math.floor((cap - level - unit) / unit), -1, 0,
        level = level, last = last, fresh = absent, stamp = stamp}
    end
    if kept then
      -- The send fits once the kept level, draining as it was written, converts to at most
      -- cap - unit: once it is at most `most` in its own units.
      local most = mul_div(cap - unit, kept.unit, unit, false, LEVEL_LIMIT)
      return {0, 0, 0, kept.last + ceil_div(kept.level - most, kept.leak), 0}
    end
    return {0, 0, 0, last + ceil_div(level + unit - cap, leak), 0}
  end,

  commit = function(key, ids, seen, cap, unit_arg, leak_arg)
    local unit, leak = unit_arg + 0, leak_arg + 0
    local level, last = seen.level + unit, seen.last
    leaky_write(key, level, last, seen.stamp, unit_arg, leak_arg)
    remember(ids, ceil_div(cap + 0, leak))
    expire_in_at_least(key, last - NOW + ceil_div(level, leak), seen.fresh)
  end,

  refund = function(key, ids, cap, unit_arg, leak_arg)
    local unit, leak = unit_arg + 0, leak_arg + 0
    if admitted_at(ids, ceil_div(cap + 0, leak)) then
      local level, last, _, stamp = leaky_level(key, unit_arg, leak_arg, unit, leak, NOW)
      leaky_write(key, math.max(level - unit, 0), last, stamp, unit_arg, leak_arg)
    end
    redis.call('ZREM', ids, ID)
  end,
}
