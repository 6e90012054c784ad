"""``attnstore eval oracle``: oracle search, picks, calibration, parts, report and bad input."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from attnstore.errors import CorpusError, NamespaceNotFoundError, NamespaceNotReadyError
from attnstore.protocol.records import NamespaceLayout
from attnstore.service import AttnStoreService
from attnstore_client.adapters import adapter_for
from attnstore_client.keys import model_fingerprint
from attnstore_client.models import LoadedModel
from attnstore_tools.build.command import BuildConfig, build_namespace
from attnstore_tools.build.training import TrainConfig, map_distances
from attnstore_tools.eval.oracle import command as eval_oracle
from attnstore_tools.eval.oracle import corpora as eval_corpora
from attnstore_tools.eval.oracle.command import OracleConfig, evaluate_oracle
from attnstore_tools.eval.oracle.fidelity import prepare_queries
from attnstore_tools.eval.oracle.search import entry_sources, key_picks, oracle_picks
from attnstore_tools.eval.oracle.thresholds import QueryResult, Scored, calibrate, calibration_split, summarise

_QUICK = TrainConfig(max_epochs=3, patience=1)
_COLOURS = ["red", "green", "blue", "black", "white", "brown"]
_ANIMALS = ["cat", "dog", "horse", "bird", "fish"]
CORPUS = [f"the {c} {a} sat on the mat." for c in _COLOURS for a in _ANIMALS] + [
    f"a {c} {a} runs in the park today." for c in _COLOURS for a in _ANIMALS
]
STORED = CORPUS[:50]
# Five stored rows (exact duplicates), five held-out rows, and two near-duplicates.
QUERIES = CORPUS[45:] + ["the red cat sat on a mat.", "a green dog runs in the park now."]


def _prompt(a: int, b: int, pad: int) -> str:
    return (
        "The following are multiple choice questions (with answers) about arithmetic.\n\n"
        + "please " * pad + f"what is {a} plus {b}?\nA. {a + b}\nB. {a - b}\nC. {a * b}\nD. {b}\nAnswer:"
    )


PROMPTS = [_prompt(a, b, a % 3) for a in range(2, 9) for b in range(2, 7)]


@pytest.fixture(scope="module")
def minilm_store(minilm_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("eval") / "store"
    with AttnStoreService.open(path, create=True) as service:
        build_namespace(minilm_model, STORED, service, BuildConfig(namespace="ns", train=_QUICK), progress=False)
    return path


@pytest.fixture
def service(minilm_store):
    """The minilm store, read-only, open for one test (the command opens it itself)."""
    with AttnStoreService.open(minilm_store, readonly=True) as opened:
        yield opened


@pytest.fixture(scope="module")
def tiny_decoder(minilm_model):
    """A random two-layer Llama over MiniLM's tokenizer (its ids fit the vocabulary), with an LM head."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(minilm_model.tokenizer), hidden_size=32, intermediate_size=48,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    causal_lm = LlamaForCausalLM(config).eval()
    return LoadedModel("tiny-llama", causal_lm.get_decoder(), minilm_model.tokenizer, causal_lm.lm_head)


@pytest.fixture(scope="module")
def decoder_store(tiny_decoder, tmp_path_factory):
    path = tmp_path_factory.mktemp("eval") / "decoder"
    with AttnStoreService.open(path, create=True) as service:
        build_namespace(tiny_decoder, PROMPTS[::2], service, BuildConfig(namespace="mc", train=_QUICK), progress=False)
    with AttnStoreService.open(path, readonly=True) as service:
        yield service


def test_oracle_is_the_same_length_entry_with_the_smallest_true_map_distance(minilm_model, service):
    adapter = adapter_for(minilm_model)
    queries, _ = prepare_queries(adapter, service, "ns", QUERIES, progress=False)
    picks = oracle_picks(service, "ns", queries, causal=False, progress=False)
    assert picks.crop == picks.same_length
    for query, pick in zip(queries, picks.same_length, strict=True):
        entries = list(service.store.entries("ns", query.length))
        stored = np.stack([service.store.read_maps("ns", e.id) for e in entries])
        truth = map_distances(query.maps, torch.from_numpy(stored))
        assert pick.stored_length == query.length
        assert pick.distance == pytest.approx(truth.min(), abs=1e-9)
        assert truth[[e.id for e in entries].index(pick.entry_id)] == pytest.approx(truth.min(), abs=1e-9)


