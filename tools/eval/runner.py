"""Running variants over a task's queries: embeddings and hit counts, then timing rounds.

Every variant sees the same queries, tokenized once as the model's head
tokenizes them (``Queries``). A *pass* runs one variant over every query in one
call and keeps each query's sentence embedding and, for multiple-choice
prompts, the A-D logits after it (a decoder's embedding is its last token's
hidden state, so the language-model head applies to it).

Timing follows the measurement rules: one process, the same inputs and thread
count for every variant; a seeded subset of the queries is run in rounds, one
warm-up round first, each round calling every variant once on the whole subset
(their order rotated from round to round so none always runs first), and the
median over rounds is reported. Attention time comes from hooks on the
attention modules (``AttentionTimer``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from tqdm.auto import tqdm

from attnstore_client.adapters import Adapter
from attnstore_client.adapters.batch import Batch, batch_from_ids
from attnstore_client.sentence.heads import SentenceHead
from attnstore_tools.eval.variants import AttentionTimer, CallRun, Queries, Variant
from attnstore_tools.timing import time_rounds

# A batch of rows: their indices and the padded batch.
RowBatch = tuple[list[int], Batch]


@dataclass(frozen=True)
class Pass:
    """One variant over every query."""

    outputs: np.ndarray  # (n, dim) float32 sentence embeddings, query order
    logits: np.ndarray | None  # (n, choices) next-token logits of the choices, when asked for
    kinds: tuple[str, ...]  # per query: "exact" / "map" / "miss" / "fallback"; "computed" when no store
    exact_hits: int
    map_hits: int
    misses: int
    fallbacks: int
    layer_replays: int
    seconds: float
    tokens: int = 0  # prompt tokens of the queries
    computed_tokens: int = 0  # of which the forward computed (not exact hits, not stored prefixes)


@dataclass(frozen=True)
class Timing:
    """Medians over the timing rounds of one variant on the timing subset (seconds)."""

    total_s: float
    retrieval_s: float  # projection + lookup + fetch
    inline_s: float  # retrieval spent inside the attention modules
    attention_s: float  # inside the attention modules, inline retrieval included
    rounds: int

    @property
    def compute_s(self) -> float:
        """The whole time less retrieval."""
        return self.total_s - self.retrieval_s

    @property
    def attention_compute_s(self) -> float:
        """Attention time less the retrieval done inside it."""
        return self.attention_s - self.inline_s


def row_batches(ids: Sequence[Sequence[int]], indices: Sequence[int], batch_size: int, pad_id: int) -> list[RowBatch]:
    """Batches of the given rows, longest first, with the row indices of each."""
    order = sorted(indices, key=lambda i: -len(ids[i]))
    return [
        (order[start : start + batch_size], batch_from_ids([ids[i] for i in order[start : start + batch_size]], pad_id))
        for start in range(0, len(order), batch_size)
    ]


def run_pass(
    adapter: Adapter,
    variant: Variant,
    queries: Queries,
    head: SentenceHead,
    *,
    choice_ids: torch.Tensor | None = None,
) -> Pass:
    """Run ``variant`` over every query in one call.

    Args:
        adapter: the model (for the language-model head).
        variant: what embeds the queries.
        queries: the task's queries.
        head: the model's pooling.
        choice_ids: token ids whose next-token logits are kept (multiple choice); None: none.
    """
    started = time.perf_counter()
    run = variant.embed(queries, range(len(queries.ids)), head)
    seconds = time.perf_counter() - started
    logits = None
    lm_head = adapter.loaded.lm_head
    if choice_ids is not None and lm_head is not None:
        with torch.inference_mode():
            pooled = torch.from_numpy(run.embeddings).to(next(lm_head.parameters()).device)
            logits = lm_head(pooled)[:, choice_ids].float().cpu().numpy()  # (n, choices)
    kinds = run.kinds or ("computed",) * len(queries.ids)
    return Pass(
        outputs=run.embeddings,
        logits=logits,
        kinds=kinds,
        exact_hits=run.exact_hits,
        map_hits=run.map_hits,
        misses=sum(kind == "miss" for kind in kinds),
        fallbacks=run.fallbacks,
        layer_replays=run.layer_replays,
        seconds=seconds,
        tokens=sum(len(ids) for ids in queries.ids),
        computed_tokens=sum(len(ids) for ids, kind in zip(queries.ids, kinds, strict=True) if kind != "exact")
        - run.prefix_tokens,
    )


def time_variants(
    adapter: Adapter,
    variants: Sequence[Variant],
    queries: Queries,
    subset: Sequence[int],
    head: SentenceHead,
    *,
    rounds: int = 5,
    progress: bool = True,
) -> list[Timing]:
    """Median times of every variant over ``rounds`` rounds (after one warm-up round), in ``variants`` order."""
    calls = {
        position: partial(_time_once, adapter, variant, queries, subset, head)
        for position, variant in enumerate(variants)
    }
    bar = tqdm(total=(rounds + 1) * len(variants), desc="timing", unit="run", disable=not progress, leave=False)
    # The figures are what each call measures itself: the call alone, not the hooks' set-up.
    samples = time_rounds(calls, repeats=rounds, warmup=1, rotate=True, after_call=bar.update)
    bar.close()
    return [
        Timing(
            total_s=statistics.median(s.value[0] for s in rows),
            retrieval_s=statistics.median(s.value[1] for s in rows),
            inline_s=statistics.median(s.value[2] for s in rows),
            attention_s=statistics.median(s.value[3] for s in rows),
            rounds=rounds,
        )
        for rows in samples.values()
    ]


def _time_once(
    adapter: Adapter, variant: Variant, queries: Queries, subset: Sequence[int], head: SentenceHead
) -> tuple[float, float, float, float]:
    """Seconds of the call, of retrieval, of retrieval inside attention, and in attention."""
    with AttentionTimer(adapter.attention_modules) as timer:
        started = time.perf_counter()
        run: CallRun = variant.embed(queries, subset, head)
        total = time.perf_counter() - started
    return total, run.retrieval_s, run.inline_s, timer.seconds
