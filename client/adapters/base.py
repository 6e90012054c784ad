"""The model adapter interface and the patching shared by every family.

An adapter wraps the ``forward`` of each attention module of a loaded model for
the duration of one call (``capture`` or ``forward``), in a try/finally, so the
model is the unmodified transformers model between calls. The per-call state
(lengths, replay maps, capture buffers) lives on the adapter instance; a lock
keeps concurrent calls on one adapter from interleaving. Use one adapter per
loaded model.

Inside a patched call, each attention layer splits the batch:

- hit rows (those with replay maps) compute only the value projection,
  maps·V and the output projection: no q/k projection, RoPE, QKᵀ, mask or softmax;
- miss rows go through the module's own forward (the model's ``sdpa`` or
  ``eager`` kernel) on just those rows, so they equal the baseline.

Capture runs the whole batch through the hit path with maps it computes itself
in fp32 from the module's own q/k projections, one row at a time at the row's
true length, and keeps those maps. ``forward_keeping`` does the same for some
computing rows of an ordinary forward (the rows a node writes back with their
maps): those rows take the hit path with their own maps, the others are
untouched, so only the kept rows pay for the explicit softmax.

A packed forward (``forward_packed``, ``adapters.packed``) runs the rows end to
end in one sequence, nothing padded; a planned forward (``forward_planned``,
``adapters.planned``) asks a ``LayerPlan`` at every layer which rows replay.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from attnstore.errors import MapShapeError
from attnstore_client.adapters.batch import Batch
from attnstore_client.adapters.fused import FusedLinears, fused_linears_available, onednn_pays, padded_tokens
from attnstore_client.adapters.layer_plan import LayerPlan
from attnstore_client.adapters.packed import PackedBatch, PackedCall, attend_packed, plan_packed, with_filler
from attnstore_client.adapters.planned import attend_planned
from attnstore_client.adapters.replay import ReplayMaps, apply_maps, check_replay, layer_maps
from attnstore_client.adapters.rows import merge_rows, select_rows
from attnstore_client.models import LoadedModel


@dataclass(frozen=True)
class Capture:
    """Per row of a batch, at the row's true length (no padding)."""

    maps: list[torch.Tensor]  # per row: (layers, heads, L, L) fp32
    hidden: list[torch.Tensor]  # per row: (L, hidden) fp32 last hidden states


@dataclass(frozen=True)
class _Call:
    """State of one patched forward; lives on the adapter only while the call runs."""

    lengths: tuple[int, ...]  # true length of every row
    replay: Mapping[int, ReplayMaps] = field(default_factory=dict)  # hit row -> maps
    hits: tuple[int, ...] = ()  # sorted hit rows
    # Rows that compute their own maps (fp32, explicit softmax) and take the hit path with them: when a
    # forward keeps maps, every computing row (one batched softmax costs less than splitting the batch).
    keep: tuple[int, ...] = ()  # sorted
    keep_index: torch.Tensor | None = None  # (B_keep,) long, only when some rows replay stored maps
    kept: torch.Tensor | None = None  # (layers, B_kept, H, P, P) fp16: the maps of the rows asked for, padded
    kept_index: torch.Tensor | None = None  # (B_kept,) their positions in ``keep``; None: all of ``keep``
    replaying: tuple[int, ...] = ()  # sorted hits and kept rows: the rows that take the hit path
    hit_index: torch.Tensor | None = None  # (B_replaying,) long, only when some rows miss
    miss_index: torch.Tensor | None = None  # (B_miss,) long, only when some rows miss
    captured: list[torch.Tensor] | None = None  # per row (layers, H, L, L), filled when capturing
    plan: LayerPlan | None = None  # consulted at every layer by a planned forward


