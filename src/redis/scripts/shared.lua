-- Shared by every script that reads operations or buckets (prepended at build time, first).
-- An operation is a field of the hash KEYS[2]: its id -> "<state> <replica> <client>", with the
-- state `p` (pending), `a` (approved) or `e` (executing).

local function parse_op(record)
  local state, replica, client = string.match(record, '^(%a) (%S+) (%S+)$')
  return state, replica, client
end

-- A client's rate bucket: its field of the hash `<base>:buckets` holds "<TAT> <interval> <span>"
-- (µs; the rate the TAT was last written under). A bare number has no known rate, so it is never
-- rescaled. `parse_tat` reads a value already fetched (false for none; `read_tat`, in counts.lua,
-- reads the field). Reply: tat, interval, span (both nil when unknown).
local function parse_tat(v)
  if not v then
    return 0, nil, nil
  end
  local tat, interval, span = string.match(v, '^(%d+) (%d+) (%d+)$')
  if tat then
    return tonumber(tat), tonumber(interval), tonumber(span)
  end
  return tonumber(v) or 0, nil, nil
end

-- The TAT rescaled from a span `old` to `new` at `now`, as the in-process engine's
-- `Bucket::rescale` does: the used part of the span (at most all of it) keeps its fraction,
-- rounded up, so a reload never hands out a fresh burst. Exact while old × new spans stay below
-- 2^53 µs² (windows up to ~95 s); beyond that within a microsecond.
local function rescale(tat, now, old, new)
  local used = math.min(math.max(tat - now, 0), old)
  return now + math.ceil(used * new / math.max(old, 1))
end
