-- Moves operation ARGV[2] in the shared counts, naming it by id so a retry never moves it twice.
-- KEYS: 1 counts, 2 operations. ARGV: 1 key base, 2 operation id, 3 target: `a` (approved), `e`
-- (executing), `t` (terminal: release everything) or `r` (refund: release and give the rate
-- token back), 4 global executing limit, 5 the emission interval and 6 the burst span the token
-- was taken under (µs, for `r`), 7 the idempotency record to free if it still names this
-- operation (empty for none: a committed operation keeps its key).
-- Reply: {'moved', from} | {'same'} | {'absent'} (released already) | {'not_allowed', from} |
--        {'saturated'} (no execution slot: the operation stays approved).
-- A move that lowers a count (a release, a refund, an approval) is published on the
-- deployment's notices channel, `r <client>` or, for a refund, `f <client>`, so every replica's
-- refusal memory forgets what it may have changed.
local base, id, to = ARGV[1], ARGV[2], ARGV[3]
local key_record = ARGV[7]
if key_record ~= nil and key_record ~= '' and (to == 't' or to == 'r') then
  -- An admission never committed: its key is free again, whether or not it still holds slots
  -- (a lost reply's release may come after a lapsed lease released them).
  local owner = redis.call('GET', key_record)
  if owner and string.match(owner, '^(%S+) ') == id then
    redis.call('DEL', key_record)
  end
end
local record = redis.call('HGET', KEYS[2], id)
if not record then
  return {'absent'}
end
local state, replica, client = parse_op(record)
if to == 't' or to == 'r' then
  release(id, record, base)
  if to == 'r' then
    local tat_key = base .. ':tat:' .. client
    local tat, stored_interval, stored_span = read_tat(tat_key)
    local token, token_span = tonumber(ARGV[5]), tonumber(ARGV[6])
    local now = now_micros()
    if stored_span ~= nil and tat > now then
      -- The token is measured in the rate the bucket has now (a reload may have rescaled it),
      -- rounded down, as the in-process engine's `Rate::token_in` does.
      if stored_span ~= token_span then
        token = math.floor(token * stored_span / math.max(token_span, 1))
      end
      write_tat(tat_key, math.max(tat - token, 0), stored_interval, stored_span, now)
    elseif tat > now then
      local ttl = redis.call('PTTL', tat_key)
      if ttl > 0 then
        redis.call('SET', tat_key, string.format('%.0f', math.max(tat - token, 0)), 'PX', ttl)
      end
    end
    redis.call('PUBLISH', base .. ':notices', 'f ' .. client)
  else
    redis.call('PUBLISH', base .. ':notices', 'r ' .. client)
  end
  return {'moved', state}
end
if state == to then
  return {'same'}
end
if to == 'a' and state == 'p' then
  adjust({'pending', 'p:' .. client}, -1)
  redis.call('PUBLISH', base .. ':notices', 'r ' .. client)
elseif to == 'e' and state == 'a' then
  local known = counts({'executing', 'e:' .. client})
  if known['executing'] >= tonumber(ARGV[4]) then
    return {'saturated'}
  end
  adjust({'executing', 'e:' .. client}, 1, known)
else
  return {'not_allowed', state}
end
redis.call('HSET', KEYS[2], id, to .. ' ' .. replica .. ' ' .. client)
return {'moved', state}
