"""Running variants over a task's queries: pooled outputs and hit counts, then timing rounds.

Every variant sees the same batches: the queries tokenized once, sorted by
length (longest first, as ``encode()`` batches) and cut into batches. A *pass*
runs one variant over every query once and keeps each query's pooled output
(BERT-like: mean over tokens; decoders: the last token's hidden state) and, for
multiple-choice prompts, the A-D logits after it.

Timing follows the measurement rules: one process, the same inputs and thread
count for every variant; a seeded subset of the queries is run in rounds, one
warm-up round first, each round running every variant once (their order rotated
from round to round so none always runs first), and the median over rounds is
reported. Attention time comes from hooks on the attention modules
(``AttentionTimer``).
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
from attnstore_client.batch import Batch, batch_from_ids
from attnstore_tools.eval.variants import AttentionTimer, Variant
from attnstore_tools.timing import time_rounds

# A batch of queries: their indices (in query order) and the padded batch.
Chunk = tuple[list[int], Batch]


@dataclass(frozen=True)
class Pass:
    """One variant over every query."""

    outputs: np.ndarray  # (n, hidden) float32 pooled outputs, query order
    logits: np.ndarray | None  # (n, choices) next-token logits of the choices, when asked for
    kinds: tuple[str, ...]  # per query: "exact" / "map" / "miss" / "fallback"; "computed" when no store
    exact_hits: int
    map_hits: int
    misses: int
    fallbacks: int
    layer_replays: int
    seconds: float


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


def chunks(ids: Sequence[Sequence[int]], indices: Sequence[int], batch_size: int, pad_id: int) -> list[Chunk]:
    """Batches of the given queries, longest first."""
    order = sorted(indices, key=lambda i: -len(ids[i]))
    return [
        (order[start : start + batch_size], batch_from_ids([ids[i] for i in order[start : start + batch_size]], pad_id))
        for start in range(0, len(order), batch_size)
    ]


def pool(hidden: torch.Tensor, causal: bool) -> torch.Tensor:
    """A row's output embedding from its ``(L, hidden)`` states: last token for decoders, else the mean."""
    return hidden[-1] if causal else hidden.mean(dim=0)  # (hidden,)


def run_pass(
    adapter: Adapter,
    variant: Variant,
    batches: Sequence[Chunk],
    count: int,
    *,
    choice_ids: torch.Tensor | None = None,
    progress: bool = True,
) -> Pass:
    """Run ``variant`` over every batch once.

    Args:
        adapter: the model (for pooling and the language-model head).
        variant: what runs the batches.
        batches: the queries, batched.
        count: number of queries (outputs are indexed by query index).
        choice_ids: token ids whose next-token logits are kept (multiple choice); None: none.
        progress: a progress bar.
    """
    outputs = np.zeros((count, adapter.hidden_size), dtype=np.float32)
    logits = None if choice_ids is None else np.zeros((count, len(choice_ids)), dtype=np.float32)
    kinds = ["computed"] * count
    tallies = dict(exact_hits=0, map_hits=0, fallbacks=0, layer_replays=0)
    started = time.perf_counter()
    label = f"{variant.name}" + ("" if variant.setting is None else f" {variant.setting:g}")
    for indices, batch in tqdm(batches, desc=label, unit="batch", disable=not progress, leave=False):
        run = variant.run(batch)
        pooled = torch.stack([pool(h, adapter.causal) for h in run.hidden]).float()  # (B, hidden)
        outputs[indices] = pooled.numpy()
        if logits is not None:
            with torch.inference_mode():
                logits[indices] = adapter.loaded.lm_head(pooled)[:, choice_ids].float().numpy()  # (B, choices)
        for i, kind in zip(indices, run.kinds, strict=False):
            kinds[i] = kind
        for key in tallies:
            tallies[key] += getattr(run, key)
    return Pass(
        outputs=outputs,
        logits=logits,
        kinds=tuple(kinds),
        misses=sum(kind == "miss" for kind in kinds),
        seconds=time.perf_counter() - started,
        **tallies,
    )


def time_variants(
    adapter: Adapter,
    variants: Sequence[Variant],
    batches: Sequence[Chunk],
    *,
    rounds: int = 5,
    progress: bool = True,
) -> list[Timing]:
    """Median times of every variant over ``rounds`` rounds (after one warm-up round), in ``variants`` order."""
    calls = {position: partial(_time_once, adapter, variant, batches) for position, variant in enumerate(variants)}
    bar = tqdm(total=(rounds + 1) * len(variants), desc="timing", unit="run", disable=not progress, leave=False)
    # The figures are what each call measures itself: the batches' forwards alone, not the hooks' set-up.
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


def _time_once(adapter: Adapter, variant: Variant, batches: Sequence[Chunk]) -> tuple[float, float, float, float]:
    """Seconds in the batches' forwards, of retrieval, of retrieval inside attention, and in attention."""
    total = retrieval = inline = 0.0
    with AttentionTimer(adapter.attention_modules) as timer:
        for _, batch in batches:
            started = time.perf_counter()
            run = variant.run(batch)
            total += time.perf_counter() - started
            retrieval += run.retrieval_s
            inline += run.inline_s
    return total, retrieval, inline, timer.seconds
