"""Differential fuzz of ``encode()``: every row of every call equals sentence-transformers' own ``encode`` of the
same call with the same options, whatever collides in it.

Calls are composed at random (hypothesis) from texts built to collide (``fuzz_texts``: case, accent and
whitespace variants, repeats, empty and over-long texts, unicode), some stored in the store with their outputs
(exact hits), some with their maps alone (map hits), most not at all, and run through ``AttnCache`` in every
configuration that changes a row's path: embedded (a real LMDB store) and through a real daemon with write-back
on, this process's exact tier on and off, the exact tiers off (map hits every time), packed and padded forwards,
side by side or not, the map tier on and off, batch sizes small enough that a call crosses windows of the stream,
and every ``encode`` option. Computed
rows and exact hits must be within cosine 0.9999 of the reference (token embeddings token by token), map hits
within the fidelity the gate promises (0.99), every row's kind set, and texts that repeat give equal rows.

The fast profile runs in the suite; a long run is ``python -m pytest tests/fuzz --hypothesis-profile long``
(``ATTNSTORE_FUZZ_EXAMPLES`` examples per test; docs/concepts/guarantees.md, "How it is checked").
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fuzz_harness import Tally, fuzz_settings
from fuzz_texts import MAPS_ONLY, STORED, colliding_calls
from hypothesis import assume, given
from hypothesis import strategies as st
from sentence_transformers import SentenceTransformer

from attnstore.protocol.records import TokenLimits
from attnstore_client.cache import AttnCache
from attnstore_client.models import LoadedModel, resolve_model_path
from attnstore_client.tiers.cost_model import CostSettings
from tests.support.caches import capture_entries
from tests.support.daemon import ADMIN_TOKEN, WRITE_TOKEN, DaemonProcess
from tests.support.vectors import row_cosines

pytestmark = pytest.mark.real_model

COMPUTED = 0.9999  # computed rows and exact hits (fp16 outputs)
MAPPED = 0.99  # map hits: what the fidelity gate promises of a hit
KINDS = {"exact", "map", "miss", "fallback"}
MAX_ROWS = 70  # with batch_size <= 4 a window of the stream is at most 64 rows: long calls cross windows


@pytest.fixture(scope="module")
def reference() -> SentenceTransformer:
    return SentenceTransformer(str(resolve_model_path("minilm")), device="cpu")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, minilm_model: LoadedModel) -> Iterator[DaemonProcess]:
    """A real daemon on a real LMDB store holding ``STORED`` with outputs and ``MAPS_ONLY`` with maps alone."""
    workdir = tmp_path_factory.mktemp("fuzz-encode")
    process = DaemonProcess(workdir / "store", workdir, extra_args=("--admit-after", "1")).start()
    stored = capture_entries(minilm_model, STORED)
    maps_only = capture_entries(minilm_model, MAPS_ONLY, outputs=False, projector=stored.projector)
    limits = TokenLimits(len(minilm_model.tokenizer), int(minilm_model.model.config.max_position_embeddings))
    with process.client(ADMIN_TOKEN) as admin:
        admin.create_namespace("default", model=minilm_model.name, fingerprint=stored.fingerprint,
                               layout=stored.layout, projector=stored.projector.to_safetensors_bytes(), limits=limits)
        admin.ingest("default", stored.fingerprint, stored.entries + maps_only.entries)
    yield process
    assert process.stop() == 0, process.log()


_SMALL_BUDGET = 112 * 2**20  # 2 forwards of one 256-token row at 72 KiB a token take 72 MiB of it


@pytest.fixture(scope="module")
def caches(daemon: DaemonProcess, minilm_model: LoadedModel) -> Iterator[dict[str, AttnCache]]:
    """One cache per way of reaching the store; every lookup asked (``explore=1``), hits at distance 0 only."""
    always = CostSettings(min_samples=0, explore=1.0)
    store = Path(daemon.store)
    opened = {
        "embedded": AttnCache(minilm_model, f"local:{store}", max_distance=1e-6, cost=always),
        "embedded, no local tier": AttnCache(minilm_model, f"local:{store}", max_distance=1e-6, cost=always,
                                             exact_cache_bytes=0),
        # Map hits every time: nothing computed is kept, so a stored row's tokens always replay its maps.
        "embedded, maps only": AttnCache(minilm_model, f"local:{store}", max_distance=1e-6, cost=always, exact=False),
        "daemon, write-back": AttnCache(minilm_model, f"grpc://{daemon.target}", token=WRITE_TOKEN,
                                        max_distance=1e-6, cost=always, write_back=True),
        # Every exact hit computed again and compared with what the store holds: a correct row is never reported.
        "daemon, audit every hit": AttnCache(minilm_model, f"grpc://{daemon.target}", token=WRITE_TOKEN,
                                             max_distance=1e-6, cost=always, audit_rate=1.0),
        # A budget leaving a few hundred tokens per forward: over-long rows' forwards and projection batches are
        # cut by it, the exact tier capped by it.
        "embedded, small memory budget": AttnCache(minilm_model, f"local:{store}", max_distance=1e-6, cost=always,
                                                   memory_budget=_SMALL_BUDGET),
        # Computed rows on the model's exported graphs (``tiers.engines``), every band: held to the same floor.
        "embedded, openvino engine": AttnCache(minilm_model, f"local:{store}", max_distance=1e-6, cost=always,
                                               engine="openvino"),
        "embedded, onnxruntime engine": AttnCache(minilm_model, f"local:{store}", max_distance=1e-6, cost=always,
                                                  engine="onnxruntime"),
    }
    yield opened
    for cache in opened.values():
        cache.close()


@dataclass(frozen=True)
class Options:
    """One call's ``encode`` options and path switches."""

    batch_size: int
    packed: bool
    side_by_side: bool
    maps: bool
    output_value: str | None
    normalize_embeddings: bool
    precision: str
    truncate_dim: int | None
    convert_to_tensor: bool

    def encode_kwargs(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "output_value": self.output_value, "precision": self.precision,
                "normalize_embeddings": self.normalize_embeddings, "truncate_dim": self.truncate_dim,
                "convert_to_tensor": self.convert_to_tensor, "show_progress_bar": False}


