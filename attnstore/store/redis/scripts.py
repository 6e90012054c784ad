"""The Lua scripts that change several keys of one hash slot at once (Redis runs each atomically).

Ids, lengths and byte counts travel as decimal strings; a meta value is the
32-byte token hash followed by ``"length stored raw"``; an exact-tier value is
``"id length"``. Every script touches only keys of one slot: a namespace's
(``NamespaceKeys.index_keys()`` in that order) or the catalog's.
"""

from __future__ import annotations

# KEYS: hashes ids meta buckets recency hits log. ARGV: now, n, then per entry
# token_hash, "id length", id, length, stored, raw, feature bytes ("" for none).
# Returns per entry "" when it was added, else the "id length" of the entry that has its token hash.
# Everything is read before anything is written, so a refused call writes nothing.
COMMIT = """
local n = tonumber(ARGV[2])
local out = {}
for i = 1, n do
  local found = redis.call('HGET', KEYS[1], ARGV[3 + (i - 1) * 7])
  if found then out[i] = found else out[i] = '' end
end
local refs, features = {}, {}
for i = 1, n do
  if out[i] == '' then
    local a = 2 + (i - 1) * 7
    local th, ref, id, len = ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[a + 4]
    redis.call('HSET', KEYS[1], th, ref)
    redis.call('ZADD', KEYS[2], id, id)
    redis.call('HSET', KEYS[3], id, th .. len .. ' ' .. ARGV[a + 5] .. ' ' .. ARGV[a + 6])
    redis.call('HINCRBY', KEYS[4], 'n:' .. len, 1)
    redis.call('HINCRBY', KEYS[4], 'b:' .. len, ARGV[a + 5])
    redis.call('HINCRBY', KEYS[4], 'r:' .. len, ARGV[a + 6])
    redis.call('ZADD', KEYS[5], ARGV[1], id)
    if ARGV[a + 7] ~= '' then
      table.insert(refs, ref)
      table.insert(features, ARGV[a + 7])
    end
  end
end
if #refs > 0 then
  redis.call('XADD', KEYS[7], '*', 'op', 'add', 'refs', table.concat(refs, ','), 'features', table.concat(features))
end
return out
"""

# KEYS: as COMMIT. ARGV: reason ("delete", "evict" or "vanished"), then ids.
# Returns the ids that were registered (and now are not). Evictions and entries found gone count as evicted.
REMOVE = """
local removed = {}
for i = 2, #ARGV do
  local id = ARGV[i]
  local meta = redis.call('HGET', KEYS[3], id)
  if meta then
    local th = string.sub(meta, 1, 32)
    local len, stored, raw = string.match(string.sub(meta, 33), '^(%d+) (%d+) (%d+)$')
    if redis.call('HGET', KEYS[1], th) == id .. ' ' .. len then redis.call('HDEL', KEYS[1], th) end
    redis.call('ZREM', KEYS[2], id)
    redis.call('HDEL', KEYS[3], id)
    redis.call('HINCRBY', KEYS[4], 'n:' .. len, -1)
    redis.call('HINCRBY', KEYS[4], 'b:' .. len, '-' .. stored)
    redis.call('HINCRBY', KEYS[4], 'r:' .. len, '-' .. raw)
    redis.call('ZREM', KEYS[5], id)
    redis.call('HDEL', KEYS[6], id, id .. ':t')
    if ARGV[1] ~= 'delete' then
      redis.call('HINCRBY', KEYS[4], 'evicted:n', 1)
      redis.call('HINCRBY', KEYS[4], 'evicted:b', stored)
    end
    table.insert(removed, id)
  end
end
if #removed > 0 then
  redis.call('XADD', KEYS[7], '*', 'op', 'del', 'ids', table.concat(removed, ','))
end
return removed
"""

# KEYS: ids recency hits. ARGV: triples id, hits, unix time of the last one. Entries gone meanwhile are skipped.
HITS = """
for i = 1, #ARGV, 3 do
  local id = ARGV[i]
  if redis.call('ZSCORE', KEYS[1], id) then
    redis.call('HINCRBY', KEYS[3], id, ARGV[i + 1])
    local last = tonumber(redis.call('HGET', KEYS[3], id .. ':t') or '0')
    if tonumber(ARGV[i + 2]) > last then redis.call('HSET', KEYS[3], id .. ':t', ARGV[i + 2]) end
    redis.call('ZADD', KEYS[2], 'GT', ARGV[i + 2], id)
  end
end
return 0
"""

# KEYS: log trimmed. ARGV: the id to trim below. The watermark only moves forward.
TRIM = """
local function parse(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
local ms, seq = parse(ARGV[1])
local old = redis.call('GET', KEYS[2])
if old then
  local old_ms, old_seq = parse(old)
  if old_ms > ms or (old_ms == ms and old_seq >= seq) then return old end
end
redis.call('XTRIM', KEYS[1], 'MINID', ARGV[1])
redis.call('SET', KEYS[2], ARGV[1])
return ARGV[1]
"""

# KEYS: namespaces catalog. ARGV: name, info JSON, new catalog token.
# Returns "" when created, else the JSON of the namespace that exists.
CREATE_NAMESPACE = """
local found = redis.call('HGET', KEYS[1], ARGV[1])
if found then return found end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('SET', KEYS[2], ARGV[3])
return ''
"""

# KEYS: namespaces projectors catalog. ARGV: name, blob, new catalog token. Returns 1, or 0 for no such namespace.
SET_PROJECTOR = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('SET', KEYS[3], ARGV[3])
return 1
"""

# KEYS: namespaces projectors catalog. ARGV: name, new catalog token. Returns 1, or 0 for no such namespace.
DROP_NAMESPACE = """
if redis.call('HDEL', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('SET', KEYS[3], ARGV[2])
return 1
"""
