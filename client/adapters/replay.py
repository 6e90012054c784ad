"""Replayed attention maps: what a caller may hand in, how it is checked, the maps·V math.

A row's replay maps are either one tensor ``(layers, heads, L', L')`` or a sequence
indexable by layer whose items are ``(heads, L', L')`` tensors. The sequence form
lets a streaming client hand in a lazy object whose ``__getitem__`` blocks until
that layer has arrived. ``L' == L`` for bidirectional models; causal models also
take ``L' > L`` and use the top-left ``L x L`` block, which is exact for the
shared prefix because row i of a causal map only covers columns <= i.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeAlias

import torch

from attnstore.errors import MapShapeError

ReplayMaps: TypeAlias = torch.Tensor | Sequence[torch.Tensor]

MAP_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)


def check_replay(
    replay: Mapping[int, ReplayMaps],
    lengths: Sequence[int],
    *,
    layers: int,
    heads: int,
    causal: bool,
) -> None:
    """Check every row's maps before any compute.

    Full tensors are checked completely here; lazy per-layer sequences are
    checked for their layer count (when they know it) here and layer by layer
    in ``layer_maps``.

    Args:
        replay: row index -> that row's maps.
        lengths: the batch's true row lengths.
        layers, heads: the model's layer and query-head counts.
        causal: whether a stored length ``L' > L`` may be cropped.

    Raises:
        MapShapeError: a row index out of range, or maps of the wrong type,
            dtype, layer count, head count or length.
    """
    for row, maps in replay.items():
        if not isinstance(row, int) or not 0 <= row < len(lengths):
            raise MapShapeError(f"replay row {row!r} is not a row of this batch (0..{len(lengths) - 1})")
        if isinstance(maps, torch.Tensor):
            if maps.dim() != 4 or maps.shape[0] != layers:
                raise MapShapeError(
                    f"row {row}: maps of shape {tuple(maps.shape)}, expected "
                    f"(layers={layers}, heads={heads}, L, L) with L = {lengths[row]}"
                )
            for layer in range(layers):
                check_layer_maps(maps[layer], row, layer, lengths[row], heads=heads, causal=causal)
        elif hasattr(maps, "__array__") or hasattr(maps, "shape"):
            raise MapShapeError(
                f"row {row}: maps must be torch tensors, got {type(maps).__name__} (torch.from_numpy converts arrays)"
            )
        elif hasattr(type(maps), "__getitem__") and not isinstance(maps, (str, bytes)):
            if hasattr(type(maps), "__len__") and len(maps) != layers:
                raise MapShapeError(f"row {row}: maps for {len(maps)} layers, the model has {layers}")
        else:
            raise MapShapeError(
                f"row {row}: maps must be a tensor (layers, heads, L, L) or a per-layer "
                f"sequence of (heads, L, L) tensors, got {type(maps).__name__}"
            )


def check_layer_maps(
    maps: object,
    row: int,
    layer: int,
    length: int,
    *,
    heads: int,
    causal: bool,
) -> torch.Tensor:
    """Check one row's maps for one layer and return them.

    Raises:
        MapShapeError: not a tensor, an unsupported dtype, the wrong head count,
            a non-square map, or a length that does not fit the row.
    """
    if not isinstance(maps, torch.Tensor):
        raise MapShapeError(f"row {row}, layer {layer}: maps must be a torch.Tensor, got {type(maps).__name__}")
    if maps.dtype not in MAP_DTYPES:
        raise MapShapeError(
            f"row {row}, layer {layer}: maps of dtype {maps.dtype}; supported: {[str(d) for d in MAP_DTYPES]}"
        )
    if maps.dim() != 3 or maps.shape[0] != heads or maps.shape[1] != maps.shape[2]:
        raise MapShapeError(
            f"row {row}, layer {layer}: maps of shape {tuple(maps.shape)}, expected (heads={heads}, L, L)"
        )
    stored = int(maps.shape[1])
    if stored != length and not (causal and stored > length):
        wanted = f">= {length} (causal crop)" if causal else f"== {length} (bidirectional: exact length)"
        raise MapShapeError(f"row {row}, layer {layer}: maps of length {stored}, the row needs {wanted}")
    return maps


def layer_maps(
    maps: ReplayMaps,
    row: int,
    layer: int,
    length: int,
    *,
    heads: int,
    causal: bool,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Return one row's maps for one layer, cropped to ``(heads, length, length)`` and in ``dtype``.

    No copy is made when the maps already have that length and dtype.

    Raises:
        MapShapeError: as ``check_layer_maps`` (lazy sequences are checked here).
    """
    one = check_layer_maps(maps[layer], row, layer, length, heads=heads, causal=causal)  # (H, L', L')
    if one.shape[-1] != length:
        one = one[:, :length, :length]  # (H, L, L)
    return one.to(dtype)


# Causal maps are zero above the diagonal. Past this length the hit path skips
# those zeros by query-row blocks of this size (block k reads keys < its end):
# about 40% fewer FLOPs at L = 512. Below it one folded matmul is faster.
CAUSAL_BLOCK_ROWS = 128


def apply_maps(
    maps: Sequence[torch.Tensor],
    values: torch.Tensor,
    lengths: Sequence[int],
    *,
    out: torch.Tensor,
    causal: bool,
) -> None:
    """Write each row's attention context ``maps · V`` into ``out``, per query head.

    Query heads of one KV group are adjacent (query head ``h`` reads KV head
    ``h // G``). Up to ``CAUSAL_BLOCK_ROWS`` tokens (and always for bidirectional
    maps) a row's maps fold into ``(KVH, G*L, L)`` and one batched matmul against
    ``(KVH, L, d)`` serves every query head without repeating V. Longer causal
    rows go by query-row blocks that skip the zero upper triangle; a block cannot
    fold the G query heads into its rows, so there V is repeated, once for the
    batch (``d / L`` of the maps' bytes: an eighth at L = 512).

    Args:
        maps: per row, ``(H, L, L)`` probabilities at the row's true length.
        values: ``(B, P, KVH * d)`` value projections.
        lengths: per row, its true length ``L <= P``.
        out: ``(B, P, H * d)``, the layout the output projection takes; pad
            positions are left as they are.
        causal: whether the maps are lower-triangular.
    """
    rows, padded, _ = out.shape
    heads = maps[0].shape[0]
    head_dim = out.shape[-1] // heads
    kv_heads = values.shape[-1] // head_dim
    value_heads = values.view(rows, padded, kv_heads, head_dim).transpose(1, 2)  # (B, KVH, P, d)
    out_heads = out.view(rows, padded, heads, head_dim).transpose(1, 2)  # (B, H, P, d), a view of out
    blocked = [causal and length > CAUSAL_BLOCK_ROWS for length in lengths]
    repeated = value_heads.repeat_interleave(heads // kv_heads, dim=1) if any(blocked) else None  # (B, H, P, d)
    for row, (row_maps, length) in enumerate(zip(maps, lengths, strict=True)):
        if repeated is not None and blocked[row]:
            for start in range(0, length, CAUSAL_BLOCK_ROWS):
                end = min(start + CAUSAL_BLOCK_ROWS, length)
                # Straight into out's strided (H, n, d) view: no copy afterwards.
                torch.bmm(row_maps[:, start:end, :end], repeated[row, :, :end], out=out_heads[row, :, start:end])
            continue
        grouped = row_maps.reshape(kv_heads, -1, length)  # (KVH, G*L, L), a view if contiguous
        context = torch.matmul(grouped, value_heads[row, :, :length])  # (KVH, G*L, d)
        out_heads[row, :, :length].copy_(context.view(heads, length, head_dim))
