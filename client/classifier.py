"""A sequence-classification model's head, run on last hidden states its base model gave elsewhere (cross-encoders).

A ``*ForSequenceClassification`` model is a base model (``.bert``, ``.model``, ``.distilbert``... : its
``base_model_prefix``), which the adapters run and the tiers serve, and a head after it: BERT's pooler (first token,
dense, tanh) and classifier, DistilBERT's and RoBERTa's first-token heads, ModernBERT's pooling and head, a decoder's
score of its last non-pad token. The head here is always the model's own: the model's forward runs on a shell of it
whose base model is a stand-in handing back the states given, so no family's pooling or weights are written again.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPooling


@dataclass
class _BaseOutputs(BaseModelOutputWithPooling):
    """What any family's head reads of its base model's outputs: the states, BERT's pooler output, and a decoder's
    cache (none)."""

    cache: Any = None


class _GivenStates(nn.Module):
    """Stands in for the base model inside the shell: returns this thread's given states (and BERT's pooler output,
    the pooler being the base model's own module, where it has one)."""

    def __init__(self, pooler: nn.Module | None) -> None:
        super().__init__()
        self.pooler = pooler
        self.given = threading.local()  # forwards may run on several threads at once

    def forward(self, *args: Any, **kwargs: Any) -> _BaseOutputs:
        states: torch.Tensor = self.given.states  # (B, P, hidden)
        pooled = None if self.pooler is None else self.pooler(states)  # (B, hidden)
        return _BaseOutputs(last_hidden_state=states, pooler_output=pooled)


class SequenceClassifier:
    """The classifier head of a ``*ForSequenceClassification`` model, over its base model's last hidden states.

    Args:
        model: the whole model, eval mode; its base model (``model.base_model_prefix``) is what the adapters run.
        activation_fn: the dotted path of the activation a sentence-transformers ``CrossEncoder`` folder saved
            (``torch.nn.modules.activation.Sigmoid``), or None.
        max_length: the ``max_seq_length`` such a folder saved, or None.
    """

    def __init__(self, model: PreTrainedModel, *, activation_fn: str | None = None, max_length: int | None = None,
                 ) -> None:
        self.model = model
        self.activation_fn = activation_fn
        self.max_length = max_length
        prefix = model.base_model_prefix
        base = getattr(model, prefix)
        pooler = getattr(base, "pooler", None)  # BERT keeps its pooler in the base model
        self._given = _GivenStates(pooler if isinstance(pooler, nn.Module) else None)
        # A shallow copy: the same head modules and weights (moved with ``model``), another base model.
        self._shell = copy.copy(model)
        object.__setattr__(self._shell, "_modules", OrderedDict(model._modules))
        self._shell._modules[prefix] = self._given

    @property
    def base(self) -> PreTrainedModel:
        """The base model the adapters run."""
        base = getattr(self.model, self.model.base_model_prefix)
        assert isinstance(base, PreTrainedModel)  # load_model checked it
        return base

    @property
    def num_labels(self) -> int:
        """Logits per row."""
        return int(self.model.config.num_labels or 1)  # every sequence-classification config sets it

    @property
    def pad_token_id(self) -> int | None:
        """The id a decoder's head takes for padding (its score is its last token of another id)."""
        pad: int | None = self.model.config.pad_token_id
        return pad

    def __call__(self, states: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The logits ``(B, num_labels)`` fp32 of right-padded rows.

        Args:
            states: ``(B, P, hidden)`` the base model's last hidden states.
            input_ids: ``(B, P)`` the rows' ids, padded with ``pad_token_id`` (a decoder's head reads them).
            attention_mask: ``(B, P)`` 1 on real tokens.
        """
        if self.pad_token_id is None and states.shape[0] > 1:
            # transformers' decoder heads cannot find a row's last token in a batch without a pad id: one at a time.
            lengths = attention_mask.sum(dim=1).tolist()
            return torch.cat([self(states[r : r + 1, :n], input_ids[r : r + 1, :n], attention_mask[r : r + 1, :n])
                              for r, n in enumerate(lengths)])
        self._given.given.states = states
        try:
            with torch.inference_mode():
                logits = self._shell(input_ids=input_ids, attention_mask=attention_mask).logits  # (B, num_labels)
        finally:
            self._given.given.states = None
        return logits.float()
