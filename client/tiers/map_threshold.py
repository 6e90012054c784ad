"""The threshold on the predicted map distance that decides a map hit when no fidelity gate does."""

from __future__ import annotations

import logging

from attnstore_client.projector import Projector

log = logging.getLogger(__name__)

# Threshold on the predicted map distance for namespaces whose projector carries no
# calibration (built before calibration existed, or with --no-calibration). Measured on
# the demo's store (all-MiniLM-L6-v2, 3,000 STS-B train sentences, 8-epoch projector),
# 737 held-out dev sentences that are not exact duplicates: at 0.008, 11 map hits, 8 of
# them at cosine >= 0.99 to the plain model, the worst 0.977; at 0.01, 35 hits, 21
# faithful, the worst 0.885. A calibrated namespace recommends its own threshold.
DEFAULT_MAX_DISTANCE = 0.008


def map_threshold(max_distance: float | None, projector: Projector | None) -> float:
    """The map-hit threshold in use: the caller's, else the namespace's calibrated one, else the default."""
    if max_distance is not None:
        return float(max_distance)
    calibration = None if projector is None else projector.calibration
    if calibration is None:
        return DEFAULT_MAX_DISTANCE
    if calibration.max_distance is None:
        log.info("the namespace's calibration found no threshold with precise enough map hits: exact hits only")
        return 0.0
    return calibration.max_distance
