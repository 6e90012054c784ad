"""A second client process for the daemon tests: ingest a tiny model's maps, or encode through the cache.

    python -m tests.support.children.cache ingest TARGET ADMIN_TOKEN SEED COUNT
    python -m tests.support.children.cache encode URL READ_TOKEN SEED COUNT

Prints one JSON line: the ingest summary, or the cache's stats and the largest
difference of its embeddings from the plain model's.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from attnstore_client.cache import AttnCache
from attnstore_client.connection.daemon import DaemonClient
from tests.support.caches import capture_entries, plain_hidden, sentences, tiny_loaded


def main(mode: str, where: str, token: str, seed: str, count: str) -> None:
    loaded = tiny_loaded("bert")
    texts = sentences(int(count), seed=int(seed))
    if mode == "ingest":
        captured = capture_entries(loaded, texts)
        with DaemonClient(where, token=token) as remote:
            remote.create_namespace("default", model=loaded.name, fingerprint=captured.fingerprint,
                                    layout=captured.layout, projector=captured.projector.to_safetensors_bytes())
            summary = remote.ingest("default", captured.fingerprint, captured.entries)
        print(json.dumps({"entries": summary.entries, "entry_ids": list(summary.entry_ids)}))
        return
    with AttnCache(loaded, where, token=token) as cache:
        embeddings = torch.from_numpy(cache.encode(texts, batch_size=8))
    expected = torch.stack([h.mean(dim=0) for h in plain_hidden(loaded, texts)])
    max_diff = (embeddings - expected).abs().max().item()
    print(json.dumps({"stats": cache.last_stats.to_json_dict(), "max_diff": max_diff}))


if __name__ == "__main__":
    main(*sys.argv[1:])
