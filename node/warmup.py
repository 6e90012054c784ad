"""The node's warm-up: packed forwards of growing size, timed into the cost model before the first request.

The first forwards of a process are slow (kernels chosen, memory mapped in);
timing a few on synthetic rows makes the first requests fast and gives the cost
model its forward fit (``CostModel.forward_cost`` needs ``min_forwards`` of them),
so ``--max-batch-tokens`` is chosen from a fit from the start (``budget``). The
rows never touch the store: they would be looked up and could be written back.
"""

from __future__ import annotations

import logging
import time

import torch

from attnstore_client.adapters.packed import pack
from attnstore_client.cache import AttnCache

log = logging.getLogger(__name__)

# Tokens per warm-up forward, each run with rows of every length of ROW_LENGTHS (two lengths tell the fit's
# per-token and per-pair terms apart).
FORWARD_TOKENS = (64, 128, 256, 512, 1024, 2048, 3072, 4096)
ROW_LENGTHS = (16, 48)


def warm_up(cache: AttnCache, *, seed: int = 0) -> float:
    """Run and time the warm-up forwards on ``cache``'s model; returns the seconds taken."""
    adapter, cost_model = cache.adapter, cache.cost_model
    vocab = int(adapter.loaded.model.config.vocab_size)
    limit = cache.head.max_length
    generator = torch.Generator().manual_seed(seed)
    started = time.perf_counter()
    adapter.forward_packed(pack([[vocab - 1] * min(ROW_LENGTHS[0], limit)]).to(cache.device))  # untimed: the first
    for length in ROW_LENGTHS:
        length = min(length, limit)
        for tokens in FORWARD_TOKENS:
            count = max(1, tokens // length)
            ids = torch.randint(vocab // 10, vocab, (count, length), generator=generator).tolist()
            packed = pack(ids).to(cache.device)
            begun = time.perf_counter()
            adapter.forward_packed(packed)
            seconds = time.perf_counter() - begun
            cost_model.record_forward(length, computed_tokens=packed.tokens, replayed_tokens=0,
                                      pairs=count * length * length, seconds=seconds)
    elapsed = time.perf_counter() - started
    log.info("event=warmed_up forwards=%d seconds=%.2f fit=%s", len(ROW_LENGTHS) * len(FORWARD_TOKENS), elapsed,
             cost_model.forward_cost())
    return elapsed
