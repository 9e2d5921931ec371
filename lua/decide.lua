-- decide.lua: checks every rule of one scope, then commits all of them or none.
--
-- KEYS: two keys per rule, in rule order: the rule's state, and the rule's admitted-ids set
--       (used by kinds whose state cannot hold message ids). All share the scope's hash tag.
--       Then, optionally, the recipient's dispatch marks (a sorted set: member = message id,
--       score = when the mark expires, ms): with it, 'check' and 'commit' first look
--       MESSAGE_ID up there and, if it was dispatched, reply '2' and touch nothing.
--       Then, optionally (only after the marks), MESSAGE_ID's in-flight claim (a string key
--       under the recipient's hash tag: value = the holding delivery's token, expiring with its
--       lease; see src/decide/claim.rs): one delivery of a message id at a time is decided and
--       dispatched. 'commit' replies '3 WAIT_MS' and touches nothing while another token holds
--       the claim, and claims it for TOKEN when it commits (a refused message holds no claim).
--       Redis expires the key on its own clock, which every worker shares: no worker's clock
--       (skewed, or simulated with `worker --now`) measures a lease.
-- ARGV: NOW_MS, MESSAGE_ID, MODE, COST, RULE_COUNT, then per rule:
--       KIND, ENFORCE (1 = a refusal blocks the message, 0 = shadow rule), NARGS, ARG_1..ARG_NARGS;
--       then, with the claim key, TOKEN and LEASE_MS (the last two).
--   MODE: 'check'  = evaluate only, write nothing;
--         'commit' = evaluate, and if no enforcing rule refuses, consume in every rule that
--                    allowed and had not admitted MESSAGE_ID before;
--         'refund' = give back MESSAGE_ID's take in every rule listed (used when another
--                    scope refused the message after this one committed), and TOKEN's claim;
--         'claim'   = (no rules) take MESSAGE_ID's claim for TOKEN, for a message whose rules
--                    have no recipient scope to take it with: '1', or '2' or '3 WAIT_MS';
--         'renew'   = (no rules) extend TOKEN's claim by LEASE_MS: '1', or '0' when TOKEN
--                    does not hold it any more;
--         'release' = (no rules) drop TOKEN's claim: '1', or '0' when TOKEN did not hold it.
-- Reply: whole numbers in one string, separated by spaces: COMMITTED, then ALLOWED, ALREADY,
--        REMAINING, RETRY, DETAIL of each rule in turn (the kind files say what REMAINING,
--        RETRY and DETAIL mean for them); for 'refund', '1'; for a message already dispatched,
--        '2'; for one another delivery holds, '3 WAIT_MS'. One string, not an array: the
--        client parses each value of a reply on its own, and a decision's seven numbers as
--        seven values cost the worker more than the rest of reading the reply
--        (docs/redis-time.md).
--
-- A rule's slice of ARGV is handed to its kind as arguments (unpack), not copied into a table.

local mode = ARGV[3]
local count = ARGV[5] + 0
local marks, claim = KEYS[2 * count + 1], KEYS[2 * count + 2]
local token, lease
if claim then
  token, lease = ARGV[#ARGV - 1], ARGV[#ARGV]
end

if mode == 'renew' or mode == 'release' or mode == 'refund' then
  -- Every kind is known before anything is given back: an error stops a script, not what it
  -- already wrote.
  local pos = 6
  for _ = 1, count do
    if not KINDS[ARGV[pos]] then
      return redis.error_reply('sendquota: unknown limiter kind ' .. tostring(ARGV[pos]))
    end
    pos = pos + 3 + ARGV[pos + 2]
  end
  pos = 6
  for i = 1, count do
    local last = pos + 2 + ARGV[pos + 2]
    KINDS[ARGV[pos]].refund(KEYS[2 * i - 1], KEYS[2 * i], unpack(ARGV, pos + 3, last))
    pos = last + 1
  end
  if not claim then
    return '1'
  end
  -- A lease run out is a key gone: its holder holds nothing any more.
  if redis.call('GET', claim) ~= token then
    return mode == 'refund' and '1' or '0'
  end
  if mode == 'renew' then
    redis.call('PEXPIRE', claim, lease)
  else
    redis.call('DEL', claim)
  end
  return '1'
end

if marks then
  local expires = redis.call('ZSCORE', marks, ID)
  if expires and expires + 0 > NOW_ARG + 0 then
    return '2'
  end
end

if claim then
  local holder = redis.call('GET', claim)
  if holder and holder ~= token then
    -- The key expires with the lease, so what is left of it is the wait (at least 1 ms: a key
    -- about to expire reads 0).
    return '3 ' .. math.max(redis.call('PTTL', claim), 1)
  end
  if mode == 'claim' then
    redis.call('SET', claim, token, 'PX', lease)
    return '1'
  end
end

-- Sized for one rule, the usual scope: growing a table slot by slot reallocates it each time.
local reply = count > 0 and {0, 0, 0, 0, 0, 0} or {0}
local seen = {false}
local blocked = false
local pos = 6
for i = 1, count do
  local kind = KINDS[ARGV[pos]]
  if not kind then
    return redis.error_reply('sendquota: unknown limiter kind ' .. tostring(ARGV[pos]))
  end
  local last = pos + 2 + ARGV[pos + 2]
  local result = kind.check(KEYS[2 * i - 1], KEYS[2 * i], unpack(ARGV, pos + 3, last))
  if result[1] == 0 and ARGV[pos + 1] == '1' then
    blocked = true
  end
  seen[i] = result
  local at = 5 * i - 3
  reply[at], reply[at + 1], reply[at + 2], reply[at + 3], reply[at + 4] =
    result[1], result[2], result[3], result[4], result[5]
  pos = last + 1
end

if mode == 'commit' and not blocked then
  pos = 6
  for i = 1, count do
    local last = pos + 2 + ARGV[pos + 2]
    local result = seen[i]
    if result[1] == 1 and result[2] == 0 then
      KINDS[ARGV[pos]].commit(KEYS[2 * i - 1], KEYS[2 * i], result, unpack(ARGV, pos + 3, last))
    end
    pos = last + 1
  end
  if claim then
    redis.call('SET', claim, token, 'PX', lease)
  end
  reply[1] = 1
end

-- The reply: its numbers as one string, each after a space. One rule's (the usual scope) with
-- its format written out: building the format with string.rep costs Redis more than the
-- formatting (docs/redis-time.md). Other sizes in slices: unpack hands at most a few thousand
-- values to one call, and a scope may have many rules.
if #reply == 6 then
  return string.format(' %d %d %d %d %d %d', unpack(reply))
end
local parts = {}
for i = 1, #reply, 50 do
  local j = math.min(i + 49, #reply)
  parts[#parts + 1] = string.format(string.rep(' %d', j - i + 1), unpack(reply, i, j))
end
return table.concat(parts)
