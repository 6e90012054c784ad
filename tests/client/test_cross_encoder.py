"""Cross-encoders (``sentence.cross_encoder``): ``AttnCache.predict`` and ``rank`` against sentence-transformers'
``CrossEncoder`` of the same folder, row by row, on tiny random sequence-classification models."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sentence_transformers import CrossEncoder

from attnstore.errors import ConfigError, UnsupportedModelError
from attnstore.index import ExactIndex
from attnstore.service import AttnStoreService
from attnstore.store import MemoryMapStore
from attnstore_client.cache import AttnCache
from attnstore_client.connection.local import LocalConnection
from attnstore_client.models import load_model
from tests.support.adapters import save_tiny_cross_encoder
from tests.support.caches import fill_namespace

PAIRS = [
    ("how do I reset my password", "Open settings, then security, then choose reset password."),
    ("disk full on node 7", "The volume /var on node 7 reached 100% usage at 03:12."),
    ("what is the capital of France", "Paris is the capital and largest city of France."),
    ("a", "b"),
    ("", "an empty query still pairs"),
    ("what is the capital of France", "Paris is the capital and largest city of France."),  # a repeat
    ("long " * 120, "document " * 150),  # truncated longest first
]
DOCUMENTS = [pair[1] for pair in PAIRS[:5]]

WORDS = st.sampled_from(["log", "disk", "error", "node", "user", "reset", "the", "of", "capital", "[SEP]", "Paris"])
TEXTS = st.lists(WORDS, min_size=0, max_size=12).map(" ".join)


def _cache(folder: Path, *, exact: bool = False) -> AttnCache:
    """An ``AttnCache`` of ``folder`` over an in-memory store whose namespace holds a few single texts.

    The exact tiers are off unless asked: they keep fp16 outputs, and the tests that compare with ``CrossEncoder``
    within 1e-5 compare computed rows.
    """
    loaded = load_model(str(folder))
    service = AttnStoreService(MemoryMapStore(), make_index=ExactIndex)
    fill_namespace(service, loaded, ["some stored text", "another stored text"])
    return AttnCache(loaded, LocalConnection("local:memory", service), exact=exact)


@pytest.fixture(scope="module", params=[("bert", 1), ("bert", 3), ("distilbert", 1), ("qwen3", 1)],
                ids=lambda param: f"{param[0]}-{param[1]}")
def pair(request, tmp_path_factory) -> tuple[AttnCache, CrossEncoder]:
    family, labels = request.param
    folder = save_tiny_cross_encoder(tmp_path_factory.mktemp(f"{family}{labels}"), family, labels)
    cache = _cache(folder)
    yield cache, CrossEncoder(str(folder), device="cpu")
    cache.close()


def _close(ours, theirs, atol: float = 1e-5) -> None:
    np.testing.assert_allclose(np.asarray(ours, dtype=np.float32), np.asarray(theirs, dtype=np.float32),
                               rtol=0, atol=atol)


def test_predict_equals_cross_encoder_row_by_row(pair) -> None:
    cache, reference = pair
    ours = cache.predict(PAIRS, batch_size=3)
    expected = reference.predict(PAIRS, batch_size=3)
    assert ours.shape == expected.shape
    _close(ours, expected)
    assert ours.dtype == np.float32


def test_a_second_call_is_served_by_the_exact_tier(pair, request) -> None:
    cache, reference = pair
    pairs = [("exact tier question", "exact tier answer, a row of its own"), ("second", "pair")]
    cache.exact = True
    request.addfinalizer(lambda: setattr(cache, "exact", False))
    first = cache.predict(pairs)
    assert set(cache.last_row_kinds) <= {"miss", "fallback"}
    cache.predict(pairs)  # this process's exact tier keeps a row offered twice (its doorkeeper)
    again = cache.predict(pairs)
    assert cache.last_row_kinds == ("exact", "exact")
    assert cache.last_stats.rows_by_kind()["exact"] == 2
    # The exact tier keeps a row's last hidden states in fp16, as the store does: the head reads them rounded.
    _close(again, first, atol=5e-3)
    _close(again, reference.predict(pairs), atol=5e-3)


def test_options_follow_cross_encoder(pair) -> None:
    cache, reference = pair
    for options in ({"apply_softmax": True}, {"convert_to_tensor": True}, {"activation_fn": torch.nn.Identity()}):
        ours, expected = cache.predict(PAIRS[:4], **options), reference.predict(PAIRS[:4], **options)
        assert type(ours) is type(expected)
        _close(torch.as_tensor(ours).numpy(), torch.as_tensor(expected).numpy())
    listed = cache.predict(PAIRS[:3], convert_to_numpy=False)
    assert isinstance(listed, list) and all(isinstance(score, torch.Tensor) for score in listed)
    _close(torch.stack(listed).numpy(), reference.predict(PAIRS[:3]))
    single = cache.predict(PAIRS[0])  # one pair in, its score alone out
    _close(single, reference.predict(PAIRS[0]))
    assert np.shape(single) == np.shape(reference.predict(PAIRS[0]))


def test_rank_equals_cross_encoder(pair) -> None:
    cache, reference = pair
    if reference.num_labels != 1:
        with pytest.raises(ConfigError, match="num_labels=1"):
            cache.rank("query", DOCUMENTS)
        return
    query = "what is the capital of France"
    for options in ({}, {"top_k": 2}, {"return_documents": True}):
        ours, expected = cache.rank(query, DOCUMENTS, **options), reference.rank(query, DOCUMENTS, **options)
        assert [row["corpus_id"] for row in ours] == [row["corpus_id"] for row in expected]
        assert [row.get("text") for row in ours] == [row.get("text") for row in expected]
        _close([row["score"] for row in ours], [row["score"] for row in expected])


@settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(pairs=st.lists(st.tuples(TEXTS, TEXTS), min_size=1, max_size=6))
def test_generated_pairs_equal_cross_encoder(bert_pair, pairs) -> None:
    cache, reference = bert_pair
    _close(cache.predict(pairs, batch_size=4), reference.predict(pairs, batch_size=4))


@pytest.fixture(scope="module")
def bert_pair(tmp_path_factory) -> tuple[AttnCache, CrossEncoder]:
    folder = save_tiny_cross_encoder(tmp_path_factory.mktemp("bert-fuzz"), "bert", 1)
    cache = _cache(folder)
    yield cache, CrossEncoder(str(folder), device="cpu")
    cache.close()


def test_a_pair_never_shares_a_key_with_the_text_of_its_ids(bert_pair, request) -> None:
    """BERT's segment ids change a pair's outputs: "a [SEP] b" as one text has the ids of the pair ("a", "b")."""
    cache, reference = bert_pair
    cache.exact = True
    request.addfinalizer(lambda: setattr(cache, "exact", False))
    for _ in range(3):  # kept by this process's exact tier
        cache.encode(["one text [SEP] holding a separator"])
    assert cache.last_row_kinds == ("exact",)
    ours = cache.predict([("one text", "holding a separator")])
    assert cache.last_row_kinds == ("miss",)
    _close(ours, reference.predict([("one text", "holding a separator")]))


def test_a_cross_encoder_folder_loads_with_its_activation(tmp_path) -> None:
    plain = save_tiny_cross_encoder(tmp_path / "plain", "bert", 1)
    saved = CrossEncoder(str(plain), device="cpu", activation_fn=torch.nn.Identity())
    saved.save(str(tmp_path / "ce"))
    reference = CrossEncoder(str(tmp_path / "ce"), device="cpu")
    assert isinstance(reference.activation_fn, torch.nn.Identity)
    with _cache(tmp_path / "ce") as cache:
        ours = cache.predict(PAIRS)
        _close(ours, reference.predict(PAIRS))
        logits = reference.predict(PAIRS, activation_fn=torch.nn.Identity())
        _close(ours, logits)  # the saved activation (Identity), not the default Sigmoid of one label


def test_a_model_without_a_classifier_head_is_refused(tmp_path) -> None:
    from tests.support.adapters import save_tiny_family

    with _cache(save_tiny_family("bert", tmp_path / "encoder")) as cache:
        with pytest.raises(UnsupportedModelError, match="ForSequenceClassification"):
            cache.predict([("query", "document")])
        with pytest.raises(UnsupportedModelError, match="ForSequenceClassification"):
            cache.rank("query", ["document"])


@pytest.mark.parametrize(("inputs", "named"), [
    ([], "no pairs"),
    ("one string", "one string"),
    ([("only one",)], "pair 0"),
    ([("query", "document"), ("query", 7)], "pair 1"),
    ([("a", "b", "c")], "pair 0"),
])
def test_bad_input_is_refused_by_name(bert_pair, inputs, named) -> None:
    cache, _ = bert_pair
    with pytest.raises(ConfigError, match=named):
        cache.predict(inputs)


def test_bad_rank_input_is_refused_by_name(bert_pair) -> None:
    cache, _ = bert_pair
    with pytest.raises(ConfigError, match="documents"):
        cache.rank("query", [])
    with pytest.raises(ConfigError, match="document 1"):
        cache.rank("query", ["fine", None])
    with pytest.raises(ConfigError, match="query"):
        cache.rank(None, ["fine"])


def test_padded_forwards_carry_token_types_too(bert_pair, request) -> None:
    cache, reference = bert_pair
    cache.packed = False
    request.addfinalizer(lambda: setattr(cache, "packed", True))
    _close(cache.predict(PAIRS, batch_size=2), reference.predict(PAIRS, batch_size=2))
