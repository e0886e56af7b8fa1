-- Writes back the idempotency records of operations a replica's store holds, after Redis forgot
-- them: each key bound to its operation unless the key is bound already. A restore may take
-- several calls; the first leaves a marker, `<base>:keyed:<replica>`, holding the restore's
-- nonce, and every later call and the registration that follows (`replace.lua`) find it there
-- only if Redis forgot nothing since the first: a Redis that forgot meanwhile lost the records
-- already written, and the restore starts again.
-- KEYS: none besides what the names build (all under the deployment's hash tag).
-- ARGV: 1 key base, 2 the replica, 3 lifetime (ms; 0 for none), 4 the restore's nonce, 5 1 for
--       the restore's first call, else 0, then per record: client, key, operation id.
-- Reply: how many were written, or -1 (nothing written: the marker is gone, Redis forgot since
--        the first call).
local base, replica, ttl, nonce = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local marker = base .. ':keyed:' .. replica
if ARGV[5] == '1' then
  -- Kept an hour at most: the registration that follows deletes it.
  redis.call('SET', marker, nonce, 'PX', 3600000)
elseif redis.call('GET', marker) ~= nonce then
  return -1
end
local written = 0
for i = 6, #ARGV, 3 do
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
