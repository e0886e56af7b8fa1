-- A replica's decisions in one call (a group commit): admissions and transitions, decided in
-- the order given, each exactly as it would be decided alone — the same checks, codes and
-- replies, exactly once by operation id — with what they share read once and written once:
-- one TIME, one HMGET of the operations, one MGET of the lease, epoch, recovery marker, buckets
-- and key records, one HMGET of every count, then one HSET / HDEL of the counts changed and of
-- the operations changed, one SADD / SREM per replica set, one PUBLISH of every notice. A batch
-- of one is the single decision. Every key lives under the deployment's hash tag (KEYS[1]'s):
-- the per-operation keys (buckets, key records) are built from ARGV[1], as all scripts do.
-- KEYS: 1 counts, 2 operations, 3 the replica's lease, 4 the deployment's epoch, 5 the recovery
--       marker.
-- ARGV: 1 key base, 2 replica, 3 lease token, 4 the epoch this replica registered in, then each
--       decision in order, one of:
--   an admission, 14 fields: `A`, operation id, client, needs approval (0/1), emission interval
--     (µs), burst span (µs), client active limit, client pending limit, per-client grant cap,
--     global grant cap, global active limit, global executing limit, the idempotency record's
--     key (empty for none), its lifetime (ms; 0 for none: it lives until its operation is
--     retired);
--   a transition, 7 fields: `T`, operation id, target (`a` approved, `e` executing, `t`
--     terminal: release everything, `r` refund: release and give the rate token back), global
--     executing limit, the emission interval and burst span the token was taken under (µs, for
--     `r`), the idempotency record to free if it still names this operation (empty for none: a
--     committed operation keeps its key).
-- Reply: one reply per decision, in order.
--   An admission: {'admitted', reading} | {'duplicate'} (this id was admitted before: a retry) |
--     {'replay', id, replica} | {'lease'} (this replica does not hold its lease, or not in the
--     deployment's epoch) | {'recovering'} (Redis forgot the deployment and the replicas are
--     registering again) | {'refused', code, rate wait µs, capacity exhausted 0/1, reading},
--     where reading is {TAT µs, now µs, client active, client pending}: the client's bucket and
--     counts just after the decision, for the client's quota as the deployment sees it.
--   A transition: {'moved', from} | {'same'} | {'absent'} (released already) |
--     {'not_allowed', from} | {'saturated'} (no execution slot: the operation stays approved).
-- A move that lowers a count (a release, a refund, an approval) is published on the
-- deployment's notices channel, `r <client>` or, for a refund, `f <client>`, one a line, so
-- every replica's refusal memory forgets what it may have changed.
local base, replica, token, epoch = ARGV[1], ARGV[2], ARGV[3], ARGV[4]

local decisions = {}
local i = 5
while i <= #ARGV do
  local kind = ARGV[i]
  if kind == 'A' then
    decisions[#decisions + 1] = {
      admit = true, id = ARGV[i + 1], client = ARGV[i + 2], approval = ARGV[i + 3] == '1',
      interval = tonumber(ARGV[i + 4]), span = tonumber(ARGV[i + 5]),
      client_active = tonumber(ARGV[i + 6]), client_pending = tonumber(ARGV[i + 7]),
      grant_client = tonumber(ARGV[i + 8]), grant_global = tonumber(ARGV[i + 9]),
      global_active = tonumber(ARGV[i + 10]), global_executing = tonumber(ARGV[i + 11]),
      key = ARGV[i + 12], ttl = tonumber(ARGV[i + 13]),
    }
    i = i + 14
  elseif kind == 'T' then
    decisions[#decisions + 1] = {
      admit = false, id = ARGV[i + 1], to = ARGV[i + 2], limit = tonumber(ARGV[i + 3]),
      interval = tonumber(ARGV[i + 4]), span = tonumber(ARGV[i + 5]), key = ARGV[i + 6],
    }
    i = i + 7
  else
    return redis.error_reply('batch: unknown decision kind at ARGV[' .. i .. ']')
  end
end

