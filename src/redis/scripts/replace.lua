-- A replica (re)registers: everything it held is released and what its store restores is counted
-- instead (even above a limit), and its lease is taken, in one step.
-- KEYS: 1 counts, 2 operations, 3 the replica's held set, 4 its lease, 5 the replica set.
-- ARGV: 1 key base, 2 replica, 3 lease token, 4 lease time (ms), then per operation: id, client,
--       state (`p`, `a` or `e`).
-- Reply: {operations released, operations counted}.
local base, replica = ARGV[1], ARGV[2]
local released = 0
for _, id in ipairs(redis.call('SMEMBERS', KEYS[3])) do
  local record = redis.call('HGET', KEYS[2], id)
  if record then
    release(id, record, base)
    released = released + 1
  end
end
redis.call('DEL', KEYS[3])
local counted = 0
for i = 5, #ARGV, 3 do
  local id, client, state = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local record = redis.call('HGET', KEYS[2], id)
  if record then
    release(id, record, base)
  end
  hold(id, state, replica, client, base)
  counted = counted + 1
end
redis.call('SET', KEYS[4], ARGV[3], 'PX', tonumber(ARGV[4]))
redis.call('SADD', KEYS[5], replica)
return {released, counted}