def test_causal_oracle_with_crop_may_pick_a_longer_entry_by_its_cropped_maps(tiny_decoder, decoder_store):
    adapter = adapter_for(tiny_decoder)
    # A stored prompt cut before its answer cue: all but its last token is a prefix of the stored one.
    prefix = PROMPTS[0].rsplit("\n", 1)[0]
    queries, _ = prepare_queries(adapter, decoder_store, "mc", PROMPTS[1::2] + [prefix], progress=False)
    picks = oracle_picks(decoder_store, "mc", queries, causal=True, progress=False)
    stored_prompt = decoder_store.store.find_by_hash("mc", prepare_queries(
        adapter, decoder_store, "mc", [PROMPTS[0]], progress=False)[0][0].token_hash)
    assert picks.crop[-1].entry_id == stored_prompt and picks.crop[-1].stored_length > queries[-1].length
    for query, same, crop in zip(queries, picks.same_length, picks.crop, strict=True):
        assert crop.distance <= same.distance
        assert same.entry_id is None or same.stored_length == query.length
        cropped = torch.from_numpy(decoder_store.read_maps("mc", crop.entry_id, length=query.length))
        # No length term: the crop's distance is its TV term alone.
        assert crop.distance == pytest.approx(map_distances(query.maps, cropped[None])[0], abs=1e-9)


def test_exact_duplicates_are_their_own_oracle_and_projector_pick_and_replay_faithfully(minilm_model, service):
    report = evaluate_oracle(minilm_model, service, QUERIES, OracleConfig(namespace="ns"), progress=False)
    dups = [r for r in report.results if r.duplicate]
    assert len(dups) == 5
    for r in dups:
        oracle, projector = r.methods["oracle_same_length"], r.methods["projector"]
        assert oracle.distance == pytest.approx(0.0, abs=1e-6) and oracle.cosine > 0.999
        assert projector.entry_id == oracle.entry_id
    assert not any(r.duplicate for r in report.results if QUERIES[r.index] not in STORED)


def test_simple_keys_pick_entries_by_sources_recomputed_from_the_corpus(minilm_model, service):
    adapter = adapter_for(minilm_model)
    sources = entry_sources(adapter, service, "ns", CORPUS, progress=False)
    assert sources.missing == 0 and sum(ids.size for ids in sources.ids.values()) == 50
    queries, _ = prepare_queries(adapter, service, "ns", QUERIES, progress=False)
    picks = key_picks(sources, queries, crop=False)
    for query, mean, position in zip(queries, picks["mean_pooled"], picks["positionwise"], strict=True):
        assert mean.stored_length == position.stored_length == query.length
        if query.duplicate_of is not None:
            assert mean.entry_id == position.entry_id == query.duplicate_of
            assert position.distance == pytest.approx(0.0, abs=1e-4)
    partial = entry_sources(adapter, service, "ns", CORPUS[:10], progress=False)
    assert partial.missing == 40


def test_calibrate_takes_the_largest_threshold_that_keeps_the_target_precision():
    distances = np.array([0.1, 0.2, 0.3, 0.4, 0.5, np.inf])
    faithful = np.array([True, True, True, False, False, True])
    assert calibrate(distances, faithful, 0.75) == 0.4  # 3 of 4
    assert calibrate(distances, faithful, 1.0) == 0.3
    # A tie counts whole: 0.2 cannot be a threshold when a wrong pick shares it.
    assert calibrate(np.array([0.1, 0.2, 0.2]), np.array([True, True, False]), 1.0) == 0.1
    assert calibrate(np.array([0.1, 0.2]), np.array([False, True]), 0.95) is None


def test_calibration_split_is_seeded_and_takes_its_share():
    split = calibration_split(10, 0.3, seed=4)
    assert split.sum() == 3 and np.array_equal(split, calibration_split(10, 0.3, seed=4))
    assert not np.array_equal(split, calibration_split(10, 0.3, seed=5))


