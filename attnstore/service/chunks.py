"""The service's chunk part, the daemon's side of the chunk tier: which chunks a namespace stores,
their keys and values, and chunks put.

A chunk is the keys (before RoPE) and values of every layer of a text chunk
computed on its own after the namespace's instruction, stored under its
``chunk_key`` (32 bytes, see ``attnstore.protocol.keys``). A namespace records
one ``ChunkLayout`` (layers, KV heads, head size, dtype), the model's, when it is
created (or with an admin's first put, checked against the model): every request
states the layout it expects, and one of another model, KV layout or dtype is
refused as a whole, naming both, so no client fuses keys and values computed by
another model into its prompts, and no writer chooses the layout for the others.

Chunks are put whole and all-or-nothing per call (a build's batch, a node's
write-back), under ``put_rules``: each under the key its token ids and context
give, the admitted ones (their keys asked for by ``--admit-after`` writers),
recorded with the writer. A chunk is either absent or readable in full.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from attnstore.errors import EntryNotFoundError, FingerprintMismatchError, MapShapeError
from attnstore.protocol.chunks import CHUNK_KEY_BYTES, ChunkLayout, StoredChunk
from attnstore.protocol.keys import chunk_key
from attnstore.service import put_rules
from attnstore.service.admission import Admission, AdmissionConfig
from attnstore.service.put_rules import PutCaller
from attnstore.store.base import MapStoreBase

if TYPE_CHECKING:
    from attnstore.protocol.records import NamespaceInfo


@dataclass(frozen=True, slots=True)
class ChunkPutResult:
    """What one put of chunks did."""

    stored: int  # chunks new to the store
    duplicates: int  # chunks it had already (another node, or an earlier build, was first)
    bytes: int  # bytes of the new ones
    not_admitted: int = 0  # chunks skipped: not admitted


def check_chunk_layout(stored: ChunkLayout | None, namespace: str, layout: ChunkLayout) -> ChunkLayout:
    """``stored``, once it equals the request's ``layout``.

    Raises:
        FingerprintMismatchError: the namespace stores no chunks, or chunks of another layout (both named).
    """
    if stored is None:
        raise FingerprintMismatchError(f"namespace {namespace!r} stores no chunks (the request expects {layout})")
    if stored != layout:
        raise FingerprintMismatchError(
            f"namespace {namespace!r} stores chunks of {stored}; the request's are {layout}"
            " (another model, KV layout or dtype: its keys and values would be wrong)"
        )
    return stored


def check_chunk_keys(keys: Sequence[bytes]) -> None:
    """Raises ``MapShapeError`` for a key that is not ``CHUNK_KEY_BYTES`` long."""
    bad = next((key for key in keys if len(key) != CHUNK_KEY_BYTES), None)
    if bad is not None:
        raise MapShapeError(f"a chunk key is {CHUNK_KEY_BYTES} bytes, got {len(bad)}")


class ServiceChunks:
    """The service's chunk part: its stored chunks (over the store), matched, read and put; thread-safe."""

    def __init__(self, store: MapStoreBase, check_fingerprint: Callable[[str, str], NamespaceInfo],
                 admission: Callable[[], Admission] | None = None,
                 held: Callable[[str, bytes], bool] | None = None) -> None:
        """
        Args:
            store: the service's map store.
            check_fingerprint: the service's check that a request's model is the namespace's
                (``AttnStoreService.check_fingerprint``).
            admission: the service's admission rule as it is now (None: off, only trusted puts store).
            held: whether a chunk (namespace, key) is quarantined (``service.quarantine``): not stored, for every
                caller, until an admin releases it.
        """
        self._held = held or (lambda namespace, key: False)
        self._store = store
        self._check_fingerprint = check_fingerprint
        off = Admission(AdmissionConfig(admit_after=0))
        self._admission = admission or (lambda: off)

    def layout(self, namespace: str) -> ChunkLayout | None:
        """How the namespace stores chunks; None when it stores none (or its store cannot hold chunks)."""
        return None if self._store.chunks is None else self._store.chunks.layout(namespace)

    def check_request(self, namespace: str, fingerprint: str, layout: ChunkLayout) -> ChunkLayout:
        """The namespace's chunk layout, once the request's model and layout are its own.

        Raises:
            NamespaceNotFoundError: no such namespace.
            FingerprintMismatchError: another model, or another chunk layout (or none stored).
        """
        self._check_fingerprint(namespace, fingerprint)
        return check_chunk_layout(self.layout(namespace), namespace, layout)

    def lengths(self, namespace: str, fingerprint: str, layout: ChunkLayout, keys: Sequence[bytes],
                caller: str | None = None) -> list[int | None]:
        """Each key's stored chunk length in tokens; None where it is not stored. ``caller`` (an admission key;
        None: not counted) counts as asking for the keys not stored.

        Raises:
            FingerprintMismatchError: see :meth:`check_request`.
            MapShapeError: a key that is not 32 bytes.
        """
        self.check_request(namespace, fingerprint, layout)
        check_chunk_keys(keys)
        lengths = self._store.require_chunks("chunks.lengths()").lengths(namespace, list(keys))
        lengths = [None if self._held(namespace, bytes(key)) else n for key, n in zip(keys, lengths, strict=True)]
        asked = [bytes(k) for k, n in zip(keys, lengths, strict=True) if n is None]
        put_rules.observe(self._admission, namespace, list(dict.fromkeys(asked)), caller)
        return lengths

    def read_layer(self, namespace: str, key: bytes, layer: int) -> np.ndarray:
        """One chunk's keys and values of one layer ``(2, KVH, C, d)`` (the request is checked by the caller).

        Raises:
            EntryNotFoundError: the chunk is not stored; ChecksumError: it is damaged (the message names it).
        """
        self._refuse_held(namespace, key)
        return self._store.require_chunks("chunks.read_layer()").read_layer(namespace, key, layer)

    def read(self, namespace: str, key: bytes) -> np.ndarray:
        """One chunk's keys and values of every layer ``(layers, 2, KVH, C, d)`` (checked by the caller).

        Raises:
            EntryNotFoundError, ChecksumError: as :meth:`read_layer`.
        """
        self._refuse_held(namespace, key)
        return self._store.require_chunks("chunks.read()").read(namespace, key)

    def _refuse_held(self, namespace: str, key: bytes) -> None:
        """Raise EntryNotFoundError for a quarantined chunk: served to no one."""
        if self._held(namespace, bytes(key)):
            raise EntryNotFoundError(f"chunk {bytes(key).hex()[:16]} of namespace {namespace!r} is quarantined"
                                     " (admin quarantine list)")

    def set_layout(self, namespace: str, layout: ChunkLayout) -> ChunkLayout:
        """Record the namespace's chunk layout (an admin's: ``CreateNamespace``); its own again changes nothing.

        Raises:
            NamespaceNotFoundError: no such namespace.
            FingerprintMismatchError: a bidirectional namespace, a layout that is not its model's, or another
                layout recorded already (both named).
            ConfigError: the store keeps no chunks.
        """
        info = self._store.get_namespace(namespace)
        put_rules.check_causal(info, "chunks")
        put_rules.check_model_fit(info, "chunks", layout, layers=layout.layers, kv_heads=layout.kv_heads)
        recorded = self.layout(namespace)
        if recorded is not None:
            return check_chunk_layout(recorded, namespace, layout)
        return self._store.require_chunks("chunks.set_layout()").set_layout(namespace, layout)

    def put(
        self, namespace: str, fingerprint: str, layout: ChunkLayout, chunks: Sequence[StoredChunk],
        caller: PutCaller = put_rules.LOCAL,
    ) -> ChunkPutResult:
        """Store ``chunks`` (all or none) under the rules of ``put_rules``: each under the key its token ids and
        context give, the admitted ones, recorded as ``caller``'s.

        Raises:
            NamespaceNotFoundError, FingerprintMismatchError: another model; a bidirectional namespace; another
                chunk layout than the namespace's (both named), or none recorded and an untrusted caller.
            MapShapeError: a chunk without token ids (or ids outside the vocabulary, or not one per token),
                whose sent key is not the one its ids give, a key that is not 32 bytes, or keys and values that
                are not finite or do not fit ``layout`` (nothing is stored).
            WriteBackOffError: write-back is off (``--admit-after 0``) for an untrusted caller.
            StoreFullError: the store is full (nothing is stored).
        """
        info = self._check_fingerprint(namespace, fingerprint)
        put_rules.check_causal(info, "chunks")
        recorded = self.layout(namespace)
        if recorded is not None:
            check_chunk_layout(recorded, namespace, layout)
        else:
            put_rules.check_no_layout(info, "chunk", caller)
            put_rules.check_model_fit(info, "chunks", layout, layers=layout.layers, kv_heads=layout.kv_heads)
        for chunk in chunks:
            _check_chunk(chunk, layout)
        check_chunk_keys([chunk.key for chunk in chunks])
        keyed = [_keyed(info, chunk, position, caller) for position, chunk in enumerate(chunks)]
        if not keyed:
            return ChunkPutResult(0, 0, 0)
        stored_chunks = self._store.require_chunks("chunks.put()")
        if recorded is None:  # an admin's put records the layout (refused when another was set meanwhile)
            stored_chunks.set_layout(namespace, layout)
        unique = list({chunk.key: chunk for chunk in keyed}.values())
        known = stored_chunks.lengths(namespace, [chunk.key for chunk in unique])
        fresh_keys = [chunk.key for chunk, length in zip(unique, known, strict=True) if length is None]
        verdicts = dict(zip(fresh_keys, put_rules.admitted(self._admission, namespace, fresh_keys, caller),
                            strict=True))
        admitted = [chunk for chunk in unique if verdicts.get(chunk.key, True)]
        skipped = sum(chunk.key in verdicts and not verdicts[chunk.key] for chunk in keyed)
        stored = stored_chunks.put(namespace, admitted) if admitted else 0
        fresh = sum(chunk.kv.nbytes for chunk in admitted if chunk.key in verdicts)
        return ChunkPutResult(stored, len(keyed) - skipped - stored, fresh, skipped)

    def drop_writer(self, namespace: str, writer: str, *, dry_run: bool = False) -> int:
        """Delete the chunks ``writer`` put; returns how many.

        Raises:
            ConfigError: an empty writer name.
            NamespaceNotFoundError: no such namespace.
        """
        if self._store.chunks is None:
            self._store.get_namespace(namespace)
            return 0
        keys = self._store.chunks.writer_keys(namespace, writer)
        return len(keys) if dry_run else self._store.chunks.delete(namespace, keys)


