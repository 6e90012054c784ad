"""``bench score``: ``/v1/score`` requests from N concurrent clients against the node and two baseline servers.

    attnstore bench score --model smollm2 --clients 1 8 32 --requests 8 --items 2 --json score.json --plot score.png
    python -m attnstore_tools.bench.score serve --method plain|cached --model smollm2 --ready-file F  # a baseline

Requests are MMLU 5-shot (``../shared/data/mmlu_dev.jsonl`` exemplars, ``mmlu_test.jsonl``
questions): per request one subject's five exemplars as the ``query`` and ``--items``
of its test questions as the ``items``, the letters `` A``..`` D`` as the label tokens.
Three servers, the same HTTP layer (``attnstore_node``'s app) and the same requests:

- ``node``: ``attnstore node`` on an embedded store holding, as prefix blocks (fp32),
  the 5-shot prompts of the subjects the requests draw, stored before the runs as
  ``attnstore build --prefix-blocks`` stores a corpus's shared prompt starts (the dev
  split's exemplars; ``--no-store-queries`` leaves it empty): each item's forward runs
  on its question after the stored keys and values; requests are merged into calls;
- ``plain``: each request's prompts through the plain transformers forward, one
  request at a time (padded batch, the LM head in fp32);
- ``cached``: ``plain`` with an exact output cache (a dict of prompt tokens -> scores).

Per server and client count: items/s, p50/p99 request latency, errors, tokens
computed per real token (node: ``/metrics`` forward tokens over the requests'
tokens), and whether every answer's most probable label equals ``plain``'s (and
the largest difference of the scores). A table, and JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from attnstore_node.engine import Embedded, Embedder
from attnstore_node.errors import bad_request
from attnstore_node.schema import Input, ModelInfo
from attnstore_tools.arguments import DEFAULT_NODE_AUDIT_RATE, audit_rate, documented_parser

log = logging.getLogger(__name__)

DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data"
LETTERS = ("A", "B", "C", "D")


class PlainScorer(Embedder):
    """Each scoring request through the plain forward, one request at a time; with ``cached``, a dict in front.

    Args:
        model: a model alias or folder (a decoder).
        cached: keep each prompt's scores and answer repeats from them.
        threads: torch threads.
    """

    def __init__(self, model: str, cached: bool, threads: int) -> None:
        self._name = model
        self._cache: dict[tuple[tuple[int, ...], tuple[int, ...], bool], np.ndarray] | None = {} if cached else None
        self._threads = threads
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plain")
        self._info: ModelInfo | None = None
        self._loaded: Any = None
        self.computed_tokens = 0

    @property
    def info(self) -> ModelInfo | None:
        """See :meth:`Embedder.info`."""
        return self._info

    def start(self) -> None:
        """See :meth:`Embedder.start`: loads on the worker thread."""
        self._pool.submit(self._load)

    def _load(self) -> None:
        import torch

        from attnstore_client.models import load_model

        torch.set_num_threads(self._threads)
        self._loaded = loaded = load_model(self._name)
        config = loaded.model.config
        self._info = ModelInfo(self._name, int(config.hidden_size), int(config.vocab_size),
                               int(getattr(config, "max_position_embeddings", 8192)), decoder=True)

    def stop(self) -> None:
        """See :meth:`Embedder.stop`."""
        self._pool.shutdown(wait=True)

    async def embed(self, inputs: Sequence[Input], *, truncate: bool, max_input_tokens: int,
                    prompt_name: str | None = None) -> Embedded:
        """See :meth:`Embedder.embed`: this baseline only scores."""
        raise bad_request("this baseline server only scores", "unsupported_route")

    async def score(self, prompts: Sequence[Input], labels: Sequence[int] | Sequence[str], *, softmax: bool,
                    max_input_tokens: int) -> Embedded:
        """See :meth:`Embedder.score`: the plain forward of the request's prompts (the misses, when cached)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._score, list(prompts), list(labels), softmax)

    def _score(self, prompts: list[Input], labels: list[Any], softmax: bool) -> Embedded:
        import torch

        from attnstore_client.choices import label_probabilities
        from attnstore_node.tokenization import label_token_ids

        tokenizer = self._loaded.tokenizer
        ids = tuple(label_token_ids(tokenizer, labels))
        rows = [tuple(tokenizer(p, add_special_tokens=True)["input_ids"]) if isinstance(p, str) else tuple(p)
                for p in prompts]
        out = np.empty((len(rows), len(ids)), np.float32)
        keys = [(row, ids, softmax) for row in rows]
        missing = [i for i, key in enumerate(keys) if self._cache is None or key not in self._cache]
        if missing:
            width = max(len(rows[i]) for i in missing)
            pad = tokenizer.pad_token_id or 0
            input_ids = torch.tensor([list(rows[i]) + [pad] * (width - len(rows[i])) for i in missing])  # (B, P)
            mask = (torch.arange(width)[None, :] < torch.tensor([len(rows[i]) for i in missing])[:, None]).long()
            with torch.inference_mode():
                hidden = self._loaded.model(input_ids=input_ids, attention_mask=mask).last_hidden_state  # (B, P, h)
            last = hidden[torch.arange(len(missing)), mask.sum(dim=1) - 1]  # (B, hidden)
            scores = label_probabilities(self._loaded.lm_head, last, ids, over_labels=softmax).numpy()
            self.computed_tokens += sum(len(rows[i]) for i in missing)
            for r, i in enumerate(missing):
                out[i] = scores[r]
                if self._cache is not None:
                    self._cache[keys[i]] = scores[r]
        for i, key in enumerate(keys):
            if i not in missing and self._cache is not None:
                out[i] = self._cache[key]
        return Embedded(out, sum(len(row) for row in rows))


