-- token_bucket.lua: a bucket of CAPACITY tokens refilled at a constant rate; a send takes COST
-- tokens (the rule's fixed cost, or the message's `cost`), and is refused when fewer remain.
--
-- Integer units: one token = UNIT units, and REFILL units arrive per millisecond (the worker
-- reduces "RATE per PERIOD" to these so that all arithmetic is exact). CAP = capacity in units.
-- KEYS: state hash {tokens (units), last (ms), cap, unit, refill (the parameters the tokens were
--       counted under)}; a missing key is a full bucket; ids = admitted ids, kept for the time
--       an empty bucket takes to fill.
-- ARGV (this rule's slice): CAP, UNIT, REFILL, COST (0 = use the message's cost).
-- Reply: {allowed, already, remaining, retry_ms, 0}: remaining = whole tokens left after this
--        send; retry_ms = when enough tokens will be there (-1 if the cost exceeds the
--        capacity: never; nothing refills before `last`, so after the clock went back that is
--        counted from `last`, not now).
-- Where common token buckets go wrong, this one does not: millisecond time; fractional tokens
-- compared with >=, not == 0; one hash, not two keys; a clock that goes back adds no tokens.
--
-- Parameters that change (a rule reloaded with another capacity or rate, same name and kind)
-- keep what the bucket owes: state written under other parameters refills under those until
-- it is next written, and a decision converts its deficit at that instant (capacity minus
-- tokens: what was taken and has not come back) to the new units, rounded up, and takes it from
-- the new capacity (retry_ms is the first instant whose converted deficit lets the send in). A
-- full bucket stays full, as a missing key is; a deficit larger than the new capacity leaves
-- the bucket below zero until it has refilled. State without the parameters (written before
-- they were kept) was counted under the rule's current ones. Refilling under the parameters it
-- was written with, the state lives exactly as long as it matters: its expiry was set under
-- them.

-- The tokens and last update as of `now`, whether the key is absent, whether the parameters
-- must be written with the next update (absent, not kept, or others), and the state as read
-- (numbers) when it was kept under other parameters. Parameters are compared as the strings
-- the worker wrote, which the state keeps as they came.
local function token_level(key, cap_arg, unit_arg, refill_arg, cap, unit, refill, now)
  local v = redis.call('HMGET', key, 'tokens', 'last', 'cap', 'unit', 'refill')
  if not v[1] then
    return cap, now, true, true
  end
  local tokens, last = v[1] + 0, v[2] and v[2] + 0 or now
  local elapsed = math.max(now - last, 0)
  if not v[4] or (v[4] == unit_arg and v[5] == refill_arg and v[3] == cap_arg) then
    return math.min(tokens + elapsed * refill, cap), math.max(last, now), false, not v[4]
  end
  local kept = {tokens = tokens, last = last, cap = v[3] + 0, unit = v[4] + 0, refill = v[5] + 0}
  local deficit = kept.cap - math.min(tokens + elapsed * kept.refill, kept.cap)
  return cap - mul_div(deficit, unit, kept.unit, true, LEVEL_LIMIT), math.max(last, now), false,
    true, kept
end

-- What a send takes, in units: the rule's fixed COST, or the message's when that is 0.
local function token_cost(unit, cost)
  cost = cost + 0
  return (cost > 0 and cost or COST) * unit
end

-- Writes the tokens and last update, with the parameters when `stamp`.
local function token_write(key, tokens, last, stamp, cap, unit, refill)
  if stamp then
    redis.call('HSET', key, 'tokens', int(tokens), 'last', int(last), 'cap', cap, 'unit', unit,
      'refill', refill)
  else
    redis.call('HSET', key, 'tokens', int(tokens), 'last', int(last))
  end
end

KINDS.token_bucket = {
  check = function(key, ids, cap_arg, unit_arg, refill_arg, cost)
    local cap, unit, refill = cap_arg + 0, unit_arg + 0, refill_arg + 0
    local tokens, last, absent, stamp, kept =
      token_level(key, cap_arg, unit_arg, refill_arg, cap, unit, refill, NOW)
    local need = token_cost(unit, cost)
    local whole = math.max(math.floor(tokens / unit), 0)
    if admitted_at(ids, ceil_div(cap, refill)) then
      return {1, 1, whole, -1, 0}
    end
    if tokens >= need then
      return {1, 0, math.floor((tokens - need) / unit), -1, 0,
        tokens = tokens - need, last = last, fresh = absent, stamp = stamp}
    end
    if need > cap then
      return {0, 0, whole, -1, 0}
    end
    if kept then
      -- The send fits once the kept deficit, refilling as it was written, converts to at most
      -- cap - need: once it is at most `most` in its own units.
      local most = mul_div(cap - need, kept.unit, unit, false, LEVEL_LIMIT)
      return {0, 0, whole, kept.last + ceil_div(kept.cap - kept.tokens - most, kept.refill), 0}
    end
    return {0, 0, whole, last + ceil_div(need - tokens, refill), 0}
  end,

  commit = function(key, ids, seen, cap, unit, refill)
    local tokens, last = seen.tokens, seen.last
    token_write(key, tokens, last, seen.stamp, cap, unit, refill)
    cap, refill = cap + 0, refill + 0
    remember(ids, ceil_div(cap, refill))
    expire_in_at_least(key, last - NOW + ceil_div(cap - tokens, refill), seen.fresh)
  end,

  refund = function(key, ids, cap_arg, unit_arg, refill_arg, cost)
    local cap, unit, refill = cap_arg + 0, unit_arg + 0, refill_arg + 0
    if admitted_at(ids, ceil_div(cap, refill)) then
      local tokens, last, _, stamp =
        token_level(key, cap_arg, unit_arg, refill_arg, cap, unit, refill, NOW)
      tokens = math.min(tokens + token_cost(unit, cost), cap)
      token_write(key, tokens, last, stamp, cap_arg, unit_arg, refill_arg)
    end
    redis.call('ZREM', ids, ID)
  end,
}
