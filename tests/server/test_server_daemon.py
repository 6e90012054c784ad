"""The real daemon as a subprocess on a free loopback port, with a real LMDB store."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
import safetensors.numpy
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from prometheus_client.parser import text_string_to_metric_families

from attnstore.errors import AttnStoreError, AuthError, ChecksumError
from attnstore.protocol.records import LookupBatch
from attnstore.protocol.requests import ingest_requests, lookup_request
from attnstore.protocol.v1 import attnstore_pb2 as pb
from attnstore.server.metrics import METRIC_NAMES
from attnstore.store import LmdbMapStore, NewEntry
from attnstore_tools.cli import main as cli_main
from tests.support.daemon import ADMIN_TOKEN, READ_TOKEN, DaemonProcess
from tests.support.server_fixtures import FP, LAYOUT
from tests.support.stores import make_entry
from tests.support.wait import wait_until

ROOT = Path(__file__).resolve().parents[2]  # children run as modules of tests.support from here
LENGTH = 8


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    workdir = tmp_path_factory.mktemp("daemon")
    process = DaemonProcess(workdir / "store", workdir).start()
    yield process
    assert process.stop() == 0, process.log()


@pytest.fixture(scope="module")
def ingested(daemon: DaemonProcess) -> list[int]:
    """Entries of seeds 0..3 ingested by another client process; their ids."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.children.server_ingest", daemon.target, ADMIN_TOKEN, "ns", FP,
         str(LENGTH), "0", "1", "2", "3"],
        capture_output=True, text=True, cwd=ROOT, timeout=60, check=False,
    )
    assert done.returncode == 0, done.stderr + daemon.log()
    summary = json.loads(done.stdout)
    assert summary["entries"] == 4
    return summary["entry_ids"]


def _query(seeds: list[int], *, exact: bool, length: int = LENGTH) -> pb.LookupRequest:
    entries = [make_entry(LAYOUT, LENGTH, seed) for seed in seeds]
    hashes = [e.token_hash if exact else None for e in entries]
    features = np.stack([e.feature for e in entries])
    batch = LookupBatch("ns", FP, features, [length] * len(seeds), token_hashes=hashes, max_distance=0.01)
    return lookup_request(batch)


def test_what_one_client_process_ingests_another_hits(daemon: DaemonProcess, ingested: list[int]) -> None:
    with daemon.client(READ_TOKEN) as remote:
        result = remote.lookup(_query([2, 0], exact=False))
        exact = remote.lookup(_query([1], exact=True))
    kinds = [(m.kind, m.entry_id) for m in result.matches]
    assert kinds == [(pb.MATCH_KIND_MAP, ingested[2]), (pb.MATCH_KIND_MAP, ingested[0])]
    for row, seed in ((0, 2), (1, 0)):
        np.testing.assert_array_equal(result.maps[row], make_entry(LAYOUT, LENGTH, seed).maps.astype(np.float16))
    assert exact.matches[0].kind == pb.MATCH_KIND_EXACT and not exact.maps
    np.testing.assert_array_equal(exact.outputs[0], make_entry(LAYOUT, LENGTH, 1).outputs.astype(np.float16))


def test_shorter_causal_query_gets_the_longer_entry_cropped(daemon: DaemonProcess, ingested: list[int]) -> None:
    request = _query([3], exact=False, length=5)
    request.max_distance = 5.0  # the length gap costs 1.0 per token
    with daemon.client(READ_TOKEN) as remote:
        result = remote.lookup(request)
    assert result.matches[0].stored_length == LENGTH
    np.testing.assert_array_equal(result.maps[0], make_entry(LAYOUT, LENGTH, 3).maps.astype(np.float16)[..., :5, :5])


def test_wrong_fingerprint_is_failed_precondition_naming_the_model(daemon: DaemonProcess, ingested: list[int]) -> None:
    request = _query([0], exact=False)
    request.fingerprint = "0" * 64
    with daemon.client(READ_TOKEN) as remote, pytest.raises(grpc.RpcError) as caught:
        list(remote.stub.Lookup(request, metadata=remote.metadata, timeout=10))
    assert caught.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "tiny-synthetic" in caught.value.details() and "fingerprint" in caught.value.details()


