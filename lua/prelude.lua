-- prelude.lua: shared helpers for the composed decision script.
--
-- The decision script is this file, then one file per limiter kind (each registers itself in
-- KINDS), then decide.lua, concatenated when the crate is built. Every kind provides:
--   check(key, ids, args, ctx)  -> {allowed, already, remaining, retry, detail}   (reads only)
--   commit(key, ids, args, ctx, result)   (consumes for ctx.id, sets expiries; `result` is the
--                                          table check returned, which may carry named fields
--                                          for it: Redis replies with the array part only, but
--                                          reads err, ok, double, map, set, big_number and
--                                          verbatim_string as reply types, so never those)
--   refund(key, ids, args, ctx)                            (gives back what ctx.id took)
-- `key` holds the rule's state; `ids` is a sorted set of admitted message ids (score = the
-- worker's ms when admitted) for kinds whose state cannot hold ids. `allowed` and `already`
-- are 0/1; `already` = 1 when ctx.id was admitted before and consumes nothing again.
-- `retry` is when the rule would next admit this message (epoch ms of the worker's clock, or
-- a day number for calendar_quota), -1 when it admits it now or never will.
-- ctx = {now = worker ms, now_arg = the same as the worker wrote it, id = message id,
--        cost = the message's cost}.
--
-- All arithmetic is on integers below 2^53 (the worker scales rates so that it is), so the
-- results are exact and equal to the Rust reference models'.

local KINDS = {}

-- An integer as a string without exponent, for values written to Redis.
local function int(x)
  return string.format('%.0f', x)
end

-- Make sure `key` lives at least `ttl_ms` more milliseconds. Expiries are durations computed
-- from the worker's clock, never absolute instants: Redis measures them on its own clock, which
-- may differ from the worker's (skew, or a simulated clock in tests). An expiry is never
-- shortened, and a key always has one after this call. `fresh` says the caller created the key
-- in this script (it has no expiry yet), which saves the extra calls. `ttl_ms` is a number, or
-- an ARGV string: one holding a whole number of at least 1 is passed on as it is, which spares
-- formatting it again.
local function expire_in_at_least(key, ttl_ms, fresh)
  if type(ttl_ms) ~= 'string' or tonumber(ttl_ms) < 1 then
    ttl_ms = math.max(math.ceil(tonumber(ttl_ms)), 1)
  end
  if fresh then
    redis.call('PEXPIRE', key, ttl_ms)
    return
  end
  -- GT treats a key without expiry as living forever, so a 0 here may also mean "no expiry".
  if redis.call('PEXPIRE', key, ttl_ms, 'GT') == 0 and redis.call('PTTL', key) == -1 then
    redis.call('PEXPIRE', key, ttl_ms)
  end
end

-- Integer ceiling of a / b for a >= 0, b > 0.
local function ceil_div(a, b)
  return math.floor((a + b - 1) / b)
end

-- The ms at which ctx.id was admitted, if that was less than `memory_ms` ago.
local function admitted_at(ids, ctx, memory_ms)
  local at = redis.call('ZSCORE', ids, ctx.id)
  if at and tonumber(at) > ctx.now - memory_ms then
    return tonumber(at)
  end
  return nil
end

-- Records ctx.id as admitted now, forgetting ids older than `memory_ms`.
local function remember(ids, ctx, memory_ms)
  redis.call('ZREMRANGEBYSCORE', ids, '-inf', ctx.now - memory_ms)
  redis.call('ZADD', ids, ctx.now_arg, ctx.id)
  expire_in_at_least(ids, memory_ms)
end

-- Reads a hash of integer fields into a table of numbers (missing fields are absent).
local function hash_numbers(key)
  local flat = redis.call('HGETALL', key)
  local out = {}
  for i = 1, #flat, 2 do
    out[flat[i]] = tonumber(flat[i + 1])
  end
  return out
end

-- The claim on message `id` in the claims hash `key` (field = id, value = '<token> <expires
-- ms>'): its holder's token and when it expires, whether or not it has; nil when there is none.
local function claim_of(key, id)
  local held = redis.call('HGET', key, id)
  if not held then
    return nil
  end
  local sep = string.find(held, ' ', 1, true)
  return string.sub(held, 1, sep - 1), tonumber(string.sub(held, sep + 1))
end

-- Redis's own clock, in ms. Claims are leases on real time, measured by the one clock every
-- worker shares: a worker's clock may be skewed, or simulated (`worker --now`), and a lease
-- measured on it could never run out.
local function server_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Claims message `id` for `token` until `lease` ms after `now` (server_ms()); the hash lives at
-- least as long.
local function hold_claim(key, id, token, now, lease)
  redis.call('HSET', key, id, token .. ' ' .. int(now + lease))
  expire_in_at_least(key, lease)
end
