"""``attnstore bench gpu``: the GPU path checked and timed in one run that fits a short loan of a bare GPU machine.

Run by scripts/gpu_check.sh, which first installs the carried wheels (``bench.gpu_carry``). Two modes:

- ``--prepare`` (here, with a network): downloads the wheels the lent image lacks (CPython ``--python``,
  manylinux, pinned to this environment's versions), writes MiniLM's and SmolLM2's configurations and
  tokenizers without weights (``bench.gpu_models``) and a little data under ``--carried``, and checks that the
  working tree and that folder together fit the device tool's 64 MiB.
- the run (``--out DIR``): in order, each step skipped with its reason when it cannot run or the time budget is
  spent: the environment and the carried size; the models, given seeded random weights (said in the output);
  the GPU tests (``pytest -m gpu tests/gpu``); the forward table (plain ``sdpa`` vs packed vs map replay, end
  to end and attention only, ``--lengths`` for both models, fp32, fp16 and bf16); a hit's maps fetched and
  copied to the GPU against the forward the hit saves; one ``bench encode`` on the GPU (sentence-transformers
  against AttnCache, both on the GPU). Without CUDA the tables run as a short dry run on the CPU (one length,
  two rows: the code paths, not GPU figures) and the GPU-only steps are skipped.

Everything printed is also written to ``DIR/gpu-check.json`` (after every step: a run cut short keeps what it
did), with the test report ``DIR/gpu-tests.xml`` and ``DIR/encode.json`` beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from attnstore.errors import ConfigError
from attnstore_tools.arguments import documented_parser, positive_ints
from attnstore_tools.bench.gpu_carry import PYTHON_VERSION, carried_size, download_wheels, python_tag
from attnstore_tools.machine import cpu_model
from attnstore_tools.output import write_json

REPO = Path(__file__).resolve().parents[2]
SST2_ROWS = 4_000  # bench encode --data sst2 stores the first 2,000 and calls with the first 4,000
# Seconds a step is expected to need at most on a lent machine: it is skipped when less than that is left.
STEP_SECONDS = {"models": 30, "tests": 60, "forwards": 60, "fetch": 20, "encode": 90}
GPU_ONLY = ("encode",)  # skipped without CUDA (the others run a CPU dry run or stand-in there)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``gpu`` to the ``bench`` group."""
    p = documented_parser(subparsers, "gpu", __doc__, summary="the GPU check: tests and timings on a lent GPU")
    p.add_argument("--prepare", action="store_true", help="download the wheels and write the models (see above)")
    p.add_argument("--out", type=Path, default=None, help="the run: write gpu-check.json and the reports here")
    p.add_argument("--carried", type=Path, default=REPO / ".gpu", help="the carried folder: wheels, models, data")
    p.add_argument("--python", default=PYTHON_VERSION, help="--prepare: the CPython version of the wheels")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="--prepare: the data folder to copy from (default: ../shared/data)")
    p.add_argument("--scratch", type=Path, default=None,
                   help="where the run writes the models' random weights (default: a temporary folder)")
    p.add_argument("--device", default="cuda", help="the device checked")
    p.add_argument("--lengths", default="32,128,512", help="token lengths of the tables")
    p.add_argument("--batch", type=int, default=8, help="rows per forward of the forward table")
    p.add_argument("--repeats", type=int, default=7, help="timed rounds per variant, median taken (at least 5)")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    p.add_argument("--seed", type=int, default=0, help="seed of the random token ids")
    p.add_argument("--budget", type=float, default=400.0, help="seconds the run may take; later steps are skipped")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """``--prepare`` or the run; returns the exit code (1: the carry does not fit, or a step failed)."""
    if args.prepare:
        return prepare(args.carried, python_version=args.python, data_dir=args.data_dir)
    if args.out is None:
        raise ConfigError("bench gpu: give --out DIR (the run) or --prepare")
    if args.repeats < 5 or args.warmup < 0 or args.batch < 1:
        raise ConfigError(f"bench gpu: need --repeats >= 5, --warmup >= 0, --batch >= 1; got {args.repeats}, "
                          f"{args.warmup}, {args.batch}")
    positive_ints(args.lengths, "bench gpu: --lengths")
    return GpuCheck(args).run()


