"""The GPU tests (``pytest -m gpu``; scripts/gpu_check.sh runs them on a lent GPU machine).

Every test here is marked ``gpu`` and skipped, naming why, where torch sees no CUDA device. Setting
``ATTNSTORE_GPU_TESTS_DEVICE=cpu`` runs them on the CPU instead: a check of the tests themselves (their CPU
reference and their device run then coincide), never a GPU result.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

STAND_IN = os.environ.get("ATTNSTORE_GPU_TESTS_DEVICE", "")


def cuda_skip_reason() -> str | None:
    """Why the GPU tests cannot run here, or None when they can."""
    if STAND_IN:
        return None
    if torch.cuda.is_available():
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible == "":
        return "needs a CUDA device: CUDA_VISIBLE_DEVICES is empty"
    if torch.version.cuda is None:
        return f"needs a CUDA device: this torch ({torch.__version__}) is a CPU build"
    return "needs a CUDA device: torch.cuda.is_available() is False on this machine"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = cuda_skip_reason()
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.gpu)
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The device under test: the GPU (or the stand-in of ``ATTNSTORE_GPU_TESTS_DEVICE``)."""
    return torch.device(STAND_IN or "cuda")


@pytest.fixture(scope="session")
def minilm_path() -> str:
    """all-MiniLM-L6-v2's folder: the one ``bench gpu`` gives random weights (``ATTNSTORE_GPU_MODELS``), else the
    packaged model; skipped when neither is there."""
    carried = os.environ.get("ATTNSTORE_GPU_MODELS")
    if carried and (Path(carried) / "minilm" / "model.safetensors").is_file():
        return str(Path(carried) / "minilm")
    from attnstore.errors import ConfigError
    from attnstore_client.models import resolve_model_path

    try:
        return str(resolve_model_path("minilm"))
    except ConfigError:
        pytest.skip("needs all-MiniLM-L6-v2: ATTNSTORE_GPU_MODELS is unset (bench gpu sets it) and the wheel is not"
                    " installed")