def _keyed(info: NamespaceInfo, chunk: StoredChunk, position: int, caller: PutCaller) -> StoredChunk:
    """``chunk`` recorded as ``caller``'s, once its key is the one its token ids and context give."""
    where = f"chunk {position}"
    ids = put_rules.check_token_ids(info, chunk.token_ids, where)
    if len(ids) != chunk.length:
        raise MapShapeError(f"{where}: {len(ids)} token ids for keys and values of {chunk.length} tokens")
    context = None if chunk.context_ids is None or not len(chunk.context_ids) else \
        put_rules.check_token_ids(info, chunk.context_ids, f"{where} context")
    put_rules.check_key(bytes(chunk.key), chunk_key(context, ids), where)
    return dataclasses.replace(chunk, writer=caller.writer, token_ids=ids, context_ids=context)


def _check_chunk(chunk: StoredChunk, layout: ChunkLayout) -> None:
    kv = chunk.kv
    length = kv.shape[3] if kv.ndim == 5 else 0
    if length < 1 or kv.shape != (layout.layers, *layout.layer_shape(length)) or kv.dtype != np.dtype(layout.dtype):
        raise MapShapeError(f"chunk {bytes(chunk.key).hex()[:16]}: {kv.dtype} {kv.shape} does not fit {layout}"
                            " ((layers, 2, kv_heads, C, head_dim), C >= 1)")
    if not np.isfinite(kv).all():
        raise MapShapeError(f"chunk {bytes(chunk.key).hex()[:16]}: keys or values that are not finite")
