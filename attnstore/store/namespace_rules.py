"""Rules about namespaces every backend applies alike: projector versions and replacement, creating again, the
layout of chunks and prefix blocks set once.

Each backend decides inside its own write (a transaction, a Lua script) with these,
so the backends cannot drift apart on what a projector replacement or a second
``create_namespace`` does.
"""

from __future__ import annotations

import dataclasses

import crc32c

from attnstore.errors import (
    FingerprintMismatchError,
    MapShapeError,
    NamespaceExistsError,
    ProjectorChangedError,
    shown,
)
from attnstore.projector.blob import same_weights
from attnstore.protocol.records import NamespaceInfo


def check_projector_version(info: NamespaceInfo, version: int | None) -> None:
    """Refuse a request whose features were projected with another projector than the namespace's.

    Args:
        info: the namespace as it is now.
        version: the projector version the caller projected with; None (or 0 on the wire) states none.

    Raises:
        ProjectorChangedError: ``version`` is stated and is not the namespace's.
    """
    if version is not None and version != info.projector_version:
        raise ProjectorChangedError(
            f"namespace {info.name!r} has projector version {info.projector_version}; the request's features were"
            f" projected with version {version}: fetch the namespace again (its projector) and re-project"
        )


def projector_update(info: NamespaceInfo, blob: bytes, *, replace: bool) -> NamespaceInfo | None:
    """The namespace once ``blob`` is its projector; None when it is already (nothing to write).

    The first projector becomes version 1; each change bumps it, so clients load the new one. A
    blob with the same weights (a new gate, say) projects as before and needs no ``replace``; one
    with other weights does (the backend then drops every stored feature vector in the same write,
    see :func:`drops_features`).

    Raises:
        NamespaceExistsError: the namespace has other weights and ``replace`` is False.
    """
    if info.projector == blob:
        return None
    if drops_features(info, blob) and not replace:
        raise NamespaceExistsError(
            f"namespace {info.name!r} has another projector (version {info.projector_version}); replacing it drops"
            " every stored feature vector until the entries are ingested again with the new one's: ask for the"
            " replacement explicitly (replace_projector, admin ingest --replace-projector)"
        )
    return dataclasses.replace(
        info, projector=blob, projector_version=info.projector_version + 1, projector_crc32c=crc32c.crc32c(blob)
    )


def matching_namespace(existing: NamespaceInfo, wanted: NamespaceInfo) -> NamespaceInfo:
    """What ``create_namespace`` leaves of ``existing`` when asked for ``wanted``: it, with ``wanted``'s limits
    when it has none (the caller writes it back when it changed).

    Raises:
        NamespaceExistsError: another model, fingerprint or layout.
    """
    if (existing.model, existing.fingerprint, existing.layout) != (wanted.model, wanted.fingerprint, wanted.layout):
        raise NamespaceExistsError(
            f"namespace {wanted.name!r} exists with model {existing.model!r}, fingerprint {existing.fingerprint!r},"
            f" {existing.layout}; requested model {shown(wanted.model)}, fingerprint {shown(wanted.fingerprint)},"
            f" {wanted.layout}"
        )
    if existing.limits is None and wanted.limits is not None:
        return dataclasses.replace(existing, limits=wanted.limits)
    return existing


def outputs_only_feature_error(namespace: str, entry_id: int) -> MapShapeError:
    """The refusal of a feature vector for an entry that stores outputs only (``set_features``)."""
    return MapShapeError(
        f"set_features(): entry {entry_id} of namespace {namespace!r} stores outputs only (written back for the"
        " exact tier): a feature vector would send lookups to maps it does not have; nothing was written"
    )


def drops_features(info: NamespaceInfo, blob: bytes) -> bool:
    """Whether storing ``blob`` as the namespace's projector invalidates its stored feature vectors
    (it has a projector, and ``blob`` holds other weights)."""
    return info.projector is not None and not same_weights(info.projector, blob)


def check_same_layout(namespace: str, kind: str, stored: object | None, asked: object) -> None:
    """Refuse a layout of ``kind`` ("chunks", "prefix blocks") other than the one the namespace keeps them in:
    it is set once (``stored`` None: not yet), and the same one again changes nothing.

    Raises:
        FingerprintMismatchError: ``stored`` is another layout than ``asked``.
    """
    if stored is not None and stored != asked:
        raise FingerprintMismatchError(f"namespace {namespace!r} stores {kind} as {stored}; asked for {asked}")
