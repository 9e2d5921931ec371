-- sliding_log.lua: several (LIMIT, WINDOW_MS) policies over one log of sub-window counters,
-- such as 10 per minute and 100 per hour in one key; reports which policy refused.
--
-- KEYS: state hash {<sub-window index> = count}; ids = admitted ids, kept for the longest
--       window, and the sub-window length the state is numbered in (sub_admitted in
--       prelude.lua).
-- ARGV (this rule's slice): SUB_MS, N, then N pairs LIMIT_k, WINDOW_MS_k in increasing window
--       order (the worker validated: windows are multiples of SUB_MS, and a longer window has a
--       larger limit).
-- Reply: {allowed, already, remaining, retry_ms, policy}: remaining = the fewest sends any
--        policy has left after this one; retry_ms = when every refusing policy has room;
--        policy = the 1-based index of the first refusing policy (0 when allowed).
--
-- As in sliding_window.lua: a sub-window after NOW's neither counts nor makes its ids
-- recognised yet, and counts from its own start (retry_ms allows for that); a changed
-- sub_window moves each count to the new sub-window holding its sub-window's start.

KINDS.sliding_log = {
  check = function(key, ids, ...)
    local args = {...}
    local sub, n = args[1] + 0, args[2] + 0
    local current = math.floor(NOW / sub)
    local longest = args[2 + 2 * n] + 0
    local at, kept_sub = sub_admitted(ids)
    local subs, _, anew = sub_windows(key, 0, sub, kept_sub)
    local own = at and at > NOW - longest and math.floor(at / sub) or nil
    local already = own ~= nil and own <= current
    local remaining, blocked_by = nil, 0
    local limits, spans = {}, {}
    for k = 1, n do
      local limit, span = args[1 + 2 * k] + 0, args[2 + 2 * k] / sub
      limits[k], spans[k] = limit, span
      local count = 0
      for _, p in ipairs(subs) do
        if p[1] > current - span and p[1] <= current then count = count + p[2] end
      end
      local left = limit - count - (already and 0 or 1)
      if remaining == nil or left < remaining then remaining = left end
      if not already and left < 0 and blocked_by == 0 then blocked_by = k end
    end
    if already then
      return {1, 1, math.max(remaining, 0), -1, 0}
    end
    if blocked_by > 0 then
      local points, weights = {}, {}
      for j, p in ipairs(subs) do
        points[j], weights[j] = p[1], p[2]
      end
      local fits = first_fit(points, weights, limits, spans, current, own)
      return {0, 0, 0, fits < 0 and -1 or fits * sub, blocked_by}
    end
    -- Commit reuses the counters as read; a key created anew has no expiry to keep.
    return {1, 0, remaining, -1, 0, subs = subs, anew = anew, fresh = #subs == 0}
  end,

  commit = function(key, ids, seen, sub_arg, n, ...)
    local sub = sub_arg + 0
    local longest = select(2 * n, ...) + 0
    local current = math.floor(NOW / sub)
    local newest = current
    local fresh = seen.fresh
    if seen.anew then
      -- Numbered in other sub-windows: written anew, the expired counters left out.
      redis.call('DEL', key)
      local flat, placed = {}, false
      for _, p in ipairs(seen.subs) do
        if p[1] > current - longest / sub then
          local c = p[1] == current and p[2] + 1 or p[2]
          placed = placed or p[1] == current
          flat[#flat + 1] = int(p[1])
          flat[#flat + 1] = int(c)
          if p[1] > newest then newest = p[1] end
        end
      end
      if not placed then
        flat[#flat + 1] = int(current)
        flat[#flat + 1] = 1
      end
      redis.call('HSET', key, unpack(flat))
      fresh = true
    else
      for _, p in ipairs(seen.subs) do
        if p[1] <= current - longest / sub then
          redis.call('HDEL', key, p[3])
        elseif p[1] > newest then
          newest = p[1]
        end
      end
      redis.call('HINCRBY', key, int(current), 1)
    end
    sub_remember(ids, longest, sub_arg)
    expire_in_at_least(key, (newest + longest / sub) * sub - NOW, fresh)
  end,

  refund = function(key, ids, sub, n, ...)
    sub = sub + 0
    local at = admitted_at(ids, select(2 * n, ...) + 0)
    if at then
      local field = int(math.floor(at / sub))
      local c = (redis.call('HGET', key, field) or '0') + 0
      if c > 1 then
        redis.call('HINCRBY', key, field, -1)
      elseif c == 1 then
        redis.call('HDEL', key, field)
      end
    end
    redis.call('ZREM', ids, ID)
  end,
}
