-- token_bucket.lua: a bucket of CAPACITY tokens refilled at a constant rate; a send takes COST
-- tokens (the rule's fixed cost, or the message's `cost`), and is refused when fewer remain.
--
-- Integer units: one token = UNIT units, and REFILL units arrive per millisecond (the worker
-- reduces "RATE per PERIOD" to these so that all arithmetic is exact). CAP = capacity in units.
-- KEYS: state hash {tokens (units), last (ms)}; a missing key is a full bucket; ids = admitted
--       ids, kept for the time an empty bucket takes to fill.
-- ARGV (this rule's slice): CAP, UNIT, REFILL, COST (0 = use the message's cost).
-- Reply: {allowed, already, remaining, retry_ms, 0}: remaining = whole tokens left after this
--        send; retry_ms = when enough tokens will be there (-1 if the cost exceeds the
--        capacity: never; nothing refills before `last`, so after the clock went back that is
--        counted from `last`, not now).
-- Where common token buckets go wrong, this one does not: millisecond time; fractional tokens
-- compared with >=, not == 0; one hash, not two keys; a clock that goes back adds no tokens.

-- The tokens and last update as of `now`, and whether the key is absent.
local function token_level(key, cap, refill, now)
  local s = hash_numbers(key)
  if s.tokens == nil then
    return cap, now, true
  end
  local last = s.last or now
  local elapsed = math.max(now - last, 0)
  return math.min(s.tokens + elapsed * refill, cap), math.max(last, now), false
end

-- What a send takes, in units: the rule's fixed COST, or the message's when that is 0.
local function token_cost(unit, cost)
  cost = cost + 0
  return (cost > 0 and cost or COST) * unit
end

KINDS.token_bucket = {
  check = function(key, ids, cap, unit, refill, cost)
    cap, unit, refill = cap + 0, unit + 0, refill + 0
    local need = token_cost(unit, cost)
    local tokens, last, absent = token_level(key, cap, refill, NOW)
    if admitted_at(ids, ceil_div(cap, refill)) then
      return {1, 1, math.floor(tokens / unit), -1, 0}
    end
    if tokens >= need then
      return {1, 0, math.floor((tokens - need) / unit), -1, 0,
        tokens = tokens - need, last = last, fresh = absent}
    end
    if need > cap then
      return {0, 0, math.floor(tokens / unit), -1, 0}
    end
    return {0, 0, math.floor(tokens / unit), last + ceil_div(need - tokens, refill), 0}
  end,

  commit = function(key, ids, seen, cap, _, refill)
    cap, refill = cap + 0, refill + 0
    local tokens, last = seen.tokens, seen.last
    redis.call('HSET', key, 'tokens', int(tokens), 'last', int(last))
    remember(ids, ceil_div(cap, refill))
    expire_in_at_least(key, last - NOW + ceil_div(cap - tokens, refill), seen.fresh)
  end,

  refund = function(key, ids, cap, unit, refill, cost)
    cap, unit, refill = cap + 0, unit + 0, refill + 0
    if admitted_at(ids, ceil_div(cap, refill)) then
      local tokens, last = token_level(key, cap, refill, NOW)
      tokens = math.min(tokens + token_cost(unit, cost), cap)
      redis.call('HSET', key, 'tokens', int(tokens), 'last', int(last))
    end
    redis.call('ZREM', ids, ID)
  end,
}
