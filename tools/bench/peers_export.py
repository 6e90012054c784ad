"""The graphs of the peers users run instead of us, exported once per model and kept in a cache.

A user who wants fast CPU embeddings runs sentence-transformers with ``backend="onnx"`` (the plain fp32 export,
the graph optimised at O3, or the dynamically quantised int8 model that ``export_optimized_onnx_model`` and
``export_dynamic_quantized_onnx_model`` write through optimum) or ``backend="openvino"``. optimum pins an older
transformers than ours, so the same graphs are made here with the libraries underneath it:

- ``onnx_fp32``: ``torch.onnx.export`` (the TorchScript exporter, ``dynamo=False``) of the model's transformer
  (``attnstore_client.tiers.engines.graphs.write_onnx``: the graph the compute tier's ``onnxruntime`` engine runs),
  inputs ``input_ids``, ``attention_mask`` and, where its tokenizer gives them, ``token_type_ids`` (none for MPNet or
  DistilBERT), and output ``last_hidden_state``, batch and sequence
  axes dynamic, opset 14 (optimum's default for BERT), eager attention: ONNX Runtime 1.32 fuses its six
  attention blocks into ``Attention`` ops at O3, and none of an SDPA export's (measured on all-MiniLM-L6-v2; optimum
  exports BERT with SDPA), so these graphs are the faster of the two, the stricter baseline;
- ``onnx_o3``: that graph through ``onnxruntime.transformers.optimizer.optimize_model`` as optimum's
  ``AutoOptimizationConfig.O3()`` calls it: ``opt_level=2``, the transformers-specific fusions on, the
  embedding-layer-norm fusion off (optimum's default: it breaks quantisation) and the GELU approximation
  (``enable_gelu_approximation``: GELU becomes FastGelu);
- ``onnx_int8``: the fp32 graph through ``onnxruntime.quantization`` as optimum's
  ``AutoQuantizationConfig.avx2(is_static=False, per_channel=False)`` quantises it: dynamic (``IntegerOps``),
  every op of ONNX Runtime's ``IntegerOpsRegistry`` (MatMul, Gather, Attention...), activations and weights uint8,
  symmetric weights, no reduced range; optimum builds the ``ONNXQuantizer`` itself, so MatMuls whose second
  input is an activation (the attention products) are quantised too (``MatMulConstBOnly`` off);
- ``openvino_fp32``: ``openvino.convert_model`` of the PyTorch transformer (as optimum-intel converts it), saved
  uncompressed (fp32 weights): ``engines.graphs.write_openvino``, the compute tier's ``openvino`` engine's graph.

Each graph lives under ``CACHE/<first 16 hex of the model's fingerprint>/<peer>-<versions>/``: a new model,
weights or library version exports anew. Each is written to a temporary folder beside it and renamed into place,
so a reader sees a whole graph or none, and two processes exporting at once both end with one.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Literal, get_args

from attnstore.errors import ConfigError
from attnstore_client.models import LoadedModel
from attnstore_client.tiers.engines.graphs import (
    GraphEngineName,
    atomic_folder,
    example_inputs,
    model_folder,
    require,
    versions_of,
    write_onnx,
    write_openvino,
)

logger = logging.getLogger(__name__)

PeerName = Literal["onnx_fp32", "onnx_o3", "onnx_int8", "openvino_fp32"]
PEERS: tuple[PeerName, ...] = get_args(PeerName)
# The file sentence-transformers gives each graph (onnx/model_O3.onnx, onnx/model_qint8_avx2.onnx, ...).
GRAPH_FILES: dict[PeerName, str] = {
    "onnx_fp32": "model.onnx",
    "onnx_o3": "model_O3.onnx",
    "onnx_int8": "model_qint8_avx2.onnx",
    "openvino_fp32": "openvino_model.xml",
}
CACHE_ENV = "ATTNSTORE_PEERS_CACHE"

Progress = Callable[[str], None]


def default_cache_dir() -> Path:
    """``$ATTNSTORE_PEERS_CACHE``, else ``~/.cache/attnstore/peers``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "attnstore" / "peers")