def prepare(carried: Path, *, python_version: str, data_dir: Path | None) -> int:
    """Fill ``carried`` for a lent machine; returns 1 when the carry does not fit."""
    from attnstore_tools.bench.gpu_models import prepare_models
    from attnstore_tools.corpus import data_dir as default_data_dir

    wheels = download_wheels(carried / "wheels" / python_tag(python_version), python_version)
    print(f"wheels for CPython {python_version}: {', '.join(w.name for w in wheels)}")
    for folder in prepare_models(carried / "models"):
        print(f"model {folder.name}: configuration and tokenizer, weights random (drawn on the machine)")
    copy_data(default_data_dir(data_dir), carried / "data")
    size = carried_size(REPO, carried)
    print(size.line())
    return 0 if size.fits else 1


def copy_data(source: Path, dest: Path, *, rows: int = SST2_ROWS) -> None:
    """The data ``bench encode --data sst2`` reads: SST-2 train's first ``rows`` rows and STS-B dev (warm-up)."""
    dest.mkdir(parents=True, exist_ok=True)
    with (source / "sst2_train.tsv").open(encoding="utf-8") as f:
        head = [line for _, line in zip(range(rows + 1), f, strict=False)]
    (dest / "sst2_train.tsv").write_text("".join(head), encoding="utf-8")
    shutil.copyfile(source / "stsb_dev.tsv", dest / "stsb_dev.tsv")


def skip_reason(device: str) -> str | None:
    """Why the GPU steps cannot run on ``device`` here, or None when they can."""
    import torch

    if not device.startswith("cuda"):
        return f"--device {device} is not a CUDA device"
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hidden = " (CUDA_VISIBLE_DEVICES is empty)" if visible == "" else ""
        return f"no CUDA device on this machine{hidden}"
    return None


def junit_outcomes(path: Path) -> list[dict[str, str]]:
    """Each test of a JUnit XML report: name, outcome (passed, failed, error, skipped) and the skip reason or
    failure message."""
    outcomes = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            found = case.find(kind)
            if found is not None:
                outcome = "failed" if kind == "failure" else kind
                message = found.get("message", "") or (found.text or "")
                break
        outcomes.append({"test": f"{case.get('classname', '')}::{case.get('name', '')}", "outcome": outcome,
                         "message": message.strip()[:500]})
    return outcomes