-- The operations' records (id -> record, or false), read once.
local ids, seen_id = {}, {}
for _, d in ipairs(decisions) do
  if not seen_id[d.id] then
    seen_id[d.id] = true
    ids[#ids + 1] = d.id
  end
end
local records, records_before = {}, {}
local read = redis.call('HMGET', KEYS[2], unpack(ids))
for n, id in ipairs(ids) do
  records[id] = read[n]
  records_before[id] = read[n]
end

-- Whose operation each id is: its record's client, or the admission that names it.
local client_of = {}
for _, d in ipairs(decisions) do
  if client_of[d.id] == nil then
    local record = records[d.id]
    if record then
      local _, _, client = parse_op(record)
      client_of[d.id] = client or false
    elseif d.admit then
      client_of[d.id] = d.client
    end
  end
end

-- Every string key the batch reads, in one call.
local names, strings, wanted = {}, {}, {}
local function want(key)
  if key and key ~= '' and not wanted[key] then
    wanted[key] = true
    names[#names + 1] = key
  end
end
local admitting = false
for _, d in ipairs(decisions) do
  if d.admit then
    admitting = true
    want(base .. ':tat:' .. d.client)
    want(d.key)
  elseif d.to == 't' or d.to == 'r' then
    want(d.key)
    if d.to == 'r' and client_of[d.id] then
      want(base .. ':tat:' .. client_of[d.id])
    end
  end
end
if admitting then
  want(KEYS[3])
  want(KEYS[4])
  want(KEYS[5])
end
if #names > 0 then
  local values = redis.call('MGET', unpack(names))
  for n, key in ipairs(names) do
    strings[key] = values[n]
  end
end

-- Every count the batch touches, in one call.
local fields, counted = {'active', 'pending', 'executing'}, {}
for _, client in pairs(client_of) do
  if client and not counted[client] then
    counted[client] = true
    fields[#fields + 1] = 'a:' .. client
    fields[#fields + 1] = 'p:' .. client
    fields[#fields + 1] = 'e:' .. client
  end
end
local known = counts(fields)
local known_before = {}
for field, v in pairs(known) do
  known_before[field] = v
end

-- Redis time, read once and only if a decision needs it.
local now_read
local function now()
  if not now_read then
    now_read = now_micros()
  end
  return now_read
end

-- What the batch writes, applied once at the end.
local tat_writes, tat_order = {}, {}
local key_writes, key_order = {}, {}
local held_writes, held_order = {}, {}
local notices = {}

local function add(changed, delta)
  for _, field in ipairs(changed) do
    known[field] = math.max((known[field] or 0) + delta, 0)
  end
end

local function set_tat(key, value, px)
  strings[key] = value
  if not tat_writes[key] then
    tat_order[#tat_order + 1] = key
  end
  tat_writes[key] = {value, px}
end

local function put_tat(key, tat, interval, span)
  set_tat(key, string.format('%.0f %.0f %.0f', tat, interval, span),
    math.floor(math.max(tat - now(), 0) / 1000) + 1)
end

local function set_key(key, value, ttl)
  strings[key] = value
  if key_writes[key] == nil then
    key_order[#key_order + 1] = key
  end
  key_writes[key] = value and {value, ttl} or false
end

local function set_held(owner, id, present)
  if not held_writes[owner] then
    held_writes[owner] = {}
    held_order[#held_order + 1] = owner
  end
  held_writes[owner][id] = present
end

local function decide_admission(d)
  if strings[KEYS[3]] ~= token or strings[KEYS[4]] ~= epoch then
    return {'lease'}
  end
  if strings[KEYS[5]] then
    return {'recovering'}
  end
  local id, client = d.id, d.client
  if records[id] then
    return {'duplicate'}
  end
  local keyed = d.key ~= ''
  if keyed then
    local owner = strings[d.key]
    if owner then
      local owner_id, owner_replica = string.match(owner, '^(%S+) (%S+)$')
      -- The key names this very id only if it was admitted and since released (a lapsed
      -- lease): then it is decided afresh below, as a restored operation would be counted again.
      if owner_id ~= id then
        return {'replay', owner_id, owner_replica}
      end
    end
  end

  local t = now()
  local interval, span = d.interval, d.span
  local tat_key = base .. ':tat:' .. client
  local tat, _, stored_span = parse_tat(strings[tat_key])
  -- A reload changed this client's rate since the TAT was written: rescale the fill level first.
  local rescaled = stored_span ~= nil and stored_span ~= span
  if rescaled then
    tat = rescale(tat, t, stored_span, span)
  end
  local next_tat = math.max(tat, t) + interval
  local rate_wait = math.max(math.max(tat, t) + interval - t - span, 0)

  local a, p = known['a:' .. client], known['p:' .. client]
  local ga, gp, ge = known['active'], known['pending'], known['executing']
  local pending_cap = math.min(d.client_pending, d.grant_client)
  local approval = d.approval

  local code
  if next_tat - t > span then
    code = 'submission_rate_limited'
  elseif a >= d.client_active then
    code = 'client_operation_limit'
  elseif approval and p >= pending_cap then
    if p >= d.client_pending then
      code = 'client_pending_limit'
    else
      code = 'pending_grant_limit'
    end
  elseif approval and gp >= d.grant_global then
    code = 'pending_grant_limit'
  elseif ga >= d.global_active then
    code = 'global_operation_limit'
  elseif ge >= d.global_executing then
    code = 'global_execution_limit'
  end

  if code then
    local capacity = 0
    if code ~= 'submission_rate_limited'
      or a >= d.client_active
      or (approval and (p >= pending_cap or gp >= d.grant_global))
      or ga >= d.global_active
      or ge >= d.global_executing then
      capacity = 1
    end
    if rescaled and tat > t then
      put_tat(tat_key, tat, interval, span)
    end
    return {'refused', code, string.format('%.0f', rate_wait), capacity,
      {string.format('%.0f', tat), string.format('%.0f', t), a, p}}
  end

  put_tat(tat_key, next_tat, interval, span)
  local state = 'a'
  if approval then state = 'p' end
  -- (The replica is in the replica set already: its registration put it there, and a reap that
  -- took it out also ended the lease checked above.)
  add(fields_of(state, client), 1)
  records[id] = state .. ' ' .. replica .. ' ' .. client
  set_held(replica, id, true)
  if keyed then
    set_key(d.key, id .. ' ' .. replica, d.ttl)
  end
  if approval then p = p + 1 end
  return {'admitted', {string.format('%.0f', next_tat), string.format('%.0f', t), a + 1, p}}
end

local function decide_transition(d)
  local id, to = d.id, d.to
  if d.key ~= '' and (to == 't' or to == 'r') then
    -- An admission never committed: its key is free again, whether or not it still holds slots
    -- (a lost reply's release may come after a lapsed lease released them).
    local owner = strings[d.key]
    if owner and string.match(owner, '^(%S+) ') == id then
      set_key(d.key, false)
    end
  end
  local record = records[id]
  if not record then
    return {'absent'}
  end
  local state, owner, client = parse_op(record)
  if to == 't' or to == 'r' then
    -- Release everything it holds, once: its record goes with its counts.
    add(fields_of(state, client), -1)
    records[id] = false
    set_held(owner, id, false)
    if to == 'r' then
      local tat_key = base .. ':tat:' .. client
      local tat, stored_interval, stored_span = parse_tat(strings[tat_key])
      local given, given_span = d.interval, d.span
      local t = now()
      if stored_span ~= nil and tat > t then
        -- The token is measured in the rate the bucket has now (a reload may have rescaled it),
        -- rounded down, as the in-process engine's `Rate::token_in` does.
        if stored_span ~= given_span then
          given = math.floor(given * stored_span / math.max(given_span, 1))
        end
        put_tat(tat_key, math.max(tat - given, 0), stored_interval, stored_span)
      elseif tat > t then
        -- A bare TAT (no rate stored) keeps its lifetime.
        local ttl = redis.call('PTTL', tat_key)
        if ttl > 0 then
          set_tat(tat_key, string.format('%.0f', math.max(tat - given, 0)), ttl)
        end
      end
      notices[#notices + 1] = 'f ' .. client
    else
      notices[#notices + 1] = 'r ' .. client
    end
    return {'moved', state}
  end
  if state == to then
    return {'same'}
  end
  if to == 'a' and state == 'p' then
    add({'pending', 'p:' .. client}, -1)
    notices[#notices + 1] = 'r ' .. client
  elseif to == 'e' and state == 'a' then
    if known['executing'] >= d.limit then
      return {'saturated'}
    end
    add({'executing', 'e:' .. client}, 1)
  else
    return {'not_allowed', state}
  end
  records[id] = to .. ' ' .. owner .. ' ' .. client
  return {'moved', state}
end

local replies = {}
for n, d in ipairs(decisions) do
  if d.admit then
    replies[n] = decide_admission(d)
  else
    replies[n] = decide_transition(d)
  end
end

-- The writes, once each: counts that changed (a count that reaches zero is removed), records,
-- the replicas' sets, buckets, key records, notices.
local set, gone = {}, {}
for _, field in ipairs(fields) do
  local v = known[field]
  if v ~= known_before[field] then
    if v > 0 then
      set[#set + 1] = field
      set[#set + 1] = string.format('%.0f', v)
    else
      gone[#gone + 1] = field
    end
  end
end
if #set > 0 then
  redis.call('HSET', KEYS[1], unpack(set))
end
if #gone > 0 then
  redis.call('HDEL', KEYS[1], unpack(gone))
end

local written, removed = {}, {}
for _, id in ipairs(ids) do
  local now_record, before = records[id], records_before[id]
  if now_record ~= before then
    if now_record then
      written[#written + 1] = id
      written[#written + 1] = now_record
    elseif before then
      removed[#removed + 1] = id
    end
  end
end
if #written > 0 then
  redis.call('HSET', KEYS[2], unpack(written))
end
if #removed > 0 then
  redis.call('HDEL', KEYS[2], unpack(removed))
end

for _, owner in ipairs(held_order) do
  local added, taken = {}, {}
  for id, present in pairs(held_writes[owner]) do
    if present then added[#added + 1] = id else taken[#taken + 1] = id end
  end
  local held_key = base .. ':held:' .. owner
  if #added > 0 then
    redis.call('SADD', held_key, unpack(added))
  end
  if #taken > 0 then
    redis.call('SREM', held_key, unpack(taken))
  end
end

for _, key in ipairs(tat_order) do
  local w = tat_writes[key]
  redis.call('SET', key, w[1], 'PX', w[2])
end

local lasting, freed = {}, {}
for _, key in ipairs(key_order) do
  local w = key_writes[key]
  if not w then
    freed[#freed + 1] = key
  elseif w[2] > 0 then
    redis.call('SET', key, w[1], 'PX', w[2])
  else
    lasting[#lasting + 1] = key
    lasting[#lasting + 1] = w[1]
  end
end
if #lasting > 0 then
  redis.call('MSET', unpack(lasting))
end
if #freed > 0 then
  redis.call('DEL', unpack(freed))
end

if #notices > 0 then
  redis.call('PUBLISH', base .. ':notices', table.concat(notices, '\n'))
end
return replies
