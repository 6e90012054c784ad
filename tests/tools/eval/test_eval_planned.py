"""Planned forwards (the eval baselines' ``forward_planned``): a LayerPlan decides per layer which rows replay and
which computed maps are kept."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest
import torch

from attnstore.errors import ConfigError, MapShapeError
from attnstore_client.adapters import Adapter, adapter_for
from attnstore_client.adapters.batch import batch_from_ids
from attnstore_tools.eval.planned import LayerPlan, SharedMapsPlan, forward_planned
from tests.support.adapters import max_diff, random_rows, tiny_model

LENGTHS = [7, 4, 6]  # padded: rows 1 and 2 are shorter than the batch


class _ScriptedPlan(LayerPlan):
    """Replays given maps per (layer, row); keeps the listed layers and records what it is handed."""

    def __init__(self, replays: Mapping[int, Mapping[int, torch.Tensor]], keep_layers: Sequence[int] = ()) -> None:
        self.replays = replays
        self.keep_layers = set(keep_layers)
        self.kept: dict[int, dict[int, torch.Tensor]] = {}
        self.seen: list[tuple[int, tuple[int, ...]]] = []  # (layer, hidden shape) per call

    def replay(self, layer, hidden, lengths):
        self.seen.append((layer, tuple(hidden.shape)))
        return self.replays.get(layer, {})

    def keeps(self, layer):
        return layer in self.keep_layers

    def keep(self, layer, maps):
        self.kept[layer] = dict(maps)


@pytest.fixture(scope="module", params=["llama", "bert"])
def adapter(request) -> Adapter:
    return adapter_for(tiny_model(request.param))


@pytest.fixture(scope="module")
def batch():
    return batch_from_ids(random_rows(LENGTHS), pad_id=0)


def _rows_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference over real positions of two (B, P, hidden) outputs."""
    return max(max_diff(a[row, :length], b[row, :length]) for row, length in enumerate(LENGTHS))


def test_plan_that_replays_and_keeps_nothing_equals_plain_forward_and_sees_every_layer_input(adapter, batch):
    plan = _ScriptedPlan({})
    out = forward_planned(adapter, batch, plan)
    assert _rows_diff(out, adapter.forward(batch)) <= 1e-4
    assert plan.seen == [(layer, (3, 7, adapter.hidden_size)) for layer in range(adapter.num_layers)]


def test_plan_keeping_every_layer_hands_back_capture_maps_and_plain_outputs(adapter, batch):
    plan = SharedMapsPlan({}, keep_layers=range(adapter.num_layers))
    out = forward_planned(adapter, batch, plan)
    captured = adapter.capture(batch).maps
    assert sorted(plan.kept) == list(range(adapter.num_layers))
    for layer, rows in plan.kept.items():
        assert sorted(rows) == [0, 1, 2]
        for row, maps in rows.items():
            assert maps.shape == (adapter.num_heads, LENGTHS[row], LENGTHS[row]) and maps.dtype == torch.float32
            assert max_diff(maps, captured[row][layer]) <= 1e-5
    assert _rows_diff(out, adapter.forward(batch)) <= 1e-4


def test_plan_replaying_one_row_while_others_compute_and_keep_equals_forward_replaying_that_row(adapter, batch):
    captured = adapter.capture(batch).maps
    layers = range(adapter.num_layers)
    plan = _ScriptedPlan({layer: {1: captured[1][layer]} for layer in layers}, keep_layers=layers[1:])
    out = forward_planned(adapter, batch, plan)
    # Layer 0 computes rows 0 and 2 with the module's own kernel; later layers keep only their maps.
    assert sorted(plan.kept) == list(layers[1:]) and all(sorted(rows) == [0, 2] for rows in plan.kept.values())
    for layer, rows in plan.kept.items():
        assert all(max_diff(maps, captured[row][layer]) <= 1e-5 for row, maps in rows.items())
    assert _rows_diff(out, adapter.forward(batch, {1: captured[1]})) <= 1e-4


def test_causal_plan_maps_of_a_longer_row_are_cropped_to_the_shared_prefix():
    llama = adapter_for(tiny_model("llama"))
    rows = random_rows(LENGTHS)
    batch = batch_from_ids(rows, pad_id=0)
    longer = llama.capture(batch_from_ids([rows[1] + rows[0]], pad_id=0)).maps[0]  # (layers, H, 11, 11)
    plan = _ScriptedPlan({layer: {1: longer[layer]} for layer in range(llama.num_layers)})
    assert _rows_diff(forward_planned(llama, batch, plan), llama.forward(batch)) <= 1e-4


@pytest.mark.parametrize(
    ("replays", "message"),
    [
        ({1: {3: None}}, "row 3"),  # no row 3 in a batch of 3
        ({1: {0: torch.rand(2, 7, 7)}}, "heads=4"),
        ({0: {2: torch.rand(4, 5, 5)}}, "length 5"),
    ],
)
def test_bad_plan_rows_or_maps_raise_map_shape_error_and_leave_the_model_unpatched(adapter, batch, replays, message):
    with pytest.raises(MapShapeError, match=message):
        forward_planned(adapter, batch, _ScriptedPlan(replays))
    assert all("forward" not in module.__dict__ for module in adapter.attention_modules)


def test_plan_that_keeps_without_implementing_keep_says_so(adapter, batch):
    class KeepsOnly(LayerPlan):
        def replay(self, layer, hidden, lengths):
            return {}

        def keeps(self, layer):
            return True

    with pytest.raises(NotImplementedError, match="KeepsOnly.keeps"):
        forward_planned(adapter, batch, KeepsOnly())


@pytest.mark.parametrize(
    ("sources", "keep_layers", "message"),
    [
        ({1: 2}, (), "layer 1 cannot reuse layer 2"),  # a later layer
        ({1: 0, 2: 1}, (), "layer 2 cannot reuse layer 1"),  # a source that replays (unresolved chain)
        ({1: 0}, (1,), r"cannot keep layers \[1\]"),
    ],
)
def test_shared_maps_plan_refuses_sources_that_are_not_earlier_computing_layers(sources, keep_layers, message):
    with pytest.raises(ConfigError, match=message):
        SharedMapsPlan(sources, keep_layers=keep_layers)
