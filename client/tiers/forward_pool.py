"""Forwards side by side on the CPU: as many at once as torch has threads, each on one thread of its own.

One forward on two cores through torch's own threading splits every op between
them and meets at the end of each: a packed forward of all-MiniLM-L6-v2 spends
about 13 ms outside its GEMMs whatever its size (dispatch, small ops, attention
of short rows), during which a core waits, and a core the host slows holds the
other at every op. Forwards side by side, one thread each, overlap all of that:
the log lines' forwards ran 12% faster than one at a time on two threads, on an
AMD EPYC with 2 cores (``docs/BENCHMARKS.md``, "Encode"). The GEMMs themselves
run as fast either way.

The caller hands over a window's forwards and takes each result as it ends, on its
own thread (pooling, writing the result): tiers, sinks and the call's tallies are
never touched from a worker.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed, wait
from typing import TypeVar

import torch

T = TypeVar("T")


def _one_thread() -> None:
    torch.set_num_threads(1)  # this thread's own setting (OpenMP's and MKL's are per thread)


class ForwardPool:
    """Threads that run forwards side by side, started on first use and stopped by ``close``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._workers = 0

    def run(self, jobs: Sequence[Callable[[], T]], workers: int) -> Iterator[T]:
        """Each job's result, in the order the jobs end: ``workers`` of them at once on threads of one torch
        thread each, or, for one worker or one job, here and in order. When the iterator is closed (an error
        included) no job is left running: those not started are cancelled, the others waited for.
        """
        if workers <= 1 or len(jobs) <= 1:
            for job in jobs:
                yield job()
            return
        executor = self._executor_of(workers)
        # A set: each future leaves it once its result is taken, so a window's results are never all held at once.
        futures: set[Future[T]] = {executor.submit(job) for job in jobs}
        # What the caller does meanwhile (pooling the results) runs on one thread too: two threads of its own
        # on cores the workers hold would wait on each other at every op (it took 1 s more of the logs call).
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for future in as_completed(futures):
                futures.discard(future)
                yield future.result()
        finally:
            for future in futures:
                future.cancel()
            wait(futures)
            torch.set_num_threads(threads)

    def _executor_of(self, workers: int) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None or self._workers != workers:
                if self._executor is not None:
                    self._executor.shutdown(wait=True)
                self._executor = ThreadPoolExecutor(workers, thread_name_prefix="attnstore-forward",
                                                    initializer=_one_thread)
                self._workers = workers
            return self._executor

    def close(self) -> None:
        """Stop the threads (after the jobs running end); a later ``run`` starts them again."""
        with self._lock:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
