"""``attnstore eval oracle``: judge a namespace's projector against the oracle and simple keys.

For each held-out query: its true maps and the full model's output; the oracle
entry (closest true maps among the entries it may use, see ``oracle_search``);
the projector's top-1 through the service's index; with ``--corpus``, the
nearest entry by two simple keys. Each pick is replayed and its fidelity
measured (cosine of the pooled output to the full model's; answer agreement for
multiple-choice prompts). Thresholds are calibrated on a seeded calibration
split for a target precision and every figure is reported on the rest, split
into queries with an exact duplicate in the store and the others (see
``oracle_report``).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from attnstore.errors import ConfigError, CorpusError, NamespaceNotReadyError
from attnstore.projector.gate import FidelityGate
from attnstore.service import AttnStoreService
from attnstore_client.adapters import Adapter, adapter_for
from attnstore_client.keys import model_fingerprint
from attnstore_client.models import LoadedModel, load_model
from attnstore_client.projector import Projector
from attnstore_tools.corpus import read_texts
from attnstore_tools.eval.oracle.fidelity import EvalQuery, SkippedQueries, prepare_queries, replay_fidelity
from attnstore_tools.eval.oracle.search import (
    SIMPLE_KEYS,
    Pick,
    entry_sources,
    key_picks,
    oracle_picks,
    projector_picks,
)
from attnstore_tools.eval.oracle.thresholds import (
    QueryResult,
    Scored,
    calibrate_all,
    calibration_split,
    format_table,
    report_parts,
)
from attnstore_tools.output import write_json

log = logging.getLogger(__name__)
# The "kind" of the JSON file, which `attnstore report` reads.
KIND = "attnstore.oracle/1"


@dataclass(frozen=True)
class OracleConfig:
    """Settings of one oracle evaluation."""

    namespace: str = "default"
    fidelity: float = 0.99  # cosine budget: a replay at or above it is faithful
    target_precision: float = 0.95  # thresholds are calibrated for this share of faithful hits
    max_distance: float | None = None  # fixed projector threshold; None calibrates it like the keys
    crop: bool = True  # causal models: picks may be longer entries, cropped
    limit: int | None = None  # evaluate a seeded sample of this many queries; None: all
    calibration_fraction: float = 0.5  # share of queries that calibrates the thresholds
    seed: int = 0  # seeds the query sample and the calibration split
    max_length: int = 256  # longer queries are skipped and counted
    batch_size: int = 16  # queries per capture forward

    def __post_init__(self) -> None:
        if not 0.0 < self.fidelity <= 1.0:
            raise ConfigError(f"fidelity must be in (0, 1], got {self.fidelity}")
        if not 0.0 < self.target_precision <= 1.0:
            raise ConfigError(f"target precision must be in (0, 1], got {self.target_precision}")
        if not 0.0 < self.calibration_fraction < 1.0:
            raise ConfigError(f"calibration fraction must be in (0, 1), got {self.calibration_fraction}")
        if self.max_distance is not None and not self.max_distance >= 0:
            raise ConfigError(f"max distance must be >= 0, got {self.max_distance}")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"limit must be >= 1, got {self.limit}")


@dataclass(frozen=True)
class OracleReport:
    """The result of one evaluation; ``parts`` and ``groups`` hold the figures."""

    model: str
    namespace: str
    causal: bool
    config: OracleConfig
    queries_read: int  # rows in the queries file
    queries_evaluated: int
    skipped: SkippedQueries
    calibrated_on: int  # calibration queries the thresholds were fitted on
    thresholds: dict[str, float | None]  # method -> threshold in use
    calibrated_threshold: float | None  # the projector's threshold calibrated on the split (even when not used)
    # Where the projector's threshold in use came from: "namespace gate" (then the projector's
    # distances are the gate's 1 - P(faithful)), "namespace", "calibration split", "fixed".
    threshold_source: str
    oracle: str  # the oracle method the targets compare with
    parts: dict[str, dict[str, object]]  # part -> figures, over the evaluation split
    groups: dict[str, dict[str, dict[str, object]]]  # group -> part -> figures
    entries_without_source: int | None  # stored entries the corpus did not cover; None without a corpus
    results: list[QueryResult]
    seconds: float

    def to_json_dict(self) -> dict[str, object]:
        """The report as JSON-ready data, headline keys first (after ``kind``)."""
        overall = self.parts["all"]
        return {
            "kind": KIND,
            "oracle_hit_rate": overall["oracle_hit_rate"],
            "projector_hit_rate": overall.get("projector_hit_rate"),
            "projector_precision": overall.get("projector_precision"),
            "threshold": self.thresholds["projector"],
            "calibrated_threshold": self.calibrated_threshold,
            "threshold_source": self.threshold_source,
            "key_thresholds": {k: v for k, v in self.thresholds.items() if k != "projector"},
            "model": self.model,
            "namespace": self.namespace,
            "causal": self.causal,
            "oracle": self.oracle,
            "config": asdict(self.config),
            "queries_read": self.queries_read,
            "queries_evaluated": self.queries_evaluated,
            "skipped": asdict(self.skipped),
            "calibrated_on": self.calibrated_on,
            "entries_without_source": self.entries_without_source,
            "parts": self.parts,
            "groups": self.groups,
            "machine": {"cores": os.cpu_count(), "torch_threads": torch.get_num_threads()},
            "seconds": round(self.seconds, 1),
            # No candidate is an infinite distance: null in JSON, which has no Infinity.
            "per_query": [_finite(asdict(r)) for r in self.results],
        }


def evaluate_oracle(
    loaded: LoadedModel,
    service: AttnStoreService,
    texts: Sequence[str],
    config: OracleConfig = OracleConfig(),
    *,
    corpus: Sequence[str] | None = None,
    groups: Sequence[str] | None = None,
    progress: bool = True,
) -> OracleReport:
    """Evaluate the namespace's projector on held-out queries (see the module docstring).

    Args:
        loaded: the namespace's model.
        service: the store, opened (read-only is enough).
        texts: the query texts.
        config: settings.
        corpus: the build corpus, for the simple keys; None leaves them out.
        groups: per query text, a group label to report apart (e.g. the log system).
        progress: show progress bars.

    Returns:
        The report.

    Raises:
        NamespaceNotFoundError: no such namespace.
        NamespaceNotReadyError: the namespace has no projector.
        FingerprintMismatchError: the namespace belongs to another model.
        CorpusError: no queries, or none usable.
    """
    started = time.perf_counter()
    info = service.get_namespace(config.namespace)
    if info.projector is None:
        raise NamespaceNotReadyError(
            f"namespace {config.namespace!r} has no projector (a build is running or was killed); nothing to evaluate"
        )
    service.check_fingerprint(config.namespace, model_fingerprint(loaded.model, loaded.tokenizer))
    if not texts:
        raise CorpusError("the queries file is empty: nothing to evaluate")
    if groups is not None and len(groups) != len(texts):
        raise ConfigError(f"{len(groups)} group labels for {len(texts)} queries")
    rows = _sample(len(texts), config.limit, config.seed)
    adapter = adapter_for(loaded)
    causal = adapter.causal
    queries, skipped = prepare_queries(
        adapter, service, config.namespace, [texts[i] for i in rows],
        None if groups is None else [groups[i] for i in rows],
        max_length=config.max_length, batch_size=config.batch_size, progress=progress,
    )
    gate = service.gate(config.namespace) if config.max_distance is None else None
    picks, sources_missing = _picks(adapter, service, config, gate, queries, corpus, progress)
    split = calibration_split(len(queries), config.calibration_fraction, config.seed)
    results = _score(adapter, service, config.namespace, queries, picks, split, rows, progress)
    thresholded = ["projector"] + (list(SIMPLE_KEYS) if corpus is not None else [])
    oracle = "oracle_crop" if causal and config.crop else "oracle_same_length"
    thresholds, calibrated_on = calibrate_all(results, thresholded, config.target_precision, config.fidelity)
    calibrated = thresholds["projector"]
    recommended = _recommended_threshold(info.projector) if gate is None else 1.0 - gate.cutoff
    if config.max_distance is not None:
        thresholds["projector"], source = config.max_distance, "fixed"
    elif gate is not None:
        # The gate's own decision: its pick's 1 - P(faithful) within 1 - cutoff.
        thresholds["projector"], source = recommended, "namespace gate"
    elif recommended is not None:
        # What clients use by default: the namespace's build-time calibration, no query data.
        thresholds["projector"], source = recommended, "namespace"
    else:
        source = "calibration split"
    split = calibrated if source != "calibration split" else None
    parts = report_parts(results, thresholds, oracle=oracle, budget=config.fidelity, split_threshold=split)
    by_group = {}
    for group in sorted({q.group for q in queries if q.group is not None}):
        members = [r for r in results if r.group == group]
        by_group[group] = report_parts(members, thresholds, oracle=oracle, budget=config.fidelity,
                                       split_threshold=split)
    return OracleReport(
        model=loaded.name,
        namespace=config.namespace,
        causal=causal,
        config=config,
        queries_read=len(texts),
        queries_evaluated=len(queries),
        skipped=skipped,
        calibrated_on=calibrated_on,
        thresholds=thresholds,
        calibrated_threshold=calibrated,
        threshold_source=source,
        oracle=oracle,
        parts=parts,
        groups=by_group,
        entries_without_source=sources_missing,
        results=results,
        seconds=time.perf_counter() - started,
    )


def _recommended_threshold(blob: bytes) -> float | None:
    """The namespace's calibrated threshold (its projector's ``calibration.max_distance``), if any."""
    calibration = Projector.from_safetensors_bytes(blob).calibration
    return None if calibration is None else calibration.max_distance


def _sample(count: int, limit: int | None, seed: int) -> list[int]:
    """Rows evaluated: all, or a seeded sample of ``limit`` in file order."""
    if limit is None or limit >= count:
        return list(range(count))
    return sorted(np.random.default_rng(seed).choice(count, limit, replace=False).tolist())


def _picks(
    adapter: Adapter,
    service: AttnStoreService,
    config: OracleConfig,
    gate: FidelityGate | None,
    queries: list[EvalQuery],
    corpus: Sequence[str] | None,
    progress: bool,
) -> tuple[dict[str, list[Pick]], int | None]:
    """Every method's pick per query (the projector's through ``gate`` when given), and how many
    stored entries the corpus did not cover."""
    namespace, causal = config.namespace, adapter.causal
    oracle = oracle_picks(service, namespace, queries, causal=causal, progress=progress)
    projector = Projector.from_safetensors_bytes(service.get_namespace(namespace).projector)
    picks = {"oracle_same_length": oracle.same_length}
    if causal:
        picks["oracle_crop"] = oracle.crop
    picks["projector"] = projector_picks(service, namespace, projector, queries, crop=config.crop, gate=gate)
    if corpus is None:
        return picks, None
    sources = entry_sources(adapter, service, namespace, corpus, progress=progress)
    if sources.missing:
        log.warning("%d stored entries have no text in the corpus: the simple keys cannot pick them", sources.missing)
    picks.update(key_picks(sources, queries, crop=causal and config.crop))
    return picks, sources.missing


def _score(
    adapter: Adapter,
    service: AttnStoreService,
    namespace: str,
    queries: list[EvalQuery],
    picks: dict[str, list[Pick]],
    split: np.ndarray,
    rows: list[int],
    progress: bool,
) -> list[QueryResult]:
    """Replay every query's distinct picks and record what each method got."""
    results = []
    for i, query in enumerate(tqdm(queries, desc="replay", unit="query", disable=not progress)):
        mine = {method: picks[method][i] for method in picks}
        fidelity = replay_fidelity(adapter, service, namespace, query, [p.key for p in mine.values() if p.key])
        methods = {}
        for method, pick in mine.items():
            measured = fidelity.get(pick.key) if pick.key else None
            methods[method] = Scored(
                entry_id=pick.entry_id,
                stored_length=pick.stored_length,
                distance=pick.distance,
                cosine=None if measured is None else measured.cosine,
                answer=None if measured is None else measured.answer,
            )
        results.append(QueryResult(
            index=rows[query.index], group=query.group, length=query.length,
            duplicate=query.duplicate_of is not None, calibration=bool(split[i]),
            answer=query.answer, methods=methods,
        ))
    return results


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``attnstore eval oracle``."""
    parser = subparsers.add_parser(
        "oracle",
        help="judge a namespace's projector against the oracle and simple keys",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--model", required=True, help="model alias (minilm, smollm2) or a local model folder")
    parser.add_argument("--store", required=True, type=Path, help="map store folder")
    parser.add_argument("--queries", required=True, type=Path, help="held-out queries: .txt, .tsv or .jsonl")
    parser.add_argument("--column", help="text column (.tsv) or field (.jsonl) of the queries file")
    parser.add_argument("--group-column", help="column or field of the queries file to report apart (e.g. system)")
    parser.add_argument("--corpus", type=Path, help="the build corpus: enables the simple keys")
    parser.add_argument("--corpus-column", help="text column (.tsv) or field (.jsonl) of the corpus")
    parser.add_argument("--namespace", default="default", help="namespace to evaluate (default: default)")
    parser.add_argument("--max-distance", type=float,
                        help="fixed projector distance threshold, no gate (default: the namespace's fidelity gate,"
                             " else its calibrated threshold, else one calibrated on the calibration split)")
    parser.add_argument("--target-precision", type=float, default=0.95, help="calibration target (default 0.95)")
    parser.add_argument("--fidelity", type=float, default=0.99, help="cosine budget of a faithful hit (default 0.99)")
    parser.add_argument("--crop", action=argparse.BooleanOptionalAction, default=True,
                        help="causal models: let picks be longer entries, cropped (default: on)")
    parser.add_argument("--limit", type=int, help="evaluate a seeded sample of this many queries")
    parser.add_argument("--calibration-fraction", type=float, default=0.5, help="calibration share (default 0.5)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sample and the split (default 0)")
    parser.add_argument("--max-length", type=int, default=256, help="skip queries over this many tokens (default 256)")
    parser.add_argument("--batch-size", type=int, default=16, help="queries per capture forward (default 16)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--json", required=True, type=Path, help="write the report here")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``attnstore eval oracle``."""
    config = OracleConfig(
        namespace=args.namespace, fidelity=args.fidelity, target_precision=args.target_precision,
        max_distance=args.max_distance, crop=args.crop, limit=args.limit,
        calibration_fraction=args.calibration_fraction, seed=args.seed,
        max_length=args.max_length, batch_size=args.batch_size,
    )
    texts = read_texts(args.queries, column=args.column)
    groups = read_texts(args.queries, column=args.group_column) if args.group_column else None
    corpus = read_texts(args.corpus, column=args.corpus_column) if args.corpus else None
    if not texts:
        raise CorpusError(f"the queries file {args.queries} is empty: nothing to evaluate")
    with AttnStoreService.open(args.store, readonly=True) as service:
        # Refuse a bad namespace before the model load, which can take a while.
        service.get_namespace(args.namespace)
        report = evaluate_oracle(load_model(args.model), service, texts, config, corpus=corpus, groups=groups,
                                 progress=not args.no_progress)
    print(format_report(report))
    write_json(args.json, report.to_json_dict(), indent=1)
    return 0


