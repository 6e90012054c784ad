"""``attnstore admin train-projector``: a namespace's projector, trained from the maps it stores.

The end of a cold start (see ``cold_start``): a namespace made by ``admin
create-namespace`` fills from traffic, and write-back stores the maps of admitted
rows; once enough are stored, this command gives it a projector, and map hits start:

1. lists the namespace's entries with maps (``ListEntries``) and reads their maps
   (``Fetch``) into a scratch folder;
2. runs the model on their token ids for the feature sources, and the outputs
   calibration compares replays with;
3. trains and calibrates the projector and fits the fidelity gate exactly as
   ``attnstore build`` does (``build.fit``);
4. installs it (``CreateNamespace`` with ``replace_projector``: the version goes
   up and every stored feature vector is dropped in the same write);
5. projects every entry with maps and sends the vectors (``SetFeatures``,
   stating the new version, so vectors of two projectors never meet in a
   lookup); entries that arrived meanwhile without one are listed and projected too.

Nothing on the daemon changes before step 4: too few entries, a failed training
or Ctrl-C leave the namespace as it was. Running it again trains a new projector
from every entry and replaces the old one the same way. Entries stored without
token ids cannot be projected: they are counted and stay in the exact tier.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from attnstore.errors import CorpusError, EntryNotFoundError, FingerprintMismatchError
from attnstore.protocol.messages import layout_from_pb
from attnstore.protocol.records import NamespaceLayout
from attnstore.protocol.v1 import attnstore_pb2 as pb
from attnstore.protocol.wire import FrameAssembler
from attnstore_client.adapters import Adapter, adapter_for
from attnstore_client.adapters.batch import batch_from_ids
from attnstore_client.connection.daemon import DaemonClient
from attnstore_client.connection.resend import guarded_stream
from attnstore_client.keys import model_fingerprint
from attnstore_client.models import LoadedModel, load_model
from attnstore_client.projector import Projector
from attnstore_tools.build.calibration import CalibrationConfig
from attnstore_tools.build.command import groups_of
from attnstore_tools.build.fit import FitConfig, FitReport, fit_projector
from attnstore_tools.build.namespace_layout import token_limits
from attnstore_tools.build.training import MIN_CORPUS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainProjectorConfig:
    """Settings of ``train_namespace_projector``."""

    # Training and calibration, as ``attnstore build`` does them (the projector's size comes from the namespace).
    fit: FitConfig = field(default_factory=FitConfig)
    batch_size: int = 32  # rows per model forward
    fetch_bytes: int = 64 << 20  # fp16 maps per Fetch call
    fetch_entries: int = 256  # entries per Fetch call (under the daemon's --max-queries)
    features_per_call: int = 1024  # vectors per SetFeatures call (under the daemon's --max-queries)
    progress: bool = True


@dataclass(frozen=True)
class TrainProjectorReport:
    """What a run did."""

    namespace: str
    entries: int  # entries with maps the projector was trained and calibrated on
    projector_version: int  # the version installed
    featured: int  # entries given a vector of the new projector
    missing: int  # entries gone (deleted, evicted) before they were read or featured
    without_tokens: int  # entries with maps but no token ids: not projected, exact tier only
    fit: FitReport
    seconds: float


@dataclass(frozen=True)
class _Row:
    entry_id: int
    ids: list[int]


def train_namespace_projector(
    remote: DaemonClient, loaded: LoadedModel, namespace: str, config: TrainProjectorConfig = TrainProjectorConfig()
) -> TrainProjectorReport:
    """Train, calibrate and install ``namespace``'s projector from its stored maps; feature every entry.

    Args:
        remote: a daemon connection with an admin token.
        loaded: the namespace's model.
        namespace: the namespace.
        config: settings.

    Raises:
        CorpusError: fewer than ``MIN_CORPUS`` entries with maps and token ids, or too few of one
            length to train on (nothing is changed).
        FingerprintMismatchError: ``loaded`` is not the namespace's model (nothing is changed).
        NamespaceNotFoundError: no such namespace.
        AuthError: the token is not an admin token.
    """
    started = time.perf_counter()
    info = remote.get_namespace(namespace)
    fingerprint = model_fingerprint(loaded.model, loaded.tokenizer)
    if fingerprint != info.fingerprint:
        raise FingerprintMismatchError(
            f"namespace {namespace!r} belongs to model {info.model!r} (fingerprint {info.fingerprint[:16]}...);"
            f" {loaded.name!r} has fingerprint {fingerprint[:16]}...: train with the namespace's model"
        )
    layout = layout_from_pb(info.layout)
    listed = list(remote.iter_entries(namespace, maps_only=True))
    rows = [_Row(int(e.entry_id), list(e.token_ids)) for e in listed if len(e.token_ids) == e.length]
    if len(rows) < MIN_CORPUS:
        raise CorpusError(
            f"namespace {namespace!r} has {len(rows)} entries with maps and token ids ({len(listed)} with maps);"
            f" training a projector needs at least {MIN_CORPUS}: let write-back store more rows and run again"
        )
    adapter = adapter_for(loaded)
    fit_config = replace(config.fit, train=replace(config.fit.train, dim=layout.feature_dim),
                         progress=config.progress and config.fit.progress)
    with tempfile.TemporaryDirectory(prefix="attnstore-train-projector-") as scratch:
        read, maps, gone = _read_maps(remote, namespace, fingerprint, layout, rows, Path(scratch), config)
        sources, outputs = _run_model(adapter, read, Path(scratch), config)
        try:
            projector, fit = fit_projector(adapter, [r.ids for r in read], sources, maps, outputs, fit_config)
        except CorpusError as exc:
            raise CorpusError(f"cannot train a projector on the entries of namespace {namespace!r}: {exc}") from None
    installed = remote.create_namespace(
        namespace, model=info.model, fingerprint=info.fingerprint, layout=layout,
        projector=_with_embedding_layer(projector, adapter), replace_projector=True, limits=token_limits(loaded),
    )
    version = int(installed.projector_version)
    featured, missing = _send_features(remote, namespace, version, read, projector.project(sources), config)
    # Entries stored while this ran came with no vector (or one the replacement dropped).
    later = [e for e in remote.iter_entries(namespace, maps_only=True) if not e.has_feature]
    late_rows = [_Row(int(e.entry_id), list(e.token_ids)) for e in later if len(e.token_ids) == e.length]
    if late_rows:
        late_sources, _ = _run_model(adapter, late_rows, None, config)
        more, gone_late = _send_features(remote, namespace, version, late_rows, projector.project(late_sources), config)
        featured += more
        missing += gone_late
    return TrainProjectorReport(
        namespace=namespace,
        entries=len(read),
        projector_version=version,
        featured=featured,
        missing=gone + missing,
        without_tokens=len(later) - len(late_rows),
        fit=fit,
        seconds=time.perf_counter() - started,
    )


def _read_maps(
    remote: DaemonClient, namespace: str, fingerprint: str, layout: NamespaceLayout, rows: list[_Row], scratch: Path,
    config: TrainProjectorConfig,
) -> tuple[list[_Row], list[Path], int]:
    """Fetch the rows' maps into ``scratch``: the rows still there, their maps' files, and how many are gone."""
    read: list[_Row] = []
    paths: list[Path] = []
    bar = tqdm(total=len(rows), desc="read maps", unit="entry", disable=not config.progress)
    for group in groups_of(rows, config.fetch_entries, config.fetch_bytes, lambda r: layout.map_nbytes(len(r.ids))):
        for row, maps in _fetch(remote, namespace, fingerprint, group):
            path = scratch / f"{row.entry_id}.maps.npy"
            np.save(path, maps)
            read.append(row)
            paths.append(path)
        bar.update(len(group))
    bar.close()
    return read, paths, len(rows) - len(read)


def _fetch(
    remote: DaemonClient, namespace: str, fingerprint: str, group: list[_Row]
) -> Iterator[tuple[_Row, np.ndarray]]:
    """Each row's ``(layers, heads, L, L)`` maps; rows whose entry went away since the listing are skipped."""
    try:
        yield from zip(group, fetch_maps(remote, namespace, fingerprint, [r.entry_id for r in group]), strict=True)
    except EntryNotFoundError:
        # A Fetch naming a gone id sends nothing: read the group one by one to keep the others.
        for row in group:
            try:
                (maps,) = fetch_maps(remote, namespace, fingerprint, [row.entry_id])
            except EntryNotFoundError:
                continue
            yield row, maps


