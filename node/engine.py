"""What answers the embedding routes: an ``Embedder`` (the batcher over ``AttnCache``, or a benchmark's baseline).

The HTTP layer (``app``) validates a request, hands its inputs to the embedder and
awaits the vectors; cancelling that await (the client went away) tells the
embedder it may drop the request's rows. One interface, so that the node and the
baselines of ``attnstore bench node`` share everything but the embedding itself.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from attnstore_node.errors import ApiError
from attnstore_node.schema import Activation, Input, ModelInfo
from attnstore_node.tokens import Token


@dataclass(frozen=True, slots=True)
class Embedded:
    """A request's answer: its vectors in input order and the tokens its inputs held."""

    vectors: np.ndarray  # (n, dim) float32; for a scoring request (n, labels), the label probabilities
    tokens: int  # every input's tokens, special tokens included (``usage.prompt_tokens``)
    rows: tuple[np.ndarray, ...] = ()  # ``/embed_all``'s: per input its token embeddings (L, hidden) float32


class Embedder(ABC):
    """Turns validated inputs into vectors; started and stopped with the server."""

    @property
    @abstractmethod
    def info(self) -> ModelInfo | None:
        """The served model once loaded; None while it loads (``/health`` answers 503 until then)."""

    @property
    def failure(self) -> BaseException | None:
        """Why the embedder could not start (the server exits), or None."""
        return None

    @property
    def fault(self) -> BaseException | None:
        """Why the embedder stopped serving after it started (``/health`` answers 503), or None while it serves."""
        return None

    @abstractmethod
    def start(self) -> None:
        """Begin loading (in the background: the server answers ``/health`` meanwhile)."""

    @abstractmethod
    def stop(self) -> None:
        """Finish what was submitted, then release the model and the store; blocks until done."""

    @abstractmethod
    async def embed(self, inputs: Sequence[Input], *, truncate: bool, max_input_tokens: int,
                    prompt_name: str | None = None) -> Embedded:
        """The vectors of ``inputs``; an input past ``max_input_tokens`` (or the model's limit) is cut when
        ``truncate``, else refused. Texts are encoded after the model's prompt ``prompt_name`` (one of
        ``ModelInfo.prompts``, which the route checked; None: the model's default prompt, if any).

        Raises:
            ApiError: 400 for an input past the limit (``truncate`` false); 500 when preparing or computing this
                request failed (the embedder goes on serving others); 503 while stopping or once it stopped.
            asyncio.CancelledError: the caller cancelled; the request's rows are dropped where not begun.
        """

    async def score(self, prompts: Sequence[Input], labels: Sequence[int] | Sequence[str], *, softmax: bool,
                    max_input_tokens: int) -> Embedded:
        """Each prompt's next-token probabilities of ``labels`` (token ids, or words of one token each) ``(n, k)``:
        a softmax over the labels' logits when ``softmax``, else each label's probability over the vocabulary.

        Raises:
            ApiError: 400 for a prompt past ``max_input_tokens`` (or the model's limit) or a label word of more than
                one token, or when this embedder does not score; 500 and 503 as :meth:`embed`.
            asyncio.CancelledError: as :meth:`embed`.
        """
        raise ApiError(400, f"{type(self).__name__} does not score; this server serves /v1/embeddings",
                       "unsupported_route")

    async def embed_all(self, inputs: Sequence[Input], *, truncate: bool, max_input_tokens: int,
                        prompt_name: str | None = None) -> Embedded:
        """Each input's token embeddings (its last hidden states, ``Embedded.rows``), tokenized as :meth:`embed`
        tokenizes it.

        Raises:
            ApiError: 400 as :meth:`embed`, or when this embedder does not give token embeddings; 500 and 503 as
                :meth:`embed`.
            asyncio.CancelledError: as :meth:`embed`.
        """
        raise ApiError(400, f"{type(self).__name__} does not give token embeddings; this server serves"
                       " /v1/embeddings", "unsupported_route")

    async def classify(self, inputs: Sequence[Input | tuple[str, str]], *, activation: Activation | None,
                       truncate: bool, max_input_tokens: int) -> Embedded:
        """A cross-encoder's scores ``(n, labels)`` of ``inputs`` (text pairs, texts or token ids): its classifier
        logits, through ``activation`` (``tokenization.Activation``; None: the logits).

        Raises:
            ApiError: 400 for an input past the limit (``truncate`` false), or when this embedder does not
                classify; 500 and 503 as :meth:`embed`.
            asyncio.CancelledError: as :meth:`embed`.
        """
        raise ApiError(400, f"{type(self).__name__} does not classify pairs; this server serves /v1/embeddings",
                       "unsupported_route")

    async def tokenize(self, texts: Sequence[str], *, add_special_tokens: bool,
                       prompt_name: str | None = None) -> list[list[Token]]:
        """Each text's tokens as the model's tokenizer makes them, after the prompt ``prompt_name`` names (None:
        none), with their character spans (``tokens``).

        Raises:
            ApiError: 400 when this embedder has no tokenizer to show; 500 and 503 as :meth:`embed`.
        """
        raise ApiError(400, f"{type(self).__name__} does not tokenize for clients", "unsupported_route")

    async def decode(self, rows: Sequence[Sequence[int]], *, skip_special_tokens: bool) -> list[str]:
        """Each row of token ids as text.

        Raises:
            ApiError: 400 when this embedder has no tokenizer to show; 500 and 503 as :meth:`embed`.
        """
        raise ApiError(400, f"{type(self).__name__} does not decode for clients", "unsupported_route")
