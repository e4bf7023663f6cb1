-- Correct a GCRA key after the fact: a token reservation reconciled with real usage (refund or extra charge),
-- or a refund when another limit denied the same request.
-- KEYS[1]: the key's TAT (us)   ARGV[1]: interval (us per unit)   ARGV[2]: delta units (negative refunds)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local tat = tonumber(redis.call('GET', KEYS[1]) or now)
if tat < now then tat = now end
tat = tat + tonumber(ARGV[1]) * tonumber(ARGV[2])
if tat <= now then
  redis.call('DEL', KEYS[1])
  return 0
end
redis.call('SET', KEYS[1], string.format('%.0f', tat), 'PX', math.ceil((tat - now) / 1000) + 1)
return 1
