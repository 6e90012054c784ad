"""``attnstore build --prefix-blocks``: the prefix blocks of a corpus of prompts (causal models).

Each prompt's whole blocks of tokens are stored with their keys, values and
last hidden states (``attnstore_client.tiers.prefix_capture``); a block already
stored (another prompt with the same start) is stored once, and a prompt whose
blocks are all stored is not run at all. A prompt's blocks go in one write, so
an interrupted build leaves whole chains only.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from tqdm.auto import tqdm

from attnstore.protocol.prefix import DEFAULT_BLOCK_SIZE, PrefixDtype, chain_hashes
from attnstore.service import AttnStoreService
from attnstore_client.adapters import Adapter
from attnstore_client.tiers.prefix_capture import capture_prefix_blocks, prefix_layout_of


@dataclass(frozen=True)
class PrefixBuildConfig:
    """How a build stores prefix blocks."""

    block_size: int = DEFAULT_BLOCK_SIZE  # tokens per block (recorded in the namespace)
    dtype: PrefixDtype | None = None  # None: the model's compute dtype (exact); "float16" halves the bytes
    batch_size: int = 8  # prompts per forward (a 650-token SmolLM2 prompt's keys and values are 30 MB fp32)


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
    """Store the whole blocks of every row in ``namespace`` (recording its prefix layout on first use).

    Raises:
        UnsupportedModelError: the model is not causal, or has a sliding window.
        FingerprintMismatchError: the namespace stores blocks of another layout.
    """
    started = time.perf_counter()
    store = service.store
    layout = store.set_prefix_layout(
        namespace, prefix_layout_of(adapter, block_size=config.block_size, dtype=config.dtype)
    )
    todo = []
    for row in rows:
        hashes = chain_hashes(row, layout.block_size)
        if hashes and store.match_prefix(namespace, hashes) < len(hashes):
            todo.append(list(row))
    todo.sort(key=len, reverse=True)  # batches of alike lengths pad little
    added = 0
    with tqdm(total=len(todo), desc="prefix blocks", unit="prompt", disable=not progress) as bar:
        for start in range(0, len(todo), config.batch_size):
            batch = todo[start : start + config.batch_size]
            for blocks in capture_prefix_blocks(adapter, batch, layout, pad_id=pad_id):
                added += store.put_prefix_blocks(namespace, blocks)
            bar.update(len(batch))
    return PrefixBuildReport(len(todo), added, added * layout.block_bytes, time.perf_counter() - started)
