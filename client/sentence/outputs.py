"""What ``encode()`` hands back: the options sentence-transformers' ``encode`` takes, checked and applied.

So that code written for ``SentenceTransformer.encode`` (and sentence-transformers'
evaluators) runs unchanged with an ``AttnCache`` in place of the model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from attnstore.errors import ConfigError

OutputValue = Literal["sentence_embedding", "token_embeddings"]
Precision = Literal["float32", "int8", "uint8", "binary", "ubinary"]
PRECISIONS: tuple[str, ...] = ("float32", "int8", "uint8", "binary", "ubinary")
OUTPUT_VALUES: tuple[str | None, ...] = ("sentence_embedding", "token_embeddings", None)
# Every keyword encode() takes; anything else is refused with this list.
ENCODE_KEYWORDS: tuple[str, ...] = (
    "inputs", "sentences", "prompt_name", "prompt", "batch_size", "show_progress_bar", "output_value", "precision",
    "convert_to_numpy", "convert_to_tensor", "device", "normalize_embeddings", "truncate_dim", "pool", "chunk_size",
)


@dataclass(frozen=True, slots=True)
class OutputOptions:
    """How one encode() call's results are shaped (sentence-transformers' meanings)."""

    output_value: OutputValue | None = "sentence_embedding"
    precision: Precision | None = "float32"  # None: float32 (sentence-transformers' evaluators pass None)
    convert_to_numpy: bool = True
    convert_to_tensor: bool = False
    normalize_embeddings: bool = False
    truncate_dim: int | None = None

    @property
    def quantized(self) -> Precision:
        """The precision results are given in (float32 for None)."""
        return self.precision or "float32"

    def __post_init__(self) -> None:
        if self.output_value not in OUTPUT_VALUES:
            raise ConfigError(f"encode(): output_value must be one of {list(OUTPUT_VALUES)}, got {self.output_value!r}")
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ConfigError(f"encode(): precision must be one of {list(PRECISIONS)}, got {self.precision!r}")
        if self.truncate_dim is not None and (isinstance(self.truncate_dim, bool) or self.truncate_dim < 1):
            raise ConfigError(f"encode(): truncate_dim must be a positive int or None, got {self.truncate_dim!r}")


def check_keywords(extra: Mapping[str, Any]) -> None:
    """Refuse keywords encode() does not take, naming the valid ones (``pool``/``chunk_size``: only None).

    Raises:
        NotImplementedError: a multi-process pool (one AttnCache per process does that).
        ConfigError: an unknown keyword.
    """
    extra = dict(extra)
    if extra.pop("pool", None) is not None:
        raise NotImplementedError(
            "encode(pool=...) is not offered by a cache: run one AttnCache per process (each loads its model; all"
            " share the store)"
        )
    extra.pop("chunk_size", None)  # sentence-transformers' rows per pool process (its keyword): no pool here
    if extra:
        raise ConfigError(
            f"encode() got unexpected keyword arguments {sorted(extra)}; it takes {list(ENCODE_KEYWORDS)}"
        )


def shape_outputs(
    sentences: torch.Tensor | None, tokens: Sequence[torch.Tensor] | None, options: OutputOptions, *, single: bool
) -> (np.ndarray | torch.Tensor | list[torch.Tensor] | list[np.ndarray] | list[dict[str, torch.Tensor]]
      | dict[str, torch.Tensor]):
    """The results as sentence-transformers returns them.

    Args:
        sentences: ``(n, dim)`` sentence embeddings, input order (None: only token embeddings were asked for).
        tokens: per input, its ``(L, hidden)`` token embeddings (None: not asked for).
        options: the call's options.
        single: the call was given one input (its result comes back without the list).
    """
    quantized = options.quantized != "float32"
    if options.output_value == "token_embeddings":
        assert tokens is not None  # what was asked for
        rows: list[torch.Tensor] | list[np.ndarray] = list(tokens)
        if quantized:  # as sentence-transformers does: one set of int8 ranges over every row's tokens
            rows = _quantize([row.cpu().float().numpy() for row in tokens], options.quantized)
        return rows[0] if single else rows
    assert sentences is not None  # every other output value has them
    embeddings = sentences
    if options.truncate_dim is not None:
        embeddings = embeddings[:, : options.truncate_dim]
    if options.output_value is None:
        # sentence-transformers hands back the model's features as they are (never normalised), and cannot
        # quantise them: refused here with the reason instead of its TypeError.
        if quantized:
            raise ConfigError(f"encode(): precision {options.precision!r} needs output_value 'sentence_embedding' or"
                              " 'token_embeddings'; output_value=None gives the float features")
        assert tokens is not None  # both were asked for
        dicts = [
            {"token_embeddings": token, "sentence_embedding": embedding}
            for token, embedding in zip(tokens, embeddings, strict=True)
        ]
        return dicts[0] if single else dicts
    if options.normalize_embeddings:
        embeddings = torch.nn.functional.normalize(embeddings, p=2, dim=1)
    result: np.ndarray | torch.Tensor | list[torch.Tensor]
    if quantized:
        quantized_rows = np.asarray(_quantize(embeddings.cpu().float().numpy(), options.quantized))
        result = torch.from_numpy(quantized_rows) if options.convert_to_tensor else quantized_rows
    elif options.convert_to_tensor:
        result = embeddings
    elif options.convert_to_numpy:
        result = embeddings.cpu().float().numpy()
    else:
        result = list(embeddings)
    return result[0] if single else result


def _quantize(embeddings: Any, precision: Precision) -> Any:
    """sentence-transformers' ``quantize_embeddings`` (imported when asked for: it pulls in its util package)."""
    from sentence_transformers.util.quantization import quantize_embeddings

    return quantize_embeddings(embeddings, precision=precision)
