"""Write-back against the real daemon (a subprocess, real LMDB) and client processes.

A cold-start namespace (exact tier only, made by ``admin create-namespace``'s
code) fills from what the client processes compute; in a namespace with a
projector, a written-back row goes with its maps and feature and is a map hit
for the next near-duplicate on any node.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from attnstore.errors import AttnStoreError
from attnstore.protocol import keys as protocol_keys
from attnstore.protocol.requests import exact_request
from attnstore.protocol.write_back import row_to_pb
from attnstore_client.adapters import adapter_for
from attnstore_client.keys import token_hash
from attnstore_tools.admin.cold_start import create_exact_namespace
from attnstore_tools.build.namespace_layout import token_limits
from tests.support.caches import capture_entries, plain_hidden, sentences, tiny_loaded
from tests.support.daemon import ADMIN_TOKEN, OTHER_WRITE_TOKEN, READ_TOKEN, WRITE_TOKEN, DaemonProcess

ROOT = Path(__file__).resolve().parents[2]  # children run as modules of tests.support from here
COUNT = 10


def _callers(
    url: str, tokens: list[str], seed: int, texts: list[str] | None = None, max_distance: float = 0.0
) -> list[dict]:
    """One client process encoding ``sentences(COUNT, seed)`` (or ``texts``) once per token, in turn, each through a
    new cache: each caller's report. Callers that need not be processes of their own share one (the interpreter's
    start with torch is most of a run)."""
    extra = [json.dumps(texts), str(max_distance)] if texts is not None else []
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.children.write_back", url, ",".join(tokens), str(seed), str(COUNT),
         *extra],
        capture_output=True, text=True, cwd=ROOT, timeout=180, check=False,
    )
    assert done.returncode == 0, done.stderr
    reports = [json.loads(line) for line in done.stdout.strip().splitlines() if line.startswith("{")]
    assert len(reports) == len(tokens), done.stdout
    return reports


def _child(url: str, token: str, seed: int, texts: list[str] | None = None, max_distance: float = 0.0) -> dict:
    """A client process of its own encoding once with ``token``: its report."""
    (report,) = _callers(url, [token], seed, texts, max_distance)
    return report


def _daemon(workdir: Path, admit_after: int) -> DaemonProcess:
    process = DaemonProcess(workdir / "store", workdir, extra_args=("--admit-after", str(admit_after))).start()
    with process.client(ADMIN_TOKEN) as admin:
        create_exact_namespace(admin, tiny_loaded("bert"), "default")
    return process


@pytest.fixture(scope="module")
def admit_every_miss(tmp_path_factory: pytest.TempPathFactory):
    process = _daemon(tmp_path_factory.mktemp("write-back-1"), 1)
    yield process
    assert process.stop() == 0, process.log()


@pytest.fixture(scope="module")
def admit_second_ask(tmp_path_factory: pytest.TempPathFactory):
    process = _daemon(tmp_path_factory.mktemp("write-back-2"), 2)
    yield process
    assert process.stop() == 0, process.log()


@pytest.fixture(scope="module")
def with_projector(tmp_path_factory: pytest.TempPathFactory):
    """A daemon admitting every miss, whose namespace has a projector (with the embedding layer it derives written-back
    rows' features with) and entries of 3 tokens only."""
    workdir = tmp_path_factory.mktemp("write-back-maps")
    process = DaemonProcess(workdir / "store", workdir, extra_args=("--admit-after", "1")).start()
    loaded = tiny_loaded("bert")
    captured = capture_entries(loaded, sentences(4, seed=40, min_words=3, max_words=3))
    with process.client(ADMIN_TOKEN) as admin:
        admin.create_namespace("default", model=loaded.name, fingerprint=captured.fingerprint,
                               layout=captured.layout, projector=adapter_for(loaded).embedding_layer().attach_to(
                                   captured.projector.to_safetensors_bytes()), limits=token_limits(loaded))
        admin.ingest("default", captured.fingerprint, captured.entries)
    yield process
    assert process.stop() == 0, process.log()


def test_a_row_written_back_by_one_node_is_a_map_hit_for_a_near_duplicate_on_another(
    with_projector: DaemonProcess,
) -> None:
    url = f"grpc://{with_projector.target}"
    words = sentences(1, seed=41, min_words=10, max_words=10)[0].split()
    text, near = " ".join(words), " ".join([*words[:-1], "w2" if words[-1] != "w2" else "w3"])
    # Node 1 computes the row (admitted on its first ask) and writes it back with its maps and feature.
    first = _child(url, WRITE_TOKEN, 0, [text], 1e9)
    assert first["stats"]["misses"] == 1
    assert (first["written"]["stored"], first["written"]["maps_stored"]) == (1, 1)
    assert first["max_diff"] < 1e-5  # keeping its maps left the row's outputs the plain model's
    # Node 2: the near-duplicate (same length, the only entry of it) replays those maps; the row itself is exact.
    second = _child(url, WRITE_TOKEN, 0, [near, text], 1e9)
    assert (second["stats"]["map_hits"], second["stats"]["exact_hits"], second["stats"]["misses"]) == (1, 1, 0)
    assert second["row_diffs"][1] < 2e-3  # the exact hit serves node 1's outputs within the fp16 budget
    assert second["written"]["queued"] == 0  # nothing was computed, so nothing is written back
    with with_projector.client(READ_TOKEN) as reader:
        stats = reader.stats()
    assert (stats.written_back_entries, stats.written_back_map_entries) == (1, 1)
    layout = capture_entries(tiny_loaded("bert"), [text]).layout
    assert stats.written_back_map_bytes == layout.map_nbytes(10)
    assert stats.written_back_bytes == layout.map_nbytes(10) + layout.outputs_nbytes(10)


def test_maps_disagreeing_with_their_tokens_refuse_that_row_and_nothing_is_stored(
    with_projector: DaemonProcess,
) -> None:
    ids = np.arange(5, 12)
    with with_projector.client(WRITE_TOKEN) as writer:
        namespace = writer.get_namespace("default")
        before = writer.stats().entries
        writer.lookup(exact_request("default", namespace.fingerprint, [protocol_keys.token_hash(ids)], [len(ids)]))
        layout = namespace.layout
        outputs = np.zeros((len(ids), layout.hidden), np.float32)
        maps = np.full((layout.layers, layout.heads, len(ids) - 1, len(ids) - 1), 1 / (len(ids) - 1), np.float32)
        reply = writer.write_back("default", namespace.fingerprint, [row_to_pb(ids, outputs, maps)])
        assert [(r.query_index, r.code) for r in reply.refused] == [(0, "INVALID_ARGUMENT")]
        assert re.search("maps shape .* disagrees with its 7 tokens", reply.refused[0].message)
        assert writer.stats().entries == before


def test_a_write_token_cannot_poison_a_victims_lookups_with_decoys(with_projector: DaemonProcess) -> None:
    """Issue 25, item 13: a decoy of the victim's length with all-zero maps and the victim's feature made the
    victim a map hit replaying zeros; token ids far outside the vocabulary and a row past the model's
    length were stored too."""
    loaded = tiny_loaded("bert")
    victim = sentences(1, seed=52, min_words=6, max_words=6)[0]
    (captured,) = capture_entries(loaded, [victim]).entries  # the namespace's projector: the victim's feature
    length = captured.maps.shape[-1]
    zeros = np.zeros_like(captured.maps)
    vocab = token_limits(loaded).vocab_size
    decoys = [
        row_to_pb(np.arange(1, length + 1), captured.outputs, zeros, captured.feature, 1),
        row_to_pb(np.array([5, 4_000_000_000, 7]), captured.outputs[:3]),
        row_to_pb(np.arange(5000) % vocab, np.random.default_rng(0).normal(size=(5000, captured.outputs.shape[1]))),
    ]
    with with_projector.client(WRITE_TOKEN) as writer:
        fingerprint = writer.get_namespace("default").fingerprint
        before = writer.stats().entries
        keys = [protocol_keys.token_hash(np.array(row.token_ids)) for row in decoys]
        writer.lookup(exact_request("default", fingerprint, keys, [len(row.token_ids) for row in decoys]))
        reply = writer.write_back("default", fingerprint, decoys)
        assert [(r.query_index, r.code) for r in reply.refused] == [(i, "INVALID_ARGUMENT") for i in range(3)]
        assert "rows must sum to 1" in reply.refused[0].message
        assert f"token id 4000000000 is outside the vocabulary of {vocab}" in reply.refused[1].message
        assert "5000 tokens is over the model's maximum" in reply.refused[2].message
        assert writer.stats().entries == before
    report = _child(f"grpc://{with_projector.target}", READ_TOKEN, 0, [victim], 1e9)
    assert (report["stats"]["map_hits"], report["stats"]["misses"]) == (0, 1)


def test_the_client_keys_rows_with_the_protocols_token_hash_whatever_container_the_ids_come_in() -> None:
    ids = np.array([101, 7, 2000, 102])
    assert protocol_keys.token_hash(ids) == token_hash(ids) == token_hash(ids.tolist()) == token_hash(torch.tensor(ids))


def test_a_row_computed_by_one_client_process_is_an_exact_hit_for_another(admit_every_miss: DaemonProcess) -> None:
    url = f"grpc://{admit_every_miss.target}"
    first = _child(url, WRITE_TOKEN, 1)
    assert first["stats"]["misses"] == COUNT and first["written"]["stored"] == COUNT
    # Encode results are the plain model's whether written back or served from written-back rows (fp16 budget).
    assert first["max_diff"] < 1e-5
    second = _child(url, WRITE_TOKEN, 1)
    assert (second["stats"]["exact_hits"], second["stats"]["misses"]) == (COUNT, 0)
    assert second["written"]["queued"] == 0
    assert second["max_diff"] < 2e-3
    with admit_every_miss.client(READ_TOKEN) as reader:
        stats = reader.stats()
    assert stats.written_back_entries >= COUNT and stats.admit_after == 1


def test_the_admission_threshold_counts_distinct_callers(admit_second_ask: DaemonProcess) -> None:
    url = f"grpc://{admit_second_ask.target}"
    first, again, second, third = _callers(url, [WRITE_TOKEN, WRITE_TOKEN, OTHER_WRITE_TOKEN, WRITE_TOKEN], 2)
    assert first["written"]["queued"] == 0  # asked by one caller: nothing admitted
    assert again["written"]["queued"] == 0  # the same caller (token, host) asking again counts nothing
    assert second["stats"]["misses"] == COUNT and second["written"]["stored"] == COUNT
    assert third["stats"]["exact_hits"] == COUNT


def test_a_read_token_cannot_write_back_and_encode_still_answers(admit_every_miss: DaemonProcess) -> None:
    report, again = _callers(f"grpc://{admit_every_miss.target}", [READ_TOKEN, READ_TOKEN], 3)
    # A read token's asks are never admitted (admission counts callers that may write), so it sends nothing.
    assert report["written"]["stored"] == 0 and report["written"]["queued"] == 0
    assert report["max_diff"] < 1e-5
    assert again["stats"]["exact_hits"] == 0


def test_outputs_disagreeing_with_their_tokens_refuse_that_row_and_nothing_is_stored(
    admit_every_miss: DaemonProcess,
) -> None:
    ids = np.arange(5, 11)
    with admit_every_miss.client(WRITE_TOKEN) as writer:
        before = writer.stats().entries
        namespace = writer.get_namespace("default")
        writer.lookup(exact_request("default", namespace.fingerprint, [protocol_keys.token_hash(ids)], [len(ids)]))
        bad = row_to_pb(ids, np.zeros((len(ids) + 1, namespace.layout.hidden), np.float32))
        reply = writer.write_back("default", namespace.fingerprint, [bad])
        assert [(r.query_index, r.code) for r in reply.refused] == [(0, "INVALID_ARGUMENT")]
        assert "disagrees with its 6 tokens" in reply.refused[0].message
        assert writer.stats().entries == before


def test_the_daemon_going_away_mid_write_back_loses_no_committed_entry(tmp_path: Path) -> None:
    process = _daemon(tmp_path, 1)
    loaded = tiny_loaded("bert")
    hidden = plain_hidden(loaded, ["x"])[0].shape[-1]
    rng = np.random.default_rng(0)
    rows = [(rng.integers(0, 90, size=12), rng.normal(size=(12, hidden)).astype(np.float32)) for _ in range(4000)]
    committed: list[int] = []  # indices of rows whose WriteBack call returned OK
    failed: list[BaseException] = []

    def write() -> None:
        with process.client(WRITE_TOKEN) as writer:
            fingerprint = writer.get_namespace("default").fingerprint
            for start in range(0, len(rows), 50):
                batch = rows[start : start + 50]
                try:
                    writer.lookup(exact_request("default", fingerprint, [protocol_keys.token_hash(i) for i, _ in batch],
                                                [12] * len(batch)))
                    writer.write_back("default", fingerprint, [row_to_pb(i, o) for i, o in batch], timeout=5.0)
                except AttnStoreError as exc:
                    failed.append(exc)
                    return
                committed.extend(range(start, start + len(batch)))
                if len(committed) == 500:
                    process.process.send_signal(signal.SIGKILL)

    thread = threading.Thread(target=write)
    thread.start()
    thread.join(120)
    process.process.wait(30)
    assert failed and committed, "the daemon was killed mid-write-back"
    (tmp_path / "again").mkdir()
    restarted = DaemonProcess(tmp_path / "store", tmp_path / "again").start()
    try:
        with restarted.client(ADMIN_TOKEN) as admin:
            fingerprint = admin.get_namespace("default").fingerprint
            report = admin.verify()
            assert not report.corrupt and not report.store_problems
            for start in range(0, len(committed), 500):
                batch = committed[start : start + 500]
                hashes = [protocol_keys.token_hash(rows[i][0]) for i in batch]
                result = admin.lookup(exact_request("default", fingerprint, hashes, [12] * len(batch)))
                assert len(result.outputs) == len(batch)
                for k, i in enumerate(batch):
                    np.testing.assert_array_equal(result.outputs[k], rows[i][1].astype(np.float16))
            assert report.entries_checked >= len(committed)
    finally:
        assert restarted.stop() == 0, restarted.log()
