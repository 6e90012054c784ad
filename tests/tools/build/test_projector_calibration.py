"""Calibrating the projector's distances to replay fidelity: the length rule, the threshold, the round trip."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch

from attnstore.errors import ConfigError, FormatVersionError
from attnstore.projector.gate import FidelityGate
from attnstore.service import AttnStoreService
from attnstore_client.cache import DEFAULT_MAX_DISTANCE, AttnCache
from attnstore_client.projector import Calibration, Projector, ProjectorConfig
from attnstore_tools.build.calibration import (
    MIN_PSEUDO_QUERIES,
    CalibrationConfig,
    _length_exponent,
    _threshold,
    min_hits,
)
from attnstore_tools.build.command import BuildConfig, BuildReport, build_namespace
from attnstore_tools.build.fit import format_fit
from attnstore_tools.build.training import TrainConfig


def test_the_fitted_exponent_recovers_a_boundary_that_grows_with_length():
    rng = np.random.default_rng(0)
    length = rng.integers(5, 80, size=4000)
    distance = rng.uniform(0.0005, 0.05, size=4000)
    faithful = distance < 2e-4 * length  # the faithful boundary grows linearly with the length: gamma = 1
    assert _length_exponent(distance, length, faithful) == pytest.approx(1.0, abs=0.1)
    flat = distance < 0.01  # no length effect
    assert _length_exponent(distance, length, flat) == pytest.approx(0.0, abs=0.1)


def test_the_exponent_is_zero_when_the_fit_has_nothing_to_say():
    length = np.array([10, 20, 30, 40])
    distance = np.array([0.1, 0.2, 0.3, 0.4])
    assert _length_exponent(distance, length, np.ones(4, dtype=bool)) == 0.0
    assert _length_exponent(distance, np.full(4, 10), np.array([True, False, True, False])) == 0.0


def test_the_threshold_is_the_largest_whose_hits_reach_the_precision():
    distance = np.array([0.1, 0.2, 0.3, 0.4, 0.5])
    faithful = np.array([True, True, False, True, False])
    assert _threshold(distance, faithful, 0.95, 1) == 0.2
    assert _threshold(distance, faithful, 0.75, 1) == 0.4
    assert _threshold(distance, np.zeros(5, dtype=bool), 0.5, 1) is None


def test_a_threshold_needs_enough_hits_for_its_precision_to_be_trusted():
    # 17 faithful picks of 17 are 100% on the pseudo-queries and say little about held-out rows.
    assert min_hits(0.95) == 59 and min_hits(0.55) == 6
    distance = np.linspace(0.001, 0.1, 80)
    faithful = np.arange(80) < 17
    assert _threshold(distance, faithful, 0.95, min_hits(0.95)) is None
    faithful = np.arange(80) < 70  # 70 faithful, then 10 not: the largest threshold of >= 59 hits at 95%
    assert _threshold(distance, faithful, 0.95, min_hits(0.95)) == pytest.approx(distance[72])
    with pytest.raises(ConfigError, match="precision"):
        CalibrationConfig(precision=1.0)


def test_a_calibrated_projector_scales_each_row_by_its_length_and_round_trips():
    projector = Projector(ProjectorConfig(hidden=8)).eval()
    rows = [torch.randn(10, 8), torch.randn(40, 8)]
    plain = projector.project(rows)
    projector.calibration = Calibration(length_exponent=0.5, reference_length=10, max_distance=0.02,
                                        fidelity=0.99, precision=0.95, pairs=100)
    scaled = projector.project(rows)
    np.testing.assert_allclose(scaled[0], plain[0], rtol=1e-5)  # the reference length is left as it is
    np.testing.assert_allclose(scaled[1], plain[1] * (40 / 10) ** -0.5, rtol=1e-5)
    again = Projector.from_safetensors_bytes(projector.to_safetensors_bytes())
    assert again.calibration == projector.calibration
    np.testing.assert_allclose(again.project(rows), scaled, rtol=1e-6)


def test_a_malformed_calibration_in_the_blob_is_a_format_error():
    blob = Projector(ProjectorConfig(hidden=8)).to_safetensors_bytes()
    (size,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + size])
    record = json.loads(header["__metadata__"]["attnstore.projector"])
    record["calibration"] = {"length_exponent": "steep"}
    header["__metadata__"]["attnstore.projector"] = json.dumps(record)
    raw = json.dumps(header).encode()
    broken = struct.pack("<Q", len(raw)) + raw + blob[8 + size :]
    with pytest.raises(FormatVersionError, match="calibration"):
        Projector.from_safetensors_bytes(broken)


def _build(
    model, texts: list[str], path, calibration: CalibrationConfig = CalibrationConfig()
) -> tuple[BuildReport, Projector]:
    """A calibrated namespace "ns" at ``path``: the build's report and the stored projector."""
    with AttnStoreService.open(path, create=True) as service:
        config = BuildConfig(namespace="ns", train=TrainConfig(max_epochs=2, patience=1), calibration=calibration)
        report = build_namespace(model, texts, service, config, progress=False)
        return report, Projector.from_safetensors_bytes(service.get_namespace("ns").projector)


