"""One node process of ``attnstore bench stream``: encode this node's batches with one variant.

    python -m attnstore_tools.bench.stream_node SPEC.json

SPEC (JSON, written by ``bench.stream``): variant, phase, node, nodes, batch, url, token,
namespace, work (folder with ``stream.json``, ``build.json``, ``build.npy``),
first and last (the stream rows of this run), threads, model, maps (whether to
look maps up), write_back; for ``redis_cache``, url is the Redis server's and
peer and graph (optional) name the peer that encodes its misses instead of
sentence-transformers. The node loads its model, writes
``ready-VARIANT-PHASE-NODE``, waits for ``go-VARIANT-PHASE``, then encodes its
batches (every ``nodes``-th batch of ``batch`` rows from its index) and writes
``VARIANT-PHASE-NODE.npy`` (its embeddings, in its rows' order) and
``VARIANT-PHASE-NODE.json`` (rows, kinds, start and end times, write-back stats, error).
A dict node's dict starts with the build lines (none in a cold start); the
Redis cache the nodes of ``redis_cache`` share was filled with them by the parent.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from attnstore_tools.bench.redis_cache import RedisEmbeddingsCache


def _batches(first: int, last: int, batch: int, node: int, nodes: int) -> list[list[int]]:
    """The row indices of this node's batches of rows ``first..last-1``: batches of ``batch`` dealt
    round-robin over ``nodes``."""
    starts = range(first + node * batch, last, nodes * batch)
    return [list(range(s, min(s + batch, last))) for s in starts]


def _miss_encoder(spec: dict[str, Any], encoder: Any) -> Callable[[list[str]], np.ndarray]:
    """What encodes the Redis cache's misses: the spec's peer on its graph, else sentence-transformers."""
    if not spec.get("peer"):
        return lambda texts: encoder.encode(texts, batch_size=len(texts))
    from attnstore_tools.bench.peers import open_peer, weightless_pipeline

    peer = open_peer(spec["peer"], Path(spec["graph"]), weightless_pipeline(spec["model"]),
                     threads=int(spec["threads"]))
    return lambda texts: peer.encode(texts, batch_size=len(texts))


def run(spec: dict[str, Any]) -> None:
    """Run one node as ``spec`` says (see the module docstring)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from attnstore_client.cache import AttnCache
    from attnstore_client.models import load_model

    torch.set_num_threads(int(spec["threads"]))
    work, variant, node = Path(spec["work"]), spec["variant"], int(spec["node"])
    name = f"{variant}-{spec['phase']}"
    lines: list[str] = json.loads((work / "stream.json").read_text(encoding="utf-8"))
    batches = _batches(int(spec["first"]), int(spec["last"]), int(spec["batch"]), node, int(spec["nodes"]))
    loaded = load_model(spec["model"])
    encoder = loaded.sentence_transformer
    assert encoder is not None, "bench stream needs a sentence-transformers model"
    table: dict[str, np.ndarray] = {}
    cache: AttnCache | None = None
    shared: RedisEmbeddingsCache | None = None
    if variant == "redis_cache":
        import redis

        shared = RedisEmbeddingsCache(redis.Redis.from_url(spec["url"], socket_timeout=60), spec["model"])
        encode_misses = _miss_encoder(spec, encoder)  # not warmed up, as no other variant is
    elif variant == "dict":
        build = json.loads((work / "build.json").read_text(encoding="utf-8"))
        table = dict(zip(build, np.load(work / "build.npy"), strict=True))
    elif variant != "plain":
        cache = AttnCache(loaded, spec["url"], namespace=spec["namespace"], token=spec["token"],
                          write_back=bool(spec["write_back"]))
        cache.maps = bool(spec["maps"])
    (work / f"ready-{name}-{node}").touch()
    while not (work / f"go-{name}").exists():
        time.sleep(0.01)
    rows: list[int] = []
    kinds: list[str] = []
    outputs: list[np.ndarray] = []
    error = None
    start = time.time()
    try:
        for batch in batches:
            texts = [lines[i] for i in batch]
            if variant == "plain":
                embedded = encoder.encode(texts, batch_size=len(texts), convert_to_numpy=True)
                kinds += ["miss"] * len(texts)
            elif variant == "dict":
                missing = list(dict.fromkeys(t for t in texts if t not in table))
                if missing:
                    table.update(zip(missing, encoder.encode(missing, batch_size=len(missing)), strict=True))
                kinds += ["exact" if t not in missing else "miss" for t in texts]
                embedded = np.stack([table[t] for t in texts])
            elif shared is not None:
                embedded, hits = shared.encode(texts, encode_misses)
                kinds += ["exact" if hit else "miss" for hit in hits]
            else:
                assert cache is not None
                embedded = cache.encode(texts, batch_size=len(texts))
                kinds += list(cache.last_row_kinds)
            rows += batch
            outputs.append(np.asarray(embedded, dtype=np.float32))
    except Exception:  # the parent reports it as an error of this node; the run goes on
        error = traceback.format_exc()
    end = time.time()
    written = None
    if cache is not None:
        if cache.write_back is not None:
            cache.write_back.flush(60.0)
            written = dataclasses.asdict(cache.write_back.stats())
        cache.close()
    dim = outputs[0].shape[1] if outputs else 0
    np.save(work / f"{name}-{node}.npy", np.concatenate(outputs) if outputs else np.zeros((0, dim), np.float32))
    report = {"rows": rows, "kinds": kinds, "start": start, "end": end, "written": written, "error": error}
    (work / f"{name}-{node}.json").write_text(json.dumps(report), encoding="utf-8")


if __name__ == "__main__":
    run(json.loads(Path(sys.argv[1]).read_text(encoding="utf-8")))
