"""One child process of ``attnstore bench encode``: one ``encode`` call of one method, timed, its peak RSS kept.

    python -m attnstore_tools.bench.encode_child SPEC.json

SPEC (JSON, written by ``bench.encode``): method (``sentence_transformers``, ``dict``,
``attnstore``, ``attnstore_exact``, ``attnstore_int8``, ``attnstore_audit``, an engine's (``attnstore_auto``,
``attnstore_openvino``, ``attnstore_onnxruntime``: ``bench.encode.ENGINE_METHODS``) or a peer's method, see
``bench.encode.PEER_METHODS``), audit_rate (the share of exact hits the cache audits; 0 when absent),
model, threads, batch,
device (where the model runs; default cpu), graph (a peer's exported graph),
texts (a JSON file of the call's texts), warmup
(a JSON file of texts encoded first, untimed), store and namespace (the ``attnstore`` methods),
stored (a JSON file of the stored texts) and stored_embeddings (their ``.npy``, the
dict's contents), embeddings (where to save the call's ``.npy``, or null) and report
(where to write the JSON: seconds, peak RSS, the cache's stats). Every method gets the
same texts in one call: ``SentenceTransformer.encode``; a dict of the stored texts'
embeddings in front of it (the distinct misses encoded in one call); ``AttnCache.encode``
in embedded mode, with every tier, without the map tier (``attnstore_exact``: ``maps = False``) or computing on
the namespace's int8 plan (``attnstore_int8``: ``int8=True``), or auditing ``audit_rate`` of its exact hits
(``attnstore_audit``); a peer's
``encode`` (``bench.peers``: ONNX Runtime or OpenVINO, ``threads`` intra-op threads), bare or (``..._dict``) behind
the same dict. A peer's child never reads the torch weights (``weightless_pipeline``), as a user of
sentence-transformers' ``backend="onnx"`` never does.
The peak RSS is the whole process's (model, store and call): its ``VmHWM`` (``machine.peak_rss_bytes``). Beside
it, ``memory``: the process's anonymous memory (``RssAnon``: heap, tensors, indexes) and file-backed memory
(``RssFile``: mapped libraries and the store's LMDB pages, which the kernel can drop and read again) just
before the timed call and at their largest during it, sampled every 20 ms.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from attnstore_tools.machine import RssSampler, peak_rss_bytes

_MEMORY_INTERVAL_S = 0.02


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Run the call ``spec`` describes; returns the report (also written to ``spec["report"]``)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(int(spec["threads"]))
    texts: list[str] = json.loads(Path(spec["texts"]).read_text(encoding="utf-8"))
    warmup: list[str] = json.loads(Path(spec["warmup"]).read_text(encoding="utf-8"))
    batch = int(spec["batch"])
    method: str = spec["method"]
    report: dict[str, Any] = {"method": method, "rows": len(texts)}
    if spec.get("graph"):
        embeddings = _peer_call(spec, method, texts, warmup, batch, report)
    else:
        embeddings = _model_call(spec, method, texts, warmup, batch, report)
    report["peak_rss_bytes"] = peak_rss_bytes()  # its own: ru_maxrss would carry the parent's
    if spec.get("embeddings"):
        np.save(spec["embeddings"], np.asarray(embeddings, dtype=np.float32))
    Path(spec["report"]).write_text(json.dumps(report), encoding="utf-8")
    return report


def _model_call(
    spec: dict[str, Any], method: str, texts: list[str], warmup: list[str], batch: int, report: dict[str, Any]
) -> np.ndarray:
    """sentence-transformers, bare or behind the dict, or AttnCache: the call's embeddings (times in ``report``)."""
    from attnstore_client.models import load_model

    loaded = load_model(spec["model"])
    model = loaded.sentence_transformer
    assert model is not None, "bench encode needs a sentence-transformers model"
    device = spec.get("device", "cpu")
    model.to(device)
    if method in ("sentence_transformers", "dict"):
        def encode(rows: list[str]) -> np.ndarray:
            return model.encode(rows, batch_size=batch, show_progress_bar=False)

        return _timed_call(spec, method == "dict", encode, texts, warmup, report)
    from attnstore_client.cache import AttnCache
    from attnstore_tools.bench.encode import ENGINE_METHODS, INT8_METHODS

    engine = ENGINE_METHODS.get(method) or INT8_METHODS.get(method) or "torch"
    cache = AttnCache(loaded, f"local:{spec['store']}", namespace=spec["namespace"], device=device,
                      int8=method in INT8_METHODS, audit_rate=spec.get("audit_rate", 0.0), engine=engine)
    cache.maps = method != "attnstore_exact"
    cache.encode(warmup, batch_size=batch, show_progress_bar=False)
    cache.reset_stats()
    with _memory(report):
        started = time.perf_counter()
        embeddings = cache.encode(texts, batch_size=batch, show_progress_bar=False)
        report["seconds"] = time.perf_counter() - started
    report["stats"] = cache.last_stats.to_json_dict()
    report["linear_kernels"] = cache.adapter.linear_kernels
    report["engines"] = None if cache.engines is None else cache.engines.to_json()
    report["int8_engines"] = None if cache.int8_engines is None else cache.int8_engines.to_json()
    cache.close()
    return embeddings


