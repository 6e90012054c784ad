"""Synthetic entries for the map store tests (softmax maps from random logits)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import safetensors.numpy

from attnstore.protocol.records import NamespaceLayout, NewEntry


def small_layout(codec: str = "fp16", causal: bool = True) -> NamespaceLayout:
    """A tiny layout: 3 layers, 2 heads, hidden 8, feature 16."""
    return NamespaceLayout(layers=3, heads=2, causal=causal, hidden=8, feature_dim=16, codec=codec)


def softmax_maps(
    layers: int, heads: int, length: int, *, seed: int, causal: bool = True, logit_std: float = 3.0
) -> np.ndarray:
    """Attention maps ``(layers, heads, L, L)`` fp32: softmax of random normal logits."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(scale=logit_std, size=(layers, heads, length, length))
    if causal:
        logits[..., ~np.tri(length, dtype=bool)] = -np.inf
    logits -= logits.max(axis=-1, keepdims=True)
    weights = np.exp(logits)  # (layers, heads, L, L)
    return (weights / weights.sum(axis=-1, keepdims=True)).astype(np.float32)


def token_hash(*parts: object) -> bytes:
    """A 32-byte token hash derived from ``parts``."""
    return hashlib.sha256(repr(parts).encode()).digest()


def make_entry(
    layout: NamespaceLayout,
    length: int,
    seed: int,
    *,
    outputs: bool = True,
    feature: bool = True,
    tokens: bool = True,
    dtype: type = np.float32,
) -> NewEntry:
    """A valid entry for ``layout``; everything derives from ``seed``."""
    rng = np.random.default_rng(seed + 1_000_000)
    maps = softmax_maps(layout.layers, layout.heads, length, seed=seed, causal=layout.causal).astype(dtype)
    return NewEntry(
        maps=maps,
        token_hash=token_hash(seed, length),
        outputs=rng.normal(size=(length, layout.hidden)).astype(dtype) if outputs else None,
        feature=rng.normal(size=layout.feature_dim).astype(np.float32) if feature else None,
        token_ids=rng.integers(0, 50_000, size=length) if tokens else None,
    )


def projector_blob(tag: str = "p") -> bytes:
    """A small valid safetensors blob standing in for a projector (``tag`` goes into its metadata)."""
    return safetensors.numpy.save({"w": np.zeros(2, np.float32)}, metadata={"tag": tag})


def fill_disk(directory: Path, *, leave: int = 0) -> Path:
    """Fill ``directory``'s filesystem until at most ``leave`` bytes are free; returns the filler file."""
    filler = directory / "filler"
    with filler.open("wb") as f:
        block = b"\xff" * (1 << 20)
        try:
            while True:
                st = os.statvfs(directory)
                free = st.f_bavail * st.f_frsize
                if free <= leave:
                    break
                f.write(block[: max(1, min(len(block), free - leave))])
                f.flush()
        except OSError:
            pass  # ENOSPC: as full as it gets
    return filler
