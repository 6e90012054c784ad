"""int8 on OpenVINO: the model's graph with the int8 plan's linear layers in int8, activations quantised as it runs.

The plan (``attnstore.projector.int8_plan``) names, per namespace, the linear layers that keep its corpus
faithful in int8. PyTorch's dynamic quantisation (``attnstore_client.int8``) quantises a layer's activations with
one scale per call; OpenVINO's CPU plugin quantises them per group of ``DYNAMIC_GROUP`` values of each token
(``DYNAMIC_QUANTIZATION_GROUP_SIZE``) on layers whose weights are int8, which keeps more layers faithful: on the
logs' 8,000 held-out lines all-MiniLM-L6-v2 with every linear layer so quantised kept 100% of its rows at cosine
>= 0.99 (least 0.9964) and ran 2.3x OpenVINO fp32, where the plan's 27 layers in torch ran 1.3x. So a plan also
names the layers of its graph (``Int8Plan.graph_linears``), checked at build time on the same calibration rows
(``attnstore_tools.build.int8``). Weights are NNCF's int8 (``compress_weights``, asymmetric, per output channel).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from attnstore.errors import ConfigError
from attnstore_client.models import LoadedModel
from attnstore_client.tiers.engines.graphs import (
    EXTRA_HINT,
    GRAPH_FILES,
    atomic_folder,
    export_graph,
    require,
    versions_of,
)

log = logging.getLogger(__name__)

DYNAMIC_GROUP = 128  # values per activation scale (per token): 32 ran 20% slower for no row more faithful
# How OpenVINO's converter names a linear layer's MatMul: the module path under the exported wrapper's ``model``.
_PREFIX = "__module.model."


def int8_installed() -> bool:
    """Whether OpenVINO and NNCF (the ``peers`` extra) are installed."""
    import importlib.util

    return all(importlib.util.find_spec(package) is not None for package in ("openvino", "nncf"))


def export_int8_graph(loaded: LoadedModel, linears: Sequence[str], *, cache_dir: Path | None = None) -> Path:
    """``loaded``'s OpenVINO graph with the linear layers ``linears`` (module names) in int8, made once from its
    fp32 graph (``export_graph``) and kept beside it, keyed by the layers and library versions.

    Raises:
        ConfigError: OpenVINO or NNCF not installed, no layers, or a layer the graph has no MatMul of.
    """
    require("openvino")
    require("nncf")
    if not linears:
        raise ConfigError("export_int8_graph(): no linear layers to quantise")
    source = export_graph("openvino", loaded, cache_dir=cache_dir)
    digest = hashlib.sha256("\n".join(sorted(linears)).encode()).hexdigest()[:12]
    folder = source.parent.parent / f"openvino-int8-{digest}-{versions_of('openvino')}-nncf{_nncf_version()}"
    graph = folder / GRAPH_FILES["openvino"]
    if graph.is_file():
        return graph
    import nncf
    import openvino

    model = openvino.Core().read_model(str(source))
    weighted = [op.get_friendly_name() for op in model.get_ops() if op.get_type_name() in ("MatMul", "Gather")
                and any(port.get_source_output().get_node().get_type_name() == "Constant" for port in op.inputs())]
    chosen = {name for name in weighted for linear in linears if name.startswith(f"{_PREFIX}{linear}/")}
    missing = [linear for linear in linears if not any(name.startswith(f"{_PREFIX}{linear}/") for name in chosen)]
    if missing:
        raise ConfigError(f"export_int8_graph(): the graph of {loaded.name} has no MatMul of {missing}")
    log.info("quantising %d linear layers of %s's OpenVINO graph to int8 in %s (once; reused after)", len(linears),
             loaded.name, folder)
    compressed = nncf.compress_weights(
        model, mode=nncf.CompressWeightsMode.INT8_ASYM,
        ignored_scope=nncf.IgnoredScope(names=[name for name in weighted if name not in chosen], validate=False),
    )
    with atomic_folder(folder) as scratch:
        openvino.save_model(compressed, str(scratch / GRAPH_FILES["openvino"]), compress_to_fp16=False)
    return graph


def _nncf_version() -> str:
    try:
        return version("nncf")
    except PackageNotFoundError:
        raise ConfigError(f"int8 graphs need nncf: {EXTRA_HINT}") from None
