-- Take a concurrency slot: holders live in a sorted set scored by lease expiry (ms), so a gateway that dies
-- without releasing frees its slots when their leases run out.
-- KEYS[1]: the holders' set   ARGV[1]: limit   ARGV[2]: lease (ms)   ARGV[3]: holder id (the request id)
-- Returns {allowed 0|1, remaining slots, retry_after us, reset us}
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local held = redis.call('ZCARD', KEYS[1])
local limit = tonumber(ARGV[1])
if held >= limit then
  local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  local wait = (tonumber(first[2]) - now) * 1000
  return {0, 0, wait, wait}
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {1, limit - held - 1, 0, 0}
