"""Next-token choice scoring for decoders: which of a few single-token answers each prompt's next
token prefers (classification, multiple choice)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from attnstore.errors import ConfigError


@dataclass(frozen=True, slots=True)
class ChoiceScores:
    """Which choice each prompt's next token prefers."""

    index: np.ndarray  # (n,) int64: the most probable choice per prompt
    probabilities: np.ndarray  # (n, choices) float32: softmax over the choices' next-token logits


def choice_ids(tokenizer: PreTrainedTokenizerBase, choices: Sequence[str]) -> list[int]:
    """The token id of each choice.

    Raises:
        ConfigError: fewer than two choices, or a choice that is not exactly one token.
    """
    if isinstance(choices, str) or len(choices) < 2:
        raise ConfigError(f"score_choices(): give at least two choices as a sequence, got {choices!r}")
    ids = []
    for choice in choices:
        tokens = tokenizer(choice, add_special_tokens=False)["input_ids"]
        if len(tokens) != 1:
            raise ConfigError(f"score_choices(): choice {choice!r} is {len(tokens)} tokens; each must be one token")
        ids.append(tokens[0])
    return ids


def next_token_choice(lm_head: nn.Module, last: torch.Tensor, ids: Sequence[int]) -> ChoiceScores:
    """The choices' next-token probabilities from each prompt's last hidden state ``last`` ``(n, hidden)``."""
    with torch.inference_mode():
        logits = lm_head(last)[:, list(ids)]  # (n, choices)
    probabilities = torch.softmax(logits.float(), dim=-1).cpu().numpy()
    return ChoiceScores(index=probabilities.argmax(axis=1), probabilities=probabilities)
