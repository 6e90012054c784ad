"""What a measurement records of its machine and process: a child's peak memory is its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from attnstore_tools.machine import RssSampler, peak_rss_bytes
from tests.support.wait import wait_until

# Touches 200 MiB of anonymous memory when told to, holds it until its stdin closes.
_HOLDER = """
import sys
import numpy as np
print("ready", flush=True)
sys.stdin.readline()
held = np.ones(200 * 2**20 // 8)
print("held", flush=True)
sys.stdin.read()
"""
_CHILD = "import json; from attnstore_tools.machine import peak_rss_bytes; print(json.dumps(peak_rss_bytes()))"


def test_a_childs_peak_rss_is_its_own_not_the_high_water_mark_of_the_process_that_spawned_it() -> None:
    held = np.ones(400 * 2**20 // 8)  # 400 MiB touched in this process, then freed
    held.sum()
    del held
    assert peak_rss_bytes() > 400 * 2**20
    child = json.loads(subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                                      check=True).stdout)
    assert 1 * 2**20 < child < 200 * 2**20  # ru_maxrss would report more than 400 MiB here


def test_the_sampler_reports_anonymous_memory_held_during_the_block_apart_from_file_backed_memory() -> None:
    # A child of its own, not this worker: in a worker that ran other tests, a garbage collection or another
    # test's thread freeing memory meanwhile took 108 MiB off the 200 held (CI, 2026-11-28).
    child = subprocess.Popen([sys.executable, "-c", _HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    assert child.stdin is not None and child.stdout is not None
    try:
        assert child.stdout.readline().strip() == "ready"
        sampler = RssSampler(child.pid, interval=0.01)
        sampler.samples.append(sampler.read())
        sampler.start()
        child.stdin.write("hold\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "held"
        # Hold it until the thread has sampled twice more: a fixed sleep missed it on a loaded CI machine.
        taken = len(sampler.samples)
        wait_until(lambda: len(sampler.samples) >= taken + 2, 30, "two more samples of the held memory", poll=0.01)
        sampler.stop()
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    peaks = sampler.peaks()
    assert peaks["anon_peak"] - peaks["anon_start"] > 150 * 2**20
    assert abs(peaks["file_peak"] - peaks["file_start"]) < 50 * 2**20  # nothing mapped from files meanwhile
    assert peaks["rss_peak"] >= peaks["anon_peak"]


def test_the_sampler_refuses_to_report_peaks_of_no_sample() -> None:
    with pytest.raises(ValueError, match="no sample"):
        RssSampler(os.getpid()).peaks()
