"""One child process of ``attnstore bench encode``: one ``encode`` call of one method, timed, its peak RSS kept.

    python -m attnstore_tools.bench.encode_child SPEC.json

SPEC (JSON, written by ``bench.encode``): method (``sentence_transformers``, ``dict``,
``attnstore`` or ``attnstore_exact``), model, threads, batch, device (where the model runs; default cpu),
texts (a JSON file of the call's texts), warmup
(a JSON file of texts encoded first, untimed), store and namespace (the ``attnstore`` methods),
stored (a JSON file of the stored texts) and stored_embeddings (their ``.npy``, the
dict's contents), embeddings (where to save the call's ``.npy``, or null) and report
(where to write the JSON: seconds, peak RSS, the cache's stats). Every method gets the
same texts in one call: ``SentenceTransformer.encode``; a dict of the stored texts'
embeddings in front of it (the distinct misses encoded in one call); ``AttnCache.encode``
in embedded mode, with every tier or (``attnstore_exact``) without the map tier (``maps = False``).
The peak RSS is the whole process's (model, store and call): its ``VmHWM`` (``machine.peak_rss_bytes``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from attnstore_tools.machine import peak_rss_bytes


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Run the call ``spec`` describes; returns the report (also written to ``spec["report"]``)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from attnstore_client.models import load_model

    torch.set_num_threads(int(spec["threads"]))
    texts: list[str] = json.loads(Path(spec["texts"]).read_text(encoding="utf-8"))
    warmup: list[str] = json.loads(Path(spec["warmup"]).read_text(encoding="utf-8"))
    batch = int(spec["batch"])
    loaded = load_model(spec["model"])
    model = loaded.sentence_transformer
    assert model is not None, "bench encode needs a sentence-transformers model"
    device = spec.get("device", "cpu")
    model.to(device)
    report: dict[str, Any] = {"method": spec["method"], "rows": len(texts)}
    if spec["method"] == "sentence_transformers":
        model.encode(warmup, batch_size=batch, show_progress_bar=False)
        started = time.perf_counter()
        embeddings = model.encode(texts, batch_size=batch, show_progress_bar=False)
        report["seconds"] = time.perf_counter() - started
    elif spec["method"] == "dict":
        stored: list[str] = json.loads(Path(spec["stored"]).read_text(encoding="utf-8"))
        table = dict(zip(stored, np.load(spec["stored_embeddings"]), strict=True))
        model.encode(warmup, batch_size=batch, show_progress_bar=False)
        started = time.perf_counter()
        embeddings = _dict_encode(model, table, texts, batch)
        report["seconds"] = time.perf_counter() - started
        report["dict_misses"] = len({text for text in texts if text not in table})
    else:
        from attnstore_client.cache import AttnCache

        cache = AttnCache(loaded, f"local:{spec['store']}", namespace=spec["namespace"], device=device)
        cache.maps = spec["method"] != "attnstore_exact"
        cache.encode(warmup, batch_size=batch, show_progress_bar=False)
        cache.reset_stats()
        started = time.perf_counter()
        embeddings = cache.encode(texts, batch_size=batch, show_progress_bar=False)
        report["seconds"] = time.perf_counter() - started
        report["stats"] = cache.last_stats.to_json_dict()
        report["linear_kernels"] = cache.adapter.linear_kernels
        cache.close()
    report["peak_rss_bytes"] = peak_rss_bytes()  # its own: ru_maxrss would carry the parent's
    if spec.get("embeddings"):
        np.save(spec["embeddings"], np.asarray(embeddings, dtype=np.float32))
    Path(spec["report"]).write_text(json.dumps(report), encoding="utf-8")
    return report


def _dict_encode(model: Any, table: dict[str, np.ndarray], texts: list[str], batch: int) -> np.ndarray:
    """What a user writes first: stored embeddings by text, the distinct misses encoded in one call."""
    misses = list(dict.fromkeys(text for text in texts if text not in table))
    if misses:
        computed = model.encode(misses, batch_size=batch, show_progress_bar=False)
        table.update(zip(misses, computed, strict=True))
    return np.stack([table[text] for text in texts])


if __name__ == "__main__":
    run(json.loads(Path(sys.argv[1]).read_text(encoding="utf-8")))