def format_report(report: OracleReport) -> str:
    """The printed summary: setup, thresholds and the table."""
    keys = [k for k in SIMPLE_KEYS if k in report.thresholds]
    thresholds = ", ".join(f"{m} {_threshold(t)}" for m, t in report.thresholds.items())
    header = [
        f"{report.model} / {report.namespace}: {report.queries_evaluated} of {report.queries_read} queries"
        f" ({report.skipped.too_long} over max length, {report.skipped.empty} blank);"
        f" calibration {report.config.calibration_fraction:.0%} (seed {report.config.seed}),"
        f" fitted on {report.calibrated_on}, figures on the rest",
        f"fidelity cosine >= {report.config.fidelity}, target precision {report.config.target_precision};"
        f" oracle = {report.oracle}; thresholds: {thresholds} (projector's from the {report.threshold_source};"
        f" calibrated on the split: {_threshold(report.calibrated_threshold)})",
        "targets: hit rate >= 90% of oracle / precision >= 95% / not below the best simple key (Y n -)",
    ]
    sections = {"overall": report.parts} | report.groups
    return "\n".join(header + [format_table(sections, keys)])


def _threshold(value: float | None) -> str:
    return "none reaches the target" if value is None else f"{value:.4g}"


def _finite(value: object) -> object:
    """``value`` with every non-finite float replaced by None, recursively."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
