"""The prefix tier's audit (real daemon, tiny random Llama): a prefix block poisoned through a write token
(``PutPrefix`` of made-up keys, values and hidden states under the right ids, as the issue's probe did) is
caught by a node auditing every row, which answers the computed row, quarantines the block (every chain through
it ends before it, for every node), names its writer and counts it; correct stored blocks are never reported."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from attnstore.protocol.prefix import PrefixBlock, PrefixLayout, chain_hashes
from attnstore.service import AttnStoreService
from attnstore_client.adapters import adapter_for
from attnstore_client.cache import AttnCache
from attnstore_client.connection import connect
from attnstore_client.keys import model_fingerprint
from attnstore_client.tiers.prefix import prefix_layout_of
from tests.support.caches import tiny_loaded
from tests.support.daemon import ADMIN_TOKEN, OTHER_WRITE_TOKEN, READ_TOKEN, WRITE_TOKEN, DaemonProcess
from tests.support.prefixes import BLOCK, SHARED_B, fill_prefix_namespace, plain_rows, prefix_rows

ROW = SHARED_B + prefix_rows([11], seed=40)[0]  # 31 tokens: two stored blocks, a third a writer adds


@pytest.fixture(scope="module")
def llama():
    return tiny_loaded("llama")


@pytest.fixture
def daemon(tmp_path: Path, llama):
    with AttnStoreService.open(tmp_path / "store", create=True) as service:
        fill_prefix_namespace(service, llama, [SHARED_B])
    process = DaemonProcess(tmp_path / "store", tmp_path, extra_args=("--admit-after", "1")).start()
    yield process
    assert process.stop() == 0, process.log()


def _made_up_block(layout: PrefixLayout, tokens: list[int], position: int) -> PrefixBlock:
    rng = np.random.default_rng(position)
    chain = chain_hashes(tokens, layout.block_size)
    return PrefixBlock(chain[position], chain[position - 1] if position else None,
                       rng.standard_normal((layout.layers, *layout.layer_shape)).astype(layout.dtype) * 3,
                       rng.standard_normal((layout.block_size, layout.hidden)).astype(layout.dtype) * 3,
                       np.array(tokens[position * layout.block_size : (position + 1) * layout.block_size]))


def _node(llama, daemon: DaemonProcess, token: str, audit_rate: float) -> AttnCache:
    return AttnCache(llama, f"grpc://{daemon.target}", token=token, exact=False, prefix_min_tokens=BLOCK,
                     audit_rate=audit_rate)


def test_a_poisoned_prefix_block_is_caught_quarantined_and_then_no_node_starts_from_it(daemon, llama, caplog
                                                                                       ) -> None:
    fingerprint = model_fingerprint(llama.model, llama.tokenizer)
    layout = prefix_layout_of(adapter_for(llama), block_size=BLOCK)
    chain = chain_hashes(ROW, BLOCK)
    with connect(f"grpc://{daemon.target}", token=WRITE_TOKEN) as hostile:  # node-a asks (admitted), then puts
        assert hostile.match_prefix("default", fingerprint, BLOCK, [chain], timeout=10) == [2]
        assert hostile.put_prefix("default", fingerprint, layout, [_made_up_block(layout, ROW, 2)],
                                  timeout=10).stored == 1
    plain = plain_rows(llama, [ROW])[0]
    with _node(llama, daemon, READ_TOKEN, 0.0) as unaudited:  # the poison works unaudited
        hidden = unaudited.hidden_states([ROW])[0]
        assert unaudited.last_row_kinds == ("prefix",) and not torch.allclose(hidden, plain, atol=1e-3)

    with _node(llama, daemon, OTHER_WRITE_TOKEN, 1.0) as auditor:
        hidden = auditor.hidden_states([ROW])[0]
        assert torch.allclose(hidden, plain, atol=2e-5)  # the computed row, never the poisoned one
        assert (auditor.stats.audited, auditor.stats.audit_mismatches) == (1, 1)
        (finding,) = auditor.audit_findings
    assert (finding.kind, finding.key, finding.quarantined) == ("prefix", chain[2], True)  # the block itself
    assert finding.writer == "node-a"  # the write token that put it, read back from the block's record
    assert f"event=audit_mismatch namespace=default kind=prefix key={chain[2].hex()[:16]} writer=node-a" in caplog.text

    with _node(llama, daemon, READ_TOKEN, 0.0) as other:  # every node now stops before it: the honest blocks
        hidden = other.hidden_states([ROW])[0]
        assert other.last_row_kinds == ("prefix",) and torch.allclose(hidden, plain, atol=2e-5)
    with connect(f"grpc://{daemon.target}", token=READ_TOKEN) as reader:
        assert reader.match_prefix("default", fingerprint, BLOCK, [chain], timeout=10) == [2]
    with daemon.client(ADMIN_TOKEN) as admin:
        (held,) = admin.list_quarantine("default")
        assert (held.kind, bytes(held.key), held.writer, held.reporter) == ("prefix", chain[2], "node-a", "node-b")
    assert f"kind=prefix key={chain[2].hex()[:16]} writer=node-a" in daemon.log()  # the daemon's event=quarantined


def test_auditing_every_row_over_correct_stored_blocks_reports_nothing(daemon, llama) -> None:
    rows = [SHARED_B + tail for tail in prefix_rows([3, 9, 17], seed=41)]
    plain = plain_rows(llama, rows)
    with _node(llama, daemon, OTHER_WRITE_TOKEN, 1.0) as auditor:
        hidden = auditor.hidden_states(rows)
        assert (auditor.stats.audited, auditor.stats.audit_mismatches) == (3, 0)
        assert auditor.audit_findings == ()
    for got, want in zip(hidden, plain, strict=True):
        assert torch.allclose(got, want, atol=2e-5)
    with daemon.client(ADMIN_TOKEN) as admin:
        assert admin.list_quarantine() == []
