-- Shared by the registration and reap scripts (prepended at build time, after shared.lua). The
-- counts live in one hash, KEYS[1]: `active`, `pending`, `executing` (global), `active_holders`
-- and `executing_holders` (the clients whose `a:` and `e:` counts are above zero: each pool's
-- holders, among whom its fair share is divided), and `a:<client>`, `p:<client>`, `e:<client>`;
-- operations are fields of KEYS[2] (see shared.lua). Counts never fall below zero, and a count
-- that reaches zero is removed, so an idle deployment leaves an empty hash; a change that takes
-- a client's `a:` or `e:` count from or to zero moves its pool's holders with it, in the same
-- write. (The batch script keeps the same rules on its own reads and writes.)

-- The counts `fields` as numbers (an absent one is 0), in one read.
local function counts(fields)
  local read = redis.call('HMGET', KEYS[1], unpack(fields))
  local values = {}
  for i, field in ipairs(fields) do
    values[field] = tonumber(read[i] or '0') or 0
  end
  return values
end

-- The pool holders a client count belongs to (`a:<client>`, `e:<client>`), or nil.
local function holders_of(field)
  local kind = string.sub(field, 1, 2)
  if kind == 'a:' then
    return 'active_holders'
  elseif kind == 'e:' then
    return 'executing_holders'
  end
  return nil
end

-- Adds `delta` to each of `fields` in one read and at most two writes: a count never falls
-- below zero, and one that reaches zero is removed; a client count that leaves or reaches zero
-- moves its pool's holders by one.
local function adjust(fields, delta)
  local read = {'active_holders', 'executing_holders'}
  for _, field in ipairs(fields) do
    read[#read + 1] = field
  end
  local values = counts(read)
  local changed = {}
  for _, field in ipairs(fields) do
    local was = values[field] or 0
    local v = math.max(was + delta, 0)
    local holders = holders_of(field)
    if holders and (was > 0) ~= (v > 0) then
      local moved = 1
      if v == 0 then moved = -1 end
      values[holders] = math.max(values[holders] + moved, 0)
      changed[#changed + 1] = holders
    end
    values[field] = v
    changed[#changed + 1] = field
  end
  local set, gone, seen = {}, {}, {}
  for _, field in ipairs(changed) do
    if not seen[field] then
      seen[field] = true
      local v = values[field]
      if v <= 0 then
        gone[#gone + 1] = field
      else
        set[#set + 1] = field
        set[#set + 1] = string.format('%.0f', v)
      end
    end
  end
  if #set > 0 then
    redis.call('HSET', KEYS[1], unpack(set))
  end
  if #gone > 0 then
    redis.call('HDEL', KEYS[1], unpack(gone))
  end
end

-- The counts an operation in `state` for `client` is part of.
local function fields_of(state, client)
  if state == 'p' then
    return {'active', 'a:' .. client, 'pending', 'p:' .. client}
  elseif state == 'e' then
    return {'active', 'a:' .. client, 'executing', 'e:' .. client}
  end
  return {'active', 'a:' .. client}
end

-- Counts an operation in `state` for `client`, held by `replica` (no limit checked: admission
-- checked them, or it is restored work, which counts even above a limit).
local function hold(id, state, replica, client)
  adjust(fields_of(state, client), 1)
  redis.call('HSET', KEYS[2], id, state .. ' ' .. replica .. ' ' .. client)
end

-- Releases everything operation `id` holds, once: its record is removed with its counts.
local function release(id, record)
  local state, _, client = parse_op(record)
  adjust(fields_of(state, client), -1)
  redis.call('HDEL', KEYS[2], id)
  return client
end

-- The operations each of `replicas` (a set: name -> true) holds, as their records name them:
-- name -> {id, record, id, record, ...}, from one read of the operations hash (which holds only
-- live operations, so it is bounded by the global active limit and restored work).
local function held_by(replicas)
  local by = {}
  local all = redis.call('HGETALL', KEYS[2])
  for n = 1, #all, 2 do
    local _, owner = parse_op(all[n + 1])
    if owner and replicas[owner] then
      local list = by[owner]
      if not list then
        list = {}
        by[owner] = list
      end
      list[#list + 1] = all[n]
      list[#list + 1] = all[n + 1]
    end
  end
  return by
end

local function now_micros()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- `client`'s rate bucket in the deployment `base` (see shared.lua), read and written.
local function read_tat(base, client)
  return parse_tat(redis.call('HGET', base .. ':buckets', client))
end

local function write_tat(base, client, tat, interval, span)
  redis.call('HSET', base .. ':buckets', client, string.format('%d %d %d', tat, interval, span))
end

-- Adds a client's rate debt (µs of its window its admissions used, replayed from a store) to
-- its bucket, never past a whole span from now: a debt only ever empties a bucket.
local function owe(base, now, client, interval, span, debt)
  if debt > 0 then
    local tat = read_tat(base, client)
    local next_tat = math.min(math.max(tat, now) + debt, now + span)
    if next_tat > tat then
      write_tat(base, client, next_tat, interval, span)
    end
  end
end

-- Counts each pool's holders again from the client counts themselves (one read of the counts
-- hash, bounded by the clients): registration does, so a deployment whose counts were written
-- by a build that kept no holders (or restored from an older snapshot) has them exact again.
local function recount_holders()
  local all = redis.call('HGETALL', KEYS[1])
  local found = {active_holders = 0, executing_holders = 0}
  local stored = {}
  for n = 1, #all, 2 do
    local field, v = all[n], tonumber(all[n + 1]) or 0
    local holders = holders_of(field)
    if holders and v > 0 then
      found[holders] = found[holders] + 1
    elseif found[field] then
      stored[field] = v
    end
  end
  for field, n in pairs(found) do
    if n ~= (stored[field] or 0) then
      if n > 0 then
        redis.call('HSET', KEYS[1], field, string.format('%d', n))
      else
        redis.call('HDEL', KEYS[1], field)
      end
    end
  end
end
