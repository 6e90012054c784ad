"""One call's prefix tier: which rows start from a stored prefix, grouped into forwards on their suffixes.

Asked after the exact tiers, before the map tier, for the rows still open whose
stored prefix could pay (``tier.candidates``). Rows are grouped by
their count of stored blocks, so a forward's rows share one past length; a row
whose prefix cannot be read (a corrupt or vanished block, the daemon going
away) is dropped from its forward, which runs again without it, and is
computed later by the plain path as a fallback.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import TYPE_CHECKING

import torch

from attnstore.errors import AttnStoreError, MapsUnavailableError
from attnstore.protocol.prefix import PrefixLayout
from attnstore_client.batch import batch_from_ids
from attnstore_client.resilience import cause_of
from attnstore_client.tiers.prefix.tier import PrefixCandidate, candidates, forward_with_prefix

if TYPE_CHECKING:
    from collections.abc import Sequence

    from attnstore_client.prefill import CallCounts, Prefill

log = logging.getLogger(__name__)


def serve_prefixes(
    prefill: Prefill, layout: PrefixLayout, rows: list[int], tokens: Sequence[Sequence[int]],
    done: dict[int, torch.Tensor], kinds: dict[int, str], counts: CallCounts, batch_size: int,
) -> bool:
    """Answer the ``rows`` with a stored prefix that pays; False (rows counted as fallbacks) when the store failed.

    Served rows get ``done[i]`` (``(L, hidden)`` fp32: the stored prefix's hidden states, then the suffix's)
    and ``kinds[i] = "prefix"``; rows whose prefix failed get ``kinds[i] = "fallback"`` and stay open.
    """
    settings = prefill.settings
    asked = candidates([i for i in rows if i not in kinds], tokens, layout, settings.prefix_min_tokens)
    if not asked:
        return True
    chains = [c.chain for c in asked]
    ask = partial(prefill.connection.match_prefix, settings.namespace, prefill.fingerprint, layout.block_size, chains)
    matched = prefill._call(lambda remaining: ask(timeout=remaining), [c.row for c in asked], kinds, counts)
    if matched is None:
        return False
    groups: dict[int, list[PrefixCandidate]] = {}
    for candidate, blocks in zip(asked, matched, strict=True):
        if blocks * layout.block_size >= max(settings.prefix_min_tokens, 1):
            groups.setdefault(blocks, []).append(PrefixCandidate(candidate.row, candidate.chain[:blocks]))
    for blocks, group in sorted(groups.items(), reverse=True):
        for start in range(0, len(group), batch_size):
            _forward_group(prefill, layout, blocks * layout.block_size, group[start : start + batch_size], tokens,
                           done, kinds, counts)
    return True


def _forward_group(
    prefill: Prefill, layout: PrefixLayout, prefix_length: int, group: list[PrefixCandidate],
    tokens: Sequence[Sequence[int]], done: dict[int, torch.Tensor], kinds: dict[int, str], counts: CallCounts,
) -> None:
    """One forward of rows sharing a prefix length; rows whose prefix fails are dropped and the rest run again."""
    started = time.perf_counter()
    while group:
        try:
            stream = prefill.connection.fetch_prefix(
                prefill.settings.namespace, prefill.fingerprint, layout.block_size, [c.chain for c in group],
                timeout=prefill.settings.timeout,
            )
        except AttnStoreError as exc:
            log.warning("prefixes of %d rows could not be fetched, computing them: %s", len(group), exc)
            prefill.breaker.record_failure()
            counts.fallback(cause_of(exc), len(group))
            kinds.update({c.row: "fallback" for c in group})
            return
        suffix = batch_from_ids([tokens[c.row][prefix_length:] for c in group], prefill._pad).to(prefill.device)
        try:
            out = forward_with_prefix(prefill.adapter, suffix, prefix_length, stream)  # (B, S, hidden)
            hidden = [torch.tensor(stream.hidden(b), device=prefill.device) for b in range(len(group))]  # (p, hidden)
        except MapsUnavailableError as exc:
            failed = group[exc.row]
            log.warning("prefix of row %d unavailable (%s): computing it", failed.row, exc)
            counts.fallback(exc.cause, 1)
            kinds[failed.row] = "fallback"
            group = [c for c in group if c is not failed]
            continue
        finally:
            stream.close()
            counts.bytes_fetched += stream.bytes_fetched
            counts.fetch_s += stream.fetch_seconds
        for b, candidate in enumerate(group):
            done[candidate.row] = torch.cat([hidden[b].float(), out[b, : suffix.lengths[b]].float()])  # (L, hidden)
            kinds[candidate.row] = "prefix"
            counts.prefix_tokens += prefix_length
        break
    counts.forward_s += time.perf_counter() - started
