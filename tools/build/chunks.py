"""``attnstore build --chunks FILE``: the chunks of a file of texts, stored for the chunk tier (causal models).

Each line of a ``.txt`` file (or ``text`` of a ``.jsonl`` line) is a chunk: a
piece of text that prompts take as one of their segments (an exemplar, a
passage). It is tokenized on its own exactly as the client tokenizes a prompt's
segments (``call.sources.segment_tokens``), so its tokens are the same wherever
a prompt puts it, and computed on its own after the instruction
(``--instruction``; none: after nothing) with the chunk tier's own capture
(``tiers.chunks.capture``): its keys (before RoPE) and values at every layer,
keyed by ``chunk_key(instruction ids, chunk ids)``. The instruction is stored
too, as a chunk after nothing. Chunks already stored, and repeats in the file,
are computed once.

Chunks go to an embedded store (a folder: the namespace is made for the model if
it is missing) or to a daemon (``grpc://``, a write or admin token; the
namespace must exist: ``attnstore admin create-namespace``), a batch per put.
Each put is all or nothing, so an interrupted build leaves whole chunks only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from attnstore.errors import CorpusError, NamespaceNotFoundError, UnsupportedModelError
from attnstore.protocol.chunks import ChunkDtype, ChunkLayout, StoredChunk
from attnstore.service import AttnStoreService
from attnstore_client.adapters import adapter_for
from attnstore_client.call.sources import segment_tokens
from attnstore_client.connection import URL_SCHEMES, StoreConnection, connect
from attnstore_client.keys import model_fingerprint
from attnstore_client.models import LoadedModel
from attnstore_client.tiers.chunks.capture import capture_chunks
from attnstore_client.tiers.chunks.source import ChunkKV, chunk_key
from attnstore_client.tiers.chunks.store_source import model_chunk_layout, stored_kv_of
from attnstore_tools.build.namespace_layout import exact_tier_layout, token_limits
from attnstore_tools.corpus import read_texts

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChunkBuildConfig:
    """How a build stores chunks."""

    namespace: str = "default"
    instruction: str = ""  # the text chunks are computed after ("": after nothing)
    dtype: ChunkDtype = "float16"  # how chunks are stored (the chunk tier's default; float32: exact)
    batch_size: int = 32  # chunks per capture forward (and per put)


@dataclass(frozen=True)
class ChunkBuildReport:
    """What ``build --chunks`` did."""

    namespace: str
    texts: int  # lines of the file
    distinct: int  # distinct non-blank chunks
    skipped_blank: int
    skipped_long: int  # chunks over the model's positions with the instruction
    stored_before: int  # distinct chunks (the instruction included) the namespace had already
    added: int  # chunks the store added (the instruction included)
    bytes: int  # their bytes
    seconds: float


# Where chunks go: (layout, chunks) -> new ones; and which of some keys are stored already.
_Put = Callable[[ChunkLayout, Sequence[StoredChunk]], int]
_Known = Callable[[ChunkLayout, Sequence[bytes]], list[bool]]


def build_chunks(
    loaded: LoadedModel, texts: Sequence[str], put: _Put, known: _Known, config: ChunkBuildConfig = ChunkBuildConfig(),
    *, progress: bool = True,
) -> ChunkBuildReport:
    """Capture the chunks of ``texts`` (and the instruction) with ``loaded`` and ``put`` those not ``known``.

    Raises:
        UnsupportedModelError: not a Llama-like causal model without a sliding window.
        CorpusError: no usable chunk in ``texts``.
        FingerprintMismatchError: the namespace stores chunks of another layout or dtype.
    """
    started = time.perf_counter()
    adapter = adapter_for(loaded)
    if not adapter.causal:
        raise UnsupportedModelError(f"chunks need a causal (decoder) model; {loaded.name!r} is bidirectional: a"
                                    " chunk's keys would depend on what follows it")
    layout = model_chunk_layout(adapter, config.dtype)
    instruction, pieces, skipped_long = _tokenized(loaded, config.instruction, texts)
    blank = sum(1 for text in texts if not text.strip())
    if not pieces:
        raise CorpusError(f"no usable chunk in {len(texts)} lines: {blank} blank, {skipped_long} too long")
    todo: dict[bytes, tuple[int, ...]] = {chunk_key(instruction, ids): ids for ids in pieces}
    context: ChunkKV | None = None
    added = nbytes = before = 0
    if instruction:
        key = chunk_key(None, instruction)
        context = capture_chunks(adapter, [(None, instruction)], dtype=config.dtype)[0]
        if not known(layout, [key])[0]:
            chunk = StoredChunk(key, stored_kv_of(context, config.dtype), token_ids=np.asarray(instruction))
            added, nbytes = put(layout, [chunk]), chunk.kv.nbytes
        else:
            before += 1
    keys = list(todo)
    stored = known(layout, keys) if keys else []
    before += sum(stored)
    keys = [key for key, is_stored in zip(keys, stored, strict=True) if not is_stored]
    with tqdm(total=len(keys), desc="chunks", unit="chunk", disable=not progress) as bar:
        for start in range(0, len(keys), config.batch_size):
            batch = keys[start : start + config.batch_size]
            computed = capture_chunks(adapter, [(context, todo[key]) for key in batch], dtype=config.dtype,
                                      batch_size=config.batch_size)
            chunks = [StoredChunk(key, stored_kv_of(kv, config.dtype), token_ids=np.asarray(todo[key]),
                                  context_ids=np.asarray(instruction) if instruction else None)
                      for key, kv in zip(batch, computed, strict=True)]
            added += put(layout, chunks)
            nbytes += sum(chunk.kv.nbytes for chunk in chunks)
            bar.update(len(batch))
    return ChunkBuildReport(config.namespace, len(texts), len(todo), blank, skipped_long, before, added, nbytes,
                            time.perf_counter() - started)


def _tokenized(
    loaded: LoadedModel, instruction: str, texts: Sequence[str]
) -> tuple[tuple[int, ...], list[tuple[int, ...]], int]:
    """The instruction's ids and each distinct chunk's, as a prompt ``[instruction, chunk, question]`` gives them
    (the tokenizer's leading special tokens belong to the instruction); and the chunks too long to fit."""
    limit = int(loaded.model.config.max_position_embeddings)
    tokenizer = loaded.tokenizer
    distinct = list(dict.fromkeys(text for text in texts if text.strip()))
    head = segment_tokens(tokenizer, [[instruction, ""]], max_length=limit)[0]
    lead = tuple(head.ids[: head.segments[0]])
    pieces: list[tuple[int, ...]] = []
    skipped = 0
    for text in distinct:
        row = segment_tokens(tokenizer, [[instruction, text, ""]], max_length=1 << 30)[0]
        if len(row.ids) > limit:
            skipped += 1
            continue
        pieces.append(tuple(row.ids[row.segments[0] : row.segments[0] + row.segments[1]]))
    return lead, list(dict.fromkeys(piece for piece in pieces if piece)), skipped


def build_chunks_into(
    loaded: LoadedModel, texts: Sequence[str], store: str, config: ChunkBuildConfig, *, token: str | None = None,
    progress: bool = True,
) -> ChunkBuildReport:
    """:func:`build_chunks` into the store at ``store``: a folder (embedded) or a daemon URL.

    Raises:
        NamespaceNotFoundError: a daemon without the namespace.
        AuthError: the daemon refused the token (a write or admin token is needed).
    """
    fingerprint = model_fingerprint(loaded.model, loaded.tokenizer)
    if store.startswith(URL_SCHEMES[:2]):
        with connect(store, token=token) as connection:
            return build_chunks(loaded, texts, *_daemon(connection, config.namespace, fingerprint), config,
                                progress=progress)
    with AttnStoreService.open(Path(store), create=True) as service:
        try:
            service.check_fingerprint(config.namespace, fingerprint)
        except NamespaceNotFoundError:
            service.create_namespace(config.namespace, model=loaded.name, fingerprint=fingerprint,
                                     layout=exact_tier_layout(loaded), limits=token_limits(loaded))

        def put(layout: ChunkLayout, chunks: Sequence[StoredChunk]) -> int:
            return service.chunks.put(config.namespace, fingerprint, layout, chunks).stored

        def known(layout: ChunkLayout, keys: Sequence[bytes]) -> list[bool]:
            if service.chunks.layout(config.namespace) is None:
                return [False] * len(keys)
            return [n is not None for n in service.chunks.lengths(config.namespace, fingerprint, layout, keys)]

        return build_chunks(loaded, texts, put, known, config, progress=progress)


def _daemon(connection: StoreConnection, namespace: str, fingerprint: str) -> tuple[_Put, _Known]:
    has_chunks = connection.namespace(namespace).chunks is not None

    def put(layout: ChunkLayout, chunks: Sequence[StoredChunk]) -> int:
        counts = connection.put_chunks(namespace, fingerprint, layout, chunks, timeout=120.0)
        if counts.not_admitted:  # a write token's chunks are admitted like a node's: build with an admin token
            log.warning("the daemon did not admit %d of %d chunks (a write token's puts need --admit-after asks;"
                        " an admin token's are always admitted)", counts.not_admitted, len(chunks))
        return counts.stored

    def known(layout: ChunkLayout, keys: Sequence[bytes]) -> list[bool]:
        if not has_chunks:
            return [False] * len(keys)
        lengths = connection.match_chunks(namespace, fingerprint, layout, keys, timeout=60.0)
        return [n is not None for n in lengths]

    return put, known


def run_chunks(path: Path, loaded: LoadedModel, store: str, config: ChunkBuildConfig, *, token: str | None,
               progress: bool) -> str:
    """``attnstore build --chunks``: build, then the report's lines."""
    report = build_chunks_into(loaded, read_texts(path), store, config, token=token, progress=progress)
    return (f"namespace {report.namespace}: {report.added} chunks added ({report.bytes / 2**20:.1f} MiB) from"
            f" {report.texts} lines ({report.distinct} distinct, {report.stored_before} stored already,"
            f" {report.skipped_blank} blank, {report.skipped_long} too long) in {report.seconds:.1f} s")
