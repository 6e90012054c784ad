"""Admission counts kept in Redis, so every daemon of a fleet judges a WriteBack on the fleet's asks.

The same counts as ``attnstore.store.admission.MemoryCounts`` (read its docstring),
one set per namespace on the namespace's own slot::

    {P/ns}:adm:cur, {P/ns}:adm:prev      counters: depth x width uint16 (BITFIELD), this window and the last
    {P/ns}:adm:seen, {P/ns}:adm:seenprev  filter bits of counted (row, caller) pairs, likewise
    {P/ns}:adm:asks                       asks counted in the current window
    {P/ns}:adm:salt                       the hashes' random key, written by the first daemon to count

One script per Lookup counts its missed rows and turns the window (RENAME, no
copy) when it is full, atomically for every daemon. None of these keys carries a
TTL: a volatile-* maxmemory policy never evicts them, and their size is fixed
(``SketchShape.nbytes`` per namespace that was asked about).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from attnstore.store.admission import COUNTER_MAX, SEEN_HASHES, AdmissionCounts, SketchShape, hashed, new_salt
from attnstore.store.redis.connection import RedisConnection, translated
from attnstore.store.redis.keys import StoreKeys

# KEYS: cur prev seen seenprev asks. ARGV: window, depth, bits per pair, count ("1") or only read ("0"),
# then per row its bits and its counter slots. Returns 1 if this call turned the window (else 0), then each
# row's count (this window's plus the last's).
_COUNT = """
local window, depth, k, counting = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4] == '1'
local per = k + depth
local rows = (#ARGV - 4) / per
local turned = 0
if counting and tonumber(redis.call('GET', KEYS[5]) or '0') >= window then
  for _, pair in ipairs({{1, 2}, {3, 4}}) do
    if redis.call('EXISTS', KEYS[pair[1]]) == 1 then
      redis.call('RENAME', KEYS[pair[1]], KEYS[pair[2]])
    else
      redis.call('DEL', KEYS[pair[2]])
    end
  end
  redis.call('SET', KEYS[5], 0)
  turned = 1
end
local out = {turned}
for i = 0, rows - 1 do
  local a = 4 + i * per
  local seen_now, seen_before = true, true
  for j = 1, k do
    if redis.call('GETBIT', KEYS[3], ARGV[a + j]) == 0 then seen_now = false end
    if redis.call('GETBIT', KEYS[4], ARGV[a + j]) == 0 then seen_before = false end
  end
  local now, before = math.huge, math.huge
  local current = {}
  for d = 1, depth do
    local slot = '#' .. ARGV[a + k + d]
    current[d] = redis.call('BITFIELD', KEYS[1], 'GET', 'u16', slot)[1]
    now = math.min(now, current[d])
    before = math.min(before, redis.call('BITFIELD', KEYS[2], 'GET', 'u16', slot)[1])
  end
  if counting and not seen_now and not seen_before then
    -- Conservative update: raise only the counters at the minimum, so collisions inflate less.
    for j = 1, k do redis.call('SETBIT', KEYS[3], ARGV[a + j], 1) end
    now = math.min(now + 1, COUNTER_MAX)
    for d = 1, depth do
      if current[d] < now then
        redis.call('BITFIELD', KEYS[1], 'SET', 'u16', '#' .. ARGV[a + k + d], now)
      end
    end
  end
  out[i + 2] = now + before
end
if counting then redis.call('INCRBY', KEYS[5], rows) end
return out
""".replace("COUNTER_MAX", str(COUNTER_MAX))


class RedisCounts(AdmissionCounts):
    """See the module docstring; one per open RedisMapStore.

    Args:
        connection: the store's client.
        keys: the store's key names.
        shape: the counts' sizes (the same on every daemon of the fleet: a daemon with another shape
            would read other counters).
    """

    def __init__(self, connection: RedisConnection, keys: StoreKeys, shape: SketchShape) -> None:
        super().__init__(shape)
        self._redis = connection
        self._keys = keys
        self._salts: dict[str, bytes] = {}  # namespace -> its hashes' key, read once
        self._lock = threading.Lock()
        self._windows = 0

    def observe(self, namespace: str, token_hashes: Sequence[bytes], caller: str) -> list[int]:
        """See :meth:`AdmissionCounts.observe`."""
        return self._run(namespace, token_hashes, caller, counting=True)

    def counts(self, namespace: str, token_hashes: Sequence[bytes]) -> list[int]:
        """See :meth:`AdmissionCounts.counts`."""
        return self._run(namespace, token_hashes, "", counting=False)

    @property
    def windows(self) -> int:
        """See :meth:`AdmissionCounts.windows`: windows turned by this daemon's asks."""
        with self._lock:
            return self._windows

    def forget(self) -> None:
        """Drop the salts read (the store was reset: its namespaces were made anew)."""
        with self._lock:
            self._salts.clear()

    def _run(self, namespace: str, token_hashes: Sequence[bytes], caller: str, *, counting: bool) -> list[int]:
        if not token_hashes:
            return []
        salt = self._salt(namespace)
        args: list[bytes | str | int | float] = [self.shape.window, self.shape.depth, SEEN_HASHES,
                                                 "1" if counting else "0"]
        for key in token_hashes:
            ask = hashed(self.shape, salt, namespace, key, caller)
            args += list(ask.bits)
            args += [d * self.shape.width + s for d, s in enumerate(ask.slots)]
        names = self._keys.namespace(namespace).admission_keys()[:5]  # cur prev seen seenprev asks
        with translated(f"counting admission asks in {namespace!r}"):
            turned, *found = [int(n) for n in self._redis.eval(_COUNT, names, args)]
        if turned:
            with self._lock:
                self._windows += 1
        return found

    def _salt(self, namespace: str) -> bytes:
        with self._lock:
            salt = self._salts.get(namespace)
        if salt is not None:
            return salt
        key = self._keys.namespace(namespace).admission_keys()[5]
        with translated(f"reading the admission key of {namespace!r}"):
            self._redis.client.set(key, new_salt(), nx=True)  # the first daemon's wins; every daemon reads it
            salt = bytes(self._redis.client.get(key) or b"")
        with self._lock:
            self._salts[namespace] = salt
        return salt
