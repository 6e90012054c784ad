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
healthy within seconds. The node then serves, and runs the forwards left one at
a time whenever its queue has been empty for ``IDLE_SECONDS`` (a request arriving
meanwhile waits for that one forward); its own calls' forwards are timed too. Until the fit exists the
budget's default applies (``budget.FALLBACK_TOKENS``).
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
# Seconds the node's queue stays empty before a warm-up forward left runs: clients that send their next request
# as their last is answered find no forward in their way (a bench score run of 4 clients lost a third of its
# time to warm-up forwards run in the moments between calls).
IDLE_SECONDS = 1.0
WARMUP_SECONDS = 5.0  # the longest the timed forwards take together (the model's load comes before)


class WarmUp:
    """The warm-up forwards of ``cache``'s model (every size of ``FORWARD_TOKENS`` with rows of every length of
    ``ROW_LENGTHS``, growing), run within a time budget (``run``), then one at a time (``step``) while the node
    is idle, until all are timed.

    Args:
        cache: the opened cache.
        seed: of the synthetic rows.
    """

    def __init__(self, cache: AttnCache, *, seed: int = 0) -> None:
        self._cache = cache
        self._generator = torch.Generator().manual_seed(seed)
        self._left = [(tokens, length) for tokens in FORWARD_TOKENS for length in ROW_LENGTHS]
        self._per_token = 0.0  # seconds a token, as last timed
        self.forwards = 0  # timed so far

    @property
    def done(self) -> bool:
        """Whether every warm-up forward was timed."""
        return not self._left

    def run(self, seconds: float = WARMUP_SECONDS) -> float:
        """The first (untimed) forward, then timed ones until the next would pass ``seconds``; returns the seconds
        taken."""
        cache = self._cache
        vocab = int(cache.adapter.loaded.model.config.vocab_size)
        length = min(ROW_LENGTHS[0], cache.head.max_length)
        started = time.perf_counter()
        cache.adapter.forward_packed(pack([[vocab - 1] * length]).to(cache.device))  # untimed: the first
        self._per_token = (time.perf_counter() - started) / length
        while self._left and time.perf_counter() - started + self._per_token * self._left[0][0] <= seconds:
            self.step()
        elapsed = time.perf_counter() - started
        log.info("event=warmed_up forwards=%d left=%d seconds=%.2f budget_seconds=%g fit=%s", self.forwards,
                 len(self._left), elapsed, seconds, cache.cost_model.forward_cost())
        return elapsed

    def step(self) -> None:
        """Run and time the next warm-up forward into the cost model (none once ``done``)."""
        if not self._left:
            return
        tokens, length = self._left.pop(0)
        cache = self._cache
        vocab = int(cache.adapter.loaded.model.config.vocab_size)
        length = min(length, cache.head.max_length)
        count = max(1, tokens // length)
        ids = torch.randint(vocab // 10, vocab, (count, length), generator=self._generator).tolist()
        packed = pack(ids).to(cache.device)
        begun = time.perf_counter()
        cache.adapter.forward_packed(packed)
        took = time.perf_counter() - begun
        self._per_token = took / packed.tokens
        self.forwards += 1
        cache.cost_model.record_forward(length, computed_tokens=packed.tokens, replayed_tokens=0,
                                        pairs=count * length * length, seconds=took)
        if not self._left:
            log.info("event=warm_up_done forwards=%d fit=%s", self.forwards, cache.cost_model.forward_cost())


def warm_up(cache: AttnCache, *, seed: int = 0, seconds: float = WARMUP_SECONDS) -> WarmUp:
    """The warm-up of ``cache``'s model run for ``seconds`` at most (``WarmUp.run``); returns it, with the
    forwards still to time while the node is idle."""
    warmup = WarmUp(cache, seed=seed)
    warmup.run(seconds)
    return warmup
