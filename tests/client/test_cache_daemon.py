"""``AttnCache`` against the real daemon (a subprocess on a free loopback port, real LMDB)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from attnstore.errors import AuthError, FingerprintMismatchError
from attnstore.protocol.records import LookupBatch
from attnstore.service import AttnStoreService
from attnstore_client.cache import PROMPT_EOL, AttnCache
from attnstore_client.connection import MapStream, connect
from attnstore_client.connection.remote import RemoteConnection
from attnstore_client.models import LoadedModel
from attnstore_client.resilience import BreakerPolicy
from tests.support.adapters import VOCAB
from tests.support.caches import capture_entries, fill_namespace, plain_hidden, sentences, tiny_loaded, word_tokenizer
from tests.support.daemon import ADMIN_TOKEN, READ_TOKEN, DaemonProcess
from tests.support.pause import paused
from tests.support.wait import wait_until

ROOT = Path(__file__).resolve().parents[2]  # children run as modules of tests.support from here
SEED, STORED, QUERIED = 11, 12, 16  # the child ingests sentences(12, seed=11); queries add 4 unseen ones


def _child(*args: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "tests.support.children.cache", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    workdir = tmp_path_factory.mktemp("cache-daemon")
    process = DaemonProcess(workdir / "store", workdir).start()
    summary = _child("ingest", process.target, ADMIN_TOKEN, str(SEED), str(STORED))
    assert summary["entries"] == STORED
    yield process
    assert process.stop() == 0, process.log()


def test_what_one_client_process_ingests_another_client_process_hits(daemon: DaemonProcess) -> None:
    report = _child("encode", f"grpc://{daemon.target}", READ_TOKEN, str(SEED), str(QUERIED))
    stats = report["stats"]
    assert (stats["exact_hits"], stats["misses"], stats["fallbacks"]) == (STORED, QUERIED - STORED, {})
    assert report["max_diff"] < 2e-3


def test_this_process_hits_the_same_entries_with_a_read_token(daemon: DaemonProcess) -> None:
    loaded = tiny_loaded("bert")
    texts = sentences(QUERIED, seed=SEED)
    with AttnCache(loaded, f"grpc://{daemon.target}", token=READ_TOKEN, exact=False) as cache:
        embeddings = cache.encode(texts)
    expected = torch.stack([h.mean(dim=0) for h in plain_hidden(loaded, texts)]).numpy()
    np.testing.assert_allclose(embeddings, expected, atol=2e-3)
    assert cache.last_stats.map_hits == STORED and cache.last_stats.bytes_fetched > 0


def test_a_wrong_namespace_fingerprint_is_failed_precondition_with_a_clear_message(daemon: DaemonProcess) -> None:
    other = tiny_loaded("bert", seed=1)
    with pytest.raises(FingerprintMismatchError) as on_connect:
        AttnCache(other, f"grpc://{daemon.target}", token=READ_TOKEN)
    assert "tiny-bert" in str(on_connect.value) and "different model" in str(on_connect.value)
    with connect(f"grpc://{daemon.target}", token=READ_TOKEN) as connection:
        with pytest.raises(FingerprintMismatchError) as on_lookup:
            connection.search(LookupBatch("default", "0" * 64, np.zeros((1, 128), np.float32), [5],
                                          max_distance=0.01), timeout=10.0)
    assert str(on_lookup.value).startswith("FAILED_PRECONDITION")
    assert "tiny-bert" in str(on_lookup.value) and "fingerprint" in str(on_lookup.value)


@pytest.mark.parametrize("token", [None, "not-a-known-token-at-all"])
def test_a_missing_or_wrong_token_is_unauthenticated(daemon: DaemonProcess, token: str | None) -> None:
    with pytest.raises(AuthError, match="UNAUTHENTICATED"):
        AttnCache(tiny_loaded("bert"), f"grpc://{daemon.target}", token=token)


def test_health_reports_serving(daemon: DaemonProcess) -> None:
    with connect(f"grpc://{daemon.target}") as connection:
        assert connection.health() == "SERVING"


def test_a_stalled_daemon_times_out_and_the_rows_are_computed(daemon: DaemonProcess) -> None:
    loaded = tiny_loaded("bert")
    texts = sentences(QUERIED, seed=SEED)
    cache = AttnCache(loaded, f"grpc://{daemon.target}", token=READ_TOKEN, timeout=1.0)
    with paused(daemon.process.pid):
        embeddings = cache.encode(texts)
    expected = torch.stack([h.mean(dim=0) for h in plain_hidden(loaded, texts)]).numpy()
    np.testing.assert_allclose(embeddings, expected, atol=1e-5)
    assert cache.last_stats.fallbacks == {"timeout": QUERIED} and cache.last_stats.lookup_s < 3.0
    cache.close()


def _long_llama() -> LoadedModel:
    """A random decoder whose maps are big: 4 layers x 8 heads, 300 tokens = 5.8 MB of fp16 maps a row."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512)
    causal_lm = LlamaForCausalLM(config).eval()
    return LoadedModel("tiny-long-llama", causal_lm.get_decoder(), word_tokenizer(), causal_lm.lm_head)