def _result(distance: float, cosine: float, *, duplicate: bool = False, oracle_cosine: float = 1.0) -> QueryResult:
    return QueryResult(
        index=0, group=None, length=5, duplicate=duplicate, calibration=False, answer=None,
        methods={
            "oracle_same_length": Scored(1, 5, 0.0, oracle_cosine, None),
            "projector": Scored(1 if cosine == oracle_cosine else 2, 5, distance, cosine, None),
            "mean_pooled": Scored(2, 5, distance, 0.5, None),
        },
    )


def test_summary_counts_faithful_hits_within_the_threshold_and_judges_the_targets():
    results = [_result(0.1, 1.0), _result(0.2, 0.9), _result(0.9, 1.0), _result(0.1, 1.0, oracle_cosine=0.5)]
    summary = summarise(results, {"projector": 0.5, "mean_pooled": 0.5}, oracle="oracle_same_length", budget=0.99)
    assert summary["oracle_hits"] == 3 and summary["projector_hits"] == 3
    assert summary["projector_faithful_hits"] == 2 and summary["projector_precision"] == pytest.approx(2 / 3)
    assert summary["key_mean_pooled_hit_rate"] == 0.0
    assert summary["targets"] == {
        "hit_rate_ratio": pytest.approx(2 / 3), "hit_rate_vs_oracle": False, "precision": False,
        "not_below_simple_keys": True,
    }
    assert summarise(results, {"projector": None}, oracle="oracle_same_length", budget=0.99)["projector_hits"] == 0


def test_summary_reports_the_projector_at_the_split_threshold_apart_from_its_targets():
    results = [_result(0.1, 1.0), _result(0.2, 0.9), _result(0.9, 1.0)]
    summary = summarise(results, {"projector": 0.15}, oracle="oracle_same_length", budget=0.99, split_threshold=1.0)
    assert (summary["projector_hits"], summary["projector_faithful_hits"]) == (1, 1)
    assert (summary["projector_split_hits"], summary["projector_split_faithful_hits"]) == (3, 2)
    assert summary["projector_split_precision"] == pytest.approx(2 / 3)
    assert summary["targets"]["precision"] is True  # judged at the projector's own threshold


def test_figures_are_split_into_exact_duplicates_and_the_rest_on_the_held_out_split(minilm_model, service):
    config = OracleConfig(namespace="ns", calibration_fraction=0.4)
    report = evaluate_oracle(minilm_model, service, QUERIES, config, corpus=CORPUS, progress=False)
    held_out = [r for r in report.results if not r.calibration]
    assert len(held_out) == len(QUERIES) - round(0.4 * len(QUERIES))
    parts = report.parts
    assert parts["all"]["queries"] == len(held_out)
    assert parts["exact_dup"]["queries"] == sum(r.duplicate for r in held_out)
    assert parts["exact_dup"]["queries"] + parts["rest"]["queries"] == parts["all"]["queries"]
    assert set(report.thresholds) == {"projector", "mean_pooled", "positionwise"}


def test_a_fixed_max_distance_replaces_the_calibrated_projector_threshold(minilm_model, service):
    report = evaluate_oracle(minilm_model, service, QUERIES, OracleConfig(namespace="ns", max_distance=1e9),
                             progress=False)
    assert report.thresholds["projector"] == 1e9
    assert report.parts["all"]["projector_hits"] == report.parts["all"]["queries"]


def test_multiple_choice_prompts_report_answer_agreement_and_both_oracles(tiny_decoder, decoder_store):
    report = evaluate_oracle(tiny_decoder, decoder_store, PROMPTS[1::2] + PROMPTS[:4],
                             OracleConfig(namespace="mc"), corpus=PROMPTS[::2], progress=False)
    assert report.causal and report.oracle == "oracle_crop"
    assert all(r.answer in "ABCD" for r in report.results)
    overall = report.parts["all"]
    assert {"oracle_same_length_hit_rate", "oracle_crop_hit_rate", "oracle_crop_answer_agreement",
            "projector_answer_agreement"} <= set(overall)
    # Exact duplicates replay their own maps: the answer cannot change.
    assert all(r.methods["oracle_crop"].answer == r.answer for r in report.results if r.duplicate)


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    eval_oracle.register(sub)
    eval_corpora.register(sub)
    args = parser.parse_args(argv)
    return args.func(args)