def mmlu_requests(requests: int, items: int, *, seed: int = 0) -> list[dict[str, Any]]:
    """``/v1/score`` bodies: per request one subject's 5-shot prompt as the query and ``items`` questions."""
    dev = [json.loads(line) for line in (DATA / "mmlu_dev.jsonl").read_text(encoding="utf-8").splitlines()]
    test = [json.loads(line) for line in (DATA / "mmlu_test.jsonl").read_text(encoding="utf-8").splitlines()]
    by_subject: dict[str, list[dict[str, Any]]] = {}
    for row in test:
        by_subject.setdefault(row["subject"], []).append(row)
    rng = np.random.default_rng(seed)
    subjects = sorted(by_subject)
    bodies = []
    for _ in range(requests):
        subject = subjects[int(rng.integers(len(subjects)))]
        shots = [row for row in dev if row["subject"] == subject][:5]
        query = (f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}."
                 "\n\n" + "".join(_question(row) + f" {row['answer']}\n\n" for row in shots))
        picked = rng.choice(len(by_subject[subject]), size=min(items, len(by_subject[subject])), replace=False)
        bodies.append({"query": query, "items": [_question(by_subject[subject][int(i)]) for i in picked]})
    return bodies


def _question(row: dict[str, Any]) -> str:
    choices = "".join(f"\n{letter}. {choice}" for letter, choice in zip(LETTERS, row["choices"], strict=True))
    return f"{row['question']}{choices}\nAnswer:"


