"""Encode time with write-back on vs off: all-miss calls (every row admitted), the daemon a subprocess.

    python scripts/write_back_overhead.py

all-MiniLM-L6-v2, 1 torch thread, distinct Loghub lines in calls of 64 rows
(batch 32), node-local exact tier off. "on" writes back to one namespace, "off"
reads another, so both miss every row; the order alternates call by call. The
daemon (``--admit-after 1``) runs on the same machine, so its WriteBack work is
counted against the client too.
"""

from __future__ import annotations

import csv
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests.support
from attnstore_client.cache import AttnCache
from attnstore_client.models import load_model
from attnstore_tools.admin.cold_start import create_exact_namespace
from tests.support.daemon import ADMIN_TOKEN, WRITE_TOKEN, DaemonProcess

CALL_ROWS, CALLS = 64, 64


def main() -> None:
    torch.set_num_threads(1)
    lines: list[str] = []
    for path in sorted(Path(__file__).resolve().parents[2].joinpath("shared/data/loghub").glob("*.tsv")):
        with path.open(encoding="utf-8") as f:
            lines += [row["content"] for row in csv.DictReader(f, delimiter="\t")]
    lines = list(dict.fromkeys(lines))
    work = Path(tempfile.mkdtemp(prefix="attnstore-wb-"))
    daemon = DaemonProcess(work / "store", work, extra_args=("--admit-after", "1")).start()
    loaded = load_model("minilm")
    with daemon.client(ADMIN_TOKEN) as admin:
        create_exact_namespace(admin, loaded, "on")
        create_exact_namespace(admin, loaded, "off")
    url = f"grpc://{daemon.target}"
    on = AttnCache(loaded, url, namespace="on", token=WRITE_TOKEN, write_back=True, exact_cache_bytes=0)
    off = AttnCache(loaded, url, namespace="off", token=WRITE_TOKEN, exact_cache_bytes=0)
    times: dict[str, list[float]] = {"on": [], "off": []}
    on.encode(lines[-CALL_ROWS:])  # warm-up
    off.encode(lines[-CALL_ROWS:])
    for k in range(CALLS):
        call_lines = lines[k * CALL_ROWS : (k + 1) * CALL_ROWS]
        for name, cache in ((("on", on), ("off", off)) if k % 2 == 0 else (("off", off), ("on", on))):
            start = time.perf_counter()
            cache.encode(call_lines, batch_size=32)
            times[name].append(time.perf_counter() - start)
            assert cache.last_stats.exact_hits == 0, cache.last_stats
    assert on.write_back is not None
    on.write_back.flush(60)
    print("write-back:", on.write_back.stats())  # noqa: T201 (a measurement script prints its figures)
    for what, stat in (("median", statistics.median), ("mean", statistics.mean)):
        ratio = stat(times["on"]) / stat(times["off"])
        line = f"{what} s/call: on {stat(times['on']):.4f} off {stat(times['off']):.4f} ratio {ratio:.4f}"
        print(line)  # noqa: T201
    on.close()
    off.close()
    daemon.stop()


if __name__ == "__main__":
    main()
