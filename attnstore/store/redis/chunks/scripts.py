"""The Lua scripts of chunk entries; each touches one namespace's slot and runs atomically.

KEYS[1..4] are ``NamespaceKeys.chunk_keys()`` (layout, records, recency, byte
count), then one chunk hash per chunk the script names. A script that refuses
refuses before it writes; a client killed mid-call has sent the whole script or
none of it, so a put is visible whole or not at all.
"""

from __future__ import annotations

# ARGV: the layout JSON the caller checked, now, layer count, then per chunk: its key (32 bytes), record,
# bytes, then one value per layer (KEYS[4 + i] is chunk i's hash). Returns {"ok", added} or {"layout"}
# (the namespace's layout is not the one checked: dropped, or made again, meanwhile).
PUT = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return {'layout'} end
local layers = tonumber(ARGV[3])
local added = 0
local a = 3
for i = 5, #KEYS do
  local key, record, nbytes = ARGV[a + 1], ARGV[a + 2], ARGV[a + 3]
  if redis.call('HEXISTS', KEYS[2], key) == 0 then
    redis.call('DEL', KEYS[i])
    for layer = 0, layers - 1 do
      redis.call('HSET', KEYS[i], tostring(layer), ARGV[a + 4 + layer])
    end
    redis.call('HSET', KEYS[2], key, record)
    redis.call('ZADD', KEYS[3], ARGV[2], key)
    redis.call('INCRBY', KEYS[4], nbytes)
    added = added + 1
  end
  a = a + 3 + layers
end
return {'ok', added}
"""

# ARGV: the chunk keys (32 bytes each; KEYS[4 + i] is chunk i's hash). Deletes those stored; returns how many.
DELETE = """
local deleted = 0
for i = 5, #KEYS do
  if redis.call('HDEL', KEYS[2], ARGV[i - 4]) == 1 then
    local nbytes = 0
    for _, field in ipairs(redis.call('HKEYS', KEYS[i])) do
      nbytes = nbytes + redis.call('HSTRLEN', KEYS[i], field)
    end
    redis.call('DEL', KEYS[i])
    redis.call('ZREM', KEYS[3], ARGV[i - 4])
    redis.call('DECRBY', KEYS[4], nbytes)
    deleted = deleted + 1
  end
end
return deleted
"""

# ARGV: the chunk hash key prefix ("{P/ns}:c:"). Deletes the namespace's layout and every chunk; returns how many.
DROP = """
local keys = redis.call('HKEYS', KEYS[2])
for _, key in ipairs(keys) do
  local hex = string.gsub(key, '.', function(c) return string.format('%02x', string.byte(c)) end)
  redis.call('DEL', ARGV[1] .. hex)
end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4])
return #keys
"""

# ARGV: the chunk's key, now ("" for a read-only store: no recency written), then the layers to read.
# Returns {record, layer values...} ({} when not stored); a read counts as a use for the byte cap.
READ = """
local record = redis.call('HGET', KEYS[2], ARGV[1])
if not record then return {} end
if ARGV[2] ~= '' then redis.call('ZADD', KEYS[3], 'XX', ARGV[2], ARGV[1]) end
local out = {record}
for i = 3, #ARGV do
  out[#out + 1] = redis.call('HGET', KEYS[5], ARGV[i]) or false
end
return out
"""
