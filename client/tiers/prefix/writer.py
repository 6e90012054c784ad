"""Write-back of prefixes: the prefixes this node computed, stored as blocks off the critical path.

Rows of a call that share a prefix compute it once (``shared``); where write-back
is on, the prefix tier hands that prefix (its tokens, every layer's keys and
values and its last hidden states, as the forward left them) to a
``PrefixWriter``: a bounded queue (no copy, no waiting) and one thread
(``tiers.background``) that copies it to the CPU, cuts its whole blocks
(``capture.whole_blocks``, as a build does) and stores them in ``PutPrefix``
calls of at most ``batch_bytes``, parents first, so later calls and other nodes
start from it (the prefix tier's stored path).

Like rows and chunks written back, prefixes are a cache's fill, never data: a
full queue drops the new prefix, a failed call drops the rest of its prefix (its
later blocks would have no parent), and so does a call whose blocks the daemon did
not admit yet (asked for by fewer than ``--admit-after`` writers), a refused one (another layout, a bad block)
counts its prefix as refused, and a refused token or a store that takes no
prefix blocks turns the writer off with one warning. Nothing here can block or
fail a call.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from attnstore.errors import AttnStoreError, AuthError, ConfigError, WriteBackOffError
from attnstore.protocol.prefix import PrefixBlock, PrefixLayout
from attnstore_client.adapters import Adapter
from attnstore_client.connection import StoreConnection
from attnstore_client.tiers.background import BackgroundSender
from attnstore_client.tiers.prefix.capture import stacked_keys_values, whole_blocks
from attnstore_client.tiers.prefix.shared import ComputedPrefix, shareable

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PrefixWriterSettings:
    """How computed prefixes are written back."""

    # Prefixes waiting at most; past it new ones are dropped (counted). Each holds its keys and values until
    # sent (a 1,000-token prefix of a 0.5B model is about 25 MB), so the queue is short.
    max_queued: int = 32
    # Bytes of one PutPrefix call at most: under the daemon's default message cap (8 MiB); a larger block goes alone.
    batch_bytes: int = 4 << 20
    timeout: float = 10.0  # deadline of one PutPrefix call, seconds

    def __post_init__(self) -> None:
        if self.max_queued < 1 or self.batch_bytes < 1 or not self.timeout > 0:
            raise ConfigError(f"PrefixWriterSettings: sizes and timeout must be positive, got {self}")


@dataclass(frozen=True, slots=True)
class _Queued:
    """A prefix waiting to be stored, and the layout its blocks go in."""

    prefix: ComputedPrefix
    layout: PrefixLayout

    @property
    def blocks(self) -> int:
        """Its whole blocks (the tokens after the last one are not stored)."""
        return len(self.prefix.tokens) // self.layout.block_size


@dataclass(frozen=True, slots=True)
class PrefixWriterStats:
    """What the writer has done since it started."""

    queued: int  # prefixes put on the queue
    stored: int  # blocks the store added
    duplicates: int  # blocks it had already (another node, or a build, was first)
    not_admitted: int  # blocks the store skipped (not asked for by enough writers yet), and the ones after them
    dropped_full: int  # prefixes dropped because the queue was full
    dropped_failed: int  # prefixes (whole or their later blocks) dropped with a failed call (store unreachable, off)
    refused: int  # prefixes the store refused (another prefix layout, a bad block)
    disabled: str | None  # why the writer turned itself off, if it did
    layout: PrefixLayout | None  # the namespace's prefix layout once a put succeeded (the blocks' own)


class PrefixWriter(BackgroundSender[_Queued]):
    """A bounded queue and one thread that stores computed prefixes' blocks in ``connection``'s namespace.

    Args:
        connection: the store (it must take prefix blocks: a daemon and a write token).
        namespace, fingerprint: where blocks go, and the model's fingerprint.
        settings: queue size, call size, deadline.
    """

    def __init__(
        self, connection: StoreConnection, namespace: str, fingerprint: str,
        settings: PrefixWriterSettings = PrefixWriterSettings(),
    ) -> None:
        # One prefix per batch: its blocks are cut into calls by bytes in _send, parents first.
        super().__init__(name="attnstore-prefix-writer", max_queued=settings.max_queued, batch_items=1,
                         batch_bytes=settings.batch_bytes, counts=("stored", "duplicates", "not_admitted", "refused"))
        self._connection, self._namespace, self._fingerprint = connection, namespace, fingerprint
        self.settings = settings
        self._layout: PrefixLayout | None = None
        self._start()

    @property
    def layout(self) -> PrefixLayout | None:
        """The namespace's prefix layout once a put of this writer succeeded; None before."""
        return self._layout

    def put(self, prefix: ComputedPrefix, layout: PrefixLayout) -> bool:
        """Queue one prefix, its blocks to go in ``layout``; False when it was dropped (or has no whole block).
        Never blocks."""
        queued = _Queued(prefix, layout)
        return queued.blocks > 0 and self._offer(queued)

    def stats(self) -> PrefixWriterStats:
        """The counts so far."""
        counts = self._snapshot()
        del counts["pending"]
        return PrefixWriterStats(**counts, disabled=self._disabled, layout=self._layout)

    def _size(self, item: _Queued) -> int:
        return item.blocks * item.layout.block_bytes

    def _send(self, batch: list[_Queued]) -> None:
        done: Counter[str] = Counter(pending=-len(batch))
        try:
            for queued in batch:
                done.update({"dropped_failed": 1} if self._disabled is not None else self._store(queued))
        finally:
            self._add(**done)

    def _store(self, queued: _Queued) -> dict[str, int]:
        """Store one prefix's blocks in calls of at most ``batch_bytes``; the counts of what happened."""
        done = {"stored": 0, "duplicates": 0, "not_admitted": 0}
        layout = queued.layout
        try:
            calls = _calls(_blocks_of(queued), layout.block_bytes, self.settings.batch_bytes)
            for number, call in enumerate(calls):
                counts = self._connection.put_prefix(self._namespace, self._fingerprint, layout, call,
                                                     timeout=self.settings.timeout)
                self._layout = layout
                done["stored"] += counts.stored
                done["duplicates"] += counts.duplicates
                if counts.not_admitted:  # the later calls' blocks would have no parent
                    done["not_admitted"] += counts.not_admitted + sum(len(c) for c in calls[number + 1 :])
                    break
        except (AuthError, WriteBackOffError) as exc:
            self._disabled = str(exc)
            log.warning("prefix write-back off for namespace %r: %s", self._namespace, exc)
            return done | {"dropped_failed": 1}
        except AttnStoreError as exc:
            refused = not isinstance(exc, ConnectionError)  # an outage drops the prefix; anything else refused it
            log.warning("prefix write-back of %d blocks %s: %s", queued.blocks, "refused" if refused else "failed",
                        exc)
            return done | {"refused" if refused else "dropped_failed": 1}
        except Exception:
            log.exception("prefix write-back of %d blocks failed unexpectedly", queued.blocks)
            return done | {"dropped_failed": 1}
        return done


