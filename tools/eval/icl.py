"""``attnstore eval icl``: in-context classification with retrieved exemplars, chunk fusion against full prefill.

For each query of the task, its ``--shots`` most similar labelled exemplars are
retrieved from a pool by all-MiniLM-L6-v2 cosine (SST-2: train sentences; MMLU:
the dev split and the even-numbered test questions of every subject, queries
being the odd-numbered ones), and the prompt is given in segments: instruction,
exemplars (most similar last), query. Every method scores the same prompts
(next-token choice over the labels) in one process:

- ``full``: full prefill (the reference);
- ``prefix``: the instruction's stored keys and values, the rest computed (what the
  prefix tier gives at best here: the prompts share nothing after the instruction);
- ``full_reuse``: every exemplar's stored keys and values moved to its place, the query alone computed;
- ``cacheblend@r``, ``a3@r``: the same, with a share r of exemplar tokens computed again,
  chosen by value deviation (CacheBlend) or by the query's attention (A3) at layer 1;
- with ``--recent K``, the same three again with the last K exemplars (the most
  similar, next to the query) computed in full (``+K`` rows).

The exemplars' chunks are computed on their own after the instruction and stored
in an in-memory chunk source before any method is timed (a store built ahead).
Per method: accuracy, answers agreeing with full prefill, cosine of the last
hidden state to full prefill's, share of prompt tokens computed (token-layers
over prompt tokens times layers), and its time end to end including and
excluding retrieval (fetching the chunks), with the speedups over full prefill.
Agreement is also given on the *clear* queries alone, those where full prefill's
top choice leads the next by at least ``CLEAR`` in probability: a query full
prefill itself nearly ties flips at the smallest change of its last state.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from attnstore.errors import ConfigError
from attnstore_client.call.sinks import LastStates
from attnstore_client.call.sources import RowSource, Tokenized
from attnstore_tools.arguments import documented_parser
from attnstore_tools.corpus import DATA_HELP, data_dir
from attnstore_tools.eval.oracle.corpora import LETTERS, mmlu_prompt
from attnstore_tools.output import write_json

log = logging.getLogger(__name__)

RATIOS = (0.05, 0.15, 0.3)
CHUNK_BYTES = 12 << 30  # 872 SST-2 prompts' exemplars: about 5,000 chunks, 3.5 GB in fp16
CLEAR = 0.1  # a clear query: full prefill's top choice leads the next by this much probability
_SST2_INSTRUCTION = "Classify the sentiment of each movie review as positive or negative.\n\n"
_SST2_LABELS = (" negative", " positive")
_MMLU_INSTRUCTION = "The following are multiple choice questions (with answers).\n\n"


@dataclass(frozen=True)
class IclTask:
    """Queries in segments (their exemplars retrieved) and their gold answers."""

    name: str
    instruction: str
    choices: tuple[str, ...]  # the answer tokens, as text
    pool: list[str]  # exemplar texts, label included
    pool_keys: list[str]  # what retrieval embeds per exemplar (the text without its label)
    queries: list[str]  # query texts, ending where the answer token follows
    query_keys: list[str]
    gold: np.ndarray  # (n,) index into ``choices``


def load_icl_task(name: str, data: Path, *, limit: int | None, pool: int | None, seed: int = 0) -> IclTask:
    """The task's pool and queries (``limit`` queries, ``pool`` exemplars at most, both seeded samples).

    Raises:
        ConfigError: an unknown task.
    """
    rng = np.random.default_rng(seed)
    if name == "sst2":
        train = _tsv(data / "sst2_train.tsv")
        dev = _tsv(data / "sst2_dev.tsv")
        train = [train[i] for i in rng.permutation(len(train))[:pool]] if pool else train
        dev = [dev[i] for i in sorted(rng.permutation(len(dev))[:limit])] if limit else dev
        return IclTask(
            "sst2", _SST2_INSTRUCTION, _SST2_LABELS,
            [f"Review: {s.strip()}\nSentiment:{_SST2_LABELS[int(y)]}\n\n" for s, y in train], [s for s, _ in train],
            [f"Review: {s.strip()}\nSentiment:" for s, _ in dev], [s for s, _ in dev],
            np.array([int(y) for _, y in dev]),
        )
    if name == "mmlu":
        import json

        test = [json.loads(line) for line in (data / "mmlu_test.jsonl").read_text().splitlines() if line.strip()]
        dev = [json.loads(line) for line in (data / "mmlu_dev.jsonl").read_text().splitlines() if line.strip()]
        seen: dict[str, int] = {}
        held, asked = [], []
        for record in test:
            number = seen[record["subject"]] = seen.get(record["subject"], -1) + 1
            (held if number % 2 == 0 else asked).append(record)
        records = dev + held
        records = [records[i] for i in rng.permutation(len(records))[:pool]] if pool else records
        asked = [asked[i] for i in sorted(rng.permutation(len(asked))[:limit])] if limit else asked

        def block(record: dict) -> str:
            prompt = mmlu_prompt(record["subject"], record["question"], record["choices"])
            return prompt[prompt.index("\n\n") + 2 :]  # without the subject's header line

        return IclTask(
            "mmlu", _MMLU_INSTRUCTION, tuple(f" {letter}" for letter in LETTERS),
            [block(r) + f" {r['answer']}\n\n" for r in records], [r["question"] for r in records],
            [block(r) for r in asked], [r["question"] for r in asked],
            np.array([LETTERS.index(r["answer"]) for r in asked]),
        )
    raise ConfigError(f"eval icl: --task must be one of ['sst2', 'mmlu'], got {name!r}")


def _tsv(path: Path) -> list[tuple[str, str]]:
    lines = path.read_text(encoding="utf-8").splitlines()[1:]
    return [(parts[0], parts[1]) for parts in (line.split("\t") for line in lines) if len(parts) >= 2]


def retrieve(task: IclTask, shots: int, *, batch_size: int = 64, progress: bool = True) -> list[list[str]]:
    """Each query's prompt in segments: instruction, its ``shots`` nearest exemplars (most similar last), query.

    An exemplar whose text is the query's own is never retrieved.
    """
    from attnstore_client.models import load_model

    encoder = load_model("minilm").sentence_transformer
    assert encoder is not None  # the packaged all-MiniLM-L6-v2 has its sentence-transformers configuration
    pool = encoder.encode(task.pool_keys, batch_size=batch_size, normalize_embeddings=True,
                          show_progress_bar=progress, convert_to_numpy=True)  # (P, 384)
    queries = encoder.encode(task.query_keys, batch_size=batch_size, normalize_embeddings=True,
                             show_progress_bar=progress, convert_to_numpy=True)  # (n, 384)
    prompts = []
    for q, similarity in enumerate(queries @ pool.T):  # (P,) per query
        order = [i for i in np.argsort(-similarity) if task.pool_keys[i].strip() != task.query_keys[q].strip()]
        nearest = order[:shots][::-1]  # most similar last, next to the query
        prompts.append([task.instruction, *[task.pool[i] for i in nearest], task.queries[q]])
    return prompts


@dataclass
class MethodRun:
    """One method's pass over every prompt."""

    name: str
    last: torch.Tensor  # (n, hidden)
    seconds: float
    fetch_seconds: float
    computed_tokens: float  # full-forward tokens computed (token-layers over layers)


