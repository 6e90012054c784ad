"""The service's prefix part, the daemon's side of the prefix tier: which stored prefix each row may start
from, and its keys and values.

A row's prefix is asked for as its chain of block hashes (computed by the
client from its token ids, see ``attnstore.protocol.prefix``); the answer is,
per row, how many of its blocks are stored from the start on. The client asks
only for the blocks that leave at least one token to compute and for prefixes
long enough to pay, so the answer is used as it is.

Blocks are put whole and all-or-nothing per call (a node's write-back of a prefix
it computed), under ``put_rules``: each block is filed under the chain hash the
daemon computes from its token ids, admitted like a written-back row (its hash
asked in ``PrefixMatch`` by ``--admit-after`` writers), and recorded with its
writer. The namespace's ``PrefixLayout`` is the model's, recorded at creation (or
by an admin's put, checked against the model); a put in another layout is
refused naming both, so no client is served keys and values of another model's
shapes or dtype, and no writer turns the tier off for the others.

A block found corrupt while it was read is *cut* (``PrefixCuts``):
from then on every chain through it is answered as ending before it, so clients
stop fetching megabytes they cannot use on every call. Cuts are this process's
(a restart finds the block again at its next read; ``admin verify`` names it).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from attnstore.errors import FingerprintMismatchError, MapShapeError, PrefixBlockCorruptError
from attnstore.protocol.prefix import (
    PrefixBlock,
    PrefixLayout,
    block_chain_hash,
    check_block,
    check_prefix_request,
)
from attnstore.service import put_rules
from attnstore.service.admission import Admission, AdmissionConfig
from attnstore.service.put_rules import PutCaller
from attnstore.store.base import MapStoreBase

if TYPE_CHECKING:
    from attnstore.protocol.records import NamespaceInfo


@dataclass(frozen=True, slots=True)
class PrefixPutResult:
    """What one put of prefix blocks did."""

    stored: int  # blocks new to the store
    duplicates: int  # blocks it had already (another node, or a build, was first)
    bytes: int  # bytes of the new ones
    not_admitted: int = 0  # blocks skipped: not admitted (or chained after one that was not)


def check_prefix_layout(stored: PrefixLayout, namespace: str, layout: PrefixLayout) -> None:
    """Raises ``FingerprintMismatchError`` naming both when a put's ``layout`` is not the namespace's ``stored``."""
    if stored != layout:
        raise FingerprintMismatchError(
            f"namespace {namespace!r} stores prefix blocks of {stored}; the request's are {layout}"
            " (another block size, model or dtype)"
        )


class PrefixCuts:
    """The prefix blocks found unservable while serving, per namespace; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cut: dict[str, set[bytes]] = {}

    def cut(self, namespace: str, chain_hash: bytes) -> None:
        """Answer every chain through ``chain_hash`` as ending before it from now on."""
        with self._lock:
            self._cut.setdefault(namespace, set()).add(bytes(chain_hash))

    def forget(self, namespace: str) -> None:
        """Forget the cuts of a dropped namespace."""
        with self._lock:
            self._cut.pop(namespace, None)

    def blocks(self, namespace: str, chain: Sequence[bytes], stored: int) -> int:
        """How many of ``chain``'s first ``stored`` blocks come before the first cut one."""
        with self._lock:
            cut = self._cut.get(namespace)
            if not cut:
                return stored
            return next((position for position in range(stored) if bytes(chain[position]) in cut), stored)


