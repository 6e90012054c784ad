"""``attnstore node``: an inference node serving embeddings (and, on a decoder, scores and classifications) over
HTTP, OpenAI-compatible, over ``AttnCache``.

    attnstore node --model minilm --store grpc://store-host:50051 --namespace minilm --listen 0.0.0.0:8080

Routes: ``POST /v1/embeddings`` (OpenAI's schema: the ``openai`` package works
against ``http://HOST:PORT/v1``), ``POST /embed`` (text-embeddings-inference's),
on a causal model ``POST /v1/score`` (SGLang's schema) and ``POST /v1/classify``
(vLLM's), ``GET /v1/models``, ``GET /health`` (200 once the model is loaded), ``GET /metrics``
(Prometheus). Concurrent requests are merged into one call through the cache's
tiers and run as packed forwards of at most --max-batch-tokens tokens (default:
chosen from the cost model's forward fit, timed at start). With --api-key-file
every request needs ``Authorization: Bearer KEY``; SIGHUP reloads the
file. SIGTERM drains: requests in flight are answered, then the node exits 0.
"""

from __future__ import annotations

import argparse
import logging
import os
from functools import partial
from pathlib import Path
from typing import Any

from attnstore.errors import ConfigError
from attnstore_node.schema import RequestLimits
from attnstore_node.settings import BatcherSettings
from attnstore_tools.admin.command import TOKEN_ENV, read_token
from attnstore_tools.arguments import DefaultsHelpFormatter, add_audit_rate, positive_int, store_url
from attnstore_tools.serve import parse_size

# CacheSettings.engine's values (tiers.engines.graphs.ENGINE_NAMES, which imports torch: the CLI starts without it).
ENGINES = ("torch", "auto", "openvino", "onnxruntime")

log = logging.getLogger(__name__)

