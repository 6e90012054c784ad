"""``attnstore build``: capture, projector training, ingest, and all-or-nothing failure."""

from __future__ import annotations

import numpy as np
import pytest

from attnstore.errors import CorpusError, StoreFullError
from attnstore.projector.blob import has_embedding_layer
from attnstore.service import AttnStoreService, Query
from attnstore_client.adapters.batch import tokenize
from attnstore_client.keys import model_fingerprint, token_hash
from attnstore_client.projector import Projector
from attnstore_tools.build.command import BuildConfig, build_namespace
from attnstore_tools.build.training import TrainConfig
from attnstore_tools.cli import main

_QUICK = TrainConfig(max_epochs=3, patience=1)
_COLOURS = ["red", "green", "blue", "black", "white", "brown"]
_ANIMALS = ["cat", "dog", "horse", "bird", "fish"]


def corpus() -> list[str]:
    """60 short templated sentences with a few exact duplicates."""
    texts = [f"the {c} {a} sat on the mat." for c in _COLOURS for a in _ANIMALS]
    texts += [f"a {c} {a} runs in the park today." for c in _COLOURS for a in _ANIMALS]
    return texts + texts[:4]


def config(**changes) -> BuildConfig:
    return BuildConfig(namespace="ns", train=_QUICK, **changes)


@pytest.fixture
def service(tmp_path):
    with AttnStoreService.open(tmp_path / "store", create=True) as opened:
        yield opened


def test_build_stores_every_distinct_row_with_its_maps_outputs_and_projector(minilm_model, service):
    texts = corpus()
    report = build_namespace(minilm_model, texts, service, config(), progress=False)
    assert (report.texts, report.entries, report.duplicates) == (64, 60, 4)
    assert report.stored_bytes > 0 and report.train is not None
    info = service.get_namespace("ns")
    assert info.fingerprint == model_fingerprint(minilm_model.model, minilm_model.tokenizer)
    assert (info.layout.layers, info.layout.heads, info.layout.causal) == (6, 12, False)
    projector = Projector.from_safetensors_bytes(info.projector)
    assert has_embedding_layer(info.projector)  # the daemon derives written-back rows' features with it
    # A corpus row is an exact hit whose stored maps are the model's own.
    from attnstore_client.adapters import adapter_for

    adapter = adapter_for(minilm_model)
    batch = tokenize(minilm_model.tokenizer, [texts[7]])
    capture = adapter.capture(batch)
    feature = projector.project(adapter.feature_source(batch))[0]
    [match] = service.lookup(
        "ns", info.fingerprint, [Query(feature, batch.lengths[0], token_hash(batch.row_ids(0)))], max_distance=0.1
    )
    assert match.kind == "exact"
    np.testing.assert_allclose(service.read_maps("ns", match.entry_id), capture.maps[0].numpy(), atol=1e-3)
    # The stored feature is the projector's: a search without the token hash finds the same entry.
    [by_feature] = service.lookup("ns", info.fingerprint, [Query(feature, batch.lengths[0])], max_distance=1e-3)
    assert (by_feature.kind, by_feature.entry_id) == ("map", match.entry_id)


def test_rows_over_max_length_and_blank_rows_are_skipped_and_counted(minilm_model, service):
    texts = corpus() + ["", "   ", "word " * 40]
    report = build_namespace(minilm_model, texts, service, config(max_length=20), progress=False)
    assert (report.skipped_too_long, report.skipped_empty, report.entries) == (1, 2, 60)
    assert max(service.store.lengths("ns")) <= 20


def test_second_build_reuses_the_projector_and_adds_only_new_rows(minilm_model, service):
    texts = corpus()
    build_namespace(minilm_model, texts[:40], service, config(), progress=False)
    blob = service.get_namespace("ns").projector
    report = build_namespace(minilm_model, texts, service, config(), progress=False)
    assert report.train is None and report.entries == 20 and report.duplicates == 44
    assert service.get_namespace("ns").projector == blob
    assert service.store.stats().entries == 60


@pytest.mark.parametrize(
    ("texts", "message"),
    [([], "empty"), (["", " "], "no usable rows"), (["one short line.", "another one."], "too small to train")],
)
def test_bad_corpora_fail_clearly_and_create_nothing(minilm_model, service, texts, message):
    with pytest.raises(CorpusError, match=message):
        build_namespace(minilm_model, texts, service, config(), progress=False)
    assert service.list_namespaces() == []


def test_a_failed_build_leaves_the_store_as_it_was(minilm_model, tmp_path):
    texts = corpus()
    path = tmp_path / "small"
    with AttnStoreService.open(path, create=True, map_size=2 << 20) as service:
        # Without the embedding layer (~47 MB): this store is 2 MiB so that the builds below fill it.
        build_namespace(minilm_model, texts[:20], service,
                        BuildConfig(namespace="kept", train=_QUICK, embedding_layer=False), progress=False)
        kept = service.store.stats().entries
        # One entry per transaction: the store fills up part way through the ingest.
        with pytest.raises(StoreFullError):
            build_namespace(minilm_model, texts * 3, service, config(ingest_bytes=1), progress=False)
        with pytest.raises(StoreFullError):
            build_namespace(minilm_model, [t.upper() for t in texts] * 3, service,
                            BuildConfig(namespace="kept", train=_QUICK, ingest_bytes=1), progress=False)
        assert [n.name for n in service.list_namespaces()] == ["kept"]
        assert service.store.stats().entries == kept
    with AttnStoreService.open(path) as reopened:
        assert reopened.store.verify().corrupt == ()
        assert reopened.store.stats().entries == kept


def test_build_command_prints_the_summary(minilm_model, tmp_path, capsys):
    corpus_path = tmp_path / "corpus.txt"
    corpus_path.write_text("\n".join(corpus()), encoding="utf-8")
    code = main(["build", "--model", "minilm", "--corpus", str(corpus_path), "--store", str(tmp_path / "s"),
                 "--no-progress"])
    assert code == 0
    out = capsys.readouterr().out
    assert "namespace default: 60 entries added from 64 rows (4 duplicates" in out and "projector:" in out
