"""``attnstore eval icl``: every method scored against full prefill on prompts in segments (tiny Llama)."""

from __future__ import annotations

import numpy as np

from attnstore_tools.eval.icl import IclTask, evaluate_icl, format_icl, plot_icl
from tests.support.caches import tiny_loaded

INSTRUCTION = "w2 w3 w4 "
EXEMPLARS = ["w20 w21 w22 w10 ", "w30 w31 w11 ", "w40 w41 w42 w43 w10 ", "w50 w51 w11 "]


def test_every_method_is_scored_against_full_prefill_printed_and_plotted(tmp_path):
    llama = tiny_loaded("llama")
    queries = ["w60 w61", "w62 w63 w64", "w65"]
    prompts = [[INSTRUCTION, EXEMPLARS[q], EXEMPLARS[(q + 1) % 4], EXEMPLARS[(q + 2) % 4], query]
               for q, query in enumerate(queries)]
    task = IclTask("toy", INSTRUCTION, ("w10", "w11"), EXEMPLARS, EXEMPLARS, queries, queries, np.array([0, 1, 0]))
    report = evaluate_icl(llama, prompts, task, ratios=(0.5, 1.0), recent=(1,), batch_size=2, progress=False)
    methods = {m["method"]: m for m in report["methods"]}
    assert list(methods) == ["full", "prefix", "full_reuse", "cacheblend@0.5", "cacheblend@1", "a3@0.5", "a3@1",
                             "full_reuse+1", "cacheblend@0.5+1", "cacheblend@1+1", "a3@0.5+1", "a3@1+1"]
    assert methods["a3@1+1"]["agreement"] == 100.0
    # The last exemplar computed in full costs more tokens than none.
    assert methods["full_reuse"]["computed_share"] < methods["full_reuse+1"]["computed_share"] < 1.0
    assert 0.0 <= report["clear_share"] <= 1.0
    assert report["chunks_stored"] == 1 + 4  # the instruction and every exemplar, before any method is timed
    for exact in ("full", "prefix", "a3@1", "cacheblend@1"):
        assert methods[exact]["agreement"] == 100.0 and methods[exact]["cosine_min"] > 0.9999
    assert methods["full"]["computed_share"] == 1.0
    assert methods["full_reuse"]["computed_share"] < methods["a3@0.5"]["computed_share"] < 1.0
    assert methods["prefix"]["computed_share"] < 1.0
    table = format_icl(report)
    assert "a3@0.5" in table and "agree" in table
    plot_icl(report, tmp_path / "icl.png")
    assert (tmp_path / "icl.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
