"""The audit catches a wrong hit (real daemon, real client): a row poisoned through a write token is recomputed,
quarantined, its writer named and counted, and then a miss for every node; correct rows are never quarantined.

The poison is what a hostile holder of one write token can store: the outputs of another text of the same token
length, written back under the victim's tokens (the daemon hashes the tokens itself, so the key is the victim's,
and the outputs are all it cannot check).
"""

from __future__ import annotations

import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from attnstore.protocol import keys as protocol_keys
from attnstore.protocol.records import NewEntry
from attnstore.protocol.requests import exact_request
from attnstore.protocol.write_back import row_to_pb
from attnstore.service import AttnStoreService
from attnstore_client.adapters.batch import tokenize
from attnstore_client.cache import AttnCache
from attnstore_client.keys import model_fingerprint
from attnstore_tools.admin.cold_start import create_exact_namespace
from attnstore_tools.build.namespace_layout import exact_tier_layout, token_limits
from tests.support.caches import plain_hidden, sentences, tiny_loaded
from tests.support.daemon import ADMIN_TOKEN, OTHER_WRITE_TOKEN, READ_TOKEN, WRITE_TOKEN, DaemonProcess

# A poisoned row is caught by the first request that audits it: at audit_rate=1.0, the first.
BOUND = 1


@pytest.fixture
def daemon(tmp_path: Path):
    process = DaemonProcess(tmp_path / "store", tmp_path, extra_args=("--admit-after", "1")).start()
    yield process
    assert process.stop() == 0, process.log()


def _same_length_texts(loaded, count: int, seed: int) -> list[tuple[str, list[int]]]:
    """``count`` texts of one token length, with their token ids."""
    by_length: dict[int, list[tuple[str, list[int]]]] = {}
    for text in sentences(200, seed=seed, min_words=8, max_words=8):
        ids = list(tokenize(loaded.tokenizer, [text]).row_ids(0))
        by_length.setdefault(len(ids), []).append((text, ids))
        if len(by_length[len(ids)]) == count:
            return by_length[len(ids)]
    raise AssertionError("no texts of one length")


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=0).item()


def _metric(daemon: DaemonProcess, name: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines() if line.startswith(name + "{"))


def test_a_row_poisoned_through_a_write_token_is_caught_quarantined_reported_and_then_a_miss(
    daemon: DaemonProcess,
) -> None:
    loaded = tiny_loaded("bert")
    fingerprint = model_fingerprint(loaded.model, loaded.tokenizer)
    with daemon.client(ADMIN_TOKEN) as admin:
        create_exact_namespace(admin, loaded, "default")
    (victim, victim_ids), (decoy, _) = _same_length_texts(loaded, 2, seed=48)
    expected = plain_hidden(loaded, [victim])[0].mean(dim=0)
    poison = plain_hidden(loaded, [decoy])[0].to(torch.float16).numpy()  # (L, hidden): another text's outputs
    with daemon.client(WRITE_TOKEN) as hostile:  # node-a asks once (admitted), then writes the decoy's outputs
        key = protocol_keys.token_hash(np.asarray(victim_ids))
        hostile.lookup(exact_request("default", fingerprint, [key], [len(victim_ids)]))
        reply = hostile.write_back("default", fingerprint, [row_to_pb(np.asarray(victim_ids), poison, None, None, 0)])
        assert reply.stored == 1, reply

    url = f"grpc://{daemon.target}"
    with AttnCache(loaded, url, token=READ_TOKEN, exact_cache_bytes=0) as unaudited:  # the attack works unaudited
        served = torch.from_numpy(unaudited.encode([victim]))[0]
        assert unaudited.last_stats.exact_hits == 1
    assert _cosine(served, expected) < 0.99

    with AttnCache(loaded, url, token=OTHER_WRITE_TOKEN, exact_cache_bytes=0, audit_rate=1.0) as auditor:
        requests = 0
        while not auditor.stats.audit_mismatches and requests < BOUND:
            answer = torch.from_numpy(auditor.encode([victim]))[0]
            requests += 1
            assert _cosine(answer, expected) >= 0.9999  # the recomputed row, never the known-wrong one
        assert (auditor.stats.audited, auditor.stats.audit_mismatches, auditor.stats.exact_hits) == (1, 1, 0)
        (finding,) = auditor.audit_findings
    assert (finding.kind, finding.key, finding.writer, finding.quarantined, finding.error) == (
        "row", key, "node-a", True, None)
    assert finding.min_cosine < 0.999

    with AttnCache(loaded, url, token=READ_TOKEN, exact_cache_bytes=0) as other:  # quarantined: a miss for everyone
        answer = torch.from_numpy(other.encode([victim]))[0]
        assert (other.last_stats.exact_hits, other.last_stats.misses) == (0, 1)
    assert _cosine(answer, expected) >= 0.9999
    assert _metric(daemon, "attnstore_audit_mismatches_total") == 1
    assert _metric(daemon, "attnstore_quarantined_total") == 1

    with daemon.client(ADMIN_TOKEN) as admin:
        (held,) = admin.list_quarantine("default")
        assert (held.kind, held.key, held.writer, held.reporter) == ("row", key, "node-a", "node-b")
        admin.release_quarantine("default", "row", key, drop=True)  # the admin judged it: deleted
        assert admin.list_quarantine() == []
        assert [e.writer for e in admin.iter_entries("default")] == []


