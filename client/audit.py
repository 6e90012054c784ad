"""The audit: a sample of the rows the store serves is computed again and compared with what it stored.

A shared store's values come from its writers (write tokens' written-back rows).
The daemon checks who writes and under which key, never what was written: a
buggy or hostile writer can store another text's outputs under a row's key. So
a cache audits a share of its store's exact hits (``CacheSettings.audit_rate``):
the sampled rows are not served from the store but computed by the compute tier
like misses (so the caller always gets the recomputed row), and the forward's
outputs are compared with the stored fp16 outputs (``RowTolerance``). On a
mismatch the cache

1. reports the row to the store (``StoreConnection.report_mismatch``), which
   quarantines it: a miss for every node until an admin releases or drops it
   (``attnstore admin quarantine``); a read token cannot quarantine, so a node on
   one counts and logs the mismatch only;
2. records the writer the store names (``AttnCache.audit_findings``, the log);
3. counts it (``CacheStats.audit_mismatches``; the node's
   ``attnstore_node_audit_mismatches``, the daemon's ``attnstore_audit_mismatches``).

An audited row costs its forward, so the audit's price is ``audit_rate`` of the
exact hits' forwards (docs/BENCHMARKS.md, "Audit").
"""

from __future__ import annotations

import logging
import random
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from attnstore.errors import AttnStoreError
from attnstore_client.connection import StoreConnection

log = logging.getLogger(__name__)

# Findings a cache keeps (the latest); every one is logged.
KEPT_FINDINGS = 256


@dataclass(frozen=True, slots=True)
class RowTolerance:
    """How far a stored row may be from a fresh forward of its tokens and still be the same row.

    Stored outputs are the fp16 of an fp32 forward: each value within 2^-11 of its own magnitude. Forwards of
    one row in other batches (packed or padded, other kernels) differ by about 1e-5. Measured on correct rows of
    the tiny test models and all-MiniLM-L6-v2: every token's cosine above 0.99999 and the largest difference
    under 0.2% of the row's largest value. Another text's outputs are far outside both.
    """

    min_cosine: float = 0.999  # every token's cosine to the fresh forward's at least this
    max_abs_share: float = 0.02  # largest difference at most this share of the stored row's largest magnitude

    def measure(self, stored: np.ndarray, fresh: torch.Tensor) -> tuple[float, float]:
        """The least per-token cosine and the largest difference as a share of the row's largest magnitude.

        Args:
            stored: ``(L, hidden)`` the stored outputs (fp16).
            fresh: ``(L, hidden)`` the forward's.
        """
        a = torch.tensor(np.asarray(stored), dtype=torch.float32)  # (L, hidden), its own copy (stored may be read-only)
        b = fresh.detach().float().cpu()  # (L, hidden)
        if a.shape != b.shape:
            return -1.0, float("inf")
        cosine = torch.nn.functional.cosine_similarity(a, b, dim=-1, eps=1e-12)  # (L,)
        scale = float(a.abs().max()) or 1.0
        return float(cosine.min()), float((a - b).abs().max()) / scale

    def holds(self, min_cosine: float, max_abs_share: float) -> bool:
        """Whether measured values are within the tolerance."""
        return min_cosine >= self.min_cosine and max_abs_share <= self.max_abs_share


@dataclass(frozen=True, slots=True)
class AuditFinding:
    """One stored object its audit found wrong, and what the store did about it."""

    namespace: str
    kind: str  # "row", "prefix" or "chunk"
    key: bytes  # a row's token hash, a prefix block's chain hash, a chunk's key
    min_cosine: float
    max_abs_share: float
    quarantined: bool  # this report put it in quarantine (False: it already was, or the report failed)
    writer: str | None  # the token name that stored it, as the store said (None: an admin, or unknown)
    error: str | None = None  # why the report failed (a read token, the store down), else None


@dataclass
class AuditLog:
    """What one cache's audit decides and found: which rows to audit, and the findings; thread-safe.

    Args:
        rng: draws the sample (a cache's own: nodes audit different rows).
    """

    rng: random.Random = field(default_factory=random.Random)
    tolerance: RowTolerance = field(default_factory=RowTolerance)
    _findings: deque[AuditFinding] = field(default_factory=lambda: deque(maxlen=KEPT_FINDINGS))
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def sample(self, rate: float) -> bool:
        """Whether to audit one more served row, at ``rate``."""
        if rate <= 0.0:
            return False
        with self._lock:
            return rate >= 1.0 or self.rng.random() < rate

    @property
    def findings(self) -> tuple[AuditFinding, ...]:
        """The latest findings (at most ``KEPT_FINDINGS``), oldest first."""
        with self._lock:
            return tuple(self._findings)

    def report(
        self, connection: StoreConnection, namespace: str, fingerprint: str, key: bytes, measured: tuple[float, float],
        *, timeout: float | None, kind: Literal["row", "prefix", "chunk"] = "row",
    ) -> AuditFinding:
        """Report a wrong object (a row by its token hash, a prefix block by its chain hash) to the store
        (quarantine), log and keep the finding; never raises a store error."""
        min_cosine, share = measured
        detail = f"min_cosine={min_cosine:.4f} max_abs_share={share:.4f}"
        quarantined, writer, error = False, None, None
        if not connection.supports_quarantine:
            error = f"{type(connection).__name__} cannot quarantine"
        else:
            try:
                reply = connection.report_mismatch(namespace, fingerprint, kind, key, detail=detail, timeout=timeout)
            except AttnStoreError as exc:
                error = f"{type(exc).__name__}: {exc}"
            else:
                quarantined, writer = reply.quarantined, reply.writer
                if not reply.found:
                    error = f"the store no longer holds the {kind}"
        finding = AuditFinding(namespace, kind, key, min_cosine, share, quarantined, writer, error)
        log.warning(
            "event=audit_mismatch namespace=%s kind=%s key=%s writer=%s quarantined=%s %s%s", namespace, kind,
            key.hex()[:16], writer or "(admin or unknown)", quarantined, detail,
            f" report_failed={error!r}" if error else "",
        )
        with self._lock:
            self._findings.append(finding)
        return finding
