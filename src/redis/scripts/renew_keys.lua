-- Renews the lifetime of idempotency keys whose operations are still live, so that a key outlives
-- an operation that lives longer than the lifetime set at its admission: each key that still
-- names its operation gets the whole lifetime again, from now.
-- ARGV: 1 key base, 2 lifetime (ms, above 0), then per record: client, key, operation id.
-- Reply: how many were renewed.
local base, ttl = ARGV[1], tonumber(ARGV[2])
local renewed = 0
for i = 3, #ARGV, 3 do
  local name = base .. ':key:' .. ARGV[i] .. ':' .. ARGV[i + 1]
  local owner = redis.call('GET', name)
  if owner and string.match(owner, '^(%S+) ') == ARGV[i + 2] then
    redis.call('PEXPIRE', name, ttl)
    renewed = renewed + 1
  end
end
return renewed
