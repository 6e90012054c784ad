"""The model adapter interface and the patching shared by every family.

An adapter wraps the ``forward`` of each attention module of a loaded model for
the duration of one call (``capture``, ``forward``, ``forward_keeping``,
``forward_packed``), in a try/finally, so the model is the unmodified
transformers model between calls. Each entry point hands the wrapped layers a
small record of its own (``LayerCall``: ``adapters.padded``, ``adapters.packed``)
that says what every layer does; it lives on the adapter, per thread, only while
the call runs. Use one adapter per
loaded model.

A family gives a layer's queries and keys (``_queries_keys``: position-encoded,
GQA as the model has it, the same shapes for padded and packed rows); the
attention after them is ``adapters.attention``, once for every family.

Inside a patched padded call, each attention layer splits the batch:

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
end in one sequence, nothing padded. ``forward_patched`` runs a record of the
caller's own (the evaluation harness's planned forwards), with ``row_maps`` and
``replay_rows`` as the layer's parts.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from operator import attrgetter
from typing import Any, ClassVar, Literal, Protocol

import torch
from torch import nn

from attnstore.errors import MapShapeError, UnsupportedModelError
from attnstore.projector.embedding_layer import EmbeddingLayer
from attnstore_client.adapters.attention import attention_probs
from attnstore_client.adapters.batch import Batch
from attnstore_client.adapters.capabilities import FULL, Capabilities
from attnstore_client.adapters.fused import FusedLinears, fused_linears_available, onednn_pays, padded_tokens
from attnstore_client.adapters.packed import PackedBatch, plan_packed, with_filler
from attnstore_client.adapters.padded import Capturing, Keeping, Replaying
from attnstore_client.adapters.replay import ReplayMaps, apply_maps, check_replay
from attnstore_client.adapters.steps import DecoderSteps
from attnstore_client.models import LoadedModel


@dataclass(frozen=True)
class Capture:
    """Per row of a batch, at the row's true length (no padding)."""

    maps: list[torch.Tensor]  # per row: (layers, heads, L, L) fp32
    hidden: list[torch.Tensor]  # per row: (L, hidden) fp32 last hidden states


class LayerCall(Protocol):
    """What every attention layer of one patched forward runs instead of the module's own forward."""

    def attend(
        self, adapter: Adapter, layer: int, module: nn.Module, original: Callable[..., Any], args: tuple, kwargs: dict
    ) -> tuple:
        """The module's output for its call ``args``/``kwargs``; ``original`` is the module's own forward."""
        ...


