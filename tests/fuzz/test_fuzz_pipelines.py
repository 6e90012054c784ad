"""Differential fuzz of ``encode()`` over the sentence-transformers pipelines users configure: every row equals
``SentenceTransformer.encode``'s of the same pipeline, whichever family, pooling, padding side, prompt, Dense and
Normalize layers, truncation and path.

A pipeline is drawn at random (hypothesis): a family the adapters serve, or one without an adapter (``NO_ADAPTER``:
the model's own forward, exact tiers only, so its stores hold outputs alone), as tiny random-config models sharing
all-MiniLM-L6-v2's tokenizer), its tokenizer padding on the left or the right, a ``Pooling`` of any mode with its
prompt included or excluded, a ``query: `` prompt or none, Dense layers, Normalize, ``max_seq_length`` and
``truncate_dim``; then a colliding call (``fuzz_texts``) is encoded through ``AttnCache`` on a store holding some
of the texts' outputs (exact hits) and others' maps alone (map hits), embedded or through a real daemon, with the
exact tiers or the map tier off, packed or padded forwards, side by side or not. Computed rows and exact hits must
be within cosine 0.9999 of the reference, map hits within the gate's 0.99.

The reference is sentence-transformers' own ``encode`` of the call, except where a model's position ids ignore the
attention mask (BERT's absolute positions, as transformers builds them): there, left padding shifts a row's
positions by the padding its batch gives it, so sentence-transformers' vector of a text depends on the other texts
in its batch; the reference is then each text encoded alone, which is what ``AttnCache`` returns (a row's vector
never depends on its neighbours). docs/concepts/guarantees.md says so.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from fuzz_harness import Tally, fuzz_settings
from fuzz_texts import MAPS_ONLY, STORED, colliding_calls
from hypothesis import given
from hypothesis import strategies as st
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer import modules as models

from attnstore.index import ExactIndex
from attnstore.protocol.records import NamespaceLayout, TokenLimits
from attnstore.protocol.requests import exact_request
from attnstore.protocol.write_back import row_to_pb
from attnstore.service import AttnStoreService
from attnstore.store import MemoryMapStore, NewEntry
from attnstore_client.adapters.batch import tokenize
from attnstore_client.cache import AttnCache
from attnstore_client.connection.daemon import DaemonClient
from attnstore_client.connection.local import LocalConnection
from attnstore_client.keys import model_fingerprint, token_hash
from attnstore_client.models import LoadedModel
from attnstore_client.tiers.cost_model import CostSettings
from attnstore_tools.build.namespace_layout import exact_tier_layout
from tests.support.adapters import save_tiny_family
from tests.support.caches import capture_entries, plain_hidden
from tests.support.daemon import ADMIN_TOKEN, READ_TOKEN, DaemonProcess
from tests.support.vectors import row_cosines

pytestmark = pytest.mark.real_model

COMPUTED = 0.9999  # computed rows and exact hits (fp16 outputs)
MAPPED = 0.99  # map hits: what the fidelity gate promises of a hit
MAX_ROWS = 24
FAMILIES = ("bert", "roberta", "llama", "mistral", "qwen2", "xlm-roberta", "distilbert", "mpnet", "qwen3",
            "deberta-v2", "electra", "modernbert", "gemma3_text", "embeddinggemma")
# Families drawn under a name of their own: the model_type and ``save_tiny_family``'s options. EmbeddingGemma is a
# bidirectional Gemma 3 (its pipelines: mean pooling, Dense layers, Normalize).
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {"embeddinggemma": ("gemma3_text", {"bidirectional": True})}
# Families without an adapter (issue 49, item 2): their namespaces hold STORED's outputs alone, no maps or projector.
# The pipelines test draws them apart from the others, so the others' fast-profile examples stay what they were.
NO_ADAPTER = ("deberta-v2", "electra")
# The BERT-like adapters of issue 49 item 1 (MPNet's relative position bias, DistilBERT's module names), drawn apart
# for the same reason.
BERT_LIKE = ("xlm-roberta", "distilbert", "mpnet")
# The decoders of issue 49 item 1 (Qwen3's query and key norms), drawn apart for the same reason.
DECODERS = ("qwen3",)
# ModernBERT's adapter (rotary positions, local layers' windows shorter than most rows), drawn apart for the same
# reason.
MODERNBERT = ("modernbert",)
# Gemma 3's adapters, causal and bidirectional (sliding-window layers, query and key norms, scaled embeddings), drawn
# apart for the same reason.
GEMMA = ("gemma3_text", "embeddinggemma")
WITH_ADAPTER = tuple(name for name in FAMILIES
                     if name not in NO_ADAPTER + BERT_LIKE + DECODERS + MODERNBERT + GEMMA)
# Families whose position ids are a plain range over the padded batch, whatever its mask: left padding moves them.
POSITIONS_IGNORE_MASK = {"bert", "distilbert", "deberta-v2", "electra"}
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
HIDDEN = 32


@dataclass
class Family:
    """One family's transformer module (shared by every pipeline drawn on it) and its stores."""

    name: str
    transformer: models.Transformer
    service: AttnStoreService


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Family]:
    """Each family's model, and a store holding ``STORED``'s outputs and ``MAPS_ONLY``'s maps."""
    built: dict[str, Family] = {}
    for name in FAMILIES:
        model_type, options = VARIANTS.get(name, (name, {}))
        folder = save_tiny_family(model_type, tmp_path_factory.mktemp(name), hidden=HIDDEN, **options)
        transformer = models.Transformer(str(folder), max_seq_length=128)
        loaded = _loaded(transformer, None)
        service = AttnStoreService(MemoryMapStore(), make_index=ExactIndex)
        fingerprint, layout, entries, projector = _contents(loaded)
        service.create_namespace("default", model=name, fingerprint=fingerprint, layout=layout)
        service.ingest("default", fingerprint, entries)
        if projector is not None:
            service.set_projector("default", projector)
        built[name] = Family(name, transformer, service)
    return built


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, families: dict[str, Family]) -> Iterator[DaemonProcess]:
    """A real daemon on a real LMDB store with one namespace per family, filled as the embedded stores are."""
    workdir = tmp_path_factory.mktemp("fuzz-pipelines")
    # Admitting a row on its first ask: a family without an adapter's outputs go in by write-back (``_write_outputs``).
    process = DaemonProcess(workdir / "store", workdir, extra_args=("--admit-after", "1")).start()
    with process.client(ADMIN_TOKEN) as admin:
        for name, family in families.items():
            loaded = _loaded(family.transformer, None)
            fingerprint, layout, entries, projector = _contents(loaded)
            config = loaded.model.config
            limits = TokenLimits(len(loaded.tokenizer), int(config.max_position_embeddings))
            admin.create_namespace(name, model=name, fingerprint=fingerprint, layout=layout, projector=projector,
                                   limits=limits)
            if projector is None:
                _write_outputs(admin, name, fingerprint, entries)
            else:
                admin.ingest(name, fingerprint, entries)
    yield process
    assert process.stop() == 0, process.log()