class ServicePrefixes:
    """The service's prefix part: its stored prefix blocks (over the store), matched and read; thread-safe."""

    def __init__(self, store: MapStoreBase, check_fingerprint: Callable[[str, str], NamespaceInfo],
                 admission: Callable[[], Admission] | None = None,
                 held: Callable[[str, bytes], bool] | None = None) -> None:
        """
        Args:
            store: the service's map store.
            check_fingerprint: the service's check that a request's model is the namespace's
                (``AttnStoreService.check_fingerprint``).
            admission: the service's admission rule as it is now (None: off, only trusted puts store).
            held: whether a block (namespace, chain hash) is quarantined (``service.quarantine``): chains end
                before it, as before a cut one, until an admin releases it.
        """
        self._held = held or (lambda namespace, chain_hash: False)
        self._store = store
        self._check_fingerprint = check_fingerprint
        off = Admission(AdmissionConfig(admit_after=0))
        self._admission = admission or (lambda: off)
        self._cuts = PrefixCuts()  # prefix blocks found unservable: chains end before them

    def layout(self, namespace: str) -> PrefixLayout | None:
        """How the namespace stores prefix blocks; None when it stores none."""
        if self._store.prefixes is None:  # a store without prefix blocks: no namespace stores any
            self._store.get_namespace(namespace)
            return None
        return self._store.prefixes.layout(namespace)

    def matches(self, namespace: str, fingerprint: str, block_size: int, rows: Sequence[Sequence[bytes]],
                caller: str | None = None) -> list[int]:
        """Each row's count of stored blocks from its first on (a lookup stops at the first missing, cut or
        quarantined block);
        ``caller`` (an admission key; None: not counted) counts as asking for each row's blocks not stored.

        Raises:
            NamespaceNotFoundError: no such namespace.
            FingerprintMismatchError: another model, or blocks of another size (or none).
            MapShapeError: a hash that is not 32 bytes.
        """
        self._check_fingerprint(namespace, fingerprint)
        check_prefix_request(self.layout(namespace), namespace, block_size)
        prefixes = self._store.require_prefixes("prefixes.match()")
        counts = [self._cuts.blocks(namespace, row, prefixes.match(namespace, row)) for row in rows]
        counts = [next((i for i in range(n) if self._held(namespace, bytes(row[i]))), n)
                  for row, n in zip(rows, counts, strict=True)]
        asked = dict.fromkeys(bytes(h) for row, n in zip(rows, counts, strict=True) for h in row[n:])
        put_rules.observe(self._admission, namespace, list(asked), caller)
        return counts

    def read(self, namespace: str, block_size: int, chain: Sequence[bytes], part: int) -> np.ndarray:
        """Part ``part`` of a row's stored prefix: a layer's keys and values ``(2, KVH, p, d)``, or (``part`` =
        the layer count) the prefix's last hidden states ``(p, hidden)``.

        A block found corrupt is cut, so prefix matches end before it from then on (a missing block ends them
        already: matches read records).

        Raises:
            FingerprintMismatchError: another block size.
            PrefixBlockMissingError: a block is no longer stored, or the chain skips its parents;
                PrefixBlockCorruptError: a block is corrupt (both name it; see ``PrefixCuts``).
        """
        layout = check_prefix_request(self.layout(namespace), namespace, block_size)
        prefixes = self._store.require_prefixes("prefixes.read_layer()")
        try:
            if part == layout.layers:
                return prefixes.read_hidden(namespace, chain)
            return prefixes.read_layer(namespace, chain, part)
        except PrefixBlockCorruptError as exc:
            self._cuts.cut(namespace, exc.chain_hash)
            raise

    def set_layout(self, namespace: str, layout: PrefixLayout) -> PrefixLayout:
        """Record the namespace's prefix layout (an admin's: ``CreateNamespace``); its own again changes nothing.

        Raises:
            NamespaceNotFoundError: no such namespace.
            FingerprintMismatchError: a bidirectional namespace, a layout that is not its model's, or another
                layout recorded already (both named).
        """
        info = self._store.get_namespace(namespace)
        put_rules.check_causal(info, "prefix blocks")
        put_rules.check_model_fit(info, "prefix blocks", layout, layers=layout.layers, kv_heads=layout.kv_heads,
                                  hidden=layout.hidden)
        recorded = self.layout(namespace)
        if recorded is not None:
            check_prefix_layout(recorded, namespace, layout)
            return recorded
        return self._store.require_prefixes("prefixes.set_layout()").set_layout(namespace, layout)

    def put(
        self, namespace: str, fingerprint: str, layout: PrefixLayout, blocks: Sequence[PrefixBlock],
        caller: PutCaller = put_rules.LOCAL,
    ) -> PrefixPutResult:
        """Store ``blocks`` (all or none, parents before children) under the rules of ``put_rules``: each under
        the chain hash its token ids give, the admitted ones, recorded as ``caller``'s.

        Raises:
            NamespaceNotFoundError, FingerprintMismatchError: another model; a bidirectional namespace; another
                prefix layout than the namespace's (both named), or none recorded and an untrusted caller.
            MapShapeError: a block without token ids (or ids outside the vocabulary), whose sent hash is not
                the one its ids give, that does not fit ``layout``, is not finite, or whose parent is neither
                stored nor earlier in ``blocks`` (nothing is stored).
            WriteBackOffError: write-back is off (``--admit-after 0``) for an untrusted caller.
            StoreFullError: the store is full (nothing is stored).
        """
        info = self._check_fingerprint(namespace, fingerprint)
        put_rules.check_causal(info, "prefix blocks")
        recorded = self.layout(namespace)
        if recorded is not None:
            check_prefix_layout(recorded, namespace, layout)
        else:
            put_rules.check_no_layout(info, "prefix", caller)
            put_rules.check_model_fit(info, "prefix blocks", layout, layers=layout.layers, kv_heads=layout.kv_heads,
                                      hidden=layout.hidden)
        checked = [_keyed(info, layout, _finite(check_block(layout, block, position)), position, caller)
                   for position, block in enumerate(blocks)]
        if not checked:
            return PrefixPutResult(0, 0, 0)
        prefixes = self._store.require_prefixes("prefixes.put()")
        fresh = [b.chain_hash for b in checked if not prefixes.match(namespace, [b.chain_hash])]
        verdicts = dict(zip(fresh, put_rules.admitted(self._admission, namespace, fresh, caller), strict=True))
        # A block stored already needs no admission (its put is a duplicate; its children may follow it).
        admitted = _admitted_chains(checked, [verdicts.get(b.chain_hash, True) for b in checked])
        if recorded is None:  # an admin's put records the layout (refused when another was set meanwhile)
            prefixes.set_layout(namespace, layout)
        stored = prefixes.put(namespace, admitted) if admitted else 0
        return PrefixPutResult(stored, len(admitted) - stored, stored * layout.block_bytes,
                               len(checked) - len(admitted))

    def drop_writer(self, namespace: str, writer: str, *, dry_run: bool = False) -> int:
        """Delete the blocks ``writer`` put and every block chained after them; returns how many.

        Raises:
            ConfigError: an empty writer name.
            NamespaceNotFoundError: no such namespace.
        """
        if self._store.prefixes is None:
            self._store.get_namespace(namespace)
            return 0
        return self._store.prefixes.drop_writer(namespace, writer, dry_run=dry_run)

    def forget(self, namespace: str) -> None:
        """Forget what was learnt of a dropped namespace (its cut blocks)."""
        self._cuts.forget(namespace)