class _TermOnFirstFrame:
    """A FetchMaps call that stops the daemon once its first frame arrived, before taking any more.

    Until the daemon has exited the client reads nothing further, so HTTP/2 flow control holds the rest of the
    stream on the daemon's side: the drain always finds it mid-stream (on loopback a whole stream can otherwise
    go out before a SIGTERM is handled).
    """

    def __init__(self, call: Any, daemon: DaemonProcess) -> None:
        self._call, self._daemon, self._first = call, daemon, True

    def __iter__(self) -> _TermOnFirstFrame:
        return self

    def __next__(self) -> Any:
        message = next(self._call)
        if self._first:
            self._first = False
            self._daemon.process.send_signal(signal.SIGTERM)
            self._daemon.process.wait(timeout=30)
        return message

    def __getattr__(self, name: str) -> Any:  # cancel(), code(), ...: the real call's
        return getattr(self._call, name)


class _TermAfterMatches(RemoteConnection):
    """A real connection that sends the daemon SIGTERM once the hits' maps started streaming: mid-stream."""

    daemon: DaemonProcess

    def fetch_maps(self, *args: Any, **kwargs: Any) -> MapStream:
        stub = self._remote.stub
        if not hasattr(stub, "real_fetch_maps"):
            stub.real_fetch_maps = stub.FetchMaps
            stub.FetchMaps = lambda request, **options: _TermOnFirstFrame(stub.real_fetch_maps(request, **options),
                                                                          self.daemon)
        return super().fetch_maps(*args, **kwargs)


def test_sigterm_in_the_middle_of_a_lookup_stream_ends_cleanly_and_outputs_stay_correct(tmp_path: Path) -> None:
    loaded = _long_llama()
    texts = [" ".join(words) for words in (s.split() for s in sentences(8, seed=5, min_words=300, max_words=300))]
    prompts = [PROMPT_EOL.format(text=text) for text in texts]  # what encode() runs for a decoder
    captured = capture_entries(loaded, prompts, outputs=False)
    # Grace 0: the drain cancels the stream at once, with most of the 8 rows x 6 MB of maps still unsent.
    daemon = DaemonProcess(tmp_path / "store", tmp_path, extra_args=("--grace", "0")).start()
    try:
        with daemon.client() as admin:
            admin.create_namespace("default", model=loaded.name, fingerprint=captured.fingerprint,
                                   layout=captured.layout, projector=captured.projector.to_safetensors_bytes())
            admin.ingest("default", captured.fingerprint, captured.entries)
        connection = _TermAfterMatches(f"grpc://{daemon.target}", daemon.target, token=READ_TOKEN, tls=False,
                                       tls_ca=None, max_message_bytes=None)
        connection.daemon = daemon
        with AttnCache(loaded, connection, exact=False) as cache:
            embeddings = cache.encode(texts, batch_size=8)
        assert daemon.process.wait(timeout=30) == 0, daemon.log()  # the SIGTERM above: a clean exit
        assert "event=stopped" in daemon.log()
    finally:
        daemon.kill()
    stats = cache.last_stats
    # Usually the drain's GOAWAY ends the stream (unavailable); under load gRPC sometimes leaves the call
    # open, and the client's deadline ends it (timeout). Either way every row is computed.
    assert stats.fallback_rows == 8 and set(stats.fallbacks) <= {"unavailable", "timeout"} and stats.map_hits == 0
    # The stream was cut short of its last layer.
    assert stats.bytes_fetched < sum(np.asarray(entry.maps, np.float16).nbytes for entry in captured.entries)
    expected = torch.stack([h[-1] for h in plain_hidden(loaded, prompts)]).numpy()
    np.testing.assert_allclose(embeddings, expected, atol=1e-4)


