-- Writes back the idempotency records of operations a replica's store holds, after Redis forgot
-- them: each key bound to its operation unless the key is bound already.
-- KEYS: none besides what the names build (all under the deployment's hash tag).
-- ARGV: 1 key base, 2 the replica, 3 lifetime (ms; 0 for none), then per record: client, key,
--       operation id.
-- Reply: how many were written.
local base, replica, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
local written = 0
for i = 4, #ARGV, 3 do
  local name = base .. ':key:' .. ARGV[i] .. ':' .. ARGV[i + 1]
  local value = ARGV[i + 2] .. ' ' .. replica
  local set
  if ttl > 0 then
    set = redis.call('SET', name, value, 'NX', 'PX', ttl)
  else
    set = redis.call('SET', name, value, 'NX')
  end
  if set then written = written + 1 end
end
return written