DEFAULT_LISTEN = "127.0.0.1:8080"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``node`` subcommand."""
    batching, limits = BatcherSettings(), RequestLimits()
    p = subparsers.add_parser("node", help="serve embeddings over HTTP (OpenAI /v1/embeddings, TEI /embed)",
                              description=__doc__, formatter_class=DefaultsHelpFormatter)
    p.add_argument("--model", required=True, help="model alias (minilm, smollm2) or a local model folder")
    p.add_argument("--store", required=True,
                   help="grpc://HOST:PORT, grpcs://HOST:PORT, HOST:PORT (TLS with --tls-ca) or local:PATH")
    p.add_argument("--namespace", default="default", help="namespace built for the model")
    p.add_argument("--listen", default=DEFAULT_LISTEN, help="HOST:PORT to serve HTTP on; port 0 picks a free port")
    p.add_argument("--served-model-name", help="the 'model' requests name (default: --model)")
    p.add_argument("--token-file", type=Path, help="file with the store's read (or write) token")
    p.add_argument("--token", help=f"store bearer token (prefer --token-file or ${TOKEN_ENV}: argv is visible to ps)")
    p.add_argument("--tls-ca", type=Path, help="CA certificate (PEM) of a grpcs:// daemon")
    p.add_argument("--tls-cert", type=Path, help="this node's certificate (PEM), for a daemon requiring mTLS")
    p.add_argument("--tls-key", type=Path, help="this node's private key (PEM), for mTLS")
    p.add_argument("--timeout", type=float, default=30.0, help="deadline of one store call, s")
    p.add_argument("--write-back", action="store_true",
                   help="send computed rows the daemon admits to its exact tier, and (decoders) the prefixes "
                        "rows of a call shared, as prefix blocks (needs a write token)")
    p.add_argument("--chunks", action="store_true",
                   help="(decoders) run the chunk tier: score and classify requests may give their prompt in"
                   " 'segments', fused from the namespace's stored chunks (and, with --write-back, the chunks"
                   " computed are stored); approximates the full forward, see docs/guides/decoders.md")
    p.add_argument("--chunk-dtype", choices=("float16", "float32"), default="float16",
                   help="with --chunks: the dtype the namespace's chunks were built in (attnstore build"
                   " --chunk-dtype); another one is refused on every call that fuses chunks")
    p.add_argument("--exact-cache-bytes", type=parse_size,
                   help="this node's own exact tier (0 turns it off; default: AttnCache's, 256MiB)")
    p.add_argument("--memory-budget", type=parse_size,
                   help="bytes the node's cache keeps beyond its model: the store's indexes (local:), the forwards in"
                   " flight and its exact tier (AttnCache's memory_budget; default: none but each part's own; see"
                   " docs/guides/http-node.md, Memory)")
    p.add_argument("--max-distance", type=float, help="map-hit distance threshold, no gate"
                   " (default: the namespace's fidelity gate, else its calibrated threshold)")
    p.add_argument("--device", help="cpu, cuda, cuda:1... (default: the CPU)")
    p.add_argument("--threads", type=positive_int, help="torch threads (default: torch's)")
    p.add_argument("--max-batch-tokens", type=positive_int,
                   help="tokens per packed forward (default: from the cost model's fit, see docs/guides/http-node.md)")
    p.add_argument("--max-wait-ms", type=float, default=batching.max_wait_ms,
                   help="longest a request waits for others to join its batch")
    p.add_argument("--batch-size", type=positive_int, default=batching.batch_size, help="rows per forward at most")
    p.add_argument("--max-call-rows", type=positive_int, default=batching.max_call_rows,
                   help="rows of the requests merged into one call at most")
    p.add_argument("--max-queued-rows", type=positive_int, default=batching.max_queued_rows,
                   help="rows waiting for a call at most; past it a request gets 429 (its client retries), so a"
                   " burst's memory is bounded (see docs/guides/http-node.md, Memory)")
    p.add_argument("--padded", action="store_true",
                   help="pad length-sorted batches (cut where the cost model's fit predicts the least time) instead of"
                   " packing rows end to end: for devices where many small attention calls cost more than padding")
    p.add_argument("--int8", action="store_true",
                   help="compute rows no tier served on the namespace's int8 plan (built with --int8): faster,"
                        " approximate (AttnCache(int8=True))")
    p.add_argument("--engine", choices=ENGINES, default="torch",
                   help="where computed rows run: the model's torch forward, the fastest per length band of it and"
                        " its OpenVINO and ONNX Runtime graphs (auto; exported once, timed on the first call), or one"
                        " graph (AttnCache(engine=...))")
    add_audit_rate(p)
    p.add_argument("--no-warmup", action="store_true", help="serve at once, without timing forwards first")
    p.add_argument("--api-key-file", type=Path,
                   help="'key' or 'label key' lines; requests need 'Authorization: Bearer KEY' (default: no keys)")
    p.add_argument("--max-inputs", type=positive_int, default=limits.max_inputs, help="inputs per request")
    p.add_argument("--max-input-tokens", type=positive_int, default=limits.max_input_tokens,
                   help="tokens per input (the model's own limit applies first)")
    p.add_argument("--max-body-bytes", type=parse_size, default=limits.max_body_bytes, help="bytes per request body")
    p.add_argument("--read-timeout", type=float, default=limits.read_timeout,
                   help="seconds a client has to send a request's line and headers, then as many for its body; past"
                   " them the node answers 408 and closes the connection (a connection that sends nothing is closed)")
    p.add_argument("--max-labels", type=positive_int, default=limits.max_labels,
                   help="labels per scoring request (/v1/score's label_token_ids, /v1/classify's labels and --labels)")
    p.add_argument("--max-scores", type=positive_int, default=limits.max_scores,
                   help="items x labels per scoring request: the numbers in one answer")
    p.add_argument("--labels", nargs="+", default=None,
                   help="/v1/classify's labels when a request names none (words of one token each; at most"
                        " --max-labels)")
    p.add_argument("--grace", type=int, default=30, help="seconds requests in flight get to finish on SIGTERM")
    p.add_argument("--ready-file", type=Path, help="write {pid, address, port} as JSON here once the model is loaded")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the node until SIGTERM/SIGINT; returns its exit code."""
    if getattr(args, "log_level", "WARNING") == "WARNING":
        logging.getLogger().setLevel(logging.INFO)  # a server's lifecycle events are INFO
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.timeout <= 0 or args.read_timeout <= 0 or args.max_wait_ms < 0 or args.grace < 0:
        raise ConfigError("--timeout and --read-timeout must be > 0, --max-wait-ms and --grace >= 0")
    import torch

    from attnstore_client.cache import AttnCache
    from attnstore_client.call.settings import ChunkSettings
    from attnstore_node.app import create_app
    from attnstore_node.auth import KeyCheck
    from attnstore_node.batcher import Batcher
    from attnstore_node.metrics import NodeMetrics
    from attnstore_node.server import bind, serve

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    keys = KeyCheck(args.api_key_file)
    if keys.keys is None:
        log.warning("event=no_api_keys detail='every client may call this node; give --api-key-file to require keys'")
    limits = RequestLimits(args.max_inputs, args.max_input_tokens, args.max_body_bytes, args.read_timeout,
                           max_labels=args.max_labels, max_scores=args.max_scores)
    if args.labels is not None and len(args.labels) > limits.max_labels:
        raise ConfigError(f"--labels gives {len(args.labels)} words; the limit is --max-labels {limits.max_labels}")
    settings = BatcherSettings(max_batch_tokens=args.max_batch_tokens, max_wait_ms=args.max_wait_ms,
                               batch_size=args.batch_size, max_call_rows=args.max_call_rows,
                               max_queued_rows=args.max_queued_rows,
                               warmup=not args.no_warmup)
    options: dict[str, Any] = {} if args.max_distance is None else {"max_distance": args.max_distance}
    if args.exact_cache_bytes is not None:
        options["exact_cache_bytes"] = args.exact_cache_bytes
    if args.memory_budget is not None:
        options["memory_budget"] = args.memory_budget
    if args.chunks:
        # The defaults `attnstore eval icl` chose (full_reuse, recent=1), in the namespace's dtype.
        options["chunks"] = ChunkSettings(dtype=args.chunk_dtype)
    open_cache = partial(
        AttnCache, args.model, store_url(args.store, tls=args.tls_ca is not None or args.tls_cert is not None),
        namespace=args.namespace, token=read_token(args, client=True), tls_ca=args.tls_ca,
        client_cert=args.tls_cert, client_key=args.tls_key, timeout=args.timeout, write_back=args.write_back,
        device=args.device, packed=not args.padded, int8=args.int8, audit_rate=args.audit_rate,
        engine=args.engine, **options,
    )
    metrics = NodeMetrics()
    batcher = Batcher(open_cache, args.served_model_name or args.model, settings, metrics)
    sock = bind(args.listen)
    app = create_app(batcher, keys=keys, limits=limits, metrics=metrics,
                     labels=None if args.labels is None else tuple(args.labels))
    return serve(app, sock, ready_file=args.ready_file, grace=args.grace)
