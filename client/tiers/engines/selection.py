"""The compute tier's engines for one cache: exported, checked and timed on the first call that computes a row.

``CacheSettings.engine``: ``"torch"`` (the default) runs every forward on the model's own torch forward and
exports nothing; ``"auto"`` exports the model to every graph engine whose libraries are installed and runs each
length band on the fastest (``choice``); ``"openvino"`` or ``"onnxruntime"`` runs every band on that graph (a
call raises if it cannot be exported or fails its check). Graphs run on the CPU only: on another device every
forward is torch's.

int8 rows (``int8=True``) have a choice of their own, made on the first call that computes one: with ``"auto"``
or ``"openvino"`` and a plan that names graph layers (``Int8Plan.graph_linears``, checked at build time), the
int8 OpenVINO graph (``engines.int8``) against torch's int8 model, per band as above (``"openvino"``: the graph
for every band). Otherwise int8 rows stay on torch's int8 model (ONNX Runtime's int8 ran no faster than it).

Where no band of a model's rows computes on torch (an engine named, or ``"auto"`` choosing graphs for every band),
its packed forwards, then only the maps' (captures, replays), run on torch's own linear kernels: oneDNN's
reordered copy of the weights (``adapters.fused``, +85 MiB for all-MiniLM-L6-v2) is not made or is given back.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import torch

from attnstore.errors import ConfigError
from attnstore.projector.int8_plan import Int8Plan
from attnstore_client.adapters.base import Adapter
from attnstore_client.tiers.engines.choice import (
    TORCH,
    EngineChoice,
    bands_up_to,
    check_int8_graph,
    choose_engines,
)
from attnstore_client.tiers.engines.graphs import (
    EXTRA_HINT,
    GRAPH_ENGINES,
    EngineName,
    GraphEngineName,
    export_graph,
    installed,
    model_folder,
    versions_of,
)
from attnstore_client.tiers.engines.int8 import DYNAMIC_GROUP, export_int8_graph, int8_installed
from attnstore_client.tiers.engines.runtimes import GraphEngine, OpenVinoEngine, open_engine
from attnstore_client.tiers.forward_pool import ForwardPool

log = logging.getLogger(__name__)

# How choices are timed, in a kept choice's name: a choice timed another way is timed again (2: graphs on streams).
TIMING = 2


class EngineSelection:
    """Which engine runs each computed forward of one cache.

    Args:
        adapter: the model's adapter.
        requested: ``CacheSettings.engine``.
        max_length: the longest row a call gives.
        cache_dir: where graphs are exported (default: ``graphs.default_cache_dir()``).
    """

    def __init__(self, adapter: Adapter, requested: EngineName, *, max_length: int, cache_dir: Path | None = None):
        self.requested = requested
        self._adapter = adapter
        self._max_length = max_length
        self._cache_dir = cache_dir
        self._lock = threading.Lock()
        self._choice: EngineChoice | None = None
        self._graphs: dict[str, GraphEngine] = {}
        self._int8_layers: tuple[str, ...] | None = None  # the plan's graph layers the int8 choice was made for
        self._int8_choice: EngineChoice | None = None
        self._int8_graph: GraphEngine | None = None
        if requested in GRAPH_ENGINES:  # every band on that graph: torch's forwards are the maps' (and the timing's)
            adapter.release_fused_linears()

    @property
    def choice(self) -> EngineChoice | None:
        """The engine of each length band, once chosen (None before the first computing call, and with
        ``engine="torch"``)."""
        return self._choice

    @property
    def int8_choice(self) -> EngineChoice | None:
        """The engine of each length band of int8 rows, once chosen (None: they run on torch's int8 model)."""
        return self._int8_choice

    def prepare(self, pool: ForwardPool, side_by_side: int) -> None:
        """Export, check and time the engines, once (later calls return at once); each graph runs
        ``side_by_side`` forwards at once (the first computing call's: later calls' forwards take turns on its
        streams).

        Raises:
            ConfigError: ``engine`` names one graph and it could not be exported, loaded or checked.
        """
        if self.requested == TORCH or self._choice is not None:
            return
        with self._lock:
            if self._choice is not None:
                return
            device = next(self._adapter.model.parameters()).device
            if device.type != "cpu":
                reason = f"graph engines run on the CPU, the model is on {device}"
                if self.requested != "auto":
                    raise ConfigError(f"engine={self.requested!r}: {reason} (engine='torch' runs it there)")
                bands = bands_up_to(self._max_length)
                self._choice = EngineChoice(bands, (TORCH,) * len(bands), refused=dict.fromkeys(GRAPH_ENGINES, reason))
                return
            names = GRAPH_ENGINES if self.requested == "auto" else (cast(GraphEngineName, self.requested),)
            saved = self._saved(side_by_side)
            refused: dict[str, str] = {}
            graphs = []
            for name in names:
                if not installed(name):
                    refused[name] = f"not installed ({EXTRA_HINT})"
                    continue
                try:
                    graph = export_graph(name, self._adapter.loaded, cache_dir=self._cache_dir)
                    graphs.append(open_engine(name, graph, threads=torch.get_num_threads(), streams=side_by_side))
                except Exception as exc:  # an exporter's or runtime's own error: the rows run on torch
                    refused[name] = f"its export or loading failed: {exc!r}"
                    log.warning("engine %s refused for %s: %r", name, self._adapter.loaded.name, exc)
            only = None if self.requested == "auto" else self.requested
            choice = _read_choice(saved)
            if choice is None or set(choice.seconds) != {TORCH, *(graph.name for graph in graphs)}:
                choice = choose_engines(self._adapter, graphs, pool, side_by_side=side_by_side,
                                        max_length=self._max_length, only=only, refused=refused)
                _write_choice(saved, choice)
            self._choice = choice
            # Only the graphs some band runs stay loaded: each holds its own copy of the weights, as does torch's
            # oneDNN kernels' (``Adapter.release_fused_linears``), kept only where torch computes some band.
            self._graphs = {graph.name: graph for graph in graphs if graph.name in choice.engines}
            if TORCH not in choice.engines:
                self._adapter.release_fused_linears()
            self.drop_mapped_pages()  # what the timing's forwards read

    def prepare_int8(self, plan: Int8Plan, int8: Adapter, pool: ForwardPool, side_by_side: int) -> None:
        """Choose the engine of int8 rows for ``plan`` (``int8``: torch's int8 model of it), once per plan's graph
        layers; a plan without graph layers, an engine other than ``auto`` or ``openvino``, or a model off the CPU
        leaves them on torch.

        Raises:
            ConfigError: ``engine="openvino"`` and the plan's int8 graph could not be made (OpenVINO or NNCF
                missing, a layer the graph lacks) or fails its check (``check_int8_graph``; with ``auto`` the
                int8 rows stay on torch).
        """
        if self.requested not in ("auto", "openvino") or self._int8_layers == plan.graph_linears:
            return
        with self._lock:
            if self._int8_layers == plan.graph_linears:
                return
            self._int8_choice, self._int8_graph = None, None
            device = next(self._adapter.model.parameters()).device
            if plan.graph_linears and device.type == "cpu" and (self.requested == "openvino" or int8_installed()):
                graph = OpenVinoEngine(
                    export_int8_graph(self._adapter.loaded, plan.graph_linears, cache_dir=self._cache_dir),
                    threads=torch.get_num_threads(), streams=side_by_side, dynamic_group=DYNAMIC_GROUP)
                reason = check_int8_graph(self._adapter, graph, plan.fidelity)
                if reason is not None:
                    if self.requested == "openvino":
                        raise ConfigError(f"engine='openvino', int8: the plan's int8 graph {graph.graph}: {reason}")
                    log.warning("int8 graph refused for %s (int8 rows stay on torch): %s", self._adapter.loaded.name,
                                reason)
                else:
                    saved = self._saved(side_by_side, f"int8-{graph.graph.parent.name}")
                    choice = _read_choice(saved)
                    if choice is None:
                        # Checked above as an int8 graph (its plan measured it on the corpus): not against the
                        # torch int8 model's states, which are another quantisation's.
                        choice = choose_engines(int8, [graph], pool, side_by_side=side_by_side,
                                                max_length=self._max_length,
                                                only=None if self.requested == "auto" else "openvino", check=False)
                        _write_choice(saved, choice)
                    self._int8_choice = choice
                    self._int8_graph = graph if choice.uses_graphs else None
                    if TORCH not in choice.engines:
                        int8.release_fused_linears()
                    graph.drop_mapped_pages()  # what the timing's forwards read
            self._int8_layers = plan.graph_linears

    def drop_mapped_pages(self) -> None:
        """Give back the resident pages of the loaded graphs' files the forwards since the last time read
        (``GraphEngine.drop_mapped_pages``): the compute tier's, after each window's forwards."""
        for graph in [*self._graphs.values(), *([self._int8_graph] if self._int8_graph is not None else [])]:
            graph.drop_mapped_pages()

    def _saved(self, side_by_side: int, kind: str = "") -> Path:
        """Where the choice is kept for this model, request, machine's threads and library versions (and
        ``kind``: an int8 graph's): each graph's check and timings run once, not on every start."""
        parts = (part for name in GRAPH_ENGINES if installed(name) for part in versions_of(name).split("-"))
        versions = "-".join(dict.fromkeys(parts))  # each package once
        name = (f"choice-{self.requested}{'-' + kind if kind else ''}-threads{torch.get_num_threads()}"
                f"-side{side_by_side}-length{self._max_length}-{versions}-timed{TIMING}.json")
        return model_folder(self._adapter.loaded, self._cache_dir) / name

    def int8_runs_on_graph(self, length: int) -> bool:
        """Whether an int8 row ``length`` tokens long is in a band the int8 graph runs."""
        choice = self._int8_choice
        return self._int8_graph is not None and choice is not None and choice.engine_for(length) != TORCH

    def int8_graph_for(self, lengths: Sequence[int], token_types: bool) -> GraphEngine | None:
        """The int8 graph when it runs a forward of int8 rows ``lengths`` long; None: torch's int8 model."""
        graph = self._int8_graph
        if graph is None or not lengths or not self.int8_runs_on_graph(max(lengths)):
            return None
        return None if token_types and not graph.takes_token_types else graph

    def runs_on_graph(self, length: int) -> bool:
        """Whether a row ``length`` tokens long is in a band a graph runs (the compute tier cuts its forwards
        padded, as a graph runs them)."""
        return self._choice is not None and self._choice.engine_for(length) in self._graphs

    def graph_for(self, lengths: Sequence[int], token_types: bool) -> GraphEngine | None:
        """The graph that runs a forward of rows ``lengths`` long (with token types or not); None: torch."""
        if self._choice is None or not lengths:
            return None
        graph = self._graphs.get(self._choice.engine_for(max(lengths)))
        if graph is None or (token_types and not graph.takes_token_types):
            return None
        return graph


def _read_choice(path: Path) -> EngineChoice | None:
    """The choice kept at ``path``; None when there is none or it cannot be read (it is made again)."""
    try:
        return EngineChoice.from_json(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_choice(path: Path, choice: EngineChoice) -> None:
    """Keep ``choice`` at ``path``, whole or not at all (a temporary file renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_name(f".{path.name}.{os.getpid()}")
    scratch.write_text(json.dumps(choice.to_json(), indent=1), encoding="utf-8")
    os.replace(scratch, path)
