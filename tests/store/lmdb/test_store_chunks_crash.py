"""Crash safety of chunk entries: SIGKILL a writer of chunks at random points, reopen, check every chunk.

The writer is a forked child (``tests.support.crashes.run_until_killed``) running
``tests.support.children.store_chunks_crash.run`` on a real LMDB store: it stores batches of
chunks, one ``put_chunks`` call a batch. After each kill: every chunk of a
committed call reads back whole and identical, the chunks of the call in flight
are all visible or none is, nothing of an uncommitted call is stored or counted,
and verify is clean.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from functools import cache, partial
from pathlib import Path

import numpy as np
import pytest

from attnstore.errors import EntryNotFoundError
from attnstore.protocol.chunks import StoredChunk
from attnstore.store import LmdbMapStore
from tests.support.children.store_chunks_crash import LAYOUT, NAMESPACE, batch_of, chunk_of, run
from tests.support.crashes import run_until_killed

KILLS = 24


def _check_store(
    store: LmdbMapStore, committed: set[int], in_flight: int | None, expected_chunk: Callable[[bytes], StoredChunk]
) -> set[int]:
    """Check the store against the committed batches (``expected_chunk``: a key's chunk); returns them with the
    batch in flight if it landed."""
    if in_flight is not None:
        keys = batch_of(in_flight)
        visible = [length is not None for length in store.chunks.lengths(NAMESPACE, list(keys))]
        assert sum(visible) in (0, len(keys)), f"batch {in_flight}: {sum(visible)} of {len(keys)} chunks visible"
        if all(visible):
            committed = committed | {in_flight}
        else:
            with pytest.raises(EntryNotFoundError):
                store.chunks.read(NAMESPACE, keys[0])
    keys = [key for batch in sorted(committed) for key in batch_of(batch)]
    for key in keys:
        expected = expected_chunk(key)
        assert np.array_equal(store.chunks.read(NAMESPACE, key), expected.kv)
        assert np.array_equal(store.chunks.read_layer(NAMESPACE, key, LAYOUT.layers - 1), expected.kv[-1])
    stats = store.stats()
    assert stats.chunk_entries == len(keys)
    assert stats.chunk_bytes == sum(expected_chunk(key).kv.nbytes for key in keys)
    report = store.verify()
    assert report.ok and report.chunks.checked == len(keys), report
    return committed


def test_sigkill_mid_put_chunks_never_leaves_part_of_a_call_visible(tmp_path: Path) -> None:
    path = tmp_path / "store"
    rng = random.Random(20261125)
    committed: set[int] = set()
    kills_inside_a_call = 0
    # Every round checks every committed chunk again: drawing each once, not once a round, was 11 of the test's 30 s.
    expected_chunk = cache(chunk_of)
    for round_ in range(KILLS):
        in_flight = None
        batches = max(committed, default=-1) + 1
        for line in run_until_killed(partial(run, path, batches, seed=round_), rng.uniform(0.0, 0.15)):
            verb, batch = line.split(" ")
            if verb == "begin":
                in_flight = int(batch)
            else:
                committed.add(int(batch))
                in_flight = None
        kills_inside_a_call += in_flight is not None
        with LmdbMapStore.open(path) as store:
            committed = _check_store(store, committed, in_flight, expected_chunk)
    assert len(committed) > 2 * KILLS  # the children did real work between kills
    assert kills_inside_a_call >= 5  # and were often killed inside a call
