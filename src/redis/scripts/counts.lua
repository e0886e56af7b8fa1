-- Shared by every script (prepended at build time). The counts live in one hash, KEYS[1]:
-- `active`, `pending`, `executing` (global) and `a:<client>`, `p:<client>`, `e:<client>`.
-- An operation is a field of the hash KEYS[2]: its id -> "<state> <replica> <client>", with the
-- state `p` (pending), `a` (approved) or `e` (executing). Counts never fall below zero, and a
-- count that reaches zero is removed, so an idle deployment leaves an empty hash.

local function count(field)
  return tonumber(redis.call('HGET', KEYS[1], field) or '0')
end

local function lower(field)
  local v = count(field) - 1
  if v <= 0 then
    redis.call('HDEL', KEYS[1], field)
  else
    redis.call('HSET', KEYS[1], field, string.format('%.0f', v))
  end
end

local function raise(field)
  redis.call('HINCRBY', KEYS[1], field, 1)
end

local function parse_op(record)
  local state, replica, client = string.match(record, '^(%a) (%S+) (%S+)$')
  return state, replica, client
end

-- Counts an operation in `state` for `client` (no limit checked: admission checked them, or it is
-- restored work, which counts even above a limit).
local function hold(id, state, replica, client, base)
  raise('active')
  raise('a:' .. client)
  if state == 'p' then
    raise('pending')
    raise('p:' .. client)
  elseif state == 'e' then
    raise('executing')
    raise('e:' .. client)
  end
  redis.call('HSET', KEYS[2], id, state .. ' ' .. replica .. ' ' .. client)
  redis.call('SADD', base .. ':held:' .. replica, id)
end

-- Releases everything operation `id` holds, once: its record is removed with its counts.
local function release(id, record, base)
  local state, replica, client = parse_op(record)
  if state == 'p' then
    lower('pending')
    lower('p:' .. client)
  elseif state == 'e' then
    lower('executing')
    lower('e:' .. client)
  end
  lower('active')
  lower('a:' .. client)
  redis.call('HDEL', KEYS[2], id)
  redis.call('SREM', base .. ':held:' .. replica, id)
  return client
end

local function now_micros()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- A client's rate bucket: the key holds "<TAT> <interval> <span>" (µs; the rate the TAT was last
-- written under). A bare number (written before the rate was stored) has no known rate, so it is
-- never rescaled. Reply: tat, interval, span (both nil when unknown).
local function read_tat(key)
  local v = redis.call('GET', key)
  if not v then
    return 0, nil, nil
  end
  local tat, interval, span = string.match(v, '^(%d+) (%d+) (%d+)$')
  if tat then
    return tonumber(tat), tonumber(interval), tonumber(span)
  end
  return tonumber(v) or 0, nil, nil
end

local function write_tat(key, tat, interval, span, now)
  redis.call('SET', key, string.format('%.0f %.0f %.0f', tat, interval, span),
    'PX', math.floor(math.max(tat - now, 0) / 1000) + 1)
end

-- The TAT rescaled from a span `old` to `new` at `now`, as the in-process engine's
-- `Bucket::rescale` does: the used part of the span (at most all of it) keeps its fraction,
-- rounded up, so a reload never hands out a fresh burst. Exact while old × new spans stay below
-- 2^53 µs² (windows up to ~95 s); beyond that within a microsecond.
local function rescale(tat, now, old, new)
  local used = math.min(math.max(tat - now, 0), old)
  return now + math.ceil(used * new / math.max(old, 1))
end
