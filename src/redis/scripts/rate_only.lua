-- The benchmark's baseline: a GCRA token on Redis time and nothing else.
-- KEYS: 1 the TAT. ARGV: 1 emission interval (µs), 2 burst span (µs). Reply: 1 taken, 0 refused.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
local next_tat = math.max(tat, now) + tonumber(ARGV[1])
if next_tat - now > tonumber(ARGV[2]) then
  return 0
end
redis.call('SET', KEYS[1], string.format('%.0f', next_tat), 'PX', math.floor((next_tat - now) / 1000) + 1)
return 1
