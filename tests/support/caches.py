"""Tiny models with a real word-level tokenizer, and stores filled with their maps, for the cache tests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from attnstore.projector.int8_plan import Int8Plan
from attnstore.service import AttnStoreService
from attnstore.store import NamespaceLayout, NewEntry
from attnstore_client.adapters import adapter_for
from attnstore_client.adapters.batch import tokenize
from attnstore_client.keys import model_fingerprint, token_hash
from attnstore_client.models import LoadedModel
from attnstore_client.projector import Projector, ProjectorConfig
from tests.support.adapters import VOCAB, TinyKind, tiny_model

# Word ids: 0 pad, 1 unknown, then "w2".."w95".
WORDS = [f"w{i}" for i in range(2, VOCAB)]


def word_tokenizer() -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer over ``WORDS`` (pad id 0)."""
    vocab = {"[PAD]": 0, "[UNK]": 1, **{word: i for i, word in enumerate(WORDS, start=2)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]")


def tiny_loaded(kind: TinyKind, *, seed: int = 0) -> LoadedModel:
    """A random tiny model of that kind with the word tokenizer."""
    loaded = tiny_model(kind, seed=seed)
    return LoadedModel(name=f"tiny-{kind}", model=loaded.model, tokenizer=word_tokenizer(), lm_head=loaded.lm_head)


def sentences(count: int, *, seed: int = 0, min_words: int = 4, max_words: int = 12) -> list[str]:
    """Random "sentences" of tokenizer words."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(min_words, max_words + 1)))) for _ in range(count)]


@dataclass(frozen=True)
class Captured:
    """What a namespace of ``loaded`` needs: layout, fingerprint, projector and one entry per text."""

    layout: NamespaceLayout
    fingerprint: str
    projector: Projector
    entries: list[NewEntry]


def capture_entries(
    loaded: LoadedModel, texts: Sequence[str], *, outputs: bool = True, projector: Projector | None = None
) -> Captured:
    """Capture ``texts`` with ``loaded``: maps and outputs fp16, token hashes, features.

    The projector is untrained (random, seeded) unless given: identical inputs
    still get identical features, which is all the mechanics tests need.
    """
    adapter = adapter_for(loaded)
    if projector is None:
        torch.manual_seed(0)
        projector = Projector(ProjectorConfig(hidden=adapter.hidden_size)).eval()
    layout = NamespaceLayout(
        layers=adapter.num_layers, heads=adapter.num_heads, causal=adapter.causal, hidden=adapter.hidden_size,
        feature_dim=projector.config.dim,
    )
    batch = tokenize(loaded.tokenizer, list(texts))
    capture = adapter.capture(batch)
    features = projector.project(adapter.feature_source(batch))
    entries = [
        NewEntry(
            maps=maps.to(torch.float16).numpy(),
            token_hash=token_hash(batch.row_ids(row)),
            outputs=hidden.to(torch.float16).numpy() if outputs else None,
            feature=features[row],
        )
        for row, (maps, hidden) in enumerate(zip(capture.maps, capture.hidden, strict=True))
    ]
    return Captured(layout, model_fingerprint(loaded.model, loaded.tokenizer), projector, entries)


def fill_namespace(
    service: AttnStoreService,
    loaded: LoadedModel,
    texts: Sequence[str],
    *,
    namespace: str = "default",
    outputs: bool = True,
    int8: Int8Plan | None = None,
) -> Projector:
    """Create ``namespace`` in an open service and ingest ``texts`` captured with ``loaded``; returns the projector
    (with ``int8`` as its int8 plan)."""
    captured = capture_entries(loaded, texts, outputs=outputs)
    service.create_namespace(namespace, model=loaded.name, fingerprint=captured.fingerprint, layout=captured.layout)
    service.ingest(namespace, captured.fingerprint, captured.entries)
    captured.projector.int8 = int8
    service.set_projector(namespace, captured.projector.to_safetensors_bytes())
    return captured.projector


def plain_hidden(loaded: LoadedModel, texts: Sequence[str]) -> list[torch.Tensor]:
    """Each text's last hidden states ``(L, hidden)`` from the plain model (no store)."""
    batch = tokenize(loaded.tokenizer, list(texts))
    out = adapter_for(loaded).forward(batch)  # (B, P, hidden)
    return [out[row, :length] for row, length in enumerate(batch.lengths)]


def mean_pooled(loaded: LoadedModel, texts: Sequence[str]) -> np.ndarray:
    """Each text's mean of its last hidden states from the plain model, ``(n, hidden)``."""
    return torch.stack([hidden.mean(dim=0) for hidden in plain_hidden(loaded, texts)]).numpy()