def _contents(loaded: LoadedModel) -> tuple[str, NamespaceLayout, list[NewEntry], bytes | None]:
    """A namespace's fingerprint, layout, entries and projector: ``STORED``'s outputs and maps and ``MAPS_ONLY``'s
    maps; for a family without an adapter ``STORED``'s outputs alone and no projector (an exact-tier namespace)."""
    if loaded.model.config.model_type in NO_ADAPTER:
        batch = tokenize(loaded.tokenizer, STORED)
        entries = [NewEntry(maps=None, token_hash=token_hash(batch.row_ids(row)), outputs=hidden.half().numpy(),
                            token_ids=batch.row_ids(row).tolist())
                   for row, hidden in enumerate(plain_hidden(loaded, STORED))]
        return model_fingerprint(loaded.model, loaded.tokenizer), exact_tier_layout(loaded), entries, None
    stored = capture_entries(loaded, STORED)
    maps_only = capture_entries(loaded, MAPS_ONLY, outputs=False, projector=stored.projector)
    return (stored.fingerprint, stored.layout, stored.entries + maps_only.entries,
            stored.projector.to_safetensors_bytes())


def _write_outputs(admin: DaemonClient, namespace: str, fingerprint: str, entries: list[NewEntry]) -> None:
    """Outputs-only entries into a daemon's namespace: asked for once (admitted), then written back (an ingest
    carries maps)."""
    ids = [np.asarray(entry.token_ids) for entry in entries]
    admin.lookup(exact_request(namespace, fingerprint, [bytes(entry.token_hash) for entry in entries],
                               [len(row) for row in ids]))
    reply = admin.write_back(namespace, fingerprint, [row_to_pb(row, np.asarray(entry.outputs, np.float32))
                                                      for row, entry in zip(ids, entries, strict=True)])
    assert not reply.refused, reply.refused


