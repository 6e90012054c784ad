"""BERT-like encoders (BERT, RoBERTa): bidirectional self-attention, no GQA.

The wrapped module is ``layer.attention.self`` (``BertSelfAttention`` /
``RobertaSelfAttention``), which returns the attention context; the output
projection (``BertSelfOutput.dense``) runs outside it for every row. Bidirectional
maps are only valid at their exact length, so no crop.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import nn

from attnstore.errors import UnsupportedModelError
from attnstore_client.adapters.base import Adapter
from attnstore_client.batch import Batch
from attnstore_client.models import LoadedModel

_LAYOUT_ATTRIBUTES = ("query", "key", "value", "scaling")


class BertAdapter(Adapter):
    """Capture and replay for BERT and RoBERTa encoders."""

    family = "bert"
    causal = False

    def __init__(self, loaded: LoadedModel) -> None:
        config = loaded.model.config
        if getattr(config, "is_decoder", False):
            raise UnsupportedModelError(
                f"{config.model_type} configured as a decoder (is_decoder=True); supported: bidirectional encoders"
            )
        super().__init__(loaded)
        missing = [name for name in _LAYOUT_ATTRIBUTES if not hasattr(self._modules[0], name)]
        if missing:
            raise UnsupportedModelError(
                f"{type(self._modules[0]).__name__} lacks the BERT attention layout (missing {missing}); "
                "supported: BERT, RoBERTa"
            )

    def _blocks(self) -> Sequence[nn.Module]:
        return self.model.encoder.layer

    def _attention_modules(self) -> Sequence[nn.Module]:
        return [layer.attention.self for layer in self._blocks()]

    def _embed(self, batch: Batch) -> torch.Tensor:
        return self.model.embeddings(input_ids=batch.input_ids)  # (B, P, hidden)

    def _run(self, batch: Batch) -> torch.Tensor:
        output = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
        return output.last_hidden_state  # (B, P, hidden)

    def _values(self, module: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return module.value(hidden)  # (B, P, H*d)

    def _project_out(self, module: nn.Module, context: torch.Tensor) -> torch.Tensor:
        return context  # (B, P, H*d): BertSelfOutput.dense follows outside the wrapped module

    def _attention_probs(
        self, module: nn.Module, hidden: torch.Tensor, lengths: Sequence[int], args: tuple, kwargs: dict
    ) -> Iterator[torch.Tensor]:
        batch_size, padded, _ = hidden.shape
        shape = (batch_size, padded, self.num_heads, self.head_dim)
        query = module.query(hidden).view(shape).transpose(1, 2)  # (B, H, P, d)
        key = module.key(hidden).view(shape).transpose(1, 2)  # (B, H, P, d)
        for row, length in enumerate(lengths):
            # Slicing to the true length drops the pad keys the model's mask would hide.
            scores = torch.matmul(query[row, :, :length], key[row, :, :length].transpose(1, 2))  # (H, L, L)
            yield torch.softmax(scores * module.scaling, dim=-1, dtype=torch.float32)  # (H, L, L)
