"""``attnstore encode``: sentence embeddings of a file's texts through the cache, saved as .npy.

Reads the texts (.txt one per line, .tsv with --column, .jsonl), encodes them
with ``AttnCache`` against a daemon (``grpc://HOST:PORT``, ``grpcs://HOST:PORT``,
or ``HOST:PORT``: TLS when --tls-ca is given) or an embedded store
(``local:PATH``), writes an ``(n, hidden)`` float32 array in input order, and
prints where each row's result came from and where the time went.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np

from attnstore.errors import ConfigError
from attnstore_tools.admin.command import TOKEN_ENV, read_token
from attnstore_tools.arguments import add_audit_rate, documented_parser, store_url
from attnstore_tools.corpus import read_texts
from attnstore_tools.output import write_json


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``encode`` subcommand."""
    parser = documented_parser(
        subparsers, "encode", __doc__,
        summary="encode a file's texts through the cache; write .npy and print the hit stats",
    )
    parser.add_argument("--model", required=True, help="model alias (minilm, smollm2) or a local model folder")
    parser.add_argument(
        "--store", required=True,
        help="grpc://HOST:PORT, grpcs://HOST:PORT, HOST:PORT (TLS with --tls-ca) or local:PATH",
    )
    parser.add_argument("--input", required=True, type=Path, help=".txt (one per line), .tsv or .jsonl")
    parser.add_argument("--column", help="text column of a .tsv input, or field of a .jsonl one")
    parser.add_argument("--output", required=True, type=Path, help="where to write the (n, hidden) float32 .npy")
    parser.add_argument("--namespace", default="default", help="namespace built for the model (default: default)")
    parser.add_argument(
        "--token-file", type=Path, help="file with a read token (one holding an admin token is refused)"
    )
    parser.add_argument("--token", help=f"bearer token (prefer --token-file or ${TOKEN_ENV}: argv is visible to ps)")
    parser.add_argument("--tls-ca", type=Path, help="CA certificate (PEM) of a grpcs:// daemon")
    parser.add_argument("--tls-cert", type=Path, help="this node's certificate (PEM), for a daemon requiring mTLS")
    parser.add_argument("--tls-key", type=Path, help="this node's private key (PEM), for mTLS")
    parser.add_argument("--batch-size", type=int, default=32, help="rows per forward (default: 32)")
    parser.add_argument("--max-distance", type=float, help="map-hit distance threshold, no gate"
                        " (default: the namespace's fidelity gate, else its calibrated threshold)")
    parser.add_argument("--timeout", type=float, default=30.0, help="deadline of one batch's lookup, s (default 30)")
    parser.add_argument("--normalize", action="store_true", help="scale embeddings to unit length")
    add_audit_rate(parser)
    parser.add_argument("--stats-json", type=Path, help="also write the stats here as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``attnstore encode``; returns the exit code."""
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {args.batch_size}")
    texts = read_texts(args.input, column=args.column)
    if not texts:
        raise ConfigError(f"{args.input} holds no texts")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from attnstore_client.cache import AttnCache

    options = {} if args.max_distance is None else {"max_distance": args.max_distance}
    store = store_url(args.store, tls=args.tls_ca is not None or args.tls_cert is not None)
    with AttnCache(args.model, store, namespace=args.namespace, token=read_token(args, client=True), tls_ca=args.tls_ca,
                   client_cert=args.tls_cert, client_key=args.tls_key, timeout=args.timeout,
                   audit_rate=args.audit_rate, **options) as cache:
        embeddings = cache.encode(texts, batch_size=args.batch_size, show_progress_bar=not args.no_progress,
                                  normalize_embeddings=args.normalize)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    np.save(args.output, embeddings)
    print(f"wrote {embeddings.shape[0]} x {embeddings.shape[1]} embeddings to {args.output}")
    print(cache.last_stats.summary())
    if args.stats_json:
        write_json(args.stats_json, cache.last_stats.to_json_dict())
    return 0