class GpuCheck:
    """One run: its steps, what it printed and what it found, saved to ``gpu-check.json`` after every step."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out: Path = args.out
        self.started = time.monotonic()
        self.report: dict[str, Any] = {"steps": [], "printed": []}
        self.models: list[Any] = []
        self.skip = skip_reason(args.device)

    def say(self, text: str = "") -> None:
        """Print ``text`` and keep it in the JSON."""
        print(text, flush=True)
        self.report["printed"].extend(text.splitlines() or [""])

    def left(self) -> float:
        return self.args.budget - (time.monotonic() - self.started)

    def save(self) -> None:
        write_json(self.out / "gpu-check.json", self.report)

    def run(self) -> int:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
        self.out.mkdir(parents=True, exist_ok=True)
        steps: list[tuple[str, Callable[[], str | None]]] = [
            ("environment", self.environment), ("models", self.prepare_models), ("tests", self.tests),
            ("forwards", self.forwards), ("fetch", self.fetch), ("encode", self.encode),
        ]
        for name, step in steps:
            self.step(name, step)
        failed = [s["step"] for s in self.report["steps"] if s["status"] == "failed"]
        summary = ", ".join(f"{s['step']} {s['status']}" for s in self.report["steps"])
        self.say(f"steps: {summary}")
        self.save()
        return 1 if failed or not self.report.get("carried", {}).get("fits", True) else 0

    def step(self, name: str, body: Callable[[], str | None]) -> None:
        """Run one step unless the budget is spent; it returns a skip reason or None. A failure is recorded, and
        the later steps still run."""
        self.say(f"== {name}")
        started = time.monotonic()
        need = STEP_SECONDS.get(name, 0)
        status, reason = "ran", ""
        if name in GPU_ONLY and self.skip is not None:
            status, reason = "skipped", f"{self.skip}: this step needs one"
        elif self.left() < need:
            status, reason = "skipped", f"out of time: {self.left():.0f} s of the budget left, the step needs {need}"
        else:
            try:
                skipped = body()
                if skipped:
                    status, reason = "skipped", skipped
            except Exception as exc:  # a step's failure is reported; the later steps still run
                status, reason = "failed", f"{type(exc).__name__}: {exc}"
        seconds = round(time.monotonic() - started, 1)
        if reason:
            self.say(f"{name}: {status}: {reason}")
        self.report["steps"].append({"step": name, "status": status, "reason": reason, "seconds": seconds})
        self.save()

    # ---- steps ----------------------------------------------------------------------------------------------

    def environment(self) -> None:
        import torch
        import transformers

        env: dict[str, Any] = {
            "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": transformers.__version__, "cpu_model": cpu_model(), "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "device": self.args.device,
            "gpu": torch.cuda.get_device_name(0) if self.skip is None else None,
        }
        try:
            import sentence_transformers

            env["sentence_transformers"] = sentence_transformers.__version__
        except ImportError:
            env["sentence_transformers"] = None
        self.report["environment"] = env
        self.say(", ".join(f"{key} {value}" for key, value in env.items()))
        if self.skip is not None:
            self.say(f"GPU steps skipped: {self.skip}; the tables run as a dry run on the CPU")
        size = carried_size(REPO, self.args.carried)
        self.report["carried"] = size.to_json_dict()
        self.say(size.line())

    def prepare_models(self) -> None:
        from attnstore_tools.bench.gpu_models import materialize

        scratch = self.args.scratch or Path(tempfile.gettempdir()) / "attnstore-gpu-models"
        self.models = materialize(self.args.carried / "models", scratch)
        self.report["models"] = [{**asdict(m), "path": str(m.path)} for m in self.models]
        for model in self.models:
            self.say(f"model {model.alias} ({model.family}): the packaged model's shapes, weights {model.weights}"
                     " -- RANDOM, not the trained ones: timings hold, fidelity figures do not")

    def tests(self) -> None:
        self.report["tests"] = self._pytest("gpu-tests.xml", {})
        if self.skip is not None:  # the tests' own logic, on the CPU (tests/gpu/conftest.py): not a GPU result
            self.say("the same tests with the CPU standing in for the GPU (their logic, not a GPU result):")
            self.report["tests_cpu_stand_in"] = self._pytest("gpu-tests-cpu-stand-in.xml",
                                                             {"ATTNSTORE_GPU_TESTS_DEVICE": "cpu"})

    def _pytest(self, report: str, extra_env: dict[str, str]) -> dict[str, Any]:
        junit = self.out / report
        env = {**os.environ, **extra_env,
               "ATTNSTORE_GPU_MODELS": str(self.models[0].path.parent) if self.models else ""}
        command = [sys.executable, "-m", "pytest", "-m", "gpu", "tests/gpu", "-q", "-rsxX", "-p", "no:cacheprovider",
                   f"--junitxml={junit}"]
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=max(30.0, self.left() - 120), check=False)
        tail = [line for line in (done.stdout + done.stderr).strip().splitlines() if line.strip()]
        self.say("\n".join(tail[-25:]))
        if done.returncode not in (0, 5):
            raise RuntimeError(f"pytest -m gpu exited {done.returncode}")
        return {"exit_code": done.returncode, "outcomes": junit_outcomes(junit) if junit.is_file() else []}

    def _table_settings(self) -> tuple[Any, list[int], int, list[str], str]:
        import torch

        if self.skip is None:
            return (torch.device(self.args.device), positive_ints(self.args.lengths, "--lengths"), self.args.batch,
                    ["fp32", "fp16", "bf16"], "")
        return torch.device("cpu"), [32], 2, ["fp32", "bf16"], " (DRY RUN on the CPU: the code path, not GPU figures)"

    def _rounds(self) -> tuple[int, int]:
        """Timed and warm-up rounds: the options on the GPU, the fewest in a dry run."""
        return (self.args.repeats, self.args.warmup) if self.skip is None else (5, 1)

    def forwards(self) -> None:
        from attnstore_client.models import load_model
        from attnstore_tools.bench.gpu_timing import FORWARD_COLUMNS, table, time_forwards

        device, lengths, batch, dtypes, label = self._table_settings()
        rows = []
        for model in self.models:
            loaded = load_model(str(model.path))
            repeats, warmup = self._rounds()
            rows += time_forwards(loaded, model.alias, dtypes, lengths, batch=batch, repeats=repeats, warmup=warmup,
                                  seed=self.args.seed, device=device)
            del loaded
        self.report["forwards"] = {"device": str(device), "dry_run": bool(label), "rows": [asdict(r) for r in rows]}
        self.say(f"forwards on {device}{label}: medians of {self._rounds()[0]}, ms; x = sdpa / replay")
        self.say(table(rows, FORWARD_COLUMNS))
        longest = [r for r in rows if r.length == max(lengths)]
        for row in longest:
            self.say(f"{row.model} {row.dtype} L={row.length}: replay's attention speedup "
                     f"{row.replay_attention_speedup}x (the AttnCache paper: 3x on GPU), end to end "
                     f"{row.replay_speedup}x (paper: 1.6x)")

    def fetch(self) -> None:
        from attnstore_client.models import load_model
        from attnstore_tools.bench.gpu_timing import FETCH_COLUMNS, table, time_fetches

        device, lengths, _, dtypes, label = self._table_settings()
        dtype = "fp16" if self.skip is None else dtypes[0]
        rows = []
        for model in self.models:
            loaded = load_model(str(model.path))
            repeats, warmup = self._rounds()
            rows += time_fetches(loaded, model.alias, dtype, lengths, repeats=repeats, warmup=warmup,
                                 seed=self.args.seed, device=device)
            del loaded
        self.report["fetch"] = {"device": str(device), "dry_run": bool(label), "rows": [asdict(r) for r in rows]}
        self.say(f"a hit's maps fetched (embedded LMDB) and copied to {device} vs the forward it saves{label}:")
        self.say(table(rows, FETCH_COLUMNS))

    def encode(self) -> None:
        minilm = next(m for m in self.models if m.alias == "minilm")
        report = self.out / "encode.json"
        command = [sys.executable, "-m", "attnstore_tools.cli", "bench", "encode", "--device", self.args.device,
                   "--model", str(minilm.path), "--data", "sst2", "--data-dir", str(self.args.carried / "data"),
                   "--rows", str(SST2_ROWS), "--repeats", "1", "--methods", "sentence_transformers,attnstore",
                   "--threads", str(min(8, os.cpu_count() or 1)), "--batch", "64",
                   "--work-dir", str(minilm.path.parent / "bench-encode"), "--json", str(report)]
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                              timeout=max(30.0, self.left() - 10), check=False)
        self.say("\n".join((done.stdout + done.stderr).strip().splitlines()[-15:]))
        if done.returncode != 0:
            raise RuntimeError(f"bench encode exited {done.returncode}")
        self.report["encode"] = json.loads(report.read_text(encoding="utf-8"))
