"""``attnstore report``: eval run files in, RESULTS.md blocks and PNG plots out."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from attnstore.errors import ConfigError
from attnstore_tools.cli import main
from attnstore_tools.report.runs import read_run
from attnstore_tools.report.tables import Block, splice_blocks

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _row(method: str, setting: float | None, metric: float, *, default: bool = False, hit_rate: float = 0.45,
         e2e_incl: float = 1.22, groups: dict | None = None) -> dict:
    return {
        "method": method, "setting": setting, "default": default, "metric": metric, "delta": round(metric - 93.1, 2),
        "hit_rate": hit_rate, "exact_hits": 3000, "map_hits": 600, "misses": 4400, "fallbacks": 0,
        "layer_replays": 1234 if method in ("lazyformer", "san") else 0,
        "cosine": {"mean": 0.9995, "min": 0.9712, "share_099": 0.997},
        "groups": groups or {},
        "parts": {"exact_dup": {"queries": 3000, "metric": 99.0, "full": 99.0, "hit_rate": 1.0, "cosine_mean": 1.0},
                  "rest": {"queries": 5000, "metric": 90.0, "full": 90.1, "hit_rate": 0.12, "cosine_mean": 0.999}},
        "speedup": {"e2e_excl": 1.31, "e2e_incl": e2e_incl, "attn_excl": 2.1, "attn_incl": 1.6},
        "gamma": 2.2 if method == "attncache_f" else None,
        "time_s": {"total": 10.1, "retrieval": 0.4, "attention": 2.0, "full_total": 13.2, "full_attention": 4.2},
    }


def _run(task: str = "logs", model: str = "minilm", shots: int | None = None, default_metric: float = 93.0) -> dict:
    groups = {"HDFS": {"queries": 1000, "metric": 98.5, "full": 99.0, "hit_rate": 0.5},
              "BGL": {"queries": 1000, "metric": 90.2, "full": 90.2, "hit_rate": None}}
    return {
        "kind": "attnstore.eval/1", "task": task, "shots": shots, "model": model,
        "command": f"attnstore eval {task} --model {model} --json runs/eval/{task}-{model}.json",
        "metric": {"name": "accuracy", "unit": "%"},
        "machine": {"cores": 2, "torch_threads": 2, "torch": "2.13.0+cpu", "cpu": "AMD EPYC 7B13",
                    "date": "2026-11-22"},
        "store": {"url": f"local:runs/eval/stores/{task}-{model}", "namespace": task, "entries": 4276,
                  "bytes": 633000000},
        "queries": 8000, "batch_size": 32, "timing": {"queries": 256, "rounds": 5}, "default_threshold": 0.008,
        "full": {"metric": 93.1, "groups": {"HDFS": 99.0, "BGL": 90.2}, "parts": {}},
        "rows": [
            _row("attncache", 0.004, 93.08, hit_rate=0.30, e2e_incl=1.10),
            _row("attncache", 0.008, default_metric, default=True, groups=groups if task in ("logs", "mmlu") else {}),
            _row("attncache", 0.016, 91.5, hit_rate=0.61, e2e_incl=1.40),
            _row("output_cache", None, 93.1, hit_rate=0.375, e2e_incl=1.15),
            _row("lazyformer", 2, 90.4, e2e_incl=1.05),
            _row("san", 0.5, 89.9, e2e_incl=1.02),
            _row("attncache_f", 0.008, 92.7, e2e_incl=1.3),
        ],
    }


def _write(folder: Path, name: str, data: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def _report(tmp_path: Path) -> int:
    return main(["report", "--runs", str(tmp_path / "runs"), "--results", str(tmp_path / "docs" / "RESULTS.md"),
                 "--plots", str(tmp_path / "docs" / "plots")])


def test_tables_hold_the_runs_figures_with_the_default_row_in_bold(tmp_path: Path, capsys) -> None:
    _write(tmp_path / "runs", "logs-minilm.json", _run())
    assert _report(tmp_path) == 0
    text = (tmp_path / "docs" / "RESULTS.md").read_text(encoding="utf-8")
    assert "```sh\nattnstore eval logs --model minilm --json runs/eval/logs-minilm.json\n```" in text
    assert "AMD EPYC 7B13, 2 cores, torch 2.13.0+cpu, 2 torch threads, 2026-11-22" in text
    assert "Queries: 8,000, batch size 32. Timing: 256 queries, 5 rounds per method." in text
    # per group: overall row first, then each system; a null hit rate is a dash
    assert "| **all** | 8,000 | 93.10 | 93.00 | -0.10 | 45.0% | 3,000 | 600 |" in text
    assert "| HDFS | 1,000 | 99.00 | 98.50 | -0.50 | 50.0% | – | – |" in text
    assert "| BGL | 1,000 | 90.20 | 90.20 | +0.00 | – |" in text
    # sweep: ordered by threshold, the default row in bold
    assert ("| **0.008** | **93.00** | **-0.10** | **45.0%** | **3,000** | **600** | **0.9995** | **0.9712**"
            " | **99.7%** | **1.31×** | **1.22×** | **2.10×** | **1.60×** |") in text
    assert text.index("| 0.004 | 93.08 |") < text.index("| **0.008** |") < text.index("| 0.016 | 91.50 |")
    # exact-duplicate split
    assert "| exact dup | 3,000 | 99.00 | 99.00 | +0.00 | 100.0% | 1.0000 |" in text
    assert "| rest | 5,000 | 90.10 | 90.00 | -0.10 | 12.0% | 0.9990 |" in text
    # methods: full model first, attncache only at its default, layer methods count replays, γ or a dash
    methods = text[text.index("**Methods**"):]
    assert "| full model | 93.10 | – | – | 1.00× | 1.00× | 1.00× | 1.00× | – |" in methods
    assert ("| attncache 0.008 (default) | 93.00 | -0.10 | 45.0% | 1.31× | 1.22× | 2.10× | 1.60× | – |"
            in methods)
    assert "| lazyformer 2 | 90.40 | -2.70 | 1,234 replays |" in methods
    assert "| attncache_f 0.008 | 92.70 | -0.40 | 45.0% | 1.31× | 1.30× | 2.10× | 1.60× | 2.20 |" in methods
    assert "attncache 0.004" not in methods
    assert "![sweep](plots/logs-minilm-sweep.png)" in text and "![methods](plots/logs-minilm-methods.png)" in text
    # summary: one row per run
    assert "| logs | minilm | accuracy (%) | 93.10 | 93.00 | -0.10 | 45.0% | 1.22× | – |" in text
    out = capsys.readouterr().out
    assert "appended summary, logs-minilm" in out and "logs-minilm-sweep.png" in out


def test_the_simple_alternatives_lead_the_methods_and_the_summary_compares_the_default_with_dict_cache(
    tmp_path: Path,
) -> None:
    run = _run()
    run["rows"] += [_row("dict_cache", None, 93.1, hit_rate=0.375, e2e_incl=1.10),
                    _row("sentence_transformers", None, 93.1, hit_rate=0.0, e2e_incl=0.98)]
    _write(tmp_path / "runs", "logs-minilm.json", run)
    assert _report(tmp_path) == 0
    text = (tmp_path / "docs" / "RESULTS.md").read_text(encoding="utf-8")
    methods = text[text.index("**Methods**"):]
    order = [methods.index(f"| {name}") for name in ("full model", "sentence_transformers", "dict_cache",
                                                      "output_cache", "attncache 0.008 (default)")]
    assert order == sorted(order)
    # 1.22 / 1.10: the default row's speed over the dict cache's, both over the full model in the same run
    assert "| logs | minilm | accuracy (%) | 93.10 | 93.00 | -0.10 | 45.0% | 1.22× | 1.11× | – |" in text


def test_prose_outside_the_markers_is_kept_byte_for_byte(tmp_path: Path) -> None:
    _write(tmp_path / "runs", "logs-minilm.json", _run())
    before = "# Results\r\n\r\nHand-written, CRLF, trailing space \n\n<!-- report:logs-minilm -->\nold table\n"
    after = ("<!-- /report:logs-minilm -->\n\nMore prose — ünïcode.\n"
             "    <!-- report:logs-minilm --> (indented: prose, not a marker)\n")
    results = tmp_path / "docs" / "RESULTS.md"
    results.parent.mkdir(parents=True)
    results.write_bytes((before + after).encode("utf-8"))
    assert _report(tmp_path) == 0
    written = results.read_bytes().decode("utf-8")
    head = before.removesuffix("old table\n")
    assert written.startswith(head)
    assert "old table" not in written
    assert written[written.index("<!-- /report:logs-minilm -->"):].startswith(after)


def test_a_second_run_replaces_the_block_instead_of_adding_one(tmp_path: Path) -> None:
    _write(tmp_path / "runs", "logs-minilm.json", _run(default_metric=93.0))
    assert _report(tmp_path) == 0
    _write(tmp_path / "runs", "logs-minilm.json", _run(default_metric=92.25))
    assert _report(tmp_path) == 0
    text = (tmp_path / "docs" / "RESULTS.md").read_text(encoding="utf-8")
    assert text.count("<!-- report:logs-minilm -->") == 1 and text.count("## logs — minilm") == 1
    assert text.count("<!-- report:summary -->") == 1
    assert "**92.25**" in text and "**93.00**" not in text


def test_missing_blocks_are_appended_after_the_prose_summary_then_logs_first(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    _write(runs, "a-sts.json", _run(task="sts", model="minilm"))
    _write(runs, "b-mmlu.json", _run(task="mmlu", model="smollm2", shots=0))
    _write(runs, "c-logs.json", _run(task="logs", model="minilm"))
    results = tmp_path / "docs" / "RESULTS.md"
    results.parent.mkdir(parents=True)
    results.write_text("# Results\n\nProse without a trailing newline.", encoding="utf-8")
    assert _report(tmp_path) == 0
    text = results.read_text(encoding="utf-8")
    prose = "# Results\n\nProse without a trailing newline."
    assert text.startswith(prose + "\n\n## Summary\n\n<!-- report:summary -->\n")
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert headings == ["## Summary", "## logs — minilm", "## sts — minilm", "## mmlu — smollm2 (0-shot)"]
    assert "<!-- report:mmlu-smollm2-0shot -->" in text and text.endswith("<!-- /report:mmlu-smollm2-0shot -->\n")
    assert "| mmlu 0-shot | smollm2 |" in text
    assert "**Per subject**" in text and "**Per system**" in text
    sts = text[text.index("<!-- report:sts-minilm -->"):text.index("<!-- /report:sts-minilm -->")]
    assert "**Per" not in sts  # sts rows carry no groups


def test_other_json_files_under_runs_are_ignored(tmp_path: Path) -> None:
    _write(tmp_path / "runs", "logs-minilm.json", _run())
    _write(tmp_path / "runs" / "oracle", "loghub.json", {"oracle_hit_rate": 0.6, "per_query": []})
    assert _report(tmp_path) == 0
    text = (tmp_path / "docs" / "RESULTS.md").read_text(encoding="utf-8")
    assert [line for line in text.splitlines() if line.startswith("## ")] == ["## Summary", "## logs — minilm"]


def test_a_file_missing_a_field_raises_config_error_naming_the_file_and_field(tmp_path: Path) -> None:
    data = _run()
    del data["rows"][1]["speedup"]["e2e_incl"]
    path = _write(tmp_path / "runs", "broken.json", data)
    with pytest.raises(ConfigError, match=r"broken\.json: missing field rows\[1\]\.speedup\.e2e_incl"):
        read_run(path)
    assert _report(tmp_path) == 2  # the command reports it and writes nothing
    assert not (tmp_path / "docs" / "RESULTS.md").exists()


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: d.update(kind="attnstore.eval/2"),
     r"field kind must be one of attnstore\.eval/1; got 'attnstore\.eval/2'"),
    (lambda d: d.update(task="qa"), r"field task must be one of logs, sts, sst2, mmlu; got 'qa'"),
    (lambda d: d["rows"][0].update(metric="93"), r"field rows\[0\]\.metric must be a number or null"),
    (lambda d: d["rows"][0].update(default=True), r"more than one attncache row default"),
])
def test_a_file_with_a_wrong_value_raises_config_error_naming_the_field(tmp_path: Path, edit, message) -> None:
    data = copy.deepcopy(_run())
    edit(data)
    with pytest.raises(ConfigError, match=message):
        read_run(_write(tmp_path, "run.json", data))


def test_null_figures_render_as_dashes_and_a_null_command_as_a_note(tmp_path: Path) -> None:
    data = _run()
    data["command"] = None
    data["rows"][1].update(metric=None, delta=None, gamma=None)
    data["rows"][1]["speedup"]["e2e_incl"] = None
    data["rows"][1]["parts"]["exact_dup"] = {"queries": 0, "metric": None, "full": None, "hit_rate": None,
                                             "cosine_mean": None}
    run = read_run(_write(tmp_path / "runs", "logs-minilm.json", data))
    assert run.default_row is not None and run.default_row.metric is None
    assert _report(tmp_path) == 0
    text = (tmp_path / "docs" / "RESULTS.md").read_text(encoding="utf-8")
    assert "| exact dup | 0 | – | – | – | – | – |" in text
    assert "The command was not recorded" in text and "```sh" not in text
    assert "| logs | minilm | accuracy (%) | 93.10 | – | – | 45.0% | – | – |" in text


def test_plots_are_written_as_png_files(tmp_path: Path) -> None:
    _write(tmp_path / "runs", "logs-minilm.json", _run())
    assert _report(tmp_path) == 0
    for name in ("logs-minilm-sweep.png", "logs-minilm-methods.png"):
        data = (tmp_path / "docs" / "plots" / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE) and 1_000 < len(data) < 200_000


def test_a_plot_with_nothing_to_plot_is_skipped_with_a_note(tmp_path: Path, capsys) -> None:
    data = _run()
    data["rows"] = [r for r in data["rows"] if r["method"] == "output_cache"]
    _write(tmp_path / "runs", "logs-minilm.json", data)
    assert _report(tmp_path) == 0
    assert not (tmp_path / "docs" / "plots" / "logs-minilm-sweep.png").exists()
    assert (tmp_path / "docs" / "plots" / "logs-minilm-methods.png").read_bytes().startswith(PNG_SIGNATURE)
    text = (tmp_path / "docs" / "RESULTS.md").read_text(encoding="utf-8")
    assert "No sweep plot: no attncache row has a threshold" in text
    assert "No attncache row is marked default" in text
    assert "plot skipped: logs-minilm-sweep.png" in capsys.readouterr().out


def test_stale_blocks_stay_and_broken_markers_raise_config_error(tmp_path: Path) -> None:
    block = Block("logs-minilm", "logs — minilm", "new")
    stale = "<!-- report:old -->\nkept\n<!-- /report:old -->\n"
    spliced = splice_blocks(stale + "<!-- report:logs-minilm -->\nx\n<!-- /report:logs-minilm -->\n", [block],
                            tmp_path / "R.md")
    assert spliced.text.startswith(stale) and spliced.stale == ["old"] and spliced.replaced == ["logs-minilm"]
    for broken, message in [("<!-- report:logs-minilm -->\nx\n", "has no closing line"),
                            ("<!-- /report:logs-minilm -->\n", "closes but was not opened"),
                            ("<!-- report:a -->\n<!-- report:b -->\n", "opens inside block a"),
                            (stale + stale, "appears twice")]:
        with pytest.raises(ConfigError, match=message):
            splice_blocks(broken, [block], tmp_path / "R.md")
