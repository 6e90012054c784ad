"""The feature projector: a row's input embedding -> a d = 128 vector for the map index.

Its input is the row's *feature source*, the (L, hidden) output of the model's
embedding stage (token + position embeddings and the first norm). A fixed-size
pooling keeps the positional structure: the sequence is averaged into
``segments`` position bins (so "which token sits where" survives: a one-token
edit of a template moves one bin a little, a different sentence structure moves
many bins a lot), concatenated with the whole-sequence mean and two length
features. A two-layer MLP (paper: 2 layers, d = 128) maps that to the feature
vector. The L2 distance between two vectors predicts the map term of the
training target (see ``attnstore_tools.build.training``); the length term is
exact and added by the index.

A calibrated projector (``attnstore build`` calibrates by default, see
``attnstore_tools.build.calibration``) also scales its output by
``(L / reference_length) ** -length_exponent``: whether a replay keeps the output
faithful depends on the distance *and* on the length (one differing token moves a
7-token log line far more than a 40-token one), so the threshold that keeps hits
faithful grows with the length, and scaling the vectors turns that length-aware
threshold into one number, the calibration's ``max_distance``.

The calibration also fits the namespace's fidelity gate (``attnstore.projector.gate``),
which decides hits from the distance *and* the tokens that differ; the service
applies it when a client asks (the default when the namespace has one).

The weights travel as safetensors bytes (the config, the calibration and the
gate in its metadata as JSON), so every client of a namespace uses the same projector.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import safetensors.torch
import torch
import torch.nn.functional as F
from torch import nn

from attnstore.errors import ConfigError, FeatureSourceError, FormatVersionError, WireFormatError
from attnstore.projector.blob import (
    EMBEDDING_LAYER_PREFIX,
    GATE_METADATA_KEY,
    gate_from_projector,
    int8_plan_from_projector,
    projector_metadata,
)
from attnstore.projector.gate import FidelityGate
from attnstore.projector.int8_plan import INT8_METADATA_KEY, Int8Plan

FORMAT = "attnstore.projector/1"
_METADATA_KEY = "attnstore.projector"
_LENGTH_FEATURES = 2  # L / max_length and log(1 + L) / log(1 + max_length)


@dataclass(frozen=True, slots=True)
class ProjectorConfig:
    """Shape of a projector; stored with its weights."""

    hidden: int  # width of the feature source: the model's hidden size
    # Position bins of the pooling: sentences and log lines are 10-60 tokens, so 16
    # bins keep about one to four tokens each, enough to place an edit.
    segments: int = 16
    # First-layer units per slot (shared across slots): 64 x 17 slots = 1088 hidden
    # units; the weights stay well under 1 MB (they ship with every namespace).
    width: int = 64
    dim: int = 128  # output size: the paper's d, and the index dimension
    dropout: float = 0.1  # active only while training; regularises small corpora
    # Lengths are scaled by this in the length features (the models' context limit).
    max_length: int = 512

    def __post_init__(self) -> None:
        for name in ("hidden", "segments", "width", "dim", "max_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"ProjectorConfig: {name} must be an int >= 1, got {value!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"ProjectorConfig: dropout must be in [0, 1), got {self.dropout!r}")

    @property
    def slots(self) -> int:
        """Pooled slots: one per position bin, plus the whole-sequence mean."""
        return self.segments + 1

    @property
    def features(self) -> int:
        """Width of the pooled input: every slot's embedding, then the length features."""
        return self.slots * self.hidden + _LENGTH_FEATURES


@dataclass(frozen=True, slots=True)
class Calibration:
    """How a projector's distances map to replay fidelity, measured when the namespace was built."""

    length_exponent: float  # outputs are scaled by (L / reference_length) ** -length_exponent
    reference_length: int  # the length whose distances the scaling leaves unchanged
    max_distance: float | None  # recommended threshold: its build-time hits reached ``precision``; None if none did
    fidelity: float  # cosine of the pooled output to the full model's that counts as faithful
    precision: float  # share of faithful hits the threshold was chosen for
    pairs: int  # pseudo-queries it was measured on

    def __post_init__(self) -> None:
        if not 0.0 <= self.length_exponent <= 4.0:
            raise ConfigError(f"Calibration: length_exponent must be in [0, 4], got {self.length_exponent!r}")
        if self.reference_length < 1:
            raise ConfigError(f"Calibration: reference_length must be >= 1, got {self.reference_length!r}")