options = st.builds(
    Options,
    batch_size=st.integers(1, 4),
    packed=st.booleans(),
    side_by_side=st.booleans(),
    maps=st.booleans(),
    output_value=st.sampled_from(("sentence_embedding", "sentence_embedding", "token_embeddings", None)),
    normalize_embeddings=st.booleans(),
    precision=st.sampled_from(("float32", "float32", "float32", "int8", "uint8", "binary", "ubinary")),
    truncate_dim=st.sampled_from((None, None, 64, 383)),
    convert_to_tensor=st.booleans(),
)


def _numpy(value: Any) -> np.ndarray:
    return value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)


def _check_floats(ours: np.ndarray, theirs: np.ndarray, kinds: tuple[str, ...], texts: list[str]) -> None:
    assert ours.shape == theirs.shape
    cosines = row_cosines(ours, theirs)
    for row, (cosine, kind) in enumerate(zip(cosines, kinds, strict=True)):
        floor = MAPPED if kind == "map" else COMPUTED
        assert cosine >= floor, f"row {row} ({kind}, {texts[row]!r}): cosine {cosine:.6f} < {floor}"


def _check_quantised(ours: np.ndarray, theirs: np.ndarray, floats: np.ndarray, precision: str,
                     kinds: tuple[str, ...]) -> None:
    """Quantised rows of computed rows and exact hits: what float rounding (fp16 stored outputs: 2e-3) can move.

    int8 steps are the call's own range over 255, so a value may move by that much over a step, plus one for the
    floor; a binary bit may flip only where the reference's value is within that much of zero. Map hits are held
    to their cosine on the floats alone (a replayed row moves the call's ranges further).
    """
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype, (ours.shape, theirs.shape)
    rows = [row for row, kind in enumerate(kinds) if kind != "map"]
    if len(rows) < len(kinds) and precision in ("int8", "uint8"):
        return
    if precision in ("int8", "uint8"):
        step = (floats.max(axis=0) - floats.min(axis=0)) / 255  # (dim,)
        allowed = 1 + np.ceil(2e-3 / np.where(step == 0, 1.0, step))
        moved = np.abs(ours[rows].astype(np.int64) - theirs[rows].astype(np.int64))
        assert (moved <= allowed).all(), f"{precision}: a value moved {moved.max()} steps"
        return
    flipped = np.unpackbits(ours[rows].view(np.uint8), axis=-1) != np.unpackbits(theirs[rows].view(np.uint8), axis=-1)
    near_zero = np.abs(floats[rows]) < 2e-3
    assert not (flipped[:, : near_zero.shape[1]] & ~near_zero).any(), f"{precision}: a bit flipped away from zero"


def _check_repeats(texts: list[str], result: Any, output_value: str | None) -> None:
    """Equal texts give equal rows, bit for bit."""
    first: dict[str, int] = {}
    for row, text in enumerate(texts):
        earlier = first.setdefault(text, row)
        if earlier == row:
            continue
        keys = ("sentence_embedding", "token_embeddings") if output_value is None else (None,)
        for key in keys:
            mine, theirs = (result[row], result[earlier]) if key is None else (result[row][key], result[earlier][key])
            np.testing.assert_array_equal(_numpy(mine), _numpy(theirs), f"row {row} != row {earlier} ({key})")


