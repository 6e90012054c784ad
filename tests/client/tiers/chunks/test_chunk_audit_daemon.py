"""The chunk tier's audit (real daemon, tiny local decoder): a chunk poisoned through a write token (``PutChunks``
of made-up keys and values under the right key, as the issue's probe did) is caught by a node auditing every
chunk it is served: the prompt is fused from the chunk computed there, the chunk is quarantined (not stored, for
every node), its writer named and counted; correct stored chunks are never reported."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnstore.protocol.chunks import StoredChunk
from attnstore.service import AttnStoreService
from attnstore_client.adapters import adapter_for
from attnstore_client.cache import AttnCache
from attnstore_client.call.settings import ChunkSettings
from attnstore_client.call.sources import segment_tokens
from attnstore_client.connection import connect
from attnstore_client.keys import model_fingerprint
from attnstore_client.models import load_model
from attnstore_client.tiers.chunks.capture import capture_chunks
from attnstore_client.tiers.chunks.source import MemoryChunkSource, chunk_key
from attnstore_client.tiers.chunks.store_source import model_chunk_layout
from attnstore_tools.build.namespace_layout import exact_tier_layout, token_limits
from tests.support.adapters import save_tiny_decoder
from tests.support.daemon import ADMIN_TOKEN, OTHER_WRITE_TOKEN, READ_TOKEN, WRITE_TOKEN, DaemonProcess

INSTRUCTION = "classify the sentiment of each review"
CHUNKS = ["the river was cold and the stone was grey", "good light over the north field", "a bad cloud"]
PROMPTS = [[INSTRUCTION, CHUNKS[0], CHUNKS[1], "is it good"], [INSTRUCTION, CHUNKS[2], CHUNKS[0], "bad"]]
REUSE = ChunkSettings(method="full_reuse", recent=0, dtype="float32")  # stored keys and values used as they are


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    return load_model(str(save_tiny_decoder(tmp_path_factory.mktemp("tiny") / "model", full_vocab=True)))


@pytest.fixture
def daemon(decoder, tmp_path):
    fingerprint = model_fingerprint(decoder.model, decoder.tokenizer)
    with AttnStoreService.open(tmp_path / "store", create=True) as service:
        service.create_namespace("default", model=decoder.name, fingerprint=fingerprint,
                                 layout=exact_tier_layout(decoder), limits=token_limits(decoder))
        service.chunks.set_layout("default", model_chunk_layout(adapter_for(decoder), "float32"))
    process = DaemonProcess(tmp_path / "store", tmp_path, extra_args=("--admit-after", "1")).start()
    yield process
    assert process.stop() == 0, process.log()


def _node(decoder, daemon: DaemonProcess, token: str, audit_rate: float, **options) -> AttnCache:
    return AttnCache(decoder, f"grpc://{daemon.target}", token=token, exact=False, chunks=REUSE,
                     audit_rate=audit_rate, **options)


def test_a_poisoned_chunk_is_caught_quarantined_and_the_prompt_fused_from_the_computed_one(decoder, daemon, caplog
                                                                                         ) -> None:
    fingerprint = model_fingerprint(decoder.model, decoder.tokenizer)
    layout = model_chunk_layout(adapter_for(decoder), "float32")
    with _node(decoder, daemon, READ_TOKEN, 0.0, chunk_source=MemoryChunkSource()) as local_only:
        honest = local_only.last_hidden_states(PROMPTS)  # every chunk computed here
    row = segment_tokens(decoder.tokenizer, PROMPTS, max_length=512)[0]
    first, second = row.segments[0], row.segments[1]
    instruction, ids = list(row.ids[:first]), list(row.ids[first : first + second])  # PROMPTS[0]'s first chunk
    key = chunk_key(instruction, ids)
    kv = np.random.default_rng(0).standard_normal((layout.layers, *layout.layer_shape(len(ids)))) * 3
    with connect(f"grpc://{daemon.target}", token=WRITE_TOKEN) as hostile:  # no one wrote this one yet: it asks
        assert hostile.match_chunks("default", fingerprint, layout, [key], timeout=10) == [None]
        poison = StoredChunk(key, kv.astype(np.float32), token_ids=np.array(ids), context_ids=np.array(instruction))
        assert hostile.put_chunks("default", fingerprint, layout, [poison], timeout=10).stored == 1
    with _node(decoder, daemon, READ_TOKEN, 0.0) as unaudited:  # the poison works unaudited
        assert not torch.allclose(unaudited.last_hidden_states(PROMPTS)[0], honest[0], atol=1e-3)

    with _node(decoder, daemon, OTHER_WRITE_TOKEN, 1.0) as auditor:
        audited = auditor.last_hidden_states(PROMPTS)
        assert (auditor.stats.audited, auditor.stats.audit_mismatches) == (1, 1)  # the one chunk stored
        (finding,) = auditor.audit_findings
    # Fused from the chunk computed there: what a node holding the honest chunk (and nothing else) answers.
    adapter = adapter_for(decoder)
    (context,) = capture_chunks(adapter, [(None, instruction)], dtype="float32")
    (chunk,) = capture_chunks(adapter, [(context, ids)], dtype="float32")
    source = MemoryChunkSource()
    source.put(key, chunk)
    with _node(decoder, daemon, READ_TOKEN, 0.0, chunk_source=source) as reference:
        assert torch.allclose(audited, reference.last_hidden_states(PROMPTS), atol=1e-5)
    assert (finding.kind, finding.key, finding.quarantined, finding.writer) == ("chunk", key, True, "node-a")
    assert f"event=audit_mismatch namespace=default kind=chunk key={key.hex()[:16]} writer=node-a" in caplog.text

    with connect(f"grpc://{daemon.target}", token=READ_TOKEN) as reader:  # not stored, for every node
        assert reader.match_chunks("default", fingerprint, layout, [key], timeout=10) == [None]
    with _node(decoder, daemon, READ_TOKEN, 0.0) as other:  # the chunk missing: computed in place, as honest's
        assert torch.allclose(other.last_hidden_states(PROMPTS), honest, atol=1e-5)
    with daemon.client(ADMIN_TOKEN) as admin:
        (held,) = admin.list_quarantine("default")
        assert (held.kind, bytes(held.key), held.writer, held.reporter) == ("chunk", key, "node-a", "node-b")
        assert f"kind=chunk key={key.hex()[:16]} writer=node-a" in daemon.log()  # the daemon's event=quarantined
        assert admin.release_quarantine("default", "chunk", key, drop=True).dropped  # the admin judged: deleted
        assert admin.list_quarantine() == []
    with connect(f"grpc://{daemon.target}", token=READ_TOKEN) as reader:
        assert reader.match_chunks("default", fingerprint, layout, [key], timeout=10) == [None]


def test_auditing_every_chunk_over_correct_stored_chunks_reports_nothing(decoder, daemon) -> None:
    with _node(decoder, daemon, WRITE_TOKEN, 0.0, write_back=True) as writer:  # node-a stores the honest chunks
        writer.last_hidden_states(PROMPTS)
        assert writer.chunk_source.flush(30)
    with _node(decoder, daemon, OTHER_WRITE_TOKEN, 1.0) as auditor:
        audited = auditor.last_hidden_states(PROMPTS)
        assert auditor.stats.audited >= 4 and auditor.stats.audit_mismatches == 0  # the instruction, 3 chunks
        assert auditor.audit_findings == ()
    with _node(decoder, daemon, READ_TOKEN, 0.0) as reader:  # the same stored chunks, unaudited: the same rows
        assert torch.allclose(audited, reader.last_hidden_states(PROMPTS), atol=1e-5)
    with daemon.client(ADMIN_TOKEN) as admin:
        assert admin.list_quarantine() == []