def _loaded(transformer: models.Transformer, pipeline: SentenceTransformer | None) -> LoadedModel:
    return LoadedModel(name="tiny", model=transformer.auto_model, tokenizer=transformer.tokenizer, lm_head=None,
                       sentence_transformer=pipeline)


@dataclass(frozen=True)
class Pipeline:
    """A sentence-transformers pipeline as a user configures it."""

    family: str
    padding_side: str
    pooling: tuple[str, ...]
    include_prompt: bool
    prompt: str | None
    dense: tuple[str, ...]  # each Dense layer's activation
    normalize: bool
    max_seq_length: int
    truncate_dim: int | None

    def build(self, transformer: models.Transformer) -> SentenceTransformer:
        transformer.tokenizer.padding_side = self.padding_side
        transformer.max_seq_length = self.max_seq_length
        modules: list[torch.nn.Module] = [transformer, models.Pooling(
            HIDDEN, pooling_mode=list(self.pooling), include_prompt=self.include_prompt)]
        width = HIDDEN * len(self.pooling)
        for index, activation in enumerate(self.dense):
            torch.manual_seed(index)
            layer = models.Dense(width, 24, activation_function=getattr(torch.nn, activation)())
            modules.append(layer)
            width = 24
        if self.normalize:
            modules.append(models.Normalize())
        return SentenceTransformer(modules=modules, device="cpu", truncate_dim=self.truncate_dim,
                                   prompts={"query": self.prompt} if self.prompt else None,
                                   default_prompt_name="query" if self.prompt else None).eval()


def pipelines_on(names: tuple[str, ...]) -> st.SearchStrategy[Pipeline]:
    """Pipelines on the families ``names``."""
    return st.builds(
        Pipeline,
        family=st.sampled_from(names),
        padding_side=st.sampled_from(("left", "right")),
        pooling=st.one_of(st.tuples(st.sampled_from(POOLING_MODES)),
                          st.lists(st.sampled_from(POOLING_MODES), min_size=2, max_size=2, unique=True).map(tuple)),
        include_prompt=st.booleans(),
        prompt=st.sampled_from((None, "query: ")),
        dense=st.sampled_from(((), (), ("Tanh",), ("Identity", "Tanh"))),
        normalize=st.booleans(),
        max_seq_length=st.sampled_from((128, 128, 12)),
        truncate_dim=st.sampled_from((None, None, 16)),
    )


@dataclass(frozen=True)
class Path_:
    """Where a call's rows go: the store's side, which tiers, how forwards are cut."""

    where: str  # "embedded" or "daemon"
    exact: bool
    maps: bool
    packed: bool
    side_by_side: bool
    batch_size: int


paths = st.builds(Path_, where=st.sampled_from(("embedded", "embedded", "daemon")), exact=st.booleans(),
                  maps=st.booleans(), packed=st.booleans(), side_by_side=st.booleans(),
                  batch_size=st.sampled_from((2, 5, 32)))


def _reference(pipeline: Pipeline, model: SentenceTransformer, texts: list[str], batch_size: int) -> np.ndarray:
    if pipeline.padding_side == "left" and pipeline.family in POSITIONS_IGNORE_MASK:
        alone = {text: model.encode([text], show_progress_bar=False)[0] for text in set(texts)}
        return np.stack([alone[text] for text in texts])
    return model.encode(texts, batch_size=batch_size, show_progress_bar=False)


