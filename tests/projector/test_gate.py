"""The fidelity gate: its features, its decision, its JSON form and where the service finds it."""

from __future__ import annotations

import numpy as np
import pytest
import safetensors.numpy

from attnstore.errors import ConfigError, FormatVersionError
from attnstore.projector.blob import GATE_METADATA_KEY, gate_from_projector
from attnstore.projector.gate import FEATURES, FidelityGate, differing_positions, gate_features


def _gate(**changes: object) -> FidelityGate:
    fields = {"weights": (-1.0, 0.5, 0.0, -2.0, -1.0, -0.1), "bias": 2.0, "min_probability": 0.8, "candidates": 4,
              "fidelity": 0.99, "precision": 0.95}
    return FidelityGate(**{**fields, **changes})


def test_differing_positions_compare_the_query_with_the_entrys_prefix() -> None:
    assert differing_positions(np.array([1, 2, 3]), np.array([1, 9, 3])) == 1
    assert differing_positions(np.array([1, 2, 3]), np.array([1, 2, 3, 4, 5])) == 0  # a causal crop


def test_features_have_one_column_per_named_feature_in_order() -> None:
    features = gate_features(np.array([0.01, 0.1]), 20, np.array([0, 4]), np.array([0, 1]))
    assert features.shape == (2, len(FEATURES))
    np.testing.assert_allclose(features[1], [np.log(0.1 + 1e-6), np.log(20), np.log(4.5), 0.2, 4.0, 1.0])


def test_probability_falls_as_the_distance_and_the_differing_tokens_grow() -> None:
    gate = _gate()
    near, far = gate.probabilities(gate_features(np.array([0.01, 0.1]), 20, np.array([1, 1]), np.array([0, 0])))
    same, edited = gate.probabilities(gate_features(np.array([0.01, 0.01]), 20, np.array([0, 6]), np.array([0, 0])))
    assert near > far and same > edited and 0.0 < edited < same < 1.0


def test_the_cutoff_is_the_larger_of_the_set_level_threshold_and_the_precision() -> None:
    assert _gate(min_probability=0.8, precision=0.95).cutoff == 0.95
    assert _gate(min_probability=0.97, precision=0.95).cutoff == 0.97


def test_a_gate_round_trips_through_json_and_bad_ones_are_refused() -> None:
    gate = _gate()
    assert FidelityGate.from_json(gate.to_json()) == gate
    with pytest.raises(ConfigError, match="weights for"):
        _gate(weights=(1.0,))
    with pytest.raises(ConfigError, match="min_probability"):
        _gate(min_probability=0.0)
    with pytest.raises(ConfigError, match="candidates"):
        _gate(candidates=0)
    with pytest.raises(ConfigError, match="finite"):
        _gate(bias=float("nan"))
    with pytest.raises(ConfigError, match="malformed gate"):
        FidelityGate.from_json('{"weights": [1.0]')


def test_the_service_reads_the_gate_from_the_projector_blobs_metadata() -> None:
    tensor = {"weight": np.zeros(1, np.float32)}
    blob = safetensors.numpy.save(tensor, metadata={GATE_METADATA_KEY: _gate().to_json()})
    assert gate_from_projector(blob) == _gate()
    assert gate_from_projector(safetensors.numpy.save(tensor)) is None
    with pytest.raises(FormatVersionError, match="malformed gate"):
        gate_from_projector(safetensors.numpy.save(tensor, metadata={GATE_METADATA_KEY: '{"bias": 1}'}))
    with pytest.raises(FormatVersionError, match="not safetensors"):
        gate_from_projector(b"\x01\x02")
