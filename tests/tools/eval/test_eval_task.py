"""``attnstore eval logs|sts|sst2|mmlu``: every variant run, scored and timed against the full model."""

from __future__ import annotations

import json

import numpy as np
import pytest

from attnstore.errors import ConfigError
from attnstore.projector.gate import FidelityGate
from attnstore.service import AttnStoreService
from attnstore_client.projector import Projector
from attnstore_tools.build.command import BuildConfig, build_namespace
from attnstore_tools.build.training import TrainConfig
from attnstore_tools.cli import main
from attnstore_tools.eval.command import EvalConfig, evaluate, format_report
from attnstore_tools.eval.tasks import Task
from tests.support.daemon import READ_TOKEN, DaemonProcess

_COLOURS = ["red", "green", "blue", "black", "white", "brown"]
_ANIMALS = ["cat", "dog", "horse", "bird", "fish"]


def _corpus() -> list[str]:
    return [f"the {c} {a} sat on the mat." for c in _COLOURS for a in _ANIMALS]


def _animal_task(queries: list[str]) -> Task:
    """Classify a sentence's animal by the nearest stored sentence's animal (a logs-like vote with k = 1)."""
    corpus = _corpus()
    gold = np.array([next(a for a in _ANIMALS if a in q) for q in queries])
    stored_animals = np.array([next(a for a in _ANIMALS if a in t) for t in corpus])

    def fit(reference: np.ndarray):
        unit = reference / np.linalg.norm(reference, axis=1, keepdims=True)

        def score(outputs: np.ndarray, mask: np.ndarray | None):
            mask = np.ones(len(queries), dtype=bool) if mask is None else mask
            q = outputs / np.linalg.norm(outputs, axis=1, keepdims=True)
            predicted = stored_animals[np.argmax(q @ unit.T, axis=1)]
            return float((predicted == gold)[mask].mean() * 100), {}

        return score

    return Task(name="logs", metric="accuracy", unit="%", build=corpus, queries=queries, groups=None,
                references=corpus, _fit=fit)


@pytest.fixture(scope="module")
def store(tmp_path_factory, minilm_model):
    path = tmp_path_factory.mktemp("eval") / "store"
    with AttnStoreService.open(path, create=True) as service:
        build_namespace(minilm_model, _corpus(), service,
                        BuildConfig(namespace="ns", train=TrainConfig(max_epochs=2, patience=1)), progress=False)
    return path


def test_evaluate_scores_and_times_every_variant_and_splits_exact_duplicates(minilm_model, store):
    duplicates = _corpus()[:6]
    fresh = [f"one {c} {a} slept under the old mat." for c in ("grey", "pink") for a in _ANIMALS]
    task = _animal_task(duplicates + fresh)
    config = EvalConfig(thresholds=(0.0, 0.008), default_threshold=0.008, batch_size=8, timing_queries=8,
                        timing_rounds=2, attncache_f=(0.5,), san_shares=(0.5,), progress=False)
    report = evaluate(task, minilm_model, f"local:{store}", "ns", config)

    assert report["kind"] == "attnstore.eval/1" and report["queries"] == 16
    methods = [(row["method"], row["setting"]) for row in report["rows"]]
    assert methods[:6] == [("sentence_transformers", None), ("dict_cache", None), ("output_cache", None),
                           ("attncache", 0.0), ("attncache", 0.008), ("lazyformer", None)]
    assert [m for m, _ in methods[6:]] == ["san", "attncache_f"]
    [default] = [row for row in report["rows"] if row["default"]]
    assert default["setting"] == 0.008
    rows = {row["method"]: row for row in report["rows"]}
    # The simple alternatives: sentence-transformers itself, and a dict of the build corpus in front of it.
    assert rows["sentence_transformers"]["cosine"]["mean"] > 0.9999
    assert (rows["dict_cache"]["exact_hits"], rows["dict_cache"]["cosine"]["mean"] > 0.9999) == (6, True)
    output_cache = rows["output_cache"]
    # Stored sentences are exact hits (fp16 stored outputs); the rest are computed as the full model does.
    assert (output_cache["exact_hits"], output_cache["map_hits"]) == (6, 0)
    assert output_cache["parts"]["exact_dup"]["queries"] == 6 and output_cache["parts"]["rest"]["queries"] == 10
    assert output_cache["parts"]["rest"]["cosine_mean"] == pytest.approx(1.0, abs=1e-6)
    assert output_cache["parts"]["exact_dup"]["cosine_mean"] > 0.999
    assert output_cache["metric"] == report["full"]["metric"]
    lazy = rows["lazyformer"]
    assert lazy["layer_replays"] == 16 * 3  # 6 layers: 1, 3 and 5 reuse, every row
    assert lazy["cosine"]["mean"] < 0.999  # sharing maps across layers is not free
    for row in report["rows"]:
        assert row["time_s"]["total"] > 0 and row["speedup"]["e2e_incl"] > 0
        assert row["speedup"]["e2e_excl"] >= row["speedup"]["e2e_incl"]
    assert report["options"]["san"]["calibration_inputs"] == 30
    json.dumps(report)  # JSON-ready: no NaN, no numpy scalars
    assert "output_cache" in format_report(report)


