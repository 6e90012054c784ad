"""The harness baselines: LazyFormer and SAN share maps across layers, AttnCache-f replays stored maps per layer."""

from __future__ import annotations

import math

import pytest
import torch

from attnstore.errors import ConfigError
from attnstore.service import AttnStoreService
from attnstore.store import NamespaceLayout, NewEntry
from attnstore_client.adapters import Adapter, adapter_for
from attnstore_client.adapters.batch import batch_from_ids
from attnstore_client.keys import token_hash
from attnstore_tools.eval.baselines import (
    AttnCacheFVariant,
    LayerKeys,
    LazyFormerVariant,
    SanCalibration,
    SanVariant,
    _js_divergence,
    calibrate_san,
    lazyformer_sources,
)
from attnstore_tools.eval.planned import SharedMapsPlan, forward_planned
from tests.support.adapters import max_diff, random_rows, tiny_model

LENGTHS = [7, 4, 6]
FP = "f" * 64


@pytest.fixture(scope="module", params=["llama", "bert"])
def adapter(request) -> Adapter:
    return adapter_for(tiny_model(request.param))


@pytest.fixture(scope="module")
def batch():
    return batch_from_ids(random_rows(LENGTHS), pad_id=0)


def _rows_diff(rows: list[torch.Tensor], out: torch.Tensor) -> float:
    """Max abs difference of per-row (L, hidden) outputs and a (B, P, hidden) output at real positions."""
    return max(max_diff(row, out[b, : row.shape[0]]) for b, row in enumerate(rows))


# --- LazyFormer ---------------------------------------------------------------------


def test_lazyformer_pairs_each_odd_layer_with_the_even_layer_before_and_an_odd_count_ends_computing():
    assert lazyformer_sources(4) == {1: 0, 3: 2}
    assert lazyformer_sources(5) == {1: 0, 3: 2}
    assert lazyformer_sources(1) == {}


def test_lazyformer_output_equals_replaying_its_own_kept_maps_with_odd_layers_copied(adapter, batch):
    variant = LazyFormerVariant(adapter)
    run = variant.run(batch)
    computing = [layer for layer in range(adapter.num_layers) if layer not in variant.sources]
    plan = SharedMapsPlan(variant.sources, keep_layers=computing)  # every computing layer's maps, to replay them
    forward_planned(adapter, batch, plan)
    maps = {
        row: torch.stack([plan.kept[variant.sources.get(layer, layer)][row] for layer in range(adapter.num_layers)])
        for row in range(batch.size)
    }  # row -> (layers, H, L, L), layer 1 = layer 0
    assert _rows_diff(run.hidden, adapter.forward(batch, maps)) <= 1e-4
    assert _rows_diff(run.hidden, adapter.forward(batch)) > 1e-3  # the sharing changes the output
    assert (run.layer_replays, run.retrieval_s, variant.name) == (batch.size, 0.0, "lazyformer")


# --- SAN ------------------------------------------------------------------------------


def test_js_divergence_is_zero_for_equal_rows_and_ln2_for_disjoint_ones():
    p = torch.tensor([[1.0, 0.0], [0.5, 0.5]])
    q = torch.tensor([[0.0, 1.0], [0.5, 0.5]])
    assert torch.allclose(_js_divergence(p, q), torch.tensor([math.log(2), 0.0]))


def test_san_chains_resolve_to_the_first_computing_layer():
    calibration = SanCalibration(divergences=(0.1, 0.05, 0.3, 0.01), inputs=1)
    assert calibration.sources(0.2) == {1: 0, 2: 0, 4: 3}
    assert calibration.sources(0.0) == {}


def test_san_calibration_gives_one_divergence_per_adjacent_pair_within_js_bounds(adapter, batch):
    calibration = calibrate_san(adapter, [batch])
    assert calibration.inputs == batch.size and len(calibration.divergences) == adapter.num_layers - 1
    assert all(0.0 < d <= math.log(2) for d in calibration.divergences)
    with pytest.raises(ConfigError, match="no calibration inputs"):
        calibrate_san(adapter, [])


def test_san_threshold_zero_equals_the_plain_model(adapter, batch):
    variant = SanVariant(adapter, calibrate_san(adapter, [batch]), 0.0)
    run = variant.run(batch)
    assert variant.sources == {} and run.layer_replays == 0
    assert _rows_diff(run.hidden, adapter.forward(batch)) <= 1e-4


