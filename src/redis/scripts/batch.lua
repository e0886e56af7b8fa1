-- A replica's decisions in one call (a group commit): admissions and transitions, decided in
-- the order given, each exactly as it would be decided alone — the same checks, codes and
-- replies, exactly once by operation id — with what they share read once and written once:
-- one TIME, one HMGET of the operations, one MGET of the refusal marker, lease, epoch, recovery
-- marker and key records, one HMGET of the buckets, one HMGET of every count, then one HSET /
-- HDEL of the counts changed and of the operations changed, one HSET of the buckets changed,
-- one PUBLISH of every notice (while a refusal may be remembered; see the end of this header).
-- An operation's record names the replica holding it, which is how registration and reap find
-- a replica's holdings: there is no set per replica to keep beside it. A batch of one is the
-- single decision. Every key lives under the deployment's hash tag (KEYS[1]'s): the keys not in
-- KEYS (the buckets hash, key records) are built from ARGV[1], as all scripts do.
-- The rate buckets are fields of one hash, `<base>:buckets` (client -> "<TAT> <interval>
-- <span>", see shared.lua): one read and one write per batch rather than a key per client (a
-- `SET ... PX` each). A field never expires; a TAT in the past is as good as none, and the hash
-- holds at most one field per client ever admitted.
-- Written for Redis's cost model, where every step is dear (on the reference VM a `redis.call`
-- costs 1–3 µs, a `tonumber` ~0.3 µs, a table ~0.3 µs, a float `string.format` ~1 µs): the
-- limits go once per batch, not once per admission, and are read as numbers once; a bucket
-- whose rate is unchanged is parsed and written with its rate as the text it came as; integers
-- are formatted with `%d` (exact: Lua's `%d` is a 64-bit long here), never `%.0f`; no helper
-- closures, no table per decision, duplicates in the reads allowed rather than deduplicated;
-- a client's executing count is read only when a transition may need it. The counts follow
-- counts.lua's rules (never below zero; a count that reaches zero is removed).
-- KEYS: 1 counts, 2 operations, 3 the replica's lease, 4 the deployment's epoch, 5 the recovery
--       marker.
-- ARGV: 1 key base, 2 replica, 3 lease token, 4 the epoch this replica registered in, then
--       records in order, each one of:
--   limits, 10 fields: `L`, emission interval (µs), burst span (µs), client active limit, client
--     pending limit, per-client grant cap, global grant cap, global active limit, global
--     executing limit, and how long past its rate wait the sending replica may remember a
--     refusal (ms; 0: it remembers none): what every admission after it is decided on, until
--     the next `L` (an admission before any `L` is an error, and the batch does nothing);
--   a fair share, 5 fields: `F`, the active pool's reserve and floor, the executing pool's
--     reserve and floor (a floor of 0: that pool is first come, first served): what every
--     admission and start after it is decided on, until the next `F` (before any, none);
--   an admission, 6 fields: `A`, operation id, client, needs approval (0/1), the idempotency
--     record's key (empty for none), its lifetime (ms; 0 for none: it lives until its operation
--     is retired);
--   a transition, 4 to 6 fields: `T`, operation id, target (`a` approved, `e` executing, `t`
--     terminal: release everything, `r` refund: release and give the rate token back), the
--     idempotency record to free if it still names this operation (empty for none: a committed
--     operation keeps its key); then for `e` the global executing limit, for `r` the emission
--     interval and burst span the token was taken under (µs).
--   The decisions are the admissions and transitions; an `L` is not one.
-- Reply: one flat array, each decision's reply in order: its word, then that reply's fields
-- (one table for the whole batch: Redis converts every table of a reply at a cost).
--   An admission: `admitted, reading` | `duplicate` (this id was admitted before: a retry) |
--     `replay, id, replica` | `lease` (this replica does not hold its lease, or not in the
--     deployment's epoch) | `recovering` (Redis forgot the deployment and the replicas are
--     registering again) | `refused, code, rate wait µs, capacity exhausted 0/1, reading` |
--     `refused_fair, code, reason, rate wait µs, 1, reading` (a global pool's fair share refused
--     where first come, first served would admit: the pool's code, and `reserve` or `share`),
--     where reading is `TAT µs, now µs, client active, client pending`: the client's bucket and
--     counts just after the decision, for the client's quota as the deployment sees it. Numbers
--     in a reply are Lua numbers (Redis answers them as integers: exact below 2^53, and a TAT
--     in µs is ~2^51), not formatted strings.
--   A transition: `moved, from` | `same` | `absent` (released already) | `not_allowed, from` |
--     `saturated` (no execution slot, or none for this client by the fair share: the operation
--     stays approved) | `recounting` (a start
--     while the recovery marker stands: Redis forgot the deployment, and until every replica
--     has registered again the executing count is not the deployment's, so no slot is taken;
--     the operation stays approved).
-- A move that lowers a count (a release, a refund, an approval) is published on the
-- deployment's notices channel, `r <client>` or, for a refund, `f <client>`, one a line, so
-- every replica's refusal memory forgets what it may have changed — but only while some replica
-- may remember a refusal: a refusal that may be remembered keeps the marker `<base>:refused`
-- (its value the Redis time, µs, until which it must last; never shortened) alive past the
-- longest the refusal can be remembered, in the same call, so every move after it sees the
-- marker and publishes. With no marker no replica remembers anything a notice could end, and
-- the notice is not sent.
local base, replica, token, epoch = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local tonumber, format, match = tonumber, string.format, string.match
local max, min, floor = math.max, math.min, math.floor

-- Where each decision starts in ARGV, the limits each admission is decided on ({interval, span,
-- client active, client pending, grant client, grant global, global active, global executing,
-- the rate as a bucket stores it, how long past its wait a refusal may be remembered (ms)}), the
-- ids transitions name, and what the batch must read.
local at, ids, limits, shares, moved = {}, {}, {}, {}, {}
local admits, refunds, starts = 0, 0, 0
-- The fair share in force ({active reserve, active floor, executing reserve, executing floor}, or
-- nil: first come, first served), and whether any admission is decided on an executing floor
-- (then the admitting clients' executing counts are read).
local current, share
local executing_shared = false
local i, last = 5, #ARGV
while i <= last do
  local kind = ARGV[i]
  if kind == 'F' then
    share = {tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3]),
      tonumber(ARGV[i + 4])}
    if share[2] == 0 and share[4] == 0 then share = nil end
    i = i + 5
  elseif kind == 'L' then
    current = {
      tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3]), tonumber(ARGV[i + 4]),
      tonumber(ARGV[i + 5]), tonumber(ARGV[i + 6]), tonumber(ARGV[i + 7]), tonumber(ARGV[i + 8]),
      ARGV[i + 1] .. ' ' .. ARGV[i + 2], tonumber(ARGV[i + 9]),
    }
    i = i + 10
  else
    local n = #at + 1
    at[n], ids[n] = i, ARGV[i + 1]
    if kind == 'A' then
      if not current then
        return redis.error_reply('batch: an admission before any limits, at ARGV[' .. i .. ']')
      end
      limits[n], shares[n] = current, share
      if share and share[4] > 0 then executing_shared = true end
      admits = admits + 1
      i = i + 6
    elseif kind == 'T' then
      moved[ARGV[i + 1]] = true
      local to = ARGV[i + 2]
      if to == 'e' then
        shares[n] = share
        starts = starts + 1
        i = i + 5
      elseif to == 'r' then
        refunds = refunds + 1
        i = i + 6
      else
        i = i + 4
      end
    else
      return redis.error_reply('batch: unknown record kind at ARGV[' .. i .. ']')
    end
  end
