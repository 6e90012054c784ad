"""How the node merges requests into calls: one frozen settings object, each default with why it is what it is.

Kept apart from the batcher (which loads torch and the client) so that ``attnstore --help`` stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BatcherSettings:
    """How requests are merged into calls (the ``attnstore node`` options of the same names)."""

    max_batch_tokens: int | None = None  # tokens per packed forward; None: from the cost model's fit (``budget``)
    max_wait_ms: float = 5.0  # longest a request waits for others to join its call (a few ms: less than a forward)
    batch_size: int = 128  # rows per forward at most, and per projection batch of the map tier (padded there)
    max_call_rows: int = 4096  # rows per call at most, so one call never holds the next requests back for long
    # Rows waiting for a call at most: past it a request is refused with 429 (clients retry), so a burst's memory
    # is bounded by the settings (docs/guides/http-node.md, "Memory"). Two calls' worth.
    max_queued_rows: int = 8192
    warmup: bool = True  # time forwards before serving (fast first requests, a forward fit from the start)

    def __post_init__(self) -> None:
        if self.max_batch_tokens is not None and self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1 or None, got {self.max_batch_tokens}")
        if self.max_wait_ms < 0 or self.batch_size < 1 or self.max_call_rows < 1 or self.max_queued_rows < 1:
            raise ValueError(f"max_wait_ms must be >= 0, batch_size, max_call_rows and max_queued_rows >= 1;"
                             f" got {self}")