def test_evaluate_against_a_daemon_serves_the_same_exact_hits_and_skips_only_attncache_f(
    minilm_model, store, tmp_path
):
    task = _animal_task(_corpus()[:6] + [f"one grey {a} slept under the old mat." for a in _ANIMALS])
    config = EvalConfig(thresholds=(0.0,), default_threshold=0.0, batch_size=8, timing_queries=4, timing_rounds=1,
                        san_shares=(0.5,), progress=False)
    daemon = DaemonProcess(store, tmp_path).start()
    try:
        report = evaluate(task, minilm_model, f"grpc://{daemon.target}", "ns", config, token=READ_TOKEN)
    finally:
        assert daemon.stop() == 0, daemon.log()
    methods = [row["method"] for row in report["rows"]]
    # AttnCache-f reads maps in process only.
    assert methods == ["sentence_transformers", "dict_cache", "output_cache", "attncache", "lazyformer", "san"]
    output_cache = report["rows"][2]
    assert output_cache["exact_hits"] == 6 and output_cache["fallbacks"] == 0
    assert report["store"] == {"url": f"grpc://{daemon.target}", "namespace": "ns"}


def test_eval_config_refuses_negative_thresholds_naming_the_option():
    with pytest.raises(ConfigError, match="--thresholds"):
        EvalConfig(thresholds=(0.002, -0.004))
    with pytest.raises(ConfigError, match="--default-threshold"):
        EvalConfig(default_threshold=-1.0)


def test_eval_mmlu_refuses_an_encoder_naming_the_fix(tmp_path, capsys):
    code = main(["eval", "mmlu", "--model", "minilm", "--json", str(tmp_path / "x.json")])
    assert code == 2
    assert "decoder" in capsys.readouterr().err


def test_a_gated_namespace_is_evaluated_under_its_gate_by_default_also_through_a_daemon(minilm_model, tmp_path):
    path = tmp_path / "store"
    with AttnStoreService.open(path, create=True) as service:
        build_namespace(minilm_model, _corpus(), service,
                        BuildConfig(namespace="ns", train=TrainConfig(max_epochs=1, patience=1), calibration=None),
                        progress=False)
        projector = Projector.from_safetensors_bytes(service.get_namespace("ns").projector)
        # Trusts a candidate only when no token differs: the gate serves exactly the stored sentences.
        projector.gate = FidelityGate(weights=(0.0, 0.0, 0.0, 0.0, -20.0, 0.0), bias=10.0, min_probability=0.5,
                                      candidates=4, fidelity=0.99, precision=0.95)
        service.set_projector("ns", projector.to_safetensors_bytes())
    task = _animal_task(_corpus()[:4] + [f"one grey {a} slept under the old mat." for a in _ANIMALS])
    config = EvalConfig(thresholds=(0.0,), batch_size=8, timing_queries=4, timing_rounds=1, baselines=False,
                        progress=False)
    daemon = DaemonProcess(path, tmp_path).start()
    try:
        report = evaluate(task, minilm_model, f"grpc://{daemon.target}", "ns", config, token=READ_TOKEN)
    finally:
        assert daemon.stop() == 0, daemon.log()
    rows = {(row["method"], row["setting"]): row for row in report["rows"]}
    assert list(rows)[:4] == [("sentence_transformers", None), ("dict_cache", None), ("output_cache", None),
                              ("attncache", None)]
    gated = rows[("attncache", None)]
    assert gated["default"] and report["default_rule"] == "gate"
    assert (gated["exact_hits"], gated["map_hits"], gated["fallbacks"]) == (4, 0, 0)
    assert "attncache" in format_report(report)


def test_variants_that_run_token_rows_tokenize_inside_their_timed_call(minilm_model, store):
    from attnstore_client.adapters import adapter_for
    from attnstore_client.cache import AttnCache
    from attnstore_client.sentence.heads import sentence_head
    from attnstore_tools.eval.variants import CacheVariant, PlainVariant, Queries

    head = sentence_head(minilm_model)
    tokenized: list[int] = []

    def tokenize(rows: list[str]) -> list[list[int]]:
        tokenized.append(len(rows))
        return head.tokenize(rows, None)[0]

    texts = _corpus()[:5]
    queries = Queries(texts=texts, ids=tokenize(texts), pad_id=minilm_model.tokenizer.pad_token_id, batch_size=4,
                      tokenize=tokenize)
    tokenized.clear()
    with AttnCache(minilm_model, f"local:{store}", namespace="ns") as cache:
        plain = PlainVariant(adapter_for(minilm_model)).embed(queries, [0, 2, 4], head)
        cached = CacheVariant(cache, 0.0, maps=False).embed(queries, [0, 2, 4], head)
    assert tokenized == [3, 3]  # the plain model's and the cache's calls each tokenized their three texts
    np.testing.assert_allclose(cached.embeddings, plain.embeddings, atol=1e-3)  # stored outputs are fp16


def test_each_cache_variant_keeps_its_own_cost_model(minilm_model, store):
    from attnstore_client.cache import AttnCache
    from attnstore_client.sentence.heads import sentence_head
    from attnstore_tools.eval.variants import CacheVariant, Queries

    head = sentence_head(minilm_model)
    texts = [f"a {c} {a} ran past the old house." for c in _COLOURS for a in _ANIMALS]

    def tokenize(rows: list[str]) -> list[list[int]]:
        return head.tokenize(rows, None)[0]

    queries = Queries(texts=texts, ids=tokenize(texts), pad_id=minilm_model.tokenizer.pad_token_id, batch_size=8,
                      tokenize=tokenize)
    with AttnCache(minilm_model, f"local:{store}", namespace="ns") as cache:
        looked_up, output_cache = CacheVariant(cache, 0.0), CacheVariant(cache, 0.0, maps=False)
        looked_up.embed(queries, range(len(texts)), head)
        before = looked_up.cost_model.estimates()
        output_cache.embed(queries, range(len(texts)), head)  # its forwards go to its own model
        assert looked_up.cost_model.estimates() == before
        assert output_cache.cost_model.estimates() != before and cache.cost_model is output_cache.cost_model
