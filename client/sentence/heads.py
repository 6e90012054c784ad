"""How a model turns texts into token rows, and last hidden states into sentence embeddings.

A model folder with a sentence-transformers configuration (``modules.json``) is
served the way sentence-transformers serves it: its own ``preprocess``
tokenizes (prompts, ``max_seq_length`` truncation) and its own modules after
the transformer (pooling mode, Normalize, Dense...) pool, so an ``AttnCache``
gives the vectors ``SentenceTransformer.encode`` gives. Other encoders pool by
the mean; decoders without one take the PromptEOL prompt and its last token.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from attnstore.errors import ConfigError
from attnstore_client.models import LoadedModel

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

# PromptEOL (Jiang et al. 2023): a decoder's last token then summarises the sentence in "one word".
PROMPT_EOL = 'This sentence: "{text}" means in one word:"'
# Rows handed to sentence-transformers' preprocess at once (it pads them to one length).
_TOKENIZE_CHUNK = 1024


class SentenceHead(ABC):
    """Texts to token rows, and a model's last hidden states to sentence embeddings.

    Attributes:
        max_length: rows are truncated to this many tokens.
        prompts: named prompts the model defines (``prompt_name`` picks one).
        similarity_fn_name: how the model's embeddings are compared (``"cosine"``...).
    """

    max_length: int
    prompts: dict[str, str]
    similarity_fn_name: str = "cosine"

    @abstractmethod
    def tokenize(self, texts: Sequence[str], prompt: str | None) -> tuple[list[list[int]], int]:
        """Each text's token ids (special tokens, prompt and truncation applied), and the prompt's token count."""

    @abstractmethod
    def embed(self, hidden: Sequence[torch.Tensor], prompt_length: int) -> torch.Tensor:
        """Sentence embeddings ``(n, dim)`` of rows given as ``(L, hidden)`` last hidden states."""

    def resolve_prompt(self, prompt: str | None, prompt_name: str | None) -> str | None:
        """The prompt to use: ``prompt``, else the one named, else the model's default (None: none).

        Raises:
            ConfigError: ``prompt_name`` names no prompt of the model (the valid names are listed).
        """
        if prompt is not None:
            return prompt
        if prompt_name is None:
            return None
        if prompt_name not in self.prompts:
            raise ConfigError(
                f"encode(): prompt_name {prompt_name!r} is not one of this model's prompts {sorted(self.prompts)}"
            )
        return self.prompts[prompt_name]


class TransformersPipelineHead(SentenceHead):
    """A sentence-transformers model: its preprocess before the transformer, its modules after."""

    def __init__(self, model: SentenceTransformer) -> None:
        self._model = model
        self._after = list(model)[1:]  # pooling, normalisation, dense layers: whatever the config lists
        self.max_length = int(model.max_seq_length or model.tokenizer.model_max_length)
        self.prompts = {name: text for name, text in model.prompts.items() if text is not None}
        self.similarity_fn_name = model.similarity_fn_name or "cosine"
        self._default_prompt = model.default_prompt_name

    def resolve_prompt(self, prompt: str | None, prompt_name: str | None) -> str | None:
        """See :meth:`SentenceHead.resolve_prompt`; with neither given, the model's ``default_prompt_name`` applies."""
        if prompt is None and prompt_name is None and self._default_prompt is not None:
            prompt_name = self._default_prompt
        return super().resolve_prompt(prompt, prompt_name)

    def tokenize(self, texts: Sequence[str], prompt: str | None) -> tuple[list[list[int]], int]:
        """See :meth:`SentenceHead.tokenize`: sentence-transformers' own preprocess, a chunk at a time."""
        rows: list[list[int]] = []
        prompt_length = 0
        for start in range(0, len(texts), _TOKENIZE_CHUNK):
            features = self._model.preprocess(list(texts[start : start + _TOKENIZE_CHUNK]), prompt=prompt)
            ids, mask = features["input_ids"], features["attention_mask"]  # (n, P) each
            rows += [row[: int(length)].tolist() for row, length in zip(ids, mask.sum(dim=1), strict=True)]
            prompt_length = int(features.get("prompt_length") or 0)
        return rows, prompt_length

    def embed(self, hidden: Sequence[torch.Tensor], prompt_length: int) -> torch.Tensor:
        """See :meth:`SentenceHead.embed`: the rows padded into one batch and run through the modules."""
        tokens = torch.nn.utils.rnn.pad_sequence(list(hidden), batch_first=True)  # (n, P, hidden)
        mask = torch.zeros(tokens.shape[:2], dtype=torch.long, device=tokens.device)  # (n, P)
        for row, states in enumerate(hidden):
            mask[row, : states.shape[0]] = 1
        features: dict[str, object] = {"token_embeddings": tokens, "attention_mask": mask}
        if prompt_length:
            features["prompt_length"] = prompt_length
        with torch.inference_mode():
            for module in self._after:
                features = module(features)
        embedding = features["sentence_embedding"]
        assert isinstance(embedding, torch.Tensor)  # every sentence-transformers pooling module writes it
        return embedding


