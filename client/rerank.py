"""How a decoder reranks: a prompt per (query, document) and the answer tokens whose probabilities score it.

A causal language model reranks as Qwen3-Reranker does (its model card's
``format_instruction``): a fixed system line, the instruction, the query, then
the document, and the next token's probabilities of "yes" against "no"; the
score is ``P(yes)`` of the softmax over those two. Every prompt of one query
starts with the same instruction and query, so a call computes that prefix once
and the prefix tier serves it from the store when it repeats across calls: what
makes a decoder reranker cheap here.
"""

from __future__ import annotations

from dataclasses import dataclass

from attnstore.errors import ConfigError

QWEN3_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
_QWEN3_HEAD = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct"
    ' provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
)
_QWEN3_BODY = "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
_QWEN3_TAIL = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


@dataclass(frozen=True, slots=True)
class RerankTemplate:
    """A decoder reranker's prompt and answer tokens.

    Attributes:
        head: text before the body (a system turn).
        body: the body, with ``{instruction}``, ``{query}`` and ``{document}`` fields, the document last so that
            every prompt of a query shares all that comes before it.
        tail: text after the document, ending where the answer token follows.
        instruction: the instruction put in the body unless a request gives its own.
        labels: the answer words, "no" then "yes": each one token of the model's tokenizer.
    """

    head: str = _QWEN3_HEAD
    body: str = _QWEN3_BODY
    tail: str = _QWEN3_TAIL
    instruction: str = QWEN3_INSTRUCTION
    labels: tuple[str, str] = ("no", "yes")

    def __post_init__(self) -> None:
        for field in ("{instruction}", "{query}", "{document}"):
            if field not in self.body:
                raise ConfigError(f"RerankTemplate.body must hold {field}, got {self.body!r}")
        if not self.body.rstrip().endswith("{document}"):
            raise ConfigError("RerankTemplate.body must end with {document}: what comes before it is the prefix the"
                              f" documents of a query share; got {self.body!r}")

    def prompt(self, query: str, document: str, instruction: str | None = None) -> str:
        """The prompt scoring ``document`` against ``query`` (``instruction``: this template's when None)."""
        text = self.body.format(instruction=self.instruction if instruction is None else instruction, query=query,
                                document=document)
        return f"{self.head}{text}{self.tail}"
