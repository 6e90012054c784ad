"""Any other model: the model's own forward, and nothing that needs to know its attention modules.

A ``model_type`` without a family adapter (``deberta-v2``, ``electra``, ...) still
runs: its rows go through the model's own forward on right-padded, length-sorted
batches with the model's own attention mask, so every tier that needs only
outputs works (this process's exact tier, the store's exact tier, write-back of
rows, the node's embedding routes). What needs the attention modules is off and
says so (``capabilities``): map capture and replay, packed forwards, the prefix
and chunk tiers. No adapter means slower, never refused, and never a wrong row:
a call that asks this adapter for maps is refused with the reason, not run
without them.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import NoReturn

import torch
from torch import nn

from attnstore.errors import UnsupportedModelError
from attnstore.projector.embedding_layer import EmbeddingLayer
from attnstore_client.adapters.base import Adapter, Capture, LayerCall
from attnstore_client.adapters.batch import Batch, batch_from_ids
from attnstore_client.adapters.capabilities import Capabilities
from attnstore_client.adapters.packed import PackedBatch
from attnstore_client.adapters.padded import Keeping
from attnstore_client.adapters.replay import ReplayMaps
from attnstore_client.models import LoadedModel


class GenericAdapter(Adapter):
    """The model's own forward for a bidirectional model no family adapter knows (``GenericDecoderAdapter``: a causal
    one).

    Padded forwards (``forward``) run the model as it is; ``forward_packed`` runs the packed rows as one padded
    batch (what a caller that packs gets, the same rows within float rounding); everything that needs maps raises
    ``UnsupportedModelError`` naming the model type.
    """

    family = "generic"
    causal = False
    attention_path = ""
    takes_token_types = True  # the model's own forward takes them (ELECTRA's, DeBERTa's segments)

    def __init__(self, loaded: LoadedModel) -> None:
        super().__init__(loaded)
        model_type = loaded.model.config.model_type
        self._capabilities = Capabilities(
            can_replay=False, can_pack=False, can_share_kv=False,
            missing=f"no adapter for model_type {model_type!r}: map replay, packed forwards, prefix and chunk tiers"
            " need one",
        )
        # Some models take no ``use_cache`` (encoders without a cache); pass it only to those that do.
        self._run_options = {"use_cache": False} if _takes(loaded.model, "use_cache") else {}

    @property
    def capabilities(self) -> Capabilities:
        """Nothing beyond the model's own forward (``adapters.capabilities``)."""
        return self._capabilities

    # --- the model's own forward ------------------------------------------------------

    def _run(self, batch: Batch) -> torch.Tensor:
        options = self._run_options if batch.token_type_ids is None else {
            **self._run_options, "token_type_ids": batch.token_type_ids}
        output = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, **options)
        hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        return hidden  # (B, P, hidden)

    def _forward(self, batch: Batch, replay: dict[int, ReplayMaps], keeping: Keeping | None = None) -> torch.Tensor:
        if replay or keeping is not None:
            self._refuse("map replay and capture")
        with torch.inference_mode():
            return self._run(batch)

    def forward_packed(
        self, batch: PackedBatch, replay: Mapping[int, ReplayMaps] | None = None, keep: Sequence[int] = ()
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The packed rows run as one right-padded batch of the model's own forward (no packing without an adapter).

        Returns:
            ``(T, hidden)`` last hidden states laid out as ``batch``, and no maps.

        Raises:
            UnsupportedModelError: ``replay`` or ``keep`` given (maps need an adapter).
        """
        if replay or keep:
            self._refuse("map replay and capture")
        rows = [batch.row(batch.input_ids, row).tolist() for row in range(batch.size)]
        types = None if batch.token_type_ids is None else [
            batch.row(batch.token_type_ids, row).tolist() for row in range(batch.size)]
        padded = batch_from_ids(rows, self._pad_id(), types).to(batch.input_ids.device)
        with torch.inference_mode():
            hidden = self._run(padded)  # (B, P, hidden)
        out = torch.cat([hidden[row, :length] for row, length in enumerate(batch.lengths)])  # (T, hidden)
        return out, {}

    def _pad_id(self) -> int:
        pad = getattr(self.loaded.tokenizer, "pad_token_id", None)
        return int(pad) if pad is not None else 0

    # --- what needs an adapter ----------------------------------------------------------

    def capture(self, batch: Batch) -> Capture:
        """Refused: capture needs an adapter.

        Raises:
            UnsupportedModelError: always, naming the model type.
        """
        self._refuse("map capture")

    def forward_patched(self, batch: Batch, call: LayerCall) -> torch.Tensor:
        """Refused: a patched forward needs the attention modules.

        Raises:
            UnsupportedModelError: always, naming the model type.
        """
        self._refuse("patched forwards")

    def _attention_modules(self) -> Sequence[nn.Module]:
        return []  # nothing is patched

    def _blocks(self) -> Sequence[nn.Module]:
        self._refuse("the transformer blocks")

    def _embed(self, batch: Batch) -> torch.Tensor:
        self._refuse("the feature source (a projector's input)")

    def _run_packed(self, batch: PackedBatch) -> torch.Tensor:
        self._refuse("packed forwards")

    def _queries_keys(
        self, module: nn.Module, hidden: torch.Tensor, args: tuple, kwargs: dict, tokens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._refuse("queries and keys")

    def _values(self, module: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        self._refuse("the value projection")

    def embedding_layer(self) -> EmbeddingLayer:
        self._refuse("the embedding layer (a projector's input)")

    def _refuse(self, what: str) -> NoReturn:
        raise UnsupportedModelError(f"{what} of {self.loaded.name!r}: {self._capabilities.missing}")


class GenericDecoderAdapter(GenericAdapter):
    """``GenericAdapter`` for a causal model (its namespace's layout says causal; its rows still right-padded, which
    a causal model's real positions never see)."""

    causal = True


def _takes(model: nn.Module, keyword: str) -> bool:
    """Whether ``model``'s forward names ``keyword`` as a parameter of its own."""
    try:
        return keyword in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
