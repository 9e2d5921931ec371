-- sliding_window.lua: at most LIMIT sends in any WINDOW_MS, counted in sub-windows of SUB_MS
-- (WINDOW_MS is a multiple of SUB_MS). A sub-window with index i = floor(ms / SUB_MS) counts
-- from ms i * SUB_MS until ms reaches (i + WINDOW_MS / SUB_MS) * SUB_MS.
--
-- KEYS: state (see STORAGE); ids = admitted ids (score = ms admitted), kept WINDOW_MS, and the
--       sub-window length the state is numbered in (sub_admitted in prelude.lua).
-- ARGV (this rule's slice): LIMIT, WINDOW_MS, SUB_MS, STORAGE (0 = hash, 1 = list).
--   hash storage: {<sub-window index> = count}.
--   list storage: [total, i1, c1, i2, c2, ...], pairs in increasing index order; expired pairs
--                 are removed from the head by position, all of them, never by value.
-- Reply: {allowed, already, remaining, retry_ms, 0}: remaining = sends left in the window after
--        this one; retry_ms = when enough sub-windows have expired for one more send.
--
-- A sub-window after NOW's (a worker whose clock ran ahead, or a what-if before later sends)
-- neither counts nor makes its ids recognised yet; it counts from its own start, and retry_ms
-- allows for that. A rule whose storage or sub_window changed (a reload, same name and kind)
-- keeps its counts: the state is read in the storage it was written in, counts move to the
-- new sub-window holding their sub-window's start, and the next admission writes it anew.

local function sliding_check(key, ids, limit, window, sub, storage)
  local n = window / sub
  local current = math.floor(NOW / sub)
  local at, kept_sub = sub_admitted(ids)
  local subs, state, anew = sub_windows(key, storage, sub, kept_sub)
  local count = 0
  for _, p in ipairs(subs) do
    if p[1] > current - n and p[1] <= current then count = count + p[2] end
  end
  local left = limit - count
  local own = at and at > NOW - window and math.floor(at / sub) or nil
  if own and own <= current then
    return {1, 1, math.max(left, 0), -1, 0}
  end
  if left >= 1 then
    -- Commit reuses what was read; a key created anew has no expiry to keep.
    return {1, 0, left - 1, -1, 0, subs = subs, state = state, anew = anew, fresh = #subs == 0}
  end
  local points, weights = {}, {}
  for j, p in ipairs(subs) do
    points[j], weights[j] = p[1], p[2]
  end
  local fits = first_fit(points, weights, {limit}, {n}, current, own)
  return {0, 0, 0, fits < 0 and -1 or fits * sub, 0}
end

-- Writes the counters `subs` ({index, count} in increasing index order) as the whole state.
local function sliding_write(key, subs, storage)
  redis.call('DEL', key)
  local flat = {}
  local total = 0
  for _, p in ipairs(subs) do
    flat[#flat + 1] = int(p[1])
    flat[#flat + 1] = int(p[2])
    total = total + p[2]
  end
  if storage == 0 then
    redis.call('HSET', key, unpack(flat))
  else
    redis.call('RPUSH', key, int(total), unpack(flat))
  end
end

KINDS.sliding_window = {
  check = function(key, ids, limit, window, sub, storage)
    return sliding_check(key, ids, limit + 0, window + 0, sub + 0, storage + 0)
  end,

  commit = function(key, ids, seen, _, window, sub_arg, storage)
    local sub
    window, sub, storage = window + 0, sub_arg + 0, storage + 0
    local n = window / sub
    local current = math.floor(NOW / sub)
    local newest = current
    local fresh = seen.fresh
    if seen.anew then
      -- Kept in another storage or numbered in other sub-windows: written anew, the expired
      -- counters left out.
      local kept, placed = {}, false
      for _, p in ipairs(seen.subs) do
        if p[1] > current - n then
          if p[1] == current then
            p[2], placed = p[2] + 1, true
          end
          kept[#kept + 1] = p
          if p[1] > newest then newest = p[1] end
        end
      end
      if not placed then
        kept[#kept + 1] = {current, 1}
        table.sort(kept, function(a, b) return a[1] < b[1] end)
      end
      sliding_write(key, kept, storage)
      fresh = true
    elseif storage == 0 then
      for _, p in ipairs(seen.subs) do
        if p[1] <= current - n then
          redis.call('HDEL', key, p[3])
        elseif p[1] > newest then
          newest = p[1]
        end
      end
      redis.call('HINCRBY', key, int(current), 1)
    else
      local list = seen.state
      local total = (list[1] or '0') + 0
      -- Expired pairs are at the head: drop all of them by position.
      local j = 2
      while j < #list and list[j] + 0 <= current - n do
        total = total - list[j + 1]
        j = j + 2
      end
      local last = j < #list and list[#list - 1] + 0 or nil
      if last ~= nil and last > current then
        -- The worker's clock went back: rebuild the list with this send in its own
        -- sub-window, keeping the pairs in index order.
        local kept = {}
        for k = j, #list, 2 do
          kept[#kept + 1] = {list[k] + 0, list[k + 1] + 0}
        end
        local placed = false
        for _, p in ipairs(kept) do
          if p[1] == current then p[2] = p[2] + 1; placed = true end
        end
        if not placed then kept[#kept + 1] = {current, 1} end
        table.sort(kept, function(a, b) return a[1] < b[1] end)
        redis.call('DEL', key)
        redis.call('RPUSH', key, int(total + 1))
        for _, p in ipairs(kept) do
          redis.call('RPUSH', key, int(p[1]), int(p[2]))
          if p[1] > newest then newest = p[1] end
        end
      else
        if #list > 0 then
          redis.call('LPOP', key, j - 1)
        end
        if last == current then
          redis.call('LSET', key, -1, int(list[#list] + 1))
        else
          redis.call('RPUSH', key, int(current), 1)
        end
        redis.call('LPUSH', key, int(total + 1))
      end
    end
    sub_remember(ids, window, sub_arg)
    expire_in_at_least(key, (newest + n) * sub - NOW, fresh)
  end,

  refund = function(key, ids, _, window, sub, storage)
    window, sub, storage = window + 0, sub + 0, storage + 0
    local at = admitted_at(ids, window)
    if at then
      local i = math.floor(at / sub)
      if storage == 0 then
        local c = (redis.call('HGET', key, int(i)) or '0') + 0
        if c > 1 then
          redis.call('HINCRBY', key, int(i), -1)
        elseif c == 1 then
          redis.call('HDEL', key, int(i))
        end
      else
        local list = redis.call('LRANGE', key, 0, -1)
        -- Pair values sit at Lua index j (index) and j + 1 (count), which is Redis index j.
        for j = 2, #list - 1, 2 do
          if list[j] + 0 == i and list[j + 1] + 0 > 0 then
            redis.call('LSET', key, j, int(list[j + 1] - 1))
            redis.call('LSET', key, 0, int(list[1] - 1))
            break
          end
        end
      end
    end
    redis.call('ZREM', ids, ID)
  end,
}
