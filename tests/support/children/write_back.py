"""A client process of the write-back tests: encode through a cache that writes back, then report.

    python -m tests.support.children.write_back URL TOKENS SEED COUNT [TEXTS_JSON MAX_DISTANCE]

Encodes ``sentences(COUNT, seed=SEED)``, or the texts of TEXTS_JSON (a JSON list) looked up with
MAX_DISTANCE, once per token of TOKENS (comma-separated), each time through a new cache: one
process plays several callers in turn without paying another interpreter start. Prints one JSON
line per token, in order: the call's stats, the write-back worker's stats after a flush, and the
difference of the embeddings from the plain model's (the largest, and each row's).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from attnstore_client.cache import AttnCache
from tests.support.caches import plain_hidden, sentences, tiny_loaded


def main(url: str, tokens: str, seed: str, count: str, texts_json: str = "", max_distance: str = "") -> None:
    loaded = tiny_loaded("bert")
    texts = json.loads(texts_json) if texts_json else sentences(int(count), seed=int(seed))
    distance = float(max_distance) if max_distance else None
    expected = torch.stack([h.mean(dim=0) for h in plain_hidden(loaded, texts)])
    for token in tokens.split(","):
        with AttnCache(loaded, url, token=token, write_back=True, max_distance=distance) as cache:
            embeddings = torch.from_numpy(cache.encode(texts, batch_size=8))
            assert cache.write_back is not None
            cache.write_back.flush(30.0)
            written = dataclasses.asdict(cache.write_back.stats())
        row_diffs = (embeddings - expected).abs().amax(dim=1).tolist()
        print(json.dumps({"stats": cache.last_stats.to_json_dict(), "written": written, "max_diff": max(row_diffs),
                          "row_diffs": row_diffs}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
