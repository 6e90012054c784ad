"""Next-token choice scoring for decoders: which of a few single-token answers each prompt's next
token prefers (classification, multiple choice)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from attnstore.errors import ConfigError, UnsupportedModelError
from attnstore_client.call.sinks import LastStates, Sink
from attnstore_client.call.sources import Prompt, RowSource, TextRows, segment_tokens
from attnstore_client.models import LoadedModel


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


def label_probabilities(lm_head: nn.Module, last: torch.Tensor, ids: Sequence[int], *,
                        over_labels: bool) -> torch.Tensor:
    """The label tokens' next-token probabilities from last hidden states ``last`` ``(n, hidden)``, fp32 ``(n, k)``.

    Args:
        lm_head: the decoder's output head (a linear layer: only the labels' rows are used when ``over_labels``).
        last: each prompt's last hidden state.
        ids: the label token ids.
        over_labels: softmax over the labels' logits (SGLang's ``apply_softmax``); else each label's
            probability over the whole vocabulary.
    """
    ids = list(ids)
    with torch.inference_mode():
        last = last.float()
        if isinstance(lm_head, nn.Linear):
            weight = lm_head.weight.float()  # (vocab, hidden)
            bias = None if lm_head.bias is None else lm_head.bias.float()
            if over_labels:
                logits = last @ weight[ids].T  # (n, k): the labels' rows of the head only
                if bias is not None:
                    logits = logits + bias[ids]
                return torch.softmax(logits, dim=-1)
            logits = torch.nn.functional.linear(last, weight, bias)  # (n, vocab)
        else:  # a head of its own kind: run it, then read the labels
            logits = lm_head(last).float()  # (n, vocab)
            if over_labels:
                return torch.softmax(logits[:, ids], dim=-1)
        return (logits[:, ids] - torch.logsumexp(logits, dim=-1, keepdim=True)).exp()  # (n, k)


def score_prompts(
    loaded: LoadedModel, prompts: str | Sequence[Prompt], choices: Sequence[str], max_length: int,
    run: Callable[[RowSource, Sink], object],
) -> ChoiceScores:
    """``AttnCache.score_choices``: the prompts' last hidden states by ``run`` (one call), then the choices' odds.

    ``prompts`` is one prompt or a sequence of them; a prompt is a string, or a list of segments (instruction,
    chunks, question; see ``sources``).

    Raises:
        UnsupportedModelError: the model is an encoder (no language-model head).
        ConfigError: fewer than two choices, or a choice that is not exactly one token.
    """
    head = loaded.lm_head
    if head is None:
        raise UnsupportedModelError(
            f"score_choices() needs a decoder with a language-model head; {loaded.name!r} is an encoder"
        )
    ids = choice_ids(loaded.tokenizer, choices)
    rows = _listed(prompts)
    if not rows:
        return ChoiceScores(index=np.zeros(0, dtype=np.int64), probabilities=np.zeros((0, len(ids)), np.float32))
    return next_token_choice(head, last_states(loaded.tokenizer, rows, max_length, run), ids)


def last_states(
    tokenizer: PreTrainedTokenizerBase, prompts: str | Sequence[Prompt], max_length: int,
    run: Callable[[RowSource, Sink], object],
) -> torch.Tensor:
    """``AttnCache.last_hidden_states``: each prompt's last hidden state ``(n, hidden)`` by ``run`` (one call into
    a ``LastStates`` sink; ``(0, 0)`` for no prompts).

    A plain prompt is tokenized with special tokens and truncated to ``max_length``; a prompt in segments
    is tokenized segment by segment (``sources.segment_tokens``).
    """
    rows = _listed(prompts)
    if not rows:
        return torch.zeros((0, 0))

    def tokenize(batch: list[str]) -> list[list[int]]:
        return tokenizer(batch, truncation=True, max_length=max_length, add_special_tokens=True)["input_ids"]

    last = LastStates(len(rows))
    run(TextRows(rows, tokenize, partial(segment_tokens, tokenizer, max_length=max_length)), last)
    return last.result()


def _listed(prompts: str | Sequence[Prompt]) -> list[Prompt]:
    """One prompt as a list of one; a sequence of prompts as a list."""
    return [prompts] if isinstance(prompts, str) else list(prompts)
