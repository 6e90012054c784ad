"""Prompts in segments fused from a chunk source: each prompt's parts looked up, the missing ones computed.

For a prompt ``instruction, chunk, ..., chunk, question`` (token counts per
segment, ``Row.segments``):

1. the instruction is looked up as a chunk after nothing, each chunk as a chunk
   after that instruction (``source.chunk_key``);
2. a missing instruction is computed on its own and stored (it is exact: a true
   prefix); a missing chunk is computed on its own after the instruction and
   stored for the next prompts, and in this prompt it is computed in place, at
   every layer, with everything before it (so it costs what a full forward would),
   as are the last ``ChunkSettings.recent`` chunks, stored or not;
3. the prompts run through ``fusion.fused_forward`` a batch at a time.

A prompt whose instruction or a chunk the source holds damaged (a store's
``ChecksumError``) is not fused: it is left for the other tiers, which compute
it in full, and the damaged part is not computed on its own or put back.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from attnstore_client.adapters import Adapter
from attnstore_client.call.settings import ChunkSettings
from attnstore_client.tiers.chunks.capture import capture_chunks
from attnstore_client.tiers.chunks.fusion import FusedRow, fused_forward
from attnstore_client.tiers.chunks.source import ChunkKV, ChunkSource, ChunkTokens, chunk_key

# Checks the chunks a source served and gives them back, a wrong one replaced (``audit.ChunkAudit``): called with
# the chunks found, what was wanted (key -> context, ids), the settings, the batch size and the device.
ChunkCheck = Callable[
    [dict[bytes, ChunkKV], Mapping[bytes, tuple[ChunkKV | None, Sequence[int]]], ChunkSettings, int, torch.device],
    dict[bytes, ChunkKV],
]


@dataclass
class FusionCounts:
    """What fusing some prompts took."""

    stored_tokens: int = 0  # prompt tokens whose keys and values came from the source (instruction included)
    chosen_tokens: int = 0  # of the stored chunk tokens, those computed again from the selection layer on
    candidate_tokens: int = 0  # stored chunk tokens (instructions not included)
    token_layers: int = 0  # tokens times layers the fused forwards computed
    captured: int = 0  # instructions and chunks computed on their own and put in the source
    damaged: int = 0  # prompts left unfused: the source holds their instruction or a chunk damaged
    bytes_fetched: int = 0
    fetch_s: float = 0.0  # looking chunks up in the source
    capture_s: float = 0.0  # computing the missing ones on their own


@dataclass(frozen=True, slots=True)
class _Segments:
    """A prompt cut into its instruction, chunks and question."""

    instruction: tuple[int, ...]
    chunks: tuple[tuple[int, tuple[int, ...]], ...]  # (start, ids) of each non-empty chunk
    question: int  # tokens of the question

    @classmethod
    def of(cls, ids: Sequence[int], segments: Sequence[int]) -> _Segments:
        starts = [0]
        for count in segments:
            starts.append(starts[-1] + count)
        chunks = tuple(
            (starts[k], tuple(ids[starts[k] : starts[k + 1]])) for k in range(1, len(segments) - 1) if segments[k]
        )
        return cls(tuple(ids[: segments[0]]), chunks, segments[-1])


def fuse_prompts(
    adapter: Adapter, source: ChunkSource, prompts: Sequence[tuple[Sequence[int], Sequence[int]]],
    settings: ChunkSettings, *, batch_size: int = 32, device: torch.device | None = None,
    counts: FusionCounts | None = None, audit: ChunkCheck | None = None,
) -> list[torch.Tensor | None]:
    """The question's last hidden states ``(question, hidden)`` of every prompt, fused from ``source``; None for
    a prompt whose instruction or a chunk the source holds damaged (``counts.damaged``).

    Args:
        adapter: a Llama-like causal model's adapter.
        source: stored chunks; the missing ones are put in it.
        prompts: ``(ids, segments)`` per prompt: its token ids and its segments' token counts (at least two
            segments, the question not empty).
        settings: method, ratio, selection layer, dtype of captured chunks.
        batch_size: prompts per fused forward.
        device: where the model runs (default: its parameters').
        counts: where to add what it took.
        audit: checks the chunks the source served (``ChunkAudit``), and gives them back, a wrong one replaced;
            None: none checked.

    Raises:
        UnsupportedModelError: not a Llama-like causal model without a sliding window.
    """
    device = device or next(adapter.model.parameters()).device
    counts = counts if counts is not None else FusionCounts()
    cut = [_Segments.of(ids, segments) for ids, segments in prompts]
    damaged: set[bytes] = set()
    instructions = _lookup(adapter, source, {chunk_key(None, c.instruction): (None, c.instruction) for c in cut
                                             if c.instruction}, settings, batch_size, device, counts, damaged,
                           audit=audit)
    unfused = {i for i, c in enumerate(cut) if c.instruction and chunk_key(None, c.instruction) in damaged}
    wanted: dict[bytes, tuple[ChunkKV | None, tuple[int, ...]]] = {}
    contexts: dict[bytes, tuple[int, ...]] = {}  # key -> the instruction a chunk is computed after
    for i, c in enumerate(cut):
        if i in unfused:
            continue  # its chunks' context is unusable: they are not computed on their own either
        context = instructions.get(chunk_key(None, c.instruction)) if c.instruction else None
        for _, chunk in c.chunks:
            wanted[chunk_key(c.instruction, chunk)] = (context, chunk)
            contexts[chunk_key(c.instruction, chunk)] = c.instruction
    missing: set[bytes] = set()
    chunks = _lookup(adapter, source, wanted, settings, batch_size, device, counts, damaged, missing=missing,
                     contexts=contexts, audit=audit)
    unfused |= {i for i, c in enumerate(cut)
                if any(chunk_key(c.instruction, chunk) in damaged for _, chunk in c.chunks)}
    counts.damaged += len(unfused)
    fused = [i for i in range(len(cut)) if i not in unfused]
    rows = [_row(prompts[i][0], cut[i], instructions, chunks, missing, device, settings.recent) for i in fused]
    out: list[torch.Tensor | None] = [None] * len(cut)
    for start in range(0, len(rows), batch_size):
        batch = rows[start : start + batch_size]
        for i, states in zip(fused[start : start + batch_size], fused_forward(adapter, batch, settings), strict=True):
            out[i] = states
        for row in batch:
            counts.stored_tokens += sum(part.length for _, part in row.parts)
            counts.chosen_tokens += row.chosen
            counts.candidate_tokens += row.candidates
            counts.token_layers += row.computed
    return out


def _lookup(
    adapter: Adapter, source: ChunkSource, wanted: dict[bytes, tuple[ChunkKV | None, tuple[int, ...]]],
    settings: ChunkSettings, batch_size: int, device: torch.device, counts: FusionCounts, damaged: set[bytes],
    missing: set[bytes] | None = None, contexts: dict[bytes, tuple[int, ...]] | None = None,
    audit: ChunkCheck | None = None,
) -> dict[bytes, ChunkKV]:
    """The chunks of ``wanted`` (key -> context, ids) from the source; those it holds damaged named in
    ``damaged``; the missing ones computed, put (with their ids and ``contexts``' token ids: a store derives
    their keys from them) and (when ``missing`` is given) named in it."""
    started = time.perf_counter()
    found = source.get_many(list(wanted), damaged) if wanted else {}
    counts.bytes_fetched += sum(chunk.nbytes for chunk in found.values())
    counts.fetch_s += time.perf_counter() - started
    if audit is not None and found:
        found = audit(found, wanted, settings, batch_size, device)
    absent = [key for key in wanted if key not in found and key not in damaged]
    if absent:
        started = time.perf_counter()
        computed = capture_chunks(adapter, [wanted[key] for key in absent], dtype=settings.dtype,
                                  batch_size=batch_size, device=device)
        for key, chunk in zip(absent, computed, strict=True):
            source.put(key, chunk, ChunkTokens(wanted[key][1], (contexts or {}).get(key)))
            found[key] = chunk
        counts.captured += len(absent)
        counts.capture_s += time.perf_counter() - started
        if missing is not None:
            missing.update(absent)
    return found


def _row(
    ids: Sequence[int], cut: _Segments, instructions: dict[bytes, ChunkKV], chunks: dict[bytes, ChunkKV],
    missing: set[bytes], device: torch.device, recent: int,
) -> FusedRow:
    """A prompt's fused row: its instruction and stored chunks as parts; its question, missing chunks and last
    ``recent`` chunks computed always."""
    tokens = torch.tensor(list(ids), dtype=torch.long, device=device)
    always = torch.zeros(len(ids), dtype=torch.bool, device=device)
    always[len(ids) - cut.question :] = True
    parts = [(0, instructions[chunk_key(None, cut.instruction)])] if cut.instruction else []
    for number, (start, chunk) in enumerate(cut.chunks):
        key = chunk_key(cut.instruction, chunk)
        if key in missing or number >= len(cut.chunks) - recent:
            always[start : start + len(chunk)] = True
        else:
            parts.append((start, chunks[key]))
    return FusedRow(tokens, len(cut.instruction), parts, always, cut.question)
