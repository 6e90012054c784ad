"""A write token cannot choose where its written-back row lands (real daemon, real client).

The decoy is a row that passes every check of its own: real maps and outputs (of
another text of the victim's length), admitted by two callers (``--admit-after 2``).
Only its feature lies: it is the victim's. Stored as sent, the victim's
near-duplicate becomes a map hit replaying the decoy's maps (cosine ~0.3 to the plain
model). The daemon derives the feature from the row's own tokens instead, so the
decoy lands where its own text would, and the victim computes its row.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from attnstore.protocol import keys as protocol_keys
from attnstore.protocol.requests import exact_request
from attnstore.protocol.write_back import row_to_pb
from attnstore_client.adapters import adapter_for
from attnstore_client.adapters.batch import tokenize
from attnstore_client.cache import AttnCache
from attnstore_tools.build.namespace_layout import token_limits
from tests.support.caches import capture_entries, plain_hidden, sentences, tiny_loaded
from tests.support.daemon import ADMIN_TOKEN, OTHER_WRITE_TOKEN, READ_TOKEN, WRITE_TOKEN, DaemonProcess


@pytest.fixture
def daemon(tmp_path: Path):
    process = DaemonProcess(tmp_path / "store", tmp_path, extra_args=("--admit-after", "2")).start()
    yield process
    assert process.stop() == 0, process.log()


def test_a_decoy_sent_with_the_victims_feature_lands_at_its_own_tokens_and_the_victim_computes(
    daemon: DaemonProcess,
) -> None:
    loaded = tiny_loaded("bert")
    adapter = adapter_for(loaded)
    victim_words = sentences(1, seed=90, min_words=9, max_words=9)[0].split()
    near = " ".join([*victim_words[:-1], "w2" if victim_words[-1] != "w2" else "w3"])
    decoy_text = sentences(1, seed=91, min_words=9, max_words=9)[0]
    captured = capture_entries(loaded, [" ".join(victim_words), decoy_text, near])
    victim_feature, decoy_feature, near_feature = (entry.feature for entry in captured.entries)
    # The threshold the victim searches with: its near-duplicate reaches the victim's feature, not the decoy's.
    to_victim = float(np.linalg.norm(near_feature - victim_feature))
    to_decoy = float(np.linalg.norm(near_feature - decoy_feature))
    assert to_victim < to_decoy
    threshold = (to_victim + to_decoy) / 2

    projector = adapter.embedding_layer().attach_to(captured.projector.to_safetensors_bytes())
    with daemon.client(ADMIN_TOKEN) as admin:
        admin.create_namespace("default", model=loaded.name, fingerprint=captured.fingerprint,
                               layout=captured.layout, projector=projector, limits=token_limits(loaded))
    decoy = captured.entries[1]
    (ids,) = [tokenize(loaded.tokenizer, [decoy_text]).row_ids(0)]
    ids = np.asarray(ids)
    row = row_to_pb(ids, decoy.outputs, decoy.maps, victim_feature, 1)  # every part its own, but the feature
    for token in (WRITE_TOKEN, OTHER_WRITE_TOKEN):  # two callers ask for it: admitted
        with daemon.client(token) as writer:
            writer.lookup(exact_request("default", captured.fingerprint, [protocol_keys.token_hash(ids)], [len(ids)]))
            reply = writer.write_back("default", captured.fingerprint, [row])
            assert not reply.refused
    with daemon.client(READ_TOKEN) as reader:
        stats = reader.stats()
    assert (stats.written_back_entries, stats.written_back_map_entries) == (1, 1)  # stored, with its maps

    with AttnCache(loaded, f"grpc://{daemon.target}", token=READ_TOKEN, max_distance=threshold) as cache:
        embeddings = torch.from_numpy(cache.encode([near]))
        assert cache.last_stats.map_hits == 0
    expected = plain_hidden(loaded, [near])[0].mean(dim=0)
    assert torch.nn.functional.cosine_similarity(embeddings[0], expected, dim=0).item() >= 0.99

    # The decoy's own near-duplicate finds it where its tokens put it: derived rows still serve the map tier.
    decoy_near = " ".join([*decoy_text.split()[:-1], "w2" if decoy_text.split()[-1] != "w2" else "w3"])
    with AttnCache(loaded, f"grpc://{daemon.target}", token=READ_TOKEN, max_distance=1e9) as cache:
        cache.encode([decoy_near])
        assert cache.last_stats.map_hits == 1
