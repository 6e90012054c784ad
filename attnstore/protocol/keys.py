"""Keys that name stored things, the same on every side: token hashes, block hashes and fingerprints.

- ``TokenHash``: the exact tier's key of one row, sha256 of its token ids as
  little-endian int64 (the ids' container type does not matter). The client files
  rows under it, the daemon hashes written-back rows itself with the same
  function (so a node cannot file a row under another row's key), and every
  backend indexes entries by it.
- ``BlockHash``: a prefix block's key, chained: ``h_i = sha256(h_{i-1} || tokens of
  block i)`` with the ids as little-endian uint32, ``h_{-1}`` seeded with the block
  size (see ``protocol.prefix`` for the chain).
- ``chunk_key``: a chunk entry's key, ``sha256("attnstore-chunk-v1" || token_hash(context)
  || token_hash(ids))`` (no context: nothing in its place): the chunk's tokens and the tokens it
  was computed after. The daemon computes it from a put's ids, as it hashes written-back rows.
- ``Fingerprint``: a namespace's model, tokenizer and weights, 64 hex characters
  (``attnstore_client.keys.model_fingerprint`` computes it from a loaded model).

Both hashes take ``extra_keys``, as vLLM's ``hash_block_tokens`` does: what
besides the tokens changes what is stored under a key (an adapter's name, a cache
salt). None is used yet; empty extra keys give the hashes every store holds today.

Imports hashlib and numpy only: the client and the daemon both import it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NewType

import numpy as np

from attnstore.errors import ConfigError

TokenHash = NewType("TokenHash", bytes)
BlockHash = NewType("BlockHash", bytes)
Fingerprint = NewType("Fingerprint", str)
ExtraKeys = tuple[str | int | bytes, ...]

TOKEN_HASH_BYTES = 32
BLOCK_HASH_BYTES = 32
_EXTRA_TAGS = {str: b"s", int: b"i", bytes: b"b"}


def _extra_bytes(extra_keys: ExtraKeys) -> bytes:
    """The extra keys, each tagged with its type and length, so no two tuples give the same bytes."""
    out = [b"\x00extra"]
    for key in extra_keys:
        tag = _EXTRA_TAGS.get(type(key))
        if tag is None:
            raise ConfigError(f"extra keys must be str, int or bytes, got {type(key).__name__} {key!r:.40}")
        raw = key.encode() if isinstance(key, str) else key if isinstance(key, bytes) else str(key).encode()
        out.append(tag + len(raw).to_bytes(4, "little") + raw)
    return b"".join(out)


def token_hash(token_ids: Sequence[int] | np.ndarray, *, extra_keys: ExtraKeys = ()) -> TokenHash:
    """The exact-tier key of one row's token ids (no padding): 32 bytes of sha256.

    Raises:
        ValueError: the ids are not one row.
        ConfigError: an extra key that is not str, int or bytes.
    """
    ids = np.asarray(token_ids, dtype="<i8")
    if ids.ndim != 1:
        raise ValueError(f"token_hash(): expected one row of token ids, got shape {ids.shape}")
    digest = hashlib.sha256(ids.tobytes())
    if extra_keys:
        digest.update(_extra_bytes(extra_keys))
    return TokenHash(digest.digest())


def chain_seed(block_size: int) -> BlockHash:
    """The parent of a chain's first block: layouts of two block sizes never share a key."""
    return BlockHash(hashlib.sha256(b"attnstore-prefix/" + str(block_size).encode()).digest())


def hash_block_tokens(parent: BlockHash, block_ids: np.ndarray, *, extra_keys: ExtraKeys = ()) -> BlockHash:
    """One block's key from its parent's and its ``(block_size,)`` token ids (little-endian uint32)."""
    digest = hashlib.sha256(parent + np.asarray(block_ids, dtype="<u4").tobytes())
    if extra_keys:
        digest.update(_extra_bytes(extra_keys))
    return BlockHash(digest.digest())


def chunk_key(context: Sequence[int] | np.ndarray | None, ids: Sequence[int] | np.ndarray) -> bytes:
    """The key of a chunk of token ``ids`` computed after the tokens ``context`` (None or empty: after nothing)."""
    digest = hashlib.sha256(b"attnstore-chunk-v1")
    digest.update(token_hash(context) if context is not None and len(context) else b"")
    digest.update(token_hash(ids))
    return digest.digest()
