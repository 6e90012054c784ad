"""The Lua scripts that change several keys of one hash slot at once (Redis runs each atomically).

Every script touches only keys of one slot: a namespace's (``NamespaceKeys.index_keys()``
in that order, KEYS[1..10] = info hashes ids meta features buckets recency hits log trimmed).
Ids, lengths and byte counts travel as decimal strings; a meta value is the
32-byte token hash followed by ``"length stored raw"``; an exact-tier value is
``"id length"``. Each script reads everything it decides on before it writes, so
a refusal writes nothing.
"""

from __future__ import annotations

# Appends to a namespace's log and keeps it at most ARGV[1] long, noting the last id it trimmed away in
# the "trimmed" key: a daemon whose position is below that missed changes and rebuilds its index from the
# keys (see ``feed``). Call as LOG(log key, trimmed key, fields...).
_LOG = """
local function LOG(log, trimmed, ...)
  redis.call('XADD', log, '*', ...)
  local over = redis.call('XLEN', log) - tonumber(ARGV[1])
  if over > 0 then
    local head = redis.call('XRANGE', log, '-', '+', 'COUNT', over + 1)
    redis.call('SET', trimmed, head[over][1])
    redis.call('XTRIM', log, 'MINID', head[over + 1][1])
  end
end
"""

# What the scripts that set feature vectors share (after _LOG): the namespace's projector version
# (VERSION(): a string, nil when the namespace is gone), and the vectors set, noted with FEATURED(id, length,
# feature) and logged by LOG_FEATURED() as one add (followers replace rows of the same id).
_FEATURES = (
    _LOG
    + """
local function VERSION()
  local info = redis.call('GET', KEYS[1])
  if not info then return nil end
  return tostring(cjson.decode(info)['projector_version'] or 0)
end
local featured_ids, featured_lens, featured = {}, {}, {}
local function FEATURED(id, len, feature)
  table.insert(featured_ids, id); table.insert(featured_lens, len); table.insert(featured, feature)
end
local function LOG_FEATURED()
  if #featured_ids > 0 then
    LOG(KEYS[9], KEYS[10], 'op', 'add', 'ids', table.concat(featured_ids, ','), 'lengths',
        table.concat(featured_lens, ','), 'features', table.concat(featured))
  end
end
"""
)

# ARGV: log cap, projector version to check ("" for none), now, n, then per entry 7 values:
# token_hash, id ("0": not written, only match or feature an existing entry), length, stored, raw,
# feature bytes ("" for none), "1" if the feature may go to an entry already stored under the hash
# (the caller saw that entry has maps: an outputs-only entry never takes a feature).
# Returns {status, per-entry results}: status "ok", "gone" (no such
# namespace) or "version <v>" (the namespace's projector version is v, not the one stated).
# A per-entry result is "a" (added), "d id length" (already stored), "f id length" (already stored,
# given this entry's feature) or "m" (id "0" and no entry has the hash: the caller writes it and retries).
COMMIT = (
    _FEATURES
    + """
local version = VERSION()
if not version then return {'gone'} end
if ARGV[2] ~= '' and ARGV[2] ~= version then return {'version ' .. version} end
local n = tonumber(ARGV[4])
local out = {'ok'}
for i = 1, n do
  local a = 4 + (i - 1) * 7
  local th, id, len = ARGV[a + 1], ARGV[a + 2], ARGV[a + 3]
  local stored, raw, feature, featurable = ARGV[a + 4], ARGV[a + 5], ARGV[a + 6], ARGV[a + 7]
  local found = redis.call('HGET', KEYS[2], th)
  if found then
    local old = string.match(found, '^(%d+) ')
    if feature ~= '' and featurable == '1' and redis.call('HEXISTS', KEYS[5], old) == 0 then
      redis.call('HSET', KEYS[5], old, feature)
      FEATURED(old, string.match(found, ' (%d+)$'), feature)
      out[i + 1] = 'f ' .. found
    else
      out[i + 1] = 'd ' .. found
    end
  elseif id == '0' then
    out[i + 1] = 'm'
  else
    redis.call('HSET', KEYS[2], th, id .. ' ' .. len)
    redis.call('ZADD', KEYS[3], id, id)
    redis.call('HSET', KEYS[4], id, th .. len .. ' ' .. stored .. ' ' .. raw)
    redis.call('HINCRBY', KEYS[6], 'n:' .. len, 1)
    redis.call('HINCRBY', KEYS[6], 'b:' .. len, stored)
    redis.call('HINCRBY', KEYS[6], 'r:' .. len, raw)
    redis.call('ZADD', KEYS[7], ARGV[3], id)
    if feature ~= '' then
      redis.call('HSET', KEYS[5], id, feature)
      FEATURED(id, len, feature)
    end
    out[i + 1] = 'a'
  end
end
LOG_FEATURED()
return out
"""
)

