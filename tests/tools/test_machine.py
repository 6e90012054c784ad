"""What a measurement records of its machine and process: a child's peak memory is its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from attnstore_tools.machine import RssSampler, peak_rss_bytes

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
    sampler = RssSampler(os.getpid(), interval=0.01)
    sampler.samples.append(sampler.read())
    sampler.start()
    held = np.ones(200 * 2**20 // 8)  # 200 MiB of anonymous memory, touched
    # Hold it until the thread has sampled twice more: a fixed sleep missed it on a loaded CI machine.
    taken = len(sampler.samples)
    deadline = time.monotonic() + 30
    while len(sampler.samples) < taken + 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    del held
    sampler.stop()
    peaks = sampler.peaks()
    assert peaks["anon_peak"] - peaks["anon_start"] > 150 * 2**20
    assert abs(peaks["file_peak"] - peaks["file_start"]) < 50 * 2**20  # nothing mapped from files meanwhile
    assert peaks["rss_peak"] >= peaks["anon_peak"]


def test_the_sampler_refuses_to_report_peaks_of_no_sample() -> None:
    with pytest.raises(ValueError, match="no sample"):
        RssSampler(os.getpid()).peaks()
