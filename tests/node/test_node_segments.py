"""A decoder node's chunk tier over HTTP (tiny random Llama, an embedded store holding built chunks): ``segments`` on
``/v1/score`` and ``/v1/classify`` are fused by the chunk tier (``rows_total{tier="chunk"}``) into the answers the
Python API's chunk path gives for the same prompts in segments; rows given whole keep the plain forward's answers,
also beside the same tokens in segments; bad segments get a 400 naming the value. A node without ``--chunks``
refuses segments in its router, before anything is queued: shown on the routes around a stand-in scorer (a second
node process would double the file's time, its start being most of it)."""

from __future__ import annotations

import shutil
from collections.abc import Sequence

import httpx
import numpy as np
import pytest
import torch
from starlette.testclient import TestClient
from transformers import LlamaForCausalLM

from attnstore_client.cache import AttnCache
from attnstore_client.call.settings import ChunkSettings
from attnstore_client.choices import label_probabilities
from attnstore_node.app import create_app
from attnstore_node.engine import Embedded, Embedder
from attnstore_node.schema import Input, ModelInfo
from attnstore_tools.build.chunks import ChunkBuildConfig, build_chunks_into
from tests.support.nodes import API_KEY, NodeProcess, save_tiny_llama

AUTH = {"Authorization": f"Bearer {API_KEY}"}
TOLERANCE = 1e-4
INSTRUCTION = "classify the sentiment of each review ."
EXEMPLARS = ["the river was cold and the stone was grey . negative", "good light over the north field . positive",
             "a bad cloud over the hill . negative"]
# The query's segments: the instruction, then the exemplars (the word tokenizer drops the spaces between them, so
# each segment's tokens are those the build stored).
SEGMENTS = [INSTRUCTION, *(f" {exemplar}" for exemplar in EXEMPLARS)]
QUERY = "".join(SEGMENTS)
ITEMS = [" the stone field is good . sentiment", " grey cloud , cold river . sentiment"]
LABELS = ["positive", "negative"]


@pytest.fixture(scope="module")
def decoder(tmp_path_factory: pytest.TempPathFactory):
    """The tiny Llama's folder and the model loaded from it."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    return folder, save_tiny_llama(folder)


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory, decoder):
    """Two copies of a store holding the instruction and exemplars as chunks (as ``attnstore build --chunks``):
    the node's and the reference's (an embedded store is opened by one process at a time)."""
    _, loaded = decoder
    root = tmp_path_factory.mktemp("chunk-stores")
    build_chunks_into(loaded, [segment.strip() for segment in SEGMENTS[1:]], str(root / "node"),
                      ChunkBuildConfig(instruction=INSTRUCTION), progress=False)
    shutil.copytree(root / "node", root / "reference")
    return root


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, decoder, stores):
    folder, _ = decoder
    process = NodeProcess(str(folder), f"local:{stores / 'node'}", tmp_path_factory.mktemp("segment-node"),
                          keys=True, args=("--no-warmup", "--chunks", "--max-wait-ms", "20")).start()
    yield process
    process.kill()


@pytest.fixture(scope="module")
def reference(decoder, stores):
    """The Python API's chunk path on the same stored chunks (the node's defaults: ``ChunkSettings()``)."""
    _, loaded = decoder
    with AttnCache(loaded, f"local:{stores / 'reference'}", chunks=ChunkSettings()) as cache:
        yield cache


def post(node: NodeProcess, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{node.url}{route}", json=body, headers=AUTH, timeout=120)


def chunk_rows(node: NodeProcess) -> float:
    return node.metric('attnstore_node_rows_total{tier="chunk"}')


def label_ids(decoder) -> list[int]:
    return [decoder[1].tokenizer(word, add_special_tokens=False)["input_ids"][0] for word in LABELS]


class _Scorer(Embedder):
    """A decoder without the chunk tier whose every score is 0.5; counts the requests that reach it."""

    def __init__(self) -> None:
        self.scored = 0

    @property
    def info(self) -> ModelInfo:
        return ModelInfo("m", 4, 100, 64, decoder=True, chunks=False)

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    async def embed(self, inputs: Sequence[Input], *, truncate: bool, max_input_tokens: int,
                    prompt_name: str | None = None) -> Embedded:
        raise AssertionError("no embedding route is called here")

    async def score(self, prompts: Sequence[Input], labels: Sequence[int] | Sequence[str], *, softmax: bool,
                    max_input_tokens: int) -> Embedded:
        self.scored += 1
        return Embedded(np.full((len(prompts), len(labels)), 0.5, np.float32), tokens=len(prompts))


def plain_forward(decoder, texts: list[str], labels: list[int]) -> np.ndarray:
    """The plain forward's softmax over ``labels`` after each text (tokenized whole, as the node does)."""
    folder, loaded = decoder
    model = LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for text in texts:
            ids = loaded.tokenizer(text, add_special_tokens=True)["input_ids"]
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]  # (vocab,)
            out.append(torch.softmax(logits[labels], -1))
    return torch.stack(out).numpy()


