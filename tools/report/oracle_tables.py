"""The oracle tables of docs/RESULTS.md, from ``attnstore eval oracle`` JSON files.

One block per file, named ``oracle-NAMESPACE``: a line with the setup (queries,
thresholds and where they came from), then one table row per part of the
evaluation split (all, exact duplicates, the rest) and, when the queries had
groups, two rows per group (all, rest). Rates are of the part's queries, with
counts in brackets; ``prec`` is the faithful share of a method's hits, with the
number of hits.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from attnstore.errors import ConfigError
from attnstore_tools.eval.oracle.command import KIND
from attnstore_tools.report.tables import Block

_PARTS = ("all", "exact_dup", "rest")
_GROUP_PARTS = ("all", "rest")
_TARGETS = ("hit_rate_vs_oracle", "precision", "not_below_simple_keys")
_KEYS = {"mean_pooled": "mean", "positionwise": "pos"}


def oracle_blocks(paths: Sequence[Path]) -> list[Block]:
    """One block per ``attnstore eval oracle`` JSON file, in namespace order.

    Raises:
        ConfigError: a file is unreadable, not JSON, not an oracle file, a field the table needs
            is missing, or two files are of the same namespace.
    """
    blocks: dict[str, tuple[Path, Block]] = {}
    for path in paths:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{path}: cannot read it as JSON ({exc})") from exc
        if not (isinstance(data, dict) and data.get("kind") == KIND):
            raise ConfigError(f"{path}: not an attnstore eval oracle file (kind {KIND!r}); run attnstore eval oracle")
        block = oracle_block(path, data)
        if block.name in blocks:
            raise ConfigError(f"{blocks[block.name][0]} and {path} are both {block.name}: keep one of them")
        blocks[block.name] = (path, block)
    return [blocks[name][1] for name in sorted(blocks)]


def oracle_block(path: Path, data: Mapping[str, object]) -> Block:
    """The block of one oracle file.

    Raises:
        ConfigError: a field the table needs is missing or of the wrong type (named with the file).
    """
    namespace = _field(path, data, "namespace", str)
    model = _field(path, data, "model", str)
    parts = _field(path, data, "parts", dict)
    groups = _field(path, data, "groups", dict)
    for name in _PARTS:
        _field(path, parts, name, dict, where="parts")
    split = "projector_split_hits" in parts["all"]
    keys = [k for k in _KEYS if f"key_{k}_hits" in parts["all"]]
    causal = bool(data.get("causal"))
    header = ["part", "n", "oracle (crop)" if data.get("oracle") == "oracle_crop" else "oracle"]
    header += ["oracle, same length"] if causal else []
    header += ["top1=oracle", "proj top1", "proj hit", "proj prec"]
    header += ["split hit", "split prec"] if split else []
    for key in keys:
        header += [f"{_KEYS[key]} top1", f"{_KEYS[key]} hit", f"{_KEYS[key]} prec"]
    header.append("targets")
    columns = len(header)
    rows = [_row(f"**{name.replace('_', ' ')}**", parts[name], causal, split, keys, columns) for name in _PARTS]
    for group, figures in groups.items():
        figures = _field(path, groups, group, dict, where="groups")
        rows += [_row(f"{group} {name}", figures[name], causal, split, keys, columns) for name in _GROUP_PARTS]
    lines = [
        _setup(data, split),
        "",
        "| " + " | ".join(header) + " |",
        "| --- | " + " | ".join("---:" for _ in header[1:-1]) + " | :---: |",
        *("| " + " | ".join(row) + " |" for row in rows),
    ]
    return Block(f"oracle-{namespace}", f"oracle — {model} / {namespace}", "\n".join(lines))


def _setup(data: Mapping[str, object], split: bool) -> str:
    config = data.get("config") if isinstance(data.get("config"), dict) else {}
    keys = data.get("key_thresholds") if isinstance(data.get("key_thresholds"), dict) else {}
    thresholds = [f"projector {_threshold(data.get('threshold'))} (from the {data.get('threshold_source')})"]
    if split:
        thresholds.append(f"projector on the split {_threshold(data.get('calibrated_threshold'))}")
    thresholds += [f"{_KEYS.get(k, k)} {_threshold(v)}" for k, v in keys.items()]
    return (
        f"{data.get('queries_evaluated')} of {data.get('queries_read')} queries evaluated; "
        f"{data.get('calibrated_on')} calibrate the thresholds (split {config.get('calibration_fraction')}, "
        f"seed {config.get('seed')}), the table is on the others. Fidelity: cosine ≥ {config.get('fidelity')}; "
        f"thresholds: {', '.join(thresholds)}. Wall time {data.get('seconds')} s."
    )


def _row(
    label: str, s: Mapping[str, object], causal: bool, split: bool, keys: Sequence[str], columns: int
) -> list[str]:
    if not s.get("queries"):
        return [label, "0", *["–"] * (columns - 3), "- - -"]
    cells = [label, str(s["queries"]), _rate(s, "oracle_hit_rate", "oracle_hits")]
    if causal:
        cells.append(_rate(s, "oracle_same_length_hit_rate", "oracle_same_length_hits"))
    cells += [_pct(s.get("projector_top1_is_oracle")), _pct(s.get("projector_top1_faithful_rate")),
              _rate(s, "projector_hit_rate", "projector_faithful_hits"), _precision(s, "projector")]
    if split:
        cells += [_rate(s, "projector_split_hit_rate", "projector_split_faithful_hits"),
                  _precision(s, "projector_split")]
    for key in keys:
        cells += [_pct(s.get(f"key_{key}_top1_faithful_rate")),
                  _rate(s, f"key_{key}_hit_rate", f"key_{key}_faithful_hits"), _precision(s, f"key_{key}")]
    targets = s.get("targets") if isinstance(s.get("targets"), dict) else {}
    cells.append(" ".join("-" if targets.get(t) is None else ("Y" if targets[t] else "n") for t in _TARGETS))
    return cells


def _field(path: Path, data: Mapping[str, object], key: str, kind: type, *, where: str = "") -> object:
    value = data.get(key)
    if not isinstance(value, kind):
        name = f"{where}.{key}" if where else key
        raise ConfigError(f"{path}: field {name} must be a {kind.__name__}, got {value!r:.60}")
    return value


def _rate(s: Mapping[str, object], rate: str, count: str) -> str:
    return f"{_pct(s.get(rate))} ({s.get(count, '–')})"


def _precision(s: Mapping[str, object], prefix: str) -> str:
    hits = s.get(f"{prefix}_hits")
    return "– (0 hits)" if not hits else f"{_pct(s.get(f'{prefix}_precision'))} ({hits})"


def _pct(value: object) -> str:
    return "–" if not isinstance(value, int | float) else f"{100 * value:.1f}%"


def _threshold(value: object) -> str:
    return "none reaches the target" if not isinstance(value, int | float) else f"{value:.4g}"
