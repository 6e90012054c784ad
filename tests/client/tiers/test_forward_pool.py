"""Forwards side by side (``tiers.forward_pool``): every result back, one torch thread per worker, nothing left
running after an error or ``close``."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch

from attnstore_client.tiers.forward_pool import ForwardPool


def _workers() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("attnstore-forward")}


def test_every_jobs_result_comes_back_from_workers_of_one_torch_thread_each() -> None:
    pool = ForwardPool()
    seen: list[tuple[str, int]] = []

    def job(k: int) -> int:
        seen.append((threading.current_thread().name, torch.get_num_threads()))
        time.sleep(0.01)  # a forward's work, so both workers take jobs; what is asserted holds for any length
        return k

    threads = torch.get_num_threads()
    try:
        results = list(pool.run([lambda k=k: job(k) for k in range(6)], workers=2))
    finally:
        pool.close()
    assert sorted(results) == list(range(6))
    assert all(name.startswith("attnstore-forward") and count == 1 for name, count in seen)
    assert torch.get_num_threads() == threads  # the caller's own setting is given back


def test_one_worker_or_one_job_runs_here_in_order() -> None:
    pool = ForwardPool()
    others = _workers()  # other pools' (caches not yet collected)
    here = threading.current_thread().name
    names: list[str] = []

    def job(k: int) -> int:
        names.append(threading.current_thread().name)
        return k

    assert list(pool.run([lambda k=k: job(k) for k in range(3)], workers=1)) == [0, 1, 2]
    assert list(pool.run([lambda: job(7)], workers=4)) == [7]
    assert set(names) == {here} and _workers() <= others


def test_an_error_in_a_job_is_raised_with_no_job_left_running() -> None:
    pool = ForwardPool()
    running = threading.Event()
    ended: list[int] = []

    def slow(k: int) -> int:
        running.set()
        time.sleep(0.2)  # a forward's work: the 10 queued after the first would take 1 s on 2 workers
        ended.append(k)
        return k

    def bad() -> int:
        running.wait(5)
        raise RuntimeError("forward failed")

    jobs = [bad, lambda: slow(1), *[lambda k=k: slow(k) for k in range(2, 12)]]
    try:
        with pytest.raises(RuntimeError, match="forward failed"):
            list(pool.run(jobs, workers=2))
        settled = list(ended)
    finally:
        pool.close()  # joins the workers: a job still running after the error would end (and be counted) first
    assert ended == settled and len(ended) < 11  # the running job was waited for; the queued ones never ran


def test_close_stops_the_workers_and_a_later_run_starts_them_again() -> None:
    pool = ForwardPool()
    others = _workers()  # other pools' (caches not yet collected)
    assert sorted(pool.run([lambda: 1, lambda: 2], workers=2)) == [1, 2]
    assert _workers() - others  # started (one or two: a worker done with its job takes the next)
    pool.close()
    assert _workers() <= others
    assert sorted(pool.run([lambda: 3, lambda: 4], workers=2)) == [3, 4]
    pool.close()
    assert _workers() <= others


def test_a_result_taken_from_the_pool_is_not_held_by_it_until_the_run_ends() -> None:
    class Result:
        pass

    pool = ForwardPool()
    taken: list[weakref.ref[Result]] = []
    try:
        for result in pool.run([Result for _ in range(6)], workers=2):
            taken.append(weakref.ref(result))
            del result
            gc.collect()
            assert all(ref() is None for ref in taken[:-1])  # the results before this one: freed, not held
    finally:
        pool.close()
    assert len(taken) == 6
