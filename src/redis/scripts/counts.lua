-- Shared by the registration and reap scripts (prepended at build time, after shared.lua). The
-- counts live in one hash, KEYS[1]: `active`, `pending`, `executing` (global) and `a:<client>`,
-- `p:<client>`, `e:<client>`; operations are fields of KEYS[2] (see shared.lua). Counts never
-- fall below zero, and a count that reaches zero is removed, so an idle deployment leaves an
-- empty hash. (The batch script keeps the same rules on its own reads and writes.)

-- The counts `fields` as numbers (an absent one is 0), in one read.
local function counts(fields)
  local read = redis.call('HMGET', KEYS[1], unpack(fields))
  local values = {}
  for i, field in ipairs(fields) do
    values[field] = tonumber(read[i] or '0') or 0
  end
  return values
end

-- Adds `delta` to each of `fields` in one read (skipped when `known` has them already) and at
-- most two writes: a count never falls below zero, and one that reaches zero is removed.
local function adjust(fields, delta, known)
  local values = known or counts(fields)
  local set, gone = {}, {}
  for _, field in ipairs(fields) do
    local v = (values[field] or 0) + delta
    if v <= 0 then
      gone[#gone + 1] = field
    else
      set[#set + 1] = field
      set[#set + 1] = string.format('%.0f', v)
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
-- checked them, or it is restored work, which counts even above a limit). `known`: the counts
-- already read, if any.
local function hold(id, state, replica, client, known)
  adjust(fields_of(state, client), 1, known)
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
