-- Renews a replica's lease if it still holds it, in the epoch it registered in.
-- KEYS: 1 the lease, 2 the deployment's epoch, 3 the recovery window. ARGV: 1 lease token,
-- 2 lease time (ms), 3 the epoch this replica registered in.
-- Reply: 'ok' | 'ok-recovering' (renewed, and the replicas are still registering again after Redis
--        forgot) | 'lapsed' (nobody holds it: the holdings may have been released) | 'taken' |
--        'lost' (Redis no longer holds this replica's epoch: it forgot the deployment).
if redis.call('GET', KEYS[2]) ~= ARGV[3] then
  return 'lost'
end
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
  if redis.call('EXISTS', KEYS[3]) == 1 then
    return 'ok-recovering'
  end
  return 'ok'
elseif holder then
  return 'taken'
end
return 'lapsed'
