"""A request's inputs turned into token rows held to its limits, before it is queued (TEI's validation step).

Each request is tokenized on its own, as ``SentenceTransformer.encode`` tokenizes
(the model's prompt and truncation), and every row is held to the request's token
limit: cut when the request allows it, else the request is refused with a 400
naming the input. So a refused input refuses its own request only, at once, and
the batcher only ever merges requests that are ready to run: no row of one
request can be taken for another's.

Tokenizing runs on one worker thread of its own (``RequestTokenizer.submit``), off
the event loop and off the batcher's thread: the model's fast tokenizer is not
safe to call from two threads at once, and a long request never holds up a call.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from transformers import PreTrainedTokenizerBase

from attnstore_client.cache import AttnCache
from attnstore_client.call.sources import segment_tokens
from attnstore_client.sentence.cross_encoder import PairTokenizer
from attnstore_node.errors import ApiError, bad_request
from attnstore_node.schema import Activation, Input
from attnstore_node.scoring import SegmentedPrompt
from attnstore_node.tokens import Token

log = logging.getLogger(__name__)
_Result = TypeVar("_Result")


@dataclass(frozen=True, slots=True)
class TokenizedRequest:
    """A request ready to be batched: its token rows, in input order, held to its limits."""

    rows: tuple[tuple[int, ...], ...]
    prompts: tuple[int, ...]  # per row, the prompt tokens its pooling leaves out
    tokens: int  # every row's tokens (``usage.prompt_tokens``)
    labels: tuple[int, ...] | None = None  # a scoring request's label token ids (None: an embedding request)
    softmax: bool = False  # a scoring request's softmax over its labels' logits (else over the vocabulary)
    # Per row, its segments' token counts where its prompt came in segments (``SegmentedPrompt``), else ();
    # () when no row did.
    segments: tuple[tuple[int, ...], ...] = ()
    # A cross-encoder request's rows: their classifier logits (``activation`` None), or those through an activation.
    classify: bool = False
    activation: Activation | None = None
    # Per row, its token types where it is a text pair of a model with token types, else (); () when no row is.
    token_types: tuple[tuple[int, ...], ...] = ()
    all_tokens: bool = False  # ``/embed_all``: every token's embedding, not the pooled one


class RequestTokenizer:
    """Tokenizes one request at a time on a worker thread of its own.

    Args:
        cache: the opened cache, whose model's head tokenizes.
    """

    def __init__(self, cache: AttnCache) -> None:
        self._cache = cache
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="attnstore-node-tokenizer")

    async def submit(self, inputs: Sequence[Input], *, truncate: bool, max_input_tokens: int,
                     prompt_name: str | None = None) -> TokenizedRequest:
        """``inputs`` tokenized on the worker thread (see :meth:`tokenize`).

        Raises:
            ApiError: 400 for an input past the limit (``truncate`` false), 500 when tokenizing fails otherwise.
        """
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._worker, self._or_500, self.tokenize, inputs, truncate,
                                          max_input_tokens, prompt_name)

    async def submit_scoring(self, prompts: Sequence[Input], labels: Sequence[int] | Sequence[str], *, softmax: bool,
                             max_input_tokens: int) -> TokenizedRequest:
        """A scoring request's prompts tokenized on the worker thread (see :meth:`tokenize_scoring`).

        Raises:
            ApiError: 400 for a prompt past the limit or a label word of more than one token; 500 otherwise.
        """
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._worker, self._or_500, self.tokenize_scoring, prompts, labels, softmax,
                                          max_input_tokens)

    async def submit_tokens(self, texts: Sequence[str], *, add_special_tokens: bool,
                            prompt_name: str | None) -> list[list[Token]]:
        """``/tokenize``'s tokens of ``texts`` (see :meth:`tokens`), on the worker thread.

        Raises:
            ApiError: 500 when tokenizing fails.
        """
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._worker, self._or_500, self.tokens, texts, add_special_tokens,
                                          prompt_name)

    async def submit_decode(self, rows: Sequence[Sequence[int]], *, skip_special_tokens: bool) -> list[str]:
        """``rows`` decoded on the worker thread.

        Raises:
            ApiError: 500 when decoding fails.
        """
        tokenizer = self._cache.adapter.loaded.tokenizer
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._worker, self._or_500, partial(
            tokenizer.batch_decode, skip_special_tokens=skip_special_tokens), [list(row) for row in rows])

    async def submit_classify(self, inputs: Sequence[Input | tuple[str, str]], activation: Activation | None, *,
                              truncate: bool, max_input_tokens: int) -> TokenizedRequest:
        """A cross-encoder request's rows tokenized on the worker thread (see :meth:`tokenize_classify`).

        Raises:
            ApiError: 400 for an input past the limit (``truncate`` false); 500 otherwise.
        """
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._worker, self._or_500, self.tokenize_classify, inputs, activation,
                                          truncate, max_input_tokens)

    def close(self) -> None:
        """Stop the worker thread once what was submitted is done."""
        self._worker.shutdown(wait=True)

    def _or_500(self, tokenize: Callable[..., _Result], *args: Any) -> _Result:
        try:
            return tokenize(*args)
        except ApiError:
            raise
        except Exception:
            log.exception("event=tokenize_failed inputs=%d", len(args[0]))
            raise ApiError(500, "the node failed to tokenize this request", "internal_error",
                           type="server_error") from None

    def tokenize_scoring(self, prompts: Sequence[Input], labels: Sequence[int] | Sequence[str], softmax: bool,
                         max_input_tokens: int) -> TokenizedRequest:
        """A scoring request's rows: texts tokenized whole with the tokenizer's special tokens (as SGLang does),
        prompts in segments segment by segment (as the library's ``segment_tokens``, which the chunk tier's
        stored chunks are keyed by), token ids as given; label words turned into their token ids. Never cut: a
        prompt past the limit refuses the request.

        Raises:
            ApiError: 400 ``context_length_exceeded`` for the first prompt past the limit, ``invalid_labels`` for
                a label word that is not exactly one token.
        """
        tokenizer = self._cache.adapter.loaded.tokenizer
        ids = tuple(label_token_ids(tokenizer, labels))
        texts = [prompt for prompt in prompts if isinstance(prompt, str) and not isinstance(prompt, SegmentedPrompt)]
        next_text = iter(tokenizer(texts, add_special_tokens=True)["input_ids"] if texts else [])
        segmented = [prompt.segments for prompt in prompts if isinstance(prompt, SegmentedPrompt)]
        # Not cut there: every row is held to the request's limit below, with the same 400.
        next_segmented = iter(segment_tokens(tokenizer, segmented, max_length=sys.maxsize) if segmented else [])
        limit = min(max_input_tokens, self._cache.head.max_length)
        rows: list[tuple[int, ...]] = []
        segments: list[tuple[int, ...]] = []
        for index, prompt in enumerate(prompts):
            lengths: tuple[int, ...] = ()
            if isinstance(prompt, SegmentedPrompt):
                tokenized = next(next_segmented)
                row, lengths = tuple(tokenized.ids), tokenized.segments
            else:
                row = tuple(next(next_text)) if isinstance(prompt, str) else tuple(prompt)
            if len(row) > limit:
                raise bad_request(f"item {index}'s prompt (query and item) has {len(row)} tokens; the limit is {limit}",
                                  "context_length_exceeded", "items")
            if not row:
                raise bad_request(f"item {index}'s prompt has no tokens", "empty_input", "items")
            rows.append(row)
            segments.append(lengths)
        return TokenizedRequest(tuple(rows), (0,) * len(rows), sum(len(row) for row in rows), ids, softmax,
                                tuple(segments) if segmented else ())

    def tokens(self, texts: Sequence[str], add_special_tokens: bool, prompt_name: str | None) -> list[list[Token]]:
        """Each text's tokens after the model's prompt ``prompt_name`` (None: none), uncut: ids, spans in the text
        (the prompt's included) and whether special, as TEI's ``/tokenize`` shows them."""
        tokenizer = self._cache.adapter.loaded.tokenizer
        prompt = self._cache.head.resolve_prompt(None, prompt_name) if prompt_name is not None else None
        whole = [f"{prompt}{text}" if prompt else text for text in texts]
        encoded = tokenizer(whole, add_special_tokens=add_special_tokens, return_offsets_mapping=True,
                            return_special_tokens_mask=True, verbose=False)
        out: list[list[Token]] = []
        for text, ids, spans, specials in zip(whole, encoded["input_ids"], encoded["offset_mapping"],
                                              encoded["special_tokens_mask"], strict=True):
            row = []
            for token_id, (start, stop), special in zip(ids, spans, specials, strict=True):
                if special:
                    row.append(Token(token_id, str(tokenizer.convert_ids_to_tokens(token_id)), True, None, None))
                else:
                    row.append(Token(token_id, text[start:stop], False, start, stop))
            out.append(row)
        return out

    def tokenize_classify(self, inputs: Sequence[Input | tuple[str, str]], activation: Activation | None,
                          truncate: bool, max_input_tokens: int) -> TokenizedRequest:
        """A cross-encoder request's rows: a pair of texts tokenized as ``CrossEncoder`` tokenizes it (a text pair,
        ``longest_first``, token types where the model's embeddings take them), a text alone, token ids as given;
        each held to the limit (``max_input_tokens``, the model's own first).

        Raises:
            ApiError: 400 ``context_length_exceeded`` for the first input past the limit, ``truncate`` false.
        """
        loaded = self._cache.adapter.loaded
        limit = min(max_input_tokens, self._cache.head.max_length)
        types = int(getattr(loaded.model.config, "type_vocab_size", 0) or 0) > 1
        pairs = [item for item in inputs if isinstance(item, tuple) and item and isinstance(item[0], str)]
        next_pair = iter(PairTokenizer(loaded.tokenizer, limit, token_types=types)(list(pairs)) if pairs else [])
        if pairs and not truncate:
            whole = loaded.tokenizer([p[0] for p in pairs], [p[1] for p in pairs], add_special_tokens=True)
            for index, ids in enumerate(whole["input_ids"]):
                if len(ids) > limit:
                    raise bad_request(f"pair {index} has {len(ids)} tokens; the limit is {limit} (send truncate=true"
                                      " to cut it)", "context_length_exceeded", "inputs")
        rows: list[tuple[int, ...]] = []
        token_types: list[tuple[int, ...]] = []
        for index, item in enumerate(inputs):
            if isinstance(item, tuple) and item and isinstance(item[0], str):
                tokenized = next(next_pair)
                rows.append(tuple(tokenized.ids))
                token_types.append(tuple(tokenized.token_types))
                continue
            single = item if isinstance(item, str) else tuple(int(v) for v in item)
            # Cut by the tokenizer (its special tokens kept) when allowed, else whole: refused past the limit.
            ids = (loaded.tokenizer(single, truncation=truncate, max_length=limit)["input_ids"]
                   if isinstance(single, str) else single)
            rows.append(self._limited(index, single, ids, truncate, max_input_tokens))
            token_types.append(())
        return TokenizedRequest(tuple(rows), (0,) * len(rows), sum(len(row) for row in rows), classify=True,
                                activation=activation,
                                token_types=tuple(token_types) if any(token_types) else ())

    def tokenize(self, inputs: Sequence[Input], truncate: bool, max_input_tokens: int,
                 prompt_name: str | None = None) -> TokenizedRequest:
        """The request's token rows: texts tokenized together, after the prompt ``prompt_name`` names (None: the
        model's default prompt, if any) as ``SentenceTransformer.encode`` does, token ids as given; each held to the
        limit (``max_input_tokens``, the model's own first).

        Raises:
            ApiError: 400 ``context_length_exceeded`` for the first input past the limit, ``truncate`` false.
        """
        head = self._cache.head
        texts = [item for item in inputs if isinstance(item, str)]
        prompt = head.resolve_prompt(None, prompt_name)  # the route checked the name (``ModelInfo.prompts``)
        tokenized, prompt_length = head.tokenize(texts, prompt) if texts else ([], 0)
        next_text = iter(tokenized)  # this request's own texts only
        rows: list[tuple[int, ...]] = []
        prompts: list[int] = []
        for index, item in enumerate(inputs):
            row = next(next_text) if isinstance(item, str) else item
            rows.append(self._limited(index, item, row, truncate, max_input_tokens))
            prompts.append(prompt_length if isinstance(item, str) else 0)
        return TokenizedRequest(tuple(rows), tuple(prompts), sum(len(row) for row in rows))

    def _limited(self, index: int, item: Input, row: Sequence[int], truncate: bool,
                 max_input_tokens: int) -> tuple[int, ...]:
        """``row`` within the request's token limit and the model's: cut if the request allows it, else refused.

        Raises:
            ApiError: 400 ``context_length_exceeded``.
        """
        head = self._cache.head
        limit = min(max_input_tokens, head.max_length)
        length = len(row)
        if isinstance(item, str) and length == head.max_length and not truncate:
            length = len(self._cache.adapter.loaded.tokenizer(item)["input_ids"])  # was it cut by the tokenizer?
        if length <= limit:
            return tuple(row)
        if truncate:
            return tuple(row[:limit])
        raise bad_request(f"input {index} has {length} tokens; the limit is {limit} (send truncate=true to cut it)",
                          "context_length_exceeded", "inputs")


def label_token_ids(tokenizer: PreTrainedTokenizerBase, labels: Sequence[int] | Sequence[str]) -> list[int]:
    """Label token ids as given, or label words each turned into its one token (as ``choices.choice_ids``).

    Raises:
        ApiError: 400 ``invalid_labels`` naming a word that is not exactly one token.
    """
    ids: list[int] = []
    for label in labels:
        if not isinstance(label, str):
            ids.append(label)
            continue
        tokens = tokenizer(label, add_special_tokens=False)["input_ids"]
        if len(tokens) != 1:
            raise bad_request(f"label {label!r} is {len(tokens)} tokens {tokens} of this model's tokenizer; each"
                              " label must be exactly one token (try it with or without a leading space)",
                              "invalid_labels", "labels")
        ids.append(tokens[0])
    return ids
