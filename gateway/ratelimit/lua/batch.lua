-- A batch of rate-limit operations from one gateway, applied in order in one script call (one round trip for many
-- requests). GCRA is the arithmetic of gateway/ratelimit/gcra.py with Redis server time as the clock, so every
-- gateway instance agrees on "now"; GCRA times are microseconds since the epoch, slot leases milliseconds.
-- A double holds microseconds since the epoch only to a quarter of one, so GCRA reckons how far each TAT is ahead
-- of now (small numbers, exact enough), and a TAT is stored as whole microseconds and a fraction, both kept.
-- Requests of one tenant share keys, so each GCRA key is read once and written once per batch, and each slot key is
-- swept and counted once: the work per request is a few table lookups, not a few Redis commands.
-- KEYS: one per check, correction and release, in the order ARGV names them.
-- ARGV, a sequence of operations, optionally after 'T' now: decide at that instant (us since the epoch), not at
-- Redis's clock (tests hold the memory backend and this script to one clock). Key expiries are absolute instants,
-- so a chosen clock governs them too, as long as it does not run behind Redis's.
--   'A' n                         an admission: its next n checks are all granted, or none consumes anything
--   'R' interval tolerance cost   a GCRA check (us per unit, us of tolerance = interval x burst, units)
--   'S' limit lease member        a concurrency slot: holders in a sorted set scored by lease expiry (ms), so a
--                                 gateway that dies without releasing frees its slots when their leases run out
--   'B' limit cost expire_at member  a spend budget: whole nanos spent in the period the key names, which ends at
--                                 expire_at (ms since the epoch); allowed while spent + cost <= limit; the
--                                 reservation is held by member in the hash <key>:held until settled
--   'J' interval delta            a GCRA correction: a token reservation reconciled with real usage (< 0 refunds)
--   'Z' member                    a slot release
--   'K' member cost               a budget settlement: member's reservation replaced by its final cost, once
--                                 (a repeated settlement finds no reservation and changes nothing)
-- Returns, for every check of every admission in order: allowed 0|1, remaining units, retry_after us, reset us.
local now, a
if ARGV[1] == 'T' then
  now, a = tonumber(ARGV[2]), 3
else
  local t = redis.call('TIME')
  now, a = tonumber(t[1]) * 1000000 + tonumber(t[2]), 1
end
local now_ms = math.floor(now / 1000)

local aheads, changed, writes = {}, {}, {}  -- GCRA key -> its TAT - now in this batch; keys to write back, in order
local held, leases = {}, {}   -- slot key -> holders within this batch; lease to extend the key's expiry to
local spent = {}              -- budget key -> nanos spent in its period, as this batch leaves it

-- A key left of another type (a rule that changed kind, same id) is read as empty and overwritten: with one
-- script per batch, a raised error would fail every request of the batch, not just that rule's.
local function ahead_of(key)
  if aheads[key] == nil then
    local stored = redis.pcall('GET', key)
    local whole, fraction = nil, nil
    if type(stored) == 'string' then whole, fraction = stored:match('^(%d+)(%.?%d*)$') end
    aheads[key] = whole and (tonumber(whole) - now) + (tonumber('0' .. fraction) or 0) or 0
  end
  return math.max(aheads[key], 0)
end

