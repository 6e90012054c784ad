"""sentence-transformers' ``CrossEncoder.predict`` and ``rank`` over a call: text pairs scored by a
sequence-classification model's own head.

A pair is tokenized as ``CrossEncoder`` tokenizes it (the two texts as a text pair,
``truncation="longest_first"`` to the model's ``max_seq_length``), token types included where the
model's embeddings have them (BERT: 1 on the second text's tokens; such a row is keyed by them too,
``keys.token_hash``). The rows go through the cache's call like ``encode``'s; each served row's last
hidden states go through the classifier head (``attnstore_client.classifier``) in the ``Scores`` sink,
and the activation follows: the one the model's folder saved, else Sigmoid for one label and none for
several, as ``CrossEncoder.activation_fn`` is chosen.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from attnstore.errors import ConfigError, UnsupportedModelError
from attnstore_client.call.rows import HiddenRows
from attnstore_client.call.sinks import Sink
from attnstore_client.call.sources import RowSource, TextRows, Tokenized
from attnstore_client.classifier import SequenceClassifier
from attnstore_client.models import LoadedModel

log = logging.getLogger(__name__)

Pair = Sequence[str]  # (query, document): two texts
Scored = np.ndarray | torch.Tensor | list[torch.Tensor]


def classifier_of(loaded: LoadedModel, method: str) -> SequenceClassifier:
    """The model's classifier head.

    Raises:
        UnsupportedModelError: the model has none (not a ``*ForSequenceClassification`` folder).
    """
    if loaded.classifier is None:
        raise UnsupportedModelError(
            f"{method} needs a cross-encoder: a *ForSequenceClassification model (or a CrossEncoder folder) with its"
            f" classifier head; {loaded.name!r} ({loaded.model.config.model_type}) has none")
    return loaded.classifier


def default_activation(classifier: SequenceClassifier) -> nn.Module:
    """``CrossEncoder``'s activation for the model: the one its folder saved (a ``torch.`` path: sentence-transformers
    trusts no other without ``trust_remote_code``), else Sigmoid for one label, else none."""
    config = classifier.model.config
    saved = getattr(config, "sentence_transformers", None)
    path = classifier.activation_fn or (saved.get("activation_fn") if isinstance(saved, dict) else None) or getattr(
        config, "sbert_ce_default_activation_function", None)
    if isinstance(path, str) and path.startswith("torch."):
        module, _, name = path.rpartition(".")
        made = getattr(importlib.import_module(module), name)()
        if isinstance(made, nn.Module):
            return made
    elif path is not None:
        log.warning("activation %r of %r is not a torch module: the default is used, as CrossEncoder does",
                    path, classifier.model.name_or_path)
    return nn.Sigmoid() if classifier.num_labels == 1 else nn.Identity()


def max_pair_length(classifier: SequenceClassifier, model_limit: int) -> int:
    """The tokens a pair is truncated to: the folder's ``max_seq_length``, else the model's own limit."""
    return int(classifier.max_length) if classifier.max_length is not None else model_limit


def listed_pairs(inputs: Pair | Sequence[Pair], method: str) -> tuple[list[tuple[str, str]], bool]:
    """The pairs of ``inputs`` and whether it was one pair (``CrossEncoder.predict``'s single input).

    Raises:
        ConfigError: no pairs, or a pair that is not two strings (its position and value named).
    """
    if isinstance(inputs, str):
        raise ConfigError(f"{method}: got one string {inputs[:40]!r}; give a pair (query, document) or a list of pairs")
    single = isinstance(inputs, (list, tuple)) and len(inputs) > 0 and isinstance(inputs[0], str)
    rows = [inputs] if single else list(inputs)
    if not rows:
        raise ConfigError(f"{method}: no pairs given; give a list of (query, document) pairs")
    pairs = []
    for number, pair in enumerate(rows):
        if isinstance(pair, str) or not isinstance(pair, (list, tuple)) or len(pair) != 2 or not all(
                isinstance(text, str) for text in pair):
            raise ConfigError(f"{method}: pair {number} must be two strings (query, document), got {pair!r:.80}")
        pairs.append((str(pair[0]), str(pair[1])))
    return pairs, single


class PairTokenizer:
    """Tokenizes pairs as ``CrossEncoder`` does, and keeps each pair's ids until its row's scores are made.

    Args:
        tokenizer: the model's tokenizer.
        max_length: tokens per pair at most (``longest_first``: the longer text loses tokens first).
        token_types: whether the model's embeddings take token types (rows then carry them).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_length: int, *, token_types: bool) -> None:
        self._tokenizer = tokenizer
        self._max_length = max_length
        self._token_types = token_types
        self.ids: dict[tuple[str, ...], Sequence[int]] = {}  # pair -> its ids, until ``Scores`` takes them

    def __call__(self, pairs: list[Sequence[str]]) -> list[Tokenized]:
        encoded = self._tokenizer([pair[0] for pair in pairs], [pair[1] for pair in pairs], truncation="longest_first",
                                  max_length=self._max_length, add_special_tokens=True)
        types = encoded.get("token_type_ids") if self._token_types else None
        out = []
        for k, pair in enumerate(pairs):
            ids = encoded["input_ids"][k]
            self.ids[tuple(pair)] = ids
            row_types = tuple(types[k]) if types is not None and any(types[k]) else ()
            out.append(Tokenized(ids, token_types=row_types))
        return out


def pair_rows(pairs: Sequence[Pair], tokenizer: PairTokenizer) -> RowSource:
    """The call's rows: each pair a prompt of two texts, tokenized together by ``tokenizer``."""

    def plain(texts: list[str]) -> list[list[int]]:
        raise ConfigError(f"a cross-encoder call takes pairs of texts, got a lone text {texts[0]!r:.40}")

    return TextRows(pairs, plain, tokenizer)


class Scores(Sink):
    """Each row's logits ``(n, num_labels)``: its last hidden states through the classifier head.

    Args:
        rows: the call's number of input rows.
        pairs: the call's pairs, by input position (a row's ids are found by its pair).
        classifier: the model's head.
        tokenizer: what tokenized the pairs (and holds their ids until here).
    """

    def __init__(self, rows: int, pairs: Sequence[Pair], classifier: SequenceClassifier,
                 tokenizer: PairTokenizer) -> None:
        super().__init__(rows)
        self._pairs = pairs
        self._classifier = classifier
        self._tokenizer = tokenizer
        self._result = torch.empty((rows, classifier.num_labels))  # (n, labels), every row written before read

    def _put(self, targets: Sequence[Sequence[int]], hidden: HiddenRows) -> None:
        states, mask = hidden.padded()  # (B, P, hidden), (B, P)
        pad = self._classifier.pad_token_id or 0
        ids = torch.full(mask.shape, pad, dtype=torch.long)  # (B, P)
        for r, positions in enumerate(targets):
            row = self._tokenizer.ids.pop(tuple(self._pairs[positions[0]]))
            ids[r, : len(row)] = torch.as_tensor(list(row), dtype=torch.long)
        logits = self._classifier(states, ids.to(states.device), mask).cpu()  # (B, labels)
        for r, positions in enumerate(targets):
            self._result[list(positions)] = logits[r]

    def _copy(self, source: int, target: int) -> None:
        self._result[target] = self._result[source]

    def result(self) -> torch.Tensor:
        """The ``(n, num_labels)`` logits, in input order.

        Raises:
            UnwrittenRowError: a row was never written.
        """
        self.check()
        return self._result


def score_pairs(
    loaded: LoadedModel, pairs: Sequence[Pair], model_limit: int, run: Callable[[RowSource, Sink], object],
    method: str,
) -> torch.Tensor:
    """The pairs' logits ``(n, num_labels)`` by ``run`` (one call of the cache).

    Raises:
        UnsupportedModelError: the model has no classifier head.
    """
    classifier = classifier_of(loaded, method)
    token_types = int(getattr(loaded.model.config, "type_vocab_size", 0) or 0) > 1
    tokenizer = PairTokenizer(loaded.tokenizer, max_pair_length(classifier, model_limit), token_types=token_types)
    scores = Scores(len(pairs), pairs, classifier, tokenizer)
    run(pair_rows(pairs, tokenizer), scores)
    return scores.result()


def finish_scores(
    logits: torch.Tensor, classifier: SequenceClassifier, *, activation_fn: Callable[..., Any] | None,
    apply_softmax: bool, convert_to_numpy: bool, convert_to_tensor: bool, single: bool,
) -> Any:
    """``CrossEncoder.predict``'s scores from the logits: the activation, one label squeezed, the softmax over
    several when asked, then numpy (default), one tensor or a list of tensors; one pair's alone for one pair."""
    activation = activation_fn if activation_fn is not None else default_activation(classifier)
    with torch.inference_mode():
        scores = activation(logits)  # (n, labels)
        if classifier.num_labels == 1 and scores.ndim > 1:
            scores = scores.squeeze(-1)  # (n,)
        if apply_softmax and scores.ndim > 1:
            scores = torch.softmax(scores, dim=1)
    out: Any
    if convert_to_tensor:
        out = scores
    elif convert_to_numpy:
        out = scores.float().cpu().numpy()
    else:
        out = list(scores)
    return out[0] if single else out


def ranked(scores: Sequence[float], documents: Sequence[str], *, top_k: int | None,
           return_documents: bool) -> list[dict[str, Any]]:
    """``CrossEncoder.rank``'s answer: ``{"corpus_id", "score"[, "text"]}`` per document, best first, ``top_k``."""
    results: list[dict[str, Any]] = []
    for number, score in enumerate(scores):
        results.append({"corpus_id": number, "score": score})
        if return_documents:
            results[-1]["text"] = documents[number]
    return sorted(results, key=lambda result: result["score"], reverse=True)[:top_k]


def rank_pairs(query: str, documents: Sequence[str], classifier: SequenceClassifier, method: str) -> list[Pair]:
    """The (query, document) pairs ``rank`` scores.

    Raises:
        ConfigError: a model of more than one label, a query or a document that is not a string, or no documents.
    """
    if classifier.num_labels != 1:
        raise ConfigError(f"{method} needs a model of one label (num_labels=1), this one has"
                          f" {classifier.num_labels}; use predict() with pairs instead")
    if not isinstance(query, str):
        raise ConfigError(f"{method}: the query must be a string, got {query!r:.80}")
    if isinstance(documents, str) or not len(documents):
        raise ConfigError(f"{method}: give the documents as a non-empty list of strings, got {documents!r:.80}")
    bad = next((number for number, text in enumerate(documents) if not isinstance(text, str)), None)
    if bad is not None:
        raise ConfigError(f"{method}: document {bad} must be a string, got {documents[bad]!r:.80}")
    return [(query, document) for document in documents]
