"""The eval harness's runs as ``attnstore report`` reads them: the ``attnstore.eval/1`` JSON files, checked.

One ``EvalRun`` per ``attnstore eval logs|sts|sst2|mmlu`` file, its rows one per
method and setting; what the tables (``tables``) and the plots (``plots``) are made of.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, cast

from attnstore.errors import ConfigError

KIND = "attnstore.eval/1"
Task = Literal["logs", "sts", "sst2", "mmlu"]
Method = Literal["sentence_transformers", "dict_cache", "attncache", "output_cache", "lazyformer", "san", "attncache_f"]
TASKS: tuple[Task, ...] = ("logs", "sts", "sst2", "mmlu")  # also the order of the blocks when appended
METHODS: tuple[Method, ...] = (
    "sentence_transformers", "dict_cache", "attncache", "output_cache", "lazyformer", "san", "attncache_f",
)


@dataclass(frozen=True, slots=True)
class Speedup:
    """Speedups over the full model, leaving out (``excl``) or counting (``incl``) the retrieval time."""

    e2e_excl: float | None
    e2e_incl: float | None
    attn_excl: float | None
    attn_incl: float | None


@dataclass(frozen=True, slots=True)
class Cosine:
    """Cosine of a row's pooled outputs to the full model's, over the queries."""

    mean: float | None
    min: float | None
    share_099: float | None  # share of the queries at cosine >= 0.99


@dataclass(frozen=True, slots=True)
class Slice:
    """A method's figures on some of the queries: a group (system, subject) or a part (exact_dup, rest)."""

    queries: int | None
    metric: float | None
    full: float | None  # the full model's metric on the same queries
    hit_rate: float | None
    exact_hits: int | None = None  # groups, when the harness records them
    map_hits: int | None = None
    cosine_mean: float | None = None  # parts


@dataclass(frozen=True, slots=True)
class Row:
    """One method at one setting."""

    method: Method
    setting: float | None  # the method's threshold or knob; None if it has none
    default: bool  # the attncache row at the chosen default threshold
    metric: float | None
    delta: float | None  # metric - the full model's, in points
    hit_rate: float | None
    exact_hits: int | None
    map_hits: int | None
    layer_replays: int | None
    cosine: Cosine
    speedup: Speedup
    gamma: float | None
    groups: Mapping[str, Slice]
    parts: Mapping[str, Slice]


@dataclass(frozen=True, slots=True)
class Machine:
    """Where a run was measured."""

    cores: int | None
    torch_threads: int | None
    torch: str | None
    cpu: str | None
    date: str | None


@dataclass(frozen=True, slots=True)
class EvalRun:
    """One ``attnstore eval`` run file, the fields the report uses."""

    path: Path
    task: Task
    shots: int | None  # mmlu only
    model: str
    command: str | None  # reproduces the file; None when the run was not started as ``attnstore``
    metric_name: str  # accuracy or spearman
    metric_unit: str  # % or x100
    machine: Machine
    queries: int | None
    batch_size: int | None
    timing_queries: int | None
    timing_rounds: int | None
    default_threshold: float | None
    full_metric: float | None
    rows: tuple[Row, ...]

    @property
    def name(self) -> str:
        """The run's block and plot name: ``logs-minilm``, ``mmlu-smollm2-0shot``."""
        model = re.sub(r"[^a-z0-9]+", "-", Path(self.model).name.lower()).strip("-") or "model"
        shots = "" if self.shots is None else f"-{self.shots}shot"
        return f"{self.task}-{model}{shots}"

    @property
    def title(self) -> str:
        """The heading of the run's block: ``logs — minilm``, ``mmlu — smollm2 (0-shot)``."""
        shots = "" if self.shots is None else f" ({self.shots}-shot)"
        return f"{self.task} — {self.model}{shots}"

    @property
    def default_row(self) -> Row | None:
        """The attncache row at the default threshold, None if no row is marked default."""
        return next((r for r in self.rows if r.method == "attncache" and r.default), None)


