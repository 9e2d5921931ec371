-- zset_window.lua: at most LIMIT sends in any WINDOW_MS, exactly: one sorted-set entry per
-- admitted send (score = ms admitted, member = message id). Memory grows with LIMIT, so it
-- suits small limits.
--
-- KEYS: the sorted set (it holds the ids itself; the ids key is unused).
-- ARGV (this rule's slice): LIMIT, WINDOW_MS.
-- Reply: {allowed, already, remaining, retry_ms, 0}: remaining = sends left in the window after
--        this one; retry_ms = when the oldest entry that must go leaves the window.
-- Where common sorted-set windows go wrong, this one does not: a denied attempt adds no entry;
-- members are message ids, so two sends in the same millisecond are two entries and a
-- redelivery is recognised.
--
-- The window of a decision at NOW is (NOW - WINDOW_MS, NOW]: an entry after NOW (a worker
-- whose clock ran ahead, or a what-if before later sends) neither counts nor is recognised
-- yet; it counts from its own instant, and retry_ms allows for that.

KINDS.zset_window = {
  check = function(key, _, limit, window)
    limit, window = limit + 0, window + 0
    local from = '(' .. int(NOW - window)
    local count = redis.call('ZCOUNT', key, from, NOW_ARG)
    local at = redis.call('ZSCORE', key, ID)
    at = at and at + 0
    if at and at > NOW - window and at <= NOW then
      return {1, 1, math.max(limit - count, 0), -1, 0}
    end
    if count < limit then
      return {1, 0, limit - count - 1, -1, 0}
    end
    local oldest = redis.call('ZRANGEBYSCORE', key, from, NOW_ARG, 'WITHSCORES',
      'LIMIT', count - limit, 1)
    -- Entries after NOW: usually none, and then room opens when the oldest that must go leaves.
    local later = redis.call('ZRANGEBYSCORE', key, '(' .. NOW_ARG, '+inf', 'WITHSCORES')
    if #later == 0 then
      return {0, 0, 0, oldest[2] + window, 0}
    end
    local held = redis.call('ZRANGEBYSCORE', key, '(' .. int(oldest[2] - 1), NOW_ARG,
      'WITHSCORES')
    local points, weights = {}, {}
    for _, list in ipairs({held, later}) do
      for j = 2, #list, 2 do
        points[#points + 1] = list[j] + 0
        weights[#weights + 1] = 1
      end
    end
    local own = at and at > NOW and at or nil
    return {0, 0, 0, first_fit(points, weights, {limit}, {window}, NOW, own), 0}
  end,

  commit = function(key, _, _, _, window)
    window = window + 0
    redis.call('ZREMRANGEBYSCORE', key, '-inf', int(NOW - window))
    redis.call('ZADD', key, NOW_ARG, ID)
    local newest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
    expire_in_at_least(key, newest[2] + window - NOW)
  end,

  refund = function(key)
    redis.call('ZREM', key, ID)
  end,
}