def evaluate_icl(loaded, prompts: Sequence[Sequence[str]], task: IclTask, *, ratios: Sequence[float] = RATIOS,
                 recent: Sequence[int] = (), batch_size: int = 16, progress: bool = True) -> dict[str, object]:
    """Run every method over ``prompts`` and score them against full prefill; returns the report."""
    from attnstore.index import ExactIndex
    from attnstore.protocol.records import NamespaceLayout
    from attnstore.service import AttnStoreService
    from attnstore.store.opening import MEMORY_LOCATION, open_store
    from attnstore_client.adapters import adapter_for
    from attnstore_client.cache import AttnCache
    from attnstore_client.call.settings import ChunkSettings
    from attnstore_client.call.sources import segment_tokens
    from attnstore_client.choices import choice_ids
    from attnstore_client.connection.local import LocalConnection
    from attnstore_client.keys import model_fingerprint
    from attnstore_client.tiers.chunks.source import MemoryChunkSource

    adapter = adapter_for(loaded)
    fingerprint = model_fingerprint(loaded.model, loaded.tokenizer)
    service = AttnStoreService(open_store(MEMORY_LOCATION).store, make_index=ExactIndex)
    layout = NamespaceLayout(layers=adapter.num_layers, heads=adapter.num_heads, causal=True,
                             hidden=adapter.hidden_size, feature_dim=16)
    service.create_namespace("icl", model=loaded.name, fingerprint=fingerprint, layout=layout)
    # Room for every chunk (a store built ahead): an evicted chunk would be computed again in each method's pass.
    cache = AttnCache(loaded, LocalConnection("local:memory", service), namespace="icl", exact=False,
                      exact_cache_bytes=0, chunk_source=MemoryChunkSource(capacity_bytes=CHUNK_BYTES))
    cache.maps = cache.prefix = False
    answers = choice_ids(loaded.tokenizer, task.choices)
    tokenized = segment_tokens(loaded.tokenizer, prompts, max_length=10**9)
    # The prefix tier's best case: the instruction stored, everything after it computed (one segment).
    as_prefix = [Tokenized(row.ids, (row.segments[0], sum(row.segments[1:]))) for row in tokenized]
    reuse = ChunkSettings(method="full_reuse", recent=0)
    methods: list[tuple[str, ChunkSettings | None]] = [("full", None), ("prefix", reuse), ("full_reuse", reuse)]
    methods += [(f"{m}@{r:g}", ChunkSettings(method=m, ratio=r, recent=0))
                for m in ("cacheblend", "a3") for r in ratios]
    for k in (k for k in recent if k > 0):
        methods += [(f"full_reuse+{k}", ChunkSettings(method="full_reuse", recent=k))]
        methods += [(f"{m}@{r:g}+{k}", ChunkSettings(method=m, ratio=r, recent=k))
                    for m in ("cacheblend", "a3") for r in ratios]
    # The exemplars' chunks, computed on their own after the instruction: stored before anything is timed.
    cache.chunks = reuse
    started = time.perf_counter()
    _last(cache, tokenized, batch_size, progress)
    build_s = time.perf_counter() - started
    captured = cache.last_stats.chunks_captured
    evicted = cache.chunk_source.stats().evictions if isinstance(cache.chunk_source, MemoryChunkSource) else 0
    if evicted:
        raise ConfigError(f"eval icl: {evicted} chunks did not fit in {CHUNK_BYTES} bytes; every method would "
                          "compute them again")
    runs: list[MethodRun] = []
    for name, settings in tqdm(methods, desc="methods", unit="method", disable=not progress):
        cache.chunks = settings
        started = time.perf_counter()
        last = _last(cache, as_prefix if name == "prefix" else tokenized, batch_size, False)
        seconds = time.perf_counter() - started
        stats = cache.last_stats
        runs.append(MethodRun(name, last, seconds, stats.fetch_s, float(stats.forward_tokens)))
    prompt_tokens = float(sum(len(row.ids) for row in tokenized))
    return _report(task, loaded, runs, answers, prompt_tokens, build_s, captured, len(tokenized))