@pytest.mark.parametrize("token", [None, "not-a-known-token-at-all"])
def test_missing_or_unknown_token_is_unauthenticated(daemon: DaemonProcess, token: str | None) -> None:
    with daemon.client(token) as remote:
        with pytest.raises(grpc.RpcError) as caught:
            remote.stub.ListNamespaces(pb.ListNamespacesRequest(), metadata=remote.metadata, timeout=10)
        assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as streamed:
            list(remote.stub.Lookup(_query([0], exact=False), metadata=remote.metadata, timeout=10))
        assert streamed.value.code() is grpc.StatusCode.UNAUTHENTICATED


def test_read_token_on_admin_rpcs_is_permission_denied(daemon: DaemonProcess, ingested: list[int]) -> None:
    with daemon.client(READ_TOKEN) as remote:
        for call, request in ((remote.stub.Delete, pb.DeleteRequest(namespace="ns", entry_ids=[1])),
                              (remote.stub.Compact, pb.CompactRequest()), (remote.stub.Verify, pb.VerifyRequest())):
            with pytest.raises(grpc.RpcError) as caught:
                call(request, metadata=remote.metadata, timeout=10)
            assert caught.value.code() is grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(AuthError, match="PERMISSION_DENIED"):
            remote.ingest("ns", FP, [make_entry(LAYOUT, LENGTH, 99)])
        assert remote.stats().entries >= len(ingested)  # Stats needs only a read token


def test_health_reports_serving_without_a_token(daemon: DaemonProcess) -> None:
    with daemon.client(None) as remote:
        assert remote.health() == "SERVING"
        assert remote.health("attnstore.v1.AttnStore") == "SERVING"


def test_ingest_stream_ending_without_commit_leaves_nothing_visible(daemon: DaemonProcess, ingested: list[int]) -> None:
    entry = make_entry(LAYOUT, LENGTH, 50)
    with daemon.client() as remote:
        before = remote.stats().entries
        with pytest.raises(grpc.RpcError) as caught:
            remote.stub.Ingest(ingest_requests("ns", FP, [entry], commit=False), metadata=remote.metadata, timeout=10)
        assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "commit" in caught.value.details()
        assert remote.stats().entries == before
        result = remote.lookup(_query([50], exact=True))
    assert result.matches[0].kind == pb.MATCH_KIND_MISS


def test_metrics_endpoint_serves_every_listed_metric(daemon: DaemonProcess, ingested: list[int]) -> None:
    with daemon.client(READ_TOKEN) as remote:
        remote.lookup(_query([0, 1], exact=False))
    text = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=10).read().decode()
    for name in METRIC_NAMES:
        assert re.search(rf"^# TYPE {name}(_total)? ", text, re.MULTILINE), name
    assert 'attnstore_hits_total{kind="map",namespace="ns"}' in text
    assert 'attnstore_rpcs_total{code="OK",method="Lookup"}' in text
    assert "attnstore_redis" not in text and "attnstore_follower" not in text  # an LMDB store no one else writes


def test_a_repeated_map_hit_is_served_from_the_dram_tier_from_its_third_lookup(
    daemon: DaemonProcess, ingested: list[int]
) -> None:
    with daemon.client() as admin:  # an entry no other test has hit, so none of its serves came before
        admin.ingest("ns", FP, [make_entry(LAYOUT, LENGTH, 60)])
    request = _query([60], exact=False)

    def served_maps() -> tuple[int, int]:
        with daemon.client(READ_TOKEN) as remote:
            result = remote.lookup(request)
            stats = remote.stats()
        assert result.matches[0].kind == pb.MATCH_KIND_MAP
        return stats.dram_hits, stats.dram_entries

    first_hits, first_entries = served_maps()
    served_maps()  # the second serve admits the entry, loaded in the background
    wait_until(lambda: served_maps()[1] != first_entries, 30, "the entry loaded into the DRAM cache", poll=0.05)
    hits, entries = served_maps()
    assert entries == first_entries + 1
    assert hits >= first_hits + LAYOUT.layers  # every layer of the last one came from DRAM


def _scrape(daemon: DaemonProcess) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=10).read().decode()