def test_a_read_token_audits_and_counts_but_cannot_quarantine(daemon: DaemonProcess) -> None:
    loaded = tiny_loaded("bert")
    fingerprint = model_fingerprint(loaded.model, loaded.tokenizer)
    with daemon.client(ADMIN_TOKEN) as admin:
        create_exact_namespace(admin, loaded, "default")
    (victim, victim_ids), (decoy, _) = _same_length_texts(loaded, 2, seed=49)
    poison = plain_hidden(loaded, [decoy])[0].to(torch.float16).numpy()
    with daemon.client(WRITE_TOKEN) as hostile:
        key = protocol_keys.token_hash(np.asarray(victim_ids))
        hostile.lookup(exact_request("default", fingerprint, [key], [len(victim_ids)]))
        hostile.write_back("default", fingerprint, [row_to_pb(np.asarray(victim_ids), poison, None, None, 0)])
    with AttnCache(loaded, f"grpc://{daemon.target}", token=READ_TOKEN, exact_cache_bytes=0, audit_rate=1.0) as cache:
        answer = torch.from_numpy(cache.encode([victim]))[0]
        (finding,) = cache.audit_findings
        assert cache.stats.audit_mismatches == 1
    assert _cosine(answer, plain_hidden(loaded, [victim])[0].mean(dim=0)) >= 0.9999
    assert not finding.quarantined and "AuthError" in (finding.error or "")
    with daemon.client(ADMIN_TOKEN) as admin:
        assert admin.list_quarantine() == []


def test_audit_at_every_hit_over_correct_written_rows_quarantines_nothing(daemon: DaemonProcess) -> None:
    loaded = tiny_loaded("bert")
    with daemon.client(ADMIN_TOKEN) as admin:
        create_exact_namespace(admin, loaded, "default")
    texts = sentences(40, seed=50, min_words=3, max_words=30)
    url = f"grpc://{daemon.target}"
    with AttnCache(loaded, url, token=WRITE_TOKEN, write_back=True, exact_cache_bytes=0) as writer:
        writer.encode(texts)
        assert writer.write_back is not None
        writer.write_back.flush(60.0)
    with AttnCache(loaded, url, token=OTHER_WRITE_TOKEN, exact_cache_bytes=0, audit_rate=1.0) as auditor:
        for batch_size in (32, 3):  # padded or packed, other neighbours: still within the tolerance
            auditor.encode(texts, batch_size=batch_size)
        distinct = len(set(texts))
        assert (auditor.stats.audited, auditor.stats.audit_mismatches) == (2 * distinct, 0)
        assert auditor.audit_findings == ()
    with daemon.client(ADMIN_TOKEN) as admin:
        assert admin.list_quarantine() == []
    assert _metric(daemon, "attnstore_audit_mismatches_total") == 0


def test_an_embedded_store_quarantines_through_the_same_service(tmp_path: Path) -> None:
    loaded = tiny_loaded("bert")
    fingerprint = model_fingerprint(loaded.model, loaded.tokenizer)
    (victim, victim_ids), (decoy, _) = _same_length_texts(loaded, 2, seed=51)
    poison = plain_hidden(loaded, [decoy])[0].to(torch.float16).numpy()
    path = tmp_path / "store"
    with AttnStoreService.open(path, create=True) as service:
        service.create_namespace("default", model=loaded.name, fingerprint=fingerprint,
                                 layout=exact_tier_layout(loaded), limits=token_limits(loaded))
        key = protocol_keys.token_hash(np.asarray(victim_ids))
        service.ingest("default", fingerprint, [NewEntry(None, key, outputs=poison, token_ids=victim_ids,
                                                         writer="evil")])
    url = f"local:{path}"
    with AttnCache(loaded, url, audit_rate=1.0, exact_cache_bytes=0) as auditor, \
            AttnCache(loaded, url, exact_cache_bytes=0) as other:
        auditor.encode([victim])
        (finding,) = auditor.audit_findings
        assert (finding.writer, finding.quarantined, auditor.stats.audit_mismatches) == ("evil", True, 1)
        answer = torch.from_numpy(other.encode([victim]))[0]  # the same process's store: quarantined for it too
        assert other.last_stats.exact_hits == 0
    assert _cosine(answer, plain_hidden(loaded, [victim])[0].mean(dim=0)) >= 0.9999
