"""What the daemon checks of every prefix block and chunk a caller puts, before the store sees it.

Prefix blocks and chunks are served to every node, so the daemon trusts none of
what a writer says about them beyond its arrays:

- **keys are the daemon's**: a put carries each object's token ids, and the
  daemon files it under the key it computes from them (``protocol.keys``); a
  key the caller sent that differs is refused, naming both.
- **layouts are the model's**: a namespace's prefix and chunk layouts are
  recorded when it is created (``CreateNamespace``, from the model's
  configuration) or by an admin's put, each checked against the namespace's
  model layout (layers, query heads, hidden size); a write token's put never
  records one, a put of another layout is refused naming both, and a
  bidirectional (encoder) namespace refuses every put: its keys and values
  depend on what follows them.
- **admission**: an object is stored only once ``--admit-after`` distinct
  writers asked for its key (``PrefixMatch``, ``ChunkMatch``, ``FetchChunks``),
  as written-back rows are; an admin's put is the operator's choice and always
  admitted.
- **attribution**: each stored object records its writer's token name, which
  ``admin drop-writer`` removes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from attnstore.errors import FingerprintMismatchError, MapShapeError, WriteBackOffError
from attnstore.protocol.records import NamespaceInfo
from attnstore.service.admission import Admission


@dataclass(frozen=True, slots=True)
class PutCaller:
    """Who puts: the name recorded with what it stores, and how admission treats it."""

    writer: str | None = None  # recorded with each stored object (a token's name); None: a local build
    trusted: bool = True  # an admin (or this process): admitted without asks, may record a missing layout


LOCAL = PutCaller()  # a put from this process (a build, a test): trusted, recorded without a writer


def check_causal(info: NamespaceInfo, what: str) -> None:
    """Raises ``FingerprintMismatchError`` for a bidirectional (encoder) namespace: it stores no ``what``."""
    if not info.layout.causal:
        raise FingerprintMismatchError(
            f"namespace {info.name!r} is bidirectional (an encoder model): it stores no {what}, whose keys and"
            " values would depend on the tokens after them"
        )


def check_model_fit(info: NamespaceInfo, what: str, layout: object, *, layers: int, kv_heads: int,
                    hidden: int | None = None) -> None:
    """Raises ``FingerprintMismatchError`` naming both when ``layout`` cannot be the namespace model's: another
    layer count or hidden size, or KV heads that do not divide its query heads."""
    model = info.layout
    if layers != model.layers or model.heads % kv_heads or (hidden is not None and hidden != model.hidden):
        raise FingerprintMismatchError(
            f"namespace {info.name!r} holds a model of {model.layers} layers, {model.heads} query heads and hidden"
            f" size {model.hidden}; {what} of {layout} are not that model's"
        )


def check_no_layout(info: NamespaceInfo, what: str, caller: PutCaller) -> None:
    """Raises ``FingerprintMismatchError`` when ``caller`` may not record the namespace's missing ``what`` layout
    (only an admin may: a writer's first put must not choose it for every node)."""
    if not caller.trusted:
        raise FingerprintMismatchError(
            f"namespace {info.name!r} records no {what} layout, and a write token's put does not choose one:"
            f" record the model's with `attnstore admin create-namespace --model {info.model} --namespace"
            f" {info.name}`"
        )


def check_token_ids(info: NamespaceInfo, ids: np.ndarray | None, where: str) -> np.ndarray:
    """``ids`` as int64, once they are a non-empty row of the model's vocabulary.

    Raises:
        MapShapeError: no ids, or an id outside the vocabulary (the namespace's limits, when it records them).
    """
    if ids is None or np.asarray(ids).ndim != 1 or len(ids) == 0:
        raise MapShapeError(f"{where}: carries no token ids (the daemon computes its key from them)")
    row = np.asarray(ids)
    if row.dtype.kind not in "iu":
        raise MapShapeError(f"{where}: token ids must be integers, got {row.dtype}")
    row = row.astype(np.int64)
    limits = info.limits
    bad = (row < 0) | (row >= (limits.vocab_size if limits is not None else 2**32))
    if bad.any():
        raise MapShapeError(f"{where}: token id {int(row[bad.argmax()])} is outside the vocabulary of namespace"
                            f" {info.name!r}")
    return row


def check_key(sent: bytes, derived: bytes, where: str) -> None:
    """Raises ``MapShapeError`` naming both when a caller's key is not the one its token ids give."""
    if sent != derived:
        raise MapShapeError(f"{where}: key {sent.hex()} is not the one its token ids give ({derived.hex()});"
                            " the daemon files objects under the keys it computes")


def admitted(admission: Callable[[], Admission], namespace: str, keys: Sequence[bytes], caller: PutCaller
             ) -> list[bool]:
    """Whether each key is admitted: always for a trusted caller, else by the admission rule.

    Raises:
        WriteBackOffError: write-back is off (``--admit-after 0``) and the caller is not trusted.
        UnavailableError: shared counts cannot be reached.
    """
    if caller.trusted:
        return [True] * len(keys)
    rule = admission()
    if not rule.enabled:
        raise WriteBackOffError("this daemon runs with --admit-after 0: write-back is off, nothing was stored")
    return rule.admitted(namespace, list(keys))


def observe(admission: Callable[[], Admission], namespace: str, keys: Sequence[bytes], caller: str | None) -> None:
    """Count ``caller`` asking for ``keys`` it found missing (what admits their puts; None counts nothing)."""
    rule = admission()
    if keys and caller is not None and rule.enabled:
        rule.observe(namespace, list(keys), [True] * len(keys), caller)
