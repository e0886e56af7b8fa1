-- Releases, exactly once, what every replica whose lease has lapsed held.
-- KEYS: 1 counts, 2 operations, 3 the replica set. ARGV: 1 key base.
-- Reply: {replica, operations released, ...} for each replica reaped. Anything released is
-- published as `*` on the notices channel (any count may have fallen).
local base = ARGV[1]
local reaped = {}
local any = false
for _, replica in ipairs(redis.call('SMEMBERS', KEYS[3])) do
  if redis.call('EXISTS', base .. ':lease:' .. replica) == 0 then
    local held = base .. ':held:' .. replica
    local released = 0
    for _, id in ipairs(redis.call('SMEMBERS', held)) do
      local record = redis.call('HGET', KEYS[2], id)
      if record then
        release(id, record, base)
        released = released + 1
        any = true
      end
    end
    redis.call('DEL', held)
    redis.call('SREM', KEYS[3], replica)
    table.insert(reaped, replica)
    table.insert(reaped, released)
  end
end
if any then
  redis.call('PUBLISH', base .. ':notices', '*')
end
return reaped
