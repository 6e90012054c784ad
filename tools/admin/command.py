"""``attnstore admin``: commands against a running daemon.

``namespaces``, ``stats`` (a read token suffices), ``verify``, ``compact``,
``delete``, ``ingest``, ``create-namespace`` (admin token; an exact-tier-only
namespace for a model, filled by write-back: ``cold_start`` beside this module),
``drop-writer`` (admin token; every entry one token wrote back: ``drop_writer``),
``quarantine list|release|drop`` (admin token; what nodes' audits found wrong: ``quarantine``)
and ``train-projector`` (admin token; its projector, trained from the maps it
stores: ``train_projector``). ``ingest`` copies one namespace of a
local map store (built offline by ``attnstore build``) into the daemon, in
streams of ``--batch-entries`` entries, each committed on its own. Every command
prints a table; ``--json PATH`` also writes the answer as JSON (``-``: the JSON
alone on stdout, the table on stderr). ``--target`` takes grpc://HOST:PORT,
grpcs://HOST:PORT (TLS) or HOST:PORT (TLS when --tls-ca is given). The token
comes from ``--token``, ``--token-file`` or ``$ATTNSTORE_TOKEN``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from google.protobuf.json_format import MessageToDict

from attnstore.errors import ConfigError, MapsNotStoredError
from attnstore.protocol.records import NamespaceLayout, NewEntry
from attnstore_client.connection.channel import DEFAULT_TARGET, TARGET_FORMS
from attnstore_client.connection.daemon import DaemonClient
from attnstore_tools.admin import cold_start, drop_writer, quarantine, train_projector
from attnstore_tools.arguments import DefaultsHelpFormatter
from attnstore_tools.build.fit import format_fit

TOKEN_ENV = "ATTNSTORE_TOKEN"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``admin`` and its subcommands."""
    admin = subparsers.add_parser("admin", help="commands against a running daemon", description=__doc__)
    sub = admin.add_subparsers(dest="admin_command", metavar="COMMAND", required=True)

    def add(name: str, help_text: str, func: Any) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, formatter_class=DefaultsHelpFormatter)
        p.add_argument("--target", default=DEFAULT_TARGET, help=f"the daemon: {TARGET_FORMS}")
        p.add_argument("--token", help=f"bearer token (prefer --token-file or ${TOKEN_ENV}: argv is visible to ps)")
        p.add_argument("--token-file", type=Path, help="file with the token, or the daemon's 'role token' file")
        p.add_argument("--tls-ca", type=Path, help="CA certificate of the daemon (PEM); enables TLS")
        p.add_argument("--tls-cert", type=Path, help="client certificate (mTLS)")
        p.add_argument("--tls-key", type=Path, help="client key (mTLS)")
        p.add_argument("--timeout", type=float, default=600.0, help="deadline of each call, seconds")
        p.add_argument(
            "--json", dest="json_path",
            help="also write the answer as JSON to this path ('-': stdout, the table to stderr)",
        )
        p.set_defaults(func=_json_alone_on_stdout(func))
        return p

    add("namespaces", "list namespaces", _namespaces)
    add("stats", "entries, bytes per length bucket, DRAM cache", _stats)
    add("verify", "check every stored chunk and the database structure (exit 1 on any damage)", _verify)
    add("compact", "rewrite the store densely and rebuild the indexes", _compact)
    delete = add("delete", "delete entries by id", _delete)
    delete.add_argument("--namespace", required=True)
    delete.add_argument("ids", type=int, nargs="+", help="entry ids")
    create = add("create-namespace", "an empty exact-tier-only namespace for a model (fills by write-back)",
                 _create_namespace)
    cold_start.add_arguments(create)
    train = add("train-projector", "train, calibrate and install a namespace's projector from its stored maps,"
                " then give every entry with maps its feature vector (map hits start)", _train_projector)
    train_projector.add_arguments(train)
    drop = add("drop-writer", "delete every row, prefix block and chunk one token wrote (revoke the token first)",
               _drop_writer)
    drop_writer.add_arguments(drop)
    held = add("quarantine", "list, release or drop the objects nodes' audits found wrong (admin token)", _quarantine)
    quarantine.add_arguments(held)
    ingest = add("ingest", "copy a namespace of a local store into the daemon", _ingest)
    ingest.add_argument("--from-store", type=Path, required=True, help="local map store directory")
    ingest.add_argument("--namespace", required=True, help="namespace to copy")
    ingest.add_argument("--as", dest="target_namespace", help="name on the daemon (default: the same)")
    ingest.add_argument("--batch-entries", type=int, default=64, help="entries per Ingest stream (one commit each)")
    ingest.add_argument(
        "--replace-projector", action="store_true",
        help="replace the daemon namespace's different projector with this store's: its stored feature vectors are"
        " dropped (exact hits go on; map hits return as entries are ingested again) and clients follow the new one",
    )


