"""``AttnCache``: encode and choice scoring equal the plain model, whatever the store does."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from attnstore.errors import (
    ConfigError,
    FingerprintMismatchError,
    UnsupportedModelError,
)
from attnstore.index import ExactIndex
from attnstore.service import AttnStoreService
from attnstore.store import MemoryMapStore
from attnstore_client.adapters import adapter_for
from attnstore_client.adapters.batch import tokenize
from attnstore_client.cache import PROMPT_EOL, AttnCache
from attnstore_client.connection.local import LocalConnection
from attnstore_client.projector import Projector, ProjectorConfig
from attnstore_client.resilience import BreakerPolicy, RetryPolicy
from attnstore_client.settings import CacheOptions, CacheSettings
from attnstore_client.stats import CacheStats
from tests.support.caches import capture_entries, fill_namespace, mean_pooled, plain_hidden, sentences, tiny_loaded
from tests.support.daemon import READ_TOKEN, DaemonProcess
from tests.support.server_fixtures import served
from tests.support.wait import wait_until

TEXTS = sentences(10, seed=7)
STORED = TEXTS[:6]  # the rest are misses
TOLERANCE = 2e-3  # fp16 maps and outputs


@pytest.fixture(scope="module")
def bert():
    return tiny_loaded("bert")


@pytest.fixture(scope="module")
def llama():
    return tiny_loaded("llama")


def _memory_service() -> AttnStoreService:
    return AttnStoreService(MemoryMapStore(), make_index=ExactIndex)


@pytest.fixture(scope="module")
def bert_service(bert) -> AttnStoreService:
    service = _memory_service()
    fill_namespace(service, bert, STORED)
    return service


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("stream", [True, False])
def test_encode_equals_the_plain_model_on_hits_and_misses(bert, bert_service, exact: bool, stream: bool) -> None:
    cache = AttnCache(bert, LocalConnection("local:memory", bert_service), exact=exact, stream=stream)
    embeddings = cache.encode(TEXTS, batch_size=4)
    np.testing.assert_allclose(embeddings, mean_pooled(bert, TEXTS), atol=TOLERANCE)
    stats = cache.last_stats
    assert (stats.exact_hits, stats.map_hits) == ((6, 0) if exact else (0, 6))
    assert stats.misses == 4 and stats.fallback_rows == 0 and stats.hit_rate == 0.6


def test_encode_over_grpc_equals_the_plain_model_and_counts_bytes(bert, bert_service) -> None:
    with served(bert_service) as (_, remote), AttnCache(bert, f"grpc://{remote.target}", exact=False) as cache:
        embeddings = cache.encode(TEXTS, batch_size=4)
    np.testing.assert_allclose(embeddings, mean_pooled(bert, TEXTS), atol=TOLERANCE)
    stats = cache.last_stats
    assert stats.map_hits == 6 and stats.misses == 4
    maps_bytes = sum(3 * 4 * len(t.split()) ** 2 * 2 for t in STORED)  # layers x heads x L^2 fp16
    assert stats.bytes_fetched == maps_bytes
    assert stats.total_s >= stats.forward_s > 0 and stats.lookup_s > 0 and stats.projection_s > 0


def test_encode_takes_sentence_transformers_keywords_and_refuses_others_naming_the_valid_ones(
    bert, bert_service
) -> None:
    cache = AttnCache(bert, LocalConnection("local:memory", bert_service))
    one = cache.encode(TEXTS[0])
    assert one.shape == (64,) and isinstance(one, np.ndarray)
    tensor = cache.encode(TEXTS[:3], convert_to_tensor=True, normalize_embeddings=True)
    assert tensor.shape == (3, 64) and torch.allclose(tensor.norm(dim=1), torch.ones(3))
    rows = cache.encode(sentences=TEXTS[:3], convert_to_numpy=False)
    assert isinstance(rows, list) and len(rows) == 3 and rows[0].shape == (64,)
    assert cache.encode(TEXTS[:3], truncate_dim=8).shape == (3, 8)
    tokens = cache.encode(TEXTS[:2], output_value="token_embeddings")
    assert [t.shape for t in tokens] == [(len(text.split()), 64) for text in TEXTS[:2]]
    binary = cache.encode(TEXTS[:3], precision="ubinary")
    assert binary.dtype == np.uint8 and binary.shape == (3, 8)
    with pytest.raises(ConfigError, match=r"output_value must be one of"):
        cache.encode(TEXTS, output_value="logits")
    with pytest.raises(ConfigError, match="batch_size"):
        cache.encode(TEXTS, batch_size=0)
    with pytest.raises(ConfigError, match=r"unexpected keyword arguments \['convert_to'\].*'convert_to_numpy'"):
        cache.encode(TEXTS, convert_to="numpy")
    with pytest.raises(ConfigError, match=r"prompt_name 'query' is not one of this model's prompts \[\]"):
        cache.encode(TEXTS, prompt_name="query")


def test_stats_of_calls_add_up_to_the_cumulative_stats(bert, bert_service) -> None:
    cache = AttnCache(bert, LocalConnection("local:memory", bert_service))
    cache.encode(TEXTS[:5])
    first = cache.last_stats
    cache.encode(TEXTS[5:])
    assert cache.stats.rows == 10 and cache.stats.exact_hits == 6 and cache.stats.misses == 4
    assert cache.stats == first + cache.last_stats
    assert "6 exact hits" in cache.stats.summary() and cache.stats.to_json_dict()["hit_rate"] == 0.6
    cache.reset_stats()
    assert cache.stats == CacheStats()


def test_decoder_encode_uses_prompteol_and_the_last_token(llama) -> None:
    service = _memory_service()
    templated = [PROMPT_EOL.format(text=t) for t in TEXTS]
    # The template's own words are not in the tiny vocabulary: they become [UNK], which is fine.
    fill_namespace(service, llama, templated[:6])
    cache = AttnCache(llama, LocalConnection("local:memory", service), exact=False)
    embeddings = cache.encode(TEXTS, batch_size=4)
    expected = torch.stack([h[-1] for h in plain_hidden(llama, templated)]).numpy()
    np.testing.assert_allclose(embeddings, expected, atol=TOLERANCE)
    assert cache.last_stats.map_hits == 6 and cache.family == "llama"


def test_score_choices_equals_the_plain_models_next_token_choice(llama) -> None:
    service = _memory_service()
    fill_namespace(service, llama, TEXTS[:6])
    cache = AttnCache(llama, LocalConnection("local:memory", service))
    choices = ("w10", "w11", "w12")
    scores = cache.score_choices(TEXTS, choices=choices, batch_size=3)
    ids = [llama.tokenizer.convert_tokens_to_ids(c) for c in choices]
    with torch.inference_mode():
        logits = torch.stack([llama.lm_head(h[-1])[ids] for h in plain_hidden(llama, TEXTS)])
    expected = torch.softmax(logits, dim=-1).numpy()
    np.testing.assert_allclose(scores.probabilities, expected, atol=TOLERANCE)
    assert (scores.index == expected.argmax(axis=1)).all()
    assert cache.last_stats.exact_hits == 6
    with pytest.raises(ConfigError, match="2 tokens"):
        cache.score_choices(TEXTS, choices=("w10", "w11 w12"))


def test_a_prompt_in_segments_is_scored_as_its_segments_tokens_one_after_the_other(llama) -> None:
    service = _memory_service()
    fill_namespace(service, llama, TEXTS[:2])
    cache = AttnCache(llama, LocalConnection("local:memory", service), exact_cache_bytes=0)
    segmented = [["w2 w3", "w20 w21 w22", "w7"], ["w2 w3", "w7"]]
    joined = [" ".join(prompt) for prompt in segmented]  # the word tokenizer splits on spaces: the same tokens
    got = cache.score_choices(segmented, choices=("w10", "w11"))
    assert cache.last_row_kinds == ("miss", "miss")
    expected = cache.score_choices(joined, choices=("w10", "w11")).probabilities
    np.testing.assert_allclose(got.probabilities, expected, atol=1e-6)
    with pytest.raises(ConfigError, match="non-empty list of strings"):
        cache.score_choices([[]], choices=("w10", "w11"))


def test_score_choices_needs_a_decoder(bert, bert_service) -> None:
    cache = AttnCache(bert, LocalConnection("local:memory", bert_service))
    with pytest.raises(UnsupportedModelError, match="encoder"):
        cache.score_choices(TEXTS, choices=("w3", "w4"))


def test_a_namespace_of_another_model_is_refused_on_connect_with_a_clear_message(bert_service) -> None:
    other = tiny_loaded("bert", seed=1)
    with pytest.raises(FingerprintMismatchError) as caught:
        AttnCache(other, LocalConnection("local:memory", bert_service))
    message = str(caught.value)
    assert "tiny-bert" in message and "different model, tokenizer or weights" in message


def test_a_namespace_without_projector_serves_exact_hits_and_nothing_is_projected(bert) -> None:
    service = _memory_service()
    captured = capture_entries(bert, STORED)
    service.create_namespace("default", model="tiny-bert", fingerprint=captured.fingerprint, layout=captured.layout)
    service.ingest("default", captured.fingerprint, captured.entries)
    cache = AttnCache(bert, LocalConnection("local:memory", service))
    np.testing.assert_allclose(cache.encode(TEXTS, batch_size=4), mean_pooled(bert, TEXTS), atol=TOLERANCE)
    stats = cache.last_stats
    assert (stats.exact_hits, stats.map_hits, stats.misses) == (6, 0, 4) and stats.projection_s == 0


def test_bad_options_are_config_errors(bert, bert_service) -> None:
    connection = LocalConnection("local:memory", bert_service)
    for options in ({"max_distance": -1.0}, {"timeout": 0}, {"max_length": 0}):
        with pytest.raises(ConfigError):
            AttnCache(bert, connection, **options)


def test_a_misspelt_setting_is_refused_naming_it_and_the_settings(bert, bert_service) -> None:
    connection = LocalConnection("local:memory", bert_service)
    with pytest.raises(ConfigError, match=r"unexpected keyword arguments \['timout'\].*'timeout'"):
        AttnCache(bert, connection, timout=5.0)  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match=r"CacheSettings: exact_cache_bytes must be an int >= 0, got -1"):
        CacheSettings(exact_cache_bytes=-1)


def test_a_plain_cache_uses_the_settings_defaults_and_keywords_replace_single_values(bert, bert_service) -> None:
    connection = LocalConnection("local:memory", bert_service)
    assert set(CacheOptions.__annotations__) == {field.name for field in dataclasses.fields(CacheSettings)}
    with AttnCache(bert, connection) as plain:
        assert plain.settings == CacheSettings()
        assert (plain.exact, plain.maps, plain.prefix, plain.packed, plain.chunks) == (True, True, True, True, None)
        assert plain.local_tier.capacity_bytes == CacheSettings().exact_cache_bytes
        assert plain.cost_model.settings == CacheSettings().cost and plain.write_back is None
    given = CacheSettings(timeout=5.0, exact=False)
    with AttnCache(bert, connection, "default", given, exact_cache_bytes=0) as cache:
        assert cache.settings == CacheSettings(timeout=5.0, exact=False, exact_cache_bytes=0)
        tiers = cache._prefill.tiers
        cache.exact, cache.max_distance = True, 0.5  # the next call reads them; the tiers stay as they were
        assert cache.settings.exact and cache.settings.max_distance == 0.5 and cache._prefill.tiers is tiers
        with pytest.raises(dataclasses.FrozenInstanceError):
            cache._context.write_back = None  # type: ignore[misc]


def test_outage_falls_back_to_compute_and_the_breaker_stops_asking(bert, bert_service) -> None:
    with served(bert_service) as (server, remote):
        # No node-local exact tier: every call must go to the store (or the breaker).
        cache = AttnCache(bert, f"grpc://{remote.target}", timeout=2.0, exact_cache_bytes=0,
                          retry=RetryPolicy(attempts=2, initial_backoff=0.01),
                          breaker=BreakerPolicy(failure_threshold=2, reset_after=60.0))
        server.stop(0)  # the daemon goes away after the client connected
        expected = mean_pooled(bert, TEXTS)
        for _ in range(2):
            np.testing.assert_allclose(cache.encode(TEXTS, batch_size=10), expected, atol=TOLERANCE)
            assert cache.last_stats.fallbacks == {"unavailable": 10}
        assert cache.breaker.state == "open"
        np.testing.assert_allclose(cache.encode(TEXTS, batch_size=10), expected, atol=TOLERANCE)
        assert cache.last_stats.fallbacks == {"circuit_open": 10}
        assert cache.last_stats.lookup_s == 0 and cache.last_stats.projection_s == 0
        cache.close()


def test_half_open_breaker_uses_the_store_again_once_it_is_back(bert, tmp_path: Path) -> None:
    # A daemon process, as users run one: a gRPC server stopped inside the client's own process once left this
    # test's Lookup waiting past both its deadline and the client's cancel (one gRPC core for both ends).
    with AttnStoreService.open(tmp_path / "store", create=True) as service:
        fill_namespace(service, bert, STORED)
    daemon = DaemonProcess(tmp_path / "store", tmp_path).start()
    port = daemon.port
    cache = AttnCache(bert, f"grpc://{daemon.target}", token=READ_TOKEN, timeout=2.0, retry=RetryPolicy(attempts=1),
                      breaker=BreakerPolicy(failure_threshold=1, reset_after=0.2), exact_cache_bytes=0)
    daemon.kill()
    cache.encode(TEXTS, batch_size=10)
    assert cache.breaker.state in ("open", "half_open") and cache.last_stats.fallbacks == {"unavailable": 10}
    daemon = DaemonProcess(tmp_path / "store", tmp_path, port=port).start()  # back, on the same port
    try:
        wait_until(lambda: cache.breaker.state == "half_open", 10, "the breaker half-open (past reset_after)")
        # The trial call succeeds once the channel has reconnected (its backoff is at most 2 s).
        encoded: list[np.ndarray] = []

        def closed() -> bool:
            encoded.append(cache.encode(TEXTS, batch_size=10))
            return cache.breaker.state == "closed"

        wait_until(closed, 10.0, lambda: f"the breaker closed by a trial call ({cache.last_stats.fallbacks})",
                   poll=0.25)
        embeddings = encoded[-1]
        assert cache.last_stats.exact_hits == 6
        np.testing.assert_allclose(embeddings, mean_pooled(bert, TEXTS), atol=TOLERANCE)
    finally:
        cache.close()
        daemon.stop()


def _flip_layer_bytes(store: Path, layer_maps: np.ndarray) -> None:
    """Bit rot: flip one byte in the middle of a stored layer, wherever it lies in the LMDB file."""
    needle = layer_maps.astype(np.float16).tobytes()
    (data_file,) = store.glob("*/data.mdb")
    content = data_file.read_bytes()
    offset = content.find(needle)
    assert offset >= 0, "the layer is not in the file"
    with data_file.open("r+b") as handle:
        while offset >= 0:
            handle.seek(offset + len(needle) // 2)
            handle.write(bytes([content[offset + len(needle) // 2] ^ 0x40]))
            offset = content.find(needle, offset + 1)


@pytest.mark.parametrize("over", ["local", "grpc"])
def test_a_corrupt_stored_layer_is_a_checksum_fallback_with_correct_outputs(bert, tmp_path: Path, over: str) -> None:
    path = tmp_path / "store"
    with AttnStoreService.open(path, create=True) as service:
        fill_namespace(service, bert, STORED)
    maps = adapter_for(bert).capture(tokenize(bert.tokenizer, [STORED[2]])).maps[0]  # (layers, H, L, L)
    _flip_layer_bytes(path, maps[1].numpy())
    expected = mean_pooled(bert, TEXTS)
    if over == "local":
        with AttnCache(bert, f"local:{path}", exact=False) as cache:
            embeddings = cache.encode(TEXTS, batch_size=10)
    else:
        with AttnStoreService.open(path, readonly=True) as service, served(service) as (_, remote):
            with AttnCache(bert, f"grpc://{remote.target}", exact=False) as cache:
                embeddings = cache.encode(TEXTS, batch_size=10)
    np.testing.assert_allclose(embeddings, expected, atol=TOLERANCE)
    assert cache.last_stats.fallbacks == {"checksum": 1} and cache.last_stats.map_hits == 5


def test_a_client_follows_a_replaced_projector_without_being_recreated(bert) -> None:
    service = _memory_service()
    fill_namespace(service, bert, STORED)
    expected = mean_pooled(bert, TEXTS)
    with served(service) as (_, remote):
        cache = AttnCache(bert, f"grpc://{remote.target}", exact=False, max_distance=1e-6)
        cache.encode(TEXTS, batch_size=10)
        assert cache.last_stats.map_hits == len(STORED)
        # An admin replaces the projector (explicitly: a plain set_projector is refused) and ingests again.
        torch.manual_seed(1)
        new = Projector(ProjectorConfig(hidden=adapter_for(bert).hidden_size)).eval()
        captured = capture_entries(bert, STORED, projector=new)
        assert service.set_projector("default", new.to_safetensors_bytes(), replace=True).projector_version == 2
        service.ingest("default", captured.fingerprint, captured.entries, projector_version=2)
        # Before: every lookup of this client was refused and its breaker opened. Now it loads the new
        # projector on the first refusal and projects the batch again.
        np.testing.assert_allclose(cache.encode(TEXTS, batch_size=10), expected, atol=TOLERANCE)
        assert cache.last_stats.map_hits == len(STORED) and not cache.last_stats.fallbacks
        assert cache.breaker.state == "closed"
        cache.close()
