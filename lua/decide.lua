-- decide.lua: checks every rule of one scope, then commits all of them or none.
--
-- KEYS: two keys per rule, in rule order: the rule's state, and the rule's admitted-ids set
--       (used by kinds whose state cannot hold message ids). All share the scope's hash tag.
--       Then, optionally, the recipient's dispatch marks (a sorted set: member = message id,
--       score = when the mark expires, ms): with it, 'check' and 'commit' first look
--       MESSAGE_ID up there and, if it was dispatched, reply {2} and touch nothing.
--       Then, optionally (only after the marks), the recipient's in-flight claims (a hash:
--       field = message id, value = '<token> <expires, ms of Redis's own clock>'; see
--       src/claim.rs): one delivery of
--       a message id at a time is decided and dispatched. 'commit' replies {3, WAIT_MS} and
--       touches nothing while another token holds a live claim on MESSAGE_ID, and claims it for
--       TOKEN when it commits (a refused message holds no claim).
-- ARGV: NOW_MS, MESSAGE_ID, MODE, COST, RULE_COUNT, then per rule:
--       KIND, ENFORCE (1 = a refusal blocks the message, 0 = shadow rule), NARGS, ARG_1..ARG_NARGS;
--       then, with the claims key, TOKEN and LEASE_MS.
--   MODE: 'check'  = evaluate only, write nothing;
--         'commit' = evaluate, and if no enforcing rule refuses, consume in every rule that
--                    allowed and had not admitted MESSAGE_ID before;
--         'refund' = give back MESSAGE_ID's take in every rule listed (used when another
--                    scope refused the message after this one committed), and TOKEN's claim;
--         'claim'   = (no rules) take MESSAGE_ID's claim for TOKEN, for a message whose rules
--                    have no recipient scope to take it with: {1}, or {2} or {3, WAIT_MS};
--         'renew'   = (no rules) extend TOKEN's claim by LEASE_MS: {1}, or {0} when TOKEN
--                    does not hold it any more;
--         'release' = (no rules) drop TOKEN's claim: {1}, or {0} when TOKEN did not hold it.
-- Reply: {COMMITTED, {ALLOWED, ALREADY, REMAINING, RETRY, DETAIL} per rule} (the kind files
--        say what REMAINING, RETRY and DETAIL mean for them); for 'refund', {1}; for a
--        message already dispatched, {2}; for one another delivery holds, {3, WAIT_MS}.

local ctx = {now = tonumber(ARGV[1]), now_arg = ARGV[1], id = ARGV[2], cost = tonumber(ARGV[4])}
local mode = ARGV[3]
local count = tonumber(ARGV[5])
local rules = {}
local pos = 6
for i = 1, count do
  local kind = KINDS[ARGV[pos]]
  if not kind then
    return redis.error_reply('sendquota: unknown limiter kind ' .. tostring(ARGV[pos]))
  end
  local nargs = tonumber(ARGV[pos + 2])
  -- One constructor sizes the table once; filling it element by element would grow it 1, 2,
  -- 4, 8, reallocating at each step, for every rule of every call.
  local args = {unpack(ARGV, pos + 3, pos + 2 + nargs)}
  rules[i] = {
    kind = kind, enforce = ARGV[pos + 1] == '1', args = args,
    key = KEYS[2 * i - 1], ids = KEYS[2 * i], result = false,
  }
  pos = pos + 3 + nargs
end

local marks = KEYS[2 * count + 1]
local claims = KEYS[2 * count + 2]
local token, lease = ARGV[pos], tonumber(ARGV[pos + 1])

if mode == 'renew' or mode == 'release' or mode == 'refund' then
  for i = 1, count do
    local r = rules[i]
    r.kind.refund(r.key, r.ids, r.args, ctx)
  end
  if not claims then
    return {1}
  end
  local holder, expires = claim_of(claims, ctx.id)
  local now = server_ms()
  if holder ~= token or (mode == 'renew' and expires <= now) then
    return {mode == 'refund' and 1 or 0}
  end
  if mode == 'renew' then
    hold_claim(claims, ctx.id, token, now, lease)
  else
    redis.call('HDEL', claims, ctx.id)
  end
  return {1}
end

if marks then
  local expires = redis.call('ZSCORE', marks, ctx.id)
  if expires and tonumber(expires) > ctx.now then
    return {2}
  end
end

local claim_now = claims and server_ms()
if claims then
  local holder, expires = claim_of(claims, ctx.id)
  if holder and holder ~= token and expires > claim_now then
    return {3, int(expires - claim_now)}
  end
  if mode == 'claim' then
    hold_claim(claims, ctx.id, token, claim_now, lease)
    return {1}
  end
end

local blocked = false
local reply = {0}
for i = 1, count do
  local r = rules[i]
  local result = r.kind.check(r.key, r.ids, r.args, ctx)
  if result[1] == 0 and r.enforce then
    blocked = true
  end
  r.result = result
  reply[i + 1] = result
end

if mode == 'commit' and not blocked then
  for i = 1, count do
    local r = rules[i]
    if r.result[1] == 1 and r.result[2] == 0 then
      r.kind.commit(r.key, r.ids, r.args, ctx, r.result)
    end
  end
  if claims then
    hold_claim(claims, ctx.id, token, claim_now, lease)
  end
  reply[1] = 1
end
return reply