def _json_alone_on_stdout(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``func`` with its tables sent to stderr when ``--json -`` claims stdout, so stdout parses as JSON."""

    def run(args: argparse.Namespace) -> int:
        if args.json_path != "-":
            return func(args)
        args.json_stream = sys.stdout
        with contextlib.redirect_stdout(sys.stderr):
            return func(args)

    return run


def read_token(args: argparse.Namespace, *, client: bool = False) -> str | None:
    """The token from --token, --token-file or the environment.

    Args:
        args: parsed arguments with ``token`` and ``token_file``.
        client: an inference client's token: a token file holding an admin token
            is refused (a node needs a read token, and the admin token should not
            sit on it). Otherwise an admin line is preferred.

    Raises:
        ConfigError: the token file cannot be read, holds no token, or (``client``) holds an admin token.
    """
    if args.token:
        return args.token
    if args.token_file is None:
        return os.environ.get(TOKEN_ENV) or None
    try:
        lines = args.token_file.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read token file {args.token_file}: {exc.strerror or exc}") from None
    tokens: list[tuple[str, str]] = []
    for line in lines:
        fields = line.split("#", 1)[0].split()
        if len(fields) == 1:
            tokens.append(("", fields[0]))
        elif len(fields) >= 2:  # "role token [name=...] [namespaces=...]", as the daemon's token file
            tokens.append((fields[0], fields[1]))
    if not tokens:
        raise ConfigError(f"token file {args.token_file} holds no token")
    if client and any(role == "admin" for role, _ in tokens):
        raise ConfigError(
            f"token file {args.token_file} holds an admin token: a client needs only a read token; give it a file"
            " with the read token alone (not the daemon's token file)"
        )
    return next((t for role, t in tokens if role == "admin"), tokens[0][1])


def _connect(args: argparse.Namespace) -> DaemonClient:
    return DaemonClient(
        args.target,
        token=read_token(args),
        timeout=args.timeout,
        tls_ca=args.tls_ca,
        client_cert=args.tls_cert,
        client_key=args.tls_key,
    )


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        print("  ".join(c.rjust(w) if n and c[:1].isdigit() else c.ljust(w) for c, w in zip(row, widths, strict=True)))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def _write_json(args: argparse.Namespace, data: Any) -> None:
    if not args.json_path:
        return
    text = json.dumps(data, indent=2, sort_keys=True)
    if args.json_path == "-":
        print(text, file=args.json_stream)
    else:
        Path(args.json_path).write_text(text + "\n", encoding="utf-8")


def _as_dict(message: Any) -> dict[str, Any]:
    return MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def _namespaces(args: argparse.Namespace) -> int:
    with _connect(args) as remote:
        namespaces = remote.list_namespaces()
    rows = [
        (
            n.name, n.model, n.fingerprint[:12], n.layout.layers, n.layout.heads,
            "causal" if n.layout.causal else "bidir", n.layout.hidden, n.layout.feature_dim, n.layout.codec,
            time.strftime("%Y-%m-%d %H:%M", time.localtime(n.created)),
        )
        for n in namespaces
    ]
    _table(["namespace", "model", "fingerprint", "layers", "heads", "mask", "hidden", "dim", "codec", "created"], rows)
    _write_json(args, [_as_dict(n) for n in namespaces])
    return 0


def _stats(args: argparse.Namespace) -> int:
    with _connect(args) as remote:
        stats = remote.stats()
    rows = [
        (b.namespace, b.length, b.codec, b.entries, b.stored_bytes, b.raw_bytes,
         f"{b.stored_bytes / b.raw_bytes:.3f}" if b.raw_bytes else "-")
        for b in stats.buckets
    ]
    _table(["namespace", "length", "codec", "entries", "stored_bytes", "raw_bytes", "ratio"], rows)
    print()
    if stats.scoped:
        # The daemon counts a scoped token's namespaces only and shows it no store-wide counter.
        _table(["entries", "stored_bytes", "raw_bytes"], [(stats.entries, stats.stored_bytes, stats.raw_bytes)])
        print("(this token is scoped to namespaces: the store-wide counters are not shown to it)")
        _write_json(args, _as_dict(stats))
        return 0
    _table(
        ["entries", "stored_bytes", "file_bytes", "max_bytes", "store_evictions", "dram_bytes", "dram_capacity",
         "dram_entries", "dram_hits", "dram_misses", "dram_evictions"],
        [(stats.entries, stats.stored_bytes, stats.file_bytes, stats.max_bytes or "-", stats.store_evictions,
          stats.dram_bytes, stats.dram_capacity_bytes, stats.dram_entries, stats.dram_hits, stats.dram_misses,
          stats.dram_evictions)],
    )
    _write_json(args, _as_dict(stats))
    return 0


def _verify(args: argparse.Namespace) -> int:
    with _connect(args) as remote:
        report = remote.verify(timeout=args.timeout)
    _table(
        # the reply's chunks_checked and orphan_chunks count stored objects (the wire's names, and the JSON's)
        ["entries_checked", "objects_checked", "corrupt", "orphan_objects", "seconds"],
        [(report.entries_checked, report.chunks_checked, len(report.corrupt), report.orphan_chunks,
          f"{report.seconds:.2f}")],
    )
    if report.corrupt:
        print()
        _table(["namespace", "entry", "reason"], [(c.namespace, c.entry_id, c.reason) for c in report.corrupt])
    if report.store_problems:
        print()
        _table(["store problem"], [(problem,) for problem in report.store_problems])
    _write_json(args, _as_dict(report))
    return 1 if report.corrupt or report.store_problems else 0


def _compact(args: argparse.Namespace) -> int:
    with _connect(args) as remote:
        report = remote.compact(timeout=args.timeout)
    _table(
        ["entries", "bytes_before", "bytes_after", "seconds"],
        [(report.entries, report.bytes_before, report.bytes_after, f"{report.seconds:.2f}")],
    )
    _write_json(args, _as_dict(report))
    return 0


def _delete(args: argparse.Namespace) -> int:
    with _connect(args) as remote:
        deleted = remote.delete(args.namespace, args.ids)
    _table(["namespace", "requested", "deleted"], [(args.namespace, len(args.ids), deleted)])
    _write_json(args, {"namespace": args.namespace, "requested": len(args.ids), "deleted": deleted})
    return 0


def _create_namespace(args: argparse.Namespace) -> int:
    with _connect(args) as remote:
        info = cold_start.run(args, remote)
    _table(["namespace", "model", "fingerprint", "projector"], [(info.name, info.model, info.fingerprint[:12], "none")])
    _write_json(args, _as_dict(info) | {"projector": ""})
    return 0


def _drop_writer(args: argparse.Namespace) -> int:
    with _connect(args) as remote:
        report = drop_writer.run(args, remote)
    _table(["namespace", "writer", "found", "deleted", "prefix_blocks", "chunks"],
           [(report.namespace, report.writer, report.found, report.deleted, report.prefix_blocks, report.chunks)])
    _write_json(args, {"namespace": report.namespace, "writer": report.writer, "found": report.found,
                       "deleted": report.deleted, "prefix_blocks": report.prefix_blocks, "chunks": report.chunks,
                       "dry_run": args.dry_run})
    return 0


def _quarantine(args: argparse.Namespace) -> int:
    with _connect(args) as remote:
        rows = quarantine.run(args, remote)
    _table(["namespace", "kind", "key", "writer", "entry", "reporter", "since", "detail"],
           [(r.namespace, r.kind, r.key, r.writer or "(admin)", "" if r.entry_id is None else r.entry_id, r.reporter,
             r.since, r.detail) for r in rows])
    _write_json(args, {"action": args.action, "objects": [dataclasses.asdict(r) for r in rows]})
    return 0


def _train_projector(args: argparse.Namespace) -> int:
    with _connect(args) as remote:
        report = train_projector.run(args, remote)
    _table(
        ["namespace", "entries", "projector_version", "featured", "missing", "without_tokens", "seconds"],
        [(report.namespace, report.entries, report.projector_version, report.featured, report.missing,
          report.without_tokens, f"{report.seconds:.2f}")],
    )
    for line in format_fit(report.fit.train, report.fit.calibration):
        print(line)
    _write_json(args, {
        "namespace": report.namespace, "entries": report.entries, "projector_version": report.projector_version,
        "featured": report.featured, "missing": report.missing, "without_tokens": report.without_tokens,
        "seconds": report.seconds,
    })
    return 0


def _local_entries(store: Any, namespace: str) -> Iterator[NewEntry]:
    for info in store.entries(namespace):
        try:
            maps = store.read_maps(namespace, info.id)  # (layers, heads, L, L) fp16
        except MapsNotStoredError:
            continue  # an outputs-only (written-back) entry: an Ingest stream carries maps; traffic refills it
        yield NewEntry(
            maps=maps,
            token_hash=info.token_hash,
            outputs=store.read_outputs(namespace, info.id),
            feature=info.feature,
            token_ids=info.token_ids,
        )


def _batches(entries: Iterator[NewEntry], size: int) -> Iterator[list[NewEntry]]:
    batch: list[NewEntry] = []
    for entry in entries:
        batch.append(entry)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _ingest(args: argparse.Namespace) -> int:
    from attnstore.store.opening import open_store  # only this command reads a local store

    if args.batch_entries < 1:
        raise ConfigError(f"--batch-entries must be >= 1, got {args.batch_entries}")
    name = args.target_namespace or args.namespace
    start = time.perf_counter()
    totals = {"entries": 0, "duplicates": 0, "bytes": 0, "streams": 0}
    with open_store(args.from_store, readonly=True, dram_bytes=0).store as store, _connect(args) as remote:
        info = store.get_namespace(args.namespace)
        layout: NamespaceLayout = info.layout
        target = remote.create_namespace(
            name, model=info.model, fingerprint=info.fingerprint, layout=layout, projector=info.projector,
            replace_projector=args.replace_projector,
        )
        # Stated on every stream: a projector replaced meanwhile fails the copy instead of mixing features.
        version = target.projector_version if info.projector is not None else 0
        for batch in _batches(_local_entries(store, args.namespace), args.batch_entries):
            summary = remote.ingest(name, info.fingerprint, batch, timeout=args.timeout, projector_version=version)
            totals["entries"] += summary.entries
            totals["duplicates"] += summary.duplicates
            totals["bytes"] += summary.bytes
            totals["streams"] += 1
            print(f"ingested {totals['entries']} entries", file=sys.stderr)
    seconds = time.perf_counter() - start
    _table(
        ["namespace", "entries", "duplicates", "bytes", "streams", "seconds"],
        [(name, totals["entries"], totals["duplicates"], totals["bytes"], totals["streams"], f"{seconds:.2f}")],
    )
    _write_json(args, {"namespace": name, **totals, "seconds": seconds})
    return 0
