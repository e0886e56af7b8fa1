-- Renews a replica's lease if it still holds it.
-- KEYS: 1 the lease. ARGV: 1 lease token, 2 lease time (ms).
-- Reply: 'ok' | 'lapsed' (nobody holds it: the holdings may have been released) | 'taken'.
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
  return 'ok'
elseif holder then
  return 'taken'
end
return 'lapsed'
