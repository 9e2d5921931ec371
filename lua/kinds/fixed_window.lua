-- fixed_window.lua: at most LIMIT sends per window of WINDOW_MS that starts at the first send.
--
-- KEYS: state hash {start = window start ms, count}; ids = admitted ids of the current window
--       (emptied when a window starts, so membership alone means "admitted in this window": an
--       id's score can be below start when it was admitted while the worker's clock lagged).
-- ARGV (this rule's slice): LIMIT, WINDOW_MS.
-- Reply: {allowed, already, remaining, retry_ms, 0}: remaining = sends left in the window after
--        this one; retry_ms = when the window ends (the next send is allowed then).
-- Where common fixed-window limiters go wrong, this one does not: a denied attempt writes
-- nothing (no INCR before the check), and the expiry is set in the same script as the write,
-- from the window's start, never 0.
--
-- A decision at NOW before the window's start (a worker whose clock lags another's) counts in
-- that window, so that the send is counted somewhere; a what-if (WHAT_IF) there counts nothing:
-- the window NOW lies in, if any, is an earlier one, no longer kept.

KINDS.fixed_window = {
  check = function(key, ids, limit, window)
    limit, window = limit + 0, window + 0
    local s = hash_numbers(key)
    local active = s.start ~= nil and NOW < s.start + window and not (WHAT_IF and NOW < s.start)
    local count = active and s.count or 0
    local left = limit - count
    if active then
      if redis.call('ZSCORE', ids, ID) then
        return {1, 1, math.max(left, 0), -1, 0}
      end
    end
    if left >= 1 then
      return {1, 0, left - 1, -1, 0, state = s}
    end
    return {0, 0, 0, s.start + window, 0}
  end,

  commit = function(key, ids, seen, _, window)
    window = window + 0
    local start = seen.state.start
    -- A new window deletes both keys and writes them anew: neither has an expiry yet.
    local fresh = start == nil or NOW >= start + window
    if fresh then
      start = NOW
      redis.call('DEL', key, ids)
      redis.call('HSET', key, 'start', NOW_ARG, 'count', 1)
    else
      redis.call('HINCRBY', key, 'count', 1)
    end
    local ttl = start + window - NOW
    redis.call('ZADD', ids, NOW_ARG, ID)
    expire_in_at_least(key, ttl, fresh)
    expire_in_at_least(ids, ttl, fresh)
  end,

  refund = function(key, ids, _, window)
    window = window + 0
    local s = hash_numbers(key)
    local at = redis.call('ZSCORE', ids, ID)
    if at and s.start and NOW < s.start + window then
      redis.call('HINCRBY', key, 'count', -1)
    end
    redis.call('ZREM', ids, ID)
  end,
}
