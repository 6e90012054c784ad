"""Picking a stored entry for each query: the oracle, the projector and the simple keys.

- The **oracle** is the entry whose true maps are closest to the query's, by
  the map term of the training target (alpha x mean per-row TV distance), among
  the entries the query may use: the same length, and for causal models also
  longer entries cropped to the query's length (the crop's TV is exactly the
  error crop reuse makes, so no length term is added).
- The **projector** pick is the service's answer: the namespace's projector on
  the query's feature source, searched in the service's index with no threshold
  (the threshold is applied afterwards, when calibrated). Without crop, causal
  queries search their own length's stored feature vectors exactly. When the
  namespace has a fidelity gate, the pick is the gate's (the most probable of the
  nearest candidates) and its "distance" is ``1 - P(faithful)``, so a threshold of
  ``1 - cutoff`` is the gate's own decision.
- The **simple keys** need each entry's feature source, recomputed from the
  build corpus: L2 between mean-pooled input embeddings, and position-wise L2
  between the input embeddings (defined for equal lengths; for a crop, over the
  entry's first L positions, which are all the cropped maps depend on).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from attnstore.projector.gate import FidelityGate
from attnstore.service import AttnStoreService, Query
from attnstore_client.adapters import Adapter
from attnstore_client.adapters.batch import batch_from_ids
from attnstore_client.keys import token_hash
from attnstore_client.projector import Projector
from attnstore_tools.build.training import map_distances
from attnstore_tools.eval.oracle.fidelity import EvalQuery

SIMPLE_KEYS = ("mean_pooled", "positionwise")
# Cap on the fp16 maps of one block of stored entries read for the oracle.
_BLOCK_BYTES = 256 << 20


@dataclass(frozen=True, slots=True)
class Pick:
    """The entry a method picked for one query; ``entry_id`` None when it had no candidate."""

    entry_id: int | None
    distance: float  # the method's own distance (inf without a candidate)
    stored_length: int | None

    @property
    def key(self) -> tuple[int, int] | None:
        """``(entry id, stored length)``, what a replay needs; None without a candidate."""
        return None if self.entry_id is None else (self.entry_id, int(self.stored_length))


_NONE = Pick(None, math.inf, None)


@dataclass(frozen=True)
class OraclePicks:
    """Per query, the oracle among same-length entries and among same-or-longer (cropped) ones."""

    same_length: list[Pick]
    crop: list[Pick]  # equals ``same_length`` for bidirectional models


@dataclass(frozen=True)
class EntrySources:
    """Feature sources of stored entries, by token length (for the simple keys)."""

    ids: dict[int, np.ndarray]  # length -> (n,) entry ids
    sources: dict[int, torch.Tensor]  # length -> (n, L, hidden) fp32
    missing: int  # stored entries the corpus did not account for


def oracle_picks(
    service: AttnStoreService,
    namespace: str,
    queries: Sequence[EvalQuery],
    *,
    causal: bool,
    alpha: float = 0.2,
    progress: bool = True,
) -> OraclePicks:
    """Find each query's oracle entry by true map distance (see the module docstring).

    Every stored entry that some query may use is read once, in blocks.

    Returns:
        The same-length and crop oracles, one pick per query, in order.
    """
    same = [_NONE] * len(queries)
    crop = [_NONE] * len(queries)
    lengths = np.array([q.length for q in queries])
    stored = [
        s for s in service.store.lengths(namespace) if ((lengths <= s).any() if causal else (lengths == s).any())
    ]
    bar = tqdm(total=len(stored), desc="oracle", unit="bucket", disable=not progress)
    for stored_length in stored:
        users = np.flatnonzero((lengths <= stored_length) if causal else (lengths == stored_length))
        for ids, block in _bucket_blocks(service, namespace, stored_length):
            for i in users:
                length = int(lengths[i])
                tv = map_distances(queries[i].maps, block[..., :length, :length], alpha=alpha)  # (n,)
                best = int(np.argmin(tv))
                pick = Pick(int(ids[best]), float(tv[best]), stored_length)
                if length == stored_length and pick.distance < same[i].distance:
                    same[i] = pick
                if pick.distance < crop[i].distance:
                    crop[i] = pick
        bar.update(1)
    bar.close()
    return OraclePicks(same_length=same, crop=crop if causal else same)


def _bucket_blocks(service: AttnStoreService, namespace: str, length: int) -> Iterator[tuple[list[int], torch.Tensor]]:
    """A length bucket's entries as blocks ``(ids, (n, layers, heads, L, L) fp16)`` under ``_BLOCK_BYTES``."""
    per_entry = service.get_namespace(namespace).layout.map_nbytes(length)
    size = max(1, _BLOCK_BYTES // per_entry)
    ids = [e.id for e in service.store.entries(namespace, length)]
    for start in range(0, len(ids), size):
        block_ids = ids[start : start + size]
        yield block_ids, torch.from_numpy(np.stack([service.store.read_maps(namespace, i) for i in block_ids]))


def projector_picks(
    service: AttnStoreService,
    namespace: str,
    projector: Projector,
    queries: Sequence[EvalQuery],
    *,
    crop: bool,
    gate: FidelityGate | None = None,
) -> list[Pick]:
    """The projector's top-1 for each query, without a threshold.

    Args:
        crop: for causal namespaces, let the index match longer entries (as the
            service does); False searches the query's own length only.
        gate: the namespace's fidelity gate, to pick as a gated lookup does
            (distance ``1 - P(faithful)``); None picks the nearest entry.
    """
    info = service.get_namespace(namespace)
    features = projector.project([q.source for q in queries])  # (q, dim)
    if gate is not None and (crop or not info.layout.causal):
        rows = [Query(f, q.length, token_ids=np.asarray(q.ids)) for f, q in zip(features, queries, strict=True)]
        return [
            _NONE if pick is None else Pick(pick.entry_id, 1.0 - probability, pick.stored_length)
            for pick, probability in service.gate_picks(namespace, info.fingerprint, rows, gate)
        ]
    if crop or not info.layout.causal:
        matches = service.lookup(
            namespace,
            info.fingerprint,
            [Query(feature, q.length) for feature, q in zip(features, queries, strict=True)],
            max_distance=math.inf,
            exact=False,  # the projector is judged on every query; the exact tier is reported apart
        )
        return [Pick(m.entry_id, m.distance, m.stored_length) if m.entry_id is not None else _NONE for m in matches]
    picks = []
    for feature, query in zip(features, queries, strict=True):
        entries = [e for e in service.store.entries(namespace, query.length) if e.feature is not None]
        if not entries:
            picks.append(_NONE)
            continue
        distances = np.linalg.norm(np.stack([e.feature for e in entries]) - feature, axis=1)
        best = int(np.argmin(distances))
        picks.append(Pick(entries[best].id, float(distances[best]), query.length))
    return picks


def entry_sources(
    adapter: Adapter,
    service: AttnStoreService,
    namespace: str,
    corpus: Sequence[str],
    *,
    batch_size: int = 64,
    progress: bool = True,
) -> EntrySources:
    """Recompute the feature source of every stored entry from the build corpus.

    Each corpus text is tokenized and matched to its entry by token hash; texts
    not stored (skipped by the build, or another corpus) are ignored.

    Returns:
        The sources by length, and how many stored entries had no corpus text.
    """
    tokenizer = adapter.loaded.tokenizer
    found: dict[int, tuple[int, ...]] = {}
    for text in corpus:
        if text.strip():
            ids = tuple(tokenizer(text, add_special_tokens=True)["input_ids"])
            entry_id = service.store.find_by_hash(namespace, token_hash(ids))
            if entry_id is not None:
                found.setdefault(entry_id, ids)
    by_length: dict[int, list[int]] = {}
    for entry_id, ids in found.items():
        by_length.setdefault(len(ids), []).append(entry_id)
    result_ids, result_sources = {}, {}
    bar = tqdm(total=len(found), desc="entry sources", unit="entry", disable=not progress)
    for length, entry_ids in sorted(by_length.items()):
        parts = []
        for start in range(0, len(entry_ids), batch_size):
            block_ids = entry_ids[start : start + batch_size]
            batch = batch_from_ids([found[i] for i in block_ids], tokenizer.pad_token_id)
            parts.append(torch.stack(adapter.feature_source(batch)))  # (b, L, hidden)
            bar.update(len(block_ids))
        result_ids[length] = np.array(entry_ids, dtype=np.int64)
        result_sources[length] = torch.cat(parts)
    bar.close()
    stored = sum(1 for _ in service.store.entries(namespace))
    return EntrySources(ids=result_ids, sources=result_sources, missing=stored - len(found))


def key_picks(sources: EntrySources, queries: Sequence[EvalQuery], *, crop: bool) -> dict[str, list[Pick]]:
    """Each simple key's nearest entry per query (see the module docstring).

    Args:
        sources: the stored entries' feature sources.
        queries: the captured queries.
        crop: also consider longer entries, on their first L positions (causal models).

    Returns:
        Key name (``SIMPLE_KEYS``) -> one pick per query.
    """
    distances: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
        "mean_pooled": lambda q, c: (c.mean(dim=1) - q.mean(dim=0)).norm(dim=1),  # (n,)
        "positionwise": lambda q, c: (c - q).flatten(1).norm(dim=1),  # (n,)
    }
    picks: dict[str, list[Pick]] = {name: [] for name in SIMPLE_KEYS}
    for query in queries:
        length = query.length
        allowed = [s for s in sources.ids if s == length or (crop and s > length)]
        for name, distance in distances.items():
            best = _NONE
            for stored_length in allowed:
                d = distance(query.source, sources.sources[stored_length][:, :length])
                i = int(torch.argmin(d))
                if float(d[i]) < best.distance:
                    best = Pick(int(sources.ids[stored_length][i]), float(d[i]), stored_length)
            picks[name].append(best)
    return picks
