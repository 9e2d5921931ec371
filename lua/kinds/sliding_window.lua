-- sliding_window.lua: at most LIMIT sends in any WINDOW_MS, counted in sub-windows of SUB_MS
-- (WINDOW_MS is a multiple of SUB_MS). A sub-window with index i = floor(ms / SUB_MS) counts
-- until ms reaches (i + WINDOW_MS / SUB_MS) * SUB_MS.
--
-- KEYS: state (see STORAGE); ids = admitted ids (score = ms admitted), kept WINDOW_MS.
-- ARGV (this rule's slice): LIMIT, WINDOW_MS, SUB_MS, STORAGE (0 = hash, 1 = list).
--   hash storage: {<sub-window index> = count}.
--   list storage: [total, i1, c1, i2, c2, ...], pairs in increasing index order; expired pairs
--                 are removed from the head by position, all of them, never by value.
-- Reply: {allowed, already, remaining, retry_ms, 0}: remaining = sends left in the window after
--        this one; retry_ms = when enough sub-windows have expired for one more send.

-- In-window {index, count} pairs in increasing index order, and the state as read (the hash's
-- fields as numbers, or the whole list), which commit reuses instead of reading it again.
local function sliding_pairs(key, storage, first)
  local pairs_out = {}
  local state
  if storage == 0 then
    state = hash_numbers(key)
    for field, c in pairs(state) do
      local i = field + 0
      if i >= first then
        pairs_out[#pairs_out + 1] = {i, c}
      end
    end
    table.sort(pairs_out, function(a, b) return a[1] < b[1] end)
  else
    state = redis.call('LRANGE', key, 0, -1)
    for j = 2, #state, 2 do
      local i = state[j] + 0
      if i >= first then
        pairs_out[#pairs_out + 1] = {i, state[j + 1] + 0}
      end
    end
  end
  return pairs_out, state
end

-- When a window holding `subs` (in-window {index, count} pairs, oldest first) has room for one
-- more send under `limit`: the moment the oldest sub-windows that must go have expired.
local function sliding_retry(subs, count, limit, n, sub)
  for _, p in ipairs(subs) do
    count = count - p[2]
    if count + 1 <= limit then
      return (p[1] + n) * sub
    end
  end
  return -1
end

local function sliding_check(key, ids, limit, window, sub, storage)
  local n = window / sub
  local current = math.floor(NOW / sub)
  local subs, state = sliding_pairs(key, storage, current - n + 1)
  local count = 0
  for _, p in ipairs(subs) do count = count + p[2] end
  local left = limit - count
  if admitted_at(ids, window) then
    return {1, 1, math.max(left, 0), -1, 0}, subs
  end
  if left >= 1 then
    -- The key is created by commit when nothing was read (no expiry to keep yet).
    return {1, 0, left - 1, -1, 0, state = state, fresh = next(state) == nil}, subs
  end
  return {0, 0, 0, sliding_retry(subs, count, limit, n, sub), 0}, subs
end

KINDS.sliding_window = {
  check = function(key, ids, limit, window, sub, storage)
    local result = sliding_check(key, ids, limit + 0, window + 0, sub + 0, storage + 0)
    return result
  end,

  commit = function(key, ids, seen, _, window, sub, storage)
    window, sub, storage = window + 0, sub + 0, storage + 0
    local n = window / sub
    local current = math.floor(NOW / sub)
    local newest = current
    if storage == 0 then
      for field, _ in pairs(seen.state) do
        local i = field + 0
        if i <= current - n then
          redis.call('HDEL', key, field)
        elseif i > newest then
          newest = i
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
    remember(ids, window)
    expire_in_at_least(key, (newest + n) * sub - NOW, seen.fresh)
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
