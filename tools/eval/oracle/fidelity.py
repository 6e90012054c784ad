"""Held-out queries for the oracle evaluation, and the fidelity of replaying a stored entry.

A query is captured once: its true maps (what the oracle compares stored maps
with), its feature source (what the projector and the simple keys see) and the
full model's pooled output and, for multiple-choice prompts, its answer letter.
Replaying an entry's maps for the query gives the same two things, compared to
the full model's: the cosine of the pooled output (sentence encoders: mean over
tokens, as sentence-transformers pools all-MiniLM-L6-v2; decoders: the last
token's hidden state, the one that scores the next token) and whether the
answer letter is the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from attnstore.errors import ConfigError, CorpusError
from attnstore.service import AttnStoreService
from attnstore_client.adapters import Adapter
from attnstore_client.adapters.batch import batch_from_ids
from attnstore_client.keys import token_hash

LETTERS = ("A", "B", "C", "D")
# Prompts ending like this are scored by the letter the model puts next.
ANSWER_CUE = "Answer:"


@dataclass(frozen=True)
class EvalQuery:
    """One captured held-out query."""

    index: int  # row in the queries file
    group: str | None  # value of the group column (e.g. the log system), if any
    ids: tuple[int, ...]
    token_hash: bytes
    duplicate_of: int | None  # id of the stored entry with the same tokens, if any
    source: torch.Tensor  # (L, hidden) fp32 feature source
    maps: torch.Tensor  # (layers, heads, L, L) fp16 true maps
    reference: torch.Tensor  # (hidden,) fp32 full model's pooled output
    answer: str | None  # full model's answer letter; None unless a multiple-choice prompt

    @property
    def length(self) -> int:
        """Token length L."""
        return len(self.ids)


@dataclass(frozen=True, slots=True)
class Fidelity:
    """How close a replay came to the full model, for one query and one stored entry."""

    cosine: float  # of the pooled output to the full model's
    answer: str | None  # answer letter under replay; None unless a multiple-choice prompt


@dataclass(frozen=True, slots=True)
class SkippedQueries:
    """Query rows not evaluated, by reason."""

    empty: int
    too_long: int


def letter_ids(adapter: Adapter) -> torch.Tensor | None:
    """Token ids of `` A`` .. `` D`` (what follows ``Answer:``); None for models without an LM head.

    Raises:
        ConfigError: a letter is not one token for this tokenizer.
    """
    if adapter.loaded.lm_head is None:
        return None
    ids = []
    for letter in LETTERS:
        encoded = adapter.loaded.tokenizer(f" {letter}", add_special_tokens=False)["input_ids"]
        if len(encoded) != 1:
            raise ConfigError(f"the tokenizer splits {f' {letter}'!r} into {len(encoded)} tokens; need one per letter")
        ids.append(encoded[0])
    return torch.tensor(ids)


def prepare_queries(
    adapter: Adapter,
    service: AttnStoreService,
    namespace: str,
    texts: Sequence[str],
    groups: Sequence[str] | None = None,
    *,
    max_length: int = 256,
    batch_size: int = 16,
    progress: bool = True,
) -> tuple[list[EvalQuery], SkippedQueries]:
    """Tokenize and capture the queries, in input order.

    Args:
        adapter: the namespace's model.
        service: the store, to find each query's exact duplicate.
        namespace: the namespace evaluated.
        texts: the query texts.
        groups: per text, its group label (or None).
        max_length: rows over this many tokens are skipped and counted.
        batch_size: rows per capture forward.
        progress: show a progress bar.

    Returns:
        The captured queries and the counts of skipped rows.

    Raises:
        CorpusError: no usable query.
    """
    tokenizer = adapter.loaded.tokenizer
    letters = letter_ids(adapter)
    rows, empty, too_long = [], 0, 0
    for index, text in enumerate(texts):
        if not text.strip():
            empty += 1
            continue
        ids = tuple(tokenizer(text, add_special_tokens=True)["input_ids"])
        if len(ids) > max_length:
            too_long += 1
            continue
        rows.append((index, ids, letters is not None and text.rstrip().endswith(ANSWER_CUE)))
    if not rows:
        raise CorpusError(f"no usable queries: {empty} blank, {too_long} over {max_length} tokens")
    queries: dict[int, EvalQuery] = {}
    # Sorted by length: batches pad little and capture memory grows with L².
    ordered = sorted(rows, key=lambda row: len(row[1]))
    bar = tqdm(total=len(ordered), desc="capture queries", unit="query", disable=not progress)
    for start in range(0, len(ordered), batch_size):
        batch_rows = ordered[start : start + batch_size]
        batch = batch_from_ids([ids for _, ids, _ in batch_rows], tokenizer.pad_token_id)
        sources = adapter.feature_source(batch)
        capture = adapter.capture(batch)
        full = adapter.forward(batch)  # (B, P, hidden): the unpatched model, the baseline
        for b, (index, ids, multiple_choice) in enumerate(batch_rows):
            hidden = full[b, : len(ids)]  # (L, hidden)
            key = token_hash(ids)
            queries[index] = EvalQuery(
                index=index,
                group=None if groups is None else groups[index],
                ids=ids,
                token_hash=key,
                duplicate_of=service.store.find_by_hash(namespace, key),
                source=sources[b],
                maps=capture.maps[b].to(torch.float16),
                reference=pooled_output(hidden, causal=adapter.causal),
                answer=_answer(adapter, hidden, letters) if multiple_choice else None,
            )
        bar.update(len(batch_rows))
    bar.close()
    return [queries[i] for i in sorted(queries)], SkippedQueries(empty=empty, too_long=too_long)


def pooled_output(hidden: torch.Tensor, *, causal: bool) -> torch.Tensor:
    """The output embedding of one row's ``(L, hidden)`` last hidden states: mean, or last token if causal."""
    return (hidden[-1] if causal else hidden.mean(dim=0)).float()  # (hidden,)