class Adapter(ABC):
    """Capture and replay of attention maps for one loaded model.

    Attributes:
        family: the attention layout (``"llama"``: RoPE, GQA, a decoder's modules; ``"bert"``: an encoder's;
            ``"generic"``: none known, the model's own forward only, ``adapters.generic``). Whether the attention
            is causal is ``causal``'s to say (EmbeddingGemma: Llama's layout, bidirectional).
        causal: whether the model is causal: a map of stored length ``L' > L`` may be cropped, and a prefix's keys
            and values do not depend on what follows it.
        attention_path: the module wrapped in each block, as a dotted attribute path.
        num_layers, num_heads, num_kv_heads, head_dim, hidden_size: the layout.

    A family implements six hooks (``_blocks``, ``_embed``, ``_run_packed``,
    ``_queries_keys``, ``_values``, ``embedding_layer``) and overrides the defaults below them where its
    model differs (``_project_out``, ``_sliding_window``, ``_score_bias``, ``_fusable``; a causal family
    ``capabilities`` and ``decoder_steps`` for the prefix and chunk tiers).
    """

    family: ClassVar[Literal["llama", "bert", "generic"]]
    causal: ClassVar[bool]
    attention_path: ClassVar[str]
    # Whether its forwards feed a batch's token types to the model (BERT's segments of a text pair); a family that
    # does not refuses a batch that has them (``_check_token_types``) rather than computing it as one segment.
    takes_token_types: ClassVar[bool] = False

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
    def _embed(self, batch: Batch) -> torch.Tensor:
        """The feature source of the whole batch, ``(B, P, hidden)``."""

    @abstractmethod
    def _run_packed(self, batch: PackedBatch) -> torch.Tensor:
        """The model's forward on a packed batch (positions from ``batch.position_ids``); ``(T, hidden)``."""

    @abstractmethod
    def _queries_keys(
        self, module: nn.Module, hidden: torch.Tensor, args: tuple, kwargs: dict, tokens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's queries ``(B, H, N, d)`` and keys ``(B, KVH, N, d)``, position-encoded as the model does.

        Args:
            module: the layer's attention module.
            hidden: ``(B, T, hidden)`` its input: right-padded rows, or a packed batch as one row (``B = 1``);
                ``T`` may be shorter than the call's own (the keys past it are never read).
            args, kwargs: the module call's own arguments (``hidden_states`` included), for RoPE tables and the
                like; per-row tensors hold the rows of ``hidden``.
            tokens: ``(N,)`` long, the positions along ``T`` to compute (a packed forward's computing rows);
                None: all of them (``N = T``).
        """

    @abstractmethod
    def _values(self, module: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """Value projection, ``(..., T, hidden) -> (..., T, KVH*d)``."""

    @abstractmethod
    def embedding_layer(self) -> EmbeddingLayer:
        """The model's feature source (``feature_source``) as tensors, which a daemon keeps with the namespace's
        projector to derive written-back rows' features itself (``attnstore.projector.embedding_layer``).

        Raises:
            UnsupportedModelError: the adapter has no feature source.
        """

    # Defaults, overridden where a family's model differs.

    def _attention_modules(self) -> Sequence[nn.Module]:
        """The module wrapped in each layer, in layer order."""
        return [attrgetter(self.attention_path)(block) for block in self._blocks()]

    def _run(self, batch: Batch) -> torch.Tensor:
        """The model's own forward on the batch; returns ``(B, P, hidden)`` last hidden states."""
        types = {} if batch.token_type_ids is None else {"token_type_ids": batch.token_type_ids}
        output = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False, **types)
        return output.last_hidden_state  # (B, P, hidden)

    def _check_token_types(self, batch: Batch | PackedBatch) -> None:
        """Refuse a batch with token types where this family's forwards would drop them (``takes_token_types``).

        Raises:
            UnsupportedModelError: the batch has token types and the family takes none.
        """
        if batch.token_type_ids is not None and not self.takes_token_types:
            raise UnsupportedModelError(
                f"{self.loaded.name!r} ({self.family}, model_type {self.model.config.model_type!r}): its adapter does"
                " not feed token types (a text pair's segments) to the model; families that do: bert, generic")

    def _project_out(self, module: nn.Module, context: torch.Tensor) -> torch.Tensor:
        """What the module returns for a context ``(..., T, H*d)``: the context itself, unless the family's module
        projects it (``o_proj``)."""
        return context

    def _sliding_window(self, module: nn.Module) -> int | None:
        """The layer's attention window, None for full attention."""
        return None

    def _fusable(self) -> Mapping[nn.Module, nn.Linear]:
        """Modules that are a linear layer then an activation oneDNN fuses (see ``adapters.fused``)."""
        return {}

    def _scaling(self, module: nn.Module) -> float:
        """The layer's score scale."""
        return float(getattr(module, "scaling", self.head_dim**-0.5))

    def _score_bias(self, module: nn.Module, length: int, device: torch.device) -> torch.Tensor | None:
        """What the layer adds to the scaled scores of a row of ``length`` tokens before the softmax, ``(H, L, L)``
        (a relative position bias), or None; a replayed map holds it already."""
        return None

    # --- public API -----------------------------------------------------------------

    @property
    def capabilities(self) -> Capabilities:
        """What this adapter can do beyond the model's own forward (``adapters.capabilities``): the tiers ask it."""
        return FULL

    def _require_layout(self, missing: Sequence[str], layout: str, supported: str) -> None:
        """Refuse a model whose attention modules lack what the family's ``layout`` needs (``missing``, by name).

        Raises:
            UnsupportedModelError: ``missing`` is not empty; the message names the module type and what it lacks.
        """
        if missing:
            raise UnsupportedModelError(f"{type(self._modules[0]).__name__} lacks {layout} (missing {list(missing)});"
                                        f" supported: {supported}")

    def decoder_steps(self) -> DecoderSteps:
        """The model's forward one step at a time (``adapters.steps``), for the chunk tier's fused forward.

        Raises:
            UnsupportedModelError: the family gives none (a bidirectional model, or no adapter), or the model
                cannot share keys and values (``Capabilities.can_share_kv``).
        """
        raise UnsupportedModelError(f"the chunk tier's fused forward needs a causal model's adapter that runs it in"
                                    f" steps; {self.loaded.name!r} ({self.family}) has none")

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
        self._check_token_types(batch)
        with torch.no_grad(), self._patched(Capturing(batch.lengths, captured)):
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
        return self._forward(batch, dict(replay or {}))

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
            return self._forward(batch, replay), {}
        computing = tuple(row for row in range(batch.size) if row not in replay)
        padded = max(batch.lengths[row] for row in computing)
        # Every layer's padded maps of the kept rows, in one buffer: one copy per layer, sliced per row at the end.
        kept = torch.empty((self.num_layers, len(rows), self.num_heads, padded, padded), dtype=torch.float16)
        keeping = Keeping(
            rows=computing,
            index=torch.tensor(computing) if len(computing) < batch.size else None,
            kept=kept,
            kept_index=torch.tensor([computing.index(row) for row in rows]) if len(rows) < len(computing) else None,
        )
        out = self._forward(batch, replay, keeping)
        return out, {
            row: kept[:, k, :, : batch.lengths[row], : batch.lengths[row]].clone() for k, row in enumerate(rows)
        }  # row -> (layers, H, L, L)

    def _forward(self, batch: Batch, replay: dict[int, ReplayMaps], keeping: Keeping | None = None) -> torch.Tensor:
        check_replay(replay, batch.lengths, layers=self.num_layers, heads=self.num_heads, causal=self.causal)
        self._check_token_types(batch)
        with torch.inference_mode():
            if not replay and keeping is None:
                return self._run(batch)
            rows = tuple(sorted((*replay, *(keeping.rows if keeping else ()))))
            misses = tuple(row for row in range(batch.size) if row not in rows)
            split = (torch.tensor(rows), torch.tensor(misses)) if misses else None
            with self._patched(Replaying(batch.lengths, replay, keeping, rows, split)):
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
        self._check_token_types(batch)
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

    def release_fused_linears(self) -> None:
        """Run packed forwards on torch's own linear kernels from now on, and give back oneDNN's reordered copy of
        the weights (``adapters.fused``: as large as the linear layers). For a model whose computed rows a graph
        engine runs (``tiers.engines.selection``): its own forwards are then only the maps', too few to pay for a
        second copy of its weights. A forward running on the copy keeps it until it ends."""
        with self._fused_lock:
            self.fused_linears = False
            self._fused = None

    def _fused_linears(self) -> FusedLinears | None:
        """oneDNN's linear kernels for packed forwards, where they are there and wanted (``linear_kernels``)."""
        if self.linear_kernels != "onednn":
            return None
        with self._fused_lock:  # forwards side by side: the weights are reordered once
            if self._fused is None:
                self._fused = FusedLinears(self.model, self._fusable())
            return self._fused

    def forward_patched(self, batch: Batch, call: LayerCall) -> torch.Tensor:
        """One forward of the padded batch in which every attention layer runs ``call.attend``.

        For forwards outside this library (the evaluation harness's planned forwards): ``row_maps`` and
        ``replay_rows`` are the parts a layer is made of; rows that ``call`` sends through ``original`` are the
        model's own. Only ``attnstore_tools.eval.planned`` calls it; it stays on the adapter because it patches
        the adapter's attention modules (``_patched``, ``_run``: no code outside ``adapters/`` names a model's
        modules) and a family that cannot patch refuses it by name (``generic``, ``modernbert``).

        Returns:
            ``(B, P, hidden)`` last hidden states; pad positions hold no meaning.
        """
        with torch.inference_mode(), self._patched(call):
            return self._run(batch)

    def row_maps(
        self, module: nn.Module, hidden: torch.Tensor, lengths: Sequence[int], args: tuple, kwargs: dict
    ) -> Iterator[torch.Tensor]:
        """Yield each row's attention probabilities at one layer, ``(H, L, L)`` fp32 at its true length.

        What ``capture`` keeps: the explicit softmax of the module's own queries and keys, one row at a time,
        sliced to the row's true length (which drops the pad keys the model's mask would hide).

        Args:
            module: the layer's attention module.
            hidden: ``(B, P, hidden)`` its input.
            lengths: every row's true length.
            args, kwargs: the module call's own arguments.
        """
        query, key = self._queries_keys(module, hidden, args, kwargs)  # (B, H, P, d), (B, KVH, P, d)
        scaling, window = self._scaling(module), self._sliding_window(module)
        for row, length in enumerate(lengths):
            yield attention_probs(
                query[row : row + 1, :, :length], key[row : row + 1, :, :length], scaling=scaling,
                causal=self.causal, window=window, bias=self._score_bias(module, length, query.device),
            )[0]  # (H, L, L)

    def replay_rows(
        self, module: nn.Module, hidden: torch.Tensor, maps: Sequence[torch.Tensor], lengths: Sequence[int]
    ) -> torch.Tensor:
        """The hit path of one layer: value projection, maps·V per row, output projection.

        Args:
            module: the layer's attention module.
            hidden: ``(B', P, hidden)`` the input of the rows that replay.
            maps: per row ``(H, L, L)`` in ``hidden``'s dtype.
            lengths: per row its true length ``L``.

        Returns:
            What the module returns for those rows, ``(B', P, out)``; pad positions hold zeros or values nobody reads.
        """
        values = self._values(module, hidden)  # (B', P, KVH*d)
        rows, padded, _ = values.shape
        shape = (rows, padded, self.num_heads * self.head_dim)
        # Pad positions are never read, but keep them finite for the layers after.
        context = values.new_empty(shape) if min(lengths) == padded else values.new_zeros(shape)  # (B', P, H*d)
        apply_maps(maps, values, lengths, out=context, causal=self.causal)
        return self._project_out(module, context)

    # --- patching -------------------------------------------------------------------

    @contextmanager
    def _patched(self, call: LayerCall) -> Iterator[None]:
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
        """The wrapped attention forward: this thread's call decides, or the module's own forward where none runs."""
        call: LayerCall | None = getattr(self._calls, "current", None)
        if call is None:
            return original(*args, **kwargs)
        return call.attend(self, layer, module, original, args, kwargs)
