"""The model's transformer exported to a graph an engine runs, once per model and library versions.

Two engines: ``openvino`` (``openvino.convert_model`` of the PyTorch transformer, fp32 weights) and
``onnxruntime`` (``torch.onnx.export``, the TorchScript exporter, eager attention: ONNX Runtime fuses eager
attention's ops and not SDPA's, opset 14). Each graph takes ``input_ids``, ``attention_mask`` and, where the
tokenizer gives them and the model takes them, ``token_type_ids``, batch and sequence axes dynamic, and gives
``last_hidden_state``.

A graph lives under ``CACHE/<first 16 hex of the model's fingerprint>/<engine>-<versions>/``: new weights or a new
library version export anew. It is written to a scratch folder beside it and renamed into place, so a reader sees
a whole graph or none, and two processes exporting at once both end with one.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Literal, get_args

import torch
from transformers import PreTrainedModel

from attnstore.errors import ConfigError
from attnstore_client.keys import model_fingerprint
from attnstore_client.models import LoadedModel

log = logging.getLogger(__name__)

GraphEngineName = Literal["openvino", "onnxruntime"]
GRAPH_ENGINES: tuple[GraphEngineName, ...] = get_args(GraphEngineName)
# ``CacheSettings.engine``: the model's own forward, the fastest per length band of those installed, or one graph.
EngineName = Literal["torch", "auto", "openvino", "onnxruntime"]
ENGINE_NAMES: tuple[EngineName, ...] = get_args(EngineName)
INPUT_NAMES = ("input_ids", "attention_mask", "token_type_ids")
GRAPH_FILES: dict[GraphEngineName, str] = {"openvino": "openvino_model.xml", "onnxruntime": "model.onnx"}
ONNX_OPSET = 14
CACHE_ENV = "ATTNSTORE_ENGINES_CACHE"
_PACKAGES: dict[GraphEngineName, tuple[str, ...]] = {
    "openvino": ("torch", "openvino"), "onnxruntime": ("torch", "onnx", "onnxruntime"),
}
EXTRA_HINT = "pip install -e '.[peers]' (scripts/install.sh installs it)"

Progress = Callable[[str], None]


def default_cache_dir() -> Path:
    """``$ATTNSTORE_ENGINES_CACHE``, else ``~/.cache/attnstore/engines``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "attnstore" / "engines")


def installed(engine: GraphEngineName) -> bool:
    """Whether the libraries ``engine``'s export and runtime need are installed."""
    return all(importlib.util.find_spec(package) is not None for package in _PACKAGES[engine])


def export_graph(
    engine: GraphEngineName, loaded: LoadedModel, *, cache_dir: Path | None = None, progress: Progress | None = None
) -> Path:
    """The graph file of ``loaded``'s transformer for ``engine``, exported on first use and read from the cache after.

    Raises:
        ConfigError: an unknown engine, or its libraries (the ``peers`` extra) not installed.
    """
    graph = graph_path(engine, loaded, cache_dir=cache_dir)
    folder = graph.parent
    if graph.is_file():
        return graph
    (progress or log.info)(f"exporting {loaded.name} to an {engine} graph in {folder} (once; reused after)")
    inputs = example_inputs(loaded)
    with atomic_folder(folder) as scratch:
        if engine == "onnxruntime":
            write_onnx(loaded.model, inputs, scratch / GRAPH_FILES[engine])
        else:
            write_openvino(loaded.model, inputs, scratch / GRAPH_FILES[engine])
    return graph


def graph_path(engine: GraphEngineName, loaded: LoadedModel, *, cache_dir: Path | None = None) -> Path:
    """Where ``export_graph`` keeps ``loaded``'s graph for ``engine`` (exported or not yet).

    Raises:
        ConfigError: an unknown engine, or its libraries not installed.
    """
    if engine not in GRAPH_ENGINES:
        raise ConfigError(f"engine {engine!r} is not one of {list(GRAPH_ENGINES)}")
    return model_folder(loaded, cache_dir) / f"{engine}-{versions_of(engine)}" / GRAPH_FILES[engine]


def model_folder(loaded: LoadedModel, cache_dir: Path | None = None) -> Path:
    """The cache's folder of ``loaded``'s graphs: by the first 16 hex of its fingerprint."""
    return (cache_dir or default_cache_dir()) / model_fingerprint(loaded.model, loaded.tokenizer)[:16]


def example_inputs(loaded: LoadedModel) -> dict[str, torch.Tensor]:
    """Two texts as the tokenizer gives them, the ``INPUT_NAMES`` (in that order) the model takes."""
    features = loaded.tokenizer(["an example input", "a second, longer example input for the export"],
                                padding=True, return_tensors="pt")
    taken = inspect.signature(loaded.model.forward).parameters
    return {key: features[key] for key in INPUT_NAMES if key in features and key in taken}


def write_onnx(model: PreTrainedModel, inputs: Mapping[str, torch.Tensor], path: Path) -> None:
    """``model``'s transformer (eager attention) as an ONNX graph at ``path``, taking ``inputs``' names."""
    require("onnx")
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")  # ONNX Runtime's attention fusion matches eager attention's ops
    try:
        names = tuple(inputs)
        axes = {0: "batch_size", 1: "sequence_length"}
        with torch.no_grad():
            torch.onnx.export(
                LastHiddenState(model).eval(), tuple(inputs.values()), str(path),
                input_names=list(names), output_names=["last_hidden_state"],
                dynamic_axes={key: axes for key in (*names, "last_hidden_state")},
                opset_version=ONNX_OPSET, do_constant_folding=True, dynamo=False,
            )
    finally:
        model.set_attn_implementation(previous)


def write_openvino(model: PreTrainedModel, inputs: Mapping[str, torch.Tensor], path: Path) -> None:
    """``model``'s transformer converted by OpenVINO, saved at ``path`` with fp32 weights."""
    require("openvino")
    import openvino

    with torch.no_grad():
        converted = openvino.convert_model(
            LastHiddenState(model).eval(), example_input=dict(inputs),
            input=[(key, [-1, -1], openvino.Type.i64) for key in inputs],
        )
    openvino.save_model(converted, str(path), compress_to_fp16=False)


class LastHiddenState(torch.nn.Module):
    """The model's transformer as a module of its input tensors to one: what an exported graph computes."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        types = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, **types)
        return outputs.last_hidden_state  # (B, T, hidden)


@contextmanager
def atomic_folder(folder: Path) -> Iterator[Path]:
    """A scratch folder beside ``folder``, renamed to it when the block ends without error (removed otherwise);
    if another process got there first, its folder is kept and ours dropped."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        yield scratch
        try:
            os.rename(scratch, folder)
        except OSError:
            if not folder.is_dir():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def require(module: str) -> None:
    """Raises ConfigError naming the extra when ``module`` is not installed."""
    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"the graph engines need {module}: {EXTRA_HINT}")


def versions_of(engine: GraphEngineName) -> str:
    """The library versions a graph depends on, in its folder's name: a new one exports anew."""
    try:
        return "-".join(f"{package}{version(package)}" for package in _PACKAGES[engine])
    except PackageNotFoundError as exc:
        raise ConfigError(f"engine {engine} needs {exc.name}: {EXTRA_HINT}") from None
