-- Releases, exactly once, what every replica whose lease has lapsed held: the operations whose
-- records name it (one read of the operations hash, only when some lease has lapsed).
-- KEYS: 1 counts, 2 operations, 3 the replica set. ARGV: 1 key base, 2 '?' to only name the
-- replicas whose leases lapsed (nothing released), or '!' followed by the replicas to spare: a
-- store the fleet shares still has live work of theirs, which a survivor takes over there and
-- moves here by its registration (released now, it would be counted nowhere meanwhile).
-- Reply: {replica, operations released, ...} for each replica reaped (with '?': the names of the
-- replicas whose leases lapsed). Anything released is published as `*` on the notices channel
-- (any count may have fallen).
local base = ARGV[1]
local spare = {}
for n = 3, #ARGV do
  spare[ARGV[n]] = true
end
local lapsed, lapsed_list = {}, {}
for _, replica in ipairs(redis.call('SMEMBERS', KEYS[3])) do
  if redis.call('EXISTS', base .. ':lease:' .. replica) == 0 and not spare[replica] then
    lapsed[replica] = true
    lapsed_list[#lapsed_list + 1] = replica
  end
end
local reaped = {}
if #lapsed_list == 0 or ARGV[2] == '?' then
  return lapsed_list
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
