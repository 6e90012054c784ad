"""``attnstore bench gpu`` on a machine without a GPU: the carried-size check, the wheels chosen, the skip reasons,
the test report read back and the JSON every step writes (the GPU steps themselves run on a lent machine)."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import pytest

from attnstore.errors import ConfigError
from attnstore_tools.bench import gpu
from attnstore_tools.bench.gpu_carry import (
    CarriedSize,
    carried_size,
    download_command,
    python_tag,
    release,
    tree_bytes,
    wheels_to_install,
)
from attnstore_tools.cli import main


def test_the_carried_size_counts_the_tree_git_copies_and_the_carried_folder(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    (repo / ".gitignore").write_text("/.gpu/\n")
    (repo / "code.py").write_bytes(b"x" * 1000)
    (repo / ".gpu" / "wheels").mkdir(parents=True)
    (repo / ".gpu" / "wheels" / "a.whl").write_bytes(b"w" * 5000)
    assert tree_bytes(repo) == 1000 + len("/.gpu/\n")  # untracked but not ignored: copied; .gpu/ is not
    size = carried_size(repo, repo / ".gpu", limit=6100)
    assert (size.tree_bytes, size.carried_bytes, size.total_bytes) == (1007, 5000, 6007) and size.fits
    assert not carried_size(repo, repo / ".gpu", limit=6000).fits


def test_the_carried_size_line_says_whether_it_fits() -> None:
    mib = 1024 * 1024
    assert CarriedSize(4 * mib, 40 * mib).line().endswith("of 64 MiB: fits")
    over = CarriedSize(4 * mib, 61 * mib)
    assert over.line().endswith("DOES NOT FIT") and over.to_json_dict()["fits"] is False


def test_wheels_are_installed_when_missing_or_older_than_the_stubs_need(tmp_path: Path) -> None:
    import google.protobuf
    import grpc

    names = ["surely_not_installed_pkg-1.0-py3-none-any.whl",
             f"grpcio-{grpc.__version__}-cp312-cp312-manylinux2014_x86_64.whl",  # as installed: kept
             "protobuf-999.0.0-cp310-abi3-manylinux2014_x86_64.whl",  # newer than installed: installed
             "pytest-0.1-py3-none-any.whl"]  # installed, and not one whose version matters
    for name in names:
        (tmp_path / name).write_bytes(b"")
    chosen = {wheel.name: why for wheel, why in wheels_to_install(tmp_path.glob("*.whl"))}
    assert chosen == {names[0]: "not installed",
                      names[2]: f"installed {google.protobuf.__version__} < 999.0.0"}


def test_release_numbers_order_versions() -> None:
    assert release("7.36.2") == (7, 36, 2) and release("1.85.0rc1") == (1, 85, 0)
    assert release("2.11.0+cu130") == (2, 11, 0)
    assert release("6.31.1") < release("7.35.1") < release("7.36.2")


def test_wheels_are_pinned_binaries_for_cpython_manylinux() -> None:
    command = download_command("lmdb==3.0.0", Path("/w"), "3.12")
    assert command[-1] == "lmdb==3.0.0" and "--no-deps" in command and "--only-binary=:all:" in command
    assert command[command.index("--python-version") + 1] == "3.12" and "manylinux_2_28_x86_64" in command
    assert python_tag("3.12") == "cp312"
    with pytest.raises(ConfigError, match="MAJOR.MINOR"):
        python_tag("312")


def test_the_skip_reason_names_why(monkeypatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpu.skip_reason("cuda") == "no CUDA device on this machine (CUDA_VISIBLE_DEVICES is empty)"
    assert gpu.skip_reason("cpu") == "--device cpu is not a CUDA device"


def test_the_junit_report_is_read_back_with_skip_reasons(tmp_path: Path) -> None:
    report = tmp_path / "tests.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.gpu.test_a" name="test_ok"/>'
        '<testcase classname="tests.gpu.test_a" name="test_skip"><skipped message="needs a CUDA device: x"/></testcase>'
        '<testcase classname="tests.gpu.test_a" name="test_bad"><failure message="assert 1 == 2">trace</failure>'
        '</testcase></testsuite></testsuites>')
    assert gpu.junit_outcomes(report) == [
        {"test": "tests.gpu.test_a::test_ok", "outcome": "passed", "message": ""},
        {"test": "tests.gpu.test_a::test_skip", "outcome": "skipped", "message": "needs a CUDA device: x"},
        {"test": "tests.gpu.test_a::test_bad", "outcome": "failed", "message": "assert 1 == 2"},
    ]


def _check(tmp_path: Path, budget: float = 100.0) -> gpu.GpuCheck:
    args = argparse.Namespace(out=tmp_path / "out", device="cpu", budget=budget, carried=tmp_path / "carried")
    check = gpu.GpuCheck(args)
    check.out.mkdir(parents=True)
    return check


def test_every_step_is_recorded_in_the_json_as_it_ends(tmp_path: Path, capsys) -> None:
    check = _check(tmp_path)

    def fails() -> None:
        raise RuntimeError("boom")

    check.step("tests", lambda: check.say("3 passed"))
    check.step("models", lambda: "nothing to load")
    check.step("fetch", fails)
    check.step("encode", lambda: None)  # GPU only
    report = json.loads((check.out / "gpu-check.json").read_text())
    assert [(s["step"], s["status"], s["reason"]) for s in report["steps"]] == [
        ("tests", "ran", ""), ("models", "skipped", "nothing to load"), ("fetch", "failed", "RuntimeError: boom"),
        ("encode", "skipped", "--device cpu is not a CUDA device: this step needs one")]
    assert "3 passed" in report["printed"] and "models: skipped: nothing to load" in report["printed"]
    assert report["printed"] == capsys.readouterr().out.splitlines()


def test_a_step_the_budget_cannot_fit_is_skipped_saying_so(tmp_path: Path) -> None:
    check = _check(tmp_path, budget=10.0)
    ran = []
    check.step("forwards", lambda: ran.append(1))
    assert ran == [] and check.report["steps"][0]["status"] == "skipped"
    assert check.report["steps"][0]["reason"].startswith("out of time: 10 s of the budget left, the step needs 60")


def test_the_command_wants_out_or_prepare(capsys) -> None:
    assert main(["bench", "gpu"]) == 2
    assert "--out DIR" in capsys.readouterr().err