def test_eval_oracle_command_prints_the_table_and_writes_the_headline_json_keys(minilm_store, tmp_path, capsys):
    path = minilm_store
    queries = tmp_path / "queries.tsv"
    queries.write_text("group\ttext\n" + "".join(f"{'ab'[i % 2]}\t{q}\n" for i, q in enumerate(QUERIES)))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(CORPUS))
    out = tmp_path / "report.json"
    code = _cli(["oracle", "--model", "minilm", "--store", str(path), "--namespace", "ns", "--queries", str(queries),
                 "--column", "text", "--group-column", "group", "--corpus", str(corpus), "--no-progress",
                 "--json", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "overall exact_dup" in printed and "a rest" in printed and "b all" in printed
    report = json.loads(out.read_text())
    assert {"oracle_hit_rate", "projector_hit_rate", "projector_precision", "threshold"} <= set(report)
    assert set(report["groups"]) == {"a", "b"} and len(report["per_query"]) == len(QUERIES)


def test_bad_input_fails_with_a_clear_error(minilm_model, minilm_store, tmp_path):
    path = minilm_store
    with AttnStoreService.open(path, readonly=True) as service:
        _refuse_bad_queries(minilm_model, service)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(CorpusError, match="empty"):
        _cli(["oracle", "--model", "minilm", "--store", str(path), "--namespace", "ns", "--queries", str(empty),
              "--json", str(tmp_path / "r.json")])


def _refuse_bad_queries(minilm_model, service):
    with pytest.raises(NamespaceNotFoundError, match="'nope'.*existing"):
        evaluate_oracle(minilm_model, service, QUERIES, OracleConfig(namespace="nope"), progress=False)
    with pytest.raises(CorpusError, match="empty"):
        evaluate_oracle(minilm_model, service, [], OracleConfig(namespace="ns"), progress=False)
    with pytest.raises(CorpusError, match="no usable queries"):
        evaluate_oracle(minilm_model, service, ["", "  "], OracleConfig(namespace="ns"), progress=False)


def test_a_namespace_without_projector_is_refused(minilm_model, tmp_path):
    fingerprint = model_fingerprint(minilm_model.model, minilm_model.tokenizer)
    with AttnStoreService.open(tmp_path / "s", create=True) as service:
        service.create_namespace("bare", model="minilm", fingerprint=fingerprint,
                                 layout=NamespaceLayout(layers=6, heads=12, causal=False, hidden=384, feature_dim=128))
        with pytest.raises(NamespaceNotReadyError, match="no projector"):
            evaluate_oracle(minilm_model, service, QUERIES, OracleConfig(namespace="bare"), progress=False)


def test_eval_corpora_writes_halves_and_zero_shot_prompts(tmp_path):
    assert eval_corpora.mmlu_prompt("college_mathematics", "1+1?", ["1", "2", "3", "4"]).endswith(
        "about college mathematics.\n\n1+1?\nA. 1\nB. 2\nC. 3\nD. 4\nAnswer:"
    )
    data = tmp_path / "data"
    (data / "loghub").mkdir(parents=True)
    (data / "stsb_train.tsv").write_text("score\tsentence1\tsentence2\n1\ta b.\tc d.\n2\tc d.\te f.\n")
    for system in eval_corpora.LOGHUB_SYSTEMS:
        lines = "".join(f"{i}\tE1\t{system} line {i}\n" for i in range(10))
        (data / "loghub" / f"{system}.tsv").write_text("line_id\tevent_id\tcontent\n" + lines)
    records = [{"subject": "s", "question": f"q{i}", "choices": ["1", "2", "3", "4"], "answer": "A"} for i in range(5)]
    (data / "mmlu_test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    config = eval_corpora.CorporaConfig(data=data, out=tmp_path / "out", loghub_store_lines=6, loghub_queries=2,
                                        mmlu_subjects=("s",))
    written = eval_corpora.write_corpora(config)
    assert written == {"stsb_train_sentences.txt": 3, "loghub_build.tsv": 48, "loghub_queries.tsv": 16,
                       "mmlu_build.jsonl": 3, "mmlu_queries.jsonl": 2}
    queries = (tmp_path / "out" / "loghub_queries.tsv").read_text().splitlines()
    assert all(int(line.rsplit(" ", 1)[1]) >= 6 for line in queries[1:])
    with pytest.raises(CorpusError, match="unknown MMLU subjects"):
        eval_corpora.write_corpora(replace(config, mmlu_subjects=("x",)))