def fetch_maps(
    remote: DaemonClient, namespace: str, fingerprint: str, entry_ids: Sequence[int], *, length: int = 0,
    timeout: float | None = None,
) -> list[np.ndarray]:
    """Maps ``(layers, heads, L, L)`` of each id, cropped to ``length`` (0 = stored length), by the Fetch RPC.

    Fetch serves the admin tools, this command first: one unknown id fails the whole call (a node's map tier
    asks FetchMaps, whose rows fail alone), so it is read here, beside its caller, not on ``DaemonClient``.
    A stream broken by a daemon going away is sent again, whole (``DaemonClient.read_stream``).

    Raises:
        EntryNotFoundError: an id is not stored (nothing is returned).
        FingerprintMismatchError, NamespaceNotFoundError: as every read.
    """
    request = pb.FetchRequest(namespace=namespace, fingerprint=fingerprint, entry_ids=list(entry_ids), length=length)

    def read(left: float | None) -> list[np.ndarray]:
        assembler = FrameAssembler(max_array_bytes=1 << 40)
        layers: dict[int, dict[int, np.ndarray]] = {}
        for frame in guarded_stream(remote.stub.Fetch(request, metadata=remote.metadata, timeout=left), left):
            done = assembler.add(frame)
            if done is not None:
                (index, layer), array = done
                layers.setdefault(index, {})[int(layer)] = array
        return [np.stack([layers[i][j] for j in sorted(layers[i])]) for i in range(len(entry_ids))]

    return remote.read_stream(read, timeout)


