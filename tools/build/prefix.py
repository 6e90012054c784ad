"""``attnstore build --prefix-blocks``: the prefix blocks of a corpus of prompts (causal models).

A block is stored when at least ``min_shared`` prompts of the corpus start with
it (default 2: a start that several prompts share, such as an instruction or
few-shot exemplars, is likely to start future prompts too; a prompt's own text
is not). Since a block's key covers every token before it, the blocks a prompt
shares with others are always its first ones: each prompt stores a prefix of
its chain. Blocks are stored with their keys, values and last hidden states
(``attnstore_client.tiers.prefix.capture``), each once; a prompt whose kept
blocks are all stored is not run at all, and one that is run is run on its
kept blocks only. A prompt's blocks go in one write, so an interrupted build
leaves whole chains only.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from tqdm.auto import tqdm

from attnstore.protocol.prefix import DEFAULT_BLOCK_SIZE, PrefixDtype, chain_hashes
from attnstore.service import AttnStoreService
from attnstore_client.adapters import Adapter
from attnstore_client.tiers.prefix import capture_prefix_blocks, prefix_layout_of


@dataclass(frozen=True)
class PrefixBuildConfig:
    """How a build stores prefix blocks."""

    block_size: int = DEFAULT_BLOCK_SIZE  # tokens per block (recorded in the namespace)
    dtype: PrefixDtype | None = None  # None: the model's compute dtype (exact); "float16" halves the bytes
    batch_size: int = 8  # prompts per forward (a 650-token SmolLM2 prompt's keys and values are 30 MB fp32)
    min_shared: int = 2  # prompts of the corpus that must start with a block for it to be stored (1: every block)


@dataclass(frozen=True)
class PrefixBuildReport:
    """What the prefix stage of a build stored."""

    prompts: int  # prompts run (those with a block not stored yet)
    blocks: int  # blocks added
    bytes: int  # their bytes
    seconds: float


def store_prefix_blocks(
    adapter: Adapter, rows: Sequence[Sequence[int]], service: AttnStoreService, namespace: str,
    config: PrefixBuildConfig, *, pad_id: int, progress: bool = False,
) -> PrefixBuildReport:
    """Store the shared blocks of the rows in ``namespace``, recording its prefix layout with the first ones
    (a namespace without blocks gets no layout, so clients never ask it for prefixes).

    Raises:
        UnsupportedModelError: the model is not causal, or has a sliding window.
        FingerprintMismatchError: the namespace stores blocks of another layout.
    """
    started = time.perf_counter()
    prefixes = service.store.require_prefixes("prefixes (building prefix blocks)")
    layout = prefix_layout_of(adapter, block_size=config.block_size, dtype=config.dtype)
    stored = prefixes.layout(namespace)
    if stored is not None and stored != layout:
        layout = prefixes.set_layout(namespace, layout)  # refused: the namespace records another layout
    chains = [chain_hashes(row, layout.block_size) for row in rows]
    starts = Counter(h for chain in chains for h in set(chain))
    todo = []
    for row, chain in zip(rows, chains, strict=True):
        kept = sum(1 for h in chain if starts[h] >= config.min_shared)  # counts fall along a chain: a prefix
        if kept and (stored is None or prefixes.match(namespace, chain[:kept]) < kept):
            todo.append(list(row[: kept * layout.block_size]))
    todo.sort(key=len, reverse=True)  # batches of alike lengths pad little
    if todo and stored is None:
        prefixes.set_layout(namespace, layout)
    added = 0
    with tqdm(total=len(todo), desc="prefix blocks", unit="prompt", disable=not progress) as bar:
        for start in range(0, len(todo), config.batch_size):
            batch = todo[start : start + config.batch_size]
            for blocks in capture_prefix_blocks(adapter, batch, layout, pad_id=pad_id):
                added += prefixes.put(namespace, blocks)
            bar.update(len(batch))
    return PrefixBuildReport(len(todo), added, added * layout.block_bytes, time.perf_counter() - started)
