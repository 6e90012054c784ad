"""The feature projector: pooling, projection, safetensors round trip, input checks."""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import numpy as np
import pytest
import safetensors.torch
import torch

from attnstore.errors import ConfigError, FeatureSourceError, FormatVersionError
from attnstore_client.projector import Projector, ProjectorConfig

HIDDEN = 24


def _projector(**overrides: object) -> Projector:
    torch.manual_seed(0)
    return Projector(ProjectorConfig(HIDDEN, **overrides)).eval()


def _sources(lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(length, HIDDEN, generator=generator) for length in lengths]


def test_project_gives_one_float32_vector_of_dim_per_source_in_input_order() -> None:
    projector = _projector()
    sources = _sources([7, 3, 40, 7, 1])
    vectors = projector.project(sources)
    assert vectors.shape == (5, 128) and vectors.dtype == np.float32
    one_by_one = np.concatenate([projector.project([s]) for s in sources])
    np.testing.assert_allclose(vectors, one_by_one, rtol=1e-5, atol=1e-6)


def test_project_of_nothing_is_an_empty_matrix() -> None:
    assert _projector(dim=32).project([]).shape == (0, 32)


def test_project_is_deterministic_even_from_training_mode() -> None:
    projector = _projector(dropout=0.5).train()
    sources = _sources([9, 12])
    first, second = projector.project(sources), projector.project(sources)
    np.testing.assert_array_equal(first, second)
    assert projector.training  # the caller's mode is restored


def test_identical_inputs_project_to_the_same_vector() -> None:
    source = _sources([11])[0]
    vectors = _projector().project([source, source.clone(), _sources([11], seed=1)[0]])
    assert np.linalg.norm(vectors[0] - vectors[1]) < 1e-5  # rows of one matmul may round differently
    assert np.linalg.norm(vectors[0] - vectors[2]) > 1e-2


def test_pooling_keeps_position_a_one_token_edit_moves_less_than_a_reordering() -> None:
    base = _sources([16])[0]
    edited = base.clone()
    edited[5] = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(9))
    shuffled = base[torch.randperm(16, generator=torch.Generator().manual_seed(3))]
    pooled = _projector().pool([base, edited, shuffled])
    edit = (pooled[1] - pooled[0]).norm()
    reorder = (pooled[2] - pooled[0]).norm()
    assert 0 < edit < reorder
    # The mean slot alone cannot see a reordering: the positional bins do.
    assert torch.allclose(pooled[0, 16 * HIDDEN : 17 * HIDDEN], pooled[2, 16 * HIDDEN : 17 * HIDDEN], atol=1e-5)


def test_safetensors_round_trip_keeps_config_weights_and_outputs() -> None:
    projector = _projector(segments=8, width=16, dim=64)
    features = projector.config.features
    projector.set_standardisation(torch.full((features,), 0.5), torch.full((features,), 2.0))
    blob = projector.to_safetensors_bytes()
    assert isinstance(blob, bytes)
    restored = Projector.from_safetensors_bytes(blob)
    assert restored.config == projector.config and not restored.training
    sources = _sources([5, 30])
    np.testing.assert_array_equal(restored.project(sources), projector.project(sources))
    # A standard safetensors reader sees plain tensors and our JSON metadata.
    assert set(safetensors.torch.load(blob)) == set(projector.state_dict())
    (size,) = struct.unpack("<Q", blob[:8])
    metadata = json.loads(blob[8 : 8 + size])["__metadata__"]
    assert json.loads(metadata["attnstore.projector"])["config"]["segments"] == 8


def test_foreign_bytes_are_refused_with_format_errors() -> None:
    with pytest.raises(FormatVersionError, match="not safetensors"):
        Projector.from_safetensors_bytes(b"\x00" * 3)
    plain = safetensors.torch.save({"w": torch.zeros(2)})
    with pytest.raises(FormatVersionError, match="no projector metadata"):
        Projector.from_safetensors_bytes(plain)
    other = safetensors.torch.save(
        {"w": torch.zeros(2)}, metadata={"attnstore.projector": json.dumps({"format": "attnstore.projector/99"})}
    )
    with pytest.raises(FormatVersionError, match="projector/99"):
        Projector.from_safetensors_bytes(other)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (torch.randn(5, HIDDEN + 1), "got \\(5, 25\\)"),
        (torch.randn(HIDDEN), "got \\(24,\\)"),
        (torch.randn(0, HIDDEN), "L >= 1"),
        (torch.full((4, HIDDEN), float("nan")), "NaN or Inf"),
        (np.zeros((4, HIDDEN), dtype=np.float32), "ndarray"),
    ],
)
def test_bad_sources_raise_feature_source_errors(source: object, message: str) -> None:
    with pytest.raises(FeatureSourceError, match=message) as caught:
        _projector().project([_sources([3])[0], source])  # type: ignore[list-item]
    assert isinstance(caught.value, ValueError)


def test_half_precision_sources_are_accepted() -> None:
    source = _sources([6])[0]
    projector = _projector()
    np.testing.assert_allclose(
        projector.project([source.half()]), projector.project([source.half().float()]), rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize("field", ["hidden", "segments", "width", "dim", "max_length"])
def test_config_rejects_non_positive_sizes(field: str) -> None:
    values = {"hidden": HIDDEN, field: 0}
    with pytest.raises(ConfigError, match=field):
        ProjectorConfig(**values)  # type: ignore[arg-type]


def test_projector_module_imports_no_storage_backend() -> None:
    code = (
        "import sys, attnstore_client.projector; "
        "bad = [m for m in ('faiss', 'lmdb', 'zarr') if m in sys.modules]; "
        "sys.exit(f'imported {bad}' if bad else 0)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