def test_build_calibrates_a_new_projector_and_the_cache_defaults_to_its_threshold(minilm_model, tmp_path):
    texts = [f"the {c} {a} sat on the mat." for c in ("red", "green", "blue", "black") for a in ("cat", "dog", "owl")]
    texts += [f"a {c} {a} ran in the park." for c in ("red", "green", "blue", "black") for a in ("cat", "dog", "owl")]
    report, stored = _build(minilm_model, texts, tmp_path / "store")
    assert report.calibration is not None and report.calibration.pairs == 24
    assert stored.calibration == report.calibration.calibration
    with AttnCache(minilm_model, f"local:{tmp_path / 'store'}", namespace="ns") as cache:
        expected = stored.calibration.max_distance if stored.calibration.max_distance is not None else 0.0
        assert cache.max_distance == pytest.approx(expected)
    with AttnCache(minilm_model, f"local:{tmp_path / 'store'}", namespace="ns", max_distance=0.5) as cache:
        assert cache.max_distance == 0.5


def test_too_few_pseudo_queries_calibrate_the_projector_to_exact_hits_only(minilm_model, tmp_path):
    # Five lengths with three lines each and three lines of lengths of their own: 15 pseudo-queries, too few to
    # tell a faithful distance from an unfaithful one (the client's uncalibrated default would trust them).
    words = ["disk", "node", "job", "link", "fan", "port", "cpu", "log", "user", "task", "cache", "queue", "shard"]
    texts = [" ".join([first, *words[1:size]]) for size in (2, 4, 6, 8, 10) for first in ("alpha", "beta", "gamma")]
    texts += [" ".join(words[:size]) for size in (11, 12, 13)]
    report, stored = _build(minilm_model, texts, tmp_path / "store")
    assert report.calibration is not None and report.calibration.pairs < MIN_PSEUDO_QUERIES
    assert stored.calibration is not None and stored.calibration.max_distance is None and stored.gate is None
    assert any("exact hits only" in line for line in format_fit(None, report.calibration))
    with AttnCache(minilm_model, f"local:{tmp_path / 'store'}", namespace="ns") as cache:
        assert cache.max_distance == 0.0 and not cache.gated


