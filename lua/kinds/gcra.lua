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
  return math.max(stored and stored + 0 or now_t, now_t)
end

KINDS.gcra = {
  check = function(key, ids, t, tau, tpm)
    t, tau, tpm = t + 0, tau + 0, tpm + 0
    local now_t = NOW * tpm
    local tat = gcra_tat(key, now_t)
    if admitted_at(ids, ceil_div(tau + t, tpm)) then
      return {1, 1, math.max(math.floor((now_t - (tat - tau)) / t), 0), -1, 0}
    end
    local diff = now_t - (tat + t - tau)
    if diff >= 0 then
      -- The TAT read here is the one commit advances: nothing writes the key in between.
      return {1, 0, math.floor(diff / t), -1, 0, tat = tat}
    end
    return {0, 0, 0, NOW + ceil_div(-diff, tpm), 0}
  end,

  commit = function(key, ids, seen, t, tau, tpm)
    t, tau, tpm = t + 0, tau + 0, tpm + 0
    local now_t = NOW * tpm
    local tat = seen.tat + t
    redis.call('SET', key, int(tat), 'PX', int(math.max(ceil_div(tat - now_t, tpm), 1)))
    remember(ids, ceil_div(tau + t, tpm))
  end,

  refund = function(key, ids, t, tau, tpm)
    t, tau, tpm = t + 0, tau + 0, tpm + 0
    local now_t = NOW * tpm
    if admitted_at(ids, ceil_div(tau + t, tpm)) then
      local stored = redis.call('GET', key)
      if stored then
        local tat = math.max(stored - t, now_t)
        redis.call('SET', key, int(tat), 'PX', int(math.max(ceil_div(tat - now_t, tpm), 1)))
      end
    end
    redis.call('ZREM', ids, ID)
  end,
}