def _keyed(info: NamespaceInfo, layout: PrefixLayout, block: PrefixBlock, position: int, caller: PutCaller
           ) -> PrefixBlock:
    """``block`` recorded as ``caller``'s, once its chain hash is the one its parent and token ids give."""
    where = f"prefix block {position}"
    ids = put_rules.check_token_ids(info, block.token_ids, where)
    put_rules.check_key(block.chain_hash, block_chain_hash(layout, block.parent, ids), where)
    return dataclasses.replace(block, token_ids=ids, writer=caller.writer)


def _admitted_chains(blocks: Sequence[PrefixBlock], admitted: Sequence[bool]) -> list[PrefixBlock]:
    """The admitted blocks, less those chained after a block of the call that was not admitted."""
    skipped: set[bytes] = set()
    out = []
    for block, yes in zip(blocks, admitted, strict=True):
        if not yes or (block.parent is not None and block.parent in skipped):
            skipped.add(block.chain_hash)
            continue
        out.append(block)
    return out


def _finite(block: PrefixBlock) -> PrefixBlock:
    """``block``, once its keys, values and hidden states are finite (a NaN would be served to every node)."""
    if not (np.isfinite(block.kv).all() and np.isfinite(block.hidden).all()):
        raise MapShapeError(f"prefix block {block.chain_hash.hex()[:16]}: keys, values or hidden states that are"
                            " not finite")
    return block