def replay_fidelity(
    adapter: Adapter,
    service: AttnStoreService,
    namespace: str,
    query: EvalQuery,
    entries: Sequence[tuple[int, int]],
) -> dict[tuple[int, int], Fidelity]:
    """Replay each stored entry's maps for ``query`` in one forward and measure fidelity.

    Args:
        adapter: the namespace's model.
        service: the store.
        namespace: the namespace evaluated.
        query: the captured query.
        entries: ``(entry id, stored length)`` pairs; longer entries are cropped (causal only).

    Returns:
        Per ``(entry id, stored length)``, the fidelity of its replay.
    """
    unique = list(dict.fromkeys(entries))
    if not unique:
        return {}
    batch = batch_from_ids([query.ids] * len(unique), adapter.loaded.tokenizer.pad_token_id)
    replay = {
        row: torch.from_numpy(np.ascontiguousarray(service.read_maps(namespace, entry_id, length=query.length)))
        for row, (entry_id, _) in enumerate(unique)
    }
    hidden = adapter.forward(batch, replay)  # (k, L, hidden): every row has the query's length
    letters = letter_ids(adapter) if query.answer is not None else None
    result = {}
    for row, key in enumerate(unique):
        pooled = pooled_output(hidden[row], causal=adapter.causal)
        cosine = float(F.cosine_similarity(pooled, query.reference, dim=0))
        answer = _answer(adapter, hidden[row], letters) if letters is not None else None
        result[key] = Fidelity(cosine=cosine, answer=answer)
    return result


def _answer(adapter: Adapter, hidden: torch.Tensor, letters: torch.Tensor) -> str:
    """The letter among A-D with the highest next-token logit after the row's last token."""
    with torch.inference_mode():
        logits = adapter.loaded.lm_head(hidden[-1:].float())[0, letters]  # (4,)
    return LETTERS[int(logits.argmax())]