class Projector(nn.Module):
    """Fixed-size positional pooling, input standardisation, then a two-layer MLP.

    The first layer is shared across the pooled slots (each position bin and the
    mean): one ``hidden -> width`` map applied per slot, like a 1x1 convolution.
    Sharing makes it learn one "what matters in a token embedding" map from every
    position's data instead of one per bin, which is what lets a corpus of a few
    thousand inputs train it (a dense first layer over all bins at once fitted
    held-out pairs markedly worse in our measurements). The second layer mixes
    the slots (and the length features) into the output.
    """

    # Buffers registered in __init__ (saved with the weights, never trained).
    feature_mean: torch.Tensor  # (features,)
    feature_scale: torch.Tensor  # (features,)

    def __init__(self, config: ProjectorConfig) -> None:
        """Create a projector with random weights and identity standardisation."""
        super().__init__()
        self.config = config
        # Per-feature standardisation, fitted on the training corpus: embedding
        # dimensions differ several-fold in spread, and positions differ too.
        self.register_buffer("feature_mean", torch.zeros(config.features))
        self.register_buffer("feature_scale", torch.ones(config.features))
        self.slot = nn.Linear(config.hidden, config.width)
        self.dropout = nn.Dropout(config.dropout)
        self.out = nn.Linear(config.slots * config.width + _LENGTH_FEATURES, config.dim)
        self.calibration: Calibration | None = None
        self.gate: FidelityGate | None = None
        self.int8: Int8Plan | None = None  # the layers a client may run in int8

    def pool(self, sources: Sequence[torch.Tensor]) -> torch.Tensor:
        """Pool variable-length feature sources to fixed-size rows.

        Args:
            sources: per row, an (L, hidden) tensor, L >= 1, any float dtype.
        Returns:
            (n, config.features) float32, in input order.
        Raises:
            FeatureSourceError: a source of the wrong shape, or holding NaN/Inf.
        """
        hidden, segments = self.config.hidden, self.config.segments
        by_length: dict[int, list[int]] = {}
        for i, source in enumerate(sources):
            tensor = isinstance(source, torch.Tensor)
            if not tensor or source.ndim != 2 or source.shape[1] != hidden or source.shape[0] < 1:
                shape = tuple(source.shape) if tensor else type(source).__name__
                raise FeatureSourceError(
                    f"Projector.pool(): source {i} must be an (L, {hidden}) tensor with L >= 1, got {shape}"
                )
            by_length.setdefault(int(source.shape[0]), []).append(i)
        out = torch.empty(len(sources), self.config.features)
        for length, rows in by_length.items():
            x = torch.stack([sources[i].detach().to("cpu", torch.float32) for i in rows])  # (g, L, hidden)
            if not torch.isfinite(x).all():
                raise FeatureSourceError(f"Projector.pool(): a source of length {length} holds NaN or Inf")
            # L < segments repeats tokens across bins, so short inputs still fill every bin.
            bins = F.adaptive_avg_pool1d(x.transpose(1, 2), segments).transpose(1, 2)  # (g, segments, hidden)
            mean = x.mean(dim=1)  # (g, hidden)
            scale = self.config.max_length
            lengths = torch.tensor([length / scale, math.log1p(length) / math.log1p(scale)]).expand(len(rows), -1)
            out[rows] = torch.cat([bins.flatten(1), mean, lengths], dim=1)  # (g, features)
        return out

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """Map pooled features (n, features) to feature vectors (n, dim), length-scaled if calibrated."""
        z = (features - self.feature_mean) / self.feature_scale  # (n, features)
        slots = z[:, :-_LENGTH_FEATURES].unflatten(1, (self.config.slots, self.config.hidden))  # (n, slots, hidden)
        h = F.gelu(self.slot(slots)).flatten(1)  # (n, slots * width)
        out = self.out(self.dropout(torch.cat([h, z[:, -_LENGTH_FEATURES:]], dim=1)))  # (n, dim)
        if self.calibration is None or self.calibration.length_exponent == 0:
            return out
        lengths = features[:, -_LENGTH_FEATURES] * self.config.max_length  # (n,) the first length feature is L / max
        scale = (lengths / self.calibration.reference_length) ** -self.calibration.length_exponent  # (n,)
        return out * scale[:, None]

    @torch.no_grad()
    def project(self, sources: Sequence[torch.Tensor]) -> np.ndarray:
        """Feature vectors of rows, for the index.

        Args:
            sources: per row, its (L, hidden) feature source.
        Returns:
            (n, dim) float32 numpy array, in input order.
        Raises:
            FeatureSourceError: a source of the wrong shape, or holding NaN/Inf.
        """
        if len(sources) == 0:
            return np.empty((0, self.config.dim), dtype=np.float32)
        was_training = self.training
        self.eval()
        try:
            vectors = self(self.pool(sources))  # (n, dim)
        finally:
            self.train(was_training)
        return vectors.cpu().numpy().astype(np.float32, copy=False)

    @torch.no_grad()
    def scale_output(self, factor: float) -> None:
        """Multiply every output by ``factor`` (training starts distances at the target's scale)."""
        self.out.weight.mul_(factor)
        self.out.bias.mul_(factor)

    def set_standardisation(self, mean: torch.Tensor, scale: torch.Tensor) -> None:
        """Install per-feature mean and scale (both (features,), scale > 0)."""
        self.feature_mean.copy_(mean)
        self.feature_scale.copy_(scale)

    def to_safetensors_bytes(self) -> bytes:
        """Weights and standardisation as safetensors bytes; config, calibration, gate and int8 plan as JSON
        metadata."""
        tensors = {name: tensor.detach().contiguous().clone() for name, tensor in self.state_dict().items()}
        record = {"format": FORMAT, "config": dataclasses.asdict(self.config)}
        if self.calibration is not None:
            record["calibration"] = dataclasses.asdict(self.calibration)
        metadata = {_METADATA_KEY: json.dumps(record)}
        if self.gate is not None:
            metadata[GATE_METADATA_KEY] = self.gate.to_json()
        if self.int8 is not None:
            metadata[INT8_METADATA_KEY] = self.int8.to_json()
        return safetensors.torch.save(tensors, metadata=metadata)

    @classmethod
    def from_safetensors_bytes(cls, blob: bytes) -> Projector:
        """Rebuild a projector (in eval mode) from ``to_safetensors_bytes`` output.

        Raises:
            FormatVersionError: not projector safetensors bytes, or an unknown format.
        """
        metadata = _metadata(blob)
        if _METADATA_KEY not in metadata:
            raise FormatVersionError(
                "Projector.from_safetensors_bytes(): no projector metadata in the safetensors header"
            )
        record = json.loads(metadata[_METADATA_KEY])
        if record.get("format") != FORMAT:
            raise FormatVersionError(
                f"Projector.from_safetensors_bytes(): format {record.get('format')!r}, this code reads {FORMAT!r}"
            )
        projector = cls(ProjectorConfig(**record["config"]))
        # A namespace's stored blob may also hold its embedding layer (what a daemon derives features with).
        tensors = {name: t for name, t in safetensors.torch.load(bytes(blob)).items()
                   if not name.startswith(EMBEDDING_LAYER_PREFIX)}
        projector.load_state_dict(tensors, strict=True)
        if record.get("calibration") is not None:
            try:
                projector.calibration = Calibration(**record["calibration"])
            except (TypeError, ConfigError) as exc:
                raise FormatVersionError(f"Projector.from_safetensors_bytes(): malformed calibration: {exc}") from None
        projector.gate = gate_from_projector(blob)
        projector.int8 = int8_plan_from_projector(blob)
        return projector.eval()


def _metadata(blob: bytes) -> dict[str, str]:
    try:
        return projector_metadata(blob)
    except WireFormatError as exc:
        raise FormatVersionError(f"Projector.from_safetensors_bytes(): {exc}") from None