# ARGV: log cap, projector version to check, then pairs id, feature bytes. Returns {status, per-id results}:
# status "ok", "gone" (no such namespace) or "version <v>"; a result is the entry's length, or "" when the id
# is not registered (deleted or evicted). Each registered entry's feature is replaced and the lot logged as an
# add (followers replace rows of the same id).
SET_FEATURES = (
    _FEATURES
    + """
local version = VERSION()
if not version then return {'gone'} end
if ARGV[2] ~= version then return {'version ' .. version} end
local out = {'ok'}
for i = 3, #ARGV, 2 do
  local id, feature = ARGV[i], ARGV[i + 1]
  local meta = redis.call('HGET', KEYS[4], id)
  if meta then
    local len = string.match(string.sub(meta, 33), '^(%d+) ')
    redis.call('HSET', KEYS[5], id, feature)
    FEATURED(id, len, feature)
    table.insert(out, len)
  else
    table.insert(out, '')
  end
end
LOG_FEATURED()
return out
"""
)

# ARGV: log cap, reason ("delete", "evict" or "vanished"), then ids. Returns the ids that were
# registered (and now are not). Evictions and entries found gone count as evicted.
REMOVE = (
    _LOG
    + """
local removed = {}
for i = 3, #ARGV do
  local id = ARGV[i]
  local meta = redis.call('HGET', KEYS[4], id)
  if meta then
    local th = string.sub(meta, 1, 32)
    local len, stored, raw = string.match(string.sub(meta, 33), '^(%d+) (%d+) (%d+)$')
    if redis.call('HGET', KEYS[2], th) == id .. ' ' .. len then redis.call('HDEL', KEYS[2], th) end
    redis.call('ZREM', KEYS[3], id)
    redis.call('HDEL', KEYS[4], id)
    redis.call('HDEL', KEYS[5], id)
    redis.call('HINCRBY', KEYS[6], 'n:' .. len, -1)
    redis.call('HINCRBY', KEYS[6], 'b:' .. len, -tonumber(stored))
    redis.call('HINCRBY', KEYS[6], 'r:' .. len, -tonumber(raw))
    if redis.call('HGET', KEYS[6], 'n:' .. len) == '0' then
      redis.call('HDEL', KEYS[6], 'n:' .. len, 'b:' .. len, 'r:' .. len)
    end
    redis.call('ZREM', KEYS[7], id)
    redis.call('HDEL', KEYS[8], id, id .. ':t')
    if ARGV[2] ~= 'delete' then
      redis.call('HINCRBY', KEYS[6], 'evicted:n', 1)
      redis.call('HINCRBY', KEYS[6], 'evicted:b', stored)
    end
    table.insert(removed, id)
  end
end
if #removed > 0 then
  LOG(KEYS[9], KEYS[10], 'op', 'del', 'ids', table.concat(removed, ','))
end
return removed
"""
)

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

# KEYS: info. ARGV: info JSON. Returns "" when created, else the JSON of the namespace that exists.
CREATE_NAMESPACE = """
local found = redis.call('GET', KEYS[1])
if found then return found end
redis.call('SET', KEYS[1], ARGV[1])
return ''
"""

# KEYS: info projector features log trimmed. ARGV: log cap, the info JSON the caller decided on, the new info
# JSON, the blob, "1" to drop every feature. Compare-and-set: returns 1, 0 when the info changed meanwhile
# (the caller decides again), or -1 when the namespace is gone.
SET_PROJECTOR = (
    _LOG
    + """
local info = redis.call('GET', KEYS[1])
if not info then return -1 end
if info ~= ARGV[2] then return 0 end
redis.call('SET', KEYS[1], ARGV[3])
redis.call('SET', KEYS[2], ARGV[4])
if ARGV[5] == '1' then
  redis.call('DEL', KEYS[3])
  LOG(KEYS[4], KEYS[5], 'op', 'reset')
end
return 1
"""
)

# KEYS: one key. ARGV: the value the caller read, the value to store. Sets it only if it still holds the
# first (a compare-and-set); returns 1 when set, 0 when it changed meanwhile or is gone.
SET_IF_EQUAL = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2])
return 1
"""
