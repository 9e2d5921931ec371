-- decide.lua: checks every rule of one scope, then commits all of them or none.
--
-- KEYS: two keys per rule, in rule order: the rule's state, and the rule's admitted-ids set
--       (used by kinds whose state cannot hold message ids). All share the scope's hash tag.
--       Then, optionally, the recipient's dispatch marks (a sorted set: member = message id,
--       score = when the mark expires, ms): with it, 'check' and 'commit' first look
--       MESSAGE_ID up there and, if it was dispatched, reply {2} and touch nothing.
-- ARGV: NOW_MS, MESSAGE_ID, MODE, COST, RULE_COUNT, then per rule:
--       KIND, ENFORCE (1 = a refusal blocks the message, 0 = shadow rule), NARGS, ARG_1..ARG_NARGS
--   MODE: 'check'  = evaluate only, write nothing;
--         'commit' = evaluate, and if no enforcing rule refuses, consume in every rule that
--                    allowed and had not admitted MESSAGE_ID before;
--         'refund' = give back MESSAGE_ID's take in every rule listed (used when another
--                    scope refused the message after this one committed).
-- Reply: {COMMITTED, {ALLOWED, ALREADY, REMAINING, RETRY, DETAIL} per rule} (the kind files
--        say what REMAINING, RETRY and DETAIL mean for them); for 'refund', {1}; for a
--        message already dispatched, {2}.

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
  -- One constructor sizes the table once; filling it element by element grew it 1, 2, 4, 8
  -- (about 0.3 us of a headline call's 7.3 in Redis).
  local args = {unpack(ARGV, pos + 3, pos + 2 + nargs)}
  rules[i] = {
    kind = kind, enforce = ARGV[pos + 1] == '1', args = args,
    key = KEYS[2 * i - 1], ids = KEYS[2 * i], result = false,
  }
  pos = pos + 3 + nargs
end

local marks = KEYS[2 * count + 1]
if marks and mode ~= 'refund' then
  local expires = redis.call('ZSCORE', marks, ctx.id)
  if expires and tonumber(expires) > ctx.now then
    return {2}
  end
end

if mode == 'refund' then
  for i = 1, count do
    local r = rules[i]
    r.kind.refund(r.key, r.ids, r.args, ctx)
  end
  return {1}
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
  reply[1] = 1
end
return reply