class Server:
    """A server subprocess on a free loopback port, ready once its ready file is written."""

    def __init__(self, command: list[str], workdir: Path) -> None:
        self.ready_file = workdir / "ready.json"
        self.log_path = workdir / "server.log"
        self._command = [*command, "--listen", "127.0.0.1:0", "--ready-file", str(self.ready_file)]
        self.process: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self, timeout: float = 600.0) -> Server:
        """Start it and wait for its ready file.

        Raises:
            RuntimeError: it exited or was not ready within ``timeout`` seconds.
        """
        with self.log_path.open("ab") as out:
            self.process = subprocess.Popen(self._command, stdout=out, stderr=subprocess.STDOUT,
                                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
        deadline = time.monotonic() + timeout
        while not self.ready_file.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server {self._command[:4]} did not start; see {self.log_path}")
            time.sleep(0.1)
        self.url = f"http://127.0.0.1:{json.loads(self.ready_file.read_text(encoding='utf-8'))['port']}"
        return self

    def stop(self) -> None:
        """SIGTERM, then SIGKILL past 60 s."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _score_answer(body: Any) -> Any:
    return body["scores"]


async def run_clients(url: str, bodies: list[dict[str, Any]], clients: int, *, route: str = "/v1/score",
                      items: str = "items", read: Callable[[Any], Any] = _score_answer) -> dict[str, Any]:
    """``bodies`` posted to ``route`` by ``clients`` concurrent clients; latencies, each answer as ``read`` takes it
    from the JSON (its scores per item, in the request's order) and errors; items/s counts each body's
    ``items``."""
    import httpx

    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(len(bodies)):
        queue.put_nowait(index)
    latencies: list[float] = []
    scores: list[Any] = [None] * len(bodies)
    errors = 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal errors
        while not queue.empty():
            index = queue.get_nowait()
            begun = time.perf_counter()
            try:
                answer = await http.post(f"{url}{route}", json=bodies[index], timeout=1800)
                answer.raise_for_status()
                scores[index] = read(answer.json())
            except httpx.HTTPStatusError as exc:
                log.warning("request %d failed: %s %s", index, exc.response.status_code, exc.response.text[:300])
                errors += 1
            except httpx.HTTPError as exc:
                log.warning("request %d failed: %s", index, exc)
                errors += 1
            latencies.append(time.perf_counter() - begun)

    started = time.perf_counter()
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=clients)) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    seconds = time.perf_counter() - started
    count = sum(len(body[items]) for body in bodies)
    return {"clients": clients, "seconds": seconds, "items_per_s": count / seconds, "errors": errors,
            "p50_ms": 1000 * float(np.percentile(latencies, 50)), "p99_ms": 1000 * float(np.percentile(latencies, 99)),
            "scores": scores}


def _metric(url: str, name: str) -> float:
    import httpx

    match = re.search(rf"^{re.escape(name)} (\S+)$", httpx.get(f"{url}/metrics", timeout=30).text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def _store(loaded: Any, path: Path) -> str:
    """An embedded store with a namespace for ``loaded`` (a ``LoadedModel``); its ``local:`` URL."""
    from attnstore.service import AttnStoreService
    from attnstore_client.keys import model_fingerprint
    from attnstore_tools.build.namespace_layout import exact_tier_layout

    service = AttnStoreService.open(path, create=True)
    try:
        service.create_namespace("default", model=loaded.name, layout=exact_tier_layout(loaded),
                                 fingerprint=model_fingerprint(loaded.model, loaded.tokenizer))
    finally:
        service.close()
    return f"local:{path}"


def _store_queries(loaded: Any, path: Path, queries: Sequence[str]) -> int:
    """The queries' prefix blocks (fp32, so served rows equal the plain forward's) stored in the namespace, as
    ``attnstore build --prefix-blocks`` stores a corpus's shared prompt starts; returns the blocks stored."""
    from attnstore.service import AttnStoreService
    from attnstore_client.adapters import adapter_for
    from attnstore_tools.build.prefix import PrefixBuildConfig, store_prefix_blocks

    rows = [loaded.tokenizer(query)["input_ids"] for query in queries]
    service = AttnStoreService.open(path)
    try:
        report = store_prefix_blocks(adapter_for(loaded), rows, service, "default", PrefixBuildConfig(min_shared=1),
                                     pad_id=loaded.tokenizer.pad_token_id, progress=True)
    finally:
        service.close()
    log.info("stored %d prefix blocks (%.0f MB) of %d queries in %.0f s", report.blocks, report.bytes / 1e6,
             len(queries), report.seconds)
    return report.blocks


def bench(args: argparse.Namespace) -> dict[str, Any]:
    """Every server at every client count, the same requests each time (a fresh server per count)."""
    # At least one request per client: a run of N clients posts max(--requests, N) requests, the first ones of
    # the same seeded draw, so every server at one client count answers the same requests.
    bodies = mmlu_requests(max(args.requests, *args.clients), args.items, seed=args.seed)
    labels = None
    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="attnstore-bench-score-") as tmp:
        from attnstore_client.models import load_model

        loaded = load_model(args.model)
        store = _store(loaded, Path(tmp) / "store")
        tokenizer = loaded.tokenizer
        labels = [tokenizer(f" {letter}", add_special_tokens=False)["input_ids"][-1] for letter in LETTERS]
        for body in bodies:
            body["label_token_ids"] = labels
        lengths = [sum(len(tokenizer(body["query"] + item)["input_ids"]) for item in body["items"]) for body in bodies]
        stored = 0
        if "node" in args.methods and args.store_queries:
            stored = _store_queries(loaded, Path(tmp) / "store", sorted({body["query"] for body in bodies}))
        for method in args.methods:
            for clients in args.clients:
                run_bodies = bodies[: max(args.requests, clients)]
                tokens = sum(lengths[: len(run_bodies)])
                workdir = Path(tmp) / f"{method}-{clients}"
                workdir.mkdir()
                if method == "node":
                    command = [sys.executable, "-m", "attnstore_tools.cli", "node", "--model", args.model, "--store",
                               store, "--threads", str(args.threads), "--audit-rate", str(args.audit_rate)]
                else:
                    command = [sys.executable, "-m", "attnstore_tools.bench.score", "serve", "--method", method,
                               "--model", args.model, "--threads", str(args.threads)]
                server = Server(command, workdir).start()
                try:
                    before = _metric(server.url, "attnstore_node_forward_tokens_total") if method == "node" else 0
                    row = asyncio.run(run_clients(server.url, run_bodies, clients))
                    if method == "node":
                        row["computed_per_token"] = (_metric(server.url, "attnstore_node_forward_tokens_total")
                                                     - before) / tokens
                finally:
                    server.stop()
                row["method"], row["requests"], row["tokens"] = method, len(run_bodies), tokens
                results.setdefault(method, []).append(row)
                log.info("%s clients=%d items/s=%.2f", method, clients, row["items_per_s"])
    _compare(results)
    return {"model": args.model, "requests": args.requests, "items": args.items, "threads": args.threads,
            "audit_rate": args.audit_rate,
            "stored_query_blocks": stored,
            "label_token_ids": labels, "results": results}