def test_san_huge_threshold_makes_every_layer_reuse_layer_zero(adapter, batch):
    variant = SanVariant(adapter, calibrate_san(adapter, [batch]), 1e9)
    run = variant.run(batch)
    assert variant.sources == {layer: 0 for layer in range(1, adapter.num_layers)} and variant.setting == 1e9
    first = adapter.capture(batch).maps
    maps = {row: first[row][:1].expand(adapter.num_layers, -1, -1, -1) for row in range(batch.size)}
    assert _rows_diff(run.hidden, adapter.forward(batch, maps)) <= 1e-4
    assert run.layer_replays == batch.size * (adapter.num_layers - 1)


def test_san_refuses_a_calibration_of_another_model(adapter):
    with pytest.raises(ConfigError, match="calibration of 2 layers"):
        SanVariant(adapter, SanCalibration(divergences=(0.1,), inputs=1), 0.5)


# --- AttnCache-f ----------------------------------------------------------------------


@pytest.fixture
def stored(adapter, tmp_path):
    """A real store holding five captured rows (three of length 6, two of length 4)."""
    rows = random_rows([6, 6, 6, 4, 4], seed=7)
    captured = adapter.capture(batch_from_ids(rows, pad_id=0))
    layout = NamespaceLayout(
        layers=adapter.num_layers, heads=adapter.num_heads, causal=adapter.causal, hidden=adapter.hidden_size
    )
    with AttnStoreService.open(tmp_path / "s", create=True) as service:
        service.create_namespace("ns", model="tiny", fingerprint=FP, layout=layout)
        entries = [
            NewEntry(maps=maps, token_hash=token_hash(ids), outputs=hidden)
            for ids, maps, hidden in zip(rows, captured.maps, captured.hidden, strict=True)
        ]
        ids = service.ingest("ns", FP, entries).entry_ids
        yield service, rows, ids


def test_layer_keys_cover_each_stored_row_once_and_q_sets_quantile_thresholds(adapter, stored):
    service, rows, _ = stored
    unstored = random_rows([5], seed=8)[0]
    keys = LayerKeys.build(adapter, service, "ns", [*rows, rows[0], unstored], batch_size=2, pad_id=0)
    assert [loo.size for loo in keys.loo] == [5] * adapter.num_layers
    assert keys.thresholds(0.0) == [-math.inf] * adapter.num_layers
    assert keys.thresholds(1.0) == pytest.approx([float(loo.max()) for loo in keys.loo])
    with pytest.raises(ConfigError, match=r"q must be in \[0, 1\], got 1.5"):
        keys.thresholds(1.5)
    with pytest.raises(ConfigError, match="none of the 1 rows"):
        LayerKeys.build(adapter, service, "ns", [unstored], pad_id=0)


def test_attncache_f_at_q_zero_equals_the_plain_model(adapter, stored):
    service, rows, _ = stored
    keys = LayerKeys.build(adapter, service, "ns", rows, pad_id=0)
    batch = batch_from_ids([rows[0], *random_rows([5])], pad_id=0)
    run = AttnCacheFVariant(adapter, service, "ns", keys, 0.0).run(batch)
    assert (run.layer_replays, run.map_hits, run.retrieval_s) == (0, 0, 0.0)
    assert _rows_diff(run.hidden, adapter.forward(batch)) <= 1e-4


def test_attncache_f_replays_every_layer_of_a_stored_row_from_its_entry_and_reproduces_the_output(adapter, stored):
    service, rows, ids = stored
    keys = LayerKeys.build(adapter, service, "ns", rows, pad_id=0)
    batch = batch_from_ids([rows[0], *random_rows([5])], pad_id=0)  # row 1: no stored entry of its length
    variant = AttnCacheFVariant(adapter, service, "ns", keys, 0.5)
    plan = variant.plan()
    out = forward_planned(adapter, batch, plan)
    assert plan.replayed == [(0, layer, ids[0]) for layer in range(adapter.num_layers)]
    plain = adapter.forward(batch)
    assert max_diff(out[0, :6], plain[0, :6]) <= 1e-3
    assert max_diff(out[1, :5], plain[1, :5]) <= 1e-4
    run = variant.run(batch)
    assert (run.layer_replays, run.map_hits) == (adapter.num_layers, 1)
    assert run.retrieval_s > 0