def _sample(text: str, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return None


def test_metrics_count_refused_calls_by_code_with_process_metrics_and_zeroed_counters(
    daemon: DaemonProcess, ingested: list[int]
) -> None:
    before = _scrape(daemon)
    with daemon.client(None) as anonymous, pytest.raises(AuthError, match="UNAUTHENTICATED"):
        anonymous.stats()
    with daemon.client(READ_TOKEN) as reader, pytest.raises(AuthError, match="PERMISSION_DENIED"):
        reader.delete("ns", [ingested[0]])
    text = _scrape(daemon)
    for method, code in (("Stats", "UNAUTHENTICATED"), ("Delete", "PERMISSION_DENIED")):
        old = _sample(before, "attnstore_rpcs_total", method=method, code=code)
        assert _sample(text, "attnstore_rpcs_total", method=method, code=code) == (old or 0) + 1
    assert (_sample(text, "process_resident_memory_bytes") or 0) > 0
    # Present before the first event, so increase() sees the first corrupt entry.
    assert _sample(text, "attnstore_row_errors_total", namespace="ns", code="DATA_LOSS") == 0


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (Debian: apt install prometheus)")
def test_promtool_finds_nothing_to_lint_in_the_metrics(daemon: DaemonProcess, ingested: list[int]) -> None:
    with daemon.client(READ_TOKEN) as remote:
        remote.lookup(_query([0, 1], exact=False))
    done = subprocess.run(
        ["promtool", "check", "metrics"], input=_scrape(daemon), capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert done.returncode == 0 and not done.stdout.strip(), done.stdout + done.stderr


def test_a_reflection_client_without_a_token_lists_the_services(daemon: DaemonProcess) -> None:
    with grpc.insecure_channel(daemon.target) as channel:
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {"attnstore.v1.AttnStore", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection"} <= services


def test_sighup_reloads_the_token_file_and_a_bad_file_keeps_the_old_tokens(daemon: DaemonProcess) -> None:
    original = daemon.token_file.read_text()
    rotated = "rotated-read-token-0000000"

    def accepted(token: str) -> bool:
        with daemon.client(token) as remote:
            try:
                remote.stats()
            except AuthError:
                return False
            return True

    def reload_until(expected: bool, token: str) -> None:
        daemon.process.send_signal(signal.SIGHUP)
        wait_until(lambda: accepted(token) == expected, 10,
                   lambda: f"the token {'accepted' if expected else 'refused'} after SIGHUP; the log:\n{daemon.log()}",
                   poll=0.1)

    try:
        daemon.token_file.write_text(original + f"read {rotated}\n")
        reload_until(True, rotated)
        daemon.token_file.write_text("read short\n")
        daemon.process.send_signal(signal.SIGHUP)
        wait_until(lambda: "event=reload_failed" in daemon.log(), 10,
                   lambda: f"event=reload_failed in the log:\n{daemon.log()}")
        assert accepted(rotated) and accepted(READ_TOKEN)
    finally:
        daemon.token_file.write_text(original)
        reload_until(False, rotated)


def test_admin_cli_reads_stats_and_copies_a_local_namespace_in(
    daemon: DaemonProcess, ingested: list[int], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with LmdbMapStore.open(tmp_path / "local", create=True) as local:
        local.create_namespace("src", model="tiny-synthetic", fingerprint=FP, layout=LAYOUT)
        local.ingest("src", [make_entry(LAYOUT, 6, seed) for seed in (70, 71)])
    target = ["--target", daemon.target]
    assert cli_main(["admin", "ingest", *target, "--token", ADMIN_TOKEN, "--from-store", str(tmp_path / "local"),
                     "--namespace", "src", "--as", "copy", "--batch-entries", "1"]) == 0
    assert cli_main(["admin", "stats", *target, "--token", READ_TOKEN, "--json", str(tmp_path / "stats.json")]) == 0
    assert cli_main(["admin", "verify", *target, "--token", ADMIN_TOKEN]) == 0
    out = capsys.readouterr().out
    assert "copy" in out and "namespace" in out
    buckets = json.loads((tmp_path / "stats.json").read_text())["buckets"]
    assert {"namespace": "copy", "length": 6, "entries": "2"}.items() <= next(
        b for b in buckets if b["namespace"] == "copy").items()
    entry = make_entry(LAYOUT, 6, 71)
    with daemon.client(READ_TOKEN) as remote:
        hit = remote.lookup(lookup_request(LookupBatch("copy", FP, entry.feature[None], [6], max_distance=0.01)))
    np.testing.assert_array_equal(hit.maps[0], entry.maps.astype(np.float16))


@pytest.mark.parametrize("form", ["grpc://{}", "{}"])
def test_admin_cli_takes_url_and_bare_targets_and_json_dash_writes_json_alone(
    daemon: DaemonProcess, ingested: list[int], form: str, capsys: pytest.CaptureFixture[str]
) -> None:
    target = form.format(daemon.target)
    assert cli_main(["admin", "stats", "--target", target, "--token", READ_TOKEN, "--json", "-"]) == 0
    assert cli_main(["admin", "namespaces", "--target", target, "--token", READ_TOKEN]) == 0
    out, err = capsys.readouterr()
    stats_json, table = out.split("\n}\n", 1)
    assert int(json.loads(stats_json + "}")["entries"]) >= len(ingested)
    assert "dram_hits" in err  # the stats table went to stderr
    assert re.search(r"^ns\s+tiny-synthetic", table, re.MULTILINE)


def test_admin_cli_refuses_another_scheme_naming_the_forms(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["admin", "stats", "--target", "http://127.0.0.1:1"]) == 2
    assert "'http://127.0.0.1:1' is not one of grpc://HOST:PORT" in capsys.readouterr().err


def test_sigterm_in_the_middle_of_a_lookup_stream_exits_cleanly(tmp_path: Path) -> None:
    # 16 rows hit one entry of 8 layers x 4 heads x 256^2 fp16: 64 MiB of maps,
    # far more than flow control lets the server push to a client that stops reading.
    layout = LAYOUT.__class__(layers=8, heads=4, causal=True, hidden=8, feature_dim=16)
    entry = make_entry(layout, 256, 1)
    entry = NewEntry(maps=entry.maps.astype(np.float16), token_hash=entry.token_hash, feature=entry.feature)
    daemon = DaemonProcess(tmp_path / "store", tmp_path).start()
    try:
        with daemon.client() as remote:
            remote.create_namespace("big", model="tiny-synthetic", fingerprint=FP, layout=layout)
            remote.ingest("big", FP, [entry])
            batch = LookupBatch("big", FP, np.repeat(entry.feature[None], 16, 0), [256] * 16, max_distance=0.01)
            request = lookup_request(batch)
            stream = remote.iter_lookup(request, timeout=60)
            first = next(stream)
            assert first.WhichOneof("body") == "matches" and next(stream).WhichOneof("body") == "maps"
            daemon.process.send_signal(15)
            # Not read until the daemon's 1 s grace is over: the drain ended the stream it could not push.
            wait_until(lambda: "event=stopped" in daemon.log(), 30,
                       lambda: f"the drain over (event=stopped*); the log:\n{daemon.log()[-3000:]}")
            start = time.monotonic()
            with pytest.raises(AttnStoreError) as caught:
                for _ in stream:
                    pass
            assert time.monotonic() - start < 30
            assert "DEADLINE_EXCEEDED" not in str(caught.value)
        # Wait, never signal again: a second SIGTERM after the drain restored the default handler kills it.
        assert daemon.process.wait(30) == 0, daemon.log()
        assert "event=stopped" in daemon.log()
    finally:
        daemon.kill()


# ---- issue 18: damaged and vanishing stores, projector swaps -------------------------------------


def _flip_everywhere(store: Path, needle: bytes, at: int) -> None:
    """Flip byte ``at`` of every copy of ``needle`` in the store's data file (bit rot in a leaf page)."""
    (data_file,) = store.glob("gen-*/data.mdb")
    data = bytearray(data_file.read_bytes())
    offsets = [m.start() for m in re.finditer(re.escape(needle), bytes(data))]
    assert offsets, "the needle is not in the data file"
    for offset in offsets:
        data[offset + at] ^= 0x20
    data_file.write_bytes(bytes(data))


def test_a_store_that_cannot_be_loaded_makes_serve_exit_2_with_one_line(tmp_path: Path) -> None:
    with LmdbMapStore.open(tmp_path / "store", create=True) as store:
        store.create_namespace("ns", model="tiny-synthetic", fingerprint=FP, layout=LAYOUT)
    _flip_everywhere(tmp_path / "store", b'{"name": "ns"', 0)  # the catalog record is no JSON any more
    result = subprocess.run(
        [sys.executable, "-m", "attnstore_tools.cli", "serve", "--store", str(tmp_path / "store"),
         "--listen", "127.0.0.1:0"],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )
    assert result.returncode == 2, result.stderr  # before: 1, with a JSONDecodeError traceback
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("attnstore: error: ") and "damaged" in last and "restore" in last


def test_a_damaged_projector_is_logged_at_start_refused_to_clients_and_reported_by_verify(tmp_path: Path) -> None:
    blob = safetensors.numpy.save({"w": np.zeros(4, np.float32)}, metadata={"note": "projector-" + "p" * 40})
    with LmdbMapStore.open(tmp_path / "store", create=True) as store:
        store.create_namespace("ns", model="tiny-synthetic", fingerprint=FP, layout=LAYOUT)
        store.set_projector("ns", blob)
    _flip_everywhere(tmp_path / "store", b"projector-" + b"p" * 40, 20)
    daemon = DaemonProcess(tmp_path / "store", tmp_path).start()
    try:
        assert "event=projector_damaged namespace=ns" in daemon.log()
        with daemon.client() as remote:
            with pytest.raises(ChecksumError, match="DATA_LOSS.*projector of namespace 'ns' fails its crc32c"):
                remote.get_namespace("ns")
            problems = list(remote.verify().store_problems)
            assert any("projector of namespace 'ns'" in p for p in problems), problems
    finally:
        daemon.kill()


def test_a_removed_store_directory_turns_health_not_serving_and_refuses_writes(tmp_path: Path) -> None:
    daemon = DaemonProcess(tmp_path / "store", tmp_path).start()
    try:
        with daemon.client() as remote:
            remote.create_namespace("ns", model="tiny-synthetic", fingerprint=FP, layout=LAYOUT)
            remote.ingest("ns", FP, [make_entry(LAYOUT, LENGTH, 1)])
            shutil.rmtree(tmp_path / "store")
            wait_until(lambda: remote.health() == "NOT_SERVING", 10, "health NOT_SERVING", poll=0.1)
            for write in (lambda: remote.ingest("ns", FP, [make_entry(LAYOUT, LENGTH, 2)]), remote.compact):
                with pytest.raises(AttnStoreError, match="FAILED_PRECONDITION.*removed while it was open"):
                    write()
            assert not (tmp_path / "store").exists()  # before: a compaction quietly made it again
        assert "event=storage_fault" in daemon.log()
    finally:
        daemon.kill()


def test_admin_ingest_into_a_namespace_with_another_projector_needs_replace_projector(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    target = ["--target", daemon.target, "--token", ADMIN_TOKEN]
    for weight, path in ((1.0, tmp_path / "a"), (2.0, tmp_path / "b")):
        with LmdbMapStore.open(path, create=True) as local:
            local.create_namespace("src", model="tiny-synthetic", fingerprint=FP, layout=LAYOUT)
            local.ingest("src", [make_entry(LAYOUT, 6, 80)])
            local.set_projector("src", safetensors.numpy.save({"w": np.full(1, weight, np.float32)}))
    copy = ["admin", "ingest", *target, "--namespace", "src", "--as", "swapped"]
    assert cli_main([*copy, "--from-store", str(tmp_path / "a")]) == 0
    assert cli_main([*copy, "--from-store", str(tmp_path / "b")]) == 2  # before: replaced silently
    with daemon.client() as remote:
        assert remote.get_namespace("swapped").projector_version == 1
    assert cli_main([*copy, "--from-store", str(tmp_path / "b"), "--replace-projector"]) == 0
    with daemon.client() as remote:
        info = remote.get_namespace("swapped")
        assert info.projector_version == 2
        assert safetensors.numpy.load(info.projector)["w"][0] == 2.0
