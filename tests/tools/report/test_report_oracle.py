"""``attnstore report --oracle``: eval oracle files in, one RESULTS.md block per namespace out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnstore.errors import ConfigError
from attnstore_tools.cli import main
from attnstore_tools.eval.oracle.command import KIND
from attnstore_tools.eval.oracle.thresholds import QueryResult, Scored, report_parts
from attnstore_tools.report.oracle_tables import oracle_blocks


def _result(index: int, distance: float, cosine: float, *, group: str, duplicate: bool = False) -> QueryResult:
    return QueryResult(
        index=index, group=group, length=5, duplicate=duplicate, calibration=False, answer=None,
        methods={
            "oracle_same_length": Scored(1, 5, 0.0, 1.0, None),
            "projector": Scored(2, 5, distance, cosine, None),
            "mean_pooled": Scored(3, 5, distance, 0.5, None),
        },
    )


def _oracle_file(folder: Path, namespace: str = "loghub") -> Path:
    """An oracle file whose figures come from the tool's own ``report_parts``."""
    results = [_result(0, 0.1, 1.0, group="HDFS", duplicate=True), _result(1, 0.2, 1.0, group="HDFS"),
               _result(2, 0.3, 0.9, group="BGL"), _result(3, 0.9, 1.0, group="BGL")]
    thresholds = {"projector": 0.15, "mean_pooled": 0.5}
    kwargs = {"oracle": "oracle_same_length", "budget": 0.99, "split_threshold": 0.25}
    data = {
        "kind": KIND, "model": "minilm", "namespace": namespace, "causal": False, "oracle": "oracle_same_length",
        "threshold": 0.15, "calibrated_threshold": 0.25, "threshold_source": "namespace",
        "key_thresholds": {"mean_pooled": 0.5}, "config": {"calibration_fraction": 0.5, "seed": 0, "fidelity": 0.99},
        "queries_read": 8, "queries_evaluated": 8, "calibrated_on": 4, "seconds": 12.5,
        "parts": report_parts(results, thresholds, **kwargs),
        "groups": {g: report_parts([r for r in results if r.group == g], thresholds, **kwargs)
                   for g in ("BGL", "HDFS")},
    }
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{namespace}.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def _report(tmp_path: Path, *oracle: Path) -> int:
    return main(["report", "--runs", str(tmp_path / "runs"), "--results", str(tmp_path / "RESULTS.md"),
                 "--plots", str(tmp_path / "plots"), "--oracle", *map(str, oracle)])


def _table_row(text: str, label: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith(f"| {label} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_an_oracle_file_becomes_a_block_with_parts_groups_and_the_split_threshold(tmp_path: Path) -> None:
    (tmp_path / "runs").mkdir()
    assert _report(tmp_path, _oracle_file(tmp_path / "oracle")) == 0
    text = (tmp_path / "RESULTS.md").read_text(encoding="utf-8")
    assert "<!-- report:oracle-loghub -->" in text and "## oracle — minilm / loghub" in text
    header = _table_row(text, "part")
    assert {"proj hit", "split hit", "mean hit"} <= set(header)
    rest = dict(zip(header, _table_row(text, "**rest**"), strict=True))
    # 3 non-duplicates: the projector's threshold 0.15 takes none of them, the split's 0.25 one faithful.
    assert rest["n"] == "3" and rest["oracle"] == "100.0% (3)"
    assert rest["proj hit"] == "0.0% (0)" and rest["proj prec"] == "– (0 hits)"
    assert rest["split hit"] == "33.3% (1)" and rest["split prec"] == "100.0% (1)"
    bgl = dict(zip(header, _table_row(text, "BGL all"), strict=True))
    assert bgl["n"] == "2" and bgl["split prec"] == "– (0 hits)"
    assert "projector on the split 0.25" in text


def test_a_file_that_is_not_an_oracle_file_raises_config_error(tmp_path: Path) -> None:
    (tmp_path / "runs").mkdir()
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"kind": "attnstore.eval/1"}), encoding="utf-8")
    with pytest.raises(ConfigError, match="not an attnstore eval oracle file"):
        oracle_blocks([other])
    assert _report(tmp_path, other) == 2  # the command reports it and writes nothing
    assert not (tmp_path / "RESULTS.md").exists()


def test_two_files_of_one_namespace_raise_config_error(tmp_path: Path) -> None:
    first, second = _oracle_file(tmp_path / "a"), _oracle_file(tmp_path / "b")
    with pytest.raises(ConfigError, match="both oracle-loghub"):
        oracle_blocks([first, second])


def test_a_missing_part_raises_config_error_naming_the_field(tmp_path: Path) -> None:
    path = _oracle_file(tmp_path / "oracle")
    data = json.loads(path.read_text(encoding="utf-8"))
    del data["parts"]["rest"]
    path.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(ConfigError, match=r"loghub\.json: field parts\.rest must be a dict"):
        oracle_blocks([path])
