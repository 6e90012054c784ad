"""``attnstore build``: fill a namespace from a corpus.

corpus → tokenize (lines over ``--max-length`` tokens are skipped and counted,
never truncated; exact duplicates are captured once) → capture maps, final
outputs and feature sources, spilling maps to a scratch folder so corpora larger
than memory work → train the feature projector, calibrate its distances to
replay fidelity and fit the fidelity gate (new namespaces; see
``projector_calibration``) → ingest maps, outputs, token ids and hashes, and
feature vectors in bounded transactions → with ``--int8``, choose the int8 plan
on the corpus (``build.int8``) → store the projector (with the gate and the plan).

A model without an adapter (``adapters.generic``: no maps to capture) gets an
exact-tier store instead: its outputs only, computed by the model's own forward
in length-sorted batches, in a namespace without a projector (clients serve
exact hits from it and write computed rows back to it; no map hits).

The projector is written last: a namespace is usable by clients only once it
has one. Any failure, Ctrl-C included, removes what the run wrote (the new
namespace, or the entries added to an existing one), so the store is left as it
was before the run.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
from tqdm.auto import tqdm

from attnstore.errors import ConfigError, CorpusError, NamespaceNotFoundError
from attnstore.protocol.records import CODECS, Codec, NamespaceLayout, NewEntry
from attnstore.service import AttnStoreService
from attnstore_client.adapters import Adapter, adapter_for
from attnstore_client.adapters.batch import batch_from_ids
from attnstore_client.connection import URL_SCHEMES
from attnstore_client.keys import model_fingerprint, token_hash
from attnstore_client.models import LoadedModel, load_model
from attnstore_client.projector import Projector
from attnstore_client.tiers.prefix.shared import shareable
from attnstore_tools.build.calibration import CalibrationConfig, CalibrationReport
from attnstore_tools.build.chunks import ChunkBuildConfig, run_chunks
from attnstore_tools.build.fit import FitConfig, FitReport, fit_projector, format_fit
from attnstore_tools.build.int8 import Int8Config, Int8Report, calibrate_int8, check_int8_model, format_int8
from attnstore_tools.build.namespace_layout import exact_tier_layout, token_limits
from attnstore_tools.build.prefix import PrefixBuildConfig, PrefixBuildReport, store_prefix_blocks
from attnstore_tools.build.training import MIN_CORPUS, TrainConfig, TrainReport
from attnstore_tools.corpus import read_texts

T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuildConfig:
    """Settings of one build."""

    namespace: str = "default"
    codec: Codec = "fp16"
    max_length: int = 256  # longer inputs are skipped and counted
    batch_size: int = 32  # rows per capture forward
    capture_bytes: int = 512 << 20  # cap on one capture batch's fp32 maps
    ingest_bytes: int = 256 << 20  # cap on one ingest transaction's fp16 maps
    train_limit: int = 8000  # inputs the projector trains on (a seeded sample)
    seed: int = 0
    # ``causal`` and ``seed`` are set from the model and ``seed``.
    train: TrainConfig = field(default_factory=TrainConfig)
    # Calibrates a new projector's distances to replay fidelity; None leaves it uncalibrated.
    calibration: CalibrationConfig | None = field(default_factory=CalibrationConfig)
    # Stores the corpus's prefix blocks (keys and values of whole blocks of tokens); None: for models the prefix tier
    # runs (causal, no sliding window: a Mistral with one gets none rather than a failed build).
    prefix_blocks: bool | None = None
    prefix: PrefixBuildConfig = field(default_factory=PrefixBuildConfig)
    # Stores the model's embedding layer with the projector (MiniLM: ~47 MB), from which the daemon derives
    # written-back rows' features; without it they are stored featureless until train-projector runs.
    embedding_layer: bool = True
    # Chooses the int8 plan (``build.int8``) on the corpus and stores it with the projector; None: no plan.
    int8: Int8Config | None = None


@dataclass(frozen=True)
class BuildReport:
    """What a build did."""

    namespace: str
    texts: int  # rows in the corpus
    entries: int  # entries added
    duplicates: int  # rows whose tokens were already in the corpus or the store
    skipped_too_long: int  # rows over ``max_length`` tokens
    skipped_empty: int  # blank rows
    stored_bytes: int  # bytes the namespace grew by
    seconds: float
    train: TrainReport | None  # None when an existing namespace's projector was reused
    calibration: CalibrationReport | None = None  # None when reused or not calibrated
    prefix: PrefixBuildReport | None = None  # None when no prefix blocks were stored
    int8: Int8Report | None = None  # None when no int8 plan was asked for
    # Why only the exact tier was built (outputs, no maps or projector): the model has no adapter. None: a full build.
    exact_only: str | None = None


@dataclass(frozen=True)
class _Row:
    ids: list[int]
    token_hash: bytes


@dataclass(frozen=True)
class _Captured:
    row: _Row
    source: torch.Tensor  # (L, hidden) fp32 feature source: the features clients will compute
    maps_path: Path  # (layers, heads, L, L) fp16 .npy
    outputs_path: Path  # (L, hidden) fp16 .npy


def build_namespace(
    loaded: LoadedModel,
    texts: Sequence[str],
    service: AttnStoreService,
    config: BuildConfig = BuildConfig(),
    *,
    progress: bool = True,
) -> BuildReport:
    """Capture a corpus with ``loaded`` and ingest it into ``config.namespace``.

    A new namespace gets a projector trained on (a sample of) the corpus; an
    existing one keeps its projector, and must belong to the same model.

    Returns:
        What was done.

    Raises:
        CorpusError: an empty corpus, no usable rows, or too few to train on.
        FingerprintMismatchError: the namespace exists for another model.
        ConfigError: a bad codec or namespace name, or an int8 plan asked of a model without a
            sentence-transformers pipeline or without an adapter.
    """
    started = time.perf_counter()
    if config.codec not in CODECS:
        raise CorpusError(f"unknown codec {config.codec!r}; choose one of {list(CODECS)}")
    if not texts:
        raise CorpusError("the corpus is empty: nothing to build")
    adapter = adapter_for(loaded)
    if not adapter.capabilities.can_replay:
        return _build_exact_tier(adapter, texts, service, config, progress)
    if config.int8 is not None:
        check_int8_model(loaded)  # before any work: it would be undone
    fingerprint = model_fingerprint(loaded.model, loaded.tokenizer)
    existing = _existing_projector(service, config.namespace, fingerprint)
    rows, skipped_long, skipped_empty = _rows(loaded, texts, config.max_length)
    if not rows:
        raise CorpusError(
            f"no usable rows in the corpus: {skipped_long} over --max-length {config.max_length} tokens,"
            f" {skipped_empty} blank"
        )
    unique = _unique_unstored(rows, service, config.namespace if existing is not None else None)
    if existing is None and len(unique) < MIN_CORPUS:
        raise CorpusError(
            f"the corpus is too small to train a projector: {len(unique)} distinct usable rows,"
            f" at least {MIN_CORPUS} needed"
        )
    before = _namespace_bytes(service, config.namespace)
    with tempfile.TemporaryDirectory(prefix="attnstore-build-") as scratch:
        captured = _capture(adapter, unique, Path(scratch), config, progress)
        train_report = calibration = None
        projector = existing
        if projector is None:
            projector, fit = _train(adapter, captured, config, progress)
            train_report, calibration = fit.train, fit.calibration
        created = existing is None and bool(captured)
        if created:
            service.create_namespace(config.namespace, model=loaded.name, fingerprint=fingerprint,
                                     layout=_layout(adapter, projector, config.codec), limits=token_limits(loaded))
        added: list[int] = []
        prefix = int8 = None
        try:
            _ingest(service, config.namespace, fingerprint, captured, projector, config, added, progress)
            if shareable(adapter) if config.prefix_blocks is None else config.prefix_blocks:
                prefix = store_prefix_blocks(adapter, [r.ids for r in rows], service, config.namespace, config.prefix,
                                             pad_id=loaded.tokenizer.pad_token_id, progress=progress)
            if config.int8 is not None:
                int8 = calibrate_int8(loaded, texts, config.int8, progress=progress)
                projector.int8 = int8.plan
            if created or config.int8 is not None:  # an existing namespace's projector is the same, with its plan
                # With the model's embedding layer: the daemon derives written-back rows' features from it.
                blob = projector.to_safetensors_bytes()
                layer = adapter.embedding_layer() if config.embedding_layer else None
                service.set_projector(config.namespace, blob if layer is None else layer.attach_to(blob))
        except BaseException:
            _undo(service, config.namespace, created, added)
            raise
    return BuildReport(
        namespace=config.namespace,
        texts=len(texts),
        entries=len(added),
        duplicates=len(rows) - len(added),
        skipped_too_long=skipped_long,
        skipped_empty=skipped_empty,
        stored_bytes=_namespace_bytes(service, config.namespace) - before,
        seconds=time.perf_counter() - started,
        train=train_report,
        calibration=calibration,
        prefix=prefix,
        int8=int8,
    )


def _build_exact_tier(
    adapter: Adapter, texts: Sequence[str], service: AttnStoreService, config: BuildConfig, progress: bool
) -> BuildReport:
    """``build_namespace`` for a model without an adapter: the corpus's outputs, in an exact-tier namespace (made if
    missing, no projector); an existing namespace of the model gets the rows it lacks."""
    started = time.perf_counter()
    why = adapter.capabilities.missing
    if config.int8 is not None:
        raise ConfigError(f"--int8 needs map capture: {why}")
    log.info("building an exact-tier store (outputs only, no maps or projector): %s", why)
    loaded = adapter.loaded
    fingerprint = model_fingerprint(loaded.model, loaded.tokenizer)
    try:
        service.check_fingerprint(config.namespace, fingerprint)
        existing = True
    except NamespaceNotFoundError:
        existing = False
    rows, skipped_long, skipped_empty = _rows(loaded, texts, config.max_length)
    if not rows:
        raise CorpusError(
            f"no usable rows in the corpus: {skipped_long} over --max-length {config.max_length} tokens,"
            f" {skipped_empty} blank"
        )
    unique = sorted(_unique_unstored(rows, service, config.namespace if existing else None), key=lambda r: -len(r.ids))
    before = _namespace_bytes(service, config.namespace)
    created = not existing and bool(unique)
    if created:
        service.create_namespace(config.namespace, model=loaded.name, fingerprint=fingerprint,
                                 layout=exact_tier_layout(loaded, config.codec), limits=token_limits(loaded))
    added: list[int] = []
    bar = tqdm(total=len(unique), desc="outputs", unit="row", disable=not progress)
    try:
        for batch_rows in groups_of(unique, config.batch_size, config.ingest_bytes, lambda r: len(r.ids)):
            batch = batch_from_ids([r.ids for r in batch_rows], loaded.tokenizer.pad_token_id or 0)
            hidden = adapter.forward(batch)  # (B, P, hidden)
            entries = [
                NewEntry(maps=None, token_hash=row.token_hash, token_ids=row.ids,
                         outputs=hidden[b, : len(row.ids)].to(torch.float16).cpu().numpy())
                for b, row in enumerate(batch_rows)
            ]
            added.extend(service.ingest(config.namespace, fingerprint, entries).entry_ids)
            bar.update(len(batch_rows))
    except BaseException:
        _undo(service, config.namespace, created, added)
        raise
    finally:
        bar.close()
    return BuildReport(
        namespace=config.namespace, texts=len(texts), entries=len(added), duplicates=len(rows) - len(added),
        skipped_too_long=skipped_long, skipped_empty=skipped_empty,
        stored_bytes=_namespace_bytes(service, config.namespace) - before, seconds=time.perf_counter() - started,
        train=None, exact_only=why,
    )


def _existing_projector(service: AttnStoreService, namespace: str, fingerprint: str) -> Projector | None:
    try:
        info = service.check_fingerprint(namespace, fingerprint)
    except NamespaceNotFoundError:
        return None
    if info.projector is None:
        raise CorpusError(
            f"namespace {namespace!r} exists but has no projector (made by CreateNamespace, or by a build"
            " that was killed); build into another namespace or a fresh store"
        )
    return Projector.from_safetensors_bytes(info.projector)


def _rows(loaded: LoadedModel, texts: Sequence[str], max_length: int) -> tuple[list[_Row], int, int]:
    rows, too_long, empty = [], 0, 0
    for text in texts:
        if not text.strip():
            empty += 1
            continue
        ids = loaded.tokenizer(text, add_special_tokens=True)["input_ids"]
        if len(ids) > max_length:
            too_long += 1
            continue
        rows.append(_Row(ids=list(ids), token_hash=token_hash(ids)))
    if too_long:
        log.warning("skipped %d rows over %d tokens", too_long, max_length)
    return rows, too_long, empty


def _unique_unstored(rows: list[_Row], service: AttnStoreService, namespace: str | None) -> list[_Row]:
    seen: dict[bytes, _Row] = {}
    for row in rows:
        seen.setdefault(row.token_hash, row)
    if namespace is None:
        return list(seen.values())
    return [row for row in seen.values() if service.store.find_by_hash(namespace, row.token_hash) is None]


def groups_of(items: Sequence[T], size: int, byte_cap: int, bytes_of: Callable[[T], int]) -> Iterator[list[T]]:
    """``items`` in consecutive groups of at most ``size`` items and about ``byte_cap`` bytes (at least one each)."""
    group: list[T] = []
    total = 0
    for item in items:
        nbytes = bytes_of(item)
        if group and (len(group) == size or total + nbytes > byte_cap):
            yield group
            group, total = [], 0
        group.append(item)
        total += nbytes
    if group:
        yield group


def _capture(
    adapter: Adapter, rows: list[_Row], scratch: Path, config: BuildConfig, progress: bool
) -> list[_Captured]:
    # Sorted by length: batches pad little, and capture memory grows with L².
    ordered = sorted(rows, key=lambda r: len(r.ids))
    per_token = adapter.num_layers * adapter.num_heads * 4
    pad_id = adapter.loaded.tokenizer.pad_token_id
    captured: list[_Captured] = []
    bar = tqdm(total=len(ordered), desc="capture", unit="row", disable=not progress)
    capture_groups = groups_of(ordered, config.batch_size, config.capture_bytes, lambda r: per_token * len(r.ids) ** 2)
    for batch_rows in capture_groups:
        batch = batch_from_ids([r.ids for r in batch_rows], pad_id)
        sources = adapter.feature_source(batch)
        capture = adapter.capture(batch)
        for row, source, maps, hidden in zip(batch_rows, sources, capture.maps, capture.hidden, strict=True):
            n = len(captured)
            maps_path, outputs_path = scratch / f"{n}.maps.npy", scratch / f"{n}.out.npy"
            np.save(maps_path, maps.to(torch.float16).numpy())
            np.save(outputs_path, hidden.to(torch.float16).numpy())
            captured.append(_Captured(row, source, maps_path, outputs_path))
        bar.update(len(batch_rows))
    bar.close()
    return captured


def _train(
    adapter: Adapter, captured: list[_Captured], config: BuildConfig, progress: bool
) -> tuple[Projector, FitReport]:
    fit_config = FitConfig(train_limit=config.train_limit, seed=config.seed, train=config.train,
                           calibration=config.calibration, progress=progress)
    try:
        return fit_projector(
            adapter, [c.row.ids for c in captured], [c.source for c in captured],
            [c.maps_path for c in captured], [c.outputs_path for c in captured], fit_config,
        )
    except CorpusError as exc:
        raise CorpusError(f"cannot train a projector on this corpus: {exc}") from None


def _layout(adapter: Adapter, projector: Projector, codec: Codec) -> NamespaceLayout:
    return NamespaceLayout(
        layers=adapter.num_layers,
        heads=adapter.num_heads,
        causal=adapter.causal,
        hidden=adapter.hidden_size,
        feature_dim=projector.config.dim,
        codec=codec,
    )


def _ingest(
    service: AttnStoreService,
    namespace: str,
    fingerprint: str,
    captured: list[_Captured],
    projector: Projector,
    config: BuildConfig,
    added: list[int],
    progress: bool,
) -> None:
    by_row = {id(c.row): c for c in captured}
    per_token = service.get_namespace(namespace).layout.map_nbytes(1)
    rows = [c.row for c in captured]
    bar = tqdm(total=len(rows), desc="ingest", unit="entry", disable=not progress)
    for batch_rows in groups_of(rows, 4096, config.ingest_bytes, lambda r: per_token * len(r.ids) ** 2):
        items = [by_row[id(r)] for r in batch_rows]
        features = projector.project([c.source for c in items])  # (n, dim)
        entries = [
            NewEntry(
                maps=np.load(c.maps_path),
                token_hash=c.row.token_hash,
                outputs=np.load(c.outputs_path),
                feature=feature,
                token_ids=c.row.ids,
            )
            for c, feature in zip(items, features, strict=True)
        ]
        result = service.ingest(namespace, fingerprint, entries)
        added.extend(result.entry_ids)
        bar.update(len(items))
    bar.close()


def _undo(service: AttnStoreService, namespace: str, created: bool, added: list[int]) -> None:
    log.warning("build failed: removing what it wrote to namespace %r", namespace)
    if created:
        service.drop_namespace(namespace)
    elif added:
        service.delete(namespace, added)


def _namespace_bytes(service: AttnStoreService, namespace: str) -> int:
    try:
        return sum(e.nbytes for e in service.store.entries(namespace))
    except NamespaceNotFoundError:
        return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``attnstore build``."""
    parser = subparsers.add_parser(
        "build",
        help="capture a corpus, train the projector and fill a namespace",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--model", required=True, help="model alias (minilm, smollm2) or a local model folder")
    parser.add_argument("--corpus", type=Path, help=".txt (one per line), .tsv or .jsonl (needed without --chunks)")
    parser.add_argument("--column", help="text column of a .tsv corpus, or field of a .jsonl one")
    parser.add_argument("--store", required=True,
                        help="map store folder (created if missing); with --chunks alone also grpc://HOST:PORT")
    parser.add_argument("--namespace", default="default", help="namespace to fill (default: default)")
    parser.add_argument("--codec", default="fp16", choices=CODECS, help="map codec of a new namespace")
    parser.add_argument("--max-length", type=int, default=256, help="skip rows over this many tokens (default 256)")
    parser.add_argument("--batch-size", type=int, default=32, help="rows per capture forward (default 32)")
    parser.add_argument("--train-limit", type=int, default=8000, help="inputs the projector trains on (default 8000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of sampling and training (default 0)")
    parser.add_argument("--no-calibration", action="store_true",
                        help="skip calibrating the projector's distances to replay fidelity and fitting"
                             " the fidelity gate (see the docs)")
    parser.add_argument("--prefix-blocks", action=argparse.BooleanOptionalAction, default=None,
                        help="store the prompts' prefix blocks (keys and values of whole blocks of tokens, for the"
                             " prefix tier); default: on for causal models without a sliding window")
    parser.add_argument("--prefix-block-size", type=int, default=32, help="tokens per prefix block (default 32)")
    parser.add_argument("--prefix-min-shared", type=int, default=2,
                        help="store a prefix block only when this many prompts start with it (default 2; 1: all)")
    parser.add_argument("--prefix-dtype", choices=["float32", "float16"],
                        help="prefix blocks' dtype (default: the model's, exact; float16 halves the bytes)")
    parser.add_argument("--chunks", type=Path, metavar="FILE",
                        help="store the chunks of FILE for the chunk tier (.txt one chunk per line, or .jsonl with"
                             " a text field; causal models): their keys and values computed after --instruction")
    parser.add_argument("--instruction", default="", help="the text chunks are computed after (default: none)")
    parser.add_argument("--chunk-dtype", default="float16", choices=["float16", "float32"],
                        help="chunks' dtype (default float16, the chunk tier's; float32 is exact)")
    parser.add_argument("--int8", action="store_true",
                        help="choose which linear layers clients may run in int8 (AttnCache(int8=True)) on a sample"
                             " of the corpus, keeping 99.5%% of it at cosine >= 0.99 to fp32, and store that plan"
                             " (about 4 minutes for all-MiniLM-L6-v2 on 2 cores; an existing namespace gets it too)")
    parser.add_argument("--token", help="bearer token of a grpc:// store (admin; a write token's chunks are admitted"
                        " as a node's are, and only into a namespace that records its chunk layout)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``attnstore build``."""
    if args.max_length < 1:
        raise CorpusError(f"--max-length must be >= 1, got {args.max_length}")
    if args.corpus is None and args.chunks is None:
        raise CorpusError("build needs --corpus FILE, --chunks FILE or both")
    if args.corpus is not None and args.store.startswith(URL_SCHEMES):
        raise CorpusError(f"--corpus builds into a store folder, not {args.store}; a daemon takes --chunks alone")
    loaded = load_model(args.model)
    if args.corpus is not None:
        _build_corpus(args, loaded)
    if args.chunks is not None:
        config = ChunkBuildConfig(args.namespace, args.instruction, args.chunk_dtype, args.batch_size)
        print(run_chunks(args.chunks, loaded, args.store, config, token=args.token, progress=not args.no_progress))
    return 0


def _build_corpus(args: argparse.Namespace, loaded: LoadedModel) -> None:
    texts = read_texts(args.corpus, column=args.column)
    config = BuildConfig(
        namespace=args.namespace,
        codec=args.codec,
        max_length=args.max_length,
        batch_size=args.batch_size,
        train_limit=args.train_limit,
        seed=args.seed,
        calibration=None if args.no_calibration else CalibrationConfig(),
        prefix_blocks=args.prefix_blocks,
        prefix=PrefixBuildConfig(block_size=args.prefix_block_size, dtype=args.prefix_dtype,
                                 min_shared=args.prefix_min_shared),
        int8=Int8Config() if args.int8 else None,
    )
    with AttnStoreService.open(args.store, create=True) as service:
        report = build_namespace(loaded, texts, service, config, progress=not args.no_progress)
    print(format_report(report))


def format_report(report: BuildReport) -> str:
    """A short human summary of a build."""
    lines = [
        f"namespace {report.namespace}: {report.entries} entries added from {report.texts} rows"
        f" ({report.duplicates} duplicates, {report.skipped_too_long} over max length,"
        f" {report.skipped_empty} blank)",
        f"stored {report.stored_bytes / 2**20:.1f} MiB in {report.seconds:.1f} s",
    ]
    if report.exact_only is not None:
        lines.append(f"an exact-tier store (outputs only, no maps or projector: no map hits): {report.exact_only}")
    if report.prefix is not None:
        p = report.prefix
        lines.append(f"prefix blocks: {p.blocks} added ({p.bytes / 2**20:.1f} MiB) from {p.prompts} prompts"
                     f" in {p.seconds:.1f} s")
    if report.int8 is not None:
        lines += format_int8(report.int8)
    return "\n".join(lines + format_fit(report.train, report.calibration))