def _cache(pipeline: Pipeline, path: Path_, family: Family, model: SentenceTransformer,
           daemon: DaemonProcess) -> AttnCache:
    always = CostSettings(min_samples=0, explore=1.0)  # every lookup asked; hits at distance 0 only
    loaded = _loaded(family.transformer, model)
    options: dict[str, Any] = {"max_distance": 1e-6, "cost": always, "exact": path.exact, "maps": path.maps,
                               "packed": path.packed, "side_by_side": path.side_by_side}
    if path.where == "daemon":
        return AttnCache(loaded, f"grpc://{daemon.target}", family.name, token=READ_TOKEN, **options)
    return AttnCache(loaded, LocalConnection("local:memory", family.service), **options)


@pytest.mark.parametrize(("drawn", "examples"), [(WITH_ADAPTER, 30), (BERT_LIKE, 12), (DECODERS, 8), (NO_ADAPTER, 12),
                                                (MODERNBERT, 12), (GEMMA, 12)],
                         ids=["adapters", "bert_like", "decoders", "no_adapter", "modernbert", "gemma"])
def test_every_row_of_every_configured_pipeline_equals_sentence_transformers(
    families: dict[str, Family], daemon: DaemonProcess, tally: Tally, drawn: tuple[str, ...], examples: int
) -> None:
    @fuzz_settings(fast_examples=examples)
    @given(pipeline=pipelines_on(drawn), path=paths, texts=colliding_calls(MAX_ROWS))
    def check(pipeline: Pipeline, path: Path_, texts: list[str]) -> None:
        family = families[pipeline.family]
        model = pipeline.build(family.transformer)
        reference = _reference(pipeline, model, texts, path.batch_size)
        with _cache(pipeline, path, family, model, daemon) as cache:
            ours = cache.encode(texts, batch_size=path.batch_size, show_progress_bar=False)
            kinds = cache.last_row_kinds
        assert ours.shape == reference.shape, (ours.shape, reference.shape)
        cosines = row_cosines(ours, reference, zero_tolerance=1e-6)
        for row, (cosine, kind) in enumerate(zip(cosines, kinds, strict=True)):
            floor = MAPPED if kind == "map" else COMPUTED
            assert cosine >= floor, f"{pipeline} {path}: row {row} ({kind}, {texts[row]!r}) cosine {cosine:.6f}"
        tally.count("pipelines", f"{pipeline} {path}", kinds)

    check()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("pooling", ["lasttoken", "mean", "cls"])
def test_a_left_padding_pipeline_gives_each_row_its_own_vector_in_a_call_of_many(
    families: dict[str, Family], family: str, pooling: str
) -> None:
    """The issue's table: a left-padding tokenizer used to give zero vectors and rows at cosine 0."""
    pipeline = Pipeline(family, "left", (pooling,), True, None, (), True, 128, None)
    model = pipeline.build(families[family].transformer)
    texts = [*STORED[:2], "A man is playing a guitar.", "hi", "The quick brown fox jumps over the lazy dog again.",
             *MAPS_ONLY[:1], "ok then"]
    reference = _reference(pipeline, model, texts, 32)
    for exact in (True, False):
        path = Path_("embedded", exact, True, True, False, 32)
        with _cache(pipeline, path, families[family], model, None) as cache:  # type: ignore[arg-type]
            ours = cache.encode(texts)
            kinds = cache.last_row_kinds
        assert ("exact" in kinds) == exact and ("miss" in kinds)
        cosines = row_cosines(ours, reference, zero_tolerance=1e-6)
        assert all(cosine >= (MAPPED if kind == "map" else COMPUTED) for cosine, kind in zip(cosines, kinds,
                                                                                              strict=True)), (
            kinds, cosines)


