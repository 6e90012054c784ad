"""Crash safety of prefix blocks: SIGKILL a writer of chains at random points, reopen, check every block.

The writer is a forked child (``tests.support.crashes.run_until_killed``) running
``tests.support.children.store_prefix_crash.run`` on a real LMDB store: it stores and extends
chains of prefix blocks, several blocks a call. After each kill: every chain a
committed call reached reads back whole and identical, the blocks of the call
in flight are all visible or none is, a lookup of a chain stops at the end of
what committed, no record or part of an uncommitted call is stored, and verify
is clean. Last, a daemon started on the store serves the same chains.
"""

from __future__ import annotations

import random
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from attnstore.errors import EntryNotFoundError
from attnstore.store import LmdbMapStore
from attnstore_client.connection import connect
from tests.support.children.store_prefix_crash import FINGERPRINT, LAYOUT, NAMESPACE, blocks_of, chain_of, run
from tests.support.crashes import run_until_killed
from tests.support.daemon import READ_TOKEN, DaemonProcess

KILLS = 24


class _Log:
    """What the children reported, across kills."""

    def __init__(self) -> None:
        self.committed: set[bytes] = set()  # chain hashes of every block a committed call stored
        self.chains = 0  # chains begun
        self.in_flight: tuple[int, int, int] | None = None  # (chain, first, last) of a call not reported done

    def feed(self, line: str) -> None:
        verb, chain, first, last = line.split(" ")
        if verb == "begin":
            self.in_flight = (int(chain), int(first), int(last))
            self.chains = max(self.chains, int(chain) + 1)
        else:
            self.committed.update(chain_of(int(chain))[: int(last)])
            self.in_flight = None

    def stored_end(self, chain: int) -> int:
        """Blocks of ``chain`` stored by committed calls: always the chain's first ones."""
        hashes = chain_of(chain)
        end = sum(h in self.committed for h in hashes)
        assert all(h in self.committed for h in hashes[:end])
        return end


def _settle_in_flight(store: LmdbMapStore, log: _Log) -> list[bytes]:
    """Count the call in flight at the kill as committed if its blocks landed; returns its blocks that did not."""
    if log.in_flight is None:
        return []
    chain, _, last = log.in_flight
    log.in_flight = None
    new = [h for h in chain_of(chain)[:last] if h not in log.committed]
    visible = [store.prefixes.match(NAMESPACE, [h]) == 1 for h in new]  # one hash: is its record there
    assert sum(visible) in (0, len(new)), f"chain {chain}: {sum(visible)} of the call's {len(new)} blocks are visible"
    if all(visible):
        log.committed.update(new)
        return []
    return new


def _check_store(store: LmdbMapStore, log: _Log) -> None:
    lost = _settle_in_flight(store, log)
    for chain in range(log.chains):
        hashes = list(chain_of(chain))
        end = log.stored_end(chain)
        assert store.prefixes.match(NAMESPACE, hashes) == end, f"chain {chain}: a lookup does not stop at block {end}"
        if end:
            expected = blocks_of(chain, end)
            for layer in range(LAYOUT.layers):
                want = np.concatenate([b.kv[layer] for b in expected], axis=2)
                assert np.array_equal(store.prefixes.read_layer(NAMESPACE, hashes[:end], layer), want)
            want = np.concatenate([b.hidden for b in expected])
            assert np.array_equal(store.prefixes.read_hidden(NAMESPACE, hashes[:end]), want)
    for chain_hash in lost:
        with pytest.raises(EntryNotFoundError):
            store.prefixes.read_layer(NAMESPACE, [chain_hash], 0)
    stats = store.stats()  # no record, and no part without its record, of an uncommitted call
    assert stats.prefix_blocks == len(log.committed)
    assert stats.prefix_bytes == len(log.committed) * LAYOUT.block_bytes
    report = store.verify()
    assert report.ok and report.prefix_blocks_checked == len(log.committed), report


def _kill_rounds(path: Path, rounds: int, seed: int) -> tuple[_Log, int]:
    """Kill a writer ``rounds`` times, checking the store after each; the log and the kills inside a call."""
    rng = random.Random(seed)
    log = _Log()
    kills_inside_a_call = 0
    for round_ in range(rounds):
        for line in run_until_killed(partial(run, path, log.chains, seed=seed + round_), rng.uniform(0.0, 0.15)):
            log.feed(line)
        kills_inside_a_call += log.in_flight is not None
        with LmdbMapStore.open(path) as store:
            _check_store(store, log)
    return log, kills_inside_a_call


def test_sigkill_mid_ingest_never_leaves_a_partial_chain_visible(tmp_path: Path) -> None:
    log, kills_inside_a_call = _kill_rounds(tmp_path / "store", KILLS, seed=20261123)
    assert len(log.committed) > 2 * KILLS  # the children did real work between kills
    assert kills_inside_a_call >= 5  # and were often killed inside a call


def test_a_daemon_restarted_on_a_killed_writers_store_serves_whole_committed_chains_only(tmp_path: Path) -> None:
    path = tmp_path / "store"
    log, _ = _kill_rounds(path, 4, seed=7)
    daemon = DaemonProcess(path, tmp_path).start()
    try:
        with connect(f"grpc://{daemon.target}", token=READ_TOKEN) as connection:
            rows = [list(chain_of(chain)) for chain in range(log.chains)]
            ends = connection.match_prefix(NAMESPACE, FINGERPRINT, LAYOUT.block_size, rows, timeout=10)
            assert ends == [log.stored_end(chain) for chain in range(log.chains)]
            served = [chain for chain, end in enumerate(ends) if end]
            stream = connection.fetch_prefix(NAMESPACE, FINGERPRINT, LAYOUT.block_size,
                                             [rows[chain][: ends[chain]] for chain in served], timeout=10)
            try:
                for row, chain in enumerate(served):
                    expected = blocks_of(chain, ends[chain])
                    for layer in range(LAYOUT.layers):
                        want = np.concatenate([b.kv[layer] for b in expected], axis=2)
                        assert np.array_equal(stream.layer(row, layer), want)
                    assert np.array_equal(stream.hidden(row), np.concatenate([b.hidden for b in expected]))
            finally:
                stream.close()
        with daemon.client() as remote:
            report = remote.verify()
            assert not report.corrupt and not report.problems
    finally:
        daemon.kill()