class _Rows(RowSource):
    """Prompts tokenized once, in segments, for every method alike."""

    def __init__(self, rows: Sequence[Tokenized]) -> None:
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    def order(self) -> np.ndarray:
        return np.argsort([-len(row.ids) for row in self._rows], kind="stable")

    def tokens(self, positions: Sequence[int]) -> list[Tokenized]:
        return [self._rows[p] for p in positions]


def _last(cache, rows: Sequence[Tokenized], batch_size: int, progress: bool) -> torch.Tensor:
    """Each prompt's last hidden state ``(n, hidden)``, one call."""
    sink = LastStates(len(rows))
    cache.run(_Rows(rows), sink, batch_size=batch_size, show_progress_bar=progress)
    return sink.result()


def _report(task: IclTask, loaded, runs: list[MethodRun], answers: Sequence[int], prompt_tokens: float,
            build_s: float, captured: int, count: int) -> dict[str, object]:
    from attnstore_client.choices import next_token_choice

    assert loaded.lm_head is not None
    scores = {run.name: next_token_choice(loaded.lm_head, run.last, answers) for run in runs}
    full = runs[0]
    reference = scores["full"].index
    top_two = np.sort(scores["full"].probabilities, axis=1)[:, -2:]  # (n, 2)
    clear = top_two[:, 1] - top_two[:, 0] >= CLEAR  # (n,)
    methods = []
    for run in runs:
        chosen = scores[run.name].index
        cosine = torch.nn.functional.cosine_similarity(run.last, full.last, dim=-1).numpy()  # (n,)
        methods.append({
            "method": run.name,
            "accuracy": round(float((chosen == task.gold).mean() * 100), 2),
            "agreement": round(float((chosen == reference).mean() * 100), 2),
            "agreement_clear": round(float((chosen == reference)[clear].mean() * 100), 2) if clear.any() else None,
            "cosine_mean": round(float(cosine.mean()), 5),
            "cosine_min": round(float(cosine.min()), 5),
            "computed_share": round(run.computed_tokens / prompt_tokens, 4),
            "seconds": round(run.seconds, 3),
            "fetch_seconds": round(run.fetch_seconds, 4),
            "speedup_incl_retrieval": round(full.seconds / run.seconds, 3),
            "speedup_excl_retrieval": round(full.seconds / max(run.seconds - run.fetch_seconds, 1e-9), 3),
        })
    return {
        "task": task.name, "model": loaded.name, "queries": count, "prompt_tokens": int(prompt_tokens),
        "mean_prompt_tokens": round(prompt_tokens / max(count, 1), 1), "torch_threads": torch.get_num_threads(),
        "cores": os.cpu_count(), "chunk_build_seconds": round(build_s, 2), "chunks_stored": captured,
        "clear_share": round(float(clear.mean()), 4), "clear_margin": CLEAR,
        "methods": methods,
    }


