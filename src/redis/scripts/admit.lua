-- One admission decision, all or nothing, on Redis server time.
-- KEYS: 1 counts, 2 operations, 3 the client's rate bucket (see read_tat), 4 the replica's lease,
--       5 the idempotency record (client, key), 6 the replica set (not written: registration
--       keeps it), 7 the deployment's epoch,
--       8 the recovery marker.
-- ARGV: 1 key base, 2 operation id, 3 replica, 4 lease token, 5 client, 6 needs approval (0/1),
--       7 emission interval (µs), 8 burst span (µs), 9 client active limit, 10 client pending
--       limit, 11 per-client grant cap, 12 global grant cap, 13 global active limit,
--       14 global executing limit, 15 whether KEYS[5] is used (0/1), 16 its lifetime (ms; 0 for
--       none: it lives until its operation is retired), 17 the epoch this replica registered in.
-- Reply: {'admitted', reading} | {'duplicate'} (this id was admitted before: a retry) |
--        {'replay', id, replica} | {'lease'} (this replica does not hold its lease, or not in the
--        deployment's epoch) | {'recovering'} (Redis forgot the deployment and the replicas are
--        registering again) |
--        {'refused', code, rate wait µs, capacity exhausted 0/1, reading}, where reading is
--        {TAT µs, now µs, client active, client pending}: the client's bucket and counts just after
--        the decision, for the client's quota (`RateLimit` fields) as the deployment sees it.
local base, id, replica, token, client = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local approval = ARGV[6] == '1'
local interval, span = tonumber(ARGV[7]), tonumber(ARGV[8])
local client_active, client_pending = tonumber(ARGV[9]), tonumber(ARGV[10])
local grant_client, grant_global = tonumber(ARGV[11]), tonumber(ARGV[12])
local global_active, global_executing = tonumber(ARGV[13]), tonumber(ARGV[14])
local keyed = ARGV[15] == '1'

-- Every string key the decision reads, in one call: the lease, the epoch, the recovery marker,
-- the bucket and (if used) the idempotency record.
local read
if keyed then
  read = redis.call('MGET', KEYS[4], KEYS[7], KEYS[8], KEYS[3], KEYS[5])
else
  read = redis.call('MGET', KEYS[4], KEYS[7], KEYS[8], KEYS[3])
end
if read[1] ~= token or read[2] ~= ARGV[17] then
  return {'lease'}
end
if read[3] then
  return {'recovering'}
end
if redis.call('HEXISTS', KEYS[2], id) == 1 then
  return {'duplicate'}
end
if keyed then
  local owner = read[5]
  if owner then
    local owner_id, owner_replica = string.match(owner, '^(%S+) (%S+)$')
    -- The key names this very id only if it was admitted and since released (a lapsed lease):
    -- then it is decided afresh below, as a restored operation would be counted again.
    if owner_id ~= id then
      return {'replay', owner_id, owner_replica}
    end
  end
end

local now = now_micros()
local tat, _, stored_span = parse_tat(read[4])
-- A reload changed this client's rate since the TAT was written: rescale the fill level first.
local rescaled = stored_span ~= nil and stored_span ~= span
if rescaled then
  tat = rescale(tat, now, stored_span, span)
end
local next_tat = math.max(tat, now) + interval
local rate_wait = math.max(math.max(tat, now) + interval - now - span, 0)

-- Every count the decision reads, in one call.
local known = counts({'active', 'a:' .. client, 'pending', 'p:' .. client, 'executing'})
local a, p = known['a:' .. client], known['p:' .. client]
local ga, gp, ge = known['active'], known['pending'], known['executing']
local pending_cap = math.min(client_pending, grant_client)

local code
if next_tat - now > span then
  code = 'submission_rate_limited'
elseif a >= client_active then
  code = 'client_operation_limit'
elseif approval and p >= pending_cap then
  if p >= client_pending then code = 'client_pending_limit' else code = 'pending_grant_limit' end
elseif approval and gp >= grant_global then
  code = 'pending_grant_limit'
elseif ga >= global_active then
  code = 'global_operation_limit'
elseif ge >= global_executing then
  code = 'global_execution_limit'
end

if code then
  local capacity = 0
  if code ~= 'submission_rate_limited'
    or a >= client_active
    or (approval and (p >= pending_cap or gp >= grant_global))
    or ga >= global_active
    or ge >= global_executing then
    capacity = 1
  end
  if rescaled and tat > now then
    write_tat(KEYS[3], tat, interval, span, now)
  end
  return {'refused', code, string.format('%.0f', rate_wait), capacity,
    {string.format('%.0f', tat), string.format('%.0f', now), a, p}}
end

write_tat(KEYS[3], next_tat, interval, span, now)
local state = 'a'
if approval then state = 'p' end
-- (The replica is in the replica set already: its registration put it there, and a reap that
-- took it out also ended the lease checked above.)
hold(id, state, replica, client, base, known)
if keyed then
  local ttl = tonumber(ARGV[16])
  if ttl > 0 then
    redis.call('SET', KEYS[5], id .. ' ' .. replica, 'PX', ttl)
  else
    redis.call('SET', KEYS[5], id .. ' ' .. replica)
  end
end
if approval then p = p + 1 end
return {'admitted', {string.format('%.0f', next_tat), string.format('%.0f', now), a + 1, p}}
