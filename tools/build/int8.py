"""Choosing a namespace's int8 plan on its own corpus (``attnstore build --int8``).

Which linear layers survive dynamic int8 quantisation depends on the model and on the inputs (on log lines,
all-MiniLM-L6-v2's attention projections quantised together keep every row at cosine >= 0.99, its
feed-forward layers quantised together 18–52% of them). So the plan (``attnstore.projector.int8_plan``) is
chosen on a seeded sample of the corpus, greedily:

1. each candidate layer (every ``nn.Linear`` inside the transformer blocks) is quantised alone, and the mean
   cosine deficit to the fp32 output (1 - cosine) measured on the sample's first ``rank_rows`` rows;
2. candidates are taken in order of that deficit per multiply-add saved (the cheapest fidelity for the most
   work first), each kept when the sample, with it and every layer kept before, still has ``target`` of its
   rows at cosine >= ``fidelity``, and passed over otherwise.

What each step kept is the frontier (multiply-adds in int8 against the share of rows kept faithful), reported
beside the plan. The output compared is the model's sentence-transformers embedding (what ``encode`` returns).

Then the plan's graph layers (``Int8Plan.graph_linears``), where OpenVINO and NNCF are installed: the model's
OpenVINO graph with every candidate in int8 (``attnstore_client.tiers.engines.int8``: activations quantised per
group of values, which keeps more layers faithful than torch's per-call scale), checked on the same sample
against the same target; if it misses it, the plan's own layers on the graph; if those miss it too, none.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import torch
from sentence_transformers import SentenceTransformer
from torch import nn
from tqdm.auto import tqdm

from attnstore.errors import ConfigError
from attnstore.projector.int8_plan import Int8Plan
from attnstore_client.adapters import adapter_for
from attnstore_client.adapters.batch import batch_from_ids
from attnstore_client.int8 import int8_candidates, linear_flops, quantized_linear
from attnstore_client.models import LoadedModel
from attnstore_client.tiers.engines.graphs import EXTRA_HINT
from attnstore_client.tiers.engines.int8 import DYNAMIC_GROUP, export_int8_graph, int8_installed
from attnstore_client.tiers.engines.runtimes import OpenVinoEngine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Int8Config:
    """How the plan is chosen."""

    rows: int = 512  # calibration rows: a seeded sample of the corpus's distinct texts
    rank_rows: int = 512  # of those, the rows each layer is ranked on, quantised alone (fewer: a faster build)
    fidelity: float = 0.99  # cosine to the fp32 output a row must keep
    target: float = 0.995  # share of the rows that must keep it
    seed: int = 0
    batch_size: int = 32

    def __post_init__(self) -> None:
        for name in ("rows", "rank_rows", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"Int8Config: {name} must be an int >= 1, got {value!r}")
        for name in ("fidelity", "target"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ConfigError(f"Int8Config: {name} must be in (0, 1], got {getattr(self, name)!r}")


@dataclass(frozen=True)
class FrontierPoint:
    """The plan after one more candidate was tried: what it held and what it kept."""

    linear: str  # the candidate tried
    kept: bool  # whether it joined the plan (the share stayed at or above the target)
    flops_share: float  # multiply-adds per token in int8 with it, of all the linear layers'
    share: float  # rows at cosine >= fidelity with it


@dataclass(frozen=True)
class Int8Report:
    """The chosen plan (None when not even one layer kept the target) and how it was reached."""

    plan: Int8Plan | None
    frontier: tuple[FrontierPoint, ...] = ()
    seconds: float = 0.0
    evaluations: int = 0
    alone: dict[str, float] = field(default_factory=dict)  # candidate -> share of ranking rows faithful alone


def check_int8_model(loaded: LoadedModel) -> SentenceTransformer:
    """The model's sentence-transformers pipeline, whose embeddings a plan is chosen to keep.

    Raises:
        ConfigError: the model has none.
    """
    if loaded.sentence_transformer is None:
        raise ConfigError(f"--int8: {loaded.name} has no sentence-transformers pipeline, whose embeddings the"
                          " int8 plan is chosen to keep")
    return loaded.sentence_transformer


def calibrate_int8(
    loaded: LoadedModel, texts: Sequence[str], config: Int8Config = Int8Config(), *, progress: bool = True
) -> Int8Report:
    """Choose the int8 plan of ``loaded`` on a sample of ``texts`` (see the module docstring).

    Raises:
        ConfigError: the model has no sentence-transformers pipeline (its embedding is what is compared), or
            no texts.
    """
    pipeline = check_int8_model(loaded)
    distinct = sorted({text for text in texts if text.strip()})
    if not distinct:
        raise ConfigError("--int8: no texts to calibrate on")
    started = time.perf_counter()
    sample = random.Random(config.seed).sample(distinct, min(config.rows, len(distinct)))
    fp32 = loaded.model  # the pipeline's transformer's model

    def embeddings(texts: Sequence[str]) -> np.ndarray:
        return pipeline.encode(list(texts), batch_size=config.batch_size, normalize_embeddings=True,
                               show_progress_bar=False)

    candidates = int8_candidates(adapter_for(loaded))
    originals = dict(fp32.named_modules())
    int8 = {name: quantized_linear(cast(nn.Linear, originals[name])) for name in candidates}  # once each

    def cosines(linears: Sequence[str], texts: Sequence[str], reference: np.ndarray) -> np.ndarray:
        # Each layer is quantised once, above, and swapped into the model for one trial.
        try:
            for name in linears:
                fp32.set_submodule(name, int8[name])
            return np.sum(embeddings(texts) * reference, axis=1)
        finally:
            for name in linears:
                fp32.set_submodule(name, originals[name])

    reference = embeddings(sample)
    ranking = sample[: config.rank_rows]  # ranking needs fewer rows than keeping the target does
    flops = {name: linear_flops(fp32, [name]) for name in candidates}
    total = sum(flops.values())
    bar = tqdm(total=2 * len(candidates), desc="int8 plan", unit="trial", disable=not progress)
    deficit, alone = {}, {}
    for name in candidates:
        cos = cosines([name], ranking, reference[: len(ranking)])
        deficit[name] = float(np.mean(1.0 - cos))
        alone[name] = float(np.mean(cos >= config.fidelity))
        bar.update(1)
    chosen: list[str] = []
    best_share = 1.0
    frontier = []
    for name in sorted(candidates, key=lambda c: (deficit[c] / flops[c], c)):
        share = float(np.mean(cosines([*chosen, name], sample, reference) >= config.fidelity))
        kept = share >= config.target
        if kept:
            chosen.append(name)
            best_share = share
        frontier.append(FrontierPoint(name, kept, linear_flops(fp32, chosen if kept else [*chosen, name]) / total,
                                      share))
        bar.update(1)
    bar.close()
    plan = None
    if chosen:
        order = {name: k for k, name in enumerate(candidates)}
        ordered = tuple(sorted(chosen, key=order.__getitem__))
        graph_linears, graph_share = _graph_layers(loaded, pipeline, sample, reference, (tuple(candidates), ordered),
                                                   config)
        plan = Int8Plan(ordered, config.fidelity, config.target, best_share, len(sample),
                        linear_flops(fp32, chosen) / total, graph_linears, graph_share)
    return Int8Report(plan, tuple(frontier), time.perf_counter() - started, 2 * len(candidates) + 1, alone)


def _graph_layers(
    loaded: LoadedModel, pipeline: SentenceTransformer, sample: Sequence[str], reference: np.ndarray,
    tries: Sequence[tuple[str, ...]], config: Int8Config,
) -> tuple[tuple[str, ...], float]:
    """The first of ``tries`` whose OpenVINO int8 graph keeps ``config.target`` of ``sample`` at cosine >=
    ``config.fidelity`` to ``reference``, and that share; ((), 0.0) when none does or OpenVINO is not installed."""
    if not int8_installed():
        log.info("int8 plan: no graph layers (OpenVINO and NNCF are not installed: %s)", EXTRA_HINT)
        return (), 0.0
    for linears in tries:
        try:
            graph = OpenVinoEngine(export_int8_graph(loaded, linears), threads=torch.get_num_threads(),
                                   dynamic_group=DYNAMIC_GROUP)
            vectors = graph_embeddings(pipeline, graph, sample, config.batch_size)
        except Exception as exc:  # the graph is optional: a model OpenVINO cannot take keeps its torch plan
            log.warning("int8 plan: no graph layers (the model's OpenVINO int8 graph failed: %r)", exc)
            return (), 0.0
        share = float(np.mean(np.sum(vectors * reference, axis=1) >= config.fidelity))
        log.info("int8 graph with %d linear layers: %.1f%% of %d rows at cosine >= %s", len(linears), 100 * share,
                 len(sample), config.fidelity)
        if share >= config.target:
            return linears, share
    return (), 0.0


def graph_embeddings(
    pipeline: SentenceTransformer, graph: OpenVinoEngine, texts: Sequence[str], batch_size: int
) -> np.ndarray:
    """``texts``' normalised embeddings with ``graph`` as the pipeline's transformer (its other modules as they
    are: pooling, Dense, normalisation)."""
    vectors = []
    for start in range(0, len(texts), batch_size):
        features = pipeline.tokenize(list(texts[start : start + batch_size]))
        rows = [ids[mask.bool()].tolist() for ids, mask in zip(features["input_ids"], features["attention_mask"],
                                                                strict=True)]
        batch = batch_from_ids(rows, pipeline.tokenizer.pad_token_id)  # right-padded, as a graph runs rows
        out: dict[str, torch.Tensor] = {"token_embeddings": graph.forward(batch),
                                        "attention_mask": batch.attention_mask}
        with torch.inference_mode():
            for module in list(pipeline)[1:]:
                out = module(out)
        vectors.append(torch.nn.functional.normalize(out["sentence_embedding"].float(), dim=-1).numpy())
    return np.concatenate(vectors)


def format_int8(report: Int8Report) -> list[str]:
    """Lines for the build's report."""
    plan = report.plan
    if plan is None:
        return [f"int8 plan: none (no linear layer kept the target share of the calibration rows faithful, even"
                f" alone); {report.seconds:.0f} s"]
    return [
        f"int8 plan: {len(plan.linears)} linear layers ({plan.flops_share:.0%} of the linear multiply-adds) in int8,"
        f" {plan.share:.1%} of {plan.rows} calibration rows at cosine >= {plan.fidelity}"
        f" (target {plan.target:.1%}); {report.seconds:.0f} s",
        f"int8 graph (OpenVINO): {len(plan.graph_linears)} linear layers in int8, {plan.graph_share:.1%} of the rows"
        f" at cosine >= {plan.fidelity}" if plan.graph_linears else
        "int8 graph (OpenVINO): none (not installed, or no graph kept the target)",
    ]
