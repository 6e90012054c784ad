"""The evaluation's variants: what they time."""

from __future__ import annotations

import threading
import time

from torch import nn

from attnstore_tools.eval.variants import AttentionTimer


class _Slow(nn.Module):
    def forward(self, x: float) -> float:
        time.sleep(0.05)  # the module's work, which the timer measures: not a wait for anything
        return x


def test_the_attention_timer_sums_one_module_run_on_two_threads_at_once() -> None:
    # The forward pool runs two forwards side by side: one attention module is inside two calls at a time.
    module = _Slow()
    barrier = threading.Barrier(2)

    def run() -> None:
        barrier.wait()
        module(1.0)

    with AttentionTimer([module]) as timer:
        threads = [threading.Thread(target=run) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert 0.09 < timer.seconds < 1.0  # both calls, each about 0.05 s
