-- After Redis forgot the deployment, a replica whose store the whole fleet shares counts the
-- work of the replicas that have not registered again in this epoch, under their names, from
-- what the store says they own: their live operations and their clients' rate debts. So a
-- replica that died a moment before Redis forgot has its work counted at once, not only once a
-- survivor takes it over. Each such replica is marked registered in the epoch, so its own
-- registration later (if it lives) replaces what was counted for it here, without owing its
-- debts twice. An operation Redis holds already (its owner registered it, or a survivor took it
-- over meanwhile) is left as it is. Each replica counted here gets a lease no replica holds the
-- token of (`rebuilt`), one lease period long, and joins the replica set: one that lives
-- registers again before it lapses (its heartbeat finds the epoch changed), one that died is
-- reaped as a lapsed lease always is, so what it held and nobody moved (work that ended on
-- another replica while it was gone, say) is released, and what a survivor took over in the
-- store was moved to that survivor by its registration already.
-- KEYS: 1 counts, 2 operations, 3 the deployment's epoch, 4 the members hash (replica -> the
--       epoch it last registered in), 5 the replica set.
-- ARGV: 1 key base, 2 the epoch the caller registered in, 3 lease time (ms), then per replica:
--       its name, how many rate debts, per debt: client, interval, span, debt (µs); how many
--       operations, per operation: id, client, state (`p`, `a` or `e`).
-- Reply: {replica, operations counted, ...} for each replica counted | 'moved' (nothing done:
--        Redis holds another epoch, it forgot again since the caller registered).
local base, epoch, lease_ms = ARGV[1], ARGV[2], tonumber(ARGV[3])
if redis.call('GET', KEYS[3]) ~= epoch then
  return 'moved'
end
local now = now_micros()
local out = {}
local i = 4
while i <= #ARGV do
  local replica = ARGV[i]
  local debts = tonumber(ARGV[i + 1])
  local first_op = i + 2 + debts * 4
  local ops = tonumber(ARGV[first_op])
  local after = first_op + 1 + ops * 3
  if redis.call('HGET', KEYS[4], replica) ~= epoch then
    for j = 0, debts - 1 do
      local k = i + 2 + j * 4
      owe(base, now, ARGV[k], tonumber(ARGV[k + 1]), tonumber(ARGV[k + 2]), tonumber(ARGV[k + 3]))
    end
    local counted = 0
    for k = first_op + 1, after - 1, 3 do
      if redis.call('HEXISTS', KEYS[2], ARGV[k]) == 0 then
        hold(ARGV[k], ARGV[k + 2], replica, ARGV[k + 1])
        counted = counted + 1
      end
    end
    redis.call('HSET', KEYS[4], replica, epoch)
    redis.call('SET', base .. ':lease:' .. replica, 'rebuilt', 'PX', lease_ms, 'NX')
    redis.call('SADD', KEYS[5], replica)
    out[#out + 1] = replica
    out[#out + 1] = counted
  end
  i = after
end
return out
