-- leaky_bucket.lua: each send adds one to a level that leaks at a constant rate; a send that
-- would lift the level above CAPACITY is refused.
--
-- Integer units: one send = UNIT units, and the level leaks LEAK units per millisecond (the
-- worker reduces "RATE per PERIOD" to these so that all arithmetic is exact). CAP = capacity
-- in units.
-- KEYS: state hash {level (units), last (ms of the last update)}; ids = admitted ids, kept for
--       the time a full bucket takes to drain.
-- ARGV (this rule's slice): CAP, UNIT, LEAK.
-- Reply: {allowed, already, remaining, retry_ms, 0}: remaining = whole sends that still fit
--        after this one; retry_ms = when enough has leaked for one more send (nothing leaks
--        before `last`, so after the clock went back that is counted from `last`, not now).
-- Where common leaky buckets go wrong, this one does not: millisecond time, not whole seconds;
-- a clock that goes back leaks nothing (elapsed time is clamped at zero and `last` never moves
-- back).

-- The level and last update as of `now`, and whether the key is absent.
local function leaky_level(key, leak, now)
  local s = hash_numbers(key)
  local level, last = s.level or 0, s.last or now
  local elapsed = math.max(now - last, 0)
  return math.max(level - elapsed * leak, 0), math.max(last, now), s.level == nil
end

KINDS.leaky_bucket = {
  check = function(key, ids, cap, unit, leak)
    cap, unit, leak = cap + 0, unit + 0, leak + 0
    local level, last, absent = leaky_level(key, leak, NOW)
    if admitted_at(ids, ceil_div(cap, leak)) then
      return {1, 1, math.floor((cap - level) / unit), -1, 0}
    end
    if level + unit <= cap then
      return {1, 0, math.floor((cap - level - unit) / unit), -1, 0,
        level = level, last = last, fresh = absent}
    end
    return {0, 0, 0, last + ceil_div(level + unit - cap, leak), 0}
  end,

  commit = function(key, ids, seen, cap, unit, leak)
    cap, unit, leak = cap + 0, unit + 0, leak + 0
    local level, last = seen.level + unit, seen.last
    redis.call('HSET', key, 'level', int(level), 'last', int(last))
    remember(ids, ceil_div(cap, leak))
    expire_in_at_least(key, last - NOW + ceil_div(level, leak), seen.fresh)
  end,

  refund = function(key, ids, cap, unit, leak)
    cap, unit, leak = cap + 0, unit + 0, leak + 0
    if admitted_at(ids, ceil_div(cap, leak)) then
      local level, last = leaky_level(key, leak, NOW)
      redis.call('HSET', key, 'level', int(math.max(level - unit, 0)), 'last', int(last))
    end
    redis.call('ZREM', ids, ID)
  end,
}