def test_entries_the_byte_cap_evicts_are_never_map_hits_and_cost_no_fallback(tmp_path: Path) -> None:
    loaded = tiny_loaded("bert")
    texts = sentences(2 * STORED, seed=SEED + 1)
    captured = capture_entries(loaded, texts)
    older, newer = captured.entries[:STORED], captured.entries[STORED:]

    def stored_bytes(entries: list) -> int:
        return sum(e.maps.nbytes + e.outputs.nbytes for e in entries)  # fp16 codec: stored as given

    cap = int(0.75 * (stored_bytes(older) + stored_bytes(newer)))  # room for the older batch, not for both
    daemon = DaemonProcess(tmp_path / "store", tmp_path, extra_args=("--max-bytes", str(cap))).start()
    try:
        with daemon.client() as admin:
            admin.create_namespace("default", model=loaded.name, fingerprint=captured.fingerprint,
                                   layout=captured.layout, projector=captured.projector.to_safetensors_bytes())
            older_ids = list(admin.ingest("default", captured.fingerprint, older).entry_ids)
            admin.ingest("default", captured.fingerprint, newer)
            evicted = admin.stats().store_evictions
        assert 0 < evicted < STORED  # the newer batch pushed some of the older one out
        with AttnCache(loaded, f"grpc://{daemon.target}", token=READ_TOKEN, exact=False) as cache:
            embeddings = cache.encode(texts[:STORED])
    finally:
        assert daemon.stop() == 0, daemon.log()
    stats = cache.last_stats
    assert stats.fallbacks == {}  # no row was promised maps that were gone
    assert (stats.map_hits, stats.misses) == (STORED - evicted, evicted)
    assert len(older_ids) == STORED
    expected = torch.stack([h.mean(dim=0) for h in plain_hidden(loaded, texts[:STORED])]).numpy()
    np.testing.assert_allclose(embeddings, expected, atol=2e-3)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_client_made_while_its_daemon_is_down_computes_then_hits_once_the_daemon_is_up(tmp_path: Path) -> None:
    loaded = tiny_loaded("bert")
    exact_texts, map_texts, fresh = sentences(4, seed=21), sentences(3, seed=22), sentences(2, seed=23)
    with AttnStoreService.open(tmp_path / "store", create=True) as service:
        with_outputs = capture_entries(loaded, exact_texts)
        maps_only = capture_entries(loaded, map_texts, outputs=False)  # no stored outputs: map hits only
        service.create_namespace("default", model=loaded.name, fingerprint=with_outputs.fingerprint,
                                 layout=with_outputs.layout)
        service.ingest("default", with_outputs.fingerprint, with_outputs.entries + maps_only.entries)
        service.set_projector("default", with_outputs.projector.to_safetensors_bytes())
    texts = exact_texts + map_texts + fresh
    expected = torch.stack([h.mean(dim=0) for h in plain_hidden(loaded, texts)]).numpy()
    port = _free_port()
    cache = AttnCache(loaded, f"grpc://127.0.0.1:{port}", token=READ_TOKEN, timeout=2.0, exact_cache_bytes=0,
                      breaker=BreakerPolicy(failure_threshold=1, reset_after=0.2))
    with cache:
        down = cache.encode(texts)
        assert cache.last_stats.fallback_rows == len(texts) and cache.last_stats.exact_hits == 0
        np.testing.assert_allclose(down, expected, atol=1e-5)  # the plain model's
        daemon = DaemonProcess(tmp_path / "store", tmp_path, port=port).start()
        try:
            # Within the channel's reconnect backoff (at most 2 s) and the breaker's reset_after,
            # a call uses the store again.
            encoded: list[np.ndarray] = []

            def from_the_store() -> bool:
                encoded.append(cache.encode(texts))
                return not cache.last_stats.fallback_rows

            wait_until(from_the_store, 10.0, lambda: f"a call served from the store ({cache.last_stats.fallbacks})",
                       poll=0.25)
            up = encoded[-1]
        finally:
            assert daemon.stop() == 0, daemon.log()
    stats = cache.last_stats
    assert (stats.exact_hits, stats.map_hits, stats.misses, stats.fallback_rows) == (4, 3, 2, 0)
    np.testing.assert_allclose(up, expected, atol=2e-3)


def test_two_caches_on_one_embedded_store_work_side_by_side_and_share_one_open_store(tmp_path: Path) -> None:
    bert, other = tiny_loaded("bert"), tiny_loaded("bert", seed=1)  # two models: two fingerprints
    texts = sentences(5, seed=31)
    with AttnStoreService.open(tmp_path / "store", create=True) as service:
        fill_namespace(service, bert, texts, namespace="bert")
        fill_namespace(service, other, texts, namespace="other")
    url = f"local:{tmp_path / 'store'}"
    with AttnCache(bert, url, namespace="bert") as first, AttnCache(other, url, namespace="other") as second:
        assert first.connection._service is second.connection._service  # one LMDB environment per process
        first.encode(texts)
        second.encode(texts)
        assert first.last_stats.exact_hits == second.last_stats.exact_hits == len(texts)
        with AttnCache(bert, url, namespace="bert") as third:
            third.encode(texts[:2])
        first.encode(texts[:2], show_progress_bar=False)  # still open after the third closed
        assert first.last_stats.exact_hits == 2  # the store still answers
    with AttnCache(bert, url, namespace="bert") as reopened:  # every cache closed: opened again
        reopened.encode(texts[:1])
        assert reopened.last_stats.exact_hits == 1
