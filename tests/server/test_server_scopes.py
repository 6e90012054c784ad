"""A token scoped to namespaces sees only those, in every read that is not about one namespace (real daemon).

The probe of issue 48 read another namespace's buckets and entry counts, and the store-wide write-back
counters, through ``attnstore admin stats`` with a read token scoped to ``namespaces=sm``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np
import pytest

from attnstore.errors import AuthError
from attnstore.protocol.keys import token_hash
from attnstore.protocol.requests import exact_request
from attnstore.protocol.write_back import row_to_pb
from attnstore_tools.admin.cold_start import create_exact_namespace
from attnstore_tools.cli import main as cli_main
from tests.support.caches import tiny_loaded
from tests.support.daemon import (
    ADMIN_TOKEN,
    OTHER_WRITE_TOKEN,
    READ_TOKEN,
    SCOPED_READ_TOKEN,
    WRITE_TOKEN,
    DaemonProcess,
)
from tests.support.server_fixtures import FP, LAYOUT
from tests.support.stores import make_entry


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """Namespace "sm" with one entry, "other" with three entries and a written-back row (write-back counters)."""
    workdir = tmp_path_factory.mktemp("scopes")
    process = DaemonProcess(workdir / "store", workdir, extra_args=("--admit-after", "2")).start()
    with process.client(ADMIN_TOKEN) as admin:
        admin.create_namespace("sm", model="tiny-synthetic", fingerprint=FP, layout=LAYOUT)
        admin.ingest("sm", FP, [make_entry(LAYOUT, 8, 1)])
        create_exact_namespace(admin, tiny_loaded("bert"), "other")
        fingerprint = admin.get_namespace("other", projector=False).fingerprint
    rng = np.random.default_rng(0)
    rows = [(np.arange(1, 7) + i, rng.normal(size=(6, 64)).astype(np.float32)) for i in range(3)]
    request = exact_request("other", fingerprint, [token_hash(ids) for ids, _ in rows], [6] * 3)
    with process.client(WRITE_TOKEN) as writer, process.client(OTHER_WRITE_TOKEN) as other:
        writer.lookup(request)
        other.lookup(request)
        assert writer.write_back("other", fingerprint, [row_to_pb(*row) for row in rows]).stored == 3
    yield process
    assert process.stop() == 0, process.log()


def test_a_scoped_tokens_stats_count_its_namespaces_only_and_no_store_wide_counter(daemon: DaemonProcess) -> None:
    with daemon.client(SCOPED_READ_TOKEN) as scoped, daemon.client(READ_TOKEN) as unscoped:
        mine, everything = scoped.stats(), unscoped.stats()
    assert {b.namespace for b in everything.buckets} == {"sm", "other"} and not everything.scoped
    assert everything.written_back_entries == 3 and everything.admission_asked >= 3 and everything.entries == 4
    assert mine.scoped and {b.namespace for b in mine.buckets} == {"sm"}
    sm_buckets = [b for b in everything.buckets if b.namespace == "sm"]
    assert (mine.entries, mine.stored_bytes, mine.raw_bytes) == (
        1, sum(b.stored_bytes for b in sm_buckets), sum(b.raw_bytes for b in sm_buckets))
    store_wide = ("dram_bytes", "dram_capacity_bytes", "dram_hits", "dram_misses", "dram_evictions", "dram_entries",
                  "store_evictions", "file_bytes", "max_bytes", "stale_generations", "stale_generation_bytes",
                  "written_back_entries", "written_back_bytes", "written_back_duplicates",
                  "written_back_not_admitted", "written_back_map_entries", "written_back_map_bytes",
                  "written_back_refused", "admission_asked", "admission_admitted", "admission_sketch_bytes")
    assert {name: getattr(mine, name) for name in store_wide} == dict.fromkeys(store_wide, 0)
    assert mine.admit_after == 2  # a setting, not a count


def test_a_scoped_token_lists_only_its_namespaces(daemon: DaemonProcess) -> None:
    with daemon.client(SCOPED_READ_TOKEN) as scoped, daemon.client(READ_TOKEN) as unscoped:
        assert [n.name for n in scoped.list_namespaces()] == ["sm"]
        assert sorted(n.name for n in unscoped.list_namespaces()) == ["other", "sm"]


def test_admin_stats_with_a_scoped_token_shows_its_namespaces_only(
    daemon: DaemonProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["admin", "stats", "--target", daemon.target, "--token", SCOPED_READ_TOKEN, "--json", "-"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out[out.index("{"):])
    assert {b["namespace"] for b in report["buckets"]} == {"sm"} and report["scoped"] is True
    assert int(report["written_back_entries"]) == 0 and int(report["entries"]) == 1
    assert cli_main(["admin", "stats", "--target", daemon.target, "--token", SCOPED_READ_TOKEN]) == 0
    table = capsys.readouterr().out
    assert "sm" in table and "other" not in table and "store-wide counters are not shown" in table


@pytest.mark.parametrize("name", ["other", "no-such-namespace"])
def test_a_scoped_token_cannot_tell_another_namespace_from_none(daemon: DaemonProcess, name: str) -> None:
    with daemon.client(SCOPED_READ_TOKEN) as scoped, pytest.raises(AuthError) as caught:
        scoped.get_namespace(name, projector=False)
    assert "PERMISSION_DENIED" in str(caught.value) and "may name only ['sm']" in str(caught.value)
