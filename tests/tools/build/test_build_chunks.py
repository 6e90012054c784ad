"""``attnstore build --chunks``: chunks tokenized as the client tokenizes segments, computed once, stored whole
(tiny local decoder, real LMDB; a real daemon; a build SIGKILLed mid-run leaves only whole, correct chunks)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

from attnstore.errors import AuthError, FingerprintMismatchError, NamespaceNotFoundError, UnsupportedModelError
from attnstore.service import AttnStoreService
from attnstore_client.call.sources import segment_tokens
from attnstore_client.keys import model_fingerprint
from attnstore_client.models import load_model
from attnstore_client.tiers.chunks.source import chunk_key
from attnstore_tools.build.chunks import ChunkBuildConfig, build_chunks_into
from attnstore_tools.build.namespace_layout import exact_tier_layout, token_limits
from tests.support.adapters import save_tiny_decoder
from tests.support.caches import tiny_loaded
from tests.support.daemon import ADMIN_TOKEN, READ_TOKEN, WRITE_TOKEN, DaemonProcess
from tests.support.wait import wait_until

INSTRUCTION = "classify the sentiment of each review"
WORDS = ["alpha", "beta", "gamma", "delta", "river", "stone", "light", "north", "field", "cloud", "good", "bad"]


def chunk_texts(count: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(3, 12)))) for _ in range(count)]


@pytest.fixture(scope="module")
def decoder_folder(tmp_path_factory):
    folder = save_tiny_decoder(tmp_path_factory.mktemp("tiny") / "model", full_vocab=True)
    return folder


@pytest.fixture(scope="module")
def decoder(decoder_folder):
    return load_model(str(decoder_folder))


def _keys(decoder, texts: list[str]) -> set[bytes]:
    """The chunk keys a prompt ``[INSTRUCTION, text, question]`` gives the client."""
    rows = segment_tokens(decoder.tokenizer, [[INSTRUCTION, text, "w"] for text in texts], max_length=512)
    return {chunk_key(row.ids[: row.segments[0]], row.ids[row.segments[0] : row.segments[0] + row.segments[1]])
            for row in rows}


def test_build_stores_each_distinct_chunk_once_under_the_clients_keys_and_a_second_build_adds_none(
    decoder, tmp_path,
):
    texts = chunk_texts(12) + chunk_texts(3) + ["", "  "]  # three repeats, two blank lines
    config = ChunkBuildConfig(instruction=INSTRUCTION, dtype="float32", batch_size=5)
    report = build_chunks_into(decoder, texts, str(tmp_path / "store"), config, progress=False)
    assert (report.texts, report.distinct, report.skipped_blank, report.stored_before) == (17, 12, 2, 0)
    assert report.added == 12 + 1  # and the instruction
    with AttnStoreService.open(tmp_path / "store") as service:
        fingerprint = model_fingerprint(decoder.model, decoder.tokenizer)
        layout = service.chunks.layout("default")
        assert layout is not None and layout.dtype == "float32"
        keys = sorted(_keys(decoder, texts[:12]))
        lengths = service.chunks.lengths("default", fingerprint, layout, keys)
        assert all(n is not None and n >= 3 for n in lengths)
        instruction = segment_tokens(decoder.tokenizer, [[INSTRUCTION, ""]], max_length=512)[0].segments[0]
        assert report.bytes == sum(layout.chunk_bytes(n) for n in lengths) + layout.chunk_bytes(instruction)
    again = build_chunks_into(decoder, texts, str(tmp_path / "store"), config, progress=False)
    assert (again.added, again.stored_before) == (0, 13)


def test_a_bidirectional_model_is_refused_with_a_clear_error(tmp_path):
    with pytest.raises(UnsupportedModelError, match="causal"):
        build_chunks_into(tiny_loaded("bert"), ["w2 w3"], str(tmp_path / "store"), ChunkBuildConfig(), progress=False)


def test_build_through_a_daemon_needs_an_existing_namespace_and_a_write_token_a_recorded_layout(decoder, tmp_path):
    with AttnStoreService.open(tmp_path / "store", create=True) as service:
        service.create_namespace("icl", model=decoder.name, fingerprint=model_fingerprint(decoder.model,
                                 decoder.tokenizer), layout=exact_tier_layout(decoder), limits=token_limits(decoder))
    daemon = DaemonProcess(tmp_path / "store", tmp_path).start()
    try:
        url = f"grpc://{daemon.target}"
        texts = chunk_texts(6)
        with pytest.raises(AuthError):
            build_chunks_into(decoder, texts, url, ChunkBuildConfig("icl"), token=READ_TOKEN, progress=False)
        with pytest.raises(NamespaceNotFoundError):
            build_chunks_into(decoder, texts, url, ChunkBuildConfig("nope"), token=WRITE_TOKEN, progress=False)
        with pytest.raises(FingerprintMismatchError, match="records no chunk layout"):  # a writer chooses none
            build_chunks_into(decoder, texts, url, ChunkBuildConfig("icl", INSTRUCTION), token=WRITE_TOKEN,
                              progress=False)
        report = build_chunks_into(decoder, texts, url, ChunkBuildConfig("icl", INSTRUCTION), token=ADMIN_TOKEN,
                                   progress=False)
        assert report.added == 6 + 1
        again = build_chunks_into(decoder, texts, url, ChunkBuildConfig("icl", INSTRUCTION), token=WRITE_TOKEN,
                                  progress=False)
        assert (again.added, again.stored_before) == (0, 7)
    finally:
        assert daemon.stop() == 0, daemon.log()


def _killed_build(decoder_folder, store, corpus, after: int) -> None:
    """Run ``attnstore build --chunks`` in a child and SIGKILL it once its progress bar passed ``after`` chunks."""
    child = subprocess.Popen(
        [sys.executable, "-m", "attnstore_tools.cli", "build", "--model", str(decoder_folder), "--store", str(store),
         "--chunks", str(corpus), "--instruction", INSTRUCTION, "--batch-size", "2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, "TQDM_MININTERVAL": "0"},
    )
    seen = bytearray()

    def read() -> None:
        for block in iter(lambda: child.stderr.read1(256), b""):
            seen.extend(block)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    def passed() -> bool:
        if child.poll() is not None:
            raise AssertionError(f"the build ended before {after} chunks: {seen.decode(errors='replace')[-2000:]}")
        done = [int(n) for n in re.findall(rb"chunks:[^|\r\n]*\|[^|\r\n]*\| *(\d+)/\d+", bytes(seen))]
        return bool(done) and max(done) >= after

    try:
        wait_until(passed, 120, lambda: f"the build's progress past {after} chunks: {bytes(seen)[-500:]!r}",
                   poll=0.01)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        reader.join(5)
    assert child.returncode == -signal.SIGKILL, seen.decode(errors="replace")[-2000:]


def test_a_build_killed_mid_run_leaves_only_whole_correct_chunks_and_the_next_one_finishes_it(
    decoder, decoder_folder, tmp_path,
):
    texts = chunk_texts(600, seed=1)
    corpus = tmp_path / "chunks.txt"
    corpus.write_text("\n".join(texts) + "\n", encoding="utf-8")
    reference = tmp_path / "reference"
    build_chunks_into(decoder, texts, str(reference), ChunkBuildConfig(instruction=INSTRUCTION), progress=False)
    fingerprint = model_fingerprint(decoder.model, decoder.tokenizer)
    keys = sorted(_keys(decoder, texts))
    store = tmp_path / "store"
    with AttnStoreService.open(reference) as service:
        want = {key: service.chunks.read("default", key) for key in keys}
    visible_before = 0
    for after in (20, 100, 100):  # each run skips what the runs before stored
        _killed_build(decoder_folder, store, corpus, after)
        with AttnStoreService.open(store) as service:
            layout = service.chunks.layout("default")
            assert layout is not None
            lengths = service.chunks.lengths("default", fingerprint, layout, keys)
            visible = [key for key, n in zip(keys, lengths, strict=True) if n is not None]
            assert visible_before < len(visible) < len(keys)  # killed mid-run, after more than the last time
            # Whole, and an uninterrupted build's values: a resumed run puts other chunks in a forward together, and
            # where torch runs AVX-512 kernels a forward's numbers move in their last fp16 bit with the batch they
            # share (1 of 1,152 values by 2e-6 here), so within two fp16 steps; a torn chunk is far off.
            for key in visible:
                np.testing.assert_allclose(service.chunks.read("default", key), want[key], rtol=2e-3, atol=2e-5)
            report = service.store.verify()
            assert report.ok, report
        visible_before = len(visible)
    report = build_chunks_into(decoder, texts, str(store), ChunkBuildConfig(instruction=INSTRUCTION), progress=False)
    assert report.added == len(keys) - visible_before and report.stored_before == visible_before + 1
