-- Moves operation ARGV[2] in the shared counts, naming it by id so a retry never moves it twice.
-- KEYS: 1 counts, 2 operations. ARGV: 1 key base, 2 operation id, 3 target: `a` (approved), `e`
-- (executing), `t` (terminal: release everything) or `r` (refund: release and give the rate
-- token back), 4 global executing limit, 5 the emission interval (µs, for `r`).
-- Reply: {'moved', from} | {'same'} | {'absent'} (released already) | {'not_allowed', from} |
--        {'saturated'} (no execution slot: the operation stays approved).
local base, id, to = ARGV[1], ARGV[2], ARGV[3]
local record = redis.call('HGET', KEYS[2], id)
if not record then
  return {'absent'}
end
local state, replica, client = parse_op(record)
if to == 't' or to == 'r' then
  release(id, record, base)
  if to == 'r' then
    local tat_key = base .. ':tat:' .. client
    local tat = tonumber(redis.call('GET', tat_key) or '0')
    local back = math.max(tat - tonumber(ARGV[5]), 0)
    local ttl = redis.call('PTTL', tat_key)
    if ttl > 0 then
      redis.call('SET', tat_key, string.format('%.0f', back), 'PX', ttl)
    end
  end
  return {'moved', state}
end
if state == to then
  return {'same'}
end
if to == 'a' and state == 'p' then
  lower('pending')
  lower('p:' .. client)
elseif to == 'e' and state == 'a' then
  if count('executing') >= tonumber(ARGV[4]) then
    return {'saturated'}
  end
  raise('executing')
  raise('e:' .. client)
else
  return {'not_allowed', state}
end
redis.call('HSET', KEYS[2], id, to .. ' ' .. replica .. ' ' .. client)
return {'moved', state}
