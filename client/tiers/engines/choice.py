"""Which engine runs a computed forward, per length band: from each engine's check and timed forwards.

Each graph is first checked against the model's own forward on a padded batch of four random rows (every real
position within ``CHECK_TOLERANCE`` of torch's last hidden state, relative to its largest value): a graph that
fails is refused, with its reason, and never runs a row. Then each engine runs forwards of ``tokens`` tokens of
rows of each band's length as the compute tier runs them, ``side_by_side`` forwards at once on the forward pool:
torch's packed on one thread each, a graph's padded on its streams (``runtimes``). A band's engine is the fastest
(median of ``repeats`` timings after one warm-up); torch keeps a band unless a graph is ``MARGIN`` faster, since
torch's rows can also keep maps and run int8 in the same forwards. The choice is made once per cache (the first
call that computes a row) and kept; ``str(choice)`` reads as a table.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from attnstore.errors import ConfigError
from attnstore_client.adapters.base import Adapter
from attnstore_client.adapters.batch import batch_from_ids
from attnstore_client.adapters.packed import pack
from attnstore_client.tiers.engines.runtimes import GraphEngine
from attnstore_client.tiers.forward_pool import ForwardPool

log = logging.getLogger(__name__)

TORCH = "torch"
BANDS = (16, 32, 64, 128, 256, 512)  # each band's rows are this long; a forward's band: the first >= its longest row
CHECK_TOLERANCE = 1e-4  # of a graph's largest |value|: fp32 rounding of another kernel order, not another model
MARGIN = 0.03  # a graph must be this much faster than torch to take its band (the timings' spread on 2 cores)


@dataclass(frozen=True)
class EngineChoice:
    """The engine of each length band, and the timings and checks that chose them.

    Attributes:
        bands: the bands' lengths, increasing (a row longer than the last is in the last band).
        engines: per band the engine that runs its forwards (``"torch"`` or a graph's name).
        seconds: per engine timed, per band its median seconds per thousand tokens.
        refused: per graph refused, why (its check failed, or it could not be loaded).
    """

    bands: tuple[int, ...]
    engines: tuple[str, ...]
    seconds: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    refused: Mapping[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The choice as JSON values (``from_json`` reads them back)."""
        return {"bands": list(self.bands), "engines": list(self.engines),
                "seconds": {name: list(times) for name, times in self.seconds.items()}, "refused": dict(self.refused)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> EngineChoice:
        """The choice ``to_json`` gave."""
        return cls(tuple(data["bands"]), tuple(data["engines"]),
                   {name: tuple(times) for name, times in data["seconds"].items()}, dict(data["refused"]))

    def engine_for(self, longest: int) -> str:
        """The engine of a forward whose longest row has ``longest`` tokens."""
        for band, engine in zip(self.bands, self.engines, strict=True):
            if longest <= band:
                return engine
        return self.engines[-1]

    @property
    def uses_graphs(self) -> bool:
        """Whether some band runs on a graph."""
        return any(engine != TORCH for engine in self.engines)

    def __str__(self) -> str:
        names = list(self.seconds)
        lines = [f"{'tokens <=':>10} " + " ".join(f"{name:>12}" for name in names) + "  engine (s per 1k tokens)"]
        for i, band in enumerate(self.bands):
            times = " ".join(f"{self.seconds[name][i]:12.4f}" for name in names)
            lines.append(f"{band:>10} {times}  {self.engines[i]}")
        lines += [f"{name} refused: {reason}" for name, reason in self.refused.items()]
        return "\n".join(lines)


def bands_up_to(max_length: int) -> tuple[int, ...]:
    """``BANDS`` shorter than ``max_length``, then ``max_length``: no band longer than a row can be."""
    return (*(band for band in BANDS if band < max_length), max_length)


def choose_engines(
    adapter: Adapter, graphs: Sequence[GraphEngine], pool: ForwardPool, *, side_by_side: int, max_length: int,
    only: str | None = None, tokens: int = 1024, repeats: int = 2, refused: Mapping[str, str] | None = None,
    check: bool = True,
) -> EngineChoice:
    """Check ``graphs`` against ``adapter``'s forward, time every engine per band, and choose (module docstring).

    Args:
        adapter: the model's adapter (its forward is the reference and the ``torch`` engine).
        graphs: the graphs exported and loaded.
        pool: the forward pool torch's forwards run side by side on.
        side_by_side: how many torch forwards run at once (``TierContext.side_by_side``).
        max_length: the longest row a call gives (the last band's length).
        only: a graph's name: that graph for every band (it must pass its check); None: the fastest per band.
        tokens: tokens per timed forward.
        repeats: timings per engine and band (their median is compared).
        refused: graphs that could not be exported or loaded, and why (kept in the choice).
        check: check each graph against ``adapter`` (False: an int8 graph, checked by ``check_int8_graph``: it
            is not ``adapter``'s int8 within fp32 rounding).

    Raises:
        ConfigError: ``only`` names a graph that was refused or not given.
    """
    refusals = dict(refused or {})
    checked = []
    for graph in graphs:
        reason = check_graph(adapter, graph) if check else None
        if reason is None:
            checked.append(graph)
        else:
            refusals[graph.name] = reason
            log.warning("engine %s refused: %s", graph.name, reason)
    if only is not None:
        if only not in {graph.name for graph in checked}:
            raise ConfigError(f"engine={only!r}: {refusals.get(only, 'no such graph was loaded')}")
        checked = [graph for graph in checked if graph.name == only]
    bands = bands_up_to(max_length)
    pad = adapter.loaded.tokenizer.pad_token_id

    def torch_forward(rows: list[list[int]]) -> None:
        with torch.inference_mode():
            if adapter.capabilities.can_pack:
                adapter.forward_packed(pack(rows))
            else:
                adapter.forward(batch_from_ids(rows, pad))

    seconds = {TORCH: _timed(adapter, torch_forward, pool, side_by_side, bands, tokens, repeats)}
    for graph in checked:
        def graph_forward(rows: list[list[int]], graph: GraphEngine = graph) -> None:
            graph.forward(batch_from_ids(rows, pad))

        seconds[graph.name] = _timed(adapter, graph_forward, pool, side_by_side, bands, tokens, repeats)
    choice = EngineChoice(bands, pick_engines(seconds, only), seconds, refusals)
    log.info("engines by forward length (%s):\n%s", adapter.loaded.name, choice)
    return choice


def pick_engines(seconds: Mapping[str, Sequence[float]], only: str | None = None) -> tuple[str, ...]:
    """Per band of ``seconds`` (per engine, per band, torch's among them): ``only`` where given, else the fastest
    engine, where a graph takes a band from torch only when it is ``MARGIN`` faster."""
    engines: list[str] = []
    for i in range(len(seconds[TORCH])):
        if only is not None:
            engines.append(only)
            continue
        fastest = min(seconds, key=lambda name: seconds[name][i])
        engines.append(fastest if seconds[fastest][i] < (1 - MARGIN) * seconds[TORCH][i] else TORCH)
    return tuple(engines)


def check_graph(adapter: Adapter, graph: GraphEngine) -> str | None:
    """Why ``graph`` does not compute the model's last hidden states (None: it does, within ``CHECK_TOLERANCE``)."""
    rows = _random_rows(adapter, [5, 17, 33, 60], seed=0)
    batch = batch_from_ids(rows, adapter.loaded.tokenizer.pad_token_id)
    with torch.inference_mode():
        expected = adapter.forward(batch).float()  # (B, P, hidden)
    try:
        got = graph.forward(batch)
    except Exception as exc:  # a runtime's own error: the graph is refused, the rows run on torch
        return f"its forward failed: {exc!r}"
    if got.shape != expected.shape:
        return f"it gave states of shape {tuple(got.shape)}, the model {tuple(expected.shape)}"
    scale = float(expected.abs().max())
    worst = max(float((got[b, :n] - expected[b, :n]).abs().max()) for b, n in enumerate(batch.lengths))
    if not worst <= CHECK_TOLERANCE * scale:
        return (f"its last hidden states differ from the model's by up to {worst:.3g} (allowed"
                f" {CHECK_TOLERANCE * scale:.3g})")
    return None


def check_int8_graph(adapter: Adapter, graph: GraphEngine, fidelity: float) -> str | None:
    """Why int8 ``graph`` does not keep the model's states (None: it does): every real position of the four
    check rows at cosine >= ``fidelity`` to the fp32 forward's. Its plan measured it on the corpus's rows; this
    catches a graph of other weights or a runtime that computes something else (all-MiniLM-L6-v2's int8 graph:
    0.996 at least on them)."""
    rows = _random_rows(adapter, [5, 17, 33, 60], seed=0)
    batch = batch_from_ids(rows, adapter.loaded.tokenizer.pad_token_id)
    with torch.inference_mode():
        expected = adapter.forward(batch).float()
    try:
        got = graph.forward(batch)
    except Exception as exc:  # a runtime's own error: the rows run on torch's int8 model
        return f"its forward failed: {exc!r}"
    if got.shape != expected.shape:
        return f"it gave states of shape {tuple(got.shape)}, the model {tuple(expected.shape)}"
    least = min(float(torch.nn.functional.cosine_similarity(got[b, :n], expected[b, :n], dim=-1).min())
                for b, n in enumerate(batch.lengths))
    if not least >= fidelity:
        return f"a position's state is at cosine {least:.4f} to the fp32 model's (its plan's fidelity: {fidelity})"
    return None


def _random_rows(adapter: Adapter, lengths: Sequence[int], seed: int) -> list[list[int]]:
    """Rows of random ordinary token ids (above the tokenizer's special ones), ``lengths`` long."""
    generator = torch.Generator().manual_seed(seed)
    vocab = len(adapter.loaded.tokenizer)
    low = min(1000, vocab // 2)
    return [torch.randint(low, vocab, (length,), generator=generator).tolist() for length in lengths]


def _timed(
    adapter: Adapter, forward: Callable[[list[list[int]]], object], pool: ForwardPool, side_by_side: int,
    bands: Sequence[int], tokens: int, repeats: int,
) -> tuple[float, ...]:
    """Per band, the median seconds per thousand tokens of ``tokens`` tokens of the band's rows, run as
    ``side_by_side`` forwards at once on ``pool`` (after one untimed run)."""

    def run(rows: list[list[int]]) -> None:
        shares = [rows[i::side_by_side] for i in range(side_by_side) if rows[i::side_by_side]]
        for _ in pool.run([partial(forward, share) for share in shares], len(shares)):
            pass

    medians = []
    for band in bands:
        rows = _random_rows(adapter, [band] * max(1, tokens // band), seed=band)
        run(rows)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            run(rows)
            times.append(time.perf_counter() - started)
        medians.append(statistics.median(times) * 1000 / (len(rows) * band))
    return tuple(medians)
