"""The feature projector, as the client and the tools use it, and the embedding layer that goes with it.

One implementation serves clients and daemons (a daemon derives written-back
rows' features with it), so the projector lives in
``attnstore.projector.network``; this module is its name on the
client's side. A model's embedding stage is its adapter's
(``Adapter.embedding_layer``).
"""

from __future__ import annotations

from attnstore.projector.embedding_layer import EmbeddingLayer
from attnstore.projector.network import FORMAT, Calibration, Projector, ProjectorConfig

__all__ = ["FORMAT", "Calibration", "EmbeddingLayer", "Projector", "ProjectorConfig"]
