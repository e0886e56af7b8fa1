-- Unbinds idempotency keys from operations that were retired: each key is deleted if it still
-- names its operation (a key bound since to new work is left alone).
-- ARGV: 1 key base, then per record: client, key, operation id.
-- Reply: how many were deleted.
local base = ARGV[1]
local deleted = 0
for i = 2, #ARGV, 3 do
  local name = base .. ':key:' .. ARGV[i] .. ':' .. ARGV[i + 1]
  local owner = redis.call('GET', name)
  if owner and string.match(owner, '^(%S+) ') == ARGV[i + 2] then
    redis.call('DEL', name)
    deleted = deleted + 1
  end
end
return deleted
