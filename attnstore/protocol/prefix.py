"""Prefix blocks: the keys and values of a causal model's prompt prefixes, in fixed blocks.

For a causal model the keys and values (and the last hidden states) of the
tokens ``0..p-1`` do not depend on anything after them, so a stored prefix can
stand in for computing it, exactly. A prompt is cut into blocks of
``block_size`` tokens; block ``i`` is keyed by a *chained* hash over every
token from the start to its end (``protocol.keys.BlockHash``: ``h_i =
sha256(h_{i-1} || tokens of block i)``, seeded with the block size), so equal keys mean equal prefixes and a
block is useful only after all the blocks before it. Lookups walk a row's
chain from the start and stop at the first block not stored: an evicted or
corrupt block cuts every chain through it there, never serves a wrong prefix.

Shared by the store (which checks and keeps blocks) and the client (which
hashes its rows and asks): imports numpy and ``attnstore.errors`` only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from attnstore.errors import ConfigError, FingerprintMismatchError, MapShapeError
from attnstore.protocol.keys import BLOCK_HASH_BYTES, BlockHash, ExtraKeys, chain_seed, hash_block_tokens

PrefixDtype = Literal["float16", "float32"]
PREFIX_DTYPES: tuple[PrefixDtype, ...] = ("float16", "float32")
DEFAULT_BLOCK_SIZE = 32  # tokens per block: a 5-shot MMLU prefix loses under 32 tokens to the block boundary


@dataclass(frozen=True, slots=True)
class PrefixLayout:
    """How one namespace stores prefix blocks (recorded with the namespace; every block follows it)."""

    block_size: int  # tokens per block
    layers: int
    kv_heads: int
    head_dim: int
    hidden: int  # width of the last hidden states stored beside the keys and values
    dtype: PrefixDtype  # the model's compute dtype ("float32" keeps prefixes exact) or fp16 (half the bytes)

    def __post_init__(self) -> None:
        sizes = (self.block_size, self.layers, self.kv_heads, self.head_dim, self.hidden)
        if not all(isinstance(n, int) and n >= 1 for n in sizes):
            raise ConfigError(f"PrefixLayout: block_size, layers, kv_heads, head_dim, hidden must be >= 1, got {sizes}")
        if self.dtype not in PREFIX_DTYPES:
            raise ConfigError(f"PrefixLayout: dtype must be one of {list(PREFIX_DTYPES)}, got {self.dtype!r}")

    @property
    def layer_shape(self) -> tuple[int, int, int, int]:
        """One block's keys and values of one layer: ``(2, kv_heads, block_size, head_dim)``."""
        return (2, self.kv_heads, self.block_size, self.head_dim)

    @property
    def layer_bytes(self) -> int:
        """Bytes of one part: one block's keys and values of one layer."""
        return int(np.prod(self.layer_shape)) * np.dtype(self.dtype).itemsize

    @property
    def hidden_bytes(self) -> int:
        """Bytes of one block's last hidden states ``(block_size, hidden)``."""
        return self.block_size * self.hidden * np.dtype(self.dtype).itemsize

    @property
    def block_bytes(self) -> int:
        """Bytes of one whole block: every layer's keys and values and the hidden states."""
        return self.layers * self.layer_bytes + self.hidden_bytes

    def to_dict(self) -> dict[str, object]:
        """Plain dict (JSON, on disk and in stats)."""
        return {"block_size": self.block_size, "layers": self.layers, "kv_heads": self.kv_heads,
                "head_dim": self.head_dim, "hidden": self.hidden, "dtype": self.dtype}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> PrefixLayout:
        """The layout a ``to_dict`` wrote.

        Raises:
            ConfigError: a field is missing or invalid.
        """
        try:
            return cls(**{k: data[k] for k in ("block_size", "layers", "kv_heads", "head_dim", "hidden", "dtype")})  # type: ignore[arg-type]
        except KeyError as exc:
            raise ConfigError(f"prefix layout record lacks {exc}") from None


@dataclass(frozen=True, slots=True)
class PrefixBlock:
    """One block to store: its chain position and its tokens' keys, values and last hidden states."""

    chain_hash: bytes  # h_i, a BlockHash (32 bytes)
    parent: bytes | None  # h_{i-1}; None for the first block of a chain
    kv: np.ndarray  # (layers, 2, kv_heads, block_size, head_dim) in the layout's dtype
    hidden: np.ndarray  # (block_size, hidden) in the layout's dtype
    token_ids: np.ndarray | None = None  # (block_size,) its tokens: the daemon hashes them itself (a put needs them)
    writer: str | None = None  # who computed it (a token's name), recorded with the block; None: an admin's build


