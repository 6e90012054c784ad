"""Written-back rows' features, derived by the daemon from their tokens with the namespace's embedding layer.

A node sends a row's token ids, outputs and maps; where the row lands in the map
index is its feature, and a sender choosing it could file its row next to another
user's queries (a decoy replayed for them). So the daemon never stores a sent
feature: it computes ``projector(feature_source(tokens))`` itself, with the
embedding layer stored in the namespace's projector blob
(``attnstore.projector.embedding_layer``). A namespace whose blob has no layer (a
projector installed without one) stores such rows without a feature: they wait
for ``admin train-projector``, which features every entry with maps.

torch is imported on the first derivation only: a daemon whose namespaces carry
no embedding layer starts and runs without it (~2 s and ~200 MB less).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from attnstore.projector.blob import has_embedding_layer
from attnstore.protocol.records import NamespaceInfo

if TYPE_CHECKING:
    from attnstore.projector.embedding_layer import FeatureDeriver

log = logging.getLogger(__name__)


class DerivedFeatures:
    """Each namespace's feature deriver, built once per stored projector (version and checksum)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._derivers: dict[str, tuple[tuple[float, int, int | None], FeatureDeriver | None]] = {}

    def features(self, info: NamespaceInfo, token_rows: Sequence[np.ndarray]) -> np.ndarray | None:
        """``(n, feature_dim)`` float32: each row's feature from the namespace's projector and embedding layer;
        None when the namespace has no projector, or one stored without its embedding layer.

        Raises:
            MapShapeError: a row the layer cannot embed.
            FormatVersionError: the stored layer is malformed.
        """
        deriver = self._deriver(info)
        return None if deriver is None else deriver.features(token_rows)

    def _deriver(self, info: NamespaceInfo) -> FeatureDeriver | None:
        if info.projector is None:
            return None
        stamp = (info.created, info.projector_version, info.projector_crc32c)
        with self._lock:
            cached = self._derivers.get(info.name)
            if cached is not None and cached[0] == stamp:
                return cached[1]
            deriver = None
            if has_embedding_layer(info.projector):
                from attnstore.projector.embedding_layer import FeatureDeriver  # torch: see the docstring

                deriver = FeatureDeriver.from_projector_blob(info.projector)
            else:
                log.info("event=no_embedding_layer namespace=%s version=%d: written-back rows are stored without"
                         " a feature until train-projector features them", info.name, info.projector_version)
            self._derivers[info.name] = (stamp, deriver)
            return deriver
