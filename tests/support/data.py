"""Small copies of the evaluation data (../shared/data) for benches run end to end in tests."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

from attnstore_tools.corpus import DEFAULT_DATA_DIR


def small_data(folder: Path, lines: int) -> Path:
    """``folder`` holding two Loghub systems cut to ``lines`` lines each, and STS-B dev (the warm-up texts)."""
    (folder / "loghub").mkdir(parents=True)
    for system in ("HDFS", "OpenSSH"):
        with (DEFAULT_DATA_DIR / "loghub" / f"{system}.tsv").open(encoding="utf-8", newline="") as f:
            rows = list(csv.reader(f, delimiter="\t"))
        with (folder / "loghub" / f"{system}.tsv").open("w", encoding="utf-8", newline="") as f:
            csv.writer(f, delimiter="\t").writerows(rows[: lines + 1])
    shutil.copy(DEFAULT_DATA_DIR / "stsb_dev.tsv", folder / "stsb_dev.tsv")
    return folder