def chain_hashes(
    token_ids: Sequence[int] | np.ndarray, block_size: int, *, blocks: int | None = None, extra_keys: ExtraKeys = ()
) -> list[bytes]:
    """The chained hash (a ``BlockHash``) of every whole block of ``token_ids`` (at most ``blocks`` of them; see
    ``protocol.keys``).

    Ids are hashed as little-endian uint32 (any vocabulary below 2**32), the first
    hash seeded with the block size so that layouts of two block sizes never share a key.

    Raises:
        ConfigError: ``block_size`` < 1.
    """
    if block_size < 1:
        raise ConfigError(f"chain_hashes(): block_size must be >= 1, got {block_size}")
    ids = np.asarray(token_ids, dtype="<u4")
    count = len(ids) // block_size if blocks is None else min(blocks, len(ids) // block_size)
    previous = chain_seed(block_size)
    out: list[bytes] = []  # BlockHash each; the client's prefix tier keeps them as bytes
    for index in range(count):
        previous = hash_block_tokens(previous, ids[index * block_size : (index + 1) * block_size],
                                     extra_keys=extra_keys)
        out.append(previous)
    return out


def block_chain_hash(layout: PrefixLayout, parent: bytes | None, token_ids: Sequence[int] | np.ndarray) -> bytes:
    """The chain hash of a block of ``token_ids`` after ``parent`` (None: a chain's first block), as
    :func:`chain_hashes` computes it.

    Raises:
        MapShapeError: not ``block_size`` ids, or an id outside uint32.
    """
    ids = np.asarray(token_ids)
    if ids.shape != (layout.block_size,) or ids.dtype.kind not in "iu":
        raise MapShapeError(f"a prefix block's token ids must be {layout.block_size} integers, got"
                            f" {ids.dtype} {ids.shape}")
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= 2**32):
        raise MapShapeError("a prefix block's token ids must be in [0, 2**32)")
    return hash_block_tokens(BlockHash(parent) if parent else chain_seed(layout.block_size), ids)


def usable_blocks(length: int, block_size: int) -> int:
    """Whole blocks a row of ``length`` tokens may take from the store: at least one token is left to compute
    (the forward needs one, and its last position is what decoders are read at)."""
    return max(0, (length - 1) // block_size)


def check_prefix_request(layout: PrefixLayout | None, namespace: str, block_size: int) -> PrefixLayout:
    """The namespace's layout, when a request's block size is the one it stores.

    Raises:
        FingerprintMismatchError: the namespace stores no prefix blocks, or blocks of another size.
    """
    if layout is None:
        raise FingerprintMismatchError(f"namespace {namespace!r} stores no prefix blocks")
    if block_size != layout.block_size:
        raise FingerprintMismatchError(
            f"namespace {namespace!r} stores prefix blocks of {layout.block_size} tokens; the request has {block_size}"
        )
    return layout


def check_block(layout: PrefixLayout, block: PrefixBlock, position: int) -> PrefixBlock:
    """``block`` with its arrays contiguous, once it fits ``layout``.

    Raises:
        MapShapeError: a hash that is not 32 bytes, or arrays of another shape or dtype.
    """
    if not isinstance(block, PrefixBlock):
        raise MapShapeError(f"prefix block {position} must be a PrefixBlock, got {type(block).__name__}")
    for name, value in (("chain_hash", block.chain_hash), ("parent", block.parent)):
        if value is not None and (not isinstance(value, bytes) or len(value) != BLOCK_HASH_BYTES):
            raise MapShapeError(f"prefix block {position}: {name} must be {BLOCK_HASH_BYTES} bytes, got {value!r:.80}")
    kv_shape = (layout.layers, *layout.layer_shape)
    hidden_shape = (layout.block_size, layout.hidden)
    for name, array, shape in (("kv", block.kv, kv_shape), ("hidden", block.hidden, hidden_shape)):
        if not isinstance(array, np.ndarray) or array.shape != shape or array.dtype != np.dtype(layout.dtype):
            got = (getattr(array, "shape", None), str(getattr(array, "dtype", type(array).__name__)))
            raise MapShapeError(
                f"prefix block {position}: {name} must be {shape} {layout.dtype} for this namespace, got {got}"
            )
    if block.writer is not None and not isinstance(block.writer, str):
        raise MapShapeError(f"prefix block {position}: writer must be a string or None, got"
                            f" {type(block.writer).__name__}")
    return PrefixBlock(block.chain_hash, block.parent, np.ascontiguousarray(block.kv),
                       np.ascontiguousarray(block.hidden), block.token_ids, block.writer)
