-- gcra.lua: the generic cell rate algorithm (as redis-cell and redis_rate): RATE sends per
-- PERIOD, with bursts of up to BURST, exact, in one key holding the theoretical arrival time.
--
-- Integer ticks: the worker reduces RATE per PERIOD_MS by their gcd so that a tick is 1/TPM of
-- a millisecond and the emission interval T is a whole number of ticks; TAU = T * BURST.
-- KEYS: state = '<TAT> <T> <TPM>': the theoretical arrival time in ticks, and the ticks it was
--       counted in; ids = admitted ids, kept until the TAT they produced has passed.
-- ARGV (this rule's slice): T, TAU, TPM.
-- Reply: {allowed, already, remaining, retry_ms, 0}: remaining = sends still allowed right now
--        after this one; retry_ms = when this send would be allowed (rounded up to the ms).
--
-- Parameters that change (a rule reloaded with another rate or period, same name and kind)
-- keep the burst used: a TAT counted in other ticks runs down in those until it is next
-- written, and a decision converts its lead over that instant (what the sends made have used of
-- the burst, in emission intervals) to the new ticks, rounded up, counted from that instant
-- (retry_ms is the first instant whose converted lead lets the send in). A lead beyond the new
-- burst refuses until it has passed. A state of a TAT alone (written before the ticks were
-- kept) was counted in the rule's current ticks. Running down in its own ticks, the state lives
-- exactly as long as it matters: its expiry was set in them.

-- The stored TAT in the current ticks (converted when it was counted in others), or nil; and,
-- when it was converted, the TAT as stored and its emission interval and ticks per ms.
local function gcra_stored(key, t_arg, tpm_arg, t, now_t)
  local stored = redis.call('GET', key)
  if not stored then
    return nil
  end
  local sep = string.find(stored, ' ', 1, true)
  if not sep then
    return stored + 0
  end
  local tat = string.sub(stored, 1, sep - 1) + 0
  local ticks = string.sub(stored, sep + 1)
  if ticks == t_arg .. ' ' .. tpm_arg then
    return tat
  end
  local sep2 = string.find(ticks, ' ', 1, true)
  local old_t, old_tpm = string.sub(ticks, 1, sep2 - 1) + 0, string.sub(ticks, sep2 + 1) + 0
  local lead = math.max(tat - NOW * old_tpm, 0)
  return now_t + mul_div(lead, t, old_t, true, LEVEL_LIMIT), {tat, old_t, old_tpm}
end

-- Writes `tat` with the ticks it is counted in, living until it has passed.
local function gcra_write(key, tat, t_arg, tpm_arg, now_t, tpm)
  redis.call('SET', key, int(tat) .. ' ' .. t_arg .. ' ' .. tpm_arg, 'PX',
    int(math.max(ceil_div(tat - now_t, tpm), 1)))
end

KINDS.gcra = {
  check = function(key, ids, t_arg, tau, tpm_arg)
    local t, tpm = t_arg + 0, tpm_arg + 0
    tau = tau + 0
    local now_t = NOW * tpm
    local stored, kept = gcra_stored(key, t_arg, tpm_arg, t, now_t)
    local tat = math.max(stored or now_t, now_t)
    if admitted_at(ids, ceil_div(tau + t, tpm)) then
      return {1, 1, math.max(math.floor((now_t - (tat - tau)) / t), 0), -1, 0}
    end
    local diff = now_t - (tat + t - tau)
    if diff >= 0 then
      -- The TAT read here is the one commit advances: nothing writes the key in between.
      return {1, 0, math.floor(diff / t), -1, 0, tat = tat}
    end
    if kept then
      -- The send fits once the kept TAT's lead, running down in its own ticks, converts to at
      -- most tau - t: once it is at most `most` of those ticks.
      local most = mul_div(tau - t, kept[2], t, false, LEVEL_LIMIT)
      return {0, 0, 0, ceil_div(kept[1] - most, kept[3]), 0}
    end
    return {0, 0, 0, NOW + ceil_div(-diff, tpm), 0}
  end,

  commit = function(key, ids, seen, t_arg, tau, tpm_arg)
    local t, tpm = t_arg + 0, tpm_arg + 0
    gcra_write(key, seen.tat + t, t_arg, tpm_arg, NOW * tpm, tpm)
    remember(ids, ceil_div(tau + t, tpm))
  end,

  refund = function(key, ids, t_arg, tau, tpm_arg)
    local t, tpm = t_arg + 0, tpm_arg + 0
    local now_t = NOW * tpm
    if admitted_at(ids, ceil_div(tau + t, tpm)) then
      local stored = gcra_stored(key, t_arg, tpm_arg, t, now_t)
      if stored then
        gcra_write(key, math.max(stored - t, now_t), t_arg, tpm_arg, now_t, tpm)
      end
    end
    redis.call('ZREM', ids, ID)
  end,
}