def format_icl(report: dict) -> str:
    """The report as a table."""
    lines = [f"eval icl: {report['task']}, {report['model']}, {report['queries']} queries, "
             f"{report['mean_prompt_tokens']} tokens per prompt, {report['chunks_stored']} chunks stored in "
             f"{report['chunk_build_seconds']} s; {report['clear_share']:.1%} of queries clear (full prefill's "
             f"choice leads by >= {report['clear_margin']})",
             f"{'method':<18} {'acc %':>6} {'agree %':>8} {'clear %':>8} {'cos':>7} {'cos min':>8} {'computed':>9} "
             f"{'s':>7} {'x incl':>7} {'x excl':>7}"]
    for m in report["methods"]:
        clear = "-" if m["agreement_clear"] is None else f"{m['agreement_clear']:.1f}"
        lines.append(f"{m['method']:<18} {m['accuracy']:>6.1f} {m['agreement']:>8.1f} {clear:>8} "
                     f"{m['cosine_mean']:>7.4f} "
                     f"{m['cosine_min']:>8.4f} {m['computed_share']:>9.1%} {m['seconds']:>7.2f} "
                     f"{m['speedup_incl_retrieval']:>7.2f} {m['speedup_excl_retrieval']:>7.2f}")
    return "\n".join(lines)


