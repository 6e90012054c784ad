"""Ingest into a Redis store: write new entries' hashes, then register a batch in one script on its namespace's shard.

See ``RedisMapStore``'s two-phase guarantee: the registration script is what
makes entries visible, and it decides (atomically, with the projector version
check) which entries are new, already stored, or given a feature now.
"""

from __future__ import annotations

import time

from attnstore.errors import NamespaceNotFoundError, ProjectorChangedError
from attnstore.store.arrays import NamespaceState
from attnstore.store.redis import admin, scripts
from attnstore.store.redis.connection import RedisConnection, translated
from attnstore.store.redis.keys import StoreKeys, encode_entry
from attnstore.store.redis.urls import RedisSettings
from attnstore.store.validate import PreparedEntry


def _ref_id(text: str) -> int:
    return int(text.split(" ")[0])


def commit(
    connection: RedisConnection, store_keys: StoreKeys, settings: RedisSettings, namespace: str,
    state: NamespaceState, entries: list[PreparedEntry], existing: dict[bytes, int], projector_version: int | None,
    mapped: frozenset[int] = frozenset(),
) -> dict[bytes, tuple[str, int]]:
    """Write the hashes of the entries not in ``existing``, then register all in one script.

    Only an entry in ``existing`` whose stored id is in ``mapped`` (stored with maps) may give
    that entry its feature: an outputs-only entry is never searched (it has nothing to replay).

    Returns token hash -> (status, id): "a" added, "d" already stored, "f" already stored and
    featured now, "m" found by hash earlier but gone at the commit (write it anew).
    """
    keys = store_keys.namespace(namespace)
    new = [e for e in entries if e.token_hash not in existing]
    ids: list[int] = []
    if new:
        with translated(f"allocating entry ids in {namespace!r}"):
            last = int(connection.client.incrby(keys.next_id, len(new)))
        ids = list(range(last - len(new) + 1, last + 1))
    id_of = dict(zip((e.token_hash for e in new), ids, strict=True))
    written = [store_keys.entry(namespace, i) for i in ids]
    now = time.time()
    args: list[bytes | str | int | float] = [
        settings.log_max_events, "" if projector_version is None else projector_version, repr(now),
        len(entries),
    ]
    try:
        with translated(f"writing entries into {namespace!r}"):
            pipe = connection.client.pipeline(transaction=False)
            for entry in entries:
                entry_id = id_of.get(entry.token_hash, 0)
                stored = raw = 0
                if entry_id:
                    record, fields = encode_entry(state, entry, entry_id, now)
                    # One HSET: the record and every stored object appear together; the TTL lets volatile-* policies
                    # evict entries and nothing else.
                    pipe.hset(store_keys.entry(namespace, entry_id), mapping=fields)
                    pipe.expire(store_keys.entry(namespace, entry_id), settings.entry_ttl_seconds)
                    stored = record.nbytes
                    raw = state.layout.map_nbytes(entry.length) if entry.maps is not None else 0
                    if entry.outputs is not None:
                        raw += state.layout.outputs_nbytes(entry.length)
                feature = b"" if entry.feature is None else entry.feature.astype("<f4").tobytes()
                featurable = "1" if existing.get(entry.token_hash) in mapped else "0"
                args += [entry.token_hash, entry_id, entry.length, stored, raw, feature, featurable]
            if written:
                pipe.execute()
        with translated(f"registering entries in {namespace!r}"):
            result = connection.eval(scripts.COMMIT, keys.index_keys(), args)
    except BaseException:
        # Whether a failed script ran is unknown: its hashes stay only if it did (compaction's otherwise).
        unregistered = [k for k in written if not _registered(connection, store_keys, namespace, k)]
        admin.delete_keys_quietly(connection, unregistered)
        raise
    status = bytes(result[0]).decode()
    if status != "ok":
        admin.delete_keys_quietly(connection, written)
        if status == "gone":
            raise NamespaceNotFoundError(f"namespace {namespace!r} was dropped during the ingest")
        raise ProjectorChangedError(
            f"namespace {namespace!r} has projector version {status.split()[1]}; the request's features were"
            f" projected with version {projector_version}: fetch the namespace again (its projector) and re-project"
        )
    outcome: dict[bytes, tuple[str, int]] = {}
    lost = []
    for entry, raw_result in zip(entries, result[1:], strict=True):
        text = bytes(raw_result).decode()
        if text == "a":
            outcome[entry.token_hash] = ("a", id_of[entry.token_hash])
        elif text == "m":
            outcome[entry.token_hash] = ("m", 0)
        else:
            found = _ref_id(text[2:])
            if found == id_of.get(entry.token_hash):
                # Our own registration, seen again: the script ran, the reply was lost, and it was sent again.
                outcome[entry.token_hash] = ("a", found)
            else:
                outcome[entry.token_hash] = (text[0], found)
                if entry.token_hash in id_of:  # another call registered the same tokens first
                    lost.append(store_keys.entry(namespace, id_of[entry.token_hash]))
    admin.delete_keys_quietly(connection, lost)
    return outcome

def _registered(connection: RedisConnection, store_keys: StoreKeys, namespace: str, key: str) -> bool:
    entry_id = store_keys.entry_id_of(namespace, key.encode())
    try:
        with translated("checking a registration"):
            return bool(connection.client.hexists(store_keys.namespace(namespace).meta, str(entry_id)))
    except Exception:
        return True  # unknown: keep the hash (compaction decides later)

