"""Packed forwards: the rows of a forward end to end in one sequence, no padding anywhere.

Prepacking (Zhao et al., 2024): a forward's rows are concatenated into one
sequence of ``T`` tokens, positions restarting at 0 for every row, so the
embeddings, projections, MLPs and norms (nearly all of a forward's FLOPs) run on
``(T, hidden)`` with nothing padded. Only attention needs the rows apart: it runs
per *run* of consecutive rows of equal length, each run one ``(n, H, L, d)``
batch of the model's own kernel (``scaled_dot_product_attention``, causal for
decoders) with no mask at all (only a family's score bias at the run's length:
MPNet's), or on the CPU, for rows up to ``SHORT_ROW``
tokens, matmul, softmax, matmul (faster there). Rows sorted by length make few runs.

In a run a row either computes (the model's kernel), keeps its maps (computes
them explicitly in fp32, as ``Adapter.capture`` does, hands them back as fp16
and applies them, for write-back) or replays stored maps (value projection and
maps·V only: its q/k projections and RoPE are never computed). Measured on
all-MiniLM-L6-v2 over length-sorted log lines at 2 threads: 8% faster than the
same rows padded in batches of 32 (docs/BENCHMARKS.md, "Encode").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from attnstore.errors import ConfigError, MapShapeError
from attnstore_client.adapters.attention import attention
from attnstore_client.adapters.replay import ReplayMaps, apply_maps, check_replay, layer_maps
from attnstore_client.adapters.rows import hidden_states

if TYPE_CHECKING:
    from torch import nn

    from attnstore_client.adapters.hooks import AttentionHooks

Role = Literal["compute", "keep", "replay", "fill"]


@dataclass(frozen=True)
class PackedBatch:
    """Rows of token ids end to end: ``input_ids`` and ``position_ids`` are ``(T,)`` long tensors."""

    input_ids: torch.Tensor  # (T,) long
    position_ids: torch.Tensor  # (T,) long, 0..L-1 for every row
    lengths: tuple[int, ...]
    starts: tuple[int, ...]  # each row's first token in the sequence
    filler: int = 0  # the last rows are filler rows (``with_filler``), not rows of the caller's
    # (T,) long: the token types where some row is a text pair of a model with them (BERT's segments); None: all 0
    token_type_ids: torch.Tensor | None = None

    @property
    def size(self) -> int:
        """Number of rows."""
        return len(self.lengths)

    @property
    def tokens(self) -> int:
        """Tokens of every row together, ``T``."""
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device | str) -> PackedBatch:
        """The same batch with its tensors on ``device`` (itself when they are there already)."""
        if self.input_ids.device == torch.device(device):
            return self
        types = None if self.token_type_ids is None else self.token_type_ids.to(device)
        return PackedBatch(self.input_ids.to(device), self.position_ids.to(device), self.lengths, self.starts,
                           self.filler, types)

    def row(self, flat: torch.Tensor, row: int) -> torch.Tensor:
        """Row ``row`` of a ``(T, ...)`` tensor laid out as this batch: ``(L, ...)``, a view."""
        start = self.starts[row]
        return flat[start : start + self.lengths[row]]


def pack(rows: Sequence[Sequence[int]], token_types: Sequence[Sequence[int]] | None = None) -> PackedBatch:
    """Pack token id rows end to end, in the order given (sort them by length for few attention runs).

    ``token_types``: per row its token type ids, as long as the row, or empty (all 0); None: no row has any.

    Raises:
        ConfigError: no rows, or an empty row.
    """
    if not rows:
        raise ConfigError("pack() needs at least one row, got none")
    lengths = tuple(len(row) for row in rows)
    if min(lengths) == 0:
        raise ConfigError(f"pack(): row {lengths.index(0)} is empty; every row needs a token")
    starts = _starts(lengths)
    input_ids = torch.as_tensor([token for row in rows for token in row], dtype=torch.long)  # (T,)
    position_ids = torch.cat([torch.arange(length) for length in lengths])  # (T,)
    types = None
    if token_types is not None and any(token_types):
        types = torch.as_tensor([kind for row, row_types in zip(rows, token_types, strict=True)
                                 for kind in (row_types or [0] * len(row))], dtype=torch.long)  # (T,)
    return PackedBatch(input_ids, position_ids, lengths, starts, token_type_ids=types)


# Rows up to this long attend faster on the CPU as matmul, softmax, matmul than through torch's flash
# kernel, whose blocking is made for long rows: 1.3-2x at 12 heads and 12-48 tokens on 2 cores, and the
# packed forwards of log lines 3-4% faster; slower from 64 tokens on (docs/BENCHMARKS.md, "Encode").
SHORT_ROW = 40

# Filler rows are at most this long: within any model's positions, and one attention run however many there are.
FILLER_ROW = 64


def with_filler(batch: PackedBatch, tokens: int) -> PackedBatch:
    """``batch`` with ``tokens`` more, as rows of token 0 (of at most FILLER_ROW tokens) after its own rows.

    The rows' own tokens keep their places (``batch.row`` reads them the same) and see nothing of the filler:
    attention runs row by row. Filler rows compute when a row of the batch does, else they skip attention.
    """
    if tokens <= 0:
        return batch
    fill = [FILLER_ROW] * (tokens // FILLER_ROW) + ([tokens % FILLER_ROW] if tokens % FILLER_ROW else [])
    lengths = batch.lengths + tuple(fill)
    device = batch.input_ids.device
    input_ids = torch.cat([batch.input_ids, torch.zeros(tokens, dtype=torch.long, device=device)])
    positions = torch.cat([batch.position_ids, *(torch.arange(n, device=device) for n in fill)])
    types = batch.token_type_ids
    if types is not None:
        types = torch.cat([types, torch.zeros(tokens, dtype=torch.long, device=device)])
    return PackedBatch(input_ids, positions, lengths, _starts(lengths), batch.filler + len(fill), types)


def _starts(lengths: Sequence[int]) -> tuple[int, ...]:
    starts, total = [], 0
    for length in lengths:
        starts.append(total)
        total += length
    return tuple(starts)


@dataclass(frozen=True)
class Run:
    """Consecutive rows of one length and one role: one attention batch."""

    first: int  # first row
    count: int
    length: int
    role: Role

    @property
    def rows(self) -> range:
        return range(self.first, self.first + self.count)


@dataclass(frozen=True)
class PackedCall:
    """State of one packed forward; lives on the adapter only while the call runs."""

    batch: PackedBatch
    runs: tuple[Run, ...]
    replay: Mapping[int, ReplayMaps]  # replaying row -> its maps
    kept: Mapping[int, torch.Tensor]  # keeping row -> (layers, H, L, L) fp16, filled layer by layer
    # Tokens whose q/k are computed (rows that compute or keep), or None when that is every token.
    query_index: torch.Tensor | None
    query_offsets: Mapping[int, int]  # computing row -> its first position among those tokens

    def attend(
        self, adapter: AttentionHooks, layer: int, module: nn.Module, original: Callable[..., Any], args: tuple,
        kwargs: dict,
    ) -> tuple:
        """One attention layer of this forward (``attend_packed``); ``original`` is never run."""
        return attend_packed(adapter, layer, module, self, args, kwargs)


def plan_packed(
    batch: PackedBatch, replay: Mapping[int, ReplayMaps], keep: Sequence[int], *, layers: int, heads: int,
    causal: bool,
) -> PackedCall:
    """Check the maps and rows to keep, and cut the batch into attention runs.

    Raises:
        MapShapeError: maps of the wrong shape, or a row to keep outside the batch or replaying.
    """
    own = batch.size - batch.filler
    check_replay(replay, batch.lengths[:own], layers=layers, heads=heads, causal=causal)
    keeping = set(keep)
    bad = sorted(row for row in keeping if not (isinstance(row, int) and 0 <= row < own) or row in replay)
    if bad:
        raise MapShapeError(
            f"forward_packed(): rows {bad} cannot keep their maps: a row to keep is a computing row of this batch"
            f" (0..{own - 1}), not a replaying one"
        )
    roles: list[Role] = ["replay" if row in replay else "keep" if row in keeping else "compute" for row in range(own)]
    # Filler rows compute with the rows that do (their q/k in the same rounded projection), else compute nothing.
    roles += ["compute" if len(replay) < own else "fill"] * batch.filler
    runs: list[Run] = []
    for row, (length, role) in enumerate(zip(batch.lengths, roles, strict=True)):
        last = runs[-1] if runs else None
        if last is not None and (last.length, last.role) == (length, role):
            runs[-1] = Run(last.first, last.count + 1, length, role)
        else:
            runs.append(Run(row, 1, length, role))
    computing = [row for row in range(batch.size) if roles[row] in ("compute", "keep")]
    offsets, total = {}, 0
    for row in computing:
        offsets[row] = total
        total += batch.lengths[row]
    query_index = None
    if len(computing) < batch.size:
        device = batch.input_ids.device
        spans = [torch.arange(batch.starts[row], batch.starts[row] + batch.lengths[row], device=device)
                 for row in computing]
        query_index = torch.cat(spans) if spans else torch.zeros(0, dtype=torch.long, device=device)
    kept = {row: torch.empty((layers, heads, batch.lengths[row], batch.lengths[row]), dtype=torch.float16)
            for row in sorted(keeping)}
    return PackedCall(batch, tuple(runs), dict(replay), kept, query_index, offsets)


def attend_packed(
    adapter: AttentionHooks, layer: int, module: nn.Module, call: PackedCall, args: tuple, kwargs: dict
) -> tuple:
    """One attention layer of a packed forward: ``(1, T, hidden)`` in, the module's ``(1, T, out)`` out."""
    hidden = hidden_states(args, kwargs)  # (1, T, hidden)
    batch = call.batch
    heads, kv_heads, head_dim = adapter.num_heads, adapter.num_kv_heads, adapter.head_dim
    values = adapter._values(module, hidden[0])  # (T, KVH*d)
    context = values.new_empty((batch.tokens, heads * head_dim))  # (T, H*d)
    queries = keys = None
    if call.query_index is None or call.query_index.numel():
        # (1, H, N, d), (1, KVH, N, d): the computing rows' tokens end to end
        queries, keys = adapter._queries_keys(module, hidden, args, kwargs, call.query_index)
    scaling, window = adapter._scaling(module), adapter._sliding_window(module)
    biases: dict[int, torch.Tensor | None] = {}  # run length -> the layer's score bias at it (one per length)
    for run in call.runs:
        start = batch.starts[run.first]
        end = start + run.count * run.length
        out = context[start:end].view(run.count, run.length, heads, head_dim)  # (n, L, H, d), a view of context
        if run.role == "fill":
            out.zero_()
            continue
        if run.role == "replay":
            maps = [layer_maps(call.replay[row], row, layer, run.length, heads=heads, causal=adapter.causal,
                               dtype=hidden.dtype) for row in run.rows]  # per row (H, L, L)
            apply_maps(maps, values[start:end].view(run.count, run.length, -1), [run.length] * run.count,
                       out=context[start:end].view(run.count, run.length, -1), causal=adapter.causal)
            continue
        assert queries is not None and keys is not None  # a computing run has its q/k
        offset = call.query_offsets[run.first]
        span = slice(offset, offset + run.count * run.length)
        query = _run_rows(queries, span, run)  # (n, H, L, d)
        key = _run_rows(keys, span, run)  # (n, KVH, L, d)
        value = values[start:end].view(run.count, run.length, kv_heads, head_dim).transpose(1, 2)  # (n, KVH, L, d)
        # The map where it is kept, and on the CPU for short rows (faster there than the fused kernel).
        explicit = run.role == "keep" or (run.length <= SHORT_ROW and hidden.device.type == "cpu")
        if run.length not in biases:
            biases[run.length] = adapter._score_bias(module, run.length, hidden.device)  # (H, L, L) or None
        attended, probs = attention(query, key, value, scaling=scaling, causal=adapter.causal, window=window,
                                    explicit=explicit, bias=biases[run.length])  # (n, H, L, d), map or None
        if run.role == "keep":
            assert probs is not None
            for k, row in enumerate(run.rows):
                call.kept[row][layer].copy_(probs[k])
        out.copy_(attended.transpose(1, 2))
    return adapter._project_out(module, context[None]), None  # (1, T, out)


def _run_rows(heads: torch.Tensor, span: slice, run: Run) -> torch.Tensor:
    """A run's rows of packed ``(1, heads, N, d)`` queries or keys, ``(n, heads, L, d)``, a view."""
    return heads[0, :, span].unflatten(1, (run.count, run.length)).transpose(0, 1)