local function set_ahead(key, ahead)
  if not changed[key] then
    changed[key] = true
    writes[#writes + 1] = key
  end
  aheads[key] = ahead
end

-- now + ahead as whole microseconds and their fraction (to a millionth): a double of the sum would round it
local function tat_text(ahead)
  local whole = math.floor(ahead)
  local fraction = math.floor((ahead - whole) * 1000000 + 0.5)
  if fraction == 1000000 then whole, fraction = whole + 1, 0 end
  return string.format('%.0f.%06d', now + whole, fraction)
end

local function held_of(key)
  if held[key] == nil then
    if type(redis.pcall('ZREMRANGEBYSCORE', key, '-inf', now_ms)) == 'table' then redis.call('DEL', key) end
    held[key] = redis.call('ZCARD', key)
  end
  return held[key]
end

-- float rounding must not turn an exact fit into a denial or a negative remainder
local function units(span, interval)
  return math.max(0, math.floor(span / interval + 1e-6))
end

-- A check answers its outcome and, when it allows, how to take what it allowed once the whole admission is granted.
local function rate(key, interval, tolerance, cost)
  local ahead = ahead_of(key)
  local new_ahead = ahead + interval * cost
  local allow_at = new_ahead - tolerance
  if allow_at > 0.001 then
    return {0, units(tolerance - ahead, interval), math.ceil(allow_at), math.ceil(ahead)}
  end
  return {1, units(tolerance - new_ahead, interval), 0, math.ceil(new_ahead)},
    function() set_ahead(key, new_ahead) end
end

local function slot(key, limit, lease, member)
  local n = held_of(key)
  if n >= limit then
    local first = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
    local wait = (tonumber(first[2]) - now_ms) * 1000
    return {0, 0, wait, wait}
  end
  return {1, limit - n - 1, 0, 0}, function()
    redis.call('ZADD', key, now_ms + lease, member)
    held[key] = n + 1
    leases[key] = math.max(leases[key] or 0, lease)
  end
end

local function spent_of(key)
  if spent[key] == nil then
    local stored = redis.pcall('GET', key)
    spent[key] = type(stored) == 'string' and tonumber(stored) or 0
  end
  return spent[key]
end

-- nanos are passed on to INCRBY as the decimal text they came in: Redis adds them as 64-bit integers, exactly
local function budget(key, limit, cost_text, expire_at, member)
  local used, cost = spent_of(key), tonumber(cost_text)
  local reset = math.max(expire_at - now_ms, 0) * 1000
  if used + cost > limit then
    return {0, math.max(limit - used, 0), reset, reset}
  end
  return {1, limit - used - cost, 0, reset}, function()
    if type(redis.pcall('INCRBY', key, cost_text)) ~= 'number' then redis.call('SET', key, cost_text) end
    redis.call('PEXPIREAT', key, expire_at)
    redis.pcall('HSET', key .. ':held', member, cost_text)
    redis.call('PEXPIREAT', key .. ':held', expire_at)
    spent[key] = used + cost
  end
end

local out = {}
local k = 1
while a <= #ARGV do
  local op = ARGV[a]
  if op == 'A' then
    local n = tonumber(ARGV[a + 1])
    a = a + 2
    local takes, granted = {}, true
    for i = 1, n do
      local outcome, take
      if ARGV[a] == 'R' then
        outcome, take = rate(KEYS[k], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]))
      elseif ARGV[a] == 'B' then
        outcome, take = budget(KEYS[k], tonumber(ARGV[a + 1]), ARGV[a + 2], tonumber(ARGV[a + 3]), ARGV[a + 4])
        a = a + 1  -- a budget check has one argument more than the others
      else
        outcome, take = slot(KEYS[k], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), ARGV[a + 3])
      end
      for _, v in ipairs(outcome) do out[#out + 1] = v end
      if take then takes[i] = take else granted = false end
      a, k = a + 4, k + 1
    end
    if granted then
      for _, take in ipairs(takes) do take() end
    end
  elseif op == 'J' then
    set_ahead(KEYS[k], ahead_of(KEYS[k]) + tonumber(ARGV[a + 1]) * tonumber(ARGV[a + 2]))
    a, k = a + 3, k + 1
  elseif op == 'K' then
    local held_key = KEYS[k] .. ':held'
    local reserved = redis.pcall('HGET', held_key, ARGV[a + 1])
    if type(reserved) == 'string' then
      redis.call('HDEL', held_key, ARGV[a + 1])
      local delta = tonumber(ARGV[a + 2]) - tonumber(reserved)
      if delta ~= 0 and type(redis.pcall('INCRBY', KEYS[k], string.format('%d', delta))) == 'number' then
        if spent[KEYS[k]] ~= nil then spent[KEYS[k]] = spent[KEYS[k]] + delta end
      end
    end
    a, k = a + 3, k + 1
  else -- 'Z'
    local removed = redis.pcall('ZREM', KEYS[k], ARGV[a + 1])
    if held[KEYS[k]] and type(removed) == 'number' then held[KEYS[k]] = held[KEYS[k]] - removed end
    a, k = a + 2, k + 1
  end
end

for _, key in ipairs(writes) do
  local ahead = aheads[key]
  if ahead <= 0 then
    redis.call('DEL', key)
  else
    redis.call('SET', key, tat_text(ahead), 'PXAT', math.ceil((now + ahead) / 1000) + 1)
  end
end
for key, lease in pairs(leases) do
  redis.call('PEXPIREAT', key, now_ms + lease)
end
return out
