"""The shared ``Tier`` suite: every tier of a call passes it (``tiers.base.Tier``).

A tier is given some of a call's rows, some it can serve and some it cannot; it
must serve only rows it was given, each once, with its kind and its tally, hand
them to the call's sink with their last hidden states, and return the others
open, in the order given. Each tier is built from its public constructor over a
real store (an in-memory service, or LMDB for the prefix tier).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from attnstore.index import ExactIndex
from attnstore.service import AttnStoreService
from attnstore.store import MemoryMapStore
from attnstore_client.adapters import adapter_for
from attnstore_client.call.rows import NamespaceView, Row
from attnstore_client.call.settings import CallSettings
from attnstore_client.call.sinks import RowStates
from attnstore_client.call.state import Call
from attnstore_client.connection.local import LocalConnection
from attnstore_client.keys import model_fingerprint, token_hash
from attnstore_client.models import LoadedModel
from attnstore_client.namespace import NamespaceReader
from attnstore_client.resilience import CircuitBreaker
from attnstore_client.tiers.base import Tier, TierContext
from attnstore_client.tiers.compute import ComputeTier
from attnstore_client.tiers.cost_model import CostModel, CostSettings
from attnstore_client.tiers.local_exact import LocalExactTier, LocalOutputs
from attnstore_client.tiers.maps import MapTier
from attnstore_client.tiers.prefix import PrefixTier
from attnstore_client.tiers.store_exact import StoreExactTier
from tests.support.caches import fill_namespace, plain_hidden, sentences, tiny_loaded
from tests.support.prefixes import BLOCK, SHARED_A, fill_prefix_namespace, plain_rows, prefix_rows

TOLERANCE = 2e-3  # fp16 outputs and maps
TIERS = ["local_exact", "store_exact", "prefix", "maps", "compute"]
KINDS = {"local_exact": "exact", "store_exact": "exact", "prefix": "prefix", "maps": "map", "compute": "miss"}
TALLIES = {"exact": "exact_hits", "prefix": "prefix_hits", "map": "map_hits", "miss": "misses"}


@dataclass
class World:
    """A tier, the rows it is given, which of them it can serve, and what a call needs."""

    tier: Tier
    rows: list[Row]
    servable: set[int]  # row indices
    settings: CallSettings
    namespace: NamespaceView
    expected: Callable[[], list[torch.Tensor]]  # each given row's plain last hidden states


def _rows(token_rows: list[list[int]], first_index: int = 10) -> list[Row]:
    # Indices start past 0 so a tier that confuses a row's index with its position is caught.
    return [Row(first_index + k, tokens, token_hash(tokens)) for k, tokens in enumerate(token_rows)]


def _context(loaded: LoadedModel, connection: LocalConnection) -> TierContext:
    cost_model = CostModel(CostSettings(min_samples=10**9))
    return TierContext(adapter_for(loaded), connection, model_fingerprint(loaded.model, loaded.tokenizer),
                       CircuitBreaker(), lambda: cost_model)


def _encoder_world(name: str) -> World:
    bert = tiny_loaded("bert")
    texts = sentences(7, seed=41)
    service = AttnStoreService(MemoryMapStore(), make_index=ExactIndex)
    fill_namespace(service, bert, texts[:3])  # the first three are stored
    connection = LocalConnection("local:memory", service)
    context = _context(bert, connection)
    namespace = NamespaceReader(connection, "default", context.fingerprint, model=bert.name, causal=False,
                                device=context.device).read()
    ids = bert.tokenizer(texts)["input_ids"]
    rows = _rows(ids)
    outputs = LocalOutputs(1 << 20, admit_after=1)
    local = LocalExactTier(context, outputs)
    exact = name != "maps"  # the map tier's world has its hits only as maps
    settings = CallSettings("default", max_distance=1e-3, exact=exact, batch_size=2)
    stored = {row.index for row in rows[:3]}
    if name == "local_exact":
        for row, states in zip(rows[:3], plain_hidden(bert, texts[:3]), strict=True):
            outputs.put(local.key(row), states.numpy())
    tiers: dict[str, Tier] = {
        "local_exact": local, "store_exact": StoreExactTier(context, local), "maps": MapTier(context),
        "compute": ComputeTier(context, local),
    }
    servable = {row.index for row in rows} if name == "compute" else stored
    return World(tiers[name], rows, servable, settings, namespace, lambda: plain_hidden(bert, texts))


def _prefix_world(folder: Path) -> Iterator[World]:
    llama = tiny_loaded("llama")
    with AttnStoreService.open(folder / "store", create=True) as service:
        fill_prefix_namespace(service, llama, prefix_rows([5], seed=1, prefix=SHARED_A))
        connection = LocalConnection("local:memory", service)
        context = _context(llama, connection)
        namespace = NamespaceReader(connection, "default", context.fingerprint, model=llama.name, causal=True,
                                    device=context.device).read()
        # Two rows over the stored prefix, one without, one too short for a block.
        token_rows = prefix_rows([3, 9], seed=5, prefix=SHARED_A) + prefix_rows([30, BLOCK - 2], seed=6)
        rows = _rows(token_rows)
        settings = CallSettings("default", max_distance=1e-3, exact=False, prefix_min_tokens=BLOCK, batch_size=2)
        yield World(PrefixTier(context), rows, {rows[0].index, rows[1].index}, settings, namespace,
                    lambda: plain_rows(llama, token_rows))


@pytest.fixture(params=TIERS)
def world(request, tmp_path: Path) -> Iterator[World]:
    if request.param == "prefix":
        yield from _prefix_world(tmp_path)
    else:
        yield _encoder_world(request.param)


def _call(world: World) -> tuple[Call, RowStates]:
    rows = max(row.index for row in world.rows) + 2  # one position past the given rows: a copy's
    sink = RowStates(rows)
    return Call(world.settings, world.namespace, sink, rows), sink


def test_a_tier_serves_only_rows_it_was_given_and_leaves_the_rest_open_in_order(world: World) -> None:
    call, sink = _call(world)
    left = world.tier.serve(list(world.rows), call)
    assert left == [row for row in world.rows if row.index not in world.servable]
    served = {i for i, kind in enumerate(call.kinds) if kind}
    assert served == world.servable  # nothing outside the given rows
    assert {i for i, states in enumerate(sink.rows) if states is not None} == served


def test_a_tier_hands_the_sink_each_served_rows_own_last_hidden_states(world: World) -> None:
    call, sink = _call(world)
    world.tier.serve(list(world.rows), call)
    for row, expected in zip(world.rows, world.expected(), strict=True):
        if row.index in world.servable:
            got = sink.rows[row.index]
            assert got is not None and got.shape == expected.shape
            assert (got - expected).abs().max().item() < TOLERANCE


def test_a_tier_counts_what_it_served_under_its_kind(world: World) -> None:
    call, _ = _call(world)
    world.tier.serve(list(world.rows), call)
    kind = KINDS[world.tier.name]
    assert {call.kinds[i] for i in world.servable} == {kind}
    assert getattr(call.counts, TALLIES[kind]) == len(world.servable)
    others = [tally for name, tally in TALLIES.items() if name != kind]
    assert all(getattr(call.counts, tally) == 0 for tally in others)
    assert call.counts.fallbacks == {}


def test_copies_of_a_served_row_waiting_in_the_call_are_answered_with_it(world: World) -> None:
    call, sink = _call(world)
    first = next(row for row in world.rows if row.index in world.servable)
    copy = len(call.kinds) - 1
    call.copies[first.index] = [copy]
    world.tier.serve(list(world.rows), call)
    assert call.kinds[copy] == call.kinds[first.index] and not call.copies
    np.testing.assert_array_equal(sink.rows[copy], sink.rows[first.index])
