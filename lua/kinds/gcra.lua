-- gcra.lua: the generic cell rate algorithm (as redis-cell and redis_rate): RATE sends per
-- PERIOD, with bursts of up to BURST, exact, in one key holding the theoretical arrival time.
--
-- Integer ticks: the worker reduces RATE per PERIOD_MS by their gcd so that a tick is 1/TPM of
-- a millisecond and the emission interval T is a whole number of ticks; TAU = T * BURST.
-- KEYS: state = the theoretical arrival time (TAT) in ticks; ids = admitted ids, kept until the
--       TAT they produced has passed.
-- ARGV (this rule's slice): T, TAU, TPM.
-- Reply: {allowed, already, remaining, retry_ms, 0}: remaining = sends still allowed right now
--        after this one; retry_ms = when this send would be allowed (rounded up to the ms).

local function gcra_tat(key, now_t)
  local stored = redis.call('GET', key)
  return math.max(stored and tonumber(stored) or now_t, now_t)
end

KINDS.gcra = {
  check = function(key, ids, args, ctx)
    local t, tau, tpm = tonumber(args[1]), tonumber(args[2]), tonumber(args[3])
    local now_t = ctx.now * tpm
    local tat = gcra_tat(key, now_t)
    if admitted_at(ids, ctx, ceil_div(tau + t, tpm)) then
      return {1, 1, math.max(math.floor((now_t - (tat - tau)) / t), 0), -1, 0}
    end
    local diff = now_t - (tat + t - tau)
    if diff >= 0 then
      -- The TAT read here is the one commit advances: nothing writes the key in between.
      return {1, 0, math.floor(diff / t), -1, 0, tat = tat}
    end
    return {0, 0, 0, ctx.now + ceil_div(-diff, tpm), 0}
  end,

  commit = function(key, ids, args, ctx, seen)
    local t, tau, tpm = tonumber(args[1]), tonumber(args[2]), tonumber(args[3])
    local now_t = ctx.now * tpm
    local tat = seen.tat + t
    redis.call('SET', key, int(tat), 'PX', math.max(ceil_div(tat - now_t, tpm), 1))
    remember(ids, ctx, ceil_div(tau + t, tpm))
  end,

  refund = function(key, ids, args, ctx)
    local t, tau, tpm = tonumber(args[1]), tonumber(args[2]), tonumber(args[3])
    local now_t = ctx.now * tpm
    if admitted_at(ids, ctx, ceil_div(tau + t, tpm)) then
      local stored = redis.call('GET', key)
      if stored then
        local tat = math.max(tonumber(stored) - t, now_t)
        redis.call('SET', key, int(tat), 'PX', math.max(ceil_div(tat - now_t, tpm), 1))
      end
    end
    redis.call('ZREM', ids, ctx.id)
  end,
}
