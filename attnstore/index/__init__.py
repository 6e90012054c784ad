"""Vector indexes: one per (namespace, token length), searched under the length rules.

``VectorIndex`` is the interface; ``ExactIndex`` the numpy reference backend;
``FaissIndex`` the serving backend (flat while small, HNSW past a size);
``BucketedIndex`` a namespace's buckets. faiss is imported only here and in tools,
never by the client.
"""

from __future__ import annotations

from attnstore.index.base import VectorIndex
from attnstore.index.bucketed import BucketedIndex, Candidate, Match
from attnstore.index.exact import ExactIndex
from attnstore.index.faiss_index import FaissIndex, FaissIndexConfig

__all__ = ["BucketedIndex", "Candidate", "ExactIndex", "FaissIndex", "FaissIndexConfig", "Match", "VectorIndex"]