def _blocks_of(queued: _Queued) -> list[PrefixBlock]:
    """The prefix's whole blocks, copied to the CPU in its layout's dtype."""
    prefix = queued.prefix
    kv = stacked_keys_values(prefix.keys, prefix.values)[:, 0]  # (layers, 2, KVH, p, d)
    hidden = prefix.hidden.float().cpu().numpy()  # (p, hidden)
    return whole_blocks(prefix.tokens, kv, hidden, queued.layout)


def _calls(blocks: Sequence[PrefixBlock], block_bytes: int, batch_bytes: int) -> list[list[PrefixBlock]]:
    """``blocks`` in order, cut into calls of at most ``batch_bytes`` (at least one block each)."""
    per_call = max(1, batch_bytes // block_bytes)
    return [list(blocks[start : start + per_call]) for start in range(0, len(blocks), per_call)]


def start_prefix_writer(
    connection: StoreConnection, namespace: str, fingerprint: str, adapter: Adapter, *, write_back: bool
) -> PrefixWriter | None:
    """The writer of an ``AttnCache`` with write-back on (a daemon: ``start_write_back`` checked it) and a model
    whose prefixes can be stored (causal, no sliding window); None otherwise."""
    if not write_back or not shareable(adapter):
        return None
    log.info("prefix write-back on: namespace %r", namespace)
    return PrefixWriter(connection, namespace, fingerprint)