class Adapter(ABC):
    """Capture and replay of attention maps for one loaded model.

    Attributes:
        family: the attention layout (``"llama"``: RoPE, GQA, causal; ``"bert"``:
            bidirectional).
        causal: whether a map of stored length ``L' > L`` may be cropped.
        num_layers, num_heads, num_kv_heads, head_dim, hidden_size: the layout.
    """

    family: ClassVar[Literal["llama", "bert"]]
    causal: ClassVar[bool]

    def __init__(self, loaded: LoadedModel) -> None:
        config = loaded.model.config
        self.loaded = loaded
        self.model = loaded.model
        self.num_layers: int = config.num_hidden_layers
        self.num_heads: int = config.num_attention_heads
        self.num_kv_heads: int = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.hidden_size: int = config.hidden_size
        self.head_dim: int = getattr(config, "head_dim", None) or self.hidden_size // self.num_heads
        self._modules: list[nn.Module] = list(self._attention_modules())
        # The call in flight on each thread: packed forwards may run side by side (``tiers.forward_pool``).
        # The wrappers stay installed while any call runs.
        self._calls = threading.local()
        self._patch_lock = threading.Lock()
        self._patches = 0
        self._own_forwards: list[Any] = []
        self._fused_lock = threading.Lock()
        # Packed forwards run the linear layers on oneDNN's kernels (adapters.fused) where they are there and,
        # with "auto", where they pay on this CPU (fused.onednn_pays); True or False forces either way.
        self.fused_linears: bool | Literal["auto"] = "auto"
        self._fused: FusedLinears | None = None

    # --- what a family provides ---------------------------------------------------

    @abstractmethod
    def _blocks(self) -> Sequence[nn.Module]:
        """The transformer blocks (decoder or encoder layers), in layer order."""

    @abstractmethod
    def _attention_modules(self) -> Sequence[nn.Module]:
        """The module wrapped in each layer, in layer order."""

    @abstractmethod
    def _embed(self, batch: Batch) -> torch.Tensor:
        """The feature source of the whole batch, ``(B, P, hidden)``."""

    @abstractmethod
    def _run(self, batch: Batch) -> torch.Tensor:
        """The model's own forward on the batch; returns ``(B, P, hidden)`` last hidden states."""

    @abstractmethod
    def _attention_probs(
        self, module: nn.Module, hidden: torch.Tensor, lengths: Sequence[int], args: tuple, kwargs: dict
    ) -> Iterator[torch.Tensor]:
        """Yield each row's attention probabilities, ``(H, L, L)`` fp32 at its true length.

        ``hidden`` is ``(B, P, hidden)``; ``args``/``kwargs`` are the module call's
        own arguments (``hidden_states`` included), for RoPE tables and the like.
        """

    @abstractmethod
    def _padded_probs(
        self, module: nn.Module, hidden: torch.Tensor, lengths: Sequence[int], args: tuple, kwargs: dict
    ) -> torch.Tensor:
        """Every row's attention probabilities at once, ``(B, H, P, P)`` fp32.

        Row ``r``'s top-left ``L x L`` block is what ``_attention_probs`` yields for it
        (pad keys get no weight); the rest holds no meaning. One batched softmax instead
        of one per row: what keeping maps in an ordinary forward uses, where the rows are
        length-sorted and pad little.
        """

    @abstractmethod
    def _run_packed(self, batch: PackedBatch) -> torch.Tensor:
        """The model's forward on a packed batch (positions from ``batch.position_ids``); ``(T, hidden)``."""

    @abstractmethod
    def _packed_queries_keys(
        self, module: nn.Module, hidden: torch.Tensor, index: torch.Tensor | None, args: tuple, kwargs: dict
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries ``(N, H, d)`` and keys ``(N, KVH, d)``, position-encoded, of the tokens ``index`` (None: all)
        of a packed layer input ``hidden`` ``(T, hidden)``; ``args``/``kwargs`` are the module call's own."""

    def _sliding_window(self, module: nn.Module) -> int | None:
        """The layer's attention window, None for full attention."""
        return None

    def _fusable(self) -> Mapping[nn.Module, nn.Linear]:
        """Modules that are a linear layer then an activation oneDNN fuses (see ``adapters.fused``)."""
        return {}

    @abstractmethod
    def _values(self, module: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """Value projection, ``(B, P, hidden) -> (B, P, KVH*d)``."""

    @abstractmethod
    def _project_out(self, module: nn.Module, context: torch.Tensor) -> torch.Tensor:
        """What the module returns for a context ``(B, P, H*d)``: ``o_proj`` or nothing."""

    # --- public API -----------------------------------------------------------------

    @property
    def blocks(self) -> tuple[nn.Module, ...]:
        """The transformer blocks, in layer order (for timing hooks and the like)."""
        return tuple(self._blocks())

    @property
    def attention_modules(self) -> tuple[nn.Module, ...]:
        """The attention module of each layer whose forward replay wraps, in layer order."""
        return tuple(self._modules)

    def feature_source(self, batch: Batch) -> list[torch.Tensor]:
        """Return each row's input embedding (the projector's input), ``(L, hidden)`` fp32.

        The input embedding is token (+position/type) embeddings and the first
        norm: BERT's embeddings output including its LayerNorm; for Llama the
        layer-0 ``input_layernorm`` of ``embed_tokens``.
        """
        with torch.no_grad():
            embedded = self._embed(batch)  # (B, P, hidden)
        return [embedded[row, :length].clone() for row, length in enumerate(batch.lengths)]

    def capture(self, batch: Batch) -> Capture:
        """Run the batch and return each row's fp32 maps and last hidden states.

        Maps are computed from the model's own q/k (after RoPE), per row at its
        true length, so no padding row or column is ever in them.
        """
        captured = [
            torch.empty((self.num_layers, self.num_heads, length, length), dtype=torch.float32)
            for length in batch.lengths
        ]
        with torch.no_grad(), self._patched(_Call(lengths=batch.lengths, captured=captured)):
            hidden = self._run(batch)  # (B, P, hidden)
        return Capture(
            maps=captured,
            hidden=[hidden[row, :length].clone() for row, length in enumerate(batch.lengths)],
        )

    def forward(self, batch: Batch, replay: Mapping[int, ReplayMaps] | None = None) -> torch.Tensor:
        """One forward of the whole batch in which the rows in ``replay`` replay maps.

        Args:
            batch: the right-padded batch.
            replay: row index -> that row's maps, either a tensor
                ``(layers, heads, L', L')`` or a per-layer sequence of
                ``(heads, L', L')`` tensors (it may block until a layer arrives).
                ``L' == L`` for bidirectional models, ``L' >= L`` for causal ones
                (the top-left ``L x L`` block is used). fp32/fp16/bf16 maps are
                cast to the compute dtype one layer at a time.

        Returns:
            ``(B, P, hidden)`` last hidden states; pad positions hold no meaning.

        Raises:
            MapShapeError: maps of the wrong type, dtype, layers, heads or length;
                for full tensors before any compute, for lazy sequences when the
                bad layer is reached.
        """
        return self._forward(batch, dict(replay or {}), ())

    def forward_keeping(
        self, batch: Batch, keep: Sequence[int], replay: Mapping[int, ReplayMaps] | None = None
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """``forward``, keeping the attention maps of the computing rows in ``keep``.

        A kept row's maps are computed as ``capture`` computes them (fp32, from the
        module's own q/k; pad keys get no weight) and applied through the hit path,
        so its outputs are the ones its kept maps give. The other computing rows
        take the same path (one batched softmax for all of them costs less than
        splitting the batch at every layer) with their maps dropped, so their
        outputs equal ``forward``'s within float rounding; replaying rows are as in
        ``forward``.

        Args:
            batch: the right-padded batch.
            keep: batch rows whose maps to keep; none of them may be in ``replay``.
            replay: as in ``forward``.

        Returns:
            ``(B, P, hidden)`` last hidden states, and per kept row its maps
            ``(layers, heads, L, L)`` fp16 (what a store keeps).

        Raises:
            MapShapeError: as ``forward``; or a row to keep outside the batch or also replaying.
        """
        replay = dict(replay or {})
        rows = sorted(set(keep))
        bad = [row for row in rows if not (isinstance(row, int) and 0 <= row < batch.size) or row in replay]
        if bad:
            raise MapShapeError(
                f"forward_keeping(): rows {bad} cannot keep their maps: a row to keep is a computing row of this"
                f" batch (0..{batch.size - 1}), not a replaying one"
            )
        if not rows:
            return self._forward(batch, replay, ()), {}
        computing = tuple(row for row in range(batch.size) if row not in replay)
        padded = max(batch.lengths[row] for row in computing)
        # Every layer's padded maps of the kept rows, in one buffer: one copy per layer, sliced per row at the end.
        kept = torch.empty((self.num_layers, len(rows), self.num_heads, padded, padded), dtype=torch.float16)
        out = self._forward(batch, replay, computing, kept, [computing.index(row) for row in rows])
        return out, {
            row: kept[:, k, :, : batch.lengths[row], : batch.lengths[row]].clone() for k, row in enumerate(rows)
        }  # row -> (layers, H, L, L)

    def _forward(
        self, batch: Batch, replay: dict[int, ReplayMaps], keep: tuple[int, ...], kept: torch.Tensor | None = None,
        kept_positions: Sequence[int] = (),
    ) -> torch.Tensor:
        check_replay(replay, batch.lengths, layers=self.num_layers, heads=self.num_heads, causal=self.causal)
        with torch.inference_mode():
            if not replay and not keep:
                return self._run(batch)
            hits = tuple(sorted(replay))
            replaying = tuple(sorted(hits + keep))
            misses = tuple(row for row in range(batch.size) if row not in replaying)
            call = _Call(lengths=batch.lengths, replay=replay, hits=hits, keep=keep, kept=kept, replaying=replaying)
            if keep and len(keep) < batch.size:
                call = replace(call, keep_index=torch.tensor(keep))
            if len(kept_positions) < len(keep):
                call = replace(call, kept_index=torch.tensor(kept_positions))
            if misses:
                call = replace(call, hit_index=torch.tensor(replaying), miss_index=torch.tensor(misses))
            with self._patched(call):
                return self._run(batch)

    def forward_packed(
        self, batch: PackedBatch, replay: Mapping[int, ReplayMaps] | None = None, keep: Sequence[int] = ()
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """One forward of a packed batch (``adapters.packed``): what ``forward`` and ``forward_keeping`` give
        for the same rows padded, within float rounding, with no work spent on padding.

        Args:
            batch: the rows end to end.
            replay: as in ``forward``: row -> its maps; those rows compute no q/k.
            keep: computing rows whose maps to keep (as ``forward_keeping``).

        Returns:
            ``(T, hidden)`` last hidden states (row ``r`` is ``batch.row(out, r)``), and per kept row its maps
            ``(layers, heads, L, L)`` fp16.

        Raises:
            MapShapeError: as ``forward_keeping``.
        """
        fused = self._fused_linears()
        tokens = batch.tokens
        if fused is not None:  # oneDNN keeps a kernel per token count: round it once, with filler rows
            batch = with_filler(batch, padded_tokens(tokens) - tokens)
        call = plan_packed(batch, dict(replay or {}), keep, layers=self.num_layers, heads=self.num_heads,
                           causal=self.causal)
        with torch.inference_mode(), self._patched(call), fused.installed() if fused else nullcontext():
            out = self._run_packed(batch)[:tokens]  # (T, hidden)
        return out, dict(call.kept)

    @property
    def linear_kernels(self) -> Literal["onednn", "torch"]:
        """What packed forwards run the linear layers on (``fused_linears``)."""
        wanted = onednn_pays() if self.fused_linears == "auto" else self.fused_linears
        return "onednn" if wanted and fused_linears_available(self.model) else "torch"

    def _fused_linears(self) -> FusedLinears | None:
        """oneDNN's linear kernels for packed forwards, where they are there and wanted (``linear_kernels``)."""
        if self.linear_kernels != "onednn":
            return None
        with self._fused_lock:  # forwards side by side: the weights are reordered once
            if self._fused is None:
                self._fused = FusedLinears(self.model, self._fusable())
            return self._fused

    def forward_planned(self, batch: Batch, plan: LayerPlan) -> torch.Tensor:
        """One forward of the whole batch in which ``plan`` decides, layer by layer, which rows replay.

        At each layer the plan sees the attention input and names the rows that
        replay and their maps; the other rows compute. If the plan keeps the
        layer, the computing rows' maps are computed in fp32 at each row's true
        length (as ``capture`` does), handed to ``plan.keep`` and applied through
        the hit path; otherwise those rows go through the module's own forward.

        Args:
            batch: the right-padded batch.
            plan: the per-layer decisions, for this call only.

        Returns:
            ``(B, P, hidden)`` last hidden states; pad positions hold no meaning.

        Raises:
            MapShapeError: the plan named a row outside the batch, or gave maps of
                the wrong type, dtype, heads or length.
        """
        with torch.inference_mode(), self._patched(_Call(lengths=batch.lengths, plan=plan)):
            return self._run(batch)

    # --- patching -------------------------------------------------------------------

    @contextmanager
    def _patched(self, call: _Call | PackedCall) -> Iterator[None]:
        """Within the block, this thread's forwards run ``call``; the model is as it was once no call runs."""
        with self._patch_lock:
            if not self._patches:
                self._own_forwards = [module.__dict__.get("forward") for module in self._modules]
                for layer, module in enumerate(self._modules):
                    module.forward = partial(self._attend, layer, module, module.forward)
            self._patches += 1
        self._calls.current = call
        try:
            yield
        finally:
            self._calls.current = None
            with self._patch_lock:
                self._patches -= 1
                if not self._patches:
                    for module, own in zip(self._modules, self._own_forwards, strict=True):
                        if own is None:
                            module.__dict__.pop("forward", None)
                        else:
                            module.forward = own

    def _attend(self, layer: int, module: nn.Module, original: Any, *args: Any, **kwargs: Any) -> tuple:
        """The wrapped attention forward: split rows into replayed hits and computed misses."""
        call = getattr(self._calls, "current", None)
        if call is None:
            return original(*args, **kwargs)
        if isinstance(call, PackedCall):
            return attend_packed(self, layer, module, call, args, kwargs)
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]  # (B, P, hidden)
        batch_size = hidden.shape[0]

        if call.captured is not None:
            maps = []
            for row, probs in enumerate(self._attention_probs(module, hidden, call.lengths, args, kwargs)):
                call.captured[row][layer].copy_(probs)  # kept fp32 on the CPU, whatever the model's device and dtype
                maps.append(probs.to(hidden.dtype))  # (H, L, L), replayed where and as the model runs
            return self._replay_rows(module, hidden, maps, call.lengths), None
        if call.plan is not None:
            return attend_planned(self, layer, module, original, call.plan, call.lengths, hidden, args, kwargs)

        lengths = [call.lengths[row] for row in call.replaying]
        hit_index, miss_index = call.hit_index, call.miss_index  # both set, or neither (no row misses)
        if hit_index is None or miss_index is None:
            maps = self._replaying_maps(call, layer, module, hidden, args, kwargs)
            return self._replay_rows(module, hidden, maps, lengths), None
        # Misses first: a streaming client's hit maps keep arriving meanwhile.
        # (B_miss, P, out)
        missed = original(*select_rows(args, miss_index, batch_size), **select_rows(kwargs, miss_index, batch_size))[0]
        maps = self._replaying_maps(call, layer, module, hidden, args, kwargs)
        replayed = self._replay_rows(module, hidden.index_select(0, hit_index), maps, lengths)  # (B_rep, P, out)
        return merge_rows(batch_size, hit_index, replayed, miss_index, missed), None

    def _replaying_maps(
        self, call: _Call, layer: int, module: nn.Module, hidden: torch.Tensor, args: tuple, kwargs: dict
    ) -> list[torch.Tensor]:
        """The maps of every replaying row at ``layer`` in row order, ``(H, L, L)`` each in the compute dtype:
        the hits' stored maps, and the kept rows' own, computed here and kept."""
        maps = dict(zip(call.hits, self._hit_maps(call, layer, hidden.dtype), strict=True))
        if call.keep and call.kept is not None:
            index, batch_size = call.keep_index, hidden.shape[0]
            lengths = [call.lengths[row] for row in call.keep]
            padded = call.kept.shape[-1]
            probs = self._padded_probs(
                module,
                (hidden if index is None else hidden.index_select(0, index))[:, :padded],  # (B_keep, P_keep, hidden)
                lengths,
                args if index is None else select_rows(args, index, batch_size),
                kwargs if index is None else select_rows(kwargs, index, batch_size),
            )  # (B_keep, H, P_keep, P_keep) fp32
            call.kept[layer].copy_(probs if call.kept_index is None else probs.index_select(0, call.kept_index))
            applied = probs.to(hidden.dtype)
            for k, (row, length) in enumerate(zip(call.keep, lengths, strict=True)):
                maps[row] = applied[k, :, :length, :length]  # (H, L, L)
        return [maps[row] for row in call.replaying]

    def _hit_maps(self, call: _Call, layer: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """The replayed maps of every hit row at ``layer``, ``(H, L, L)`` each in ``dtype``."""
        return [
            layer_maps(
                call.replay[row], row, layer, call.lengths[row], heads=self.num_heads, causal=self.causal, dtype=dtype
            )
            for row in call.hits
        ]

    def _replay_rows(
        self, module: nn.Module, hidden: torch.Tensor, maps: Sequence[torch.Tensor], lengths: Sequence[int]
    ) -> torch.Tensor:
        """The hit path of one layer: value projection, maps·V per row, output projection."""
        values = self._values(module, hidden)  # (B', P, KVH*d)
        rows, padded, _ = values.shape
        shape = (rows, padded, self.num_heads * self.head_dim)
        # Pad positions are never read, but keep them finite for the layers after.
        context = values.new_empty(shape) if min(lengths) == padded else values.new_zeros(shape)  # (B', P, H*d)
        apply_maps(maps, values, lengths, out=context, causal=self.causal)
        return self._project_out(module, context)

