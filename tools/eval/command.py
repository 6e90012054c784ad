"""``attnstore eval logs|sts|sst2|mmlu``: the full model against AttnStore and the baselines on one task.

For a task (see ``eval_data``) and a model it:

1. opens the store given by ``--store`` (``local:PATH`` or ``grpc://HOST:PORT``),
   or builds one from the task's train split (or ``--build-from FILE``) under
   ``--work-dir`` and reuses it on the next run;
2. runs the held-out queries through the full model (``sdpa``), the exact tier
   alone (a plain output cache keyed by the exact input), AttnStore at every
   threshold, and the baselines (LazyFormer, SAN, AttnCache-f);
3. scores each with the task metric, overall, per group and split into queries
   whose exact tokens are stored and the rest, with the cosine of every query's
   pooled output to the full model's;
4. times every variant on a seeded subset of the queries (median of rounds) and
   reports end-to-end and attention-only speedups, each excluding and including
   retrieval (projection + lookup + fetch), and the speedup-degradation ratio
   gamma = (end-to-end speedup including retrieval - 1) / max(metric loss in points, 0.1);
5. prints a table and writes the JSON that ``attnstore report`` turns into docs/RESULTS.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from attnstore.errors import ConfigError, NamespaceNotFoundError
from attnstore_tools.admin.command import TOKEN_ENV, read_token
from attnstore_tools.arguments import documented_parser, store_url
from attnstore_tools.corpus import DATA_HELP, data_dir
from attnstore_tools.eval.scores import build_report, format_report
from attnstore_tools.eval.tasks import STEM_SUBJECTS, TASKS, Task, load_task
from attnstore_tools.output import write_json

log = logging.getLogger(__name__)

_DEFAULT_WORK = Path("runs/eval")
# The sweep, as multiples of the namespace's recommended threshold (its calibration's
# max_distance, or the client's default for an uncalibrated namespace).
SWEEP = (0.25, 0.5, 1.0, 1.5, 2.5)
_SAN_CALIBRATION = 64  # build inputs SAN's divergences are measured on


@dataclass(frozen=True)
class Sizes:
    """Default sizes per task and model family: the whole harness stays under 30 minutes on 2 cores."""

    limit: int | None  # queries (pairs for sts; per system for logs)
    store_limit: int | None  # train inputs stored (sts, sst2)
    per_subject: int | None = None  # mmlu: first test questions per subject
    timing_queries: int = 256
    sweep: tuple[float, ...] = SWEEP  # thresholds, as multiples of the default one


_SIZES: dict[tuple[str, bool], Sizes] = {
    ("logs", False): Sizes(limit=None, store_limit=None),
    ("logs", True): Sizes(limit=100, store_limit=None, timing_queries=64),
    ("sts", False): Sizes(limit=None, store_limit=None),
    ("sts", True): Sizes(limit=300, store_limit=3000, timing_queries=64),
    ("sst2", False): Sizes(limit=None, store_limit=10000),
    ("sst2", True): Sizes(limit=None, store_limit=2000, timing_queries=64),
    ("mmlu", True): Sizes(limit=None, store_limit=None, per_subject=20, timing_queries=16),
}
# 5-shot prompts are ~650 tokens: 228 MB of fp16 maps each, and a minute per pass of 38
# prompts on 2 cores; two thresholds keep the run under 30 minutes.
_MMLU_5SHOT = Sizes(limit=None, store_limit=None, per_subject=4, timing_queries=4, sweep=(1.0, 2.5))


@dataclass(frozen=True)
class EvalConfig:
    """Settings of one evaluation run (the command line's options)."""

    thresholds: tuple[float, ...] | None = None  # None: ``sweep`` times the default threshold
    sweep: tuple[float, ...] = SWEEP
    default_threshold: float | None = None  # None: the namespace's recommendation (what AttnCache uses)
    batch_size: int = 32
    timing_queries: int = 256
    timing_rounds: int = 5
    baselines: bool = True
    # SAN: shares of adjacent layer pairs that share maps (the most alike by mean JS divergence).
    san_shares: tuple[float, ...] = (0.25, 0.5)
    attncache_f: tuple[float, ...] = (0.05, 0.2)  # per-layer distance quantiles (see eval_baselines)
    seed: int = 0
    progress: bool = True
    extra: dict[str, object] = field(default_factory=dict)  # task options, recorded in the JSON

    def __post_init__(self) -> None:
        if self.thresholds is not None and (not self.thresholds or min(self.thresholds) < 0):
            raise ConfigError(f"--thresholds must be >= 0, got {list(self.thresholds)}")
        if self.default_threshold is not None and not self.default_threshold >= 0:
            raise ConfigError(f"--default-threshold must be >= 0, got {self.default_threshold}")
        for name in ("batch_size", "timing_queries", "timing_rounds"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")


def evaluate(
    task: Task,
    loaded,
    store_url: str,
    namespace: str,
    config: EvalConfig,
    *,
    token: str | None = None,
    tls_ca: str | None = None,
) -> dict[str, object]:
    """Run every variant on the task's queries and return the report (the JSON's content).

    Args:
        task: the loaded task.
        loaded: the model (``attnstore_client.models.LoadedModel``).
        store_url: the store, ``local:PATH`` or ``grpc[s]://HOST:PORT``.
        namespace: the namespace built for this model and task.
        config: settings.
        token, tls_ca: for a daemon.

    Raises:
        NamespaceNotFoundError, FingerprintMismatchError: the namespace does not fit the model.
    """
    from attnstore.service import AttnStoreService
    from attnstore_client.adapters import adapter_for
    from attnstore_client.cache import DEFAULT_MAX_DISTANCE, AttnCache
    from attnstore_client.connection.local import LocalConnection
    from attnstore_client.sentence.heads import sentence_head
    from attnstore_tools.eval.oracle.fidelity import letter_ids
    from attnstore_tools.eval.runner import run_pass, time_variants
    from attnstore_tools.eval.variants import CacheVariant, PlainVariant, Variant

    adapter = adapter_for(loaded)
    head = sentence_head(loaded)
    queries = _queries(loaded, head, task.queries, config.batch_size)
    context = max(len(row) for row in queries.ids)
    with ExitStack() as stack:
        service = None
        store: str | LocalConnection = store_url
        if store_url.startswith("local:"):
            # One LMDB environment per process: the cache and AttnCache-f share this service.
            service = stack.enter_context(AttnStoreService.open(store_url[len("local:"):], readonly=True))
            store = LocalConnection(store_url, service)
        cache = stack.enter_context(
            AttnCache(loaded, store, namespace=namespace)
            if service is not None
            else AttnCache(loaded, store, namespace=namespace, token=token, tls_ca=tls_ca)
        )
        gated = cache.gated and config.default_threshold is None
        default = cache.max_distance if config.default_threshold is None else config.default_threshold
        # A calibration that found no precise threshold recommends 0 (exact hits only): sweep
        # around the uncalibrated default to show what looser thresholds would cost.
        base = default or DEFAULT_MAX_DISTANCE
        thresholds = sorted(set(config.thresholds or (round(f * base, 6) for f in config.sweep)) | {round(default, 6)})
        plain = PlainVariant(adapter)
        variants: list[Variant] = [plain, *_simple_alternatives(loaded, head, plain, task, queries)]
        variants += [CacheVariant(cache, 0.0, maps=False)]
        variants += [CacheVariant(cache, None)] if gated else []
        variants += [CacheVariant(cache, t) for t in thresholds]
        if config.baselines:
            variants += _baselines(adapter, task, service, namespace, config)
        choice_ids = letter_ids(adapter) if task.answers_by_logits else None

        reference = np.empty((0, adapter.hidden_size), dtype=np.float32)
        if task.references:
            reference = run_pass(adapter, plain, _queries(loaded, head, task.references, config.batch_size),
                                 head).outputs
        task.fit(reference)

        passes = []
        for variant in tqdm(variants, desc="passes", unit="method", disable=not config.progress):
            passes.append(run_pass(adapter, variant, queries, head, choice_ids=choice_ids))
        output_cache = next(i for i, v in enumerate(variants) if v.name == "output_cache")
        duplicate = np.array([kind == "exact" for kind in passes[output_cache].kinds])
        subset = np.random.default_rng(config.seed).permutation(len(queries.ids))[: config.timing_queries]
        timings = time_variants(adapter, variants, queries, subset.tolist(), head, rounds=config.timing_rounds,
                                progress=config.progress)
    return build_report(task, loaded, store_url, namespace, config, None if gated else round(default, 6), variants,
                        passes, timings, duplicate, len(subset), context)


def _queries(loaded, head, texts: Sequence[str], batch_size: int):
    """``texts`` tokenized and truncated as ``AttnCache.encode`` does for this model (counted in the log).

    Texts come from the task already in the model's input form (a decoder's in
    its PromptEOL prompt), so the head's own tokenization applies only to models
    with a sentence-transformers configuration.
    """
    from attnstore_client.sentence.heads import TransformersPipelineHead
    from attnstore_tools.eval.variants import Queries

    def tokenize(rows: list[str]) -> list[list[int]]:
        if isinstance(head, TransformersPipelineHead):
            return head.tokenize(rows, None)[0]
        return loaded.tokenizer(rows, add_special_tokens=True, truncation=True,
                                max_length=head.max_length)["input_ids"]

    ids = tokenize(list(texts))
    truncated = sum(len(row) == head.max_length for row in ids)
    if truncated:
        log.warning("%d of %d inputs reach the model's limit of %d tokens and are truncated to it",
                    truncated, len(ids), head.max_length)
    return Queries(texts=list(texts), ids=ids, pad_id=loaded.tokenizer.pad_token_id, batch_size=batch_size,
                   tokenize=tokenize)


def _simple_alternatives(loaded, head, plain, task: Task, queries) -> list:
    """What a user would write without AttnStore: sentence-transformers' encode (when the model has a
    configuration for it) and a dict output cache in front of it (else in front of the plain model).

    The dict holds the build corpus's embeddings, as the store holds its outputs; only the build
    texts some query asks for are computed here (the others would never be looked up).
    """
    from attnstore_tools.eval.variants import DictCacheVariant, SentenceTransformersVariant

    alternatives = []
    encoder = plain
    if loaded.sentence_transformer is not None:
        encoder = SentenceTransformersVariant(loaded.sentence_transformer)
        alternatives.append(encoder)
    asked = set(queries.texts)
    stored = [text for text in dict.fromkeys(task.build) if text in asked]
    prefilled: dict[str, np.ndarray] = {}
    if stored:
        build_queries = _queries(loaded, head, stored, queries.batch_size)
        embeddings = encoder.embed(build_queries, range(len(stored)), head).embeddings
        prefilled = dict(zip(stored, embeddings, strict=True))
    return [*alternatives, DictCacheVariant(encoder, prefilled)]


def _baselines(adapter, task: Task, service, namespace: str, config: EvalConfig) -> list:
    """LazyFormer, SAN at each threshold (calibrated on build inputs) and AttnCache-f at each quantile.

    AttnCache-f reads maps in process, from ``service``: without one (a daemon) it is skipped.
    """
    from attnstore_client.sentence.heads import sentence_head
    from attnstore_tools.eval.baselines import (
        AttnCacheFVariant,
        LayerKeys,
        LazyFormerVariant,
        SanVariant,
        calibrate_san,
    )
    from attnstore_tools.eval.runner import row_batches

    pad = adapter.loaded.tokenizer.pad_token_id
    build_ids = _queries(adapter.loaded, sentence_head(adapter.loaded), task.build, config.batch_size).ids
    sample = np.random.default_rng(config.seed).permutation(len(build_ids))[:_SAN_CALIBRATION].tolist()
    calibration = calibrate_san(adapter, [batch for _, batch in row_batches(build_ids, sample, config.batch_size, pad)])
    variants: list = [LazyFormerVariant(adapter)]
    variants += [SanVariant(adapter, calibration, calibration.threshold_for(share)) for share in config.san_shares]
    if service is None:
        log.warning("AttnCache-f reads maps in process: it runs on local: stores only; skipped")
        return variants
    keys = LayerKeys.build(adapter, service, namespace, build_ids, batch_size=config.batch_size)
    return variants + [AttnCacheFVariant(adapter, service, namespace, keys, q) for q in config.attncache_f]


# ---- the command ------------------------------------------------------------------


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``attnstore eval logs|sts|sst2|mmlu``."""
    helps = {
        "logs": "Loghub template classification (the headline workload)",
        "sts": "STS-B Spearman of sentence embeddings",
        "sst2": "SST-2 accuracy of a fixed classifier on sentence embeddings",
        "mmlu": "MMLU multiple choice, next-token letter (decoders)",
    }
    for name in TASKS:
        parser = documented_parser(
            subparsers, name, __doc__, summary=f"{helps[name]}: full model vs AttnStore and baselines"
        )
        parser.add_argument("--model", required=True, help="model alias (minilm, smollm2) or a local model folder")
        source = parser.add_mutually_exclusive_group()
        source.add_argument("--store",
                            help="an existing store: local:PATH, grpc[s]://HOST:PORT or HOST:PORT (with --namespace)")
        source.add_argument("--build-from", type=Path, metavar="FILE",
                            help="build the store from this corpus (.txt, .tsv with --column, .jsonl), in model input "
                                 "form (default: the task's train split, see the module help)")
        parser.add_argument("--column", help="text column of a .tsv --build-from corpus, or field of a .jsonl one")
        parser.add_argument("--namespace", help=f"namespace (default: {name}, with the shots for mmlu)")
        parser.add_argument("--json", required=True, type=Path, help="write the report here")
        parser.add_argument("--data", type=Path, default=None, help=DATA_HELP)
        parser.add_argument("--work-dir", type=Path, default=_DEFAULT_WORK,
                            help="where built stores go, reused by later runs (default runs/eval)")
        parser.add_argument("--thresholds", type=_floats,
                            help="map-hit thresholds swept, comma-separated (default: "
                                 f"{', '.join(map(str, SWEEP))} times the default threshold; 1, 2.5 for 5-shot mmlu)")
        parser.add_argument("--default-threshold", type=float,
                            help="the threshold reported as the default (default: the namespace's calibrated "
                                 "recommendation, which AttnCache uses when given none)")
        parser.add_argument("--limit", type=int, help="evaluate the first N queries (sts: pairs; logs: per system)")
        parser.add_argument("--store-limit", type=int, help="store only the first N train inputs (sts, sst2)")
        parser.add_argument("--batch-size", type=int, default=32, help="rows per forward (default 32)")
        parser.add_argument("--timing-queries", type=int, help="queries in the timing subset (default per task)")
        parser.add_argument("--timing-rounds", type=int, default=5, help="timed rounds after a warm-up (default 5)")
        parser.add_argument("--no-baselines", action="store_true", help="skip LazyFormer, SAN and AttnCache-f")
        parser.add_argument("--san-shares", type=_floats, default=(0.25, 0.5),
                            help="SAN: shares of adjacent layer pairs that share maps, the most alike by JS "
                                 "divergence on build inputs (default 0.25,0.5)")
        parser.add_argument("--attncache-f", type=_floats, default=(0.05, 0.2),
                            help="AttnCache-f: per-layer distance quantiles (default 0.05,0.2)")
        parser.add_argument("--codec", choices=["fp16", "zstd", "q8", "q8+zstd"],
                            help="codec of a store this command builds (default fp16; zstd for 5-shot mmlu)")
        parser.add_argument("--token-file", type=Path, help="file holding the daemon's bearer token")
        parser.add_argument("--token",
                            help=f"bearer token (prefer --token-file or ${TOKEN_ENV}: argv is visible to ps)")
        parser.add_argument("--tls-ca", help="CA certificate of a grpcs:// daemon")
        parser.add_argument("--seed", type=int, default=0, help="seed of the timing subset (default 0)")
        parser.add_argument("--no-progress", action="store_true", help="no progress bars")
        if name == "logs":
            parser.add_argument("--k", type=int, default=5, help="neighbours in the template vote (default 5)")
        if name == "mmlu":
            parser.add_argument("--shots", type=int, default=0, choices=[0, 5], help="exemplars per prompt")
            parser.add_argument("--subjects", nargs="+", default=list(STEM_SUBJECTS),
                                help="MMLU subjects (default: the 19 STEM subjects)")
            parser.add_argument("--per-subject", type=int,
                                help="first test questions per subject, half stored (default 20 0-shot, 4 5-shot)")
        parser.set_defaults(func=run, task=name)


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    """Run one evaluation; returns the exit code."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from attnstore_client.adapters import adapter_for
    from attnstore_client.models import load_model

    loaded = load_model(args.model)
    decoder = adapter_for(loaded).causal
    shots = getattr(args, "shots", 0)
    sizes = _MMLU_5SHOT if args.task == "mmlu" and shots == 5 else _SIZES.get((args.task, decoder))
    if sizes is None:
        raise ConfigError(f"{args.task} needs a decoder (its answer is a next-token logit); use --model smollm2")
    extra: dict[str, object] = {"shots": shots if args.task == "mmlu" else None}
    options = {
        "limit": args.limit if args.limit is not None else sizes.limit,
        "store_limit": args.store_limit if args.store_limit is not None else sizes.store_limit,
    }
    if args.task == "mmlu":
        options.update(shots=shots, subjects=args.subjects,
                       per_subject=args.per_subject if args.per_subject is not None else sizes.per_subject)
        extra.update(subjects=len(args.subjects), per_subject=options["per_subject"])
    if args.task == "logs":
        options["k"] = args.k
        extra["k"] = args.k
    extra.update(limit=options["limit"], store_limit=options["store_limit"])
    task = load_task(args.task, data_dir(args.data), decoder=decoder, **options)
    config = EvalConfig(
        thresholds=None if args.thresholds is None else tuple(args.thresholds),
        default_threshold=args.default_threshold, batch_size=args.batch_size,
        timing_queries=args.timing_queries or sizes.timing_queries, timing_rounds=args.timing_rounds, sweep=sizes.sweep,
        baselines=not args.no_baselines, san_shares=tuple(args.san_shares),
        attncache_f=tuple(args.attncache_f), seed=args.seed, progress=not args.no_progress, extra=extra,
    )
    namespace = args.namespace or (f"mmlu-{shots}shot" if args.task == "mmlu" else args.task)
    stored = options["per_subject"] if args.task == "mmlu" else options["store_limit"]
    # A bare HOST:PORT is a daemon, as for every command that names one.
    store = store_url(args.store, tls=args.tls_ca is not None) if args.store else None
    store = store or _build_store(loaded, task, args, namespace, stored)
    token = read_token(args)
    started = time.perf_counter()
    report = evaluate(task, loaded, store, namespace, config, token=token, tls_ca=args.tls_ca)
    report["seconds"] = round(time.perf_counter() - started, 1)
    write_json(args.json, report, indent=1)
    print(format_report(report))
    print(f"wrote {args.json}")
    return 0


def _build_store(loaded, task: Task, args: argparse.Namespace, namespace: str, stored: int | None) -> str:
    """Build (or reuse) the task's store under ``--work-dir``; returns its ``local:`` URL.

    ``stored`` is the size option that decides what is stored (``--store-limit``,
    or ``--per-subject`` for mmlu); it is part of the folder's name.
    """
    from attnstore.service import AttnStoreService
    from attnstore_tools.build.command import BuildConfig, build_namespace
    from attnstore_tools.build.command import format_report as format_build
    from attnstore_tools.corpus import read_texts

    if args.build_from is not None:
        suffix = f"-{args.build_from.stem}"
    else:
        # Every size that changes what is stored is in the name: a store is reused only for the same corpus.
        shots = f"-{args.shots}shot" if task.name == "mmlu" else ""
        suffix = f"-{task.name}{shots}" + ("" if stored is None else f"-n{stored}")
    path = args.work_dir / "stores" / f"{Path(loaded.name).name}{suffix}"
    corpus = task.build if args.build_from is None else read_texts(args.build_from, column=args.column)
    with AttnStoreService.open(path, create=True) as service:
        try:
            service.get_namespace(namespace)
            print(f"store {path}: reusing namespace {namespace!r}")
            return f"local:{path}"
        except NamespaceNotFoundError:
            pass
        # Rows over the model's context are skipped and counted by the build (queries are truncated).
        codec = args.codec or ("zstd" if task.name == "mmlu" and task.queries and args.shots == 5 else "fp16")
        # The build tokenizes as the queries are tokenized: up to the model's own limit (the head's).
        from attnstore_client.sentence.heads import sentence_head

        config = BuildConfig(namespace=namespace, codec=codec, max_length=sentence_head(loaded).max_length)
        print(f"building namespace {namespace!r} in {path} from {len(corpus)} inputs")
        report = build_namespace(loaded, corpus, service, config, progress=not args.no_progress)
    print(format_build(report))
    return f"local:{path}"
