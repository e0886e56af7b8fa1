-- Releases, exactly once, what every replica whose lease has lapsed held: the operations whose
-- records name it (one read of the operations hash, only when some lease has lapsed).
-- KEYS: 1 counts, 2 operations, 3 the replica set. ARGV: 1 key base.
-- Reply: {replica, operations released, ...} for each replica reaped. Anything released is
-- published as `*` on the notices channel (any count may have fallen).
local base = ARGV[1]
local lapsed, lapsed_list = {}, {}
for _, replica in ipairs(redis.call('SMEMBERS', KEYS[3])) do
  if redis.call('EXISTS', base .. ':lease:' .. replica) == 0 then
    lapsed[replica] = true
    lapsed_list[#lapsed_list + 1] = replica
  end
end
local reaped = {}
if #lapsed_list == 0 then
  return reaped
end
local by = held_by(lapsed)
local any = false
for _, replica in ipairs(lapsed_list) do
  local released = 0
  local list = by[replica] or {}
  for n = 1, #list, 2 do
    release(list[n], list[n + 1])
    released = released + 1
    any = true
  end
  -- The held set an older build kept beside the records (nothing reads it now).
  redis.call('DEL', base .. ':held:' .. replica)
  redis.call('SREM', KEYS[3], replica)
  reaped[#reaped + 1] = replica
  reaped[#reaped + 1] = released
end
if any then
  redis.call('PUBLISH', base .. ':notices', '*')
end
return reaped