def plot_icl(report: dict, path: Path) -> None:
    """A PNG of each method's agreement with full prefill against its speedup (including retrieval).

    Raises:
        ConfigError: matplotlib is not installed.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ConfigError("eval icl draws its plot with matplotlib: pip install 'attnstore[eval]'") from exc
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    for m in report["methods"]:
        family = m["method"].split("@")[0].split("+")[0]
        marker = {"full": "s", "prefix": "D", "full_reuse": "v", "cacheblend": "o", "a3": "^"}.get(family, "x")
        ax.scatter(m["speedup_incl_retrieval"], m["agreement"], marker=marker)
        ax.annotate(m["method"], (m["speedup_incl_retrieval"], m["agreement"]), fontsize=7,
                    xytext=(3, 3), textcoords="offset points")
    ax.axhline(98, linestyle=":", linewidth=0.8)
    ax.axvline(2.5, linestyle=":", linewidth=0.8)
    ax.set_xlabel("speedup over full prefill, including retrieval (×)")
    ax.set_ylabel("answers agreeing with full prefill (%)")
    ax.set_title(f"eval icl: {report['task']}, {report['model']}, {report['queries']} queries, "
                 f"{report.get('shots', '?')} shots", fontsize=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")


# ---- the command ------------------------------------------------------------------


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``attnstore eval icl``."""
    parser = documented_parser(subparsers, "icl", __doc__,
                               summary="in-context classification with retrieved exemplars: chunk fusion vs full "
                                       "prefill")
    parser.add_argument("--model", required=True, help="a decoder alias (smollm2) or a local model folder")
    parser.add_argument("--task", required=True, choices=["sst2", "mmlu"])
    parser.add_argument("--shots", type=int, default=8, help="exemplars per prompt (default 8)")
    parser.add_argument("--limit", type=int, help="evaluate N queries, a seeded sample (default: all)")
    parser.add_argument("--pool", type=int, help="retrieve from N exemplars of the pool, a seeded sample "
                                                 "(default: all)")
    parser.add_argument("--ratios", type=_floats, default=RATIOS,
                        help="recompute ratios of CacheBlend and A3 (default 0.05,0.15,0.3)")
    parser.add_argument("--recent", type=_ints, default=(),
                        help="comma-separated K: rows with the last K exemplars computed in full (default none)")
    parser.add_argument("--batch-size", type=int, default=16, help="prompts per forward (default 16)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the query and pool samples (default 0)")
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--plot", type=Path, help="write a PNG of agreement against speedup here")
    parser.add_argument("--data", type=Path, default=None, help=DATA_HELP)
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(func=run)


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(value < 0 for value in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 0, got {text!r}")
    return values


def run(args: argparse.Namespace) -> int:
    """Run the evaluation; returns the exit code."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from attnstore_client.adapters import adapter_for
    from attnstore_client.models import load_model

    if args.shots < 1:
        raise ConfigError(f"eval icl: --shots must be >= 1, got {args.shots}")
    loaded = load_model(args.model)
    if not adapter_for(loaded).causal or loaded.lm_head is None:
        raise ConfigError(f"eval icl needs a decoder with a language-model head; {args.model!r} is not one")
    task = load_icl_task(args.task, data_dir(args.data), limit=args.limit, pool=args.pool, seed=args.seed)
    prompts = retrieve(task, args.shots, progress=not args.no_progress)
    report = evaluate_icl(loaded, prompts, task, ratios=args.ratios, recent=args.recent, batch_size=args.batch_size,
                          progress=not args.no_progress)
    report.update(shots=args.shots, pool=len(task.pool), seed=args.seed)
    print(format_icl(report))
    if args.json is not None:
        write_json(args.json, report, indent=1)
        print(f"wrote {args.json}")
    if args.plot is not None:
        plot_icl(report, args.plot)
        print(f"wrote {args.plot}")
    return 0
