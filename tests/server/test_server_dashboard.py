"""docs/grafana-dashboard.json: it parses, and every query names metrics the daemon exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from attnstore.server.metrics import METRIC_NAMES

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json"
_SUFFIXES = ("_total", "_bucket", "_sum", "_count")


def test_every_dashboard_query_names_an_exported_metric() -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    assert exprs
    for expr in exprs:
        for name in re.findall(r"\b((?:attnstore|process)_[a-z_]+)\{", expr):
            base = next((name[: -len(s)] for s in _SUFFIXES if name.endswith(s)), name)
            assert base in METRIC_NAMES or name.startswith("process_"), f"{name} in {expr!r} is not exported"
