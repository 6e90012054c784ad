"""How a model turns texts into token rows, and last hidden states into sentence embeddings.

A model folder with a sentence-transformers configuration (``modules.json``) is
served the way sentence-transformers serves it: its own ``preprocess``
tokenizes (prompts, ``max_seq_length`` truncation) and its own modules after
the transformer (pooling mode, Normalize, Dense...) pool, so an ``AttnCache``
gives the vectors ``SentenceTransformer.encode`` gives (a packed forward's rows
reach them end to end where they take that layout: ``pool_rows``). Other
encoders pool by the mean; decoders without one take the PromptEOL prompt and
its last token.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from attnstore.errors import ConfigError
from attnstore_client.call.rows import HiddenRows, last_positions
from attnstore_client.models import LoadedModel

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

# PromptEOL (Jiang et al. 2023): a decoder's last token then summarises the sentence in "one word".
PROMPT_EOL = 'This sentence: "{text}" means in one word:"'
# Rows handed to sentence-transformers' preprocess at once (it pads them to one length). The tokenizer holds each
# text's whole encoding before truncating it: 1,024 texts of 4,000 characters held 250 MB at once, 128 of them 35 MB.
_TOKENIZE_BATCH = 128


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
    truncate_dim: int | None = None  # encode() keeps this many dimensions unless told otherwise

    @abstractmethod
    def tokenize(self, texts: Sequence[str], prompt: str | None) -> tuple[list[list[int]], int]:
        """Each text's token ids (special tokens, prompt and truncation applied), and the prompt's token count."""

    dimension: int  # of the sentence embeddings

    @abstractmethod
    def pool(self, tokens: torch.Tensor, mask: torch.Tensor, prompt_length: int = 0) -> torch.Tensor:
        """Sentence embeddings ``(B, dim)`` of right-padded last hidden states ``(B, P, hidden)``, mask ``(B, P)``."""

    def pool_rows(self, hidden: HiddenRows, prompt_length: int = 0) -> torch.Tensor:
        """Sentence embeddings ``(B, dim)`` of rows as a call holds them (``pool`` on them padded; a head that
        pools rows end to end without padding them says so by overriding this)."""
        return self.pool(*hidden.padded(), prompt_length)

    def embed(self, hidden: Sequence[torch.Tensor], prompt_length: int) -> torch.Tensor:
        """Sentence embeddings ``(n, dim)`` of rows given as ``(L, hidden)`` last hidden states (padded at once:
        for a few rows; a call streams its rows through ``pool`` a forward at a time)."""
        tokens = torch.nn.utils.rnn.pad_sequence(list(hidden), batch_first=True)  # (n, P, hidden)
        lengths = torch.tensor([states.shape[0] for states in hidden], device=tokens.device)
        mask = (torch.arange(tokens.shape[1], device=tokens.device)[None, :] < lengths[:, None]).long()  # (n, P)
        return self.pool(tokens, mask, prompt_length)

    def set_max_length(self, value: int) -> None:
        """Truncate rows to ``value`` tokens from now on.

        Raises:
            ConfigError: ``value`` < 1.
        """
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"max_seq_length must be an int >= 1, got {value!r}")
        self.max_length = value

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
        self.truncate_dim = model.truncate_dim
        self.dimension = int(cast(Any, model).get_embedding_dimension())
        # sentence-transformers' Pooling also pools rows end to end (its layout for unpadded flash-attention
        # batches, ``cu_seq_lens_q``); Normalize and Dense read only the pooled vectors. A pipeline of those pools
        # a packed forward's rows as they come, without padding them first.
        from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling

        self._pools_end_to_end = bool(self._after) and isinstance(self._after[0], Pooling) and all(
            isinstance(module, (Dense, Normalize)) for module in self._after[1:])

    def set_max_length(self, value: int) -> None:
        """See :meth:`SentenceHead.set_max_length`: sentence-transformers' own preprocess truncates there too."""
        super().set_max_length(value)
        self._model.max_seq_length = value

    def resolve_prompt(self, prompt: str | None, prompt_name: str | None) -> str | None:
        """See :meth:`SentenceHead.resolve_prompt`; with neither given, the model's ``default_prompt_name`` applies."""
        if prompt is None and prompt_name is None and self._default_prompt is not None:
            prompt_name = self._default_prompt
        return super().resolve_prompt(prompt, prompt_name)

    def tokenize(self, texts: Sequence[str], prompt: str | None) -> tuple[list[list[int]], int]:
        """See :meth:`SentenceHead.tokenize`: sentence-transformers' own preprocess, a window at a time."""
        rows: list[list[int]] = []
        prompt_length = 0
        for start in range(0, len(texts), _TOKENIZE_BATCH):
            features = self._model.preprocess(list(texts[start : start + _TOKENIZE_BATCH]), prompt=prompt)
            ids, mask = features["input_ids"], features["attention_mask"]  # (n, P) each
            # Each row's tokens are where its mask is: a tokenizer may pad on either side (decoder embedders
            # such as Qwen3-Embedding pad on the left for last-token pooling).
            rows += [row[real.bool()].tolist() for row, real in zip(ids, mask, strict=True)]
            prompt_length = int(features.get("prompt_length") or 0)
        return rows, prompt_length

    def pool(self, tokens: torch.Tensor, mask: torch.Tensor, prompt_length: int = 0) -> torch.Tensor:
        """See :meth:`SentenceHead.pool`: the model's own modules after the transformer."""
        return self._after_transformer({"token_embeddings": tokens, "attention_mask": mask}, prompt_length)

    def pool_rows(self, hidden: HiddenRows, prompt_length: int = 0) -> torch.Tensor:
        """See :meth:`SentenceHead.pool_rows`: rows end to end go to the model's own modules as they are, when
        they are a Pooling and then Normalize or Dense layers."""
        if not (self._pools_end_to_end and hidden.end_to_end):
            return super().pool_rows(hidden, prompt_length)
        features: dict[str, object] = {"token_embeddings": hidden.values[None], "cu_seq_lens_q": hidden.offsets()}
        return self._after_transformer(features, prompt_length)

    def _after_transformer(self, features: dict[str, object], prompt_length: int) -> torch.Tensor:
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
        self.dimension = int(loaded.model.config.hidden_size)

    def tokenize(self, texts: Sequence[str], prompt: str | None) -> tuple[list[list[int]], int]:
        """See :meth:`SentenceHead.tokenize`."""
        rows = [f"{prompt}{text}" for text in texts] if prompt else list(texts)
        ids = self._tokenizer(rows, truncation=True, max_length=self.max_length, add_special_tokens=True)["input_ids"]
        return ids, 0

    def pool(self, tokens: torch.Tensor, mask: torch.Tensor, prompt_length: int = 0) -> torch.Tensor:
        """See :meth:`SentenceHead.pool`: the mean over each row's tokens."""
        weights = mask.to(tokens.dtype)[:, :, None]  # (B, P, 1)
        return (tokens * weights).sum(dim=1) / weights.sum(dim=1)  # (B, hidden)

    def pool_rows(self, hidden: HiddenRows, prompt_length: int = 0) -> torch.Tensor:
        """See :meth:`SentenceHead.pool_rows`: rows end to end are summed where they lie."""
        if not hidden.end_to_end:
            return super().pool_rows(hidden, prompt_length)
        values = hidden.values  # (T, hidden)
        lengths = torch.tensor(hidden.lengths, device=values.device)  # (B,)
        row_of_token = torch.repeat_interleave(torch.arange(hidden.size, device=values.device), lengths)  # (T,)
        sums = values.new_zeros((hidden.size, values.shape[-1])).index_add_(0, row_of_token, values)  # (B, hidden)
        return sums / lengths[:, None].to(values.dtype)


class PromptEolHead(MeanPoolHead):
    """A decoder: each text in the PromptEOL prompt, its last token's hidden state as the embedding."""

    def tokenize(self, texts: Sequence[str], prompt: str | None) -> tuple[list[list[int]], int]:
        """See :meth:`SentenceHead.tokenize`: a ``prompt`` goes before the PromptEOL template."""
        return super().tokenize([PROMPT_EOL.format(text=text) for text in texts], prompt)

    def pool(self, tokens: torch.Tensor, mask: torch.Tensor, prompt_length: int = 0) -> torch.Tensor:
        """See :meth:`SentenceHead.pool`: each row's last token."""
        last = last_positions(mask)  # (B,)
        return tokens[torch.arange(tokens.shape[0], device=tokens.device), last]  # (B, hidden)

    def pool_rows(self, hidden: HiddenRows, prompt_length: int = 0) -> torch.Tensor:
        """See :meth:`SentenceHead.pool_rows`: each row's last token, wherever the rows lie."""
        return torch.stack([hidden.row(r)[-1] for r in range(hidden.size)])  # (B, hidden)


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
