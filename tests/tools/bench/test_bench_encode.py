"""``bench encode``: one call of N rows per method in child processes, time, peak RSS and fidelity, on real logs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnstore.errors import ConfigError
from attnstore_tools.bench.encode import load_data
from attnstore_tools.cli import main as cli_main
from tests.support.data import small_data

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Small logs data and one work folder for the module: the store is built by the first run, reused after."""
    root = tmp_path_factory.mktemp("bench-encode")
    return small_data(root / "data", 40), root / "work"


@pytest.mark.soak
def test_a_short_run_times_every_method_in_its_own_child_and_reports_rss_overhead_and_fidelity(
    tmp_path: Path, logs: tuple[Path, Path],
) -> None:
    data, work = logs
    out, plot = tmp_path / "encode.json", tmp_path / "encode.png"
    code = cli_main(["bench", "encode", "--data-dir", str(data), "--rows", "30,90", "--repeats", "1",
                     "--work-dir", str(work), "--json", str(out), "--plot", str(plot)])
    report = json.loads(out.read_text())
    assert code == 0 and plot.stat().st_size > 0 and report["stored_rows"] == 40
    assert [result["rows"] for result in report["results"]] == [30, 90]
    for result in report["results"]:
        methods = result["methods"]
        assert set(methods) == {"sentence_transformers", "dict", "attnstore"}  # the default methods
        assert all(m["seconds"] > 0 and m["peak_rss_bytes"] > 100 * 2**20 for m in methods.values())
        assert 0 <= methods["attnstore"]["overhead_s"] < methods["attnstore"]["seconds"]
        assert result["frac_cos_099"] >= 0.95 and result["speedup_vs_dict"] > 0
        assert set(result["template_accuracy"]) == set(methods)
        assert methods["attnstore"]["stats"]["rows"] == result["rows"]
    # The store was built once and is kept for the next run.
    assert len(list((work / "logs").glob("store-*.built"))) == 1


def test_bad_rows_or_methods_are_refused_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["bench", "encode", "--rows", "ten", "--work-dir", str(tmp_path)]) != 0
    assert "--rows 'ten' must be comma-separated integers" in capsys.readouterr().err
    assert cli_main(["bench", "encode", "--methods", "plain", "--work-dir", str(tmp_path)]) != 0
    assert ("each must be one of ['sentence_transformers', 'dict', 'attnstore', 'attnstore_exact', 'attnstore_int8',"
            " 'onnx_fp32',") in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # refused before anything was built


def test_store_rows_stores_the_first_k_lines_of_each_system_and_queries_the_ones_after(tmp_path: Path) -> None:
    data = small_data(tmp_path / "data", 40)
    stored, queries, labels, stored_labels = load_data("logs", data, 30)
    assert (len(stored), len(queries)) == (60, 20) and len(labels or []) == 20 and len(stored_labels or []) == 60
    default = load_data("logs", data)
    assert (len(default[0]), len(default[1])) == (40, 40)  # the halves
    assert not set(queries) - set(default[1])  # queries come from the end of each system
    with pytest.raises(ConfigError, match="--store-rows 40 leaves no query of HDFS.tsv's 40 lines"):
        load_data("logs", data, 40)
    with pytest.raises(ConfigError, match="--store-rows must be >= 1"):
        load_data("logs", data, 0)


@pytest.mark.soak
def test_the_attnstore_exact_method_runs_attncache_without_its_map_tier_beside_the_default(
    tmp_path: Path, logs: tuple[Path, Path],
) -> None:
    data, work = logs
    out = tmp_path / "encode.json"
    code = cli_main(["bench", "encode", "--data-dir", str(data), "--rows", "60", "--repeats", "1",
                     "--methods", "dict,attnstore,attnstore_exact", "--work-dir", str(work), "--json", str(out)])
    result = json.loads(out.read_text())["results"][0]
    exact, default = result["methods"]["attnstore_exact"], result["methods"]["attnstore"]
    assert code == 0 and exact["stats"]["rows"] == default["stats"]["rows"] == 60
    # Without the map tier no row is projected or skipped, no map fetched, none a map hit (the exact tier's
    # lookups still count as retrieval).
    stats = exact["stats"]
    assert stats["map_hits"] == stats["skipped"] == stats["projection_s"] == stats["fetch_s"] == 0
    assert default["stats"]["map_hits"] + default["stats"]["skipped"] > 0  # the default's map tier saw rows
    assert exact["speedup_vs_dict"] > 0
    # Without a sentence-transformers run the dict's vectors (sentence-transformers') are the reference.
    assert result["fidelity_reference"] == "dict" and exact["frac_cos_099"] >= 0.95
    assert result["speedup_vs_dict"] == default["speedup_vs_dict"]  # the default's figures stay at the top level


@pytest.mark.soak
def test_the_attnstore_audit_method_recomputes_its_exact_hits_at_the_rate_and_finds_none_wrong(
    tmp_path: Path, logs: tuple[Path, Path],
) -> None:
    data, work = logs
    out = tmp_path / "encode.json"
    code = cli_main(["bench", "encode", "--data-dir", str(data), "--rows", "60", "--repeats", "1",
                     "--methods", "dict,attnstore,attnstore_audit", "--audit-rate", "1", "--work-dir", str(work),
                     "--json", str(out)])
    result = json.loads(out.read_text())["results"][0]
    audited, default = result["methods"]["attnstore_audit"]["stats"], result["methods"]["attnstore"]["stats"]
    assert code == 0 and default["audited"] == 0 and default["exact_hits"] > 0
    # Every store hit recomputed (this process's own exact tier is not audited), none of them wrong.
    assert audited["audited"] == default["exact_hits"] - default["local_hits"] and audited["audit_mismatches"] == 0
    assert result["methods"]["attnstore_audit"]["frac_cos_099"] >= 0.95