class _Fields:
    """One JSON object of a run file; its errors name the file and the field's path."""

    def __init__(self, file: Path, value: object, where: str) -> None:
        if not isinstance(value, dict):
            raise ConfigError(f"{file}: field {where or '(top level)'} must be an object, got {type(value).__name__}")
        self.file, self.data, self.where = file, value, where

    def path(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def error(self, key: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.file}: field {self.path(key)} {problem}")

    def get(self, key: str) -> object:
        if key not in self.data:
            raise ConfigError(f"{self.file}: missing field {self.path(key)}")
        return self.data[key]

    def number(self, key: str, *, optional: bool = False) -> float | None:
        value = self.data.get(key) if optional else self.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.error(key, f"must be a number or null, got {value!r}")
        return float(value)

    def count(self, key: str, *, optional: bool = False) -> int | None:
        value = self.number(key, optional=optional)
        if value is not None and not value.is_integer():
            raise self.error(key, f"must be a whole number or null, got {value!r}")
        return None if value is None else int(value)

    def text(self, key: str, *, nullable: bool = False) -> str | None:
        value = self.get(key)
        if value is None and nullable:
            return None
        if not isinstance(value, str):
            raise self.error(key, f"must be a string, got {value!r}")
        return value

    def choice(self, key: str, choices: tuple[str, ...]) -> str:
        value = self.get(key)
        if value not in choices:
            raise self.error(key, f"must be one of {', '.join(choices)}; got {value!r}")
        return cast(str, value)

    def flag(self, key: str) -> bool:
        value = self.get(key)
        if not isinstance(value, bool):
            raise self.error(key, f"must be true or false, got {value!r}")
        return value

    def obj(self, key: str) -> _Fields:
        return _Fields(self.file, self.get(key), self.path(key))

    def objects(self, key: str) -> dict[str, _Fields]:
        """A mapping of names to objects (``groups``, ``parts``), in file order."""
        mapping = self.obj(key)
        return {name: mapping.obj(name) for name in mapping.data}

    def items(self, key: str) -> list[_Fields]:
        value = self.get(key)
        if not isinstance(value, list):
            raise self.error(key, f"must be a list, got {type(value).__name__}")
        return [_Fields(self.file, item, f"{self.path(key)}[{i}]") for i, item in enumerate(value)]


def read_run(path: Path) -> EvalRun:
    """Read and validate one ``attnstore.eval/1`` file.

    Args:
        path: the JSON file an ``attnstore eval`` run wrote.

    Returns:
        The run.

    Raises:
        ConfigError: the file is unreadable, not JSON, of another kind, or a field the report uses is
            missing or of the wrong type (the message names the file and the field).
    """
    return _parse_run(path, _load_json(path))


def load_runs(folder: Path) -> list[EvalRun]:
    """Every ``attnstore.eval/*`` file under ``folder`` (recursively), in block order.

    JSON files of other tools (no ``kind``, or another tool's) are skipped.

    Args:
        folder: where the eval runs wrote their files.

    Returns:
        The runs ordered by task (logs, sts, sst2, mmlu), model and shots.

    Raises:
        ConfigError: ``folder`` is not a directory, an eval file is invalid (see ``read_run``), or two
            files would write the same block.
    """
    if not folder.is_dir():
        raise ConfigError(f"runs folder {folder} is not a directory")
    runs: dict[str, EvalRun] = {}
    for path in sorted(folder.rglob("*.json")):
        data = _load_json(path)
        kind = data.get("kind") if isinstance(data, dict) else None
        if not (isinstance(kind, str) and kind.startswith("attnstore.eval/")):
            continue
        run = _parse_run(path, data)
        if run.name in runs:
            raise ConfigError(f"{runs[run.name].path} and {path} are both run {run.name}: keep one of them")
        runs[run.name] = run
    return sorted(runs.values(), key=lambda r: (TASKS.index(r.task), r.model, -1 if r.shots is None else r.shots))


def _load_json(path: Path) -> object:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read it as JSON ({exc})") from exc


def _parse_run(path: Path, data: object) -> EvalRun:
    top = _Fields(path, data, "")
    top.choice("kind", (KIND,))
    metric, machine, timing = top.obj("metric"), top.obj("machine"), top.obj("timing")
    rows = tuple(_parse_row(r) for r in top.items("rows"))
    if sum(r.method == "attncache" and r.default for r in rows) > 1:
        raise ConfigError(f"{path}: field rows marks more than one attncache row default")
    return EvalRun(
        path=path,
        task=cast(Task, top.choice("task", TASKS)),
        shots=top.count("shots") if top.get("task") == "mmlu" else None,
        model=cast(str, top.text("model")),
        command=top.text("command", nullable=True),
        metric_name=cast(str, metric.text("name")),
        metric_unit=cast(str, metric.text("unit")),
        machine=Machine(
            cores=machine.count("cores"),
            torch_threads=machine.count("torch_threads"),
            torch=machine.text("torch", nullable=True),
            cpu=machine.text("cpu", nullable=True),
            date=machine.text("date", nullable=True),
        ),
        queries=top.count("queries"),
        batch_size=top.count("batch_size"),
        timing_queries=timing.count("queries"),
        timing_rounds=timing.count("rounds"),
        default_threshold=top.number("default_threshold"),
        full_metric=top.obj("full").number("metric"),
        rows=rows,
    )


def _parse_row(row: _Fields) -> Row:
    cosine, speedup = row.obj("cosine"), row.obj("speedup")
    return Row(
        method=cast(Method, row.choice("method", METHODS)),
        setting=row.number("setting"),
        default=row.flag("default"),
        metric=row.number("metric"),
        delta=row.number("delta"),
        hit_rate=row.number("hit_rate"),
        exact_hits=row.count("exact_hits"),
        map_hits=row.count("map_hits"),
        layer_replays=row.count("layer_replays"),
        cosine=Cosine(mean=cosine.number("mean"), min=cosine.number("min"), share_099=cosine.number("share_099")),
        speedup=Speedup(
            e2e_excl=speedup.number("e2e_excl"),
            e2e_incl=speedup.number("e2e_incl"),
            attn_excl=speedup.number("attn_excl"),
            attn_incl=speedup.number("attn_incl"),
        ),
        gamma=row.number("gamma"),
        groups={name: Slice(queries=g.count("queries"), metric=g.number("metric"), full=g.number("full"),
                            hit_rate=g.number("hit_rate"), exact_hits=g.count("exact_hits", optional=True),
                            map_hits=g.count("map_hits", optional=True))
                for name, g in row.objects("groups").items()},
        parts={name: Slice(queries=p.count("queries"), metric=p.number("metric"), full=p.number("full"),
                           hit_rate=p.number("hit_rate"), cosine_mean=p.number("cosine_mean"))
               for name, p in row.objects("parts").items()},
    )
