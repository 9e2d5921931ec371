-- prelude.lua: shared helpers for the composed decision script.
--
-- The decision script is this file, then one file per limiter kind (each registers itself in
-- KINDS), then decide.lua, concatenated when the crate is built. Every kind provides:
--   check(key, args, ctx)  -> {allowed, already, remaining, retry}   (reads only)
--   commit(key, args, ctx, result)                                    (consumes for ctx.id)
--   refund(key, args, ctx)                                            (gives back ctx.id's take)
-- `allowed` and `already` are 0/1; `already` = 1 when ctx.id was admitted before and consumes
-- nothing again. `retry` is kind-specific (a day number, or epoch ms), -1 when there is none.
-- Times come from the worker (ctx.now, integer ms), never from the Redis server.

local KINDS = {}

-- Make sure `key` lives at least `ttl_ms` more milliseconds. Expiries are durations computed
-- from the worker's clock, never absolute instants: Redis measures them on its own clock, which
-- may differ from the worker's (skew, or a simulated clock in tests). An expiry is never
-- shortened, and a key always has one after this call.
local function expire_in_at_least(key, ttl_ms)
  ttl_ms = math.max(math.ceil(ttl_ms), 1)
  local current = redis.call('PTTL', key)
  if current < 0 or current < ttl_ms then
    redis.call('PEXPIRE', key, ttl_ms)
  end
end