@pytest.mark.parametrize("softmax", [True, False])
def test_score_segments_are_fused_from_stored_chunks_as_the_python_api_fuses_them(
    node, decoder, reference, softmax,
) -> None:
    labels = label_ids(decoder)
    before = chunk_rows(node)
    with node.counting():
        answer = post(node, "/v1/score", {"query": QUERY, "segments": SEGMENTS, "items": ITEMS,
                                          "label_token_ids": labels, "apply_softmax": softmax})
        assert answer.status_code == 200, answer.text
    assert chunk_rows(node) - before == len(ITEMS)
    states = reference.last_hidden_states([[*SEGMENTS, item] for item in ITEMS])
    assert reference.last_row_kinds == ("chunk",) * len(ITEMS) and reference.last_stats.chunks_captured == 0
    expected = label_probabilities(decoder[1].lm_head, states, labels, over_labels=softmax).numpy()
    assert np.abs(np.array(answer.json()["scores"]) - expected).max() < TOLERANCE


def test_classify_fuses_the_inputs_in_segments_and_computes_the_others_whole(node, decoder, reference) -> None:
    prompt = [*SEGMENTS, ITEMS[0]]
    text = "".join(prompt)
    before = chunk_rows(node)
    # The same text twice: in segments (fused), then whole (the plain forward's answer, never the fused one).
    with node.counting():
        answer = post(node, "/v1/classify", {"input": [text, text], "segments": [prompt, None], "labels": LABELS})
        assert answer.status_code == 200, answer.text
    assert chunk_rows(node) - before == 1
    probs = np.array([row["probs"] for row in answer.json()["data"]])
    fused = reference.score_choices([prompt], choices=LABELS).probabilities
    assert np.abs(probs[0] - fused[0]).max() < TOLERANCE
    assert np.abs(probs[1] - plain_forward(decoder, [text], label_ids(decoder))[0]).max() < TOLERANCE


@pytest.mark.parametrize(("route", "change", "named"), [
    ("/v1/score", {"segments": "a text"}, "'a text'"),
    ("/v1/score", {"segments": [*SEGMENTS[:2], ""]}, "segments[2] must be a non-empty string, got ''"),
    ("/v1/score", {"segments": [SEGMENTS[0], 7]}, "segments[1] must be a non-empty string, got 7"),
    ("/v1/score", {"segments": [INSTRUCTION, " the river was warm"]}, "'warm'"),
    ("/v1/score", {"item_first": True}, "'item_first' false"),
    ("/v1/score", {"query": [5, 6], "items": [[7]]}, "token ids"),
    ("/v1/classify", {"segments": [SEGMENTS]}, "one entry per input (2"),
    ("/v1/classify", {"segments": [[QUERY], None]}, "segments[0] must hold at least two segments"),
    ("/v1/classify", {"segments": [None, [INSTRUCTION, " a hill"]]}, "segments[1] joined must equal input[1]"),
])
def test_bad_segments_are_refused_naming_the_value(node, route, change, named) -> None:
    if route == "/v1/score":
        body = {"query": QUERY, "segments": SEGMENTS, "items": ITEMS, "label_token_ids": [5, 6], **change}
    else:
        body = {"input": [QUERY, QUERY + " more"], "labels": LABELS, **change}
    answer = post(node, route, body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["code"] == "invalid_segments" and error["param"] == "segments"
    assert named in error["message"], error["message"]


def test_a_node_without_chunks_refuses_segments_before_queueing_and_serves_the_request_without_them() -> None:
    scorer = _Scorer()
    with TestClient(create_app(scorer)) as client:
        for route, request in (
            ("/v1/score", {"query": QUERY, "segments": SEGMENTS, "items": ITEMS, "label_token_ids": [5, 6]}),
            ("/v1/classify", {"input": [QUERY], "segments": [SEGMENTS], "labels": LABELS}),
        ):
            scored = scorer.scored
            answer = client.post(route, json=request)
            assert answer.status_code == 400, answer.text
            error = answer.json()["error"]
            assert error["code"] == "unsupported_segments" and error["param"] == "segments"
            assert "--chunks" in error["message"]
            assert scorer.scored == scored
            del request["segments"]
            assert client.post(route, json=request).status_code == 200 and scorer.scored == scored + 1
