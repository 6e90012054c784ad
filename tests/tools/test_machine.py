"""What a measurement records of its machine and process: a child's peak memory is its own."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from attnstore_tools.machine import peak_rss_bytes

_CHILD = "import json; from attnstore_tools.machine import peak_rss_bytes; print(json.dumps(peak_rss_bytes()))"


def test_a_childs_peak_rss_is_its_own_not_the_high_water_mark_of_the_process_that_spawned_it() -> None:
    held = np.ones(400 * 2**20 // 8)  # 400 MiB touched in this process, then freed
    held.sum()
    del held
    assert peak_rss_bytes() > 400 * 2**20
    child = json.loads(subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                                      check=True).stdout)
    assert 1 * 2**20 < child < 200 * 2**20  # ru_maxrss would report more than 400 MiB here