def _peer_call(
    spec: dict[str, Any], method: str, texts: list[str], warmup: list[str], batch: int, report: dict[str, Any]
) -> np.ndarray:
    """A peer on its exported graph, bare or (``..._dict``) behind the dict: the call's embeddings."""
    from attnstore_tools.bench.peers import open_peer, weightless_pipeline

    peer = open_peer(spec["peer"], Path(spec["graph"]), weightless_pipeline(spec["model"]),
                     threads=int(spec["threads"]))

    def encode(rows: list[str]) -> np.ndarray:
        return peer.encode(rows, batch_size=batch)

    return _timed_call(spec, method.endswith("_dict"), encode, texts, warmup, report)


def _timed_call(
    spec: dict[str, Any], cached: bool, encode: Callable[[list[str]], np.ndarray], texts: list[str],
    warmup: list[str], report: dict[str, Any],
) -> np.ndarray:
    """``encode`` warmed up, then timed on the call's texts, bare or behind the dict of the stored texts."""
    table: dict[str, np.ndarray] = {}
    if cached:
        stored: list[str] = json.loads(Path(spec["stored"]).read_text(encoding="utf-8"))
        table = dict(zip(stored, np.load(spec["stored_embeddings"]), strict=True))
    encode(warmup)
    with _memory(report):
        started = time.perf_counter()
        embeddings = _dict_encode(encode, table, texts) if cached else encode(texts)
        report["seconds"] = time.perf_counter() - started
    if cached:
        report["dict_misses"] = len({text for text in texts if text not in table})
    return embeddings


@contextlib.contextmanager
def _memory(report: dict[str, Any]) -> Iterator[None]:
    """Samples this process's RssAnon and RssFile while the block runs; their start and peak go to ``report``."""
    sampler = RssSampler(os.getpid(), interval=_MEMORY_INTERVAL_S)
    sampler.samples.append(sampler.read())  # before the call, whatever the thread's first wake-up
    sampler.start()
    try:
        yield
    finally:
        sampler.stop()
        sampler.samples.append(sampler.read())
        report["memory"] = sampler.peaks()


def _dict_encode(
    encode: Callable[[list[str]], np.ndarray], table: dict[str, np.ndarray], texts: list[str]
) -> np.ndarray:
    """What a user writes first: stored embeddings by text, the distinct misses encoded in one call."""
    misses = list(dict.fromkeys(text for text in texts if text not in table))
    if misses:
        table.update(zip(misses, encode(misses), strict=True))
    return np.stack([table[text] for text in texts])


if __name__ == "__main__":
    run(json.loads(Path(sys.argv[1]).read_text(encoding="utf-8")))
