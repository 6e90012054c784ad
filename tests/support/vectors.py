"""Comparing a call's vectors with a reference's, row by row."""

from __future__ import annotations

import numpy as np


def row_cosines(ours: np.ndarray, theirs: np.ndarray, *, zero_tolerance: float = 0.0) -> np.ndarray:
    """Cosine of each row of ``ours`` to the same row of ``theirs``, in float64. Where either row is zero the
    cosine is undefined: 1 when the two rows differ by at most ``zero_tolerance`` in every value, else 0."""
    ours, theirs = ours.astype(np.float64), theirs.astype(np.float64)
    norms = np.linalg.norm(ours, axis=-1) * np.linalg.norm(theirs, axis=-1)
    dots = (ours * theirs).sum(axis=-1)
    same = np.abs(ours - theirs).max(axis=-1) <= zero_tolerance
    return np.where(norms == 0, np.where(same, 1.0, 0.0), dots / np.where(norms == 0, 1.0, norms))
