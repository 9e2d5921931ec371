-- sliding_log.lua: several (LIMIT, WINDOW_MS) policies over one log of sub-window counters,
-- such as 10 per minute and 100 per hour in one key; reports which policy refused.
--
-- KEYS: state hash {<sub-window index> = count}; ids = admitted ids, kept for the longest window.
-- ARGV (this rule's slice): SUB_MS, N, then N pairs LIMIT_k, WINDOW_MS_k in increasing window
--       order (the worker validated: windows are multiples of SUB_MS, and a longer window has a
--       larger limit).
-- Reply: {allowed, already, remaining, retry_ms, policy}: remaining = the fewest sends any
--        policy has left after this one; retry_ms = when every refusing policy has room;
--        policy = the 1-based index of the first refusing policy (0 when allowed).

KINDS.sliding_log = {
  check = function(key, ids, ...)
    local args = {...}
    local sub, n = args[1] + 0, args[2] + 0
    local current = math.floor(NOW / sub)
    local longest = args[2 + 2 * n] + 0
    local subs = {}
    local state = hash_numbers(key)
    for field, c in pairs(state) do
      local i = field + 0
      if i > current - longest / sub then
        subs[#subs + 1] = {i, c}
      end
    end
    table.sort(subs, function(a, b) return a[1] < b[1] end)
    local already = admitted_at(ids, longest) ~= nil
    local remaining, retry, blocked_by = nil, -1, 0
    for k = 1, n do
      local limit, window = args[1 + 2 * k] + 0, args[2 + 2 * k] + 0
      local subs_k, count = {}, 0
      for _, p in ipairs(subs) do
        if p[1] > current - window / sub then
          subs_k[#subs_k + 1] = p
          count = count + p[2]
        end
      end
      local left = limit - count - (already and 0 or 1)
      if remaining == nil or left < remaining then remaining = left end
      if not already and left < 0 then
        if blocked_by == 0 then blocked_by = k end
        local at = -1
        for _, p in ipairs(subs_k) do
          count = count - p[2]
          if count + 1 <= limit then
            at = (p[1] + window / sub) * sub
            break
          end
        end
        if at > retry then retry = at end
      end
    end
    if already then
      return {1, 1, math.max(remaining, 0), -1, 0}
    end
    if blocked_by > 0 then
      return {0, 0, 0, retry, blocked_by}
    end
    -- Commit reuses the hash as read; a key created anew has no expiry to keep.
    return {1, 0, remaining, -1, 0, state = state, fresh = next(state) == nil}
  end,

  commit = function(key, ids, seen, sub, n, ...)
    sub = sub + 0
    local longest = select(2 * n, ...) + 0
    local current = math.floor(NOW / sub)
    local newest = current
    for field, _ in pairs(seen.state) do
      local i = field + 0
      if i <= current - longest / sub then
        redis.call('HDEL', key, field)
      elseif i > newest then
        newest = i
      end
    end
    redis.call('HINCRBY', key, int(current), 1)
    remember(ids, longest)
    expire_in_at_least(key, (newest + longest / sub) * sub - NOW, seen.fresh)
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