def test_build_fits_a_fidelity_gate_and_stores_it_with_the_projector(minilm_model, tmp_path):
    # Long lines differing in one or two words replay faithfully; two-word lines mostly do not.
    texts = [f"the nightly backup job of service {s} on node {n} finished without errors and the archive was"
             " verified by the scheduler" for s in ("alpha", "beta", "gamma", "delta") for n in ("one", "two", "three")]
    texts += [f"{a} {b}." for a in ("red", "green", "blue", "black") for b in ("cat", "dog", "owl")]
    # Two dozen pseudo-queries give a cautious fit (no pick above P = 0.6): ask for 55% precision.
    report, stored = _build(minilm_model, texts, tmp_path / "store", CalibrationConfig(precision=0.55))
    with AttnStoreService.open(tmp_path / "store", readonly=True) as service:
        assert service.gate("ns") == stored.gate
        entry = next(iter(service.store.entries("ns")))
    gate = report.calibration.gate
    assert gate is not None and stored.gate == gate and gate.candidates == 4 and gate.cutoff >= 0.55
    assert report.calibration.gate_hit_rate > 0 and report.calibration.gate_hit_precision >= 0.55
    assert entry.token_ids is not None and len(entry.token_ids) == entry.length



def test_a_gate_whose_picks_never_reach_the_precision_on_their_own_is_not_stored(minilm_model, tmp_path):
    texts = [f"the nightly backup job of service {s} on node {n} finished without errors and the archive was"
             " verified by the scheduler" for s in ("alpha", "beta", "gamma", "delta") for n in ("one", "two", "three")]
    texts += [f"{a} {b}." for a in ("red", "green", "blue", "black") for b in ("cat", "dog", "owl")]
    report, stored = _build(minilm_model, texts, tmp_path / "store")  # precision 0.95: no pick is that sure
    assert report.calibration.gate is None and stored.gate is None
    assert stored.calibration is not None  # the calibrated threshold still decides

def test_the_cache_lets_the_namespaces_gate_decide_unless_given_a_max_distance(minilm_model, tmp_path):
    texts = [f"the {c} {a} sat on the mat." for c in ("red", "green", "blue", "black") for a in ("cat", "dog", "owl")]
    with AttnStoreService.open(tmp_path / "store", create=True) as service:
        build_namespace(minilm_model, texts + [t.replace("sat on", "slept by") for t in texts], service,
                        BuildConfig(namespace="ns", train=TrainConfig(max_epochs=1, patience=1), calibration=None),
                        progress=False)
        projector = Projector.from_safetensors_bytes(service.get_namespace("ns").projector)
        # A gate that trusts any candidate: whatever the distance, the nearest same-length entry is served.
        projector.gate = FidelityGate(weights=(0.0,) * 6, bias=10.0, min_probability=0.5, candidates=4,
                                      fidelity=0.99, precision=0.95)
        service.set_projector("ns", projector.to_safetensors_bytes())
    edited = "the pink cat sat on the mat."  # not stored; same length as the stored lines
    with AttnCache(minilm_model, f"local:{tmp_path / 'store'}", namespace="ns") as cache:
        assert cache.gated
        cache.encode([edited, texts[0]])
        assert cache.last_row_kinds == ("map", "exact")
        cache.max_distance = 0.0  # an explicit threshold turns the gate off
        assert not cache.gated
        cache.encode([edited])
        assert cache.last_row_kinds == ("miss",)
    with AttnCache(minilm_model, f"local:{tmp_path / 'store'}", namespace="ns", max_distance=0.0) as cache:
        assert not cache.gated


def test_an_uncalibrated_namespace_keeps_the_clients_default_threshold(minilm_model, tmp_path):
    texts = [f"the {c} {a} sat on the mat." for c in ("red", "green", "blue", "black") for a in ("cat", "dog", "owl")]
    with AttnStoreService.open(tmp_path / "store", create=True) as service:
        report = build_namespace(minilm_model, texts + [t.replace("sat on", "slept by") for t in texts], service,
                                 BuildConfig(namespace="ns", train=TrainConfig(max_epochs=1, patience=1),
                                             calibration=None),
                                 progress=False)
    assert report.calibration is None
    with AttnCache(minilm_model, f"local:{tmp_path / 'store'}", namespace="ns") as cache:
        assert cache.max_distance == DEFAULT_MAX_DISTANCE
