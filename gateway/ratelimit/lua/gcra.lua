-- GCRA decision inside Redis: the arithmetic of gateway/ratelimit/gcra.py, with Redis server time as the clock
-- so every gateway instance agrees on "now". Times are microseconds since the epoch.
-- KEYS[1]: the key's theoretical arrival time (TAT)
-- ARGV[1]: interval (us per unit)  ARGV[2]: tolerance (us, interval x burst)  ARGV[3]: cost (units)
-- Returns {allowed 0|1, remaining units, retry_after us, reset us}
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local interval = tonumber(ARGV[1])
local tolerance = tonumber(ARGV[2])
local cost = tonumber(ARGV[3])
local tat = tonumber(redis.call('GET', KEYS[1]) or now)
if tat < now then tat = now end
local new_tat = tat + interval * cost
local allow_at = new_tat - tolerance
-- float rounding must not turn an exact fit into a denial or a negative remainder
local function units(span)
  return math.max(0, math.floor(span / interval + 1e-6))
end
if allow_at > now + 0.001 then
  return {0, units(tolerance - (tat - now)), math.ceil(allow_at - now), math.ceil(tat - now)}
end
redis.call('SET', KEYS[1], string.format('%.0f', new_tat), 'PX', math.ceil((new_tat - now) / 1000) + 1)
return {1, units(tolerance - (new_tat - now)), 0, math.ceil(new_tat - now)}