end
if i ~= last + 1 then
  return redis.error_reply('batch: the last record is cut short')
end
if #at == 0 then
  return redis.error_reply('batch: no decision')
end

-- The operations' records (id -> record, or false), read once; `before[n]` as read for ids[n].
local records = {}
local before = redis.call('HMGET', KEYS[2], unpack(ids))
for n = 1, #ids do
  records[ids[n]] = before[n]
end

-- The clients the batch touches: the admissions', and those of the operations it moves; a
-- client maps to whether its executing count is read: a transition may move it (it is the
-- client of an operation a transition names, read or admitted in this batch), or an admission's
-- fair share of the executing pool judges it.
local clients, client_list = {}, {}
for n = 1, #at do
  local j = at[n]
  local client, moves
  if ARGV[j] == 'A' then
    client, moves = ARGV[j + 2], moved[ARGV[j + 1]] == true or executing_shared
  elseif records[ARGV[j + 1]] then
    client, moves = match(records[ARGV[j + 1]], '^%a %S+ (%S+)$'), true
  end
  if client then
    local seen = clients[client]
    if seen == nil then
      client_list[#client_list + 1] = client
      clients[client] = moves
    elseif moves then
      clients[client] = true
    end
  end
end

-- Every string key the batch reads, in one call: the refusal marker, the lease, epoch and
-- recovery marker (for admissions; the recovery marker for starts too) and the key records
-- named; and, in one read of the buckets hash, the buckets of the admitting (and, with a
-- refund, every touched) client.
local marker = base .. ':refused'
local names, strings = {marker}, {}
local bucket_names, buckets = {}, {}
if admits > 0 then
  names[2], names[3], names[4] = KEYS[3], KEYS[4], KEYS[5]
elseif starts > 0 then
  names[2] = KEYS[5]
end
if refunds > 0 then
  for n = 1, #client_list do
    bucket_names[n] = client_list[n]
  end
end
for n = 1, #at do
  local j = at[n]
  if ARGV[j] == 'A' then
    if refunds == 0 then bucket_names[#bucket_names + 1] = ARGV[j + 2] end
    if ARGV[j + 4] ~= '' then names[#names + 1] = ARGV[j + 4] end
  elseif ARGV[j + 3] ~= '' then
    names[#names + 1] = ARGV[j + 3]
  end
end
local values = redis.call('MGET', unpack(names))
for n = 1, #names do
  strings[names[n]] = values[n]
end
local buckets_key = base .. ':buckets'
if #bucket_names > 0 then
  local read = redis.call('HMGET', buckets_key, unpack(bucket_names))
  for n = 1, #bucket_names do
    buckets[bucket_names[n]] = read[n]
  end
end
-- (Tables are made only when a decision needs them: each one costs Redis time.)
local bucket_list, bucket_value
local key_names, key_value, key_ttl
if admits > 0 or refunds > 0 then
  bucket_list, bucket_value = {}, {}
end

-- Every count the batch touches, in one call: `was` as read, `cur` as the decisions change it,
-- both by position: the global active, pending and executing counts and the two pools' holders
-- first, then each client's active and pending from `slot[client]` on, and its executing count
-- at `eslot[client]` if it is read (none else: a move of an unread count is an error, never
-- another's).
local fields, slot, eslot = {'active', 'pending', 'executing', 'active_holders',
  'executing_holders'}, {}, {}
for n = 1, #client_list do
  local c = client_list[n]
  local k = #fields + 1
  slot[c] = k
  fields[k], fields[k + 1] = 'a:' .. c, 'p:' .. c
  if clients[c] then
    fields[k + 2] = 'e:' .. c
    eslot[c] = k + 2
  end
end
local was = redis.call('HMGET', KEYS[1], unpack(fields))
local cur = {}
for n = 1, #fields do
  local v = was[n]
  if v then v = tonumber(v) or 0 else v = 0 end
  was[n], cur[n] = v, v
end

-- Redis time, read once, and only if a decision needs it.
local now
if admits > 0 or refunds > 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- What the batch writes, applied once at the end: buckets (value, lifetime), key records
-- (value or false, lifetime), notices.
local notices = {}
-- The replies, flat: each decision's word, then its fields (see the header); `o` the last.
local out, o = {}, 0
-- Until when (Redis time, µs) a refusal this batch gave may be remembered, if any may be.
local refused_until

for n = 1, #at do
  local j = at[n]
  local id = ARGV[j + 1]
  if ARGV[j] == 'A' then
    -- An admission.
    local client, approval = ARGV[j + 2], ARGV[j + 3] == '1'
    local key = ARGV[j + 4]
    repeat
      if strings[KEYS[3]] ~= token or strings[KEYS[4]] ~= epoch then
        o = o + 1
        out[o] = 'lease'
        break
      end
      if strings[KEYS[5]] then
        o = o + 1
        out[o] = 'recovering'
        break
      end
      if records[id] then
        o = o + 1
        out[o] = 'duplicate'
        break
      end
      if key ~= '' and strings[key] then
        local owner_id, owner_replica = match(strings[key], '^(%S+) (%S+)$')
        -- The key names this very id only if it was admitted and since released (a lapsed
        -- lease): then it is decided afresh below, as a restored operation would be counted
        -- again.
        if owner_id ~= id then
          out[o + 1], out[o + 2], out[o + 3] = 'replay', owner_id, owner_replica
          o = o + 3
          break
        end
      end
      local lim = limits[n]
      local interval, span = lim[1], lim[2]
      -- The bucket: "<TAT> <interval> <span>". Stored in the rate it is decided on now (the
      -- usual case), only its TAT is a number to read; otherwise shared.lua's parse, and a
      -- reload changed this client's rate since the TAT was written: rescale it first.
      local tat, rescaled = 0, false
      local stored = buckets[client]
      if stored then
        local tat_text, rate = match(stored, '^(%d+) (.+)$')
        if rate == lim[9] then
          tat = tonumber(tat_text)
        else
          local parsed, _, stored_span = parse_tat(stored)
          tat = parsed
          rescaled = stored_span ~= nil and stored_span ~= span
          if rescaled then
            tat = rescale(tat, now, stored_span, span)
          end
        end
      end
      local start = max(tat, now)
      local next_tat = start + interval
      local rate_wait = max(start + interval - now - span, 0)
      local k = slot[client]
      local a, p = cur[k], cur[k + 1]
      local ga, gp, ge = cur[1], cur[2], cur[3]
      local client_active, client_pending = lim[3], lim[4]
      local grant_global, global_active, global_executing = lim[6], lim[7], lim[8]
      local pending_cap = min(client_pending, lim[5])
      local fair = shares[n]

      local code, reason
      if next_tat - now > span then
        code = 'submission_rate_limited'
      elseif a >= client_active then
        code = 'client_operation_limit'
      elseif approval and p >= pending_cap then
        if p >= client_pending then
          code = 'client_pending_limit'
        else
          code = 'pending_grant_limit'
        end
      elseif approval and gp >= grant_global then
        code = 'pending_grant_limit'
      elseif ga >= global_active then
        code = 'global_operation_limit'
      elseif fair and fair[2] > 0 and a >= fair[2]
        and (ga >= global_active - fair[1] or a * cur[4] >= global_active - fair[1]) then
        -- The active pool's fair share (a ≥ floor ≥ 1: the client is among the holders).
        code = 'global_operation_limit'
        if ga >= global_active - fair[1] then reason = 'reserve' else reason = 'share' end
      elseif ge >= global_executing then
        code = 'global_execution_limit'
      elseif fair and fair[4] > 0 and cur[eslot[client]] >= fair[4]
        and (ge >= global_executing - fair[3]
          or cur[eslot[client]] * cur[5] >= global_executing - fair[3]) then
        -- The executing pool is saturated for this client: it could not start now.
        code = 'global_execution_limit'
        if ge >= global_executing - fair[3] then reason = 'reserve' else reason = 'share' end
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
          local v = format('%d ', tat) .. lim[9]
          buckets[client] = v
          if not bucket_value[client] then bucket_list[#bucket_list + 1] = client end
          bucket_value[client] = v
        end
        if lim[10] > 0 then
          local until_ = now + rate_wait + lim[10] * 1000
          if not refused_until or until_ > refused_until then refused_until = until_ end
        end
        if reason then
          out[o + 1], out[o + 2], out[o + 3] = 'refused_fair', code, reason
          o = o + 1
        else
          out[o + 1], out[o + 2] = 'refused', code
        end
        out[o + 3], out[o + 4] = rate_wait, capacity
        out[o + 5], out[o + 6], out[o + 7], out[o + 8] = tat, now, a, p
        o = o + 8
        break
      end

      local v = format('%d ', next_tat) .. lim[9]
      buckets[client] = v
      if not bucket_value[client] then bucket_list[#bucket_list + 1] = client end
      bucket_value[client] = v
      -- (The replica is in the replica set already: its registration put it there, and a reap
      -- that took it out also ended the lease checked above.)
      local state = 'a'
      cur[1], cur[k] = ga + 1, a + 1
      if a == 0 then cur[4] = cur[4] + 1 end
      if approval then
        state = 'p'
        p = p + 1
        cur[2], cur[k + 1] = gp + 1, p
      end
      records[id] = state .. ' ' .. replica .. ' ' .. client
      if key ~= '' then
        local owner = id .. ' ' .. replica
        strings[key] = owner
        if not key_names then key_names, key_value, key_ttl = {}, {}, {} end
        if key_value[key] == nil then key_names[#key_names + 1] = key end
        key_value[key] = owner
        key_ttl[key] = tonumber(ARGV[j + 5])
      end
      out[o + 1], out[o + 2], out[o + 3] = 'admitted', next_tat, now
      out[o + 4], out[o + 5] = a + 1, p
      o = o + 5
    until true
  else
    -- A transition.
    local to, key = ARGV[j + 2], ARGV[j + 3]
    repeat
      if key ~= '' and (to == 't' or to == 'r') then
        -- An admission never committed: its key is free again, whether or not it still holds
        -- slots (a lost reply's release may come after a lapsed lease released them).
        local owner = strings[key]
        if owner and match(owner, '^(%S+) ') == id then
          strings[key] = false
          if not key_names then key_names, key_value, key_ttl = {}, {}, {} end
          if key_value[key] == nil then key_names[#key_names + 1] = key end
          key_value[key] = false
        end
      end
      local record = records[id]
      if not record then
        o = o + 1
        out[o] = 'absent'
        break
      end
      local state, owner, client = parse_op(record)
      if to == 't' or to == 'r' then
        -- Release everything it holds, once: its record goes with its counts.
        local k = slot[client]
        if cur[k] == 1 then cur[4] = max(cur[4] - 1, 0) end
        cur[1], cur[k] = max(cur[1] - 1, 0), max(cur[k] - 1, 0)
        if state == 'p' then
          cur[2], cur[k + 1] = max(cur[2] - 1, 0), max(cur[k + 1] - 1, 0)
        elseif state == 'e' then
          local e = eslot[client]
          if cur[e] == 1 then cur[5] = max(cur[5] - 1, 0) end
          cur[3], cur[e] = max(cur[3] - 1, 0), max(cur[e] - 1, 0)
        end
        records[id] = false
        if to == 'r' then
          local tat, stored_interval, stored_span = parse_tat(buckets[client])
          local given, given_span = tonumber(ARGV[j + 4]), tonumber(ARGV[j + 5])
          if tat > now then
            -- The token is measured in the rate the bucket has now (a reload may have rescaled
            -- it), rounded down, as the in-process engine's `Rate::token_in` does. (A bare TAT,
            -- with no rate stored, gives back the token as given.)
            local v
            if stored_span ~= nil then
              if stored_span ~= given_span then
                given = floor(given * stored_span / max(given_span, 1))
              end
              v = format('%d %d %d', max(tat - given, 0), stored_interval, stored_span)
            else
              v = format('%d', max(tat - given, 0))
            end
            buckets[client] = v
            if not bucket_value[client] then bucket_list[#bucket_list + 1] = client end
            bucket_value[client] = v
          end
          notices[#notices + 1] = 'f ' .. client
        else
          notices[#notices + 1] = 'r ' .. client
        end
        out[o + 1], out[o + 2] = 'moved', state
        o = o + 2
        break
      end
      if state == to then
        o = o + 1
        out[o] = 'same'
        break
      end
      if to == 'a' and state == 'p' then
        local k = slot[client]
        cur[2], cur[k + 1] = max(cur[2] - 1, 0), max(cur[k + 1] - 1, 0)
        notices[#notices + 1] = 'r ' .. client
      elseif to == 'e' and state == 'a' then
        if strings[KEYS[5]] then
          o = o + 1
          out[o] = 'recounting'
          break
        end
        local limit, e, fair = tonumber(ARGV[j + 4]), eslot[client], shares[n]
        local held = cur[e]
        if cur[3] >= limit or (fair and fair[4] > 0 and held >= fair[4]
          and (cur[3] >= limit - fair[3] or held * cur[5] >= limit - fair[3])) then
          o = o + 1
          out[o] = 'saturated'
          break
        end
        if held == 0 then cur[5] = cur[5] + 1 end
        cur[3], cur[e] = cur[3] + 1, held + 1
      else
        out[o + 1], out[o + 2] = 'not_allowed', state
        o = o + 2
        break
      end
      records[id] = to .. ' ' .. owner .. ' ' .. client
      out[o + 1], out[o + 2] = 'moved', state
      o = o + 2
    until true
  end
end

-- The writes, once each: the counts that changed (one that reaches zero is removed), the
-- records, buckets, key records, notices.
local set, gone
for n = 1, #fields do
  local v = cur[n]
  if v ~= was[n] then
    if v > 0 then
      set = set or {}
      set[#set + 1] = fields[n]
      set[#set + 1] = v
    else
      gone = gone or {}
      gone[#gone + 1] = fields[n]
    end
  end
end
if set then
  redis.call('HSET', KEYS[1], unpack(set))
end
if gone then
  redis.call('HDEL', KEYS[1], unpack(gone))
end

-- (An id named twice is written twice, to the same value: harmless.)
local written, removed
for n = 1, #ids do
  local id = ids[n]
  local record = records[id]
  if record ~= before[n] then
    if record then
      written = written or {}
      written[#written + 1] = id
      written[#written + 1] = record
    elseif before[n] then
      removed = removed or {}
      removed[#removed + 1] = id
    end
  end
end
if written then
  redis.call('HSET', KEYS[2], unpack(written))
end
if removed then
  redis.call('HDEL', KEYS[2], unpack(removed))
end

if bucket_list and #bucket_list > 0 then
  local set_buckets = {}
  for n = 1, #bucket_list do
    local client = bucket_list[n]
    set_buckets[2 * n - 1], set_buckets[2 * n] = client, bucket_value[client]
  end
  redis.call('HSET', buckets_key, unpack(set_buckets))
end

if key_names and #key_names > 0 then
  local lasting, freed
  for n = 1, #key_names do
    local key = key_names[n]
    local v = key_value[key]
    if not v then
      freed = freed or {}
      freed[#freed + 1] = key
    elseif key_ttl[key] > 0 then
      redis.call('SET', key, v, 'PX', key_ttl[key])
    else
      lasting = lasting or {}
      lasting[#lasting + 1] = key
      lasting[#lasting + 1] = v
    end
  end
  if lasting then
    redis.call('MSET', unpack(lasting))
  end
  if freed then
    redis.call('DEL', unpack(freed))
  end
end

if refused_until then
  local stored = strings[marker] and tonumber(strings[marker])
  if not stored or refused_until > stored then
    redis.call('SET', marker, format('%d', refused_until), 'PX',
      floor((refused_until - now) / 1000) + 1)
  end
end
if #notices > 0 and (strings[marker] or refused_until) then
  redis.call('PUBLISH', base .. ':notices', table.concat(notices, '\n'))
end
return out
