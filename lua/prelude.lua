-- prelude.lua: shared helpers for the composed decision script.
--
-- The decision script is this file, then one file per limiter kind (each registers itself in
-- KINDS), then decide.lua, concatenated when the crate is built. Every kind provides, where
-- `...` is the rule's slice of ARGV (its arguments, as strings, in the order its file lists):
--   check(key, ids, ...)  -> {allowed, already, remaining, retry, detail}   (reads only)
--   commit(key, ids, seen, ...)   (consumes for ID, sets expiries; `seen` is the table check
--                                  returned, which may carry more for it past the reply's
--                                  five: named fields, or further array slots. Redis is only
--                                  ever handed the five, but reads err, ok, double, map, set,
--                                  big_number and verbatim_string as reply types, so never
--                                  those names)
--   refund(key, ids, ...)                              (gives back what ID took)
-- `key` holds the rule's state; `ids` is a sorted set of admitted message ids (score = the
-- worker's ms when admitted) for kinds whose state cannot hold ids. `allowed` and `already`
-- are 0/1; `already` = 1 when ID was admitted before and consumes nothing again.
-- `retry` is when the rule would next admit this message (epoch ms of the worker's clock, or
-- a day number for calendar_quota), -1 when it admits it now or never will.
-- The message being decided is the same for every rule of a call: NOW_ARG and ID below, and
-- NOW and COST, which kinds read as upvalues rather than from a table built per call.
--
-- All arithmetic is on integers below 2^53 (the worker scales rates so that it is), so the
-- results are exact and equal to the Rust reference models'.
--
-- Redis runs this whole file on every call, and its Lua allocates every table, closure and
-- converted string anew each time (and collects them later); those costs are most of a
-- decision's time inside Redis (docs/redis-time.md). Hence: a string is converted to a number
-- with `+ 0`, one strtod, where tonumber runs two; numbers handed to redis.call are formatted
-- by int() ('%d', an integer's cheap path) or passed on as the ARGV strings they came as;
-- script_for keeps of this file only the paragraphs something in the script uses.

local KINDS = {}

-- The worker's instant of the decision, as it wrote it (epoch ms), and the message id.
local NOW_ARG, ID = ARGV[1], ARGV[2]

-- NOW_ARG as a number, for the kinds that compute with it.
local NOW = NOW_ARG + 0

-- The message's cost, for the kinds that take it.
local COST = ARGV[4] + 0

-- An integer as a string without exponent, for values written to Redis.
local function int(x)
  return string.format('%d', x)
end

-- Make sure `key` lives at least `ttl_ms` more milliseconds. Expiries are durations computed
-- from the worker's clock, never absolute instants: Redis measures them on its own clock, which
-- may differ from the worker's (skew, or a simulated clock in tests). An expiry is never
-- shortened, and a key always has one after this call. `fresh` says the caller created the key
-- in this script (it has no expiry yet), which saves the extra calls. `ttl_ms` is a number, or
-- an ARGV string, which the worker writes as a whole number of at least 1, passed on as it is.
local function expire_in_at_least(key, ttl_ms, fresh)
  if type(ttl_ms) ~= 'string' then
    ttl_ms = int(math.max(math.ceil(ttl_ms), 1))
  end
  if fresh then
    redis.call('PEXPIRE', key, ttl_ms)
    return
  end
  -- GT treats a key without expiry as living forever, so a 0 here may also mean "no expiry".
  if redis.call('PEXPIRE', key, ttl_ms, 'GT') == 0 and redis.call('PTTL', key) == -1 then
    redis.call('PEXPIRE', key, ttl_ms)
  end
end

-- Integer ceiling of a / b for a >= 0, b > 0.
local function ceil_div(a, b)
  return math.floor((a + b - 1) / b)
end

-- Whether this call only asks what a decision at NOW would be ('check': `sendquota check`
-- without --commit, POST /v1/check, the console's quota page, a scope checked after another
-- refused) rather than deciding one. Only the fixed window tells the two apart: a committing
-- decision counts a send in the window it holds even when NOW lies before that window's start
-- (a worker whose clock lags another's: the send must be counted somewhere), where a what-if
-- counts only the window NOW lies in.
local WHAT_IF = ARGV[3] == 'check'

-- Levels carried over to other parameters are kept below this (2^52), so that every sum of them
-- stays exact; a level that large takes longer to drain than any key lives.
local LEVEL_LIMIT = 4503599627370496

-- x * a / b rounded down (up when `up`), exact, at most `limit`, for whole numbers 0 <= x < 2^53,
-- 0 < a, b < 2^51: how a level kept in units of 1/b converts to units of 1/a (a rule whose
-- rate changed). The product can exceed 2^53, so it is not formed: x = q * b + r (fmod is
-- exact), and r * a / b is built from a's bits with every intermediate below 2 * b.
local function mul_div(x, a, b, up, limit)
  local r = math.fmod(x, b)
  local q = (x - r) / b
  if q * a >= limit then
    return limit
  end
  local whole, rest, bit, left = 0, 0, 1, a
  while bit * 2 <= left do
    bit = bit * 2
  end
  while bit >= 1 do
    whole, rest = whole * 2, rest * 2
    if rest >= b then
      whole, rest = whole + 1, rest - b
    end
    if left >= bit then
      left, rest = left - bit, rest + r
      if rest >= b then
        whole, rest = whole + 1, rest - b
      end
    end
    bit = bit / 2
  end
  if up and rest > 0 then
    whole = whole + 1
  end
  return math.min(q * a + whole, limit)
end

-- The first position after `from` at which one more send fits, for the window kinds: `points`
-- are the positions of the sends a rule holds (ms, or sub-window indices), ascending, each
-- standing for `weights[j]` sends; a send at p counts at x under policy k when
-- x - spans[k] < p <= x, and one more fits when each policy counts fewer than limits[k].
-- `own`, when set, is the position from which this message's own earlier admission counts (it
-- is admitted again from there). Room only grows where a send leaves a span, so only those
-- positions (and `own`) are tried, each counting the sends that lie in its spans then, later
-- ones included: a send held for a position after `from` (a worker whose clock ran ahead, or
-- a what-if before a send) counts from where it lies. -1 when none fits.
local function first_fit(points, weights, limits, spans, from, own)
  local m = #points
  local prefix = {}
  local total = 0
  for j = 1, m do
    total = total + weights[j]
    prefix[j] = total
  end
  -- Sends at positions up to x.
  local function upto(x)
    local lo, hi = 0, m
    while lo < hi do
      local mid = math.floor((lo + hi + 1) / 2)
      if points[mid] <= x then lo = mid else hi = mid - 1 end
    end
    return lo == 0 and 0 or prefix[lo]
  end
  local tries = {}
  for k = 1, #spans do
    for j = 1, m do
      local x = points[j] + spans[k]
      if x > from then tries[#tries + 1] = x end
    end
  end
  if own and own > from then tries[#tries + 1] = own end
  table.sort(tries)
  for _, x in ipairs(tries) do
    if own and x >= own then return x end
    local fits = true
    for k = 1, #spans do
      if upto(x) - upto(x - spans[k]) >= limits[k] then
        fits = false
        break
      end
    end
    if fits then return x end
  end
  return -1
end

-- The ms at which ID was admitted, if that was less than `memory_ms` ago.
local function admitted_at(ids, memory_ms)
  local at = redis.call('ZSCORE', ids, ID)
  if at then
    at = at + 0
    if at > NOW - memory_ms then
      return at
    end
  end
  return nil
end

-- Records ID as admitted now, forgetting ids older than `memory_ms`.
local function remember(ids, memory_ms)
  redis.call('ZREMRANGEBYSCORE', ids, '-inf', int(NOW - memory_ms))
  redis.call('ZADD', ids, NOW_ARG, ID)
  expire_in_at_least(ids, memory_ms)
end

-- For the sub-window kinds (sliding_window, sliding_log), whose counters are numbered by
-- sub-window (index = floor(ms / SUB_MS)): their ids set also holds the length of the
-- sub-windows the counters were numbered in, as member '\0sub' scored minus that length (no
-- message id holds a control character). Reads the ms ID was admitted at (any that is kept)
-- and that length (nil for keys written before it was kept: the rule's current length), in
-- one call.
local function sub_admitted(ids)
  local got = redis.call('ZMSCORE', ids, ID, '\0sub')
  return got[1] and got[1] + 0 or nil, got[2] and -got[2] or nil
end

-- Records ID as admitted now, forgetting ids older than `memory_ms`, with the sub-window
-- length `sub_arg` (an ARGV string) the counters are numbered in (see sub_admitted).
local function sub_remember(ids, memory_ms, sub_arg)
  redis.call('ZREMRANGEBYSCORE', ids, '-inf', int(NOW - memory_ms))
  redis.call('ZADD', ids, NOW_ARG, ID, '-' .. sub_arg, '\0sub')
  expire_in_at_least(ids, memory_ms)
end

-- A sub-window kind's counters as {index, count, field} triples in increasing index order
-- (expired ones too; field = the hash field as read), the state as read, and whether it must
-- be written anew in STORAGE (0 = hash {index = count}, 1 = list [total, i1, c1, ...]): it is
-- kept in the other storage (the rule's storage changed), or numbered in sub-windows of
-- `kept_sub` ms instead of `sub` (the rule's sub_window changed), whose counts move to the
-- sub-window holding their start, as a sub-window's sends always counted from its start.
local function sub_windows(key, storage, sub, kept_sub)
  local layout = storage
  local state = storage == 0 and redis.pcall('HGETALL', key) or redis.pcall('LRANGE', key, 0, -1)
  if state.err then
    layout = 1 - storage
    state = layout == 0 and redis.call('HGETALL', key) or redis.call('LRANGE', key, 0, -1)
  end
  local out = {}
  if layout == 0 then
    for j = 1, #state, 2 do
      out[#out + 1] = {state[j] + 0, state[j + 1] + 0, state[j]}
    end
    table.sort(out, function(a, b) return a[1] < b[1] end)
  else
    for j = 2, #state, 2 do
      out[#out + 1] = {state[j] + 0, state[j + 1] + 0}
    end
  end
  if not kept_sub or kept_sub == sub then
    return out, state, layout ~= storage
  end
  local moved = {}
  for _, p in ipairs(out) do
    local i = math.floor(p[1] * kept_sub / sub)
    local last = moved[#moved]
    if last and last[1] == i then
      last[2] = last[2] + p[2]
    else
      moved[#moved + 1] = {i, p[2]}
    end
  end
  return moved, state, true
end

-- Reads a hash of integer fields into a table of numbers (missing fields are absent).
local function hash_numbers(key)
  local flat = redis.call('HGETALL', key)
  local out = {}
  for i = 1, #flat, 2 do
    out[flat[i]] = flat[i + 1] + 0
  end
  return out
end
