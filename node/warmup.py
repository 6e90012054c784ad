"""The node's warm-up: packed forwards of growing size, timed into the cost model before the first request, within a
time budget.

The first forwards of a process are slow (kernels chosen, memory mapped in);
timing a few on synthetic rows makes the first requests fast and gives the cost
model its forward fit (``CostModel.forward_cost`` needs ``min_forwards`` of them),
so ``--max-batch-tokens`` is chosen from a fit from the start (``budget``). The
rows never touch the store: they would be looked up and could be written back.

The forwards stop once the next one would pass ``seconds`` (``WARMUP_SECONDS``):
a decoder's forwards can take seconds each on a small CPU (SmolLM2 on 2 busy
cores: 16 forwards up to 4,096 tokens took 212 s), and a node must say it is
healthy within seconds. A warm-up cut short leaves the fit to the node's own
calls (every forward is timed); until it exists the budget's default applies
(``budget.FALLBACK_TOKENS``).
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
WARMUP_SECONDS = 5.0  # the longest the timed forwards take together (the model's load comes before)


def warm_up(cache: AttnCache, *, seed: int = 0, seconds: float = WARMUP_SECONDS) -> float:
    """Run and time the warm-up forwards on ``cache``'s model, growing, each size with rows of every length, until
    the next would pass ``seconds``; returns the seconds taken."""
    adapter, cost_model = cache.adapter, cache.cost_model
    vocab = int(adapter.loaded.model.config.vocab_size)
    limit = cache.head.max_length
    generator = torch.Generator().manual_seed(seed)
    started = time.perf_counter()
    adapter.forward_packed(pack([[vocab - 1] * min(ROW_LENGTHS[0], limit)]).to(cache.device))  # untimed: the first
    per_token = (time.perf_counter() - started) / min(ROW_LENGTHS[0], limit)  # seconds a token, as last timed
    forwards = 0
    for tokens in FORWARD_TOKENS:
        if time.perf_counter() - started + 2 * per_token * tokens > seconds:  # both row lengths of this size
            break
        for length in ROW_LENGTHS:
            length = min(length, limit)
            count = max(1, tokens // length)
            ids = torch.randint(vocab // 10, vocab, (count, length), generator=generator).tolist()
            packed = pack(ids).to(cache.device)
            begun = time.perf_counter()
            adapter.forward_packed(packed)
            took = time.perf_counter() - begun
            per_token = took / packed.tokens
            forwards += 1
            cost_model.record_forward(length, computed_tokens=packed.tokens, replayed_tokens=0,
                                      pairs=count * length * length, seconds=took)
    elapsed = time.perf_counter() - started
    log.info("event=warmed_up forwards=%d seconds=%.2f budget_seconds=%g fit=%s", forwards, elapsed, seconds,
             cost_model.forward_cost())
    return elapsed