# Gemma 3 as its users configure it: a Gemma 3 instruct model's last token; EmbeddingGemma's mean pooling, two Dense
# layers and Normalize over the bidirectional model.
GEMMA_PIPELINES = {
    "gemma3_text": Pipeline("gemma3_text", "left", ("lasttoken",), True, None, (), True, 128, None),
    "embeddinggemma": Pipeline("embeddinggemma", "right", ("mean",), True, None, ("Identity", "Identity"), True, 128,
                               None),
}


@pytest.mark.parametrize("family", GEMMA)
@pytest.mark.parametrize(("where", "exact", "packed"), [("embedded", True, True), ("embedded", False, True),
                                                        ("embedded", False, False), ("daemon", True, False),
                                                        ("daemon", False, True)])
def test_a_gemma3_pipeline_serves_exact_map_and_computed_rows_equal_to_sentence_transformers(
    families: dict[str, Family], daemon: DaemonProcess, family: str, where: str, exact: bool, packed: bool
) -> None:
    """Stored outputs and stored maps served, the other rows computed (rows longer than every sliding window among
    them), packed or padded, embedded or through a daemon: each row within the gate of sentence-transformers'."""
    pipeline = GEMMA_PIPELINES[family]
    model = pipeline.build(families[family].transformer)
    texts = [*STORED[:3], *MAPS_ONLY[:2], "A man is playing a guitar.", "hi", "The quick brown fox jumps over the"
             " lazy dog again and again, far longer than any sliding window of the tiny model."]
    reference = _reference(pipeline, model, texts, 32)
    with _cache(pipeline, Path_(where, exact, True, packed, False, 32), families[family], model, daemon) as cache:
        assert cache.tiers.maps and not cache.tiers.prefix and cache.tiers.packed is packed, cache.tiers.absent
        ours = cache.encode(texts)
        kinds = cache.last_row_kinds
    assert ("exact" in kinds) == exact and "map" in kinds and "miss" in kinds, kinds
    cosines = row_cosines(ours, reference, zero_tolerance=1e-6)
    floors = [MAPPED if kind == "map" else COMPUTED for kind in kinds]
    assert all(cosine >= floor for cosine, floor in zip(cosines, floors, strict=True)), (kinds, cosines)


@pytest.mark.parametrize(("padding_side", "pooling"), [("right", "cls"), ("left", "mean")])
@pytest.mark.parametrize(("where", "exact", "packed"), [("embedded", True, True), ("embedded", False, False),
                                                        ("daemon", True, False), ("daemon", False, True)])
def test_a_modernbert_pipeline_serves_exact_map_and_computed_rows_equal_to_sentence_transformers(
    families: dict[str, Family], daemon: DaemonProcess, padding_side: str, pooling: str, where: str, exact: bool,
    packed: bool
) -> None:
    """gte-modernbert's pipeline (CLS pooling) and a mean-pooling one padding on the left: stored outputs and stored
    maps served, the other rows computed (some longer than the local layers' window), packed or padded, embedded or
    through a daemon; each row within the gate of sentence-transformers'."""
    pipeline = Pipeline("modernbert", padding_side, (pooling,), True, None, (), True, 128, None)
    model = pipeline.build(families["modernbert"].transformer)
    texts = [*STORED[:3], *MAPS_ONLY[:2], "A man is playing a guitar.", "hi", "The quick brown fox jumps over the"
             " lazy dog again and again, far longer than the local layers' window of the tiny model."]
    reference = _reference(pipeline, model, texts, 32)
    with _cache(pipeline, Path_(where, exact, True, packed, False, 32), families["modernbert"], model, daemon) as cache:
        assert cache.tiers.maps and not cache.tiers.prefix and cache.tiers.packed is packed, cache.tiers.absent
        ours = cache.encode(texts)
        kinds = cache.last_row_kinds
    assert ("exact" in kinds) == exact and "map" in kinds and "miss" in kinds, kinds
    cosines = row_cosines(ours, reference, zero_tolerance=1e-6)
    floors = [MAPPED if kind == "map" else COMPUTED for kind in kinds]
    assert all(cosine >= floor for cosine, floor in zip(cosines, floors, strict=True)), (kinds, cosines)
