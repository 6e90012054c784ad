"""Any other model still works (issue 49, item 2): ``AttnCache`` on a model without an adapter.

Tiny random ``deberta-v2`` and ``electra`` encoders saved as sentence-transformers
folders with all-MiniLM-L6-v2's tokenizer: over an exact-tier namespace, rows the
cache computes and rows its exact tiers serve equal ``SentenceTransformer.encode``;
write-back through a real daemon stores outputs only and another cache is served
from the store's exact tier; ``cache.tiers`` says which tiers are absent and why;
``attnstore build`` on such a model builds an exact-tier store; a decoder without an adapter (``gemma2``) scores
through its own forward.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer

from attnstore.service import AttnStoreService
from attnstore_client.cache import AttnCache
from attnstore_client.models import LoadedModel, load_model
from attnstore_tools.admin.cold_start import create_exact_namespace
from attnstore_tools.build.command import BuildConfig, build_namespace, format_report
from tests.support.adapters import save_tiny_family
from tests.support.daemon import ADMIN_TOKEN, READ_TOKEN, WRITE_TOKEN, DaemonProcess
from tests.support.nodes import tiny_store
from tests.support.vectors import row_cosines

FAMILIES = ("deberta-v2", "electra")
TEXTS = [
    "Failed password for invalid user admin from 10.0.0.1 port 22 ssh2",
    "A man is playing a guitar.",
    "ok",
    "Receiving block blk_-1608999687919862906 src: /10.250.19.102:54106 dest: /10.250.19.102:50010",
    "A man is playing a guitar.",
    "the quick brown fox",
]
WHY = "no adapter for model_type {!r}: map replay, packed forwards, prefix and chunk tiers need one"


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    folder = save_tiny_family(request.param, tmp_path_factory.mktemp(request.param) / "model", pooling="mean")
    return request.param, folder


@pytest.fixture(scope="module")
def loaded(family: tuple[str, Path]) -> LoadedModel:
    return load_model(str(family[1]))


@pytest.fixture(scope="module")
def expected(family: tuple[str, Path]) -> np.ndarray:
    return SentenceTransformer(str(family[1]), device="cpu").encode(TEXTS)


def test_computed_rows_and_exact_hits_equal_sentence_transformers(
    family: tuple[str, Path], loaded: LoadedModel, expected: np.ndarray, tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="attnstore_client.cache"):
        cache = AttnCache(str(family[1]), store=tiny_store(tmp_path / "store", loaded))
    with cache:
        lines = [r.getMessage() for r in caplog.records if "runs through its own forward" in r.getMessage()]
        assert lines == [f"model {str(family[1])!r} runs through its own forward: exact tiers and write-back only"
                         f" ({WHY.format(family[0])})"]
        first = cache.encode(TEXTS, batch_size=4)
        assert row_cosines(first, expected).min() >= 0.9999
        stats = cache.last_stats
        assert (stats.misses, stats.deduplicated, stats.map_hits, stats.forwarded_tokens > stats.forward_tokens) == (
            5, 1, 0, True)  # padded, length-sorted forwards: padding is forwarded
        cache.encode(TEXTS, batch_size=4)  # this process's exact tier keeps a row the second time it is offered
        second = cache.encode(TEXTS[::-1], batch_size=4)  # ... and serves every row from then on
        assert cache.last_stats.exact_hits == 5 and cache.last_stats.misses == 0
        assert set(cache.last_row_kinds) == {"exact"}
        assert row_cosines(second, expected[::-1]).min() >= 0.9999


def test_cache_tiers_says_what_is_absent_and_why(family: tuple[str, Path], loaded: LoadedModel, tmp_path: Path) -> None:
    with AttnCache(loaded, store=tiny_store(tmp_path / "store", loaded)) as cache:
        tiers = cache.tiers
        assert cache.family == "generic"
        assert tiers.exact and not (tiers.maps or tiers.prefix or tiers.chunks or tiers.packed or tiers.write_back)
        why = WHY.format(family[0])
        assert tiers.absent["maps"] == tiers.absent["prefix"] == tiers.absent["chunks"] == why
        assert tiers.absent["packed"] == why + "; forwards run length-sorted padded batches"
        assert tiers.present == ("exact",)
        assert str(tiers).startswith(
            f"exact; absent: write_back (off in the settings (write_back=False)); maps ({why})")
        cache.exact = False
        assert cache.tiers.absent["exact"] == "off in the settings (exact=False)"


def test_a_family_adapter_has_every_tier_its_model_allows(tmp_path: Path) -> None:
    loaded = load_model(str(save_tiny_family("bert", tmp_path / "bert", pooling="mean")))
    with AttnCache(loaded, store=tiny_store(tmp_path / "store", loaded)) as cache:
        tiers = cache.tiers
        assert tiers.exact and tiers.packed and not tiers.maps
        assert tiers.absent["maps"] == "the namespace has no projector yet (attnstore admin train-projector)"
        assert tiers.absent["prefix"].startswith("a bidirectional model")


def test_build_makes_an_exact_tier_store_the_cache_serves(
    family: tuple[str, Path], loaded: LoadedModel, expected: np.ndarray, tmp_path: Path,
) -> None:
    with AttnStoreService.open(tmp_path / "store", create=True) as service:
        report = build_namespace(loaded, TEXTS, service, BuildConfig(batch_size=4), progress=False)
        namespace = service.get_namespace("default")
        assert namespace.projector is None and report.train is None
    assert (report.entries, report.duplicates, report.exact_only) == (5, 1, WHY.format(family[0]))
    assert "an exact-tier store (outputs only, no maps or projector: no map hits)" in format_report(report)
    with AttnCache(str(family[1]), store=f"local:{tmp_path / 'store'}", exact_cache_bytes=0) as cache:
        served = cache.encode(TEXTS)
        assert cache.last_stats.exact_hits == 5 and cache.last_stats.local_hits == 0
        assert row_cosines(served, expected).min() >= 0.9999
    with AttnStoreService.open(tmp_path / "store") as service:  # a second build adds only what is new
        again = build_namespace(loaded, [*TEXTS, "one more line"], service, BuildConfig(), progress=False)
    assert (again.entries, again.duplicates) == (1, 6)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    workdir = tmp_path_factory.mktemp("generic-write-back")
    process = DaemonProcess(workdir / "store", workdir, extra_args=("--admit-after", "1")).start()
    yield process
    assert process.stop() == 0, process.log()


def test_write_back_through_a_real_daemon_serves_another_cache_from_the_stores_exact_tier(
    family: tuple[str, Path], loaded: LoadedModel, expected: np.ndarray, daemon: DaemonProcess,
) -> None:
    namespace = family[0]
    with daemon.client(ADMIN_TOKEN) as admin:
        create_exact_namespace(admin, loaded, namespace)
    url = f"grpc://{daemon.target}"
    with AttnCache(str(family[1]), store=url, namespace=namespace, token=WRITE_TOKEN, write_back=True) as writer:
        assert writer.tiers.write_back and not writer.tiers.maps
        computed = writer.encode(TEXTS)
        assert writer.last_stats.misses == 5
        assert writer.write_back is not None
        writer.write_back.flush(30.0)
        written = writer.write_back.stats()
    assert (written.stored, written.maps_stored, written.queued_maps) == (5, 0, 0)  # outputs only: no maps to keep
    assert row_cosines(computed, expected).min() >= 0.9999
    with AttnCache(str(family[1]), store=url, namespace=namespace, token=READ_TOKEN, exact_cache_bytes=0) as reader:
        served = reader.encode(TEXTS)
        stats = reader.last_stats
    assert (stats.exact_hits, stats.local_hits, stats.misses) == (5, 0, 0)
    assert row_cosines(served, expected).min() >= 0.9999


def test_a_decoder_without_an_adapter_scores_through_its_own_forward(tmp_path: Path) -> None:
    """Gemma 2 (``gemma2``) has no adapter: its prompts' last states are the plain model's and it scores."""
    loaded = load_model(str(save_tiny_family("gemma2", tmp_path / "gemma")))
    assert loaded.lm_head is not None
    prompts = ["The answer is", "Question: is the sky blue? Answer:", "ok"]
    with AttnCache(loaded, store=tiny_store(tmp_path / "store", loaded)) as cache:
        assert cache.family == "generic" and cache.adapter.causal
        assert cache.tiers.absent["prefix"] == WHY.format("gemma2")
        states = cache.last_hidden_states(prompts)
        scores = cache.score_choices(prompts, choices=("a", "b"))
    for prompt, state in zip(prompts, states, strict=True):
        ids = torch.tensor([loaded.tokenizer(prompt)["input_ids"]])
        with torch.no_grad():
            plain = loaded.model(input_ids=ids).last_hidden_state[0, -1]  # (hidden,)
        torch.testing.assert_close(state, plain, atol=1e-5, rtol=1e-5)
    assert scores.probabilities.shape == (3, 2) and np.allclose(scores.probabilities.sum(axis=1), 1.0, atol=1e-5)