def _compare(results: dict[str, list[dict[str, Any]]]) -> None:
    """Each row's answers against ``plain``'s at the same client count: argmax equal, largest score difference."""
    reference = {row["clients"]: row["scores"] for row in results.get("plain", [])}
    for rows in results.values():
        for row in rows:
            expected = reference.get(row["clients"])
            if expected is None or None in row["scores"] or None in expected:
                row["same_answers"], row["max_diff"] = None, None
                continue
            ours = np.concatenate([np.array(s) for s in row["scores"]])
            theirs = np.concatenate([np.array(s) for s in expected])
            row["same_answers"] = bool((ours.argmax(axis=1) == theirs.argmax(axis=1)).all())
            row["max_diff"] = float(np.abs(ours - theirs).max())


def speedups(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per client count, the node's items/s over every other server's and its p99 against theirs
    (``x_<server>``, ``p99_vs_<server>``); ``bench rerank``'s too."""
    by = {(row["method"], row["clients"]): row for rows in report["results"].values() for row in rows}
    out = []
    for (method, clients), node in sorted(by.items(), key=lambda item: item[0][1]):
        if method != "node":
            continue
        line: dict[str, Any] = {"clients": clients}
        for baseline in report["results"]:
            other = by.get((baseline, clients))
            if baseline != "node" and other is not None:
                line[f"x_{baseline}"] = node["items_per_s"] / other["items_per_s"]
                line[f"p99_vs_{baseline}"] = node["p99_ms"] / other["p99_ms"]
        out.append(line)
    return out


def plot_by_clients(report: dict[str, Any], path: Path, rate: str, title: str) -> None:
    """A PNG at ``path`` of every server's ``rate`` (its items/s) and p99 latency against concurrent clients;
    ``bench rerank``'s too."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (items_ax, p99_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for method, rows in report["results"].items():
        counts = [row["clients"] for row in rows]
        items_ax.plot(counts, [row["items_per_s"] for row in rows], "o-", label=method)
        p99_ax.plot(counts, [row["p99_ms"] / 1000 for row in rows], "o-", label=method)
    for ax, label in ((items_ax, rate), (p99_ax, "p99 request latency (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def _table(report: dict[str, Any]) -> str:
    lines = [f"{'server':8} {'clients':>7} {'requests':>8} {'items/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'errors':>6} "
             f"{'computed/token':>14} {'same':>5} {'max diff':>9}"]
    for rows in report["results"].values():
        for row in rows:
            computed = row.get("computed_per_token")
            diff = row.get("max_diff")
            lines.append(f"{row['method']:8} {row['clients']:7d} {row['requests']:8d} {row['items_per_s']:8.2f} "
                         f"{row['p50_ms']:8.0f} "
                         f"{row['p99_ms']:8.0f} {row['errors']:6d} {'' if computed is None else f'{computed:.3f}':>14} "
                         f"{str(row.get('same_answers')):>5} {'' if diff is None else f'{diff:.1e}':>9}")
    for line in report["speedups"]:
        lines.append(f"node at {line['clients']} clients: " + ", ".join(
            f"{line[f'x_{b}']:.2f}x {b}'s items/s, p99 {line[f'p99_vs_{b}']:.2f}x {b}'s"
            for b in ("plain", "cached") if f"x_{b}" in line))
    return "\n".join(lines)


def serve_baseline(argv: Sequence[str]) -> int:
    """Run one baseline server (``serve --method plain|cached``) until SIGTERM; returns its exit code."""
    parser = argparse.ArgumentParser(prog="bench score serve")
    parser.add_argument("--method", choices=("plain", "cached"), required=True)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--listen", default="127.0.0.1:0")
    parser.add_argument("--ready-file", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    from attnstore_node.app import create_app
    from attnstore_node.server import bind, serve

    scorer = PlainScorer(args.model, args.method == "cached", args.threads)
    return serve(create_app(scorer), bind(args.listen), ready_file=args.ready_file)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``score`` to the ``bench`` group."""
    parser = documented_parser(subparsers, "score", __doc__,
                               summary="/v1/score from concurrent clients: the node, a plain and a cached server")
    _add_arguments(parser)
    parser.set_defaults(func=run)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help="alias or local model path of a causal model")
    parser.add_argument("--methods", nargs="+", default=["node", "plain", "cached"],
                        choices=("node", "plain", "cached"), help="servers to run (default: all three)")
    parser.add_argument("--clients", nargs="+", type=int, default=[1, 8, 32],
                        help="concurrent clients, one run each (default: 1 8 32)")
    parser.add_argument("--requests", type=int, default=8,
                        help="score requests per run, at least one per client (default 8)")
    parser.add_argument("--items", type=int, default=4, help="questions per request (its items)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each server")
    parser.add_argument("--seed", type=int, default=0, help="seeds the requests")
    parser.add_argument("--audit-rate", type=audit_rate, default=DEFAULT_NODE_AUDIT_RATE,
                        help="the node's --audit-rate: the share of the rows a stored prefix would serve that it"
                        " computes whole instead, comparing the stored blocks with its forward's")
    parser.add_argument("--no-store-queries", dest="store_queries", action="store_false",
                        help="leave the node's store empty (by default the queries' 5-shot prompts are stored as "
                             "prefix blocks first, as attnstore build --prefix-blocks stores a corpus's)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--plot", type=Path, help="write a PNG of items/s and p99 latency against clients here")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark, print the table, write the JSON; returns the exit code."""
    report = bench(args)
    report["speedups"] = speedups(report)
    print(_table(report))
    if args.plot is not None:
        plot_by_clients(report, args.plot, "items/s",
                        f"bench score: MMLU 5-shot, {report['items']} items per request, {report['model']}, "
                        f"{report['threads']} torch threads per server")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1), encoding="utf-8")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """The benchmark (or, with ``serve``, one baseline server: how ``bench`` starts them); returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if argv[:1] == ["serve"]:
        return serve_baseline(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
