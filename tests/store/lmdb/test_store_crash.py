"""Crash safety: SIGKILL a writer at random points, then reopen and check everything.

The writer is a forked child (fork keeps this fast: no interpreter start-up per
kill) running ``tests.support.children.store_crash.run`` on a real LMDB store. After each kill:
no partial entry is visible, every committed entry reads back intact, a batch
in flight is either wholly there or wholly absent, ids are never reused, and
verify is clean.
"""

from __future__ import annotations

import random
from functools import partial

import numpy as np

from attnstore.store import LmdbMapStore
from attnstore.store.codecs import q8_error_bound
from tests.support.children.store_crash import LAYOUTS, crash_entry, run
from tests.support.crashes import run_until_killed

KILLS = 24


class _Log:
    """What the children reported, across kills."""

    def __init__(self) -> None:
        self.committed: dict[tuple[str, int], int] = {}  # (namespace, id) -> k
        self.max_id = 0
        self.next_k = 0
        self.ingest_in_flight: tuple[str, list[int]] | None = None
        self.delete_in_flight: tuple[str, int] | None = None

    def feed(self, line: str) -> None:
        verb, name, arg = line.split(" ")
        if verb == "begin-ingest":
            ks = [int(k) for k in arg.split(",")]
            self.ingest_in_flight = (name, ks)
            self.next_k = max(self.next_k, ks[-1] + 1)
        elif verb == "ingested":
            for pair in arg.split(","):
                entry_id, k = map(int, pair.split(":"))
                self.committed[(name, entry_id)] = k
            self.ingest_in_flight = None
        elif verb == "begin-delete":
            self.delete_in_flight = (name, int(arg))
        elif verb == "deleted":
            self.committed.pop((name, int(arg)), None)
            self.delete_in_flight = None


def _check_entry(store: LmdbMapStore, name: str, entry_id: int, k: int) -> None:
    expected = crash_entry(name, k)
    info = store.entry(name, entry_id)
    assert info.token_hash == expected.token_hash
    maps = store.read_maps(name, entry_id).astype(np.float32)
    if LAYOUTS[name].codec == "fp16":
        assert np.array_equal(maps, expected.maps.astype(np.float32))
    else:
        reference = expected.maps.astype(np.float32)
        assert (np.abs(maps - reference) <= q8_error_bound(reference.max(axis=-1))[..., None]).all()
    assert np.array_equal(store.read_outputs(name, entry_id), expected.outputs)
    assert np.array_equal(info.feature, expected.feature)


def _check_store(store: LmdbMapStore, log: _Log) -> None:
    live = {(name, e.id): e for name in LAYOUTS for e in store.entries(name)}
    for key, k in log.committed.items():
        assert key in live or key == log.delete_in_flight, f"committed entry {key} (k={k}) is gone"
    if log.delete_in_flight is not None and log.delete_in_flight not in live:
        log.committed.pop(log.delete_in_flight, None)  # the delete committed before the kill
    log.delete_in_flight = None
    unexplained = set(live) - set(log.committed)
    if log.ingest_in_flight is not None:
        name, ks = log.ingest_in_flight
        hashes = {crash_entry(name, k).token_hash: k for k in ks}
        landed = {key: hashes[live[key].token_hash] for key in unexplained if live[key].token_hash in hashes}
        assert len(landed) in (0, len(ks)), f"batch {ks} only partly visible: {landed}"
        log.committed.update(landed)
        unexplained -= set(landed)
        log.ingest_in_flight = None
    assert not unexplained, f"entries nobody committed are visible: {unexplained}"
    new_ids = [i for (_, i) in live if i > log.max_id]
    assert len(new_ids) == len(set(new_ids))
    for (name, entry_id), k in log.committed.items():
        _check_entry(store, name, entry_id, k)
    log.max_id = max([log.max_id] + [i for (_, i) in live])
    report = store.verify()
    assert report.ok and report.orphan_objects == 0, report
    assert store.stats().entries == len(live)


def test_sigkill_at_random_points_never_leaves_a_partial_entry_visible(tmp_path):
    path = tmp_path / "store"
    rng = random.Random(20240607)
    log = _Log()
    kills_inside_a_call = 0
    for round_ in range(KILLS):
        for line in run_until_killed(partial(run, path, log.next_k, seed=round_), rng.uniform(0.0, 0.15)):
            log.feed(line)
        kills_inside_a_call += log.ingest_in_flight is not None or log.delete_in_flight is not None
        with LmdbMapStore.open(path) as store:
            _check_store(store, log)
    assert len(log.committed) > KILLS  # the children did real work between kills
    assert kills_inside_a_call >= 5  # and were often killed inside an ingest or delete
