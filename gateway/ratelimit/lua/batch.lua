-- A batch of rate-limit operations from one gateway, applied in order in one script call (one round trip for many
-- requests). GCRA is the arithmetic of gateway/ratelimit/gcra.py with Redis server time as the clock, so every
-- gateway instance agrees on "now"; GCRA times are microseconds since the epoch, slot leases milliseconds.
-- KEYS: one per check, correction and release, in the order ARGV names them.
-- ARGV, a sequence of operations:
--   'A' n                         an admission: its next n checks are all granted, or none consumes anything
--   'R' interval tolerance cost   a GCRA check (us per unit, us of tolerance = interval x burst, units)
--   'S' limit lease member        a concurrency slot: holders in a sorted set scored by lease expiry (ms), so a
--                                 gateway that dies without releasing frees its slots when their leases run out
--   'J' interval delta            a GCRA correction: a token reservation reconciled with real usage (< 0 refunds)
--   'Z' member                    a slot release
-- Returns, for every check of every admission in order: allowed 0|1, remaining units, retry_after us, reset us.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local now_ms = math.floor(now / 1000)

-- float rounding must not turn an exact fit into a denial or a negative remainder
local function units(span, interval)
  return math.max(0, math.floor(span / interval + 1e-6))
end

local function tat_of(key)
  return math.max(tonumber(redis.call('GET', key) or now), now)
end

local function store_tat(key, tat)
  if tat <= now then
    redis.call('DEL', key)
  else
    redis.call('SET', key, string.format('%.0f', tat), 'PX', math.ceil((tat - now) / 1000) + 1)
  end
end

-- A check answers its outcome and, when it allows, what to store once the whole admission is granted.
local function rate(key, interval, tolerance, cost)
  local tat = tat_of(key)
  local new_tat = tat + interval * cost
  local allow_at = new_tat - tolerance
  if allow_at > now + 0.001 then
    return {0, units(tolerance - (tat - now), interval), math.ceil(allow_at - now), math.ceil(tat - now)}
  end
  return {1, units(tolerance - (new_tat - now), interval), 0, math.ceil(new_tat - now)}, {key = key, tat = new_tat}
end

local function slot(key, limit, lease, member)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now_ms)
  local held = redis.call('ZCARD', key)
  if held >= limit then
    local first = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
    local wait = (tonumber(first[2]) - now_ms) * 1000
    return {0, 0, wait, wait}
  end
  return {1, limit - held - 1, 0, 0}, {key = key, lease = lease, member = member}
end

local function commit(grant)
  if grant.tat then
    store_tat(grant.key, grant.tat)
  else
    redis.call('ZADD', grant.key, now_ms + grant.lease, grant.member)
    redis.call('PEXPIRE', grant.key, grant.lease)
  end
end

local out = {}
local a, k = 1, 1
while a <= #ARGV do
  local op = ARGV[a]
  if op == 'A' then
    local n = tonumber(ARGV[a + 1])
    a = a + 2
    local grants, granted = {}, true
    for i = 1, n do
      local outcome, grant
      if ARGV[a] == 'R' then
        outcome, grant = rate(KEYS[k], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]))
      else
        outcome, grant = slot(KEYS[k], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), ARGV[a + 3])
      end
      for _, v in ipairs(outcome) do out[#out + 1] = v end
      if grant then grants[i] = grant else granted = false end
      a, k = a + 4, k + 1
    end
    if granted then
      for _, grant in ipairs(grants) do commit(grant) end
    end
  elseif op == 'J' then
    store_tat(KEYS[k], tat_of(KEYS[k]) + tonumber(ARGV[a + 1]) * tonumber(ARGV[a + 2]))
    a, k = a + 3, k + 1
  else -- 'Z'
    redis.call('ZREM', KEYS[k], ARGV[a + 1])
    a, k = a + 2, k + 1
  end
end
return out