def _check_call(cache: AttnCache, reference: SentenceTransformer, texts: list[str], opts: Options) -> tuple[str, ...]:
    cache.packed, cache.side_by_side, cache.maps = opts.packed, opts.side_by_side, opts.maps
    kwargs = opts.encode_kwargs()
    quantised = opts.precision != "float32"
    try:
        theirs = reference.encode(texts, **kwargs)
    except (ValueError, TypeError) as refused:  # int8 ranges from one row, quantised features: refused alike
        with pytest.raises((ValueError, TypeError)):
            cache.encode(texts, **kwargs)
        return (type(refused).__name__,)
    ours = cache.encode(texts, **kwargs)
    kinds = cache.last_row_kinds
    assert len(kinds) == len(texts) and set(kinds) <= KINDS, kinds
    _check_repeats(texts, ours, opts.output_value)
    if opts.output_value is None:
        for row, kind in enumerate(kinds):
            mine = ours[row]["token_embeddings"]
            want = theirs[row]["token_embeddings"][: len(mine)]  # sentence-transformers' are its batch's, padded
            _check_floats(_numpy(mine), _numpy(want), (kind,) * len(mine), [texts[row]] * len(mine))
        _check_floats(np.stack([_numpy(r["sentence_embedding"]) for r in ours]),
                      np.stack([_numpy(r["sentence_embedding"]) for r in theirs]), kinds, texts)
        return kinds
    if opts.output_value == "token_embeddings":
        assert [len(row) for row in ours] == [len(row) for row in theirs]
        token_kinds = tuple(kind for row, kind in zip(ours, kinds, strict=True) for _ in range(len(row)))
        mine, want = np.concatenate([_numpy(r) for r in ours]), np.concatenate([_numpy(r) for r in theirs])
    else:
        assert isinstance(ours, torch.Tensor) == opts.convert_to_tensor
        token_kinds, mine, want = kinds, _numpy(ours), _numpy(theirs)
    if not quantised:
        _check_floats(mine, want, token_kinds, texts if opts.output_value != "token_embeddings" else
                      [text for text, row in zip(texts, ours, strict=True) for _ in range(len(row))])
        return kinds
    floats = reference.encode(texts, **{**kwargs, "precision": "float32", "convert_to_tensor": False})
    if opts.output_value == "token_embeddings":
        floats = np.concatenate([_numpy(r) for r in floats])
    _check_quantised(mine, want, _numpy(floats), opts.precision, token_kinds)
    return kinds


CONFIGURATIONS = ("embedded", "embedded, no local tier", "embedded, maps only", "daemon, write-back",
                  "daemon, audit every hit", "embedded, small memory budget", "embedded, openvino engine",
                  "embedded, onnxruntime engine")


def test_every_row_of_a_colliding_call_equals_sentence_transformers(
    caches: dict[str, AttnCache], reference: SentenceTransformer, tally: Tally, daemon: DaemonProcess
) -> None:
    @fuzz_settings(fast_examples=48)
    @given(texts=colliding_calls(MAX_ROWS), opts=options, where=st.sampled_from(CONFIGURATIONS))
    def check(texts: list[str], opts: Options, where: str) -> None:
        # sentence-transformers cannot stack quantised token rows of unequal lengths into one tensor
        assume(not (opts.output_value == "token_embeddings" and opts.precision != "float32"
                    and opts.convert_to_tensor))
        kinds = _check_call(caches[where], reference, texts, opts)
        tally.count("encode", f"{where} {opts}", kinds)

    check()
    # The audit at 100% found nothing wrong in what the store holds, and the daemon quarantined nothing.
    assert caches["daemon, audit every hit"].audit_findings == ()
    with daemon.client(ADMIN_TOKEN) as admin:
        assert admin.list_quarantine() == []


def test_the_issue_s_three_row_call_returns_three_equal_vectors(
    caches: dict[str, AttnCache], reference: SentenceTransformer
) -> None:
    texts = ["Quick Brown Fox", "quick brown fox", "quick brown fox"]
    for where, cache in caches.items():
        vectors = cache.encode(texts)
        assert all(cache.last_row_kinds), (where, cache.last_row_kinds)
        np.testing.assert_array_equal(vectors[0], vectors[1])
        np.testing.assert_array_equal(vectors[1], vectors[2])
        assert row_cosines(vectors, reference.encode(texts)).min() >= COMPUTED
