"""One call through the cache: a stream of windows of rows, each through the tiers in order, into the call's sink.

A call's rows are taken a window at a time (``CallSettings.window_rows``), longest
first, as sentence-transformers orders them (``sources``). For each window:

1. its rows are tokenized (text input) and hashed; rows with identical tokens
   are one row (computed once, every copy answered, across windows too), and a
   repeated text is a copy of the row its first occurrence resolved to;
2. the tiers are asked in order, each only for the rows still open
   (``tiers.base.Tier``): this process's exact tier, the store's exact tier,
   stored prefixes (causal models), map replay where the cost model expects it
   to pay, and last the model computes the rest (a store's exact hit set aside
   for its audit goes straight to it: ``attnstore_client.audit``);
3. every tier hands the rows it serves straight to the call's sink (``sinks``),
   which pools them into the preallocated result in input order.

So a call holds its result plus a window in flight, whatever its number of rows.
At the end the sink must hold every input position (``Sink.check``): a row no
tier delivered raises ``UnwrittenRowError`` instead of returning its buffer.
Each tier's time is kept apart (``CallCounts.tier_s``); the rest of the call
(tokenizing, hashing, deduplication, pooling, writing the result) is its
overhead, reported as ``CacheStats.overhead_s`` so it can never hide.

The store can only make a call faster: a miss, timeout, checksum failure or
outage leaves the rows open for the compute tier (counted as fallbacks), and a
store that cannot be reached costs retries within the deadline, then the
circuit breaker keeps every call away from it for a while (``tiers.base.ask_store``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from tqdm.auto import tqdm

from attnstore.errors import ConfigError, UnwrittenRowError
from attnstore_client.call.rows import Row
from attnstore_client.call.sources import RowSource, Window
from attnstore_client.call.state import Call
from attnstore_client.keys import token_hash
from attnstore_client.tiers.base import Tier


class Prefill:
    """Runs calls through ``tiers``, in order; the last tier must serve every row it is given.

    The pipeline is fixed when made: what changes between calls (the settings, the namespace) comes with the call.

    Args:
        tiers: cheapest first, the compute tier last.
    """

    __slots__ = ("_tiers",)

    def __init__(self, tiers: Sequence[Tier]) -> None:
        if not tiers:
            raise ConfigError("Prefill needs at least one tier (the compute tier, last)")
        self._tiers = tuple(tiers)

    @property
    def tiers(self) -> tuple[Tier, ...]:
        """The tiers, in the order a call asks them."""
        return self._tiers

    def run(self, source: RowSource, call: Call, *, progress: bool = False) -> None:
        """Serve every row of ``source`` into ``call``'s sink; ``call.counts`` and ``call.kinds`` say how.

        Raises:
            ConfigError: a row without tokens.
            UnwrittenRowError: a row no tier served (a bug in a tier, never a value handed out).
        """
        started = time.perf_counter()
        first: dict[bytes, int] = {}  # token hash (and segments, chunk tier on) -> the position of its first row
        roots: dict[int, int] = {}  # the position of a copy -> the position of the row it copies
        with tqdm(total=len(source), desc="rows", unit="row", disable=not progress) as bar:
            for window in source.windows(call.settings.window_rows):
                rows = self._distinct(window, first, roots, call)
                audited: list[Row] = []  # rows a tier set aside for their audit: the compute tier's alone
                for tier in self.tiers[:-1]:
                    if not rows:
                        break
                    rows = self._serve(tier, rows, call)
                    audited += [row for row in rows if row.facts.audit is not None]
                    rows = [row for row in rows if row.facts.audit is None]
                if rows or audited:
                    rows = self._serve(self.tiers[-1], rows + audited, call)
                if rows:
                    raise UnwrittenRowError(f"{len(rows)} rows left open by the last tier, {self.tiers[-1].name}:"
                                            f" rows {[row.index for row in rows[:8]]}")
                bar.update(len(window))
        call.sink.check(call.kinds)  # a row no tier delivered is a bug: raise, never hand out its buffer
        call.counts.total_s = time.perf_counter() - started

    @staticmethod
    def _serve(tier: Tier, rows: list[Row], call: Call) -> list[Row]:
        """``tier.serve``, its time (less the sink's) added to the tier's."""
        sink_before = call.counts.sink_s
        started = time.perf_counter()
        left = tier.serve(rows, call)
        seconds = time.perf_counter() - started - (call.counts.sink_s - sink_before)
        call.counts.tier_s[tier.name] = call.counts.tier_s.get(tier.name, 0.0) + seconds
        return left

    @staticmethod
    def _distinct(window: Window, first: dict[bytes, int], roots: dict[int, int], call: Call) -> list[Row]:
        """The window's rows not seen before in the call.

        Every other row is a copy of one distinct row, its *root*: the first row of the call with its tokens.
        A text that repeats an earlier text takes that text's root, also when the earlier text was itself a copy
        (an uncased model gives "Fox" and "fox" one row; a later "fox" is a copy of the first "Fox"). A copy of
        a served root is answered at once, a copy of one in flight when its root is served.
        """
        rows: list[Row] = []
        copies: list[int] = []  # positions of this window answered by a root
        for position, tokens in window.rows:
            if not len(tokens.ids):
                raise ConfigError(f"row {position} has no tokens; every row needs at least one")
            key = token_hash(tokens.ids, tokens.token_types)
            # With the chunk tier on, a prompt's segments decide what it is fused from: the same ids cut into other
            # segments (or given as a plain text) are another row.
            same = key + repr(tokens.segments).encode() if call.settings.chunks is not None else key
            root = first.setdefault(same, position)
            if root == position:
                rows.append(Row(position, tokens.ids, key, tokens.segments, tokens.token_types))
            else:
                roots[position] = root
                copies.append(position)
        for position, earlier in window.repeats:  # after the rows: ``earlier`` may be a copy found just above
            roots[position] = roots.get(earlier, earlier)
            copies.append(position)
        for position in copies:
            root = roots[position]
            call.counts.deduplicated += 1
            if call.kinds[root]:
                call.sink.copy(root, position)
                call.kinds[position] = call.kinds[root]
            else:
                call.copies.setdefault(root, []).append(position)
        return rows