def check_peer(name: str) -> PeerName:
    """``name`` if it is a peer.

    Raises:
        ConfigError: it is not one of ``PEERS``.
    """
    if name not in PEERS:
        raise ConfigError(f"peer {name!r} is not one of {list(PEERS)}")
    return name  # type: ignore[return-value]


def export_graph(
    name: str, loaded: LoadedModel, *, cache_dir: Path | None = None, progress: Progress | None = None
) -> Path:
    """The graph file of peer ``name`` for ``loaded``, exported on first use and read from the cache after.

    Args:
        name: one of ``PEERS``.
        loaded: a sentence-transformers model (``load_model`` of a folder with ``modules.json``), its real weights.
        cache_dir: the cache's root (default: ``default_cache_dir()``).
        progress: called with one line before an export starts (default: logged at INFO).

    Returns:
        The ``.onnx`` or ``.xml`` file.

    Raises:
        ConfigError: an unknown peer, a model without a sentence-transformers pipeline, or the ``peers`` extra
            (onnx, onnxruntime, openvino) not installed.
    """
    peer = check_peer(name)
    if loaded.sentence_transformer is None:
        raise ConfigError(f"peer {peer}: model {loaded.name!r} has no sentence-transformers configuration")
    engine: GraphEngineName = "openvino" if peer == "openvino_fp32" else "onnxruntime"
    folder = model_folder(loaded, cache_dir or default_cache_dir()) / f"{peer}-{versions_of(engine)}"
    graph = folder / GRAPH_FILES[peer]
    if graph.is_file():
        return graph
    if peer in ("onnx_o3", "onnx_int8"):
        source = export_graph("onnx_fp32", loaded, cache_dir=cache_dir, progress=progress)
    (progress or logger.info)(f"exporting the {peer} graph of {loaded.name} to {folder} (once; reused after)")
    with atomic_folder(folder) as scratch:
        if peer == "onnx_fp32":
            _export_onnx(loaded, scratch / GRAPH_FILES[peer])
        elif peer == "onnx_o3":
            _optimize_o3(loaded, source, scratch / GRAPH_FILES[peer])
        elif peer == "onnx_int8":
            _quantize_avx2(source, scratch / GRAPH_FILES[peer])
        else:
            _convert_openvino(loaded, scratch / GRAPH_FILES[peer])
    return graph


def _export_onnx(loaded: LoadedModel, path: Path) -> None:
    write_onnx(loaded.model, example_inputs(loaded), path)


def _optimize_o3(loaded: LoadedModel, source: Path, path: Path) -> None:
    require("onnxruntime")
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    options = FusionOptions("bert")
    options.enable_embed_layer_norm = False  # optimum: disable_embed_layer_norm_fusion=True
    options.enable_gelu_approximation = True  # what O3 adds to O2
    config = loaded.model.config
    optimized = optimize_model(
        str(source), model_type="bert", num_heads=config.num_attention_heads, hidden_size=config.hidden_size,
        opt_level=2, optimization_options=options, use_gpu=False, only_onnxruntime=False,
    )
    fused = {op: count for op, count in optimized.get_fused_operator_statistics().items() if count}
    logger.info("onnx_o3: fused operators %s", fused)
    optimized.save_model_to_file(str(path))


def _quantize_avx2(source: Path, path: Path) -> None:
    require("onnxruntime")
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.registry import IntegerOpsRegistry

    quantize_dynamic(
        str(source), str(path), op_types_to_quantize=list(IntegerOpsRegistry), per_channel=False,
        reduce_range=False, weight_type=QuantType.QUInt8,
        extra_options={"WeightSymmetric": True, "ActivationSymmetric": False, "EnableSubgraph": False,
                       "ForceSymmetric": False, "MatMulConstBOnly": False},
    )


def _convert_openvino(loaded: LoadedModel, path: Path) -> None:
    write_openvino(loaded.model, example_inputs(loaded), path)