class MeanPoolHead(SentenceHead):
    """An encoder without a sentence-transformers configuration: the mean of its last hidden states."""

    def __init__(self, loaded: LoadedModel, max_length: int) -> None:
        self._tokenizer = loaded.tokenizer
        self.max_length = max_length
        self.prompts = {}

    def tokenize(self, texts: Sequence[str], prompt: str | None) -> tuple[list[list[int]], int]:
        """See :meth:`SentenceHead.tokenize`."""
        rows = [f"{prompt}{text}" for text in texts] if prompt else list(texts)
        ids = self._tokenizer(rows, truncation=True, max_length=self.max_length, add_special_tokens=True)["input_ids"]
        return ids, 0

    def embed(self, hidden: Sequence[torch.Tensor], prompt_length: int) -> torch.Tensor:
        """See :meth:`SentenceHead.embed`."""
        return torch.stack([states.mean(dim=0) for states in hidden])  # (n, hidden)


class PromptEolHead(MeanPoolHead):
    """A decoder: each text in the PromptEOL prompt, its last token's hidden state as the embedding."""

    def tokenize(self, texts: Sequence[str], prompt: str | None) -> tuple[list[list[int]], int]:
        """See :meth:`SentenceHead.tokenize`: a ``prompt`` goes before the PromptEOL template."""
        return super().tokenize([PROMPT_EOL.format(text=text) for text in texts], prompt)

    def embed(self, hidden: Sequence[torch.Tensor], prompt_length: int) -> torch.Tensor:
        """See :meth:`SentenceHead.embed`."""
        return torch.stack([states[-1] for states in hidden])  # (n, hidden)


def sentence_head(loaded: LoadedModel, max_length: int | None = None) -> SentenceHead:
    """The head of ``loaded``: its sentence-transformers pipeline when it has one, else by its family.

    Args:
        loaded: the model.
        max_length: a cap on the row length below the model's own (its ``max_seq_length``, or its context).
    """
    if loaded.sentence_transformer is not None:
        head: SentenceHead = TransformersPipelineHead(loaded.sentence_transformer)
        if max_length is not None:
            head.max_length = min(head.max_length, max_length)
            loaded.sentence_transformer.max_seq_length = head.max_length
        return head
    context = _context(loaded)
    limit = context if max_length is None else min(context, max_length)
    return PromptEolHead(loaded, limit) if loaded.lm_head is not None else MeanPoolHead(loaded, limit)


def _context(loaded: LoadedModel) -> int:
    """The model's context (position embeddings), capped by the tokenizer's own limit."""
    limit = getattr(loaded.model.config, "max_position_embeddings", None) or 512
    return int(min(limit, loaded.tokenizer.model_max_length))
