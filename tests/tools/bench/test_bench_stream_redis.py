"""``bench stream``'s ``redis_cache``: node processes sharing one exact cache in a real Redis (RedisVL's keys), end
to end on a tiny random BERT; a second pass over the same rows is answered from the cache."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from attnstore.errors import ConfigError
from attnstore_client.models import load_model
from attnstore_tools.bench import redis_cache
from attnstore_tools.bench.redis_cache import RedisEmbeddingsCache, RedisProcess, cache_key
from attnstore_tools.bench.stream import load_stream
from attnstore_tools.cli import main as cli_main

if shutil.which("redis-server") is None:
    pytest.skip("redis-server is not installed (scripts/install.sh installs Debian's redis-server)",
                allow_module_level=True)

EVENTS = 12  # distinct lines per system: the stream repeats the build lines and its own


def _loghub(folder: Path) -> Path:
    folder.mkdir()
    for system in ("Alpha", "Beta"):
        rows = "".join(f"{i}\tE{i % EVENTS}\t{system} event {i % EVENTS} on node-{i % EVENTS}\n" for i in range(40))
        (folder / f"{system}.tsv").write_text("line_id\tevent_id\tcontent\n" + rows, encoding="utf-8")
    return folder


def test_the_keys_are_redisvls_sha256_of_text_and_model_name() -> None:
    import hashlib

    assert cache_key("hello", "minilm") == "embedcache:" + hashlib.sha256(b"hello:minilm").hexdigest()


def test_a_second_pass_of_a_node_is_answered_from_the_redis_cache(tiny_minilm: Path, tmp_path: Path) -> None:
    lines = [f"line {i % 5} of the stream" for i in range(20)]  # 5 distinct lines, each 4 times
    work = tmp_path / "work"
    work.mkdir()
    (work / "stream.json").write_text(json.dumps(lines), encoding="utf-8")
    reference = load_model(str(tiny_minilm)).sentence_transformer.encode(lines)
    with RedisProcess(tmp_path / "redis") as server:
        answers = []
        for phase in (0, 1):
            spec = {"variant": "redis_cache", "phase": phase, "node": 0, "nodes": 1, "batch": 8,
                    "url": server.url, "work": str(work), "first": 0, "last": len(lines), "threads": 1,
                    "model": str(tiny_minilm)}
            (work / f"go-redis_cache-{phase}").touch()  # no other node to wait for
            path = work / f"spec-{phase}.json"
            path.write_text(json.dumps(spec), encoding="utf-8")
            subprocess.run([sys.executable, "-m", "attnstore_tools.bench.stream_node", str(path)], check=True)
            report = json.loads((work / f"redis_cache-{phase}-0.json").read_text())
            assert report["error"] is None and report["rows"] == list(range(len(lines)))
            answers.append((report["kinds"], np.load(work / f"redis_cache-{phase}-0.npy")))
        with server.client() as client:
            assert client.dbsize() == 5
    (first_kinds, first), (second_kinds, second) = answers
    # First pass: the first batch of 8 holds every distinct line, none stored yet; the rest are found. Second
    # pass: all found.
    assert first_kinds == ["miss"] * 8 + ["exact"] * 12 and second_kinds == ["exact"] * len(lines)
    np.testing.assert_array_equal(second, first)
    np.testing.assert_allclose(first, reference, atol=1e-5)


@pytest.mark.soak
@pytest.mark.parametrize("peer", [None, "onnx_o3"])
def test_redis_cache_runs_beside_plain_and_dict_prefilled_with_the_build_lines(
    peer: str | None, tiny_minilm: Path, tmp_path: Path,
) -> None:
    if peer is not None and importlib.util.find_spec("onnxruntime") is None:
        pytest.skip("onnxruntime is not installed: the peers extra (pip install -e '.[peers]')")
    data = _loghub(tmp_path / "loghub")
    out = tmp_path / "stream.json"
    code = cli_main(["bench", "stream", "--data", str(data), "--variants", "plain,dict,redis_cache",
                     "--build-lines", "8", "--limit", "48", "--nodes", "2", "--batch", "8", "--threads", "1",
                     "--model", str(tiny_minilm), "--peers-cache", str(tmp_path / "peers"), "--json", str(out),
                     *(["--redis-peer", peer] if peer else [])])
    result = json.loads(out.read_text())
    assert code == 0 and result["errors"] == 0 and result["candidate"] is None
    assert list(result["variants"]) == ["plain", "dict", "redis_cache"]
    redis = result["variants"]["redis_cache"]
    # 8 build lines of each system pre-filled; the stream's lines of events 8-11 of each set back.
    assert redis["redis"]["prefilled_keys"] == 16 and redis["redis"]["keys"] == 2 * EVENTS
    assert redis["redis"]["peer"] == peer
    # Every row of a pre-filled line is found; of the others, at least each line's first batch misses.
    build, stream = load_stream(data, 8, 48)
    prefilled = sum(line in set(build) for line in stream)
    assert redis["hit_rate"]["exact"] >= prefilled / 48 and 0 < redis["hit_rate"]["miss"] <= 1 - prefilled / 48
    assert redis["frac_cos_099"] == 1.0 and redis["min_cos"] > 0.9999


def test_without_redis_server_the_bench_refuses_naming_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(redis_cache.shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match="redis-server"):
        RedisProcess(tmp_path)


def test_the_cache_gives_found_vectors_and_encodes_each_miss_once(tmp_path: Path) -> None:
    calls: list[list[str]] = []

    def encoder(texts: list[str]) -> np.ndarray:
        calls.append(texts)
        return np.array([[len(text), 1.0] for text in texts], dtype=np.float32)

    with RedisProcess(tmp_path) as server, server.client() as client:
        cache = RedisEmbeddingsCache(client, "m")
        cache.set_many(["aa"], np.array([[9.0, 9.0]], dtype=np.float32))
        vectors, hits = cache.encode(["aa", "b", "b", "ccc"], encoder)
        assert calls == [["b", "ccc"]] and hits == [True, False, False, False]
        np.testing.assert_array_equal(vectors, [[9, 9], [1, 1], [1, 1], [3, 1]])
        assert cache.encode(["ccc"], encoder)[1] == [True] and len(calls) == 1