def _run_model(
    adapter: Adapter, rows: list[_Row], scratch: Path | None, config: TrainProjectorConfig
) -> tuple[list[torch.Tensor], list[Path]]:
    """Each row's feature source, and (with ``scratch``) its last hidden states saved there as fp16."""
    pad = adapter.loaded.tokenizer.pad_token_id
    sources: list[torch.Tensor | None] = [None] * len(rows)
    outputs: list[Path] = [Path()] * len(rows)
    order = sorted(range(len(rows)), key=lambda i: len(rows[i].ids))  # batches pad little
    bar = tqdm(total=len(rows), desc="features", unit="entry", disable=not config.progress)
    for start in range(0, len(order), config.batch_size):
        batch_rows = order[start : start + config.batch_size]
        batch = batch_from_ids([rows[i].ids for i in batch_rows], pad)
        for i, source in zip(batch_rows, adapter.feature_source(batch), strict=True):
            sources[i] = source
        if scratch is not None:
            hidden = adapter.forward(batch)  # (B, P, hidden)
            for row, i in enumerate(batch_rows):
                outputs[i] = scratch / f"{rows[i].entry_id}.out.npy"
                np.save(outputs[i], hidden[row, : batch.lengths[row]].to(torch.float16).numpy())
        bar.update(len(batch_rows))
    bar.close()
    return [s for s in sources if s is not None], outputs


def _send_features(
    remote: DaemonClient, namespace: str, version: int, rows: Sequence[_Row], vectors: np.ndarray,
    config: TrainProjectorConfig,
) -> tuple[int, int]:
    """Send each row's vector of projector ``version``; returns how many were set and how many entries are gone."""
    updated = gone = 0
    bar = tqdm(total=len(rows), desc="set features", unit="entry", disable=not config.progress)
    for start in range(0, len(rows), config.features_per_call):
        part = rows[start : start + config.features_per_call]
        reply = remote.set_features(namespace, version, [r.entry_id for r in part],
                                    vectors[start : start + len(part)])
        updated += reply.updated
        gone += len(reply.missing)
        bar.update(len(part))
    bar.close()
    return updated, gone




def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``admin train-projector``."""
    parser.add_argument("--model", required=True, help="the namespace's model: alias (minilm, smollm2) or local path")
    parser.add_argument("--namespace", required=True, help="namespace whose stored maps train its projector")
    parser.add_argument("--train-limit", type=int, default=8000, help="entries the projector trains on (a sample)")
    parser.add_argument("--seed", type=int, default=0, help="seed of sampling and training")
    parser.add_argument("--batch-size", type=int, default=32, help="rows per model forward")
    parser.add_argument("--no-calibration", action="store_true",
                        help="skip calibrating the projector's distances and fitting the fidelity gate")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace, remote: DaemonClient) -> TrainProjectorReport:
    """Train and install the projector of the namespace ``args`` name."""
    if args.train_limit < 1 or args.batch_size < 1:
        raise CorpusError(f"--train-limit and --batch-size must be >= 1, got {args.train_limit}, {args.batch_size}")
    fit = FitConfig(train_limit=args.train_limit, seed=args.seed,
                    calibration=None if args.no_calibration else CalibrationConfig())
    config = TrainProjectorConfig(fit=fit, batch_size=args.batch_size, progress=not args.no_progress)
    return train_namespace_projector(remote, load_model(args.model), args.namespace, config)


# The blob travels in one CreateNamespace message: the daemon's default cap, less room for the rest of it.
_MAX_SENT_BLOB_BYTES = (8 << 20) - (256 << 10)


def _with_embedding_layer(projector: Projector, adapter: Adapter) -> bytes:
    """The projector's blob with the model's embedding layer (the daemon derives written-back rows' features
    from it), where it fits one message; else without it, and written-back rows wait for this command again.

    MiniLM's layer is ~47 MB: over a daemon's default message cap, so such a namespace gets its layer from
    ``attnstore build`` (which writes the store directly) for now.
    """
    blob = projector.to_safetensors_bytes()
    with_layer = adapter.embedding_layer().attach_to(blob)
    if len(with_layer) <= _MAX_SENT_BLOB_BYTES:
        return with_layer
    log.warning("the embedding layer (%d bytes) does not fit one message: the projector is installed without it,"
                " so written-back rows are stored without features until train-projector features them",
                len(with_layer) - len(blob))
    return blob
