"""The rest of ``SentenceTransformer``'s public surface on an ``AttnCache``, so code written for it runs unchanged.

``encode`` itself is ``AttnCache.encode``; this mixin adds what code around it
calls: dimensions, prompts, similarity, the retrieval API of sentence-transformers
>= 5 (``encode_query``/``encode_document``), ``tokenizer``/``tokenize``,
``max_seq_length``, ``truncate_sentence_embeddings``, ``eval()``. What makes no
sense for a cache (training, saving, adapters, multi-process pools) raises a
``NotImplementedError`` that names what to do instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, Literal, NoReturn, overload

import numpy as np
import torch

from attnstore.errors import UnsupportedModelError
from attnstore_client.call.sources import Prompt
from attnstore_client.sentence.outputs import OutputValue, Precision

if TYPE_CHECKING:
    from attnstore_client.models import LoadedModel
    from attnstore_client.sentence.heads import SentenceHead

# What ``encode`` returns, as ``SentenceTransformer.encode`` does; the overloads say which for which flags.
Embeddings = (
    np.ndarray | torch.Tensor | list[torch.Tensor] | list[np.ndarray] | dict[str, torch.Tensor]
    | list[dict[str, torch.Tensor]]
)

_POOL = "run one AttnCache per process (each loads its model; all share the store)"
_TRAIN = "train the SentenceTransformer itself, then build a namespace for the trained model (its maps differ)"
_SAVE = "save the SentenceTransformer you loaded: cache.loaded.sentence_transformer"


def _not_offered(name: str, instead: str) -> Callable[..., NoReturn]:
    """A method a cache does not offer: it raises, naming what to do instead."""

    def method(self: object, *args: object, **kwargs: object) -> NoReturn:
        raise NotImplementedError(f"AttnCache.{name}() is not offered by a cache: {instead}")

    method.__name__ = name
    return method


class SentenceTransformerAPI:
    """``SentenceTransformer``'s public methods beyond ``encode``, for ``AttnCache``."""

    head: SentenceHead
    loaded: LoadedModel
    device: torch.device
    encode: Callable[..., Embeddings]  # AttnCache.encode (typed there, by overloads)

    # ---- what the model is --------------------------------------------------------

    def get_sentence_embedding_dimension(self) -> int:
        """The width of the sentence embeddings (sentence-transformers' older name)."""
        return self.head.dimension

    def get_embedding_dimension(self) -> int:
        """The width of the sentence embeddings."""
        return self.head.dimension

    @property
    def max_seq_length(self) -> int:
        """Inputs are truncated to this many tokens; settable, as on a SentenceTransformer."""
        return self.head.max_length

    @max_seq_length.setter
    def max_seq_length(self, value: int) -> None:
        self.head.set_max_length(value)

    def get_max_seq_length(self) -> int:
        """Inputs are truncated to this many tokens."""
        return self.head.max_length

    @property
    def prompts(self) -> dict[str, str]:
        """The model's named prompts (for ``prompt_name``)."""
        return self.head.prompts

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer."""
        return self.loaded.tokenizer

    def tokenize(self, texts: list[str]) -> dict[str, torch.Tensor]:
        """The model's features of ``texts`` (``input_ids``, ``attention_mask``...), as sentence-transformers
        tokenizes them."""
        pipeline = self.loaded.sentence_transformer
        if pipeline is not None:
            return dict(pipeline.tokenize(texts))
        return dict(self.loaded.tokenizer(texts, padding=True, truncation=True, max_length=self.head.max_length,
                                          return_tensors="pt"))

    @property
    def similarity_fn_name(self) -> str:
        """How the model's embeddings are compared, as sentence-transformers names it (``"cosine"``...)."""
        return self.head.similarity_fn_name

    @property
    def model_card_data(self) -> Any:
        """The sentence-transformers model card data (its evaluators record metrics there).

        Raises:
            UnsupportedModelError: the model has no sentence-transformers configuration.
        """
        pipeline = self.loaded.sentence_transformer
        if pipeline is None:
            raise UnsupportedModelError(f"{self.loaded.name!r} has no sentence-transformers configuration")
        return pipeline.model_card_data

    def eval(self) -> SentenceTransformerAPI:
        """A cache's model is always in eval mode; returns self."""
        return self

    # ---- similarity ---------------------------------------------------------------

    def similarity(self, embeddings1: Any, embeddings2: Any) -> torch.Tensor:
        """Pairwise similarities ``(n, m)`` under ``similarity_fn_name``, as sentence-transformers computes them."""
        from sentence_transformers.util import cos_sim, dot_score, euclidean_sim, manhattan_sim

        functions = {"cosine": cos_sim, "dot": dot_score, "euclidean": euclidean_sim, "manhattan": manhattan_sim}
        return functions[self.similarity_fn_name](embeddings1, embeddings2)

    def similarity_pairwise(self, embeddings1: Any, embeddings2: Any) -> torch.Tensor:
        """Row ``i``'s similarity to row ``i``, ``(n,)``, under ``similarity_fn_name``."""
        from sentence_transformers.util import (
            pairwise_cos_sim,
            pairwise_dot_score,
            pairwise_euclidean_sim,
            pairwise_manhattan_sim,
        )

        functions = {"cosine": pairwise_cos_sim, "dot": pairwise_dot_score, "euclidean": pairwise_euclidean_sim,
                     "manhattan": pairwise_manhattan_sim}
        return functions[self.similarity_fn_name](embeddings1, embeddings2)

    # ---- retrieval (sentence-transformers >= 5) -------------------------------------

    # The return types follow the flags as for ``encode`` (sentence-transformers types these two alike).
    @overload
    def encode_query(
        self,
        inputs: str | Sequence[Prompt],
        prompt_name: str | None = ...,
        prompt: str | None = ...,
        *,
        batch_size: int = ...,
        show_progress_bar: bool | None = ...,
        output_value: Literal["sentence_embedding"] = ...,
        precision: Precision | None = ...,
        convert_to_numpy: Literal[True] = ...,
        convert_to_tensor: Literal[False] = ...,
        device: str | torch.device | None = ...,
        normalize_embeddings: bool = ...,
        truncate_dim: int | None = ...,
        pool: None = ...,
        chunk_size: int | None = ...,
    ) -> np.ndarray: ...

    @overload
    def encode_query(
        self,
        inputs: str | Sequence[Prompt],
        prompt_name: str | None = ...,
        prompt: str | None = ...,
        *,
        batch_size: int = ...,
        show_progress_bar: bool | None = ...,
        output_value: Literal["sentence_embedding"] = ...,
        precision: Precision | None = ...,
        convert_to_numpy: bool = ...,
        convert_to_tensor: Literal[True],
        device: str | torch.device | None = ...,
        normalize_embeddings: bool = ...,
        truncate_dim: int | None = ...,
        pool: None = ...,
        chunk_size: int | None = ...,
    ) -> torch.Tensor: ...

    @overload
    def encode_query(  # type: ignore[overload-overlap]  # a str is a Sequence[str]: it matches this first
        self,
        inputs: str,
        prompt_name: str | None = ...,
        prompt: str | None = ...,
        *,
        batch_size: int = ...,
        show_progress_bar: bool | None = ...,
        output_value: Literal["sentence_embedding"] = ...,
        precision: Precision | None = ...,
        convert_to_numpy: Literal[False],
        convert_to_tensor: bool = ...,
        device: str | torch.device | None = ...,
        normalize_embeddings: bool = ...,
        truncate_dim: int | None = ...,
        pool: None = ...,
        chunk_size: int | None = ...,
    ) -> torch.Tensor: ...

    @overload
    def encode_query(
        self,
        inputs: Sequence[Prompt],
        prompt_name: str | None = ...,
        prompt: str | None = ...,
        *,
        batch_size: int = ...,
        show_progress_bar: bool | None = ...,
        output_value: Literal["sentence_embedding"] = ...,
        precision: Precision | None = ...,
        convert_to_numpy: Literal[False],
        convert_to_tensor: Literal[False] = ...,
        device: str | torch.device | None = ...,
        normalize_embeddings: bool = ...,
        truncate_dim: int | None = ...,
        pool: None = ...,
        chunk_size: int | None = ...,
    ) -> list[torch.Tensor]: ...

    # Catch-all, as sentence-transformers has: union-typed flags, other output values.
    @overload
    def encode_query(
        self,
        inputs: str | Sequence[Prompt] | None = ...,
        prompt_name: str | None = ...,
        prompt: str | None = ...,
        *,
        batch_size: int = ...,
        show_progress_bar: bool | None = ...,
        output_value: OutputValue | None = ...,
        precision: Precision | None = ...,
        convert_to_numpy: bool = ...,
        convert_to_tensor: bool = ...,
        device: str | torch.device | None = ...,
        normalize_embeddings: bool = ...,
        truncate_dim: int | None = ...,
        pool: None = ...,
        chunk_size: int | None = ...,
    ) -> Embeddings: ...

    def encode_query(
        self, inputs: str | Sequence[Prompt] | None = None, prompt_name: str | None = None, prompt: str | None = None,
        **kwargs: Any,
    ) -> Embeddings:
        """``encode`` for search queries: the model's ``"query"`` prompt unless another is given."""
        if prompt_name is None and prompt is None and "query" in self.prompts:
            prompt_name = "query"
        return self.encode(inputs, prompt_name=prompt_name, prompt=prompt, **kwargs)

    @overload
    def encode_document(
        self,
        inputs: str | Sequence[Prompt],
        prompt_name: str | None = ...,
        prompt: str | None = ...,
        *,
        batch_size: int = ...,
        show_progress_bar: bool | None = ...,
        output_value: Literal["sentence_embedding"] = ...,
        precision: Precision | None = ...,
        convert_to_numpy: Literal[True] = ...,
        convert_to_tensor: Literal[False] = ...,
        device: str | torch.device | None = ...,
        normalize_embeddings: bool = ...,
        truncate_dim: int | None = ...,
        pool: None = ...,
        chunk_size: int | None = ...,
    ) -> np.ndarray: ...

    @overload
    def encode_document(
        self,
        inputs: str | Sequence[Prompt],
        prompt_name: str | None = ...,
        prompt: str | None = ...,
        *,
        batch_size: int = ...,
        show_progress_bar: bool | None = ...,
        output_value: Literal["sentence_embedding"] = ...,
        precision: Precision | None = ...,
        convert_to_numpy: bool = ...,
        convert_to_tensor: Literal[True],
        device: str | torch.device | None = ...,
        normalize_embeddings: bool = ...,
        truncate_dim: int | None = ...,
        pool: None = ...,
        chunk_size: int | None = ...,
    ) -> torch.Tensor: ...

    @overload
    def encode_document(  # type: ignore[overload-overlap]  # a str is a Sequence[str]: it matches this first
        self,
        inputs: str,
        prompt_name: str | None = ...,
        prompt: str | None = ...,
        *,
        batch_size: int = ...,
        show_progress_bar: bool | None = ...,
        output_value: Literal["sentence_embedding"] = ...,
        precision: Precision | None = ...,
        convert_to_numpy: Literal[False],
        convert_to_tensor: bool = ...,
        device: str | torch.device | None = ...,
        normalize_embeddings: bool = ...,
        truncate_dim: int | None = ...,
        pool: None = ...,
        chunk_size: int | None = ...,
    ) -> torch.Tensor: ...

    @overload
    def encode_document(
        self,
        inputs: Sequence[Prompt],
        prompt_name: str | None = ...,
        prompt: str | None = ...,
        *,
        batch_size: int = ...,
        show_progress_bar: bool | None = ...,
        output_value: Literal["sentence_embedding"] = ...,
        precision: Precision | None = ...,
        convert_to_numpy: Literal[False],
        convert_to_tensor: Literal[False] = ...,
        device: str | torch.device | None = ...,
        normalize_embeddings: bool = ...,
        truncate_dim: int | None = ...,
        pool: None = ...,
        chunk_size: int | None = ...,
    ) -> list[torch.Tensor]: ...

    # Catch-all, as sentence-transformers has: union-typed flags, other output values.
    @overload
    def encode_document(
        self,
        inputs: str | Sequence[Prompt] | None = ...,
        prompt_name: str | None = ...,
        prompt: str | None = ...,
        *,
        batch_size: int = ...,
        show_progress_bar: bool | None = ...,
        output_value: OutputValue | None = ...,
        precision: Precision | None = ...,
        convert_to_numpy: bool = ...,
        convert_to_tensor: bool = ...,
        device: str | torch.device | None = ...,
        normalize_embeddings: bool = ...,
        truncate_dim: int | None = ...,
        pool: None = ...,
        chunk_size: int | None = ...,
    ) -> Embeddings: ...

    def encode_document(
        self, inputs: str | Sequence[Prompt] | None = None, prompt_name: str | None = None, prompt: str | None = None,
        **kwargs: Any,
    ) -> Embeddings:
        """``encode`` for documents searched: the model's ``"document"`` prompt (or ``"passage"``/``"corpus"``)
        unless another is given."""
        if prompt_name is None and prompt is None:
            prompt_name = next((name for name in ("document", "passage", "corpus") if name in self.prompts), None)
        return self.encode(inputs, prompt_name=prompt_name, prompt=prompt, **kwargs)

    @contextmanager
    def truncate_embeddings(self, truncate_dim: int | None) -> Iterator[None]:
        """Within the block, ``encode`` keeps the first ``truncate_dim`` dimensions unless told otherwise."""
        previous = self.head.truncate_dim
        self.head.truncate_dim = truncate_dim
        try:
            yield
        finally:
            self.head.truncate_dim = previous

    def truncate_sentence_embeddings(self, truncate_dim: int | None) -> AbstractContextManager[None]:
        """``truncate_embeddings`` (sentence-transformers' older name)."""
        return self.truncate_embeddings(truncate_dim)

    # ---- what a cache does not do ---------------------------------------------------

    start_multi_process_pool = _not_offered("start_multi_process_pool", _POOL)
    stop_multi_process_pool = _not_offered("stop_multi_process_pool", _POOL)
    encode_multi_process = _not_offered("encode_multi_process", _POOL)
    fit = _not_offered("fit", _TRAIN)
    old_fit = _not_offered("old_fit", _TRAIN)
    train = _not_offered("train", _TRAIN)
    save = _not_offered("save", _SAVE)
    save_pretrained = _not_offered("save_pretrained", _SAVE)
    push_to_hub = _not_offered("push_to_hub", _SAVE)
    add_adapter = _not_offered("add_adapter", _TRAIN)
    load_adapter = _not_offered("load_adapter", _TRAIN)
