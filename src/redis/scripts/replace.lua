-- A replica (re)registers: everything it held (the operations whose records name it) is released
-- and what its store restores is counted instead (even above a limit), and its lease is taken, in
-- one step. It also notices whether Redis has forgotten the deployment (a restart without
-- persistence, a flush, a failover to a Redis without the state) and, if so, opens a recovery
-- window in which no replica admits until every replica expected has registered again, or one
-- lease period has passed. Who is expected is known only from a replica that knows the whole
-- deployment (its `replicas` list): until one such registers, the window lasts its whole lease
-- period, whatever the replicas heard of each other before (one started a moment before Redis
-- forgot may be unknown to all the others).
-- KEYS: 1 counts, 2 operations, 3 the held set an older build kept (deleted), 4 its lease,
--       5 the replica set, 6 the deployment's epoch, 7 the recovery marker, 8 the replicas
--       expected back, 9 the members hash (replica -> the epoch it last registered in).
-- ARGV: 1 key base, 2 replica, 3 lease token, 4 lease time (ms), 5 the epoch this replica last
--       registered in ('' if none: a new process), 6 a fresh epoch to use if there is none,
--       7 the nonce of the key records it restored just before (`restore_keys.lua`), '' for
--       none, or '-' if it has none to restore (no recovery source), 8 '1' if the replicas it
--       reports are the whole deployment (its `replicas` list was given), else '0', 9 how many
--       replicas it reports, then their names (the deployment as it knows it), then
--       how many rate debts, then per client: client, interval, span, debt (µs), then per
--       operation: id, client, state (`p`, `a` or `e`).
-- A registration that may have lowered a count is published as `*` on the notices channel: what
-- it released (or counted again in another state), or what Redis forgot, may turn any replica's
-- remembered refusal into an admission. One that lowered nothing (a replica joining a running
-- deployment with nothing held before, whose rate debts can only make buckets emptier) is not:
-- a notice then could only end remembered refusals that are still Redis's answer.
-- Reply: {operations released, operations counted, the epoch, recovering 0/1, restored 0/1}
--        (restored: Redis lacked this replica's rate buckets and key records for this epoch,
--        and the rate debts were applied) | 'lacking' (nothing done: Redis lacks this replica's
--        key records — it forgot the deployment after the replica checked, or during or after
--        their restore — so they must be restored, and the registration sent, again).
local base, replica, known, keyed = ARGV[1], ARGV[2], ARGV[5], ARGV[7]
local lease_ms = tonumber(ARGV[4])
local epoch = redis.call('GET', KEYS[6])
local marker = base .. ':keyed:' .. replica
-- Whether Redis lacks this replica's part of the epoch (none at all, or this replica not
-- registered in it), and if so whether the key records it restored are still here.
if keyed ~= '-' and (not epoch or redis.call('HGET', KEYS[9], replica) ~= epoch)
  and (keyed == '' or redis.call('GET', marker) ~= keyed) then
  return 'lacking'
end
redis.call('DEL', marker)
local fresh_epoch = false
if not epoch then
  -- Nothing of this deployment is left in Redis (or it never ran): a new epoch, and a recovery
  -- window for the replicas this one knows of.
  epoch = ARGV[6]
  redis.call('SET', KEYS[6], epoch)
  fresh_epoch = true
end
local complete = ARGV[8] == '1'
local i = 9
local reported = tonumber(ARGV[i])
local names = {}
for j = 1, reported do
  names[j] = ARGV[i + j]
end
i = i + reported + 1
local restored = redis.call('HGET', KEYS[9], replica) ~= epoch
-- A new epoch, or one that changed under a replica that had one: what every replica held may
-- be missing from the counts, so none admits until the replicas known are back (or a lease
-- period has passed: a silent one then counts as dead, as a lapsed lease does).
if (fresh_epoch or (known ~= '' and known ~= epoch)) and redis.call('EXISTS', KEYS[7]) == 0 then
  redis.call('DEL', KEYS[8])
  redis.call('SET', KEYS[7], epoch, 'PX', lease_ms)
  -- '?' (no replica's name: names start with a letter or digit) stands for the replicas nobody
  -- has named yet; only a replica that knows the whole deployment takes it out.
  redis.call('SADD', KEYS[8], '?')
end
if redis.call('EXISTS', KEYS[7]) == 1 then
  for j = 1, reported do
    if redis.call('HGET', KEYS[9], names[j]) ~= epoch then
      redis.call('SADD', KEYS[8], names[j])
    end
  end
  if complete then
    redis.call('SREM', KEYS[8], '?')
  end
  redis.call('PEXPIRE', KEYS[8], lease_ms)
end
-- Rate debts: applied only when Redis lacks this replica's admissions for this epoch. Each
-- replica adds its own debt, which can only leave a bucket emptier than the merged history.
local debts = tonumber(ARGV[i])
local now = now_micros()
if restored then
  for j = 0, debts - 1 do
    local k = i + 1 + j * 4
    owe(base, now, ARGV[k], tonumber(ARGV[k + 1]), tonumber(ARGV[k + 2]), tonumber(ARGV[k + 3]))
  end
end
i = i + 1 + debts * 4
local released = 0
local mine = held_by({[replica] = true})[replica] or {}
for n = 1, #mine, 2 do
  release(mine[n], mine[n + 1])
  released = released + 1
end
-- The held set an older build kept beside the records (nothing reads it now).
redis.call('DEL', KEYS[3])
local counted, recounted = 0, 0
for k = i, #ARGV, 3 do
  local id, client, state = ARGV[k], ARGV[k + 1], ARGV[k + 2]
  local record = redis.call('HGET', KEYS[2], id)
  if record then
    release(id, record)
    recounted = recounted + 1
  end
  hold(id, state, replica, client)
  counted = counted + 1
end
-- The holders, from the counts as they now stand (every script keeps them, but a build that did
-- not may have written the counts).
recount_holders()
redis.call('SET', KEYS[4], ARGV[3], 'PX', lease_ms)
redis.call('SADD', KEYS[5], replica)
redis.call('HSET', KEYS[9], replica, epoch)
redis.call('SREM', KEYS[8], replica)
local recovering = redis.call('EXISTS', KEYS[7])
if recovering == 1 and redis.call('SCARD', KEYS[8]) == 0 then
  -- Every replica expected back is registered again: admissions resume at once.
  redis.call('DEL', KEYS[7], KEYS[8])
  recovering = 0
end
if released > 0 or recounted > 0 or fresh_epoch or (known ~= '' and known ~= epoch) then
  redis.call('PUBLISH', base .. ':notices', '*')
end
local restored_flag = 0
if restored then restored_flag = 1 end
return {released, counted, epoch, recovering, restored_flag}
